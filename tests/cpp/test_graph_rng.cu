// Dropout captured into CUDA graphs by a raw stream capture (cudaStreamBeginCapture /
// cudaGraphInstantiate / cudaGraphLaunch, no host call of inferctx between replays): every
// replay's mask equals cuRAND's own curand_init + curand_uniform4, run on the host, at the
// (seed, subsequence, offset) graph_rng.hpp gives replay r of site k: (seed, k * 2^36 + i / 4,
// 2^63 + 4 r). Cases named "host: ..." need no GPU; "gpu: ..." cases need a device (without one
// the binary runs the former and exits 77).
#define QUALIFIERS static __forceinline__ __host__ __device__
#include <curand_kernel.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "device_memory.cuh"
#include "inferctx/context.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/dropout.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/graph_rng.hpp"
#include "inferctx/philox.hpp"
#include "inferctx/plan.hpp"
#include "inferctx/stream.hpp"

using namespace inferctx;

namespace {

constexpr int F32 = static_cast<int>(DType::Float32);
constexpr int F16 = static_cast<int>(DType::Float16);
constexpr int BF16 = static_cast<int>(DType::BFloat16);
constexpr int kBits = static_cast<int>(MaskMode::Bits);
constexpr int kBytes = static_cast<int>(MaskMode::Bytes);

using Mask = std::vector<uint32_t>;

// The bit mask of n elements drawn at (seed, subsequence base + i / 4, offset), from cuRAND.
Mask reference_bits(uint64_t seed, uint64_t subsequence_base, uint64_t offset, double p, int64_t n) {
  Mask words(static_cast<size_t>((n + 31) / 32), 0u);
  const float pf = static_cast<float>(p);
  for (int64_t b = 0; b * 4 < n; ++b) {
    curandStatePhilox4_32_10_t s;
    curand_init(seed, subsequence_base + static_cast<uint64_t>(b), offset, &s);
    const float4 u = curand_uniform4(&s);
    const float v[4] = {u.x, u.y, u.z, u.w};
    for (int e = 0; e < 4 && b * 4 + e < n; ++e)
      if (v[e] > pf) words[static_cast<size_t>((b * 4 + e) / 32)] |= 1u << ((b * 4 + e) % 32);
  }
  return words;
}

// The expected mask of replay `replay` of site `site`.
Mask graph_reference(uint64_t seed, uint64_t site, uint64_t replay, double p, int64_t n) {
  return reference_bits(seed, graph_subsequence_base(site), graph_offset(replay), p, n);
}

struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) { INFERCTX_CUDA(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes), -1); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
  void* ptr = nullptr;
};

struct OwnedStream {
  OwnedStream() { INFERCTX_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), -1); }
  ~OwnedStream() { cudaStreamDestroy(s); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  cudaStream_t s = nullptr;
};

// One captured dropout step on its own stream: x -> y with a bit mask, replayable by cudaGraphLaunch.
struct CapturedStep {
  CapturedStep(InferenceContext& ctx, cudaStream_t stream, const void* x, void* y, void* mask, int64_t n, int dtype,
               double p, int mode = kBits)
      : stream(stream) {
    INFERCTX_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), -1);
    try {
      source = ctx.graph_rng().draw(stream, 4);
      dropout_forward(x, y, mask, n, dtype, p, mode, source, stream, ctx.device());
    } catch (...) {
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(stream, &broken);
      if (broken) cudaGraphDestroy(broken);
      cudaGetLastError();
      throw;
    }
    INFERCTX_CUDA(cudaStreamEndCapture(stream, &graph), -1);
    INFERCTX_CUDA(cudaGraphInstantiate(&exec, graph, 0), -1);
  }
  ~CapturedStep() { destroy(); }
  CapturedStep(const CapturedStep&) = delete;
  CapturedStep& operator=(const CapturedStep&) = delete;
  void destroy() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    exec = nullptr;
    graph = nullptr;
  }
  void replay() const { INFERCTX_CUDA(cudaGraphLaunch(exec, stream), -1); }

  cudaStream_t stream;
  PhiloxSource source;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

// Copies the mask of `words` uint32 into slot `index` of a device array of masks, on `stream`.
void keep_mask(const DeviceBuffer& all, int64_t index, const void* mask, int64_t words, cudaStream_t stream) {
  INFERCTX_CUDA(cudaMemcpyAsync(all.as<uint32_t>() + index * words, mask, static_cast<size_t>(words) * 4,
                                cudaMemcpyDeviceToDevice, stream),
                -1);
}

std::vector<Mask> download_masks(const DeviceBuffer& all, int64_t count, int64_t words) {
  std::vector<uint32_t> flat(static_cast<size_t>(count * words));
  INFERCTX_CUDA(cudaMemcpy(flat.data(), all.ptr, flat.size() * 4, cudaMemcpyDeviceToHost), -1);
  std::vector<Mask> out;
  for (int64_t i = 0; i < count; ++i) out.emplace_back(flat.begin() + i * words, flat.begin() + (i + 1) * words);
  return out;
}

GraphRngSlot read_slot(const GraphPhilox& g) {
  GraphRngSlot slot{};
  INFERCTX_CUDA(cudaMemcpy(&slot, g.slot, sizeof(slot), cudaMemcpyDeviceToHost), -1);
  return slot;
}

// Uploads n elements of `dtype` of value 1 (so y is the scale where kept, 0 where dropped).
void fill_ones(void* x, int64_t n, int dtype) {
  const int64_t elem = dtype_size(dtype);
  std::vector<uint8_t> host(static_cast<size_t>(n * elem));
  for (int64_t i = 0; i < n; ++i) {
    if (dtype == F32) {
      const float one = 1.0f;
      std::memcpy(&host[static_cast<size_t>(i * 4)], &one, 4);
    } else {
      const uint16_t one = dtype == F16 ? 0x3c00 : 0x3f80;
      std::memcpy(&host[static_cast<size_t>(i * 2)], &one, 2);
    }
  }
  test_memory::upload(x, host.data(), host.size(), -1);  // landed: the streams here are non-blocking
}

int first_mismatch(const Mask& a, const Mask& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<int>(i);
  return -1;
}

bool check_mask(const char* what, const Mask& got, const Mask& want) {
  const int at = first_mismatch(got, want);
  if (at < 0) return true;
  std::printf("  %s: word %d differs: 0x%08x, expected 0x%08x\n", what, at,
              at < static_cast<int>(got.size()) ? got[static_cast<size_t>(at)] : 0u,
              at < static_cast<int>(want.size()) ? want[static_cast<size_t>(at)] : 0u);
  return false;
}

// Waits (up to 10 s) for the graphs' user objects to be released: their destructors run on a
// CUDA thread, asynchronously.
bool wait_live_sites(InferenceContext& ctx, int64_t expected) {
  for (int i = 0; i < 1000; ++i) {
    if (ctx.graph_rng().stats().live_sites == expected) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace

// ---- host ---------------------------------------------------------------------------------------

TEST_CASE("host: a captured source is checked before anything runs") {
  GraphPhilox bad;  // null state, uid 0
  const PhiloxSource none = PhiloxSource::site(bad);
  void* p = reinterpret_cast<void*>(uintptr_t{4096});
  try {
    dropout_forward(p, p, nullptr, 64, F32, 0.5, 0, none, nullptr);
    CHECK(false);
  } catch (const ConfigError& e) {
    CHECK(e.argument == "site");
  }
  GraphPhilox g;
  g.header = reinterpret_cast<const GraphRngHeader*>(uintptr_t{256});
  g.slot = reinterpret_cast<GraphRngSlot*>(uintptr_t{512});
  g.uid = 1;
  g.step = 6;  // not a multiple of 4
  CHECK_THROWS(ConfigError, dropout_forward(p, p, nullptr, 64, F32, 0.5, 0, PhiloxSource::site(g), nullptr));
  g.step = 4;
  g.site = kGraphSites;
  CHECK_THROWS(ConfigError, dropout_forward(p, p, nullptr, 64, F32, 0.5, 0, PhiloxSource::site(g), nullptr));
  g.site = 0;
  try {
    dropout_forward(p, p, nullptr, kGraphMaxElements + 1, F32, 0.5, 0, PhiloxSource::site(g), nullptr);
    CHECK(false);
  } catch (const ConfigError& e) {
    CHECK(e.argument == "n");
  }
  // A host source keeps the eager rule on offsets.
  CHECK_THROWS(ConfigError, dropout_forward(p, p, nullptr, 64, F32, 0.5, 0, PhiloxSource::host(1, 2), nullptr));
}

TEST_CASE("host: the reference of site k, replay r is cuRAND at (k * 2^36 + i / 4, 2^63 + 4 r)") {
  // By hand: element i of site 2, replay 3 is output i % 4 of the block at subsequence
  // 2 * 2^36 + i / 4 and offset 2^63 + 12 (element 5: output 1 of subsequence 2 * 2^36 + 1).
  // 64 elements, so that a wrong subsequence or offset cannot match by chance (2^-64).
  const Mask m = graph_reference(99, 2, 3, 0.5, 64);
  CHECK_EQ(m.size(), size_t{2});
  int wrong = 0, kept = 0;
  for (uint64_t i = 0; i < 64; ++i) {
    curandStatePhilox4_32_10_t s;
    curand_init(99, (uint64_t{2} << 36) + i / 4, (uint64_t{1} << 63) + 12, &s);
    const float4 u = curand_uniform4(&s);
    const float v[4] = {u.x, u.y, u.z, u.w};
    const uint32_t want = v[i % 4] > 0.5f ? 1u : 0u;
    wrong += ((m[i / 32] >> (i % 32)) & 1u) != want;
    kept += static_cast<int>(want);
  }
  CHECK_EQ(wrong, 0);
  CHECK(kept > 0 && kept < 64);  // both outcomes occur: the bits are no constant
}

// ---- GPU ----------------------------------------------------------------------------------------

TEST_CASE("gpu: an eager draw takes increment_offset; a capturing stream gets a call site") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  ctx->set_seed(5);
  const PhiloxSnapshot before = ctx->philox().snapshot();
  const PhiloxSource e = ctx->graph_rng().draw(st.s, 4);
  CHECK(!e.captured);
  CHECK_EQ(e.seed, uint64_t{5});
  CHECK_EQ(e.offset, uint64_t{0});
  CHECK_EQ(ctx->philox().offset(), uint64_t{4});
  CHECK(!stream_capturing(st.s, 0));
  // Capture requires capturing.
  CHECK_THROWS(ConfigError, ctx->graph_rng().capture(st.s, 4));
  INFERCTX_CUDA(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal), 0);
  CHECK(stream_capturing(st.s, 0));
  const PhiloxSource c = ctx->graph_rng().draw(st.s, 4);
  cudaGraph_t graph = nullptr;
  INFERCTX_CUDA(cudaStreamEndCapture(st.s, &graph), 0);
  CHECK(c.captured);
  CHECK_EQ(c.graph.site, before.sites);
  CHECK_EQ(c.graph.step, uint64_t{4});
  CHECK(c.graph.uid != 0);
  CHECK_EQ(ctx->philox().offset(), uint64_t{4});  // a capture takes no eager offset
  CHECK_EQ(ctx->philox().snapshot().sites, before.sites + 1);
  CHECK(ctx->graph_rng().stats().live_sites >= 1);
  cudaGraphDestroy(graph);  // an empty graph holding a site: destroying it frees the site
}

TEST_CASE("gpu: 200 replays of a raw capture: fresh masks, each cuRAND's at (site, replay), none eager") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  const int64_t n = 5000;  // four whole tiles of fp32 and a scalar tail
  const int64_t words = (n + 31) / 32;
  const double p = 0.3;
  DeviceBuffer x(n * 4), y(n * 4), mask(words * 4);
  fill_ones(x.ptr, n, F32);
  ctx->set_seed(1234, st.s);  // the graphs' header reset, ordered before the replays below
  // An eager draw before and after the graph.
  DeviceBuffer eager(2 * words * 4);
  const std::pair<uint64_t, uint64_t> e0 = ctx->increment_offset(4);
  dropout_forward(x.ptr, y.ptr, mask.ptr, n, F32, p, kBits, e0.first, e0.second, st.s, 0);
  keep_mask(eager, 0, mask.ptr, words, st.s);

  CapturedStep step(*ctx, st.s, x.ptr, y.ptr, mask.ptr, n, F32, p);
  const uint64_t site = step.source.graph.site;
  constexpr int kReplays = 200;
  DeviceBuffer all(kReplays * words * 4);
  for (int r = 0; r < kReplays; ++r) {
    step.replay();
    keep_mask(all, r, mask.ptr, words, st.s);
  }
  const std::pair<uint64_t, uint64_t> e1 = ctx->increment_offset(4);
  dropout_forward(x.ptr, y.ptr, mask.ptr, n, F32, p, kBits, e1.first, e1.second, st.s, 0);
  keep_mask(eager, 1, mask.ptr, words, st.s);
  INFERCTX_CUDA(cudaStreamSynchronize(st.s), 0);

  const std::vector<Mask> got = download_masks(all, kReplays, words);
  const std::vector<Mask> eager_got = download_masks(eager, 2, words);
  CHECK(check_mask("eager before", eager_got[0], reference_bits(1234, 0, 0, p, n)));
  CHECK(check_mask("eager after", eager_got[1], reference_bits(1234, 0, 4, p, n)));
  std::set<Mask> distinct(eager_got.begin(), eager_got.end());
  int wrong = 0;
  for (int r = 0; r < kReplays; ++r) {
    if (!check_mask(("replay " + std::to_string(r)).c_str(), got[r], graph_reference(1234, site, r, p, n))) ++wrong;
    distinct.insert(got[r]);
  }
  CHECK_EQ(wrong, 0);
  CHECK_EQ(distinct.size(), static_cast<size_t>(kReplays + 2));
  // The eager offsets went on from the host counter as if no graph existed.
  CHECK_EQ(e1.second, uint64_t{4});
  // The slot as the last replay left it: 200 replays in this epoch, no arrivals pending.
  const GraphRngSlot slot = read_slot(step.source.graph);
  CHECK_EQ(slot.replays, uint64_t{kReplays});
  CHECK_EQ(slot.uid, step.source.graph.uid);
  CHECK_EQ(slot.arrivals, uint64_t{0});
  CHECK_EQ(slot.epoch, ctx->philox().snapshot().epoch);
}

TEST_CASE("gpu: the last block to read the state advances it, whatever the grid: 1, 7 (capped) or 128 blocks") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  const uint64_t seed = ctx->philox().seed();
  struct Shape {
    int64_t n;
    int max_blocks;
  };
  for (const Shape shape : {Shape{1000, 0}, Shape{int64_t{1} << 20, 7}, Shape{int64_t{1} << 20, 0}}) {
    const int64_t n = shape.n;
    const int64_t words = (n + 31) / 32;
    DeviceBuffer x(n * 4), y(n * 4), mask(words * 4);
    fill_ones(x.ptr, n, F32);
    INFERCTX_CUDA(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal), 0);
    const PhiloxSource src = ctx->graph_rng().draw(st.s, 4);
    dropout_forward(x.ptr, y.ptr, mask.ptr, n, F32, 0.2, kBits, src, st.s, 0, shape.max_blocks);
    cudaGraph_t graph = nullptr;
    INFERCTX_CUDA(cudaStreamEndCapture(st.s, &graph), 0);
    cudaGraphExec_t exec = nullptr;
    INFERCTX_CUDA(cudaGraphInstantiate(&exec, graph, 0), 0);
    DeviceBuffer all(3 * words * 4);
    for (int r = 0; r < 3; ++r) {
      INFERCTX_CUDA(cudaGraphLaunch(exec, st.s), 0);
      keep_mask(all, r, mask.ptr, words, st.s);
    }
    INFERCTX_CUDA(cudaStreamSynchronize(st.s), 0);
    const std::vector<Mask> got = download_masks(all, 3, words);
    for (int r = 0; r < 3; ++r)
      CHECK(check_mask(("n " + std::to_string(n) + ", max_blocks " + std::to_string(shape.max_blocks) +
                        ", replay " + std::to_string(r)).c_str(),
                       got[r], graph_reference(seed, src.graph.site, static_cast<uint64_t>(r), 0.2, n)));
    const GraphRngSlot slot = read_slot(src.graph);
    CHECK_EQ(slot.replays, uint64_t{3});
    CHECK_EQ(slot.arrivals, uint64_t{0});
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

TEST_CASE("gpu: advance_graph_site, the node for kernels that do not advance their site, counts replays") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  INFERCTX_CUDA(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal), 0);
  const GraphPhilox site = ctx->graph_rng().capture(st.s, 9);
  advance_graph_site(site, st.s, 0);
  cudaGraph_t graph = nullptr;
  INFERCTX_CUDA(cudaStreamEndCapture(st.s, &graph), 0);
  CHECK_EQ(site.step, uint64_t{12});
  cudaGraphExec_t exec = nullptr;
  INFERCTX_CUDA(cudaGraphInstantiate(&exec, graph, 0), 0);
  for (int r = 0; r < 4; ++r) INFERCTX_CUDA(cudaGraphLaunch(exec, st.s), 0);
  INFERCTX_CUDA(cudaStreamSynchronize(st.s), 0);
  const GraphRngSlot slot = read_slot(site);
  CHECK_EQ(slot.replays, uint64_t{4});
  CHECK_EQ(slot.uid, site.uid);
  CHECK_EQ(slot.arrivals, uint64_t{0});
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  GraphPhilox bad = site;
  bad.uid = 0;
  CHECK_THROWS(ConfigError, advance_graph_site(bad, st.s, 0));
}

TEST_CASE("gpu: fp16 and bf16 with byte masks and odd sizes, and explicit host values baked in") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  for (int dtype : {F16, BF16}) {
    const int64_t n = 3001;
    DeviceBuffer x(n * 2), y(n * 2), bytes(n);
    fill_ones(x.ptr, n, dtype);
    CapturedStep step(*ctx, st.s, x.ptr, y.ptr, bytes.ptr, n, dtype, 0.6, kBytes);
    const uint64_t seed = ctx->philox().seed();
    for (int r = 0; r < 3; ++r) {
      step.replay();
      std::vector<uint8_t> host(static_cast<size_t>(n));
      INFERCTX_CUDA(cudaStreamSynchronize(st.s), 0);
      INFERCTX_CUDA(cudaMemcpy(host.data(), bytes.ptr, static_cast<size_t>(n), cudaMemcpyDeviceToHost), 0);
      const Mask want = graph_reference(seed, step.source.graph.site, static_cast<uint64_t>(r), 0.6, n);
      int bad = 0;
      for (int64_t i = 0; i < n; ++i)
        if (host[static_cast<size_t>(i)] != ((want[static_cast<size_t>(i / 32)] >> (i % 32)) & 1u)) ++bad;
      CHECK_EQ(bad, 0);
    }
  }
  // seed/offset given: the values are baked into the graph, so every replay draws the same mask.
  const int64_t n = 2048;
  DeviceBuffer x(n * 4), y(n * 4), mask(n / 8);
  fill_ones(x.ptr, n, F32);
  INFERCTX_CUDA(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal), 0);
  dropout_forward(x.ptr, y.ptr, mask.ptr, n, F32, 0.5, kBits, PhiloxSource::host(77, 40), st.s, 0);
  cudaGraph_t graph = nullptr;
  INFERCTX_CUDA(cudaStreamEndCapture(st.s, &graph), 0);
  cudaGraphExec_t exec = nullptr;
  INFERCTX_CUDA(cudaGraphInstantiate(&exec, graph, 0), 0);
  DeviceBuffer all(2 * n / 8);
  for (int r = 0; r < 2; ++r) {
    // Cleared before each replay: a replay that wrote nothing would leave zeros, not the mask.
    INFERCTX_CUDA(cudaMemsetAsync(mask.ptr, 0, static_cast<size_t>(n / 8), st.s), 0);
    INFERCTX_CUDA(cudaGraphLaunch(exec, st.s), 0);
    keep_mask(all, r, mask.ptr, n / 32, st.s);
  }
  INFERCTX_CUDA(cudaStreamSynchronize(st.s), 0);
  const std::vector<Mask> fixed = download_masks(all, 2, n / 32);
  CHECK(reference_bits(77, 0, 40, 0.5, n) != Mask(static_cast<size_t>(n / 32), 0u));
  CHECK(check_mask("fixed state, replay 0", fixed[0], reference_bits(77, 0, 40, 0.5, n)));
  CHECK(check_mask("fixed state, replay 1", fixed[1], reference_bits(77, 0, 40, 0.5, n)));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_CASE("gpu: two graphs replayed interleaved draw disjoint streams; the same sequence again repeats the bits") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  const int64_t n = 4096;
  const int64_t words = n / 32;
  DeviceBuffer x(n * 4), ya(n * 4), yb(n * 4), ma(words * 4), mb(words * 4);
  fill_ones(x.ptr, n, F32);
  CapturedStep a(*ctx, st.s, x.ptr, ya.ptr, ma.ptr, n, F32, 0.5);
  CapturedStep b(*ctx, st.s, x.ptr, yb.ptr, mb.ptr, n, F32, 0.5);
  CHECK_EQ(b.source.graph.site, a.source.graph.site + 1);
  const char order[] = "ABAABBBAAB";
  constexpr int kSteps = sizeof(order) - 1;
  std::vector<Mask> runs[2];
  for (int run = 0; run < 2; ++run) {
    ctx->set_seed(42, st.s);
    DeviceBuffer all(kSteps * words * 4);
    for (int i = 0; i < kSteps; ++i) {
      (order[i] == 'A' ? a : b).replay();
      keep_mask(all, i, order[i] == 'A' ? ma.ptr : mb.ptr, words, st.s);
    }
    INFERCTX_CUDA(cudaStreamSynchronize(st.s), 0);
    runs[run] = download_masks(all, kSteps, words);
    uint64_t replays[2] = {0, 0};
    for (int i = 0; i < kSteps; ++i) {
      const int g = order[i] == 'A' ? 0 : 1;
      const uint64_t site = (g == 0 ? a : b).source.graph.site;
      CHECK(check_mask("interleaved", runs[run][i], graph_reference(42, site, replays[g]++, 0.5, n)));
    }
    std::set<Mask> distinct(runs[run].begin(), runs[run].end());
    CHECK_EQ(distinct.size(), static_cast<size_t>(kSteps));
  }
  CHECK(runs[0] == runs[1]);
}

TEST_CASE("gpu: set_seed restarts every graph at replay 0 with the new seed, in order on its stream") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  const int64_t n = 1024;
  const int64_t words = n / 32;
  DeviceBuffer x(n * 4), y(n * 4), mask(words * 4);
  fill_ones(x.ptr, n, F32);
  ctx->set_seed(7, st.s);
  CapturedStep step(*ctx, st.s, x.ptr, y.ptr, mask.ptr, n, F32, 0.5);
  const uint64_t site = step.source.graph.site;
  DeviceBuffer all(6 * words * 4);
  // No host synchronisation anywhere below: the reset is ordered on the replays' stream.
  for (int r = 0; r < 3; ++r) {
    step.replay();
    keep_mask(all, r, mask.ptr, words, st.s);
  }
  ctx->set_seed(8, st.s);
  for (int r = 3; r < 5; ++r) {
    step.replay();
    keep_mask(all, r, mask.ptr, words, st.s);
  }
  ctx->set_seed(7, st.s);
  step.replay();
  keep_mask(all, 5, mask.ptr, words, st.s);
  INFERCTX_CUDA(cudaStreamSynchronize(st.s), 0);
  const std::vector<Mask> got = download_masks(all, 6, words);
  CHECK(check_mask("seed 7, replay 0", got[0], graph_reference(7, site, 0, 0.5, n)));
  CHECK(check_mask("seed 7, replay 2", got[2], graph_reference(7, site, 2, 0.5, n)));
  CHECK(check_mask("seed 8, replay 0", got[3], graph_reference(8, site, 0, 0.5, n)));
  CHECK(check_mask("seed 8, replay 1", got[4], graph_reference(8, site, 1, 0.5, n)));
  CHECK(check_mask("seed 7 again, replay 0", got[5], got[0]));
  CHECK_EQ(ctx->philox().snapshot().offset, uint64_t{0});
}

TEST_CASE("gpu: set_seed while the context's stream captures is refused and changes nothing") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  ctx->set_seed(3);
  const int64_t n = 1024;
  DeviceBuffer x(n * 4), y(n * 4), mask(n / 8);
  fill_ones(x.ptr, n, F32);
  CapturedStep first(*ctx, st.s, x.ptr, y.ptr, mask.ptr, n, F32, 0.5);  // the device header exists
  const PhiloxSnapshot before = ctx->philox().snapshot();
  INFERCTX_CUDA(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal), 0);
  try {
    ctx->set_seed(9, st.s);
    CHECK(false);
  } catch (const ConfigError& e) {
    CHECK(e.argument == "stream");
    CHECK(std::string(e.what()).find("capturing") != std::string::npos);
  }
  cudaGraph_t graph = nullptr;
  INFERCTX_CUDA(cudaStreamEndCapture(st.s, &graph), 0);  // the capture itself is still valid
  CHECK(graph != nullptr);
  if (graph) cudaGraphDestroy(graph);
  const PhiloxSnapshot after = ctx->philox().snapshot();
  CHECK_EQ(after.seed, before.seed);
  CHECK_EQ(after.epoch, before.epoch);
}

TEST_CASE("gpu: a captured call over the draw limit is refused before it takes a site") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  DeviceBuffer x(1024);  // never read: the call is refused before anything is queued
  const GraphRngStats before = ctx->graph_rng().stats();
  INFERCTX_CUDA(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal), 0);
  try {
    dropout_forward(x.ptr, x.ptr, nullptr, kGraphMaxElements + 1, F32, 0.5, 0, ctx->graph_rng(), st.s, 0);
    CHECK(false);
  } catch (const ConfigError& e) {
    CHECK(e.argument == "n");
  }
  cudaGraph_t graph = nullptr;
  INFERCTX_CUDA(cudaStreamEndCapture(st.s, &graph), 0);  // the capture is still valid
  CHECK(graph != nullptr);
  if (graph) cudaGraphDestroy(graph);
  const GraphRngStats after = ctx->graph_rng().stats();
  CHECK_EQ(after.sites, before.sites);
  CHECK_EQ(after.live_sites, before.live_sites);
}

TEST_CASE("gpu: a destroyed graph gives its slot back; the next site on it starts at replay 0") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  const int64_t n = 1024;
  const int64_t words = n / 32;
  DeviceBuffer x(n * 4), y(n * 4), mask(words * 4);
  fill_ones(x.ptr, n, F32);
  INFERCTX_CUDA(cudaDeviceSynchronize(), 0);
  CHECK(wait_live_sites(*ctx, 0));  // earlier cases' graphs are gone
  const int64_t slots = ctx->graph_rng().stats().slots;
  GraphRngSlot* reused = nullptr;
  {
    CapturedStep old(*ctx, st.s, x.ptr, y.ptr, mask.ptr, n, F32, 0.5);
    for (int r = 0; r < 5; ++r) old.replay();
    INFERCTX_CUDA(cudaStreamSynchronize(st.s), 0);
    CHECK_EQ(ctx->graph_rng().stats().live_sites, int64_t{1});
    reused = old.source.graph.slot;
  }
  CHECK(wait_live_sites(*ctx, 0));
  CapturedStep fresh(*ctx, st.s, x.ptr, y.ptr, mask.ptr, n, F32, 0.5);
  CHECK(fresh.source.graph.slot == reused);  // the slot freed last is taken first
  CHECK_EQ(ctx->graph_rng().stats().slots, slots);
  fresh.replay();
  INFERCTX_CUDA(cudaStreamSynchronize(st.s), 0);
  Mask got(static_cast<size_t>(words));
  INFERCTX_CUDA(cudaMemcpy(got.data(), mask.ptr, static_cast<size_t>(words) * 4, cudaMemcpyDeviceToHost), 0);
  CHECK(check_mask("reused slot, replay 0", got,
                   graph_reference(ctx->philox().seed(), fresh.source.graph.site, 0, 0.5, n)));
}

TEST_CASE("gpu: 4 threads capturing at once (thread-local mode) get unique, gap-free site numbers") {
  auto ctx = InferenceContext::instance(0);
  constexpr int kThreads = 4;
  constexpr int kSites = 300;  // together more than a slab: slabs are added while others capture
  const uint64_t first = ctx->philox().snapshot().sites;
  std::vector<std::vector<uint64_t>> sites(kThreads);
  std::vector<int> failures(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        INFERCTX_CUDA(cudaSetDevice(0), 0);
        OwnedStream st;
        INFERCTX_CUDA(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal), 0);
        for (int i = 0; i < kSites; ++i) sites[t].push_back(ctx->graph_rng().capture(st.s, 4).site);
        cudaGraph_t graph = nullptr;
        INFERCTX_CUDA(cudaStreamEndCapture(st.s, &graph), 0);
        if (graph == nullptr) ++failures[t];
        if (graph) cudaGraphDestroy(graph);
      } catch (const std::exception& e) {
        std::printf("  thread %d: %s\n", t, e.what());
        ++failures[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  std::vector<uint64_t> all;
  for (int t = 0; t < kThreads; ++t) {
    CHECK_EQ(failures[t], 0);
    all.insert(all.end(), sites[t].begin(), sites[t].end());
  }
  std::sort(all.begin(), all.end());
  int bad = 0;
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i] != first + i) ++bad;
  CHECK_EQ(bad, 0);
  CHECK_EQ(all.size(), static_cast<size_t>(kThreads * kSites));
  CHECK(wait_live_sites(*ctx, 0));
}

TEST_CASE("gpu: a graph that outlives its GraphRng (the context's part) replays on from memory its user objects hold") {
  OwnedStream st;
  PhiloxState philox(2718);
  auto rng = std::make_unique<GraphRng>(0, philox);
  const int64_t n = 2048;
  const int64_t words = n / 32;
  DeviceBuffer x(n * 4), y(n * 4), mask(words * 4);
  fill_ones(x.ptr, n, F32);
  INFERCTX_CUDA(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal), 0);
  const PhiloxSource src = rng->draw(st.s, 4);
  dropout_forward(x.ptr, y.ptr, mask.ptr, n, F32, 0.5, kBits, src, st.s, 0);
  cudaGraph_t graph = nullptr;
  INFERCTX_CUDA(cudaStreamEndCapture(st.s, &graph), 0);
  cudaGraphExec_t exec = nullptr;
  INFERCTX_CUDA(cudaGraphInstantiate(&exec, graph, 0), 0);
  CHECK_EQ(src.graph.site, uint64_t{0});  // a fresh state numbers from 0
  DeviceBuffer all(3 * words * 4);
  INFERCTX_CUDA(cudaGraphLaunch(exec, st.s), 0);
  keep_mask(all, 0, mask.ptr, words, st.s);
  INFERCTX_CUDA(cudaStreamSynchronize(st.s), 0);
  rng.reset();  // the owner goes while the graph holds a site: the memory stays
  for (int r = 1; r < 3; ++r) {
    INFERCTX_CUDA(cudaGraphLaunch(exec, st.s), 0);
    keep_mask(all, r, mask.ptr, words, st.s);
  }
  INFERCTX_CUDA(cudaStreamSynchronize(st.s), 0);
  const std::vector<Mask> got = download_masks(all, 3, words);
  for (int r = 0; r < 3; ++r)
    CHECK(check_mask(("after the owner, replay " + std::to_string(r)).c_str(), got[r],
                     graph_reference(2718, 0, static_cast<uint64_t>(r), 0.5, n)));
  // The last holder's destructor takes the bookkeeping (no CUDA call there).
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  INFERCTX_CUDA(cudaDeviceSynchronize(), 0);
}

TEST_CASE("gpu: 1100 sites take a second slab") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  INFERCTX_CUDA(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal), 0);
  for (int i = 0; i < 1100; ++i) ctx->graph_rng().capture(st.s, 4);
  CHECK(ctx->graph_rng().stats().slots >= 2048);
  cudaGraph_t graph = nullptr;
  INFERCTX_CUDA(cudaStreamEndCapture(st.s, &graph), 0);  // allocating under capture kept it valid
  CHECK(graph != nullptr);
  if (graph) cudaGraphDestroy(graph);
  CHECK(wait_live_sites(*ctx, 0));
}

TEST_CASE("gpu: a capturing stream's device is asked without ending the capture; another device's is refused") {
  auto ctx = InferenceContext::instance(0);
  OwnedStream st;
  INFERCTX_CUDA(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal), 0);
  CHECK(stream_is_on_device(st.s, 0));
  CHECK(stream_capturing(st.s, 0));  // still capturing: cudaStreamGetDevice would have ended it
  ctx->graph_rng().capture(st.s, 4);
  cudaGraph_t graph = nullptr;
  INFERCTX_CUDA(cudaStreamEndCapture(st.s, &graph), 0);
  CHECK(graph != nullptr);
  if (graph) cudaGraphDestroy(graph);
  CHECK(stream_is_on_device(cudaStreamLegacy, 0));
  int devices = 0;
  INFERCTX_CUDA(cudaGetDeviceCount(&devices), -1);
  if (devices < 2) return;  // the refusal needs a second device
  cudaStream_t other = nullptr;
  INFERCTX_CUDA(cudaSetDevice(1), 1);
  INFERCTX_CUDA(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), 1);
  INFERCTX_CUDA(cudaStreamBeginCapture(other, cudaStreamCaptureModeGlobal), 1);
  CHECK(!stream_is_on_device(other, 0));
  CHECK(stream_is_on_device(other, 1));
  INFERCTX_CUDA(cudaSetDevice(0), 0);
  const uint64_t sites = ctx->graph_rng().stats().sites;
  CHECK_THROWS(ConfigError, ctx->graph_rng().capture(other, 4));
  CHECK(ctx->graph_rng().stats().sites == sites);  // nothing taken
  INFERCTX_CUDA(cudaSetDevice(1), 1);
  graph = nullptr;
  INFERCTX_CUDA(cudaStreamEndCapture(other, &graph), 1);
  if (graph) cudaGraphDestroy(graph);
  cudaStreamDestroy(other);
  INFERCTX_CUDA(cudaSetDevice(0), 0);
}

int main() { return check::run_all_or_cpu_cases("host:"); }

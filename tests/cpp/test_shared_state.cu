// Shared state of one context read and written from several threads (or streams) at once: the
// released-range check against a release and retake in progress, the GEMM algorithm cache's first
// choice for a problem against an import of it, and the graphs' device header written by set_seed
// calls on two streams.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "inferctx/context.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/gemm.hpp"
#include "inferctx/graph_rng.hpp"
#include "inferctx/memory.hpp"
#include "small_request.hpp"

using namespace inferctx;

namespace {

int kDevice = 0;  // the current device when main() starts

// A non-blocking stream of kDevice for a scope.
struct OwnedStream {
  cudaStream_t s = nullptr;
  OwnedStream() { INFERCTX_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), kDevice); }
  ~OwnedStream() {
    if (cudaStreamDestroy(s) != cudaSuccess) cudaGetLastError();
  }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
};

__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Keeps `stream` busy for about `ms` milliseconds.
void spin(cudaStream_t stream, double ms) {
  int clock_khz = 0;
  INFERCTX_CUDA(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, kDevice), kDevice);
  if (clock_khz <= 0) clock_khz = 2000000;
  spin_kernel<<<1, 1, 0, stream>>>(static_cast<long long>(ms * clock_khz));
  INFERCTX_CUDA(cudaGetLastError(), kDevice);
}

// Both threads of a round start it together: each calls arrive(round) and waits for the other.
// A thread that fails breaks it, so that the other does not wait for it forever.
struct RoundBarrier {
  std::atomic<int64_t> arrived{0};
  std::atomic<bool> broken{false};
  bool arrive(int64_t round) {
    arrived.fetch_add(1, std::memory_order_acq_rel);
    while (arrived.load(std::memory_order_acquire) < 2 * (round + 1)) {
      if (broken.load(std::memory_order_acquire)) return false;
    }
    return true;
  }
  void give_up() { broken.store(true, std::memory_order_release); }
};

}  // namespace

TEST_CASE("gpu: a release and retake in progress never make in_released_range refuse other addresses") {
  auto ctx = InferenceContext::instance(kDevice);
  if (!ctx->addresses_stable()) {
    std::printf("  (skipped: the workspace is a cudaMalloc allocation: %s)\n", ctx->fallback_reason().c_str());
    return;
  }
  ctx->gen_workspace(small_request(64));
  void* inside = ctx->workspace()->data();
  // Far below any reservation: never in the workspace's range, released or not.
  void* outside = reinterpret_cast<void*>(uintptr_t{4096});
  constexpr int kRounds = 300;
  std::atomic<bool> done{false};
  std::atomic<int64_t> spurious{0}, seen_released{0};
  std::string failure;
  std::thread reader([&] {
    while (!done.load(std::memory_order_acquire)) {
      if (ctx->in_released_range(outside, 4096)) spurious.fetch_add(1, std::memory_order_relaxed);
      if (ctx->in_released_range(inside, 1)) seen_released.fetch_add(1, std::memory_order_relaxed);
    }
  });
  try {
    for (int r = 0; r < kRounds; ++r) {
      ctx->release_workspace(false);
      ctx->retake_workspace();
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  done.store(true, std::memory_order_release);
  reader.join();
  if (!failure.empty()) std::printf("  release / retake failed: %s\n", failure.c_str());
  CHECK(failure.empty());
  CHECK_EQ(spurious.load(), int64_t{0});
  std::printf("  (the reader saw the workspace released %lld times)\n", static_cast<long long>(seen_released.load()));
  CHECK(!ctx->released());
  CHECK(!ctx->addresses_released());
  CHECK(!ctx->in_released_range(inside, 1));
  ctx->release_workspace(false);
  CHECK(ctx->addresses_released());
  CHECK(ctx->in_released_range(inside, 1));
  CHECK(!ctx->in_released_range(outside, 4096));
  ctx->retake_workspace();
  CHECK(!ctx->addresses_released());
}

TEST_CASE("gpu: the first gemm of a problem does not replace an import of it made meanwhile") {
  auto ctx = InferenceContext::instance(kDevice);
  clear_gemm_cache();
  constexpr int kRounds = 200;
  constexpr int64_t kBaseRows = 512, kN = 64, kK = 64;
  constexpr double kMarker = 1.25;  // the imported entries' time_ms
  const int64_t rows = kBaseRows + kRounds;
  DeviceAllocation a(kDevice, rows * kK * 2), b(kDevice, kK * kN * 2), c(kDevice, rows * kN * 2);
  INFERCTX_CUDA(cudaMemset(a.data(), 0, static_cast<size_t>(a.size())), kDevice);
  INFERCTX_CUDA(cudaMemset(b.data(), 0, static_cast<size_t>(b.size())), kDevice);
  INFERCTX_CUDA(cudaDeviceSynchronize(), kDevice);
  cudaDeviceProp prop;
  INFERCTX_CUDA(cudaGetDeviceProperties(&prop, kDevice), kDevice);
  const int f16 = static_cast<int>(DType::Float16);

  OwnedStream st;
  RoundBarrier barrier;
  std::string gemm_failure, import_failure;
  int64_t taken = 0;
  std::thread importer([&] {
    try {
      for (int r = 0; r < kRounds; ++r) {
        GemmCacheEntry e;
        e.device = kDevice;
        e.device_name = prop.name;
        e.cublas_version = static_cast<int64_t>(cublasLtGetVersion());
        e.problem = packed_gemm_problem(f16, kBaseRows + r, kN, kK);
        e.align_a = e.align_b = e.align_c = 256;  // cudaMalloc's operands below
        e.backend = static_cast<int>(GemmBackend::Cublas);
        e.time_ms = kMarker;
        if (!barrier.arrive(r)) return;
        taken += import_gemm_cache({e});
      }
    } catch (const std::exception& e) {
      import_failure = e.what();
      barrier.give_up();
    }
  });
  try {
    for (int r = 0; r < kRounds; ++r) {
      const GemmProblem p = packed_gemm_problem(f16, kBaseRows + r, kN, kK);
      if (!barrier.arrive(r)) break;
      gemm(ctx->cublas(), st.s, p, a.data(), b.data(), c.data());
    }
    INFERCTX_CUDA(cudaStreamSynchronize(st.s), kDevice);
  } catch (const std::exception& e) {
    gemm_failure = e.what();
    barrier.give_up();
  }
  importer.join();
  if (!gemm_failure.empty()) std::printf("  gemm failed: %s\n", gemm_failure.c_str());
  if (!import_failure.empty()) std::printf("  import failed: %s\n", import_failure.c_str());
  CHECK(gemm_failure.empty());
  CHECK(import_failure.empty());
  CHECK_EQ(taken, int64_t{kRounds});

  // Every import stands: the gemm's heuristic choice went in only where the key had no entry.
  std::vector<bool> kept(kRounds, false);
  for (const GemmCacheEntry& e : export_gemm_cache(true)) {
    const int64_t r = e.problem.m - kBaseRows;
    if (r >= 0 && r < kRounds && e.problem.n == kN && e.problem.k == kK && e.time_ms == kMarker &&
        e.backend == static_cast<int>(GemmBackend::Cublas)) {
      kept[static_cast<size_t>(r)] = true;
    }
  }
  int64_t lost = 0;
  for (bool k : kept) lost += k ? 0 : 1;
  CHECK_EQ(lost, int64_t{0});
  clear_gemm_cache();
}

TEST_CASE("gpu: set_seed on a busy stream, then on an idle one: the header has the later seed") {
  auto ctx = InferenceContext::instance(kDevice);
  // A captured call site makes the graphs' device header.
  OwnedStream capture;
  INFERCTX_CUDA(cudaStreamBeginCapture(capture.s, cudaStreamCaptureModeGlobal), kDevice);
  GraphPhilox site;
  std::string failure;
  try {
    site = ctx->graph_rng().capture(capture.s, 4);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  cudaGraph_t graph = nullptr;
  INFERCTX_CUDA(cudaStreamEndCapture(capture.s, &graph), kDevice);
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!failure.empty()) std::printf("  capture failed: %s\n", failure.c_str());
  CHECK(failure.empty());
  CHECK(site.header != nullptr);
  if (site.header == nullptr) return;

  OwnedStream busy, idle;
  for (int round = 0; round < 3; ++round) {
    const uint64_t first = 1000 + 2 * static_cast<uint64_t>(round), second = first + 1;
    spin(busy.s, 100.0);
    ctx->set_seed(first, busy.s);  // its header write waits for the spin
    ctx->set_seed(second, idle.s);  // later on the host: it must be the one that stands
    INFERCTX_CUDA(cudaDeviceSynchronize(), kDevice);
    GraphRngHeader h{};
    INFERCTX_CUDA(cudaMemcpy(&h, site.header, sizeof h, cudaMemcpyDeviceToHost), kDevice);
    const PhiloxSnapshot snap = ctx->philox().snapshot();
    CHECK_EQ(snap.seed, second);
    CHECK_EQ(h.seed, second);
    CHECK_EQ(h.epoch, snap.epoch);
  }
}

int main() {
  check::skip_without_gpu();
  INFERCTX_CUDA(cudaGetDevice(&kDevice), -1);
  return check::run_all();
}

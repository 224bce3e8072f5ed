// Release and retake: VirtualAllocation on its own (reserve, map, grow, unmap, contents saved and
// restored, out-of-memory answers), then the context's release_workspace / retake_workspace on
// it: contents kept byte for byte, ordering after work pending on another stream, a CUDA graph
// captured before a release replayed after the retake, gen_workspace on a released workspace.
// The context cases check what each path promises; ctest runs the file twice, the second time as
// test_release_cudamalloc with INFERCTX_DISABLE_VMM=1. The out-of-memory case takes (nearly) all
// device memory for a moment and fails allocations on purpose: run this file alone, not beside
// other GPU work. Under INFERCTX_SANITIZE (tools/gpu-suite runs the sanitizers four executables
// at a time) that case and the multi-GiB one are skipped; they run in the plain ctest pass.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "check.hpp"
#include "device_hog.hpp"
#include "device_memory.cuh"
#include "inferctx/context.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/stream.hpp"
#include "inferctx/vmm.hpp"
#include "pattern.cuh"
#include "small_request.hpp"

using namespace inferctx;

namespace {

using test_memory::Hog;
using test_memory::writable;

int kDevice = 0;  // the current device when main() starts

int64_t free_memory() {
  size_t f = 0, t = 0;
  INFERCTX_CUDA(cudaMemGetInfo(&f, &t), kDevice);
  return static_cast<int64_t>(f);
}

int64_t total_memory() {
  size_t f = 0, t = 0;
  INFERCTX_CUDA(cudaMemGetInfo(&f, &t), kDevice);
  return static_cast<int64_t>(t);
}

bool vmm_device() {
  const std::string why = virtual_memory_unsupported_reason(kDevice);
  if (!why.empty()) std::printf("  (skipped: %s)\n", why.c_str());
  return why.empty();
}

// False, with a note, under the sanitizers: for the cases that take many GiB or all free memory.
bool not_sanitized() {
  if (std::getenv("INFERCTX_SANITIZE") == nullptr) return true;
  std::printf("  note: skipped under INFERCTX_SANITIZE (runs in the plain ctest pass)\n");
  return false;
}

}  // namespace

TEST_CASE("virtual memory management is found on a Volta-or-later device, with a power-of-two granularity") {
  const std::string why = virtual_memory_unsupported_reason(kDevice);
  int major = 0;
  INFERCTX_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, kDevice), kDevice);
  // Every Linux driver that runs CUDA 13 supports it from Volta on: an empty reason there means
  // the entry points were found through the runtime and the attribute read.
  if (major >= 7) CHECK(why.empty());
  if (!why.empty()) std::printf("  (no virtual memory management: %s)\n", why.c_str());
  if (why.empty()) {
    const int64_t g = virtual_memory_granularity(kDevice);
    CHECK(g >= 4096);
    CHECK_EQ(g & (g - 1), int64_t{0});  // a power of two
    CHECK_EQ(VirtualAllocation::kChunkBytes % g, int64_t{0});
    std::printf("  (granularity %lld bytes)\n", static_cast<long long>(g));
  }
}

TEST_CASE("VirtualAllocation: reserve, map, grow, unmap and map again at the same address") {
  if (!vmm_device()) return;
  const int64_t g = virtual_memory_granularity(kDevice);
  Stream s = Stream::create(kDevice);
  VirtualAllocation a(kDevice, 5 * kGiB + 1);
  CHECK_EQ(a.capacity(), 5 * kGiB + g);  // rounded up to the granularity
  CHECK_EQ(a.granularity(), g);
  CHECK(a.data() != nullptr);
  CHECK_EQ(reinterpret_cast<uintptr_t>(a.data()) % static_cast<uintptr_t>(g), uintptr_t{0});
  CHECK_EQ(a.size(), int64_t{0});
  CHECK(!a.accessible());
  CHECK_EQ(a.mapped_bytes(), int64_t{0});
  CHECK_EQ(a.round_up(1), g);
  CHECK_EQ(a.round_up(g), g);
  CHECK_EQ(a.round_up(0), int64_t{0});
  CHECK_THROWS(ConfigError, a.round_up(a.capacity() + 1));
  CHECK_THROWS(ConfigError, a.round_up(-1));
  CHECK_THROWS(WorkspaceStateError, a.grow(g));  // nothing mapped to grow

  void* base = a.data();
  const int64_t free0 = free_memory();
  CHECK(a.map(100 * kMiB + 1, nullptr, 0, nullptr));
  const int64_t first = a.round_up(100 * kMiB + 1);
  CHECK_EQ(a.size(), first);
  CHECK(a.accessible());
  CHECK_EQ(a.mapped_bytes(), first);
  CHECK(free0 - free_memory() >= first - 2 * kMiB);
  CHECK_THROWS(WorkspaceStateError, a.map(g, nullptr, 0, nullptr));  // mapped already
  CHECK(writable(a, s.handle(), 0x3C));

  // Grow to 3 GiB: the first bytes stay where they were, with their contents.
  test_pattern::fill(base, first, 11, s.handle());
  CHECK(a.grow(first / 2));  // smaller: nothing to do
  CHECK_EQ(a.size(), first);
  CHECK(a.grow(3 * kGiB));
  CHECK_EQ(a.size(), 3 * kGiB);
  CHECK(a.data() == base);
  CHECK_EQ(test_pattern::mismatches(base, first, 11, s.handle()), int64_t{0});
  CHECK(writable(a, s.handle(), 0x3D));

  const int64_t held = free_memory();
  a.unmap(nullptr, nullptr);
  CHECK(!a.accessible());
  CHECK_EQ(a.size(), 3 * kGiB);  // kept for the next map
  CHECK_EQ(a.mapped_bytes(), int64_t{0});
  CHECK(free_memory() - held >= 3 * kGiB - 2 * kMiB);
  a.unmap(nullptr, nullptr);  // unmapped already: nothing to do

  CHECK(a.map(a.size(), nullptr, 0, nullptr));
  CHECK(a.data() == base);
  const int64_t remapped = free_memory();
  CHECK(remapped <= held + 2 * kMiB && remapped >= held - 2 * kMiB);
  CHECK(writable(a, s.handle(), 0x3E));
  a.unmap(nullptr, nullptr);
  CHECK(a.map(g, nullptr, 0, nullptr));  // a smaller map after an unmap: size() follows
  CHECK_EQ(a.size(), g);
  CHECK(writable(a, s.handle(), 0x3F));
  CHECK_EQ(static_cast<int>(cudaGetLastError()), static_cast<int>(cudaSuccess));
}

TEST_CASE("VirtualAllocation: contents saved by unmap come back byte for byte with map (4.5 GiB: 3 chunks)") {
  if (!vmm_device() || !not_sanitized()) return;
  Stream s = Stream::create(kDevice);
  const int64_t bytes = 4 * kGiB + kGiB / 2;
  VirtualAllocation a(kDevice, bytes);
  CHECK(a.map(bytes, nullptr, 0, nullptr));
  test_pattern::fill(a.data(), bytes, 77, s.handle());
  INFERCTX_CUDA(cudaStreamSynchronize(s.handle()), kDevice);
  PinnedAllocation host(bytes);
  const int64_t held = free_memory();
  a.unmap(host.data(), s.handle());
  CHECK(!a.accessible());
  CHECK(free_memory() - held >= bytes - 2 * kMiB);
  // The host copy holds the pattern (spot checks across the chunk boundaries).
  const auto* h = static_cast<const unsigned char*>(host.data());
  int wrong = 0;
  for (int64_t i : {int64_t{0}, int64_t{1}, 2 * kGiB - 1, 2 * kGiB, 4 * kGiB + 12345, bytes - 1})
    wrong += h[i] != test_pattern::byte_at(i, 77);
  CHECK_EQ(wrong, 0);
  CHECK(a.map(bytes, host.data(), bytes, s.handle()));
  CHECK_EQ(test_pattern::mismatches(a.data(), bytes, 77, s.handle()), int64_t{0});
  // Only the first restore_bytes come back: the rest is whatever the new memory holds.
  a.unmap(nullptr, nullptr);
  CHECK(a.map(bytes, host.data(), kGiB, s.handle()));
  CHECK_EQ(test_pattern::mismatches(a.data(), kGiB, 77, s.handle()), int64_t{0});
}

TEST_CASE("VirtualAllocation: a map or grow that cannot be had answers false and changes nothing") {
  if (!vmm_device() || !not_sanitized()) return;
  Stream s = Stream::create(kDevice);
  const int64_t bytes = 6 * kGiB;
  VirtualAllocation a(kDevice, total_memory());
  CHECK(a.map(bytes, nullptr, 0, nullptr));
  void* base = a.data();
  test_pattern::fill(base, bytes, 5, s.handle());
  INFERCTX_CUDA(cudaStreamSynchronize(s.handle()), kDevice);
  PinnedAllocation host(bytes);
  {
    // About 4.5 GiB left free.
    Hog hog(4 * kGiB + kGiB / 2);
    const int64_t free_before = free_memory();
    CHECK(free_before < 5 * kGiB && free_before > 4 * kGiB);
    // A grow of more than is free: false, the mapping and its contents as they were.
    CHECK(!a.grow(std::min(a.capacity(), bytes + free_before + 2 * kGiB)));
    CHECK_EQ(a.size(), bytes);
    CHECK(a.accessible());
    CHECK(a.data() == base);
    CHECK(free_memory() >= free_before - 2 * kMiB);  // nothing kept from the failed attempt
    CHECK_EQ(test_pattern::mismatches(base, bytes, 5, s.handle()), int64_t{0});

    // Saved and unmapped, then mapped again with the contents: 2 GiB chunks, two of which fit in
    // the 4.5 GiB left once the hog has the freed 6 GiB too. The third fails; the two are undone
    // after their queued copies.
    a.unmap(host.data(), s.handle());
    Hog more(4 * kGiB + kGiB / 2);
    const int64_t free_now = free_memory();
    CHECK(free_now < 5 * kGiB && free_now > 4 * kGiB);
    CHECK(!a.map(bytes, host.data(), bytes, s.handle()));
    CHECK(!a.accessible());
    CHECK_EQ(a.size(), bytes);
    CHECK(free_memory() >= free_now - 2 * kMiB);
    CHECK_EQ(static_cast<int>(cudaGetLastError()), static_cast<int>(cudaSuccess));
  }
  CHECK(a.map(bytes, host.data(), bytes, s.handle()));
  CHECK(a.data() == base);
  CHECK_EQ(test_pattern::mismatches(base, bytes, 5, s.handle()), int64_t{0});
}

namespace {

// While a workspace is released: `bytes` of device memory taken, written with another pattern and
// given back, so that memory the release freed holds other bytes at the retake (a retake that
// copied nothing back cannot show the old ones).
void overwrite_freed(int64_t bytes, cudaStream_t stream) {
  void* scratch = nullptr;
  INFERCTX_CUDA(cudaMalloc(&scratch, static_cast<size_t>(bytes)), kDevice);
  test_pattern::fill(scratch, bytes, 7777, stream);
  INFERCTX_CUDA(cudaStreamSynchronize(stream), kDevice);
  INFERCTX_CUDA(cudaFree(scratch), kDevice);
}

}  // namespace

TEST_CASE("context: keep_contents gives an 896 MiB workspace back byte for byte; the host copy is reused") {
  auto ctx = InferenceContext::instance(kDevice);
  ctx->release_workspace(false);
  // batch 64, 1024 tokens: activations 320 MiB, KV cache 4 x 16 MiB, attention scores 512 MiB.
  WorkspacePlan p = ctx->gen_workspace(small_request(1024, 64));
  CHECK_EQ(p.workspace_bytes, int64_t{896} * kMiB);
  auto ws = ctx->workspace();
  void* address = ws->data();
  const int64_t size = ws->size();
  if (!ctx->addresses_stable()) ws.reset();  // the cudaMalloc path refuses a release with views
  test_pattern::fill(address, size, 2024, ctx->stream());
  ctx->release_workspace(false, true);
  CHECK(ctx->released());
  CHECK_EQ(ctx->host_copy_bytes(), size);
  overwrite_freed(size, ctx->stream());
  CHECK(ctx->retake_workspace());
  CHECK_EQ(ctx->host_copy_bytes(), size);  // kept for the next release
  auto back = ctx->workspace();
  if (ctx->addresses_stable()) CHECK(back->data() == address);
  CHECK_EQ(test_pattern::mismatches(back->data(), size, 2024, ctx->stream()), int64_t{0});

  // A second round reuses the host copy; a release without keep_contents frees it, and a retake
  // after it does not restore anything.
  test_pattern::fill(back->data(), size, 2025, ctx->stream());
  if (!ctx->addresses_stable()) back.reset();
  ctx->release_workspace(false, true);
  CHECK_EQ(ctx->host_copy_bytes(), size);
  overwrite_freed(size, ctx->stream());
  CHECK(ctx->retake_workspace());
  CHECK_EQ(test_pattern::mismatches(ctx->workspace()->data(), size, 2025, ctx->stream()), int64_t{0});
  ws.reset();
  back.reset();
  ctx->release_workspace(false);
  CHECK_EQ(ctx->host_copy_bytes(), int64_t{0});
  CHECK(ctx->retake_workspace());
  ctx->release_workspace(false);
}

TEST_CASE("context: release waits for a kernel pending on another stream, and keeps what it wrote") {
  auto ctx = InferenceContext::instance(kDevice);
  WorkspacePlan p = ctx->gen_workspace(small_request(1024, 16));  // 224 MiB
  Stream side = Stream::create(kDevice);
  void* address = nullptr;
  int64_t size = 0;
  {
    auto ws = ctx->workspace();
    address = ws->data();
    size = ws->size();
    INFERCTX_CUDA(cudaMemsetAsync(address, 0, static_cast<size_t>(size), ctx->stream()), kDevice);
    INFERCTX_CUDA(cudaStreamSynchronize(ctx->stream()), kDevice);
    // 200 ms of spinning on a stream the context knows nothing of, then the pattern.
    test_pattern::fill(address, size, 99, side.handle(), 200ull * 1000 * 1000);
  }
  ctx->release_workspace(false, true);
  CHECK(cudaStreamQuery(side.handle()) == cudaSuccess);  // the release waited for it
  CHECK(ctx->retake_workspace());
  CHECK_EQ(test_pattern::mismatches(ctx->workspace()->data(), size, 99, ctx->stream()), int64_t{0});
  if (ctx->addresses_stable()) CHECK(ctx->workspace()->data() == address);
  CHECK_EQ(p.workspace_bytes, size);
  ctx->release_workspace(false);
}

TEST_CASE("context: a CUDA graph captured before a release replays into the workspace after the retake") {
  auto ctx = InferenceContext::instance(kDevice);
  ctx->gen_workspace(small_request(1024, 16));
  if (!ctx->addresses_stable()) {
    std::printf("  (cudaMalloc fallback: a graph must be captured again after a retake)\n");
    ctx->release_workspace(false);
    return;
  }
  Stream s = Stream::create(kDevice);
  auto ws = ctx->workspace();
  void* address = ws->data();
  const int64_t size = ws->size();
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  INFERCTX_CUDA(cudaStreamBeginCapture(s.handle(), cudaStreamCaptureModeThreadLocal), kDevice);
  test_pattern::fill(address, size, 4242, s.handle());
  INFERCTX_CUDA(cudaStreamEndCapture(s.handle(), &graph), kDevice);
  INFERCTX_CUDA(cudaGraphInstantiate(&exec, graph, 0), kDevice);
  for (int round = 0; round < 3; ++round) {
    ctx->release_workspace(false);
    CHECK(!ws->accessible());
    CHECK(ctx->retake_workspace());
    CHECK(ws->accessible());
    INFERCTX_CUDA(cudaMemsetAsync(address, 0, static_cast<size_t>(size), s.handle()), kDevice);
    INFERCTX_CUDA(cudaGraphLaunch(exec, s.handle()), kDevice);
    CHECK_EQ(test_pattern::mismatches(address, size, 4242, s.handle()), int64_t{0});
  }
  INFERCTX_CUDA(cudaGraphExecDestroy(exec), kDevice);
  INFERCTX_CUDA(cudaGraphDestroy(graph), kDevice);
  CHECK_EQ(static_cast<int>(cudaGetLastError()), static_cast<int>(cudaSuccess));
  ws.reset();
  ctx->release_workspace(false);
}

TEST_CASE("context: gen_workspace on a released workspace, with and without views or kept contents") {
  auto ctx = InferenceContext::instance(kDevice);
  ctx->release_workspace(false);
  WorkspacePlan big = ctx->gen_workspace(small_request(1024, 16));  // 224 MiB
  if (!ctx->addresses_stable()) {
    // Under cudaMalloc a released workspace has nothing to come back to but kept contents: a new
    // plan gets a new allocation, with the kept bytes copied into it as far as it reaches.
    test_pattern::fill(ctx->workspace()->data(), big.workspace_bytes, 8, ctx->stream());
    ctx->release_workspace(false, true);
    WorkspacePlan small = ctx->gen_workspace(small_request(16, 1));
    CHECK(!ctx->released());
    CHECK_EQ(test_pattern::mismatches(ctx->workspace()->data(), small.workspace_bytes, 8, ctx->stream()),
             int64_t{0});
    ctx->release_workspace(false);
    return;
  }
  auto view = ctx->workspace();
  void* address = view->data();
  test_pattern::fill(address, big.workspace_bytes, 9, ctx->stream());

  // A view alive and the contents kept: the workspace comes back whole (as a retake would),
  // contents and all, though the new plan is smaller.
  ctx->release_workspace(false, true);
  WorkspacePlan small = ctx->gen_workspace(small_request(16, 1));
  CHECK(!ctx->released());
  CHECK(ctx->workspace() == view);
  CHECK_EQ(view->size(), big.workspace_bytes);
  CHECK_EQ(ctx->workspace_bytes(), small.workspace_bytes);
  CHECK_EQ(test_pattern::mismatches(address, big.workspace_bytes, 9, ctx->stream()), int64_t{0});

  // A view alive, contents not kept: whole again (the view spans it), at the same address.
  ctx->release_workspace(false);
  ctx->gen_workspace(small_request(16, 1));
  CHECK_EQ(view->size(), big.workspace_bytes);
  CHECK(view->accessible());
  CHECK(writable(*view, ctx->stream(), 0x91));

  // No view and nothing kept: only the new plan's bytes come back, still at the same address.
  view.reset();
  ctx->release_workspace(false);
  const int64_t before = free_memory();
  WorkspacePlan again = ctx->gen_workspace(small_request(16, 1));
  CHECK_EQ(ctx->held_bytes(), again.workspace_bytes);
  CHECK(before - free_memory() <= again.workspace_bytes + 2 * kMiB);
  CHECK(ctx->workspace()->data() == address);
  CHECK(writable(*ctx->workspace(), ctx->stream(), 0x92));
  ctx->release_workspace(false);
}

int main() {
  check::skip_without_gpu();
  INFERCTX_CUDA(cudaGetDevice(&kDevice), -1);
  return check::run_all();
}

// Allocation failures on a GPU: a failed cudaMalloc, retake_workspace without room, and a
// regrow that only fits once the old workspace is freed (or, under CUDA virtual memory, grows in
// place). These take (nearly) all device memory for a moment, so they are a file of their own:
// run it alone, not beside other GPU work, and under compute-sanitizer with --report-api-errors
// no (the failed allocations are the point). ctest runs it twice, the second time as
// test_context_oom_cudamalloc with INFERCTX_DISABLE_VMM=1.
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
#include "pattern.cuh"
#include "inferctx/context.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "small_request.hpp"

using namespace inferctx;

namespace {

using test_memory::Hog;
using test_memory::writable;

int kDevice = 0;  // the current device when main() starts

// True under tools/gpu-suite's sanitizer runs, which take device memory of their own meanwhile.
bool sanitized() { return std::getenv("INFERCTX_SANITIZE") != nullptr; }

int64_t free_memory() {
  size_t f = 0, t = 0;
  INFERCTX_CUDA(cudaMemGetInfo(&f, &t), kDevice);
  return static_cast<int64_t>(f);
}

}  // namespace

TEST_CASE("a cudaMalloc that cannot succeed: CudaError with call, code, device; state cleared") {
  try {
    DeviceAllocation huge(kDevice, int64_t{1} << 52);
    CHECK(false);
  } catch (const CudaError& e) {
    CHECK_EQ(e.code, static_cast<int>(cudaErrorMemoryAllocation));
    CHECK(e.code_name == "cudaErrorMemoryAllocation");
    CHECK(e.call.find("cudaMalloc") != std::string::npos);
    CHECK_EQ(e.device, kDevice);
    CHECK(std::string(e.what()).find("device " + std::to_string(kDevice)) != std::string::npos);
  }
  CHECK_EQ(static_cast<int>(cudaGetLastError()), static_cast<int>(cudaSuccess));
  DeviceAllocation after(kDevice, 1024);
  CHECK(after.data() != nullptr);
}

TEST_CASE("retake without room: WorkspaceOOMError, the context stays released, kept contents survive") {
  auto ctx = InferenceContext::instance(kDevice);
  WorkspacePlan p = ctx->gen_workspace(small_request(1024, 16));
  CHECK_EQ(p.workspace_bytes, int64_t{224} << 20);
  std::shared_ptr<DeviceAllocation> view = ctx->workspace();
  void* address = view->data();
  const int64_t size = view->size();
  test_pattern::fill(address, size, 1401, ctx->stream());
  // Under virtual memory the view may stay through the release; under cudaMalloc it must go.
  if (!ctx->addresses_stable()) view.reset();
  ctx->release_workspace(false, true);
  CHECK(ctx->released());
  CHECK_EQ(ctx->host_copy_bytes(), size);
  {
    Hog hog(int64_t{64} << 20);
    CHECK(free_memory() < p.workspace_bytes);
    try {
      ctx->retake_workspace();
      CHECK(false);
    } catch (const WorkspaceOOMError& e) {
      CHECK_EQ(e.requested_bytes, ctx->addresses_stable() ? size : p.workspace_bytes);
      CHECK(e.free_bytes < e.requested_bytes);
      CHECK(std::string(e.what()).find("stays released") != std::string::npos);
      CHECK(std::string(e.what()).find("host memory") != std::string::npos);
    }
    CHECK(ctx->released());
    CHECK_THROWS(WorkspaceStateError, ctx->workspace());
    CHECK_EQ(ctx->plan().workspace_bytes, p.workspace_bytes);
    CHECK_EQ(ctx->held_bytes(), int64_t{0});
    CHECK_EQ(ctx->host_copy_bytes(), size);
    if (ctx->addresses_stable()) {
      CHECK(!view->accessible());
      CHECK(ctx->in_released_range(address, 1));
      CHECK_EQ(ctx->views_alive(), int64_t{1});
    }
    // A new plan cannot be had either, and that too leaves the context as it was.
    CHECK_THROWS(WorkspaceOOMError, ctx->gen_workspace(small_request(1024, 16)));
    CHECK(ctx->released());
    CHECK_EQ(ctx->plan().workspace_bytes, p.workspace_bytes);
    CHECK_EQ(static_cast<int>(cudaGetLastError()), static_cast<int>(cudaSuccess));
  }
  CHECK(ctx->retake_workspace());
  CHECK(!ctx->released());
  CHECK_EQ(ctx->held_bytes(), ctx->addresses_stable() ? size : p.workspace_bytes);
  if (ctx->addresses_stable()) {
    CHECK(ctx->workspace() == view);
    CHECK(view->accessible());
    CHECK(!ctx->in_released_range(address, 1));
  }
  // The bytes kept through the failed retake are all back.
  CHECK_EQ(test_pattern::mismatches(ctx->workspace()->data(), p.workspace_bytes, 1401, ctx->stream()), int64_t{0});
  CHECK(writable(*ctx->workspace(), ctx->stream(), 0x61));
  view.reset();
  ctx->release_workspace(false);  // without keep_contents: the host copy goes too
  CHECK_EQ(ctx->host_copy_bytes(), int64_t{0});
  CHECK(ctx->retake_workspace());
}

TEST_CASE("a regrow that fits only in place of the old workspace: freed first, or restored") {
  auto ctx = InferenceContext::instance(kDevice);
  WorkspacePlan old_plan = ctx->gen_workspace(small_request(1024, 16));
  const int64_t old_bytes = old_plan.workspace_bytes;
  CHECK_EQ(ctx->views_alive(), int64_t{0});

  // A small reserve (128 MiB, less than the old 224 MiB) and a max_out_tokens that cannot fit:
  // the plan takes all free memory but the reserve, counting the old workspace, to within one
  // token (about 2 MiB here). So it cannot be allocated beside the old workspace, only in its
  // place. The reserve is not 0: the driver needs device memory of its own to map that much
  // (on an H100 a plan of every free byte failed to map for want of it).
  PlanRequest r;
  r.shape = {1, 1, 128, 1};
  r.batch_size = 1;
  r.prompt_len = 1;
  r.max_out_tokens = int64_t{1} << 20;
  r.min_out_tokens = 1;
  r.dtype = static_cast<int>(DType::Float16);
  r.has_reserve = true;
  r.reserve_bytes = int64_t{128} << 20;
  const int64_t free_before = free_memory();
  void* old_address = ctx->workspace()->data();
  try {
    WorkspacePlan big = ctx->gen_workspace(r);
    std::printf("  (path taken: %s, %lld bytes in all)\n",
                ctx->addresses_stable() ? "grown in place" : "the old workspace was freed, then allocated",
                static_cast<long long>(big.workspace_bytes));
    CHECK(big.bound_by == "memory");
    CHECK(big.request.free_bytes >= free_before + old_bytes - (int64_t{8} << 20));
    CHECK(big.workspace_bytes > free_before);  // only possible without the old workspace
    CHECK(big.workspace_bytes <= big.request.free_bytes - r.reserve_bytes);
    CHECK(!ctx->released());
    CHECK_EQ(ctx->workspace()->size(), big.workspace_bytes);
    if (ctx->addresses_stable()) CHECK(ctx->workspace()->data() == old_address);
    CHECK(writable(*ctx->workspace(), ctx->stream(), 0x71));
  } catch (const WorkspaceOOMError& e) {
    std::printf("  (path taken: the allocation failed after freeing the old workspace: %s)\n", e.what());
    // Only the cudaMalloc path frees the old workspace first and may then fail: under virtual
    // memory the plan counts the mapped workspace as free and grows it in place, within what was
    // free when it was planned less the reserve. The sanitizers (INFERCTX_SANITIZE, four
    // executables at a time, initcheck's shadow of every allocation) take memory meanwhile; there
    // a failure may come, but it never costs the old workspace.
    CHECK(!ctx->addresses_stable() || sanitized());
    if (ctx->addresses_stable()) CHECK(!ctx->released());
    CHECK(e.requested_bytes > free_before);
    CHECK(ctx->has_plan());
    CHECK_EQ(ctx->plan().workspace_bytes, old_bytes);
    CHECK_EQ(ctx->max_token_length(), old_plan.max_tokens);
    if (ctx->released()) {
      // Restoring failed too (memory taken meanwhile); the plan is kept for a retake.
      CHECK(ctx->retake_workspace());
    }
    CHECK_EQ(ctx->workspace()->size(), old_bytes);
    if (ctx->addresses_stable()) CHECK(ctx->workspace()->data() == old_address);
    CHECK(writable(*ctx->workspace(), ctx->stream(), 0x72));
  }
  CHECK_EQ(static_cast<int>(cudaGetLastError()), static_cast<int>(cudaSuccess));

  // Give the memory back and check that the context is usable with a small plan again.
  ctx->release_workspace(false);
  WorkspacePlan small = ctx->gen_workspace(small_request(1024, 16));
  CHECK_EQ(small.workspace_bytes, old_bytes);
  CHECK(writable(*ctx->workspace(), ctx->stream(), 0x73));
}

TEST_CASE("with a view alive: grown in place (virtual memory), or OOM with the previous plan kept") {
  auto ctx = InferenceContext::instance(kDevice);
  ctx->release_workspace(false);
  WorkspacePlan old_plan = ctx->gen_workspace(small_request(1024, 16));
  auto view = ctx->workspace();
  // Under cudaMalloc, with a view alive the planner no longer counts the old workspace as free,
  // so the request below plans within the memory beside it; the allocation then either fits or
  // fails, and a failure must leave the old plan and allocation in place. Under virtual memory
  // the mapped workspace counts as free, views or not, and the plan grows it in place (the
  // 128 MiB reserve leaves the driver room to map it).
  PlanRequest r;
  r.shape = {1, 1, 128, 1};
  r.max_out_tokens = int64_t{1} << 20;
  r.dtype = static_cast<int>(DType::Float16);
  r.has_reserve = true;
  r.reserve_bytes = int64_t{128} << 20;
  const int64_t free_before = free_memory();
  try {
    WorkspacePlan big = ctx->gen_workspace(r);
    std::printf("  (the plan with a view alive fitted: %lld bytes)\n", static_cast<long long>(big.workspace_bytes));
    if (ctx->addresses_stable()) {
      CHECK(ctx->workspace() == view);
      CHECK(big.workspace_bytes > free_before);  // the memory under the view was counted
      CHECK_EQ(view->size(), big.workspace_bytes);
    } else {
      CHECK(ctx->workspace() != view);
      CHECK_EQ(view.use_count(), long{1});
    }
  } catch (const WorkspaceOOMError& e) {
    std::printf("  (the plan with a view alive failed: %s)\n", e.what());
    // Under virtual memory the plan counted the mapped workspace as free and grows it in place:
    // a view alive is no reason to fail there (but memory the sanitizers take meanwhile is).
    CHECK(!ctx->addresses_stable() || sanitized());
    CHECK(ctx->workspace() == view);
    CHECK_EQ(ctx->plan().workspace_bytes, old_plan.workspace_bytes);
    if (!ctx->addresses_stable()) CHECK(std::string(e.what()).find("view") != std::string::npos);
  }
  CHECK(writable(*view, ctx->stream(), 0x81));
  view.reset();
  ctx->release_workspace(false);
}

int main() {
  check::skip_without_gpu();
  INFERCTX_CUDA(cudaGetDevice(&kDevice), -1);
  return check::run_all();
}

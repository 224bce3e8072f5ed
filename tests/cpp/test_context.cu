// InferenceContext on a GPU: one per device, workspace allocation (grow, reuse, release,
// retake, a failing request), views, tokens, Philox, cuBLAS, and stream ordering by events.
// The cases share the process's context of the current device and run in file order.
// Deliberate allocation failures live in test_context_oom.cu, so that this file runs clean
// under compute-sanitizer with its default reporting of CUDA API errors.
// ctest runs this file twice: as is (CUDA virtual memory where the device has it) and as
// test_context_cudamalloc with INFERCTX_DISABLE_VMM=1; the workspace cases check what each path
// promises (addresses_stable() says which is in force).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "device_memory.cuh"
#include "inferctx/context.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "small_request.hpp"

using namespace inferctx;

namespace {

using test_memory::writable;

int kDevice = 0;  // the current device when main() starts

int64_t small_bytes(int64_t t) { return 10 * 4 * 64 * t * 2 + 4 * (2 * t * 64 * 2) + 4 * t * t * 2; }

// What the exact policy plans for `bytes` of layout: whole granules under virtual memory.
int64_t granules(const InferenceContext& ctx, int64_t bytes) {
  const int64_t g = ctx.allocation_granularity();
  return g > 1 ? (bytes + g - 1) / g * g : bytes;
}

int64_t free_memory() {
  size_t f = 0, t = 0;
  INFERCTX_CUDA(cudaMemGetInfo(&f, &t), kDevice);
  return static_cast<int64_t>(f);
}

__device__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits `spin_ns` before writing, so that a consumer that does not wait reads stale values.
__global__ void slow_fill(int* data, int n, int value, unsigned long long spin_ns) {
  const unsigned long long start = global_ns();
  while (global_ns() - start < spin_ns) {
  }
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) data[i] = value;
}

__global__ void copy_ints(const int* src, int* dst, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}

std::vector<unsigned char> bytes_of(const DeviceAllocation& a, int64_t n, cudaStream_t s) {
  std::vector<unsigned char> host(static_cast<size_t>(n));
  INFERCTX_CUDA(cudaMemcpyAsync(host.data(), a.data(), static_cast<size_t>(n), cudaMemcpyDeviceToHost, s), kDevice);
  INFERCTX_CUDA(cudaStreamSynchronize(s), kDevice);
  return host;
}

std::vector<int> ints_of(const DeviceAllocation& a, int n, cudaStream_t s) {
  std::vector<int> host(static_cast<size_t>(n));
  INFERCTX_CUDA(cudaMemcpyAsync(host.data(), a.data(), sizeof(int) * n, cudaMemcpyDeviceToHost, s), kDevice);
  INFERCTX_CUDA(cudaStreamSynchronize(s), kDevice);
  return host;
}

int count_not(const std::vector<int>& v, int value) {
  int bad = 0;
  for (int x : v) bad += x != value;
  return bad;
}

// `producer` writes `value` late; `consumer` copies what it sees after `order()` ran.
// Returns how many copied elements are not `value`.
template <class Order>
int stale_after(cudaStream_t producer, cudaStream_t consumer, int value, Order order) {
  constexpr int n = 1 << 16;
  DeviceAllocation data(kDevice, sizeof(int) * n), seen(kDevice, sizeof(int) * n);
  INFERCTX_CUDA(cudaMemsetAsync(data.data(), 0, sizeof(int) * n, producer), kDevice);
  INFERCTX_CUDA(cudaMemsetAsync(seen.data(), 0, sizeof(int) * n, consumer), kDevice);
  INFERCTX_CUDA(cudaStreamSynchronize(producer), kDevice);
  INFERCTX_CUDA(cudaStreamSynchronize(consumer), kDevice);
  slow_fill<<<64, 256, 0, producer>>>(static_cast<int*>(data.data()), n, value, 50ull * 1000 * 1000);
  INFERCTX_CUDA(cudaGetLastError(), kDevice);
  order();
  copy_ints<<<64, 256, 0, consumer>>>(static_cast<const int*>(data.data()), static_cast<int*>(seen.data()), n);
  INFERCTX_CUDA(cudaGetLastError(), kDevice);
  const int bad = count_not(ints_of(seen, n, consumer), value);
  // Both allocations are freed below; the producer must be done with `data` by then.
  INFERCTX_CUDA(cudaStreamSynchronize(producer), kDevice);
  return bad;
}

}  // namespace

TEST_CASE("instance: one context per device, created once under contention") {
  int count = 0;
  INFERCTX_CUDA(cudaGetDeviceCount(&count), -1);
  // The first call for this device in the process: 8 threads race to create it.
  std::vector<std::shared_ptr<InferenceContext>> got(8);
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      got[t] = InferenceContext::instance(kDevice);
    });
  }
  go.store(true);
  for (auto& th : threads) th.join();
  for (int t = 0; t < 8; ++t) CHECK(got[t] && got[t] == got[0]);
  auto ctx = InferenceContext::instance(-1);
  CHECK(ctx == got[0]);
  CHECK_EQ(ctx->device(), kDevice);

  int sms = 0, major = 0, minor = 0;
  INFERCTX_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, kDevice), kDevice);
  INFERCTX_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, kDevice), kDevice);
  INFERCTX_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, kDevice), kDevice);
  CHECK_EQ(ctx->multiprocessor_count(), sms);
  CHECK_EQ(ctx->compute_capability(), major * 10 + minor);

  CHECK_THROWS(ConfigError, InferenceContext::instance(count));
  CHECK_THROWS(ConfigError, InferenceContext::instance(-2));

  if (count >= 2) {
    const int other = kDevice == 0 ? 1 : 0;
    auto second = InferenceContext::instance(other);
    CHECK(second != ctx);
    CHECK_EQ(second->device(), other);
    int current = -1;
    cudaGetDevice(&current);
    CHECK_EQ(current, kDevice);  // creating another device's context leaves ours current
  } else {
    std::printf("  (one device: the second-device checks need two)\n");
  }
}

TEST_CASE("before any plan: no workspace, zero limits, tokens guarded") {
  auto ctx = InferenceContext::instance(kDevice);
  CHECK(!ctx->has_plan());
  CHECK(!ctx->released());
  CHECK_EQ(ctx->workspace_bytes(), int64_t{0});
  CHECK_EQ(ctx->max_token_length(), int64_t{0});
  CHECK_EQ(ctx->views_alive(), int64_t{0});
  CHECK_THROWS(WorkspaceStateError, ctx->plan());
  try {
    ctx->workspace();
    CHECK(false);
  } catch (const WorkspaceStateError& e) {
    CHECK(std::string(e.what()).find("gen_workspace") != std::string::npos);
  }
  CHECK_THROWS(WorkspaceStateError, ctx->retake_workspace());
  ctx->release_workspace(false);  // nothing held: nothing to do
  CHECK(!ctx->released());
  try {
    ctx->advance_tokens(1);
    CHECK(false);
  } catch (const TokenLimitError& e) {
    CHECK_EQ(e.limit, int64_t{0});
    CHECK(std::string(e.what()).find("gen_workspace") != std::string::npos);
  }
  ctx->reset_tokens(0);
  CHECK_THROWS(ConfigError, ctx->reset_tokens(1));
  CHECK_EQ(ctx->current_tokens(), int64_t{0});
}

TEST_CASE("cuBLAS handle: workspace by compute capability, default math, on the compute stream") {
  auto ctx = InferenceContext::instance(kDevice);
  CublasHandle& h = ctx->cublas();
  const int64_t want = ctx->compute_capability() >= 90 ? (int64_t{32} << 20) : (int64_t{4} << 20);
  CHECK_EQ(h.workspace_bytes(), want);
  CHECK(h.workspace() != nullptr);
  CHECK(h.get() != nullptr);
  CHECK(h.lt() != nullptr);
  CHECK_EQ(h.device(), kDevice);
  cublasMath_t mode;
  INFERCTX_CUBLAS(cublasGetMathMode(h.get(), &mode), kDevice);
  CHECK_EQ(static_cast<int>(mode), static_cast<int>(CUBLAS_DEFAULT_MATH));
  h.set_tf32(true);
  INFERCTX_CUBLAS(cublasGetMathMode(h.get(), &mode), kDevice);
  CHECK_EQ(static_cast<int>(mode), static_cast<int>(CUBLAS_TF32_TENSOR_OP_MATH));
  CHECK(h.tf32());
  h.set_tf32(false);
  INFERCTX_CUBLAS(cublasGetMathMode(h.get(), &mode), kDevice);
  CHECK_EQ(static_cast<int>(mode), static_cast<int>(CUBLAS_DEFAULT_MATH));
  cudaStream_t bound = nullptr;
  INFERCTX_CUBLAS(cublasGetStream(h.get(), &bound), kDevice);
  CHECK(bound == ctx->stream());

  // A 2x2 GEMM (column-major) through the handle, on the context's stream.
  const float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
  DeviceAllocation da(kDevice, sizeof a), db(kDevice, sizeof b), dc(kDevice, sizeof a);
  cudaStream_t s = ctx->stream();
  INFERCTX_CUDA(cudaMemcpyAsync(da.data(), a, sizeof a, cudaMemcpyHostToDevice, s), kDevice);
  INFERCTX_CUDA(cudaMemcpyAsync(db.data(), b, sizeof b, cudaMemcpyHostToDevice, s), kDevice);
  const float alpha = 1.0f, beta = 0.0f;
  INFERCTX_CUBLAS(cublasSgemm(h.get(), CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &alpha, static_cast<const float*>(da.data()),
                              2, static_cast<const float*>(db.data()), 2, &beta, static_cast<float*>(dc.data()), 2),
                  kDevice);
  float c[4] = {};
  INFERCTX_CUDA(cudaMemcpyAsync(c, dc.data(), sizeof c, cudaMemcpyDeviceToHost, s), kDevice);
  INFERCTX_CUDA(cudaStreamSynchronize(s), kDevice);
  // C = A B with A = [1 3; 2 4], B = [5 7; 6 8]: C = [23 31; 34 46], stored by columns.
  CHECK(c[0] == 23.0f && c[1] == 34.0f && c[2] == 31.0f && c[3] == 46.0f);
}

TEST_CASE("gen_workspace allocates exactly the plan, measured now") {
  auto ctx = InferenceContext::instance(kDevice);
  size_t free_b = 0, total_b = 0;
  INFERCTX_CUDA(cudaMemGetInfo(&free_b, &total_b), kDevice);
  PlanRequest r = small_request(16);
  r.free_bytes = 1;  // replaced by the measurement
  r.total_bytes = 1;
  WorkspacePlan p = ctx->gen_workspace(r);
  CHECK_EQ(small_bytes(16), int64_t{100352});
  // Under virtual memory the granule (2 MiB on current GPUs) is counted; else the exact bytes.
  const int64_t want = granules(*ctx, 100352);
  if (ctx->addresses_stable()) {
    CHECK(ctx->fallback_reason().empty());
    CHECK(ctx->allocation_granularity() >= (int64_t{64} << 10));
    CHECK_EQ(want % ctx->allocation_granularity(), int64_t{0});
    CHECK(want > 100352);
  } else {
    std::printf("  (cudaMalloc fallback: %s)\n", ctx->fallback_reason().c_str());
    CHECK(!ctx->fallback_reason().empty());
    CHECK_EQ(ctx->allocation_granularity(), int64_t{0});
    CHECK_EQ(want, int64_t{100352});
  }
  CHECK_EQ(p.max_tokens, int64_t{16});
  CHECK_EQ(p.workspace_bytes, want);
  CHECK_EQ(p.attention_scores_offset + p.attention_scores_bytes, int64_t{100352});
  CHECK(p.bound_by == "max_out_tokens");
  CHECK_EQ(p.request.total_bytes, static_cast<int64_t>(total_b));
  CHECK(p.request.free_bytes > static_cast<int64_t>(free_b) / 2);
  CHECK(ctx->has_plan());
  CHECK_EQ(ctx->workspace_bytes(), want);
  CHECK_EQ(ctx->max_token_length(), int64_t{16});
  CHECK_EQ(ctx->plan().workspace_bytes, want);
  CHECK_EQ(ctx->held_bytes(), want);
  auto ws = ctx->workspace();
  CHECK(ws->data() != nullptr);
  CHECK(ws->accessible());
  CHECK_EQ(ws->size(), want);
  CHECK_EQ(ws->device(), kDevice);
  CHECK_EQ(reinterpret_cast<uintptr_t>(ws->data()) % 256, uintptr_t{0});
  CHECK(writable(*ws, ctx->stream(), 0x5A));
}

TEST_CASE("a plan that fits reuses the allocation (same pointer); a larger one grows it") {
  auto ctx = InferenceContext::instance(kDevice);
  ctx->gen_workspace(small_request(16));
  void* first = ctx->workspace()->data();
  const int64_t first_size = ctx->workspace()->size();

  WorkspacePlan smaller = ctx->gen_workspace(small_request(8));
  CHECK_EQ(smaller.workspace_bytes, granules(*ctx, small_bytes(8)));
  CHECK(ctx->workspace()->data() == first);
  CHECK_EQ(ctx->workspace()->size(), first_size);  // the allocation is kept whole
  CHECK_EQ(ctx->workspace_bytes(), granules(*ctx, small_bytes(8)));  // the plan's bytes
  CHECK_EQ(ctx->max_token_length(), int64_t{8});

  // 512 tokens: 5120*512 + 1024*512 + 8*512^2 = 5 MiB, more than the granule of the small plans.
  CHECK_EQ(small_bytes(512), int64_t{5} << 20);
  WorkspacePlan larger = ctx->gen_workspace(small_request(512));
  CHECK_EQ(larger.workspace_bytes, granules(*ctx, small_bytes(512)));
  CHECK_EQ(ctx->workspace()->size(), granules(*ctx, small_bytes(512)));
  CHECK_EQ(ctx->max_token_length(), int64_t{512});
  void* grown = ctx->workspace()->data();
  if (ctx->addresses_stable()) {
    CHECK(grown == first);  // grown in place: the address range was reserved up front
  } else {
    CHECK(grown != first);  // a new cudaMalloc
  }
  CHECK(writable(*ctx->workspace(), ctx->stream(), 0x11));

  ctx->gen_workspace(small_request(16));
  CHECK(ctx->workspace()->data() == grown);
  CHECK_EQ(ctx->views_alive(), int64_t{0});
}

TEST_CASE("grow with a view alive: in place under virtual memory, else the old allocation is detached") {
  auto ctx = InferenceContext::instance(kDevice);
  ctx->gen_workspace(small_request(16));
  std::shared_ptr<DeviceAllocation> view = ctx->workspace();
  CHECK_EQ(ctx->views_alive(), int64_t{1});
  CHECK(writable(*view, ctx->stream(), 0x21));
  ctx->gen_workspace(small_request(1024));  // 5120K + 1024K + 8 MiB = 14 MiB
  CHECK_EQ(ctx->workspace()->size(), granules(*ctx, small_bytes(1024)));
  if (ctx->addresses_stable()) {
    CHECK(ctx->workspace() == view);  // the same allocation, grown under the view
    CHECK_EQ(ctx->views_alive(), int64_t{1});
    CHECK_EQ(view->size(), granules(*ctx, small_bytes(1024)));
    // What was written before the grow is still there, and the new tail is usable.
    auto head = bytes_of(*view, 4096, ctx->stream());
    int changed = 0;
    for (unsigned char b : head) changed += b != 0x21;
    CHECK_EQ(changed, 0);
  } else {
    CHECK(ctx->workspace()->data() != view->data());
    CHECK_EQ(ctx->views_alive(), int64_t{0});  // the new allocation has no views
    CHECK_EQ(view.use_count(), long{1});       // the view is the old allocation's last owner
  }
  CHECK(writable(*view, ctx->stream(), 0x22));
  view.reset();  // under cudaMalloc, frees the detached allocation
  CHECK(writable(*ctx->workspace(), ctx->stream(), 0x23));
}

TEST_CASE("views_alive counts the other owners of the allocation") {
  auto ctx = InferenceContext::instance(kDevice);
  ctx->gen_workspace(small_request(16));
  CHECK_EQ(ctx->views_alive(), int64_t{0});
  auto a = ctx->workspace();
  CHECK_EQ(ctx->views_alive(), int64_t{1});
  auto b = a;
  CHECK_EQ(ctx->views_alive(), int64_t{2});
  {
    auto c = ctx->workspace();
    std::shared_ptr<DeviceAllocation> d(c);
    CHECK_EQ(ctx->views_alive(), int64_t{4});
  }
  CHECK_EQ(ctx->views_alive(), int64_t{2});
  b.reset();
  CHECK_EQ(ctx->views_alive(), int64_t{1});
  a.reset();
  CHECK_EQ(ctx->views_alive(), int64_t{0});
}

TEST_CASE("release with views alive: kept at their addresses (virtual memory) or WorkspaceInUseError") {
  auto ctx = InferenceContext::instance(kDevice);
  WorkspacePlan p = ctx->gen_workspace(small_request(16));
  auto view = ctx->workspace();
  auto twin = view;
  void* address = view->data();
  const int64_t size = view->size();
  if (ctx->addresses_stable()) {
    ctx->release_workspace(false);  // views are no obstacle
    CHECK(ctx->released());
    CHECK(!view->accessible());
    CHECK_EQ(ctx->views_alive(), int64_t{2});  // they still own the (reserved) range
    CHECK_EQ(ctx->held_bytes(), int64_t{0});
    CHECK(view->data() == address && view->size() == size);
    CHECK(ctx->in_released_range(address, 1));
    CHECK(ctx->in_released_range(static_cast<char*>(address) + size - 1, 1));
    CHECK(!ctx->in_released_range(reinterpret_cast<void*>(uintptr_t{4096}), 4096));
  } else {
    try {
      ctx->release_workspace(false);
      CHECK(false);
    } catch (const WorkspaceInUseError& e) {
      CHECK_EQ(e.views_alive, int64_t{2});
      CHECK(e.remedy == Remedy::DropViewsOrDetach);  // the Python class words it (pass force=True)
      CHECK(std::string(e.what()).find(ctx->fallback_reason()) != std::string::npos);
    }
    CHECK(!ctx->released());
    CHECK(ctx->workspace() == view);
    ctx->release_workspace(true);
    CHECK(ctx->released());
    CHECK_EQ(ctx->views_alive(), int64_t{0});
    CHECK_EQ(view.use_count(), long{2});
    CHECK(view->accessible());  // detached: the views keep it allocated
    CHECK(!ctx->in_released_range(address, 1));
    CHECK(writable(*view, ctx->stream(), 0x33));
  }
  try {
    ctx->workspace();
    CHECK(false);
  } catch (const WorkspaceStateError& e) {
    CHECK(std::string(e.what()).find("retake_workspace") != std::string::npos);
  }
  // The plan survives the release.
  CHECK(ctx->has_plan());
  CHECK_EQ(ctx->plan().max_tokens, p.max_tokens);
  CHECK_EQ(ctx->workspace_bytes(), p.workspace_bytes);
  CHECK_EQ(ctx->max_token_length(), p.max_tokens);
  ctx->release_workspace(false);  // already released: nothing to do
  CHECK(ctx->released());

  CHECK(ctx->retake_workspace());
  CHECK(!ctx->released());
  auto again = ctx->workspace();
  if (ctx->addresses_stable()) {
    CHECK(again == view);  // the same allocation, mapped again at the same addresses
    CHECK(view->accessible());
    CHECK(!ctx->in_released_range(address, 1));
  } else {
    CHECK(again->data() != view->data());  // both alive at once
  }
  CHECK_EQ(again->size(), ctx->addresses_stable() ? size : p.workspace_bytes);
  CHECK(writable(*view, ctx->stream(), 0x35));
  CHECK(ctx->retake_workspace());  // held already
  CHECK(ctx->workspace() == again);
  view.reset();
  twin.reset();
  again.reset();
  CHECK(writable(*ctx->workspace(), ctx->stream(), 0x34));
}

TEST_CASE("release frees the memory and retake takes it; 100 cycles keep the address and leak nothing") {
  auto ctx = InferenceContext::instance(kDevice);
  ctx->release_workspace(false);
  // 224 MiB: activations 80 MiB, KV cache 16 MiB, attention scores 128 MiB (whole granules).
  WorkspacePlan p = ctx->gen_workspace(small_request(1024, 16));
  CHECK_EQ(p.workspace_bytes, int64_t{224} << 20);
  CHECK_EQ(ctx->held_bytes(), p.workspace_bytes);
  const int64_t slack = int64_t{4} << 20;  // the driver's own bookkeeping may move free memory a little
  const int64_t held = free_memory();
  ctx->release_workspace(false);
  const int64_t after_release = free_memory();
  CHECK(after_release - held >= p.workspace_bytes - slack);
  CHECK(ctx->retake_workspace());
  const int64_t start = free_memory();
  CHECK(after_release - start >= p.workspace_bytes - slack);
  void* address = ctx->workspace()->data();
  int moved = 0, rose = 0, fell = 0;
  for (int i = 0; i < 100; ++i) {
    const int64_t before = free_memory();
    ctx->release_workspace(false);
    const int64_t released = free_memory();
    rose += released - before >= p.workspace_bytes - slack;
    ctx->retake_workspace();
    fell += released - free_memory() >= p.workspace_bytes - slack;
    moved += ctx->workspace()->data() != address;
  }
  CHECK_EQ(rose, 100);
  CHECK_EQ(fell, 100);
  if (ctx->addresses_stable()) CHECK_EQ(moved, 0);  // (cudaMalloc may or may not reuse an address)
  const int64_t end = free_memory();
  CHECK(end - start <= (int64_t{2} << 20) && start - end <= (int64_t{2} << 20));
  CHECK(writable(*ctx->workspace(), ctx->stream(), 0x44));
  ctx->release_workspace(false);  // give the 224 MiB back to the cases below
}

TEST_CASE("an impossible request throws WorkspaceOOMError and leaves the previous plan in force") {
  auto ctx = InferenceContext::instance(kDevice);
  WorkspacePlan before = ctx->gen_workspace(small_request(16));
  void* ptr = ctx->workspace()->data();
  CHECK(writable(*ctx->workspace(), ctx->stream(), 0x55));
  size_t free_b = 0, total_b = 0;
  INFERCTX_CUDA(cudaMemGetInfo(&free_b, &total_b), kDevice);

  // 2^30 sequences need 5 KiB each per token for activations alone: terabytes.
  try {
    ctx->gen_workspace(small_request(16, int64_t{1} << 30));
    CHECK(false);
  } catch (const WorkspaceOOMError& e) {
    CHECK(e.requested_bytes > e.free_bytes);
    CHECK_EQ(e.total_bytes, static_cast<int64_t>(total_b));
    CHECK(e.max_batch_size >= 1);  // a smaller batch fits
  }
  CHECK(ctx->has_plan());
  CHECK(!ctx->released());
  CHECK_EQ(ctx->plan().max_tokens, before.max_tokens);
  CHECK_EQ(ctx->workspace_bytes(), before.workspace_bytes);
  CHECK_EQ(ctx->max_token_length(), before.max_tokens);
  CHECK(ctx->workspace()->data() == ptr);
  // Contents survive too: the allocation was never touched.
  auto kept = bytes_of(*ctx->workspace(), 4096, ctx->stream());
  int changed = 0;
  for (unsigned char b : kept) changed += b != 0x55;
  CHECK_EQ(changed, 0);
  CHECK(writable(*ctx->workspace(), ctx->stream(), 0x56));

  // The same with a view alive, and with an invalid argument.
  auto view = ctx->workspace();
  CHECK_THROWS(WorkspaceOOMError, ctx->gen_workspace(small_request(16, int64_t{1} << 30)));
  CHECK_THROWS(ConfigError, ctx->gen_workspace(small_request(0)));
  CHECK(ctx->workspace() == view);
  CHECK_EQ(ctx->plan().max_tokens, before.max_tokens);
}

TEST_CASE("token counter: guard at max_token_length, reset range, contention") {
  auto ctx = InferenceContext::instance(kDevice);
  ctx->gen_workspace(small_request(16));
  CHECK_EQ(ctx->max_token_length(), int64_t{16});
  ctx->reset_tokens(0);
  ctx->advance_tokens(15);
  ctx->advance_tokens();
  CHECK_EQ(ctx->current_tokens(), int64_t{16});
  try {
    ctx->advance_tokens(1);
    CHECK(false);
  } catch (const TokenLimitError& e) {
    CHECK_EQ(e.current, int64_t{16});
    CHECK_EQ(e.requested, int64_t{1});
    CHECK_EQ(e.limit, int64_t{16});
  }
  CHECK_EQ(ctx->current_tokens(), int64_t{16});
  ctx->reset_tokens();
  CHECK_EQ(ctx->current_tokens(), int64_t{1});
  CHECK_THROWS(TokenLimitError, ctx->advance_tokens(INT64_MAX));  // no overflow on the way
  CHECK_THROWS(ConfigError, ctx->advance_tokens(0));
  CHECK_THROWS(ConfigError, ctx->advance_tokens(-3));
  CHECK_THROWS(ConfigError, ctx->reset_tokens(17));
  CHECK_THROWS(ConfigError, ctx->reset_tokens(-1));
  ctx->reset_tokens(16);
  CHECK_EQ(ctx->current_tokens(), int64_t{16});

  // 8 threads advance one token at a time until refused: exactly the limit is handed out.
  ctx->gen_workspace(small_request(4096));
  ctx->reset_tokens(0);
  std::atomic<int64_t> granted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (;;) {
        try {
          ctx->advance_tokens(1);
          granted.fetch_add(1);
        } catch (const TokenLimitError&) {
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK_EQ(granted.load(), int64_t{4096});
  CHECK_EQ(ctx->current_tokens(), int64_t{4096});
  ctx->reset_tokens(0);
  ctx->gen_workspace(small_request(16));  // reuses the larger allocation
  CHECK_EQ(ctx->max_token_length(), int64_t{16});
}

TEST_CASE("Philox state through the context") {
  auto ctx = InferenceContext::instance(kDevice);
  ctx->set_seed(1234);
  auto r = ctx->increment_offset(5);
  CHECK_EQ(r.first, uint64_t{1234});
  CHECK_EQ(r.second, uint64_t{0});
  r = ctx->increment_offset(4);
  CHECK_EQ(r.second, uint64_t{8});
  CHECK_EQ(ctx->philox().offset(), uint64_t{12});
  ctx->set_seed(7);
  CHECK_EQ(ctx->philox().offset(), uint64_t{0});
  CHECK_EQ(ctx->increment_offset(1).first, uint64_t{7});
}

TEST_CASE("streams: owned, non-blocking, distinct; never the legacy stream") {
  auto ctx = InferenceContext::instance(kDevice);
  cudaStream_t comp = ctx->stream(), comm = ctx->comm_stream();
  CHECK(comp != nullptr && comm != nullptr && comp != comm);
  CHECK(comp != cudaStreamLegacy && comp != cudaStreamPerThread);
  unsigned flags = 0;
  INFERCTX_CUDA(cudaStreamGetFlags(comp, &flags), kDevice);
  CHECK_EQ(flags, unsigned{cudaStreamNonBlocking});
  INFERCTX_CUDA(cudaStreamGetFlags(comm, &flags), kDevice);
  CHECK_EQ(flags, unsigned{cudaStreamNonBlocking});
  int dev = -1;
  INFERCTX_CUDA(cudaStreamGetDevice(comp, &dev), kDevice);
  CHECK_EQ(dev, kDevice);
}

TEST_CASE("sync_comp: the comm stream sees what the compute stream wrote") {
  auto ctx = InferenceContext::instance(kDevice);
  CHECK_EQ(stale_after(ctx->stream(), ctx->comm_stream(), 7, [&] { ctx->sync_comp(); }), 0);
}

TEST_CASE("sync_comm: the compute stream sees what the comm stream wrote") {
  auto ctx = InferenceContext::instance(kDevice);
  CHECK_EQ(stale_after(ctx->comm_stream(), ctx->stream(), 9, [&] { ctx->sync_comm(); }), 0);
}

TEST_CASE("use_stream adopts an external stream (cuBLAS follows) and nullptr returns to the own one") {
  auto ctx = InferenceContext::instance(kDevice);
  cudaStream_t own = ctx->stream();
  Stream external = Stream::create(kDevice);
  ctx->use_stream(external.handle());
  CHECK(ctx->stream() == external.handle());
  cudaStream_t bound = nullptr;
  INFERCTX_CUBLAS(cublasGetStream(ctx->cublas().get(), &bound), kDevice);
  CHECK(bound == external.handle());
  CHECK_EQ(stale_after(external.handle(), ctx->comm_stream(), 11, [&] { ctx->sync_comp(); }), 0);
  CHECK_EQ(stale_after(ctx->comm_stream(), external.handle(), 12, [&] { ctx->sync_comm(); }), 0);

  // The default streams, asked for by name (torch's default stream is the legacy one).
  ctx->use_stream(cudaStreamLegacy);
  CHECK(ctx->stream() == cudaStreamLegacy);
  ctx->use_stream(cudaStreamPerThread);
  CHECK(ctx->stream() == cudaStreamPerThread);
  INFERCTX_CUBLAS(cublasGetStream(ctx->cublas().get(), &bound), kDevice);
  CHECK(bound == cudaStreamPerThread);

  ctx->use_stream(nullptr);
  CHECK(ctx->stream() == own);
  INFERCTX_CUBLAS(cublasGetStream(ctx->cublas().get(), &bound), kDevice);
  CHECK(bound == own);

  int count = 0;
  INFERCTX_CUDA(cudaGetDeviceCount(&count), -1);
  if (count >= 2) {
    Stream foreign = Stream::create(kDevice == 0 ? 1 : 0);
    CHECK_THROWS(ConfigError, ctx->use_stream(foreign.handle()));
    CHECK(ctx->stream() == own);
  }
}

TEST_CASE("use_stream waits for a GEMM in progress on the shared cuBLAS handle") {
  // A GEMM holds the handle's mutex from begin_use (the handle bound to its stream) to its cuBLAS
  // call; a use_stream in between would move that call to another stream and workspace.
  auto ctx = InferenceContext::instance(kDevice);
  Stream external = Stream::create(kDevice);
  std::atomic<bool> switched{false};
  std::thread other;
  {
    std::lock_guard<std::mutex> gemm_in_progress(ctx->cublas().mutex());
    other = std::thread([&] {
      ctx->use_stream(external.handle());
      switched.store(true);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    CHECK(!switched.load());  // still waiting for the handle
  }
  other.join();
  CHECK(switched.load());
  CHECK(ctx->stream() == external.handle());
  cudaStream_t bound = nullptr;
  INFERCTX_CUBLAS(cublasGetStream(ctx->cublas().get(), &bound), kDevice);
  CHECK(bound == external.handle());
  ctx->use_stream(nullptr);
}

TEST_CASE("Stream and Event owners") {
  Stream a = Stream::create(kDevice);
  CHECK(a.owned());
  CHECK_EQ(a.device(), kDevice);
  cudaStream_t h = a.handle();
  Stream b = std::move(a);
  CHECK(a.handle() == nullptr && !a.owned());
  CHECK(b.handle() == h && b.owned());
  Stream c = Stream::create(kDevice);
  c = std::move(b);  // destroys c's own stream, takes b's
  CHECK(c.handle() == h);
  c.synchronize();
  Stream borrowed = Stream::borrow(h, -1);
  CHECK(!borrowed.owned());
  CHECK_EQ(borrowed.device(), kDevice);

  Event start(kDevice, true), stop(kDevice, true), plain(kDevice);
  CHECK(start.timing() && !plain.timing());
  start.record(h);
  slow_fill<<<1, 32, 0, h>>>(nullptr, 0, 0, 2ull * 1000 * 1000);
  INFERCTX_CUDA(cudaGetLastError(), kDevice);
  stop.record(h);
  plain.record(h);
  stop.synchronize();
  CHECK(stop.query());
  CHECK(stop.elapsed_ms_since(start) >= 1.0f);
  CHECK_THROWS(ConfigError, plain.elapsed_ms_since(start));
  CHECK_THROWS(ConfigError, plain.record(nullptr));
  CHECK_THROWS(ConfigError, plain.make_wait(nullptr));
  Stream other = Stream::create(kDevice);
  plain.make_wait(other.handle());
  other.synchronize();
  CHECK(plain.query());
}

TEST_CASE("DeviceAllocation, PinnedAllocation and copy_async") {
  PinnedAllocation src(4096), dst(4096);
  auto* s = static_cast<unsigned char*>(src.data());
  for (int i = 0; i < 4096; ++i) s[i] = static_cast<unsigned char>(i * 7);
  DeviceAllocation dev(kDevice, 4096);
  Stream st = Stream::create(kDevice);
  copy_async(dev.data(), src.data(), 4096, st.handle(), kDevice);
  copy_async(dst.data(), dev.data(), 4096, st.handle(), -1);
  st.synchronize();
  int diff = 0;
  for (int i = 0; i < 4096; ++i) diff += static_cast<const unsigned char*>(dst.data())[i] != s[i];
  CHECK_EQ(diff, 0);

  CHECK_EQ(dev.size(), int64_t{4096});
  CHECK_EQ(dev.device(), kDevice);
  CHECK_EQ(src.size(), int64_t{4096});
}

TEST_CASE("calls on a context leave the caller's current device alone") {
  int count = 0;
  INFERCTX_CUDA(cudaGetDeviceCount(&count), -1);
  if (count < 2) {
    std::printf("  (one device: nothing to switch between)\n");
    return;
  }
  const int other = kDevice == 0 ? 1 : 0;
  auto ctx = InferenceContext::instance(other);
  ctx->gen_workspace(small_request(16));
  ctx->sync_comp();
  ctx->release_workspace(false);
  ctx->retake_workspace();
  int current = -1;
  cudaGetDevice(&current);
  CHECK_EQ(current, kDevice);
  CHECK_EQ(ctx->workspace()->device(), other);
  int ptr_device = -1;
  cudaPointerAttributes attr{};
  INFERCTX_CUDA(cudaPointerGetAttributes(&attr, ctx->workspace()->data()), other);
  ptr_device = attr.device;
  CHECK_EQ(ptr_device, other);
}

int main() {
  check::skip_without_gpu();
  INFERCTX_CUDA(cudaGetDevice(&kDevice), -1);
  return check::run_all();
}

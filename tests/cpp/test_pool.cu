// The stream-ordered device pool and the cuBLAS handle's workspaces per stream.
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <functional>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "check.hpp"
#include "device_memory.cuh"
#include "inferctx/blas.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/gemm.hpp"
#include "inferctx/pool.hpp"
#include "inferctx/stream.hpp"

using namespace inferctx;

namespace {

constexpr int kDevice = 0;

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void fill(int* p, int n, int value) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] = value;
}

__global__ void sum_into(const int* p, int n, unsigned long long* total) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) atomicAdd(total, static_cast<unsigned long long>(p[i]));
}

cudaStream_t new_stream() {
  cudaStream_t s = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags", kDevice);
  return s;
}

// After a block of n ints that a busy stream reads (summing into `total`) was let go: the next
// block of its size on `stream` is filled with 7s; returns what the reader summed (n when it
// saw the 1s it was given, not the next user's 7s).
unsigned long long reader_total_after_reuse(DevicePool& pool, int n, cudaStream_t stream,
                                            const unsigned long long* total) {
  auto again = pool.allocate(int64_t{n} * 4, stream);
  fill<<<(n + 255) / 256, 256, 0, stream>>>(static_cast<int*>(again->data()), n, 7);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", kDevice);
  unsigned long long host = 0;
  check_cuda(cudaMemcpy(&host, total, sizeof host, cudaMemcpyDeviceToHost), "cudaMemcpy", kDevice);
  return host;
}

long long cycles_per_ms() {
  int khz = 0;
  check_cuda(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, kDevice), "cudaDeviceGetAttribute", kDevice);
  return khz > 0 ? khz : 2000000;
}

// Queues on `stream` 50 ms of spinning, then the sum of the block's n ints into `total`: the
// block is still read well after the host has let it go.
void read_late(const DeviceAllocation& block, int n, cudaStream_t stream, unsigned long long* total) {
  spin<<<1, 1, 0, stream>>>(cycles_per_ms() * 50);
  sum_into<<<(n + 255) / 256, 256, 0, stream>>>(static_cast<const int*>(block.data()), n, total);
}

// A block of n ints on `stream` holding 1s, landed when this returns.
std::shared_ptr<PooledAllocation> block_of_ones(DevicePool& pool, int n, cudaStream_t stream) {
  auto block = pool.allocate(int64_t{n} * 4, stream);
  fill<<<(n + 255) / 256, 256, 0, stream>>>(static_cast<int*>(block->data()), n, 1);
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize", kDevice);
  return block;
}

// Captures on `durable` a fill of all n ints of `out` with 3 while `let_go` drops blocks of the
// pool: the capture must end whole with the `kept` blocks still counted (from `before`), the
// graph must replay, and trim() (a device synchronisation) must then free them.
void let_go_during_capture(DevicePool& pool, cudaStream_t durable, int* out, int n, int64_t before, int64_t kept,
                           const std::function<void()>& let_go) {
  check_cuda(cudaStreamBeginCapture(durable, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture", kDevice);
  fill<<<(n + 255) / 256, 256, 0, durable>>>(out, n, 3);  // the graph's work
  let_go();
  cudaGraph_t graph = nullptr;
  CHECK_EQ(static_cast<int>(cudaStreamEndCapture(durable, &graph)), static_cast<int>(cudaSuccess));
  CHECK(graph != nullptr);
  CHECK_EQ(pool.stats().allocations - before, kept);  // kept, and counted
  if (graph != nullptr) {
    cudaGraphExec_t exec = nullptr;
    check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate", kDevice);
    check_cuda(cudaGraphLaunch(exec, durable), "cudaGraphLaunch", kDevice);
    check_cuda(cudaStreamSynchronize(durable), "cudaStreamSynchronize", kDevice);
    std::vector<int> host(n);
    check_cuda(cudaMemcpy(host.data(), out, int64_t{n} * 4, cudaMemcpyDeviceToHost), "cudaMemcpy", kDevice);
    int wrong = 0;
    for (int v : host) wrong += v != 3;
    CHECK_EQ(wrong, 0);  // the captured work ran
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  pool.trim(0);
  CHECK_EQ(pool.stats().allocations, before);
  CHECK_EQ(static_cast<int>(cudaGetLastError()), static_cast<int>(cudaSuccess));
}

}  // namespace

TEST_CASE("gpu: negative sizes and a null stream are refused") {
  auto pool = DevicePool::of(kDevice);
  CHECK_THROWS(ConfigError, pool->allocate(-1, cudaStreamLegacy));
  CHECK_THROWS(ConfigError, pool->allocate(16, nullptr));
  CHECK_THROWS(ConfigError, pool->trim(-1));
  auto empty = pool->allocate(0, cudaStreamLegacy);
  CHECK(empty->data() == nullptr && empty->size() == 0);
}

TEST_CASE("gpu: figures follow allocations; freed blocks are reused; trim returns them") {
  auto pool = DevicePool::of(kDevice);
  CHECK(pool == DevicePool::of(kDevice));
  pool->trim(0);
  const PoolStats start = pool->stats();
  cudaStream_t s = new_stream();
  void* first = nullptr;
  {
    auto a = pool->allocate(8 << 20, s);
    first = a->data();
    const PoolStats held = pool->stats();
    CHECK_EQ(held.used_bytes - start.used_bytes, int64_t{8 << 20});
    CHECK(held.reserved_bytes >= held.used_bytes);
    CHECK_EQ(held.allocations - start.allocations, int64_t{1});
  }
  check_cuda(cudaStreamSynchronize(pool->free_stream()), "cudaStreamSynchronize", kDevice);
  const PoolStats freed = pool->stats();
  CHECK_EQ(freed.used_bytes, start.used_bytes);
  CHECK(freed.reserved_bytes >= start.reserved_bytes + (8 << 20));  // kept for reuse
  {
    auto b = pool->allocate(8 << 20, s);  // the same block again, no new memory
    CHECK(b->data() == first);
    CHECK_EQ(pool->stats().reserved_bytes, freed.reserved_bytes);
  }
  size_t free_before = 0, free_after = 0, total = 0;
  check_cuda(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo", kDevice);
  CHECK_EQ(pool->trim(0), int64_t{0} + start.used_bytes);
  check_cuda(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo", kDevice);
  CHECK(free_after >= free_before + (8u << 20));
  check_cuda(cudaStreamDestroy(s), "cudaStreamDestroy", kDevice);
}

TEST_CASE("gpu: a block is not handed out again while a stream that used it is still busy") {
  auto pool = DevicePool::of(kDevice);
  cudaStream_t producer = new_stream(), reader = new_stream();
  const int n = 1 << 20;
  unsigned long long* total = nullptr;
  check_cuda(cudaMalloc(&total, sizeof *total), "cudaMalloc", kDevice);
  check_cuda(cudaMemset(total, 0, sizeof *total), "cudaMemset", kDevice);
  {
    auto block = pool->allocate(int64_t{n} * 4, producer);
    fill<<<(n + 255) / 256, 256, 0, producer>>>(static_cast<int*>(block->data()), n, 1);
    cudaEvent_t filled;
    check_cuda(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming), "cudaEventCreate", kDevice);
    check_cuda(cudaEventRecord(filled, producer), "cudaEventRecord", kDevice);
    check_cuda(cudaStreamWaitEvent(reader, filled, 0), "cudaStreamWaitEvent", kDevice);
    block->note_use(reader);
    spin<<<1, 1, 0, reader>>>(cycles_per_ms() * 50);  // the reader is busy for 50 ms
    sum_into<<<(n + 255) / 256, 256, 0, reader>>>(static_cast<const int*>(block->data()), n, total);
    cudaEventDestroy(filled);
  }  // freed here, while the reader still has 50 ms to go
  CHECK_EQ(reader_total_after_reuse(*pool, n, producer, total), static_cast<unsigned long long>(n));
  cudaFree(total);
  cudaStreamDestroy(producer);
  cudaStreamDestroy(reader);
}

TEST_CASE("gpu: a use on a thread's per-thread default stream is waited for when another thread lets the block go") {
  // cudaStreamPerThread names the calling thread's stream: the reader thread's stream is not the
  // one the handle names on this thread, where the block is freed.
  auto pool = DevicePool::of(kDevice);
  pool->trim(0);  // no free block of the size is left from earlier cases: the next one is this
  const int n = 1 << 20;
  unsigned long long* total = nullptr;
  check_cuda(cudaMalloc(&total, sizeof *total), "cudaMalloc", kDevice);
  check_cuda(cudaMemset(total, 0, sizeof *total), "cudaMemset", kDevice);
  std::shared_ptr<PooledAllocation> block = pool->allocate(int64_t{n} * 4, cudaStreamPerThread);
  fill<<<(n + 255) / 256, 256, 0, cudaStreamPerThread>>>(static_cast<int*>(block->data()), n, 1);
  check_cuda(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize", kDevice);
  // The reader thread stays alive until the block is let go: its stream is then still one of a
  // running thread (whatever CUDA does with a per-thread stream when its thread ends), and the
  // two threads are certainly two.
  std::atomic<bool> launched{false}, let_go{false};
  std::thread reader([&] {
    check_cuda(cudaSetDevice(kDevice), "cudaSetDevice", kDevice);
    block->note_use(cudaStreamPerThread);  // the reader thread's own stream
    spin<<<1, 1, 0, cudaStreamPerThread>>>(cycles_per_ms() * 50);
    sum_into<<<(n + 255) / 256, 256, 0, cudaStreamPerThread>>>(static_cast<const int*>(block->data()), n, total);
    launched = true;
    while (!let_go) std::this_thread::yield();
  });
  while (!launched) std::this_thread::yield();
  block.reset();  // on this thread, while the reader's stream still has 50 ms to go
  let_go = true;
  reader.join();
  CHECK_EQ(reader_total_after_reuse(*pool, n, cudaStreamPerThread, total), static_cast<unsigned long long>(n));
  cudaFree(total);
}

TEST_CASE("gpu: a use on an unknown stream, or on a stream that is not durable (destroyed since), frees after a device synchronisation") {
  // Each block is read 50 ms after it is let go; the next block of its size (the same one: the
  // pool is trimmed first, so no other free block of the size is left) is then filled with 7s.
  // The reader sums n only if the free waited for it.
  auto pool = DevicePool::of(kDevice);
  const int n = 1 << 18;  // 1 MiB
  unsigned long long* total = nullptr;
  check_cuda(cudaMalloc(&total, sizeof *total), "cudaMalloc", kDevice);
  cudaStream_t s = new_stream();
  {
    // The pool knows of the legacy stream alone, a durable one: but for the unknown use, the
    // block would be freed in that stream's order and taken straight back by the allocation on
    // it below, while the reader on `s` (non-blocking: the legacy stream does not wait for it)
    // still runs.
    check_cuda(cudaMemset(total, 0, sizeof *total), "cudaMemset", kDevice);
    pool->trim(0);
    auto block = block_of_ones(*pool, n, cudaStreamLegacy);
    block->note_unknown_use();
    read_late(*block, n, s, total);
  }
  CHECK_EQ(reader_total_after_reuse(*pool, n, cudaStreamLegacy, total), static_cast<unsigned long long>(n));
  {
    check_cuda(cudaMemset(total, 0, sizeof *total), "cudaMemset", kDevice);
    pool->trim(0);
    auto block = block_of_ones(*pool, n, cudaStreamLegacy);
    block->note_use(s);
    // Work queued on a stream runs to its end after the stream is destroyed; the device
    // synchronisation waits for it like any other.
    read_late(*block, n, s, total);
    check_cuda(cudaStreamDestroy(s), "cudaStreamDestroy", kDevice);
  }  // no event is recorded on the destroyed stream: the free synchronises the device instead
  CHECK_EQ(reader_total_after_reuse(*pool, n, cudaStreamLegacy, total), static_cast<unsigned long long>(n));
  cudaStream_t other = new_stream();
  {
    // A durable stream is waited for in its own order (and is never destroyed): the block is
    // freed on it, after the reader, and another stream gets it only once that free is reached.
    cudaStream_t durable = new_stream();
    pool->note_durable(durable);
    check_cuda(cudaMemset(total, 0, sizeof *total), "cudaMemset", kDevice);
    pool->trim(0);
    auto block = block_of_ones(*pool, n, durable);
    read_late(*block, n, durable, total);
  }
  CHECK_EQ(reader_total_after_reuse(*pool, n, other, total), static_cast<unsigned long long>(n));
  {
    // Two durable streams: the pool's stream waits for each by an event before the free.
    cudaStream_t writer = new_stream(), reader = new_stream();
    pool->note_durable(writer);
    pool->note_durable(reader);
    check_cuda(cudaMemset(total, 0, sizeof *total), "cudaMemset", kDevice);
    pool->trim(0);
    auto block = block_of_ones(*pool, n, writer);
    block->note_use(reader);
    read_late(*block, n, reader, total);
  }
  CHECK_EQ(reader_total_after_reuse(*pool, n, other, total), static_cast<unsigned long long>(n));
  CHECK_EQ(static_cast<int>(cudaGetLastError()), static_cast<int>(cudaSuccess));
  auto next = pool->allocate(1 << 20, cudaStreamLegacy);
  CHECK(next->data() != nullptr);
  cudaFree(total);
  cudaStreamDestroy(other);
}

TEST_CASE("gpu: a use on a stream Stream::create made is waited for by an event while it exists, by a device synchronisation once destroyed") {
  auto pool = DevicePool::of(kDevice);
  const int n = 1 << 18;  // 1 MiB
  unsigned long long* total = nullptr;
  check_cuda(cudaMalloc(&total, sizeof *total), "cudaMalloc", kDevice);
  cudaStream_t busy = new_stream(), other = new_stream();
  {
    // Alive: the free waits for nothing else than the block's users (unrelated work on `busy` is
    // still running when the block has been let go), whether s is its one user (freed in s's
    // order) or one of two (the legacy stream too; both waited for by events).
    Stream s = Stream::create(kDevice);
    CHECK(owned_stream_serial(s.handle()) != 0);
    for (const bool two_users : {false, true}) {
      check_cuda(cudaMemset(total, 0, sizeof *total), "cudaMemset", kDevice);
      pool->trim(0);
      auto block = block_of_ones(*pool, n, two_users ? cudaStreamLegacy : s.handle());
      if (two_users) block->note_use(s.handle());
      read_late(*block, n, s.handle(), total);  // s reads the block 50 ms from now
      spin<<<1, 1, 0, busy>>>(cycles_per_ms() * 500);
      block.reset();
      CHECK_EQ(static_cast<int>(cudaStreamQuery(busy)), static_cast<int>(cudaErrorNotReady));
      CHECK_EQ(reader_total_after_reuse(*pool, n, other, total), static_cast<unsigned long long>(n));
    }
  }
  {
    // Destroyed before the block is let go, with its reader still queued: a device
    // synchronisation waits for that reader, even where a stream made since has the destroyed
    // one's address (its number differs: an event on it would wait for nothing of the reader's).
    check_cuda(cudaMemset(total, 0, sizeof *total), "cudaMemset", kDevice);
    pool->trim(0);
    auto block = block_of_ones(*pool, n, cudaStreamLegacy);
    Stream s = Stream::create(kDevice);
    const cudaStream_t gone = s.handle();
    const uint64_t serial = owned_stream_serial(gone);
    block->note_use(gone);
    read_late(*block, n, gone, total);
    s = Stream();  // destroyed; its queued work still runs
    CHECK_EQ(owned_stream_serial(gone), uint64_t{0});
    std::vector<Stream> made;
    for (int i = 0; i < 64 && (made.empty() || made.back().handle() != gone); ++i) {
      made.push_back(Stream::create(kDevice));
    }
    if (made.back().handle() == gone) {
      std::printf("  (a stream made since has the destroyed one's address)\n");
      CHECK(owned_stream_serial(gone) != serial);
    }
    block.reset();
    CHECK_EQ(reader_total_after_reuse(*pool, n, cudaStreamLegacy, total), static_cast<unsigned long long>(n));
  }
  CHECK_EQ(static_cast<int>(cudaGetLastError()), static_cast<int>(cudaSuccess));
  cudaFree(total);
  cudaStreamDestroy(busy);
  cudaStreamDestroy(other);
}

TEST_CASE("gpu: a block let go while its durable stream captures a CUDA graph waits for a later synchronisation") {
  // Nothing may be queued on a capturing stream but the graph's own work: no free (a free there
  // must name a block the graph allocated) and no event (it would pull the pool's stream into
  // the capture). The block stays counted until trim() synchronises the device.
  auto pool = DevicePool::of(kDevice);
  pool->trim(0);
  cudaStream_t durable = new_stream();
  pool->note_durable(durable);
  const int n = 1 << 18;
  int* other = nullptr;
  check_cuda(cudaMalloc(&other, int64_t{n} * 4), "cudaMalloc", kDevice);
  const int64_t before = pool->stats().allocations;
  auto block = pool->allocate(int64_t{n} * 4, durable);
  fill<<<(n + 255) / 256, 256, 0, durable>>>(static_cast<int*>(block->data()), n, 1);  // used eagerly
  check_cuda(cudaStreamSynchronize(durable), "cudaStreamSynchronize", kDevice);
  let_go_during_capture(*pool, durable, other, n, before, 1, [&] { block.reset(); });
  cudaFree(other);
}

TEST_CASE("gpu: a block also used where only a device synchronisation can wait, let go while its durable stream captures, leaves the capture alone") {
  // One block also has a use not known, the other a use on a stream that is not durable: either
  // would be freed after a device synchronisation, which is refused while the durable stream
  // captures and ends that capture in error. Both are kept, counted, and the capture goes on.
  auto pool = DevicePool::of(kDevice);
  pool->trim(0);
  cudaStream_t durable = new_stream();  // never destroyed: a durable stream lives as long as the process
  pool->note_durable(durable);
  cudaStream_t side = new_stream();
  const int n = 1 << 18;
  int* other = nullptr;
  check_cuda(cudaMalloc(&other, int64_t{n} * 4), "cudaMalloc", kDevice);
  const int64_t before = pool->stats().allocations;
  auto unknown = pool->allocate(int64_t{n} * 4, durable);
  auto also_on_side = pool->allocate(int64_t{n} * 4, durable);
  fill<<<(n + 255) / 256, 256, 0, durable>>>(static_cast<int*>(unknown->data()), n, 1);
  fill<<<(n + 255) / 256, 256, 0, durable>>>(static_cast<int*>(also_on_side->data()), n, 2);
  check_cuda(cudaStreamSynchronize(durable), "cudaStreamSynchronize", kDevice);
  unknown->note_unknown_use();
  also_on_side->note_use(side);
  CHECK_EQ(pool->stats().allocations - before, int64_t{2});
  let_go_during_capture(*pool, durable, other, n, before, 2, [&] {
    unknown.reset();
    also_on_side.reset();
  });
  cudaFree(other);
  cudaStreamDestroy(side);
}

TEST_CASE("gpu: each thread's per-thread default stream gets a GEMM workspace of its own") {
  // cudaStreamPerThread is one handle for every thread's own stream: GEMMs of two threads on it
  // run at once, so sharing a workspace by handle would mix their partial results.
  CublasHandle handle(kDevice);
  void* mine = nullptr;
  void* theirs = nullptr;
  {
    WorkspaceUse use(handle, cudaStreamPerThread);
    mine = handle.bound_workspace();
  }
  std::thread other([&] {
    check_cuda(cudaSetDevice(kDevice), "cudaSetDevice", kDevice);
    WorkspaceUse use(handle, cudaStreamPerThread);
    theirs = handle.bound_workspace();
  });
  other.join();
  CHECK(mine != nullptr && theirs != nullptr);
  CHECK(mine != theirs);
  {
    WorkspaceUse use(handle, cudaStreamPerThread);
    CHECK(handle.bound_workspace() == mine);  // kept for this thread
  }
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", kDevice);
}

TEST_CASE("gpu: each stream's GEMMs get a workspace of their own; concurrent products are right") {
  CublasHandle handle(kDevice);
  const int n = 512;
  std::vector<__half> ones(n * n, __float2half(1.0f));
  __half *a = nullptr, *b = nullptr, *c1 = nullptr, *c2 = nullptr;
  for (__half** p : {&a, &b, &c1, &c2}) check_cuda(cudaMalloc(p, n * n * sizeof(__half)), "cudaMalloc", kDevice);
  // Zeroed first: compute-sanitizer initcheck does not see the stores of cuBLAS's Hopper kernels
  // and would call the results uninitialized (every value is checked below).
  for (__half* q : {c1, c2}) check_cuda(cudaMemset(q, 0, n * n * sizeof(__half)), "cudaMemset", kDevice);
  // Landed (zeroes included) before the GEMMs on the two non-blocking streams below.
  test_memory::upload(a, ones.data(), n * n * sizeof(__half), kDevice);
  test_memory::upload(b, ones.data(), n * n * sizeof(__half), kDevice);
  cudaStream_t s1 = new_stream(), s2 = new_stream();
  const GemmProblem p = packed_gemm_problem(1, n, n, n, 1, false, false, false);
  void* w1 = nullptr;
  void* w2 = nullptr;
  {
    WorkspaceUse use(handle, s1);
    w1 = handle.bound_workspace();
  }
  {
    WorkspaceUse use(handle, s2);
    w2 = handle.bound_workspace();
  }
  CHECK(w1 == handle.workspace());  // the first stream takes the handle's own
  CHECK(w2 != nullptr && w2 != w1);
  {
    WorkspaceUse use(handle, s1);
    CHECK(handle.bound_workspace() == w1);  // kept per stream
  }
  for (int round = 0; round < 20; ++round) {
    gemm(handle, s1, p, a, b, c1, 1.0f, 0.0f);
    gemm(handle, s2, p, a, b, c2, 2.0f, 0.0f);
  }
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", kDevice);
  std::vector<__half> h1(n * n), h2(n * n);
  check_cuda(cudaMemcpy(h1.data(), c1, n * n * sizeof(__half), cudaMemcpyDeviceToHost), "cudaMemcpy", kDevice);
  check_cuda(cudaMemcpy(h2.data(), c2, n * n * sizeof(__half), cudaMemcpyDeviceToHost), "cudaMemcpy", kDevice);
  int bad = 0;
  for (int i = 0; i < n * n; ++i) {
    bad += __half2float(h1[i]) != 512.0f;
    bad += __half2float(h2[i]) != 1024.0f;
  }
  CHECK_EQ(bad, 0);
  // More streams than workspaces kept: the oldest pool workspace is given back, products stay right.
  std::vector<cudaStream_t> many;
  for (int i = 0; i < CublasHandle::kMaxStreamWorkspaces + 3; ++i) {
    many.push_back(new_stream());
    gemm(handle, many.back(), p, a, b, c1, 1.0f, 0.0f);
  }
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", kDevice);
  check_cuda(cudaMemcpy(h1.data(), c1, n * n * sizeof(__half), cudaMemcpyDeviceToHost), "cudaMemcpy", kDevice);
  bad = 0;
  for (int i = 0; i < n * n; ++i) bad += __half2float(h1[i]) != 512.0f;
  CHECK_EQ(bad, 0);
  for (cudaStream_t s : many) cudaStreamDestroy(s);
  for (__half* q : {a, b, c1, c2}) cudaFree(q);
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
}

TEST_CASE("gpu: a stream made at a destroyed stream's address does not take that stream's GEMM workspace") {
  // The destroyed stream's GEMMs may still be queued on its workspace: a stream CUDA gives the
  // same address must get another, or the two would write one scratch buffer at once.
  CublasHandle handle(kDevice);
  cudaStream_t first = new_stream();
  {
    WorkspaceUse use(handle, first);  // takes the handle's own workspace
  }
  Stream s = Stream::create(kDevice);
  const cudaStream_t gone = s.handle();
  void* old = nullptr;
  {
    WorkspaceUse use(handle, gone);
    old = handle.bound_workspace();
  }
  CHECK(old != nullptr && old != handle.workspace());
  // Work still queued on the stream when it is destroyed (a GEMM would use the workspace then).
  cudaEvent_t spun = nullptr;
  check_cuda(cudaEventCreateWithFlags(&spun, cudaEventDisableTiming), "cudaEventCreate", kDevice);
  spin<<<1, 1, 0, gone>>>(cycles_per_ms() * 200);
  check_cuda(cudaEventRecord(spun, gone), "cudaEventRecord", kDevice);
  s = Stream();  // destroyed
  std::vector<Stream> made;
  for (int i = 0; i < 64 && (made.empty() || made.back().handle() != gone); ++i) made.push_back(Stream::create(kDevice));
  if (made.back().handle() != gone) {
    std::printf("  (skipped: no stream was made at the destroyed one's address in 64 tries)\n");
  } else {
    void* now = nullptr;
    {
      WorkspaceUse use(handle, gone);
      now = handle.bound_workspace();
    }
    CHECK(now != nullptr && now != handle.workspace());
    // Not the old workspace while the destroyed stream's work may still use it: a new block, or
    // the old memory once the pool has waited for that work (its dead user needs a device
    // synchronisation before the free).
    CHECK(now != old || cudaEventQuery(spun) == cudaSuccess);
    {
      WorkspaceUse use(handle, gone);
      CHECK(handle.bound_workspace() == now);  // and it is kept for the new stream
    }
  }
  // The own workspace, left to a destroyed stream's address, is not handed to its successor.
  CublasHandle second(kDevice);
  Stream t = Stream::create(kDevice);
  const cudaStream_t t_gone = t.handle();
  {
    WorkspaceUse use(second, t_gone);
    CHECK(second.bound_workspace() == second.workspace());
  }
  t = Stream();
  std::vector<Stream> again;
  for (int i = 0; i < 64 && (again.empty() || again.back().handle() != t_gone); ++i) again.push_back(Stream::create(kDevice));
  if (again.back().handle() == t_gone) {
    WorkspaceUse use(second, t_gone);
    CHECK(second.bound_workspace() != second.workspace());
    CHECK(second.bound_workspace() != nullptr);
  }
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize", kDevice);
  cudaEventDestroy(spun);
  cudaStreamDestroy(first);
}

int main() { return ::check::run_all_or_cpu_cases("args:"); }

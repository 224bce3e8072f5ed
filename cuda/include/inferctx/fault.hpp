// Test-only failure injection: makes the N-th call at one kind of site fail with a chosen code,
// so that tests can reach every error path of the allocations, virtual-memory calls, stream and
// event creation, cuBLAS calls, the pool's device synchronisations, the stream handshakes and the
// asynchronous copies. Compiled in only with
// INFERCTX_FAULT_INJECTION (CMake option of the same name, which the ctest build turns on); in
// every other build `invoke` is the call itself and `injected` is a constant 0, so release builds
// carry none of it.
#pragma once

#include <cstdint>

namespace inferctx::fault {

enum class Site : int {
  device_alloc = 0,    // cudaMalloc, cudaMallocFromPoolAsync, cudaMemPoolCreate
  pinned_alloc = 1,    // cudaHostAlloc
  virtual_memory = 2,  // cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease
  event = 3,           // cudaEventCreate*
  stream = 4,          // cudaStreamCreate*
  cublas = 5,          // every cuBLAS / cuBLASLt status checked (the call runs; its status is replaced)
  synchronize = 6,     // the pool's cudaDeviceSynchronize (a block's unordered free, trim)
  handshake = 7,       // a stream join of the Python layer (its cudaEventRecord + cudaStreamWaitEvent)
  copy = 8,            // cudaMemcpyAsync of copy_async and of the workspace's kept contents
};
inline constexpr int kSiteCount = 9;

#if defined(INFERCTX_FAULT_INJECTION) && INFERCTX_FAULT_INJECTION
inline constexpr bool kCompiledIn = true;
// Counts one call at `site`; returns the armed code when it is the armed call, else 0.
int injected(Site site) noexcept;
// From now, the `nth` call at `site` (1: the next) fails with `code` (a cudaError_t, CUresult or
// cublasStatus_t value, as the site's calls return); nth <= 0 disarms the site. Resets its count.
void arm(Site site, int64_t nth, int code) noexcept;
void disarm_all() noexcept;          // every site, counts reset
int64_t calls(Site site) noexcept;   // calls counted at `site` since it was last armed or reset
#else
inline constexpr bool kCompiledIn = false;
constexpr int injected(Site) noexcept { return 0; }
#endif

// `call()`, unless the call at `site` is the armed one: then the armed code, and `call` never runs
// (nothing is allocated or created that the failure path would have to undo).
template <class Status, class Call>
inline Status invoke(Site site, Call&& call) {
  const int code = injected(site);
  return code != 0 ? static_cast<Status>(code) : call();
}

}  // namespace inferctx::fault

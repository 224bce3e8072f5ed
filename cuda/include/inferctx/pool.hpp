// A stream-ordered pool of device memory per device, for what inferctx allocates itself
// (DeviceView results of kernels, temporaries). Built on CUDA's stream-ordered allocator
// (cudaMallocAsync / cudaFreeAsync) over a pool of our own with the release threshold at its
// maximum, so freed blocks stay reserved for the next allocation: after warm-up no call reaches
// cudaMalloc or cudaFree. trim() gives the unused memory back to the device.
//
// Ordering. A block is allocated on the stream that first uses it. Every stream that later
// reads or writes it is noted (note_use: kernels that take it as an operand, DLPack exports
// with the consumer's stream); a use whose stream is not known (a __cuda_array_interface__
// export, a DLPack export with stream -1) is noted as such. When the last owner lets go, the
// block is freed on the pool's own stream after that stream has waited (by events recorded
// then) for every noted stream (or, used on one such stream only, in that stream's order). An
// event can be recorded at that time only on a stream that still exists, so this is done for the
// durable streams (the legacy default stream, the pool's own, and those note_durable names: the
// contexts' own and comm streams) and for the streams Stream::create made (an inferctx.Stream())
// while they exist: each use notes the stream's number (owned_stream_serial), so a later stream
// given a destroyed one's address is not taken for it, and the free holds them alive
// (OwnedStreamsHold) while it queues. A use on any other stream (a stream of another library; the
// per-thread default stream of another thread than the freeing one: that handle names the
// calling thread's), or an unknown use, is waited for by a device-wide synchronisation before
// the free. That synchronisation is refused while any thread captures
// into a CUDA graph on the device, and the attempt invalidates that capture, in every capture
// mode: a block used on such a stream is not to be let go while a capture is in progress. Where
// it is refused, the block stays allocated (and counted) until a later one succeeds (the next
// such free, or trim()). A block whose durable streams include one that is capturing when it
// is let go is kept the same way, with no synchronisation tried, whatever its other uses
// (nothing may be queued on a capturing stream but the graph's own work, and the synchronisation
// would end that capture in error).
// So memory is never handed out again while any stream that was seen using it may still do so.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "inferctx/memory.hpp"
#include "inferctx/stream.hpp"

namespace inferctx {

struct PoolStats {
  int64_t reserved_bytes;       // device memory the pool holds now
  int64_t used_bytes;           // of which handed out
  int64_t peak_reserved_bytes;  // high-water marks since the pool was made or reset_peak()
  int64_t peak_used_bytes;
  int64_t allocations;          // blocks handed out and not yet freed (deferred frees included)
};

class DevicePool;

// A block of a DevicePool; freed stream-ordered when destroyed (see above).
class PooledAllocation final : public DeviceAllocation {
 public:
  ~PooledAllocation() override;
  // Records that `stream` uses the memory (1 and 2: the legacy and per-thread default streams).
  void note_use(cudaStream_t stream);
  // Records a use on a stream that is not known.
  void note_unknown_use() noexcept;

 private:
  friend class DevicePool;
  PooledAllocation(std::shared_ptr<DevicePool> pool, int device, void* ptr, int64_t bytes, cudaStream_t first);
  std::shared_ptr<DevicePool> pool_;
  std::mutex mutex_;
  std::vector<cudaStream_t> users_;
  std::vector<uint64_t> user_serials_;  // owned_stream_serial of each of users_ when it was noted
  std::vector<uint64_t> per_thread_users_;  // threads (this_thread_serial) that noted cudaStreamPerThread
  bool unknown_use_ = false;
};

class DevicePool : public std::enable_shared_from_this<DevicePool> {
 public:
  // The pool of `device` (-1: the current device), created on first use; thread-safe.
  static std::shared_ptr<DevicePool> of(int device);

  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  int device() const noexcept { return device_; }
  // `bytes` >= 0 (0 gives an empty allocation with a null pointer) usable on `stream` in stream
  // order. CudaError (cudaErrorMemoryAllocation) when the device is out of memory.
  std::shared_ptr<PooledAllocation> allocate(int64_t bytes, cudaStream_t stream);
  // The same, usable on every stream when it returns (allocated on the pool's own stream, which
  // is then synchronised): for memory whose first user is not known, or is being captured.
  std::shared_ptr<PooledAllocation> allocate_now(int64_t bytes);
  PoolStats stats() const;
  void reset_peak();
  // Waits for the pending frees (synchronising the device), then returns the unused memory to the
  // device, keeping at least
  // `keep_bytes` reserved. Returns the bytes reserved afterwards.
  int64_t trim(int64_t keep_bytes = 0);
  cudaStream_t free_stream() const noexcept { return free_stream_; }
  // Declares a stream that lives as long as the process (see Ordering above).
  void note_durable(cudaStream_t stream);

 private:
  explicit DevicePool(int device);
  friend class PooledAllocation;
  // `other_threads_per_thread_stream`: cudaStreamPerThread was noted on a thread other than the
  // calling one (which that handle does not name here).
  // `serials`: owned_stream_serial of each of `users` when its use was noted.
  void release(void* ptr, const std::vector<cudaStream_t>& users, const std::vector<uint64_t>& serials,
               bool unknown_use, bool other_threads_per_thread_stream) noexcept;
  cudaEvent_t take_event();           // from the free list (or a new one)
  void give_event(cudaEvent_t event) noexcept;
  uint64_t deferral_mark();  // taken before a device synchronisation, for free_deferred
  // Frees the blocks deferred before `before` was taken (after a device synchronisation that
  // began after it).
  void free_deferred(uint64_t before) noexcept;
  void freed() noexcept;  // a block's free is queued: one allocation fewer
  // Whether one of `users` that may be asked (a durable stream, a live stream Stream::create
  // made that `owned` keeps alive, or the calling thread's per-thread default stream; on
  // device_) captures a CUDA graph now. Takes mutex_.
  bool durable_user_captures(const std::vector<cudaStream_t>& users, const std::vector<uint64_t>& serials,
                             const OwnedStreamsHold& owned) const noexcept;

  int device_ = 0;
  cudaMemPool_t pool_ = nullptr;
  cudaStream_t free_stream_ = nullptr;
  mutable std::mutex mutex_;
  std::vector<cudaEvent_t> events_;
  std::vector<cudaStream_t> durable_;
  // Blocks whose users could not be waited for when let go (the device synchronisation was
  // refused); freed after the next one that succeeds.
  struct Deferred {
    void* ptr;
    uint64_t mark;
  };
  std::vector<Deferred> deferred_;
  uint64_t next_deferral_ = 0;
  int64_t live_ = 0;
  bool durable(cudaStream_t stream) const;  // mutex_ held
};

}  // namespace inferctx

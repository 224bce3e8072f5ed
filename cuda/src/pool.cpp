#include "inferctx/pool.hpp"

#include <algorithm>
#include <atomic>
#include <limits>
#include <map>
#include <string>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/fault.hpp"
#include "inferctx/stream.hpp"

namespace inferctx {

namespace {

struct PoolRegistry {
  std::mutex mutex;
  std::map<int, std::shared_ptr<DevicePool>> pools;
};

PoolRegistry& registry() {
  // Never destroyed: blocks may be freed by owners that outlive static destruction order.
  static PoolRegistry* r = new PoolRegistry();
  return *r;
}

int64_t pool_attribute(cudaMemPool_t pool, cudaMemPoolAttr attr, int device) {
  uint64_t value = 0;
  check_cuda(cudaMemPoolGetAttribute(pool, attr, &value), "cudaMemPoolGetAttribute", device);
  return static_cast<int64_t>(value);
}

}  // namespace

std::shared_ptr<DevicePool> DevicePool::of(int device) {
  if (device < 0) device = current_device();
  check_device_ordinal(device);
  PoolRegistry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::shared_ptr<DevicePool>& slot = r.pools[device];
  if (!slot) slot.reset(new DevicePool(device));
  return slot;
}

DevicePool::DevicePool(int device) : device_(device) {
  CurrentDeviceScope on(device);
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  INFERCTX_CUDA_AT(device_alloc, cudaMemPoolCreate(&pool_, &props), device);
  // Freed blocks stay in the pool: without this the pool returns them to the device at every
  // synchronisation, and the next allocation reaches the driver again.
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  try {
    INFERCTX_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold), device);
    INFERCTX_CUDA_AT(stream, cudaStreamCreateWithFlags(&free_stream_, cudaStreamNonBlocking), device);
  } catch (...) {
    cudaMemPoolDestroy(pool_);
    throw;
  }
}

DevicePool::~DevicePool() {
  CurrentDeviceScope on(device_, std::nothrow);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  if (free_stream_ != nullptr) {
    cudaStreamSynchronize(free_stream_);
    cudaStreamDestroy(free_stream_);
  }
  if (pool_ != nullptr) cudaMemPoolDestroy(pool_);
  cudaGetLastError();
}

std::shared_ptr<PooledAllocation> DevicePool::allocate(int64_t bytes, cudaStream_t stream) {
  if (bytes < 0) {
    throw ConfigError("bytes", "bytes: a pool allocation got " + std::to_string(bytes) + "; a byte count must be >= 0");
  }
  require_explicit_stream(stream, "DevicePool::allocate");
  void* ptr = nullptr;
  if (bytes > 0) {
    CurrentDeviceScope on(device_);
    const cudaError_t status = fault::invoke<cudaError_t>(fault::Site::device_alloc, [&] {
      return cudaMallocFromPoolAsync(&ptr, static_cast<size_t>(bytes), pool_, stream);
    });
    if (status != cudaSuccess) {
      const std::string call = "cudaMallocFromPoolAsync(" + std::to_string(bytes) + " bytes)";
      throw_cuda_error(status, call.c_str(), device_);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++live_;
  }
  return std::shared_ptr<PooledAllocation>(new PooledAllocation(shared_from_this(), device_, ptr, bytes, stream));
}

std::shared_ptr<PooledAllocation> DevicePool::allocate_now(int64_t bytes) {
  std::shared_ptr<PooledAllocation> block = allocate(bytes, free_stream_);
  CurrentDeviceScope on(device_);
  INFERCTX_CUDA(cudaStreamSynchronize(free_stream_), device_);
  return block;
}

PoolStats DevicePool::stats() const {
  CurrentDeviceScope on(device_);
  PoolStats s{};
  s.reserved_bytes = pool_attribute(pool_, cudaMemPoolAttrReservedMemCurrent, device_);
  s.used_bytes = pool_attribute(pool_, cudaMemPoolAttrUsedMemCurrent, device_);
  s.peak_reserved_bytes = pool_attribute(pool_, cudaMemPoolAttrReservedMemHigh, device_);
  s.peak_used_bytes = pool_attribute(pool_, cudaMemPoolAttrUsedMemHigh, device_);
  std::lock_guard<std::mutex> lock(mutex_);
  s.allocations = live_;
  return s;
}

void DevicePool::reset_peak() {
  CurrentDeviceScope on(device_);
  uint64_t zero = 0;
  INFERCTX_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero), device_);
  INFERCTX_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &zero), device_);
}

int64_t DevicePool::trim(int64_t keep_bytes) {
  if (keep_bytes < 0) {
    throw ConfigError("keep_bytes", "keep_bytes: got " + std::to_string(keep_bytes) + "; it must be >= 0");
  }
  CurrentDeviceScope on(device_);
  // Blocks whose free is still queued (on the free stream or a durable stream) are in use until
  // their stream reaches it.
  const uint64_t before = deferral_mark();
  INFERCTX_CUDA(fault::invoke<cudaError_t>(fault::Site::synchronize, [] { return cudaDeviceSynchronize(); }),
                device_);
  free_deferred(before);
  INFERCTX_CUDA(cudaStreamSynchronize(free_stream_), device_);
  INFERCTX_CUDA(cudaMemPoolTrimTo(pool_, static_cast<size_t>(keep_bytes)), device_);
  return pool_attribute(pool_, cudaMemPoolAttrReservedMemCurrent, device_);
}

cudaEvent_t DevicePool::take_event() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!events_.empty()) {
      cudaEvent_t e = events_.back();
      events_.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  INFERCTX_CUDA_AT(event, cudaEventCreateWithFlags(&e, cudaEventDisableTiming), device_);
  return e;
}

void DevicePool::give_event(cudaEvent_t event) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back(event);
}

void DevicePool::note_durable(cudaStream_t stream) {
  require_explicit_stream(stream, "DevicePool::note_durable");
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::find(durable_.begin(), durable_.end(), stream) == durable_.end()) durable_.push_back(stream);
}

bool DevicePool::durable(cudaStream_t stream) const {
  // cudaStreamPerThread is decided by the caller: that handle names the calling thread's
  // stream, which is the user's only when the block is let go on the thread that used it.
  return stream == cudaStreamLegacy || stream == free_stream_ ||
         std::find(durable_.begin(), durable_.end(), stream) != durable_.end();
}

uint64_t DevicePool::deferral_mark() {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_deferral_;
}

void DevicePool::free_deferred(uint64_t before) noexcept {
  // Only blocks deferred before the synchronisation began: their users' work was queued by
  // then, so it is done. One deferred meanwhile (by another thread) waits for the next one.
  std::vector<void*> blocks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto done = std::stable_partition(deferred_.begin(), deferred_.end(),
                                      [&](const Deferred& d) { return d.mark >= before; });
    for (auto it = done; it != deferred_.end(); ++it) blocks.push_back(it->ptr);
    deferred_.erase(done, deferred_.end());
  }
  for (void* ptr : blocks) {
    if (cudaFreeAsync(ptr, free_stream_) != cudaSuccess) cudaGetLastError();
    freed();
  }
}

void DevicePool::release(void* ptr, const std::vector<cudaStream_t>& users, const std::vector<uint64_t>& serials,
                         bool unknown_use, bool other_threads_per_thread_stream) noexcept {
  if (ptr == nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    --live_;  // the others count until their free is queued
    return;
  }
  // The streams Stream::create made that are found alive stay so until the free is queued.
  OwnedStreamsHold owned;
  bool ordered = !unknown_use;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < users.size(); ++i) {
      const cudaStream_t user = users[i];
      ordered = ordered && (user == cudaStreamPerThread ? !other_threads_per_thread_stream
                                                        : durable(user) || owned.alive(user, serials[i]));
    }
  }
  CurrentDeviceScope on(device_, std::nothrow);
  if (durable_user_captures(users, serials, owned)) {
    // No free or event may be queued on a stream while it captures a CUDA graph (a free there
    // must name a block the graph allocated, and an event recorded there would pull the pool's
    // stream into the capture), and a block that also needs a device synchronisation (a use not
    // known, or on another stream) must not try one: it is refused during the capture and ends
    // the capture in error. The block waits, counted, for the next device synchronisation that
    // succeeds, which comes after the capture (the next such free, or trim()).
    std::lock_guard<std::mutex> lock(mutex_);
    deferred_.push_back({ptr, next_deferral_++});
    return;
  }
  if (ordered && users.size() == 1) {
    // Used on one stream only (the common case): freed in its order, where the next allocation
    // on it takes the block straight back.
    if (cudaFreeAsync(ptr, users.front()) == cudaSuccess) {
      freed();
      return;
    }
    cudaGetLastError();
  }
  if (ordered) {
    for (cudaStream_t user : users) {
      if (user == free_stream_) continue;
      cudaEvent_t event = nullptr;
      try {
        event = take_event();
      } catch (...) {
        ordered = false;
        break;
      }
      // The event is recorded now, after all the work queued on `user` (a durable stream, or a
      // live one `owned` keeps so), which includes every use of this block there.
      const bool ok = cudaEventRecord(event, user) == cudaSuccess &&
                      cudaStreamWaitEvent(free_stream_, event, 0) == cudaSuccess;
      give_event(event);  // reusable at once: a wait takes the state recorded at the time of the call
      if (!ok) {
        cudaGetLastError();
        ordered = false;
        break;
      }
    }
  }
  owned.unlock();  // nothing more is queued on the users' streams
  if (!ordered) {
    // A use on a stream that may be gone by now, or not known: wait for everything queued.
    const uint64_t before = deferral_mark();
    if (fault::invoke<cudaError_t>(fault::Site::synchronize, [] { return cudaDeviceSynchronize(); }) !=
        cudaSuccess) {
      // Refused (a thread captures into a CUDA graph on this device, whose capture the attempt
      // has invalidated, or the context failed): nothing says the users are done, so the block
      // is kept, and counted, until a later device synchronisation succeeds (the next such
      // free, or trim()).
      cudaGetLastError();
      std::lock_guard<std::mutex> lock(mutex_);
      deferred_.push_back({ptr, next_deferral_++});
      return;
    }
    free_deferred(before);
  }
  if (cudaFreeAsync(ptr, free_stream_) != cudaSuccess) {
    cudaGetLastError();
    // The stream-ordered free failed (a context error); a synchronous free is the last resort.
    if (cudaFree(ptr) != cudaSuccess) cudaGetLastError();
  }
  freed();
}

bool DevicePool::durable_user_captures(const std::vector<cudaStream_t>& users, const std::vector<uint64_t>& serials,
                                       const OwnedStreamsHold& owned) const noexcept {
  for (size_t i = 0; i < users.size(); ++i) {
    const cudaStream_t user = users[i];
    if (user == free_stream_) continue;
    {
      // Only a stream known to exist may be asked (another may be destroyed by now); the
      // per-thread handle names the calling thread's own stream, which does.
      std::lock_guard<std::mutex> lock(mutex_);
      if (user != cudaStreamPerThread && !durable(user) && !owned.alive(user, serials[i])) continue;
    }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    const cudaError_t status = cudaStreamIsCapturing(user, &capture);
    if (status != cudaSuccess) cudaGetLastError();
    // The legacy stream, asked while a blocking stream captures, is part of that capture.
    if (status == cudaErrorStreamCaptureImplicit || capture != cudaStreamCaptureStatusNone) return true;
  }
  return false;
}

void DevicePool::freed() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  --live_;
}

PooledAllocation::PooledAllocation(std::shared_ptr<DevicePool> pool, int device, void* ptr, int64_t bytes,
                                   cudaStream_t first)
    : DeviceAllocation(Borrowed{}, device, ptr, bytes), pool_(std::move(pool)) {
  user_serials_.push_back(owned_stream_serial(first));
  users_.push_back(first);
  if (first == cudaStreamPerThread) per_thread_users_.push_back(this_thread_serial());
}

PooledAllocation::~PooledAllocation() {
  std::vector<cudaStream_t> users;
  std::vector<uint64_t> serials;
  bool unknown = false;
  bool other_threads = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    users.swap(users_);
    serials.swap(user_serials_);
    unknown = unknown_use_;
    const uint64_t me = this_thread_serial();
    for (uint64_t id : per_thread_users_) other_threads = other_threads || id != me;
  }
  pool_->release(ptr_, users, serials, unknown, other_threads);
  ptr_ = nullptr;
}

void PooledAllocation::note_use(cudaStream_t stream) {
  require_explicit_stream(stream, "PooledAllocation::note_use");
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::find(users_.begin(), users_.end(), stream) == users_.end()) {
    // A stream first seen now is numbered now: a later stream at its address is another one. (One
    // seen before keeps its number, so a stream at the address of a destroyed one that the block
    // saw is taken for neither, and the free synchronises the device.)
    // (The number first: were the second push to fail, the two lists would still pair up.)
    user_serials_.push_back(owned_stream_serial(stream));
    users_.push_back(stream);
  }
  if (stream == cudaStreamPerThread) {
    // The handle means this thread's stream: which thread it was decides the free's ordering.
    const uint64_t id = this_thread_serial();
    if (std::find(per_thread_users_.begin(), per_thread_users_.end(), id) == per_thread_users_.end())
      per_thread_users_.push_back(id);
  }
}

void PooledAllocation::note_unknown_use() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  unknown_use_ = true;
}

}  // namespace inferctx

#include "inferctx/stream.hpp"

#include <atomic>
#include <deque>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "driver.hpp"

namespace inferctx {

namespace {

// Handles of the streams Stream::create made and a Stream destroyed, oldest first, at most
// kDestroyedKept. CUDA cannot be asked about a destroyed handle (it reads freed memory: an error
// code at best, a crash at worst); a stream created later at the same address takes it out.
constexpr size_t kDestroyedKept = 4096;
std::mutex destroyed_mutex;
std::unordered_set<cudaStream_t>& destroyed_set() {
  static auto* set = new std::unordered_set<cudaStream_t>();
  return *set;
}
std::deque<cudaStream_t>& destroyed_order() {
  static auto* order = new std::deque<cudaStream_t>();
  return *order;
}

void note_destroyed(cudaStream_t handle) noexcept {
  try {
    std::lock_guard<std::mutex> lock(destroyed_mutex);
    if (!destroyed_set().insert(handle).second) return;
    destroyed_order().push_back(handle);
    if (destroyed_order().size() > kDestroyedKept) {
      destroyed_set().erase(destroyed_order().front());
      destroyed_order().pop_front();
    }
  } catch (...) {
    // Out of memory: this handle goes unrecorded, and CUDA is asked about it.
  }
}

void note_created(cudaStream_t handle) noexcept {
  std::lock_guard<std::mutex> lock(destroyed_mutex);
  destroyed_set().erase(handle);
}

// The live streams Stream::create made, by handle, with their numbers (owned_stream_serial).
std::shared_mutex& owned_mutex() {
  static auto* m = new std::shared_mutex();
  return *m;
}
std::unordered_map<cudaStream_t, uint64_t>& owned_streams() {
  static auto* m = new std::unordered_map<cudaStream_t, uint64_t>();
  return *m;
}
uint64_t next_owned_serial = 1;  // under owned_mutex
std::atomic<uint64_t> owned_version{0};  // owned_streams_version: moved under owned_mutex

void note_owned(cudaStream_t handle) noexcept {
  try {
    std::unique_lock<std::shared_mutex> lock(owned_mutex());
    owned_streams()[handle] = next_owned_serial++;
    owned_version.fetch_add(1, std::memory_order_release);
  } catch (...) {
    // Out of memory: the stream goes unrecorded, and a block used on it is freed after a device
    // synchronisation, as for a stream of another library.
  }
}

void forget_owned(cudaStream_t handle) noexcept {
  std::unique_lock<std::shared_mutex> lock(owned_mutex());  // waits for the holders
  if (owned_streams().erase(handle) != 0) owned_version.fetch_add(1, std::memory_order_release);
}

}  // namespace

uint64_t this_thread_serial() noexcept {
  static std::atomic<uint64_t> next{1};
  thread_local const uint64_t serial = next.fetch_add(1, std::memory_order_relaxed);
  return serial;
}

uint64_t owned_stream_serial(cudaStream_t stream) noexcept {
  std::shared_lock<std::shared_mutex> lock(owned_mutex());
  const auto it = owned_streams().find(stream);
  return it == owned_streams().end() ? 0 : it->second;
}

uint64_t owned_streams_version() noexcept { return owned_version.load(std::memory_order_acquire); }

OwnedStreamsHold::OwnedStreamsHold() : lock_(owned_mutex()) {}

bool OwnedStreamsHold::alive(cudaStream_t stream, uint64_t serial) const noexcept {
  if (serial == 0 || !lock_.owns_lock()) return false;
  const auto it = owned_streams().find(stream);
  return it != owned_streams().end() && it->second == serial;
}

void OwnedStreamsHold::unlock() noexcept {
  if (lock_.owns_lock()) lock_.unlock();
}

bool stream_was_destroyed(cudaStream_t stream) noexcept {
  std::lock_guard<std::mutex> lock(destroyed_mutex);
  return destroyed_set().count(stream) != 0;
}

bool stream_is_on_device(cudaStream_t stream, int device) {
  if (stream == cudaStreamLegacy || stream == cudaStreamPerThread) return true;
  require_explicit_stream(stream, "stream_is_on_device");
  const detail::DriverApi& api = detail::driver();
  if (api.stream_get_ctx == nullptr || api.ctx_get_current == nullptr) {
    throw CudaError("the CUDA driver lacks " + api.missing, "cuStreamGetCtx",
                    static_cast<int>(CUDA_ERROR_NOT_FOUND), "CUDA_ERROR_NOT_FOUND", device);
  }
  CurrentDeviceScope on(device);
  INFERCTX_CUDA(cudaSetDevice(device), device);  // makes (and initialises) its primary context current
  CUcontext current = nullptr;
  detail::check_driver(api.ctx_get_current(&current), "cuCtxGetCurrent", device);
  CUcontext owner = nullptr;
  detail::check_driver(api.stream_get_ctx(reinterpret_cast<CUstream>(stream), &owner), "cuStreamGetCtx", device);
  return owner == current;
}

void require_explicit_stream(cudaStream_t stream, const char* where) {
  if (stream == nullptr) {
    throw ConfigError("stream", std::string("stream: ") + where +
                                    " got the null handle, which is the legacy default stream; pass a stream "
                                    "handle, or cudaStreamLegacy (1) / cudaStreamPerThread (2) to mean a "
                                    "default stream on purpose");
  }
}

Stream Stream::create(int device) {
  if (device < 0) device = current_device();
  CurrentDeviceScope on(device);
  Stream s;
  INFERCTX_CUDA_AT(stream, cudaStreamCreateWithFlags(&s.handle_, cudaStreamNonBlocking), device);
  note_created(s.handle_);
  note_owned(s.handle_);
  s.device_ = device;
  s.owned_ = true;
  return s;
}

Stream Stream::borrow(cudaStream_t handle, int device) {
  require_explicit_stream(handle, "Stream::borrow");
  if (device < 0) INFERCTX_CUDA(cudaStreamGetDevice(handle, &device), -1);
  Stream s;
  s.handle_ = handle;
  s.device_ = device;
  s.owned_ = false;
  return s;
}

Stream::~Stream() {
  if (owned_ && handle_ != nullptr) {
    CurrentDeviceScope on(device_, std::nothrow);
    // Noted first: once destroyed, the address may be given to a stream created meanwhile on
    // another thread, which note_created must be able to take out of the set; and no pool may be
    // queueing on it (forget_owned waits for the OwnedStreamsHold holders).
    forget_owned(handle_);
    note_destroyed(handle_);
    // Work still queued completes; the destroy returns at once and frees the stream after it.
    if (cudaStreamDestroy(handle_) != cudaSuccess) cudaGetLastError();
  }
}

Stream::Stream(Stream&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)),
      device_(std::exchange(other.device_, -1)),
      owned_(std::exchange(other.owned_, false)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    Stream old(std::move(*this));  // destroys what this held, after the move
    handle_ = std::exchange(other.handle_, nullptr);
    device_ = std::exchange(other.device_, -1);
    owned_ = std::exchange(other.owned_, false);
  }
  return *this;
}

void Stream::synchronize() const {
  if (handle_ == nullptr) {
    throw ConfigError("stream", "stream: this Stream holds no handle (default-constructed or moved from); "
                                "create one with Stream::create or wrap one with Stream::borrow");
  }
  CurrentDeviceScope on(device_);
  INFERCTX_CUDA(cudaStreamSynchronize(handle_), device_);
}

Event::Event(int device, bool timing) : device_(device < 0 ? current_device() : device), timing_(timing) {
  CurrentDeviceScope on(device_);
  INFERCTX_CUDA_AT(event, cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming), device_);
}

Event::~Event() {
  if (event_ != nullptr) {
    CurrentDeviceScope on(device_, std::nothrow);
    if (cudaEventDestroy(event_) != cudaSuccess) cudaGetLastError();
  }
}

void Event::record(cudaStream_t stream) {
  require_explicit_stream(stream, "Event::record");
  CurrentDeviceScope on(device_);
  INFERCTX_CUDA(cudaEventRecord(event_, stream), device_);
}

void Event::make_wait(cudaStream_t stream) { make_wait(stream, -1); }

void Event::make_wait(cudaStream_t stream, int stream_device) {
  require_explicit_stream(stream, "Event::make_wait");
  const int on_device = stream_device < 0 ? device_ : stream_device;
  CurrentDeviceScope on(on_device);
  INFERCTX_CUDA(cudaStreamWaitEvent(stream, event_, 0), on_device);
}

bool Event::query() const {
  CurrentDeviceScope on(device_);
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaSuccess) return true;
  if (status == cudaErrorNotReady) return false;
  throw_cuda_error(status, "cudaEventQuery", device_);
}

void Event::synchronize() const {
  CurrentDeviceScope on(device_);
  INFERCTX_CUDA(cudaEventSynchronize(event_), device_);
}

float Event::elapsed_ms_since(const Event& start) const {
  if (!timing_ || !start.timing_) {
    throw ConfigError("timing", std::string("timing: elapsed time needs both events created with timing=true; "
                                            "the start event has timing=") +
                                    (start.timing_ ? "true" : "false") + ", this event timing=" +
                                    (timing_ ? "true" : "false"));
  }
  CurrentDeviceScope on(device_);
  float ms = 0.0f;
  INFERCTX_CUDA(cudaEventElapsedTime(&ms, start.event_, event_), device_);
  return ms;
}

}  // namespace inferctx

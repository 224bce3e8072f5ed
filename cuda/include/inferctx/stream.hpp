// CUDA streams and events: owned (created and destroyed here) or borrowed (external handles).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <shared_mutex>

#include "inferctx/cuda_check.hpp"

namespace inferctx {

// The null handle means the legacy default stream, which synchronises with every other
// blocking stream; taking it by omission is the classic bug, so the functions below that take
// a stream refuse nullptr with ConfigError("stream"). Pass cudaStreamLegacy (0x1) or
// cudaStreamPerThread (0x2) to mean a default stream on purpose.
void require_explicit_stream(cudaStream_t stream, const char* where);

// Whether `stream` belongs to `device`, asked in a way that is allowed while the stream captures
// a CUDA graph (cudaStreamGetDevice is not: it ends the capture in error): the stream's CUDA
// context against the device's primary context, which the runtime makes current for `device`.
// The default stream handles (cudaStreamLegacy, cudaStreamPerThread) belong to every device.
bool stream_is_on_device(cudaStream_t stream, int device);

// Whether `stream` is the handle of a stream that a Stream created and has destroyed (the last
// 4096 such handles; a stream created since at the same address is not). CUDA itself cannot be
// asked about a destroyed handle.
bool stream_was_destroyed(cudaStream_t stream) noexcept;

// The streams Stream::create made that are not destroyed yet, each numbered at its creation
// (never 0): CUDA may give a new stream the address of a destroyed one, whose queued work still
// runs, and the number tells the two apart. The number of the live one at `stream`, or 0 when
// `stream` is none of them (destroyed, borrowed, a default stream).
uint64_t owned_stream_serial(cudaStream_t stream) noexcept;
// Changes whenever Stream::create makes a stream or one it made is destroyed (one atomic load):
// a cache of owned_stream_serial's answers is current while this has not changed.
uint64_t owned_streams_version() noexcept;

// While one is held, no stream Stream::create made is destroyed (Stream's destructor waits for
// the holders), so work may be queued on the streams alive() names. Any number of holders at
// once; a holder must not destroy a Stream.
class OwnedStreamsHold {
 public:
  OwnedStreamsHold();
  // Whether `stream` is the live stream numbered `serial` (owned_stream_serial at the time of a
  // use): the one a use was seen on, not a later one at its address.
  bool alive(cudaStream_t stream, uint64_t serial) const noexcept;
  void unlock() noexcept;  // lets go early; alive() must not be asked after

 private:
  std::shared_lock<std::shared_mutex> lock_;
};

// A number for the calling thread, never given to another (std::thread::id values are reused
// once a thread ends): what cudaStreamPerThread names depends on it, so a block or workspace
// noted on one thread's per-thread stream is not taken for another's.
uint64_t this_thread_serial() noexcept;

class Stream {
 public:
  // A new non-blocking stream on `device` (-1: the current device; never the legacy default stream).
  static Stream create(int device);
  // Wraps a stream someone else owns; it is not destroyed here. `device` -1: the stream's
  // own device (cudaStreamGetDevice). nullptr is refused (see require_explicit_stream).
  static Stream borrow(cudaStream_t handle, int device);

  Stream() = default;
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t handle() const noexcept { return handle_; }
  bool owned() const noexcept { return owned_; }
  int device() const noexcept { return device_; }
  void synchronize() const;  // cudaStreamSynchronize, checked; ConfigError("stream") when empty

 private:
  cudaStream_t handle_ = nullptr;
  int device_ = -1;
  bool owned_ = false;
};

// An event created with cudaEventDisableTiming unless `timing` is true; `device` -1: the current one.
class Event {
 public:
  explicit Event(int device, bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t handle() const noexcept { return event_; }
  int device() const noexcept { return device_; }
  void record(cudaStream_t stream);        // cudaEventRecord; nullptr refused
  void make_wait(cudaStream_t stream);     // cudaStreamWaitEvent(stream, this); nullptr refused
  // The same with `stream_device` current (-1: this event's device): the device whose default
  // stream the handles cudaStreamLegacy and cudaStreamPerThread then name.
  void make_wait(cudaStream_t stream, int stream_device);
  bool query() const;                      // true when complete
  void synchronize() const;
  float elapsed_ms_since(const Event& start) const;  // both need timing=true (else ConfigError)
  bool timing() const noexcept { return timing_; }

 private:
  cudaEvent_t event_ = nullptr;
  int device_ = -1;
  bool timing_ = false;
};

}  // namespace inferctx

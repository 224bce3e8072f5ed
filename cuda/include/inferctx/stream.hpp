// CUDA streams and events: owned (created and destroyed here) or borrowed (external handles).
#pragma once

#include <cuda_runtime_api.h>

namespace inferctx {

class Stream {
 public:
  // A new non-blocking stream on `device` (never the legacy default stream).
  static Stream create(int device);
  // Wraps a stream someone else owns; it is not destroyed here.
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
  void synchronize() const;  // cudaStreamSynchronize, checked

 private:
  cudaStream_t handle_ = nullptr;
  int device_ = -1;
  bool owned_ = false;
};

// An event created with cudaEventDisableTiming unless `timing` is true.
class Event {
 public:
  explicit Event(int device, bool timing = false);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t handle() const noexcept { return event_; }
  int device() const noexcept { return device_; }
  void record(cudaStream_t stream);        // cudaEventRecord
  void make_wait(cudaStream_t stream);     // cudaStreamWaitEvent(stream, this)
  bool query() const;                      // true when complete
  void synchronize() const;
  float elapsed_ms_since(const Event& start) const;  // both need timing=true

 private:
  cudaEvent_t event_ = nullptr;
  int device_ = -1;
};

}  // namespace inferctx

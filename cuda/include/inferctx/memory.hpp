// RAII owners of device and page-locked host memory.
#pragma once

#include <cstdint>

namespace inferctx {

// Bytes from cudaMalloc on one device, freed (on that device) when destroyed.
// A failed allocation throws CudaError (code cudaErrorMemoryAllocation) and leaves nothing.
class DeviceAllocation {
 public:
  DeviceAllocation(int device, int64_t bytes);  // bytes >= 0; 0 gives a null pointer; device -1: current
  ~DeviceAllocation();
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;

  void* data() const noexcept { return ptr_; }
  int64_t size() const noexcept { return bytes_; }
  int device() const noexcept { return device_; }

 private:
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
  int device_ = 0;
};

// Page-locked host memory from cudaHostAlloc (portable), freed with cudaFreeHost.
class PinnedAllocation {
 public:
  explicit PinnedAllocation(int64_t bytes);  // bytes >= 0; 0 gives a null pointer
  ~PinnedAllocation();
  PinnedAllocation(const PinnedAllocation&) = delete;
  PinnedAllocation& operator=(const PinnedAllocation&) = delete;

  void* data() const noexcept { return ptr_; }
  int64_t size() const noexcept { return bytes_; }

 private:
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

// Asynchronous copy of `bytes` between any two pointers (cudaMemcpyDefault) on `stream`.
// `device` -1: the caller's current device. A null `stream` is refused (ConfigError("stream"):
// pass cudaStreamLegacy to mean the legacy default stream); bytes < 0 or a null pointer with
// bytes > 0 is a ConfigError; bytes == 0 does nothing.
void copy_async(void* dst, const void* src, int64_t bytes, void* stream, int device);

}  // namespace inferctx

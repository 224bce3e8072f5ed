// RAII owners of device and page-locked host memory.
#pragma once

#include <cstdint>

namespace inferctx {

// Device memory on one device that views hold through shared_ptr. This class's own
// constructor takes the bytes from cudaMalloc and its destructor frees them (on that device); a
// failed allocation throws CudaError (code cudaErrorMemoryAllocation) and leaves nothing.
// Other kinds of device memory (a stream-ordered pool's blocks, address ranges backed by CUDA
// virtual memory) derive from it: they construct it through the protected constructor, which
// records the range without owning it, and release it in their own destructors.
class DeviceAllocation {
 public:
  DeviceAllocation(int device, int64_t bytes);  // bytes >= 0; 0 gives a null pointer; device -1: current
  virtual ~DeviceAllocation();
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;

  void* data() const noexcept { return ptr_; }
  int64_t size() const noexcept { return bytes_; }
  int device() const noexcept { return device_; }
  // False while the range is reserved but has no physical memory behind it (a released
  // workspace under CUDA virtual memory): touching it then is an illegal memory access.
  virtual bool accessible() const noexcept { return true; }

 protected:
  struct Borrowed {};
  // A range that the derived class owns and frees; this base does not free it.
  DeviceAllocation(Borrowed, int device, void* ptr, int64_t bytes) noexcept
      : ptr_(ptr), bytes_(bytes), device_(device), owns_(false) {}

  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
  int device_ = 0;

 private:
  bool owns_ = true;  // cudaMalloc'ed by this class's public constructor
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

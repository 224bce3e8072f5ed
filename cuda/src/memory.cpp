#include "inferctx/memory.hpp"

#include <cuda_runtime_api.h>

#include <string>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/stream.hpp"

namespace inferctx {

namespace {

void require_byte_count(int64_t bytes, const char* what) {
  if (bytes < 0) {
    throw ConfigError("bytes", std::string("bytes: ") + what + " got " + std::to_string(bytes) +
                                   "; a byte count must be >= 0");
  }
}

}  // namespace

DeviceAllocation::DeviceAllocation(int device, int64_t bytes) : device_(device) {
  require_byte_count(bytes, "DeviceAllocation");
  if (bytes == 0) return;
  if (device < 0) device_ = current_device();
  CurrentDeviceScope on(device_);
  void* ptr = nullptr;
  const cudaError_t status =
      fault::invoke<cudaError_t>(fault::Site::device_alloc, [&] { return cudaMalloc(&ptr, static_cast<size_t>(bytes)); });
  if (status != cudaSuccess) {
    // throw_cuda_error also clears the error state, so a failed allocation does not surface
    // later as the error of an unrelated call.
    const std::string call = "cudaMalloc(" + std::to_string(bytes) + " bytes)";
    throw_cuda_error(status, call.c_str(), device_);
  }
  ptr_ = ptr;
  bytes_ = bytes;
}

DeviceAllocation::~DeviceAllocation() {
  if (ptr_ == nullptr || !owns_) return;
  CurrentDeviceScope on(device_, std::nothrow);
  if (cudaFree(ptr_) != cudaSuccess) cudaGetLastError();
}

PinnedAllocation::PinnedAllocation(int64_t bytes) {
  require_byte_count(bytes, "PinnedAllocation");
  if (bytes == 0) return;
  void* ptr = nullptr;
  const cudaError_t status = fault::invoke<cudaError_t>(
      fault::Site::pinned_alloc, [&] { return cudaHostAlloc(&ptr, static_cast<size_t>(bytes), cudaHostAllocPortable); });
  if (status != cudaSuccess) {
    const std::string call = "cudaHostAlloc(" + std::to_string(bytes) + " bytes, cudaHostAllocPortable)";
    throw_cuda_error(status, call.c_str(), -1);
  }
  ptr_ = ptr;
  bytes_ = bytes;
}

PinnedAllocation::~PinnedAllocation() {
  if (ptr_ != nullptr && cudaFreeHost(ptr_) != cudaSuccess) cudaGetLastError();
}

void copy_async(void* dst, const void* src, int64_t bytes, void* stream, int device) {
  require_byte_count(bytes, "copy_async");
  if (bytes == 0) return;
  if (dst == nullptr || src == nullptr) {
    throw ConfigError(dst == nullptr ? "dst" : "src",
                      std::string(dst == nullptr ? "dst" : "src") + ": copy_async of " + std::to_string(bytes) +
                          " bytes got a null pointer; both pointers must be valid for that many bytes");
  }
  const auto s = static_cast<cudaStream_t>(stream);
  require_explicit_stream(s, "copy_async");
  if (device < 0) {
    INFERCTX_CUDA_AT(copy, cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, s), -1);
    return;
  }
  CurrentDeviceScope on(device);
  INFERCTX_CUDA_AT(copy, cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, s), device);
}

}  // namespace inferctx

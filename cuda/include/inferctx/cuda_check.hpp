// Status checks for every CUDA runtime and cuBLAS call: failures become CudaError /
// CublasError naming the call, the code and the device.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <new>
#include <string>

#include "inferctx/errors.hpp"
#include "inferctx/fault.hpp"

namespace inferctx {

// Throws CudaError (NoCudaDeviceError when there is no usable device or driver).
[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, int device);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, int device);
const char* cublas_status_name(cublasStatus_t status);

// What an error code says about the process beyond the call that failed, to append to a
// message (empty when nothing): that the CUDA context is lost (a sticky error: an illegal
// address, a kernel fault; every later CUDA call fails and the process must restart), or that
// this process was forked after its parent had initialised CUDA. `code` is a cudaError_t or a
// CUresult (their values agree for these errors).
std::string process_state_hint(int code);
// Whether `code` (cudaError_t or CUresult) is a sticky error: the CUDA context is lost.
bool is_sticky_error(int code) noexcept;

inline void check_cuda(cudaError_t status, const char* call, int device = -1) {
  if (status != cudaSuccess) throw_cuda_error(status, call, device);
}

inline void check_cublas(cublasStatus_t status, const char* call, int device = -1) {
  // A test build may turn a call's success into the armed failure (the call has run; what it
  // made is undone by its owner's failure path, as for a real failure reported late).
  if (const int code = fault::injected(fault::Site::cublas); code != 0 && status == CUBLAS_STATUS_SUCCESS) {
    status = static_cast<cublasStatus_t>(code);
  }
  if (status != CUBLAS_STATUS_SUCCESS) throw_cublas_error(status, call, device);
}

// Makes `device` current for a scope and restores the caller's device on exit, so that
// calls on behalf of one context never change which device the caller's thread targets.
// A negative `device` leaves the current device as it is.
class CurrentDeviceScope {
 public:
  explicit CurrentDeviceScope(int device);                  // CudaError when the switch fails
  CurrentDeviceScope(int device, std::nothrow_t) noexcept;  // best effort, for destructors
  ~CurrentDeviceScope();
  int device() const noexcept { return current_; }  // the device current inside the scope
  CurrentDeviceScope(const CurrentDeviceScope&) = delete;
  CurrentDeviceScope& operator=(const CurrentDeviceScope&) = delete;

 private:
  int previous_ = -1;
  int current_ = -1;
  bool switched_ = false;
};

// Number of devices; throws NoCudaDeviceError when there are none or no driver.
int device_count();
// Current device of the calling thread.
int current_device();
// Throws ConfigError("device") when `device` is not in [0, device_count()).
void check_device_ordinal(int device);

struct MemoryInfo {
  int64_t free_bytes;
  int64_t total_bytes;
};
// cudaMemGetInfo on `device`, read now (never cached).
MemoryInfo memory_info(int device);

}  // namespace inferctx

#define INFERCTX_CUDA(call, device) ::inferctx::check_cuda((call), #call, (device))
// INFERCTX_CUDA for a call at a failure-injection site (fault::Site::<site>): in a test build the
// armed call fails with the armed code without running.
#define INFERCTX_CUDA_AT(site, call, device)                                                             \
  ::inferctx::check_cuda(                                                                              \
      ::inferctx::fault::invoke<cudaError_t>(::inferctx::fault::Site::site, [&] { return (call); }), #call, \
      (device))
#define INFERCTX_CUBLAS(call, device) ::inferctx::check_cublas((call), #call, (device))

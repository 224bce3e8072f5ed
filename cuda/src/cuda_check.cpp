#include "inferctx/cuda_check.hpp"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <string>

namespace inferctx {

namespace {

// Set in the child of every fork() after this library was loaded; read only on error paths.
std::atomic<bool> forked_child{false};
void note_forked_child() { forked_child.store(true, std::memory_order_relaxed); }
const int fork_handler_registered = pthread_atfork(nullptr, nullptr, note_forked_child);

bool means_no_device(cudaError_t status) {
  return status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver ||
         status == cudaErrorDevicesUnavailable || status == cudaErrorCompatNotSupportedOnDevice ||
         status == cudaErrorSystemDriverMismatch || status == cudaErrorSystemNotReady;
}

}  // namespace

CurrentDeviceScope::CurrentDeviceScope(int device) {
  check_cuda(cudaGetDevice(&previous_), "cudaGetDevice", device);
  current_ = previous_;
  if (device >= 0 && previous_ != device) {
    check_cuda(cudaSetDevice(device), "cudaSetDevice", device);
    current_ = device;
    switched_ = true;
  }
}

CurrentDeviceScope::CurrentDeviceScope(int device, std::nothrow_t) noexcept {
  if (cudaGetDevice(&previous_) != cudaSuccess) {
    // Clear only our own failure; an error the caller has not collected yet is theirs.
    cudaGetLastError();
    return;
  }
  current_ = previous_;
  if (device >= 0 && previous_ != device) {
    if (cudaSetDevice(device) == cudaSuccess) {
      current_ = device;
      switched_ = true;
    } else {
      cudaGetLastError();
    }
  }
}

CurrentDeviceScope::~CurrentDeviceScope() {
  if (switched_ && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
}

bool is_sticky_error(int code) noexcept {
  switch (code) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

std::string process_state_hint(int code) {
  (void)fork_handler_registered;
  if (forked_child.load(std::memory_order_relaxed)) {
    return ". This process was forked from its parent; a child forked after its parent initialised "
           "CUDA cannot use CUDA: start worker processes fresh (the 'spawn' start method), not by fork";
  }
  if (is_sticky_error(code)) {
    return ". The CUDA context of this process is lost (a kernel faulted): every later CUDA call in "
           "this process fails the same way; restart the process";
  }
  return "";
}

void throw_cuda_error(cudaError_t status, const char* call, int device) {
  const std::string name = cudaGetErrorName(status);
  const std::string text = cudaGetErrorString(status);
  // Clear a non-sticky error so that it does not resurface at the next unrelated call.
  cudaGetLastError();
  if (means_no_device(status)) {
    throw with_remedy(NoCudaDeviceError(name + ": " + text + " (in " + call + "); no usable CUDA device or driver.",
                                        call, static_cast<int>(status), name),
                      Remedy::PlanWithoutDevice);
  }
  std::string where = device >= 0 ? " on device " + std::to_string(device) : "";
  std::string hint;
  if (status == cudaErrorMemoryAllocation) hint = "; free memory on the device or plan a smaller workspace";
  hint += process_state_hint(static_cast<int>(status));
  throw CudaError(name + ": " + text + " (in " + call + where + ")" + hint, call, static_cast<int>(status), name,
                  device);
}

const char* cublas_status_name(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

void throw_cublas_error(cublasStatus_t status, const char* call, int device) {
  const std::string name = cublas_status_name(status);
  std::string where = device >= 0 ? " on device " + std::to_string(device) : "";
  // cuBLAS reports a lost context as an execution failure; the runtime knows which it was.
  const std::string hint = process_state_hint(static_cast<int>(cudaPeekAtLastError()));
  throw CublasError(name + " (in " + call + where + ")" + hint, call, static_cast<int>(status), name, device);
}

int device_count() {
  int n = 0;
  check_cuda(cudaGetDeviceCount(&n), "cudaGetDeviceCount", -1);
  if (n <= 0) {
    throw NoCudaDeviceError("no CUDA device is visible (cudaGetDeviceCount gave 0). Planning works without one.",
                            "cudaGetDeviceCount", static_cast<int>(cudaErrorNoDevice), "cudaErrorNoDevice");
  }
  return n;
}

int current_device() {
  device_count();
  int d = 0;
  check_cuda(cudaGetDevice(&d), "cudaGetDevice", -1);
  return d;
}

void check_device_ordinal(int device) {
  const int n = device_count();
  if (device < 0 || device >= n) {
    throw ConfigError("device", "device: got " + std::to_string(device) + "; valid device ordinals are 0.." +
                                    std::to_string(n - 1));
  }
}

MemoryInfo memory_info(int device) {
  check_device_ordinal(device);
  CurrentDeviceScope scope(device);
  size_t free_b = 0, total_b = 0;
  check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo", device);
  return {static_cast<int64_t>(free_b), static_cast<int64_t>(total_b)};
}

}  // namespace inferctx

#include "inferctx/blas.hpp"

#include <string>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/plan.hpp"
#include "inferctx/stream.hpp"

namespace inferctx {

int64_t cublas_workspace_bytes(int cc_major) {
  if (cc_major < 1) {
    throw ConfigError("cc_major", "cc_major: got " + std::to_string(cc_major) +
                                      "; a compute capability major version is >= 1 (e.g. 9 for sm_90)");
  }
  return cc_major >= 9 ? 32 * kMiB : 4 * kMiB;
}

CublasHandle::CublasHandle(int device) : device_(device) {
  CurrentDeviceScope on(device);
  int cc_major = 0;
  INFERCTX_CUDA(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device), device);
  try {
    INFERCTX_CUBLAS(cublasCreate(&handle_), device);
    INFERCTX_CUBLAS(cublasLtCreate(&lt_), device);
    workspace_ = std::make_unique<DeviceAllocation>(device, cublas_workspace_bytes(cc_major));
    // Without a workspace of its own cuBLAS allocates one per stream behind our back, and that
    // memory is invisible to the workspace planner.
    INFERCTX_CUBLAS(cublasSetWorkspace(handle_, workspace_->data(), static_cast<size_t>(workspace_->size())),
                    device);
    // Set explicitly: CUBLAS_TENSOR_OP_MATH (deprecated) would let fp32 GEMMs run in reduced precision.
    INFERCTX_CUBLAS(cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH), device);
    INFERCTX_CUDA(cudaEventCreateWithFlags(&last_use_, cudaEventDisableTiming), device);
  } catch (...) {
    destroy_handles();
    throw;
  }
}

CublasHandle::~CublasHandle() { destroy_handles(); }

void CublasHandle::destroy_handles() noexcept {
  CurrentDeviceScope on(device_, std::nothrow);
  // The handles go before the workspace they may still reference (the member is freed later).
  if (handle_ != nullptr) {
    cublasDestroy(handle_);  // a destructor cannot report a failure; the handle is gone either way
    handle_ = nullptr;
  }
  if (lt_ != nullptr) {
    cublasLtDestroy(lt_);
    lt_ = nullptr;
  }
  if (last_use_ != nullptr) {
    cudaEventDestroy(last_use_);
    last_use_ = nullptr;
  }
}

void CublasHandle::set_stream(cudaStream_t stream) {
  require_explicit_stream(stream, "CublasHandle::set_stream");
  CurrentDeviceScope on(device_);
  INFERCTX_CUBLAS(bind_stream(stream), device_);
  stream_ = stream;
}

cublasStatus_t CublasHandle::bind_stream(cudaStream_t stream) noexcept {
  const cublasStatus_t status = cublasSetStream(handle_, stream);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  return cublasSetWorkspace(handle_, workspace_->data(), static_cast<size_t>(workspace_->size()));
}

bool CublasHandle::begin_use(cudaStream_t stream) {
  require_explicit_stream(stream, "CublasHandle::begin_use");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  INFERCTX_CUDA(cudaStreamIsCapturing(stream, &capture), device_);
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  if (stream_ != stream) set_stream(stream);
  if (!capturing && last_use_stream_ != nullptr && last_use_stream_ != stream) {
    INFERCTX_CUDA(cudaStreamWaitEvent(stream, last_use_, 0), device_);
  }
  return capturing;
}

void CublasHandle::end_use(cudaStream_t stream, bool capturing) {
  if (capturing) return;
  INFERCTX_CUDA(cudaEventRecord(last_use_, stream), device_);
  last_use_stream_ = stream;
}

void CublasHandle::set_tf32(bool enabled) {
  CurrentDeviceScope on(device_);
  INFERCTX_CUBLAS(cublasSetMathMode(handle_, enabled ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH), device_);
  tf32_ = enabled;
}

}  // namespace inferctx

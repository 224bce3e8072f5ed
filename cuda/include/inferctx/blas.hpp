// The context's cuBLAS (and cuBLASLt) handle with its own workspace.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include <cstdint>
#include <memory>

#include "inferctx/memory.hpp"

namespace inferctx {

class CublasHandle {
 public:
  // Creates the handles on `device` with the default math mode (no TF32) and a workspace of
  // 32 MiB on sm_90 and newer, 4 MiB before, set with cublasSetWorkspace.
  explicit CublasHandle(int device);
  ~CublasHandle();
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;

  cublasHandle_t get() const noexcept { return handle_; }
  cublasLtHandle_t lt() const noexcept { return lt_; }
  void* workspace() const noexcept { return workspace_->data(); }
  int64_t workspace_bytes() const noexcept { return workspace_->size(); }
  int device() const noexcept { return device_; }

  void set_stream(cudaStream_t stream);  // bind_stream, checked; nullptr refused (stream.hpp)
  cudaStream_t stream() const noexcept { return stream_; }
  // Runs the handle's calls on `stream` (without recording it as stream()): cublasSetStream,
  // then cublasSetWorkspace again, because setting a stream resets cuBLAS to its own workspace
  // pool, memory the workspace planner cannot see. For binding back after a scoped switch and
  // for destructors.
  cublasStatus_t bind_stream(cudaStream_t stream) noexcept;
  // TF32 tensor-op math for fp32 GEMMs (CUBLAS_TF32_TENSOR_OP_MATH) when true, default otherwise.
  void set_tf32(bool enabled);
  bool tf32() const noexcept { return tf32_; }

 private:
  int device_ = 0;
  cublasHandle_t handle_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  std::unique_ptr<DeviceAllocation> workspace_;
  bool tf32_ = false;
  cudaStream_t stream_ = nullptr;  // nullptr until set_stream (cuBLAS then uses the legacy stream)

  void destroy_handles() noexcept;
};

// Workspace size for a device of compute capability major.minor (32 MiB from sm_90 on, 4 MiB
// before: cuBLAS's recommendation). ConfigError("cc_major") for cc_major < 1.
int64_t cublas_workspace_bytes(int cc_major);

}  // namespace inferctx

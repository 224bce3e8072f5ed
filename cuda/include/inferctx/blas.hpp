// The context's cuBLAS (and cuBLASLt) handle with its own workspace.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include <cstdint>
#include <memory>
#include <mutex>

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

  // One call at a time: cuBLAS handles are not safe to share between threads that switch their
  // stream, and the workspace is one buffer.
  std::mutex& mutex() noexcept { return mutex_; }
  // Before work on `stream` that uses the workspace (mutex held): binds the handle to `stream`
  // (with the workspace) and, when the workspace was last used on another stream, makes
  // `stream` wait for that use. Returns true when `stream` is being captured into a CUDA graph;
  // the hand-over is then left out (an event recorded outside a capture cannot be waited on in
  // it), so graphs that use the handle must not replay while another stream uses it.
  bool begin_use(cudaStream_t stream);
  // After that work (mutex held): records it as the workspace's last use.
  void end_use(cudaStream_t stream, bool capturing);

 private:
  int device_ = 0;
  cublasHandle_t handle_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  std::unique_ptr<DeviceAllocation> workspace_;
  bool tf32_ = false;
  cudaStream_t stream_ = nullptr;  // nullptr until set_stream (cuBLAS then uses the legacy stream)
  std::mutex mutex_;
  cudaEvent_t last_use_ = nullptr;       // recorded after the workspace's last use
  cudaStream_t last_use_stream_ = nullptr;

  void destroy_handles() noexcept;
};

// The handle's mutex held, and its workspace handed over to `stream`, for a scope: begin_use
// on entry, end_use on exit (also when the work in between throws).
class WorkspaceUse {
 public:
  WorkspaceUse(CublasHandle& handle, cudaStream_t stream) : lock_(handle.mutex()), handle_(handle), stream_(stream) {
    capturing_ = handle.begin_use(stream);
  }
  ~WorkspaceUse() {
    try {
      handle_.end_use(stream_, capturing_);
    } catch (...) {  // a destructor cannot report it; the next call's check will
    }
  }
  WorkspaceUse(const WorkspaceUse&) = delete;
  WorkspaceUse& operator=(const WorkspaceUse&) = delete;
  bool capturing() const noexcept { return capturing_; }

 private:
  std::lock_guard<std::mutex> lock_;
  CublasHandle& handle_;
  cudaStream_t stream_;
  bool capturing_ = false;
};

// Workspace size for a device of compute capability major.minor (32 MiB from sm_90 on, 4 MiB
// before: cuBLAS's recommendation). ConfigError("cc_major") for cc_major < 1.
int64_t cublas_workspace_bytes(int cc_major);

}  // namespace inferctx

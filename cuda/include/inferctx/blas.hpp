// The context's cuBLAS (and cuBLASLt) handle with its own workspace.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "inferctx/memory.hpp"

namespace inferctx {

class PooledAllocation;

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

  // bind_stream, checked, under mutex(); nullptr refused (stream.hpp).
  void set_stream(cudaStream_t stream);
  cudaStream_t stream() const noexcept { return stream_; }
  // Runs the handle's calls on `stream` (without recording it as stream()): cublasSetStream,
  // then cublasSetWorkspace again, because setting a stream resets cuBLAS to its own workspace
  // pool, memory the workspace planner cannot see. For binding back after a scoped switch and
  // for destructors.
  cublasStatus_t bind_stream(cudaStream_t stream) noexcept;
  // TF32 tensor-op math for fp32 GEMMs (CUBLAS_TF32_TENSOR_OP_MATH) when true, default otherwise.
  void set_tf32(bool enabled);  // under mutex()
  bool tf32() const noexcept { return tf32_; }

  // One call at a time: cuBLAS handles are not safe to share between threads that switch their
  // stream.
  std::mutex& mutex() noexcept { return mutex_; }
  // Before work on `stream` (mutex held): binds the handle to `stream` with that stream's
  // workspace. Each stream has its own (as torch keeps one per stream), so work on two streams
  // never shares one and no stream waits for another (cudaStreamPerThread counts as one stream
  // per thread, which it names): the first stream takes the workspace made
  // with the handle, later ones a block of the device pool. At most kMaxStreamWorkspaces are kept;
  // beyond that the least recently used is given back (freed after that stream's work), except
  // the workspaces of streams that were being captured into a CUDA graph, which the graph's
  // nodes keep using. The workspace of a stream Stream::create made is unbound once that stream
  // is destroyed (its GEMMs may still be queued on it): a stream made later at its address gets
  // another. Returns true when `stream` is being captured.
  bool begin_use(cudaStream_t stream);
  // The workspace bound by the last begin_use.
  void* bound_workspace() const noexcept { return bound_workspace_; }
  // Its bytes: workspace_bytes(), or 0 for a stream first seen while capturing (no memory can be
  // taken then; it gets its workspace at its first use outside a capture).
  int64_t bound_workspace_bytes() const noexcept { return bound_workspace_bytes_; }
  static constexpr int kMaxStreamWorkspaces = 8;

 private:
  int device_ = 0;
  cublasHandle_t handle_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  std::unique_ptr<DeviceAllocation> workspace_;
  bool tf32_ = false;
  cudaStream_t stream_ = nullptr;  // nullptr until set_stream (cuBLAS then uses the legacy stream)
  std::mutex mutex_;
  struct StreamWorkspace {
    cudaStream_t stream;
    uint64_t thread;  // cudaStreamPerThread names each thread's own: the thread seen (this_thread_serial), else 0
    void* ptr;
    std::shared_ptr<PooledAllocation> block;  // null for the handle's own workspace
    uint64_t last_use;
    bool captured;  // assigned while the stream was capturing: a graph may hold it
    // owned_stream_serial(stream) when the entry was made: a stream Stream::create made later at
    // a destroyed one's address has another, and must not share the workspace the destroyed
    // stream's queued GEMMs may still be using.
    uint64_t serial;
  };
  std::vector<StreamWorkspace> workspaces_;
  uint64_t uses_ = 0;
  void* bound_workspace_ = nullptr;
  int64_t bound_workspace_bytes_ = 0;
  StreamWorkspace& workspace_for(cudaStream_t stream, bool capturing);
  // Unbinds the entries whose stream Stream::create made and has destroyed since (see serial).
  void forget_gone_streams(bool capturing);
  uint64_t checked_version_ = 0;  // owned_streams_version() when the entries were last checked

  void destroy_handles() noexcept;
};

// The handle's mutex held, and the handle bound to `stream` with its workspace, for a scope.
class WorkspaceUse {
 public:
  WorkspaceUse(CublasHandle& handle, cudaStream_t stream) : lock_(handle.mutex()) {
    capturing_ = handle.begin_use(stream);
  }
  WorkspaceUse(const WorkspaceUse&) = delete;
  WorkspaceUse& operator=(const WorkspaceUse&) = delete;
  bool capturing() const noexcept { return capturing_; }

 private:
  std::lock_guard<std::mutex> lock_;
  bool capturing_ = false;
};

// Workspace size for a device of compute capability major.minor (32 MiB from sm_90 on, 4 MiB
// before: cuBLAS's recommendation). ConfigError("cc_major") for cc_major < 1.
int64_t cublas_workspace_bytes(int cc_major);

// cuBLAS and cuBLASLt build process-wide state with their first handle and register its teardown
// at exit then. An object whose destructor destroys handles must be built after that state, or
// it is destroyed after the state is gone (cublasLtDestroy then frees memory a second time).
// Creates and destroys one handle of each on `device` (the current device is kept), once per
// process; a failure is left to the real handle's creation to report. The context registry
// calls it before it is built.
void init_blas_libraries(int device) noexcept;

}  // namespace inferctx

#include "inferctx/blas.hpp"

#include <mutex>
#include <string>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/plan.hpp"
#include "inferctx/pool.hpp"
#include "inferctx/stream.hpp"

namespace inferctx {

int64_t cublas_workspace_bytes(int cc_major) {
  if (cc_major < 1) {
    throw ConfigError("cc_major", "cc_major: got " + std::to_string(cc_major) +
                                      "; a compute capability major version is >= 1 (e.g. 9 for sm_90)");
  }
  return cc_major >= 9 ? 32 * kMiB : 4 * kMiB;
}

void init_blas_libraries(int device) noexcept {
  static std::once_flag once;
  std::call_once(once, [device] {
    CurrentDeviceScope on(device, std::nothrow);
    cublasLtHandle_t lt = nullptr;
    if (cublasLtCreate(&lt) == CUBLAS_STATUS_SUCCESS) cublasLtDestroy(lt);
    cublasHandle_t handle = nullptr;
    if (cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS) cublasDestroy(handle);
  });
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
}

void CublasHandle::set_stream(cudaStream_t stream) {
  require_explicit_stream(stream, "CublasHandle::set_stream");
  // Not while another thread's GEMM is between begin_use and its cuBLAS call: that call would
  // run on `stream`, with the handle's own workspace.
  std::lock_guard<std::mutex> lock(mutex_);
  CurrentDeviceScope on(device_);
  INFERCTX_CUBLAS(bind_stream(stream), device_);
  stream_ = stream;
}

cublasStatus_t CublasHandle::bind_stream(cudaStream_t stream) noexcept {
  const cublasStatus_t status = cublasSetStream(handle_, stream);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  stream_ = stream;
  bound_workspace_ = workspace_->data();
  bound_workspace_bytes_ = workspace_->size();
  return cublasSetWorkspace(handle_, workspace_->data(), static_cast<size_t>(workspace_->size()));
}

CublasHandle::StreamWorkspace& CublasHandle::workspace_for(cudaStream_t stream, bool capturing) {
  // The per-thread default stream is one handle for as many streams as there are threads.
  const uint64_t thread = stream == cudaStreamPerThread ? this_thread_serial() : 0;
  // Streams Stream::create made were made or destroyed since the entries were last checked: an
  // entry whose stream is gone (its address perhaps another stream's now) is not to be matched.
  const uint64_t version = owned_streams_version();
  if (version != checked_version_) {
    forget_gone_streams(capturing);
    checked_version_ = version;
  }
  for (StreamWorkspace& w : workspaces_) {
    if (w.stream != stream || w.thread != thread) continue;
    if (w.ptr == nullptr && !capturing) {  // first seen in a capture: it gets memory now
      w.block = DevicePool::of(device_)->allocate_now(workspace_->size());
      w.block->note_use(stream);
      w.ptr = w.block->data();
    }
    return w;
  }
  const uint64_t serial = owned_stream_serial(stream);
  bool own_taken = false;
  for (const StreamWorkspace& w : workspaces_) own_taken = own_taken || w.block == nullptr;
  if (!own_taken) {
    workspaces_.push_back({stream, thread, workspace_->data(), nullptr, 0, capturing, serial});
    return workspaces_.back();
  }
  if (capturing) {
    // No memory can be taken while a stream captures (torch's global capture mode refuses any
    // allocation): its GEMMs run without a workspace, as cuBLAS allows, until it stops capturing.
    workspaces_.push_back({stream, thread, nullptr, nullptr, 0, false, serial});
    return workspaces_.back();
  }
  if (static_cast<int>(workspaces_.size()) >= kMaxStreamWorkspaces) {
    // Give back the least recently used pool workspace that no graph may hold; the pool frees it
    // after the work queued on its stream.
    auto victim = workspaces_.end();
    for (auto it = workspaces_.begin(); it != workspaces_.end(); ++it) {
      if (it->block != nullptr && !it->captured && (victim == workspaces_.end() || it->last_use < victim->last_use)) {
        victim = it;
      }
    }
    if (victim != workspaces_.end()) workspaces_.erase(victim);
  }
  // Made usable on every stream at once (not in stream order): `stream` may be capturing, and an
  // allocation inside a capture would belong to the graph.
  std::shared_ptr<PooledAllocation> block = DevicePool::of(device_)->allocate_now(workspace_->size());
  block->note_use(stream);  // freed, if ever, after the work queued on `stream`
  workspaces_.push_back({stream, thread, block->data(), block, 0, capturing, serial});
  return workspaces_.back();
}

void CublasHandle::forget_gone_streams(bool capturing) {
  for (auto it = workspaces_.begin(); it != workspaces_.end();) {
    if (it->stream == nullptr || it->serial == owned_stream_serial(it->stream)) {
      ++it;
      continue;
    }
    // The entry's stream was destroyed (its GEMMs perhaps still queued on the workspace). A pool
    // block goes back, freed after the device is done with it; but not while a stream captures
    // (that wait would end the capture in error), nor one a graph captured on that stream may
    // hold. Those, and the handle's own workspace (which cannot be known to be idle), are left
    // to no stream: the pool ones are given back with the least recently used later.
    if (capturing || it->captured || it->block == nullptr) {
      it->stream = nullptr;
      ++it;
    } else {
      it = workspaces_.erase(it);
    }
  }
}

bool CublasHandle::begin_use(cudaStream_t stream) {
  require_explicit_stream(stream, "CublasHandle::begin_use");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  INFERCTX_CUDA(cudaStreamIsCapturing(stream, &capture), device_);
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  StreamWorkspace& w = workspace_for(stream, capturing);
  w.last_use = ++uses_;
  w.captured = w.captured || (capturing && w.ptr != nullptr);
  if (stream_ != stream || bound_workspace_ != w.ptr) {
    INFERCTX_CUBLAS(cublasSetStream(handle_, stream), device_);
    // cublasSetStream resets the handle to cuBLAS's own workspace pool.
    const int64_t bytes = w.ptr != nullptr ? workspace_->size() : 0;
    INFERCTX_CUBLAS(cublasSetWorkspace(handle_, w.ptr, static_cast<size_t>(bytes)), device_);
    stream_ = stream;
    bound_workspace_ = w.ptr;
    bound_workspace_bytes_ = bytes;
  }
  return capturing;
}

void CublasHandle::set_tf32(bool enabled) {
  std::lock_guard<std::mutex> lock(mutex_);  // not in the middle of another thread's GEMM
  CurrentDeviceScope on(device_);
  INFERCTX_CUBLAS(cublasSetMathMode(handle_, enabled ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH), device_);
  tf32_ = enabled;
}

}  // namespace inferctx

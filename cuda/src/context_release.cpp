// Releasing the context's workspace and taking it back (context.hpp: release_workspace,
// retake_workspace): under stable addresses the physical memory is unmapped and mapped again at
// the same addresses (vmm.hpp), under the cudaMalloc fallback the allocation is freed and made
// anew; either way the contents can be kept in page-locked host memory across the release.
#include <algorithm>
#include <string>

#include "inferctx/context.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "context_detail.hpp"

namespace inferctx {

using detail::allocate_or_null;
using detail::describe_plan;

void InferenceContext::set_released_range(bool released) noexcept {
  if (released && virtual_ != nullptr) {
    // The same bounds at every release: a reader that sees the flag raised (acquire) sees them.
    const auto begin = reinterpret_cast<uintptr_t>(virtual_->data());
    released_begin_.store(begin, std::memory_order_relaxed);
    released_end_.store(begin + static_cast<uintptr_t>(virtual_->capacity()), std::memory_order_relaxed);
    addresses_released_.store(true, std::memory_order_release);
  } else {
    addresses_released_.store(false, std::memory_order_release);
  }
}

bool InferenceContext::in_released_range(const void* p, int64_t bytes) const noexcept {
  // A reader may see the state of a moment ago; it only decides whether to refuse a launch. The
  // bounds are read after the flag: never a begin of 0 with the range's end (which would refuse
  // every address below the workspace).
  if (!addresses_released_.load(std::memory_order_acquire)) return false;
  const uintptr_t begin = released_begin_.load(std::memory_order_relaxed);
  const uintptr_t end = released_end_.load(std::memory_order_relaxed);
  if (begin == end) return false;
  const auto x = reinterpret_cast<uintptr_t>(p);
  const auto n = static_cast<uintptr_t>(bytes > 0 ? bytes : 1);
  return x < end && x + n > begin;
}

void InferenceContext::release_workspace(bool force, bool keep_contents) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (released_ && !keep_contents && host_copy_) {
    // Released with its contents kept (or by a keep_contents release that failed after making
    // its copy), now released without: the host copy goes, as documented (it may be most of the
    // host's memory), and kept contents with it. A failed release's copies may still be queued.
    if (!contents_kept_) own_stream_.synchronize();
    host_copy_.reset();
    if (contents_kept_) ++contents_epoch_;
    contents_kept_ = false;
    return;
  }
  if (!workspace_ || released_) return;
  CurrentDeviceScope on(device_);
  if (!vmm_) {
    const int64_t views = views_alive_locked();
    if (views > 0 && !force) {
      throw with_remedy(WorkspaceInUseError("release_workspace: " + std::to_string(views) +
                                                " view(s) of the workspace are still alive (views, DLPack capsules "
                                                "or arrays made from them) and this device keeps no addresses "
                                                "across a release (" + fallback_reason_ + ")",
                                            views),
                        Remedy::DropViewsOrDetach);
    }
  }
  // Any stream may still be using the workspace (the caller's, a side stream, a graph replay):
  // everything queued on the device so far runs first, as cudaFree would wait for it.
  INFERCTX_CUDA(cudaDeviceSynchronize(), device_);
  if (keep_contents) {
    if (!host_copy_ || host_copy_->size() < workspace_->size()) {
      host_copy_.reset();  // not both at once: the old one may be most of the host's memory
      host_copy_ = std::make_unique<PinnedAllocation>(workspace_->size());
    }
  } else {
    host_copy_.reset();
  }
  if (vmm_) {
    try {
      // The copies are queued before anything is unmapped; each chunk goes once its copy is done.
      virtual_->unmap(keep_contents ? host_copy_->data() : nullptr, own_stream_.handle());
    } catch (...) {
      // A copy to the host, or its event, failed before anything was unmapped: the workspace is
      // still held with its contents, as if release_workspace had not been called.
      if (virtual_->accessible()) throw;
      // Otherwise the memory is unmapped (or going); its contents are not to be trusted.
      released_ = true;
      contents_kept_ = false;
      ++contents_epoch_;
      set_released_range(true);
      throw;
    }
    set_released_range(true);
  } else {
    if (keep_contents) {
      copy_async(host_copy_->data(), workspace_->data(), workspace_->size(), own_stream_.handle(), device_);
      own_stream_.synchronize();
    }
    // Freed now when no view holds it, else by the last view.
    workspace_.reset();
  }
  released_ = true;
  contents_kept_ = keep_contents;
  if (!keep_contents) ++contents_epoch_;
}

bool InferenceContext::retake_workspace() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!has_plan_) throw WorkspaceStateError("retake_workspace: no workspace plan to retake: call gen_workspace first");
  retake_locked("retake_workspace");
  return true;
}

void InferenceContext::retake_locked(const char* where) {
  if (!released_) return;
  CurrentDeviceScope on(device_);
  {
    // A lost CUDA context (a sticky error) is reported here as by every other call: the
    // driver's mapping calls a retake makes may still succeed in one.
    const cudaError_t status = cudaStreamQuery(own_stream_.handle());
    if (status != cudaSuccess && status != cudaErrorNotReady) check_cuda(status, "cudaStreamQuery", device_);
    if (status == cudaErrorNotReady) cudaGetLastError();
  }
  const void* restore = contents_kept_ ? host_copy_->data() : nullptr;
  int64_t bytes = plan_.workspace_bytes;
  bool ok = false;
  if (vmm_) {
    // The same bytes at the same addresses as before the release, so every view of them is valid.
    bytes = virtual_->size();
    ok = virtual_->map(bytes, restore, contents_kept_ ? bytes : 0, own_stream_.handle());
  } else {
    std::shared_ptr<DeviceAllocation> fresh = allocate_or_null(device_, bytes);
    if (fresh && restore != nullptr) {
      copy_async(fresh->data(), restore, std::min(fresh->size(), host_copy_->size()), own_stream_.handle(), device_);
      own_stream_.synchronize();
    }
    ok = fresh != nullptr;
    if (ok) workspace_ = std::move(fresh);
  }
  if (!ok) {
    size_t free_now = 0, total = 0;
    INFERCTX_CUDA(cudaMemGetInfo(&free_now, &total), device_);
    throw with_remedy(WorkspaceOOMError(
        std::string(where) + ": " + (vmm_ ? "mapping " : "cudaMalloc of ") + human_bytes(bytes) +
            " of device memory for the workspace (" + describe_plan(plan_) + ") failed on device " +
            std::to_string(device_) + ": out of memory, " + human_bytes(static_cast<int64_t>(free_now)) +
            " free of " + human_bytes(static_cast<int64_t>(total)) +
            ". The context stays released with its plan" +
            (contents_kept_ ? " and the workspace's contents in host memory" : ""),
        bytes, static_cast<int64_t>(free_now), static_cast<int64_t>(total), plan_.budget_bytes, -1, -1),
        Remedy::FreeMemoryThenRetake);
  }
  released_ = false;
  contents_kept_ = false;
  set_released_range(false);
}

}  // namespace inferctx

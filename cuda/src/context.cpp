// InferenceContext (context.hpp): the context of each device, planning and mapping its workspace,
// the token counter and the streams. Releasing the workspace and taking it back is in
// context_release.cpp.
#include "inferctx/context.hpp"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>

#include "inferctx/blas.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "context_detail.hpp"

namespace inferctx {

namespace detail {

std::shared_ptr<DeviceAllocation> allocate_or_null(int device, int64_t bytes) {
  try {
    return std::make_shared<DeviceAllocation>(device, bytes);
  } catch (const CudaError& e) {
    if (e.kind() == ErrorKind::Cuda && e.code == static_cast<int>(cudaErrorMemoryAllocation)) return nullptr;
    throw;
  }
}

std::string describe_plan(const WorkspacePlan& plan) {
  return std::to_string(plan.max_tokens) + " tokens, " + human_bytes(plan.workspace_bytes);
}

}  // namespace detail

namespace {

// Why the cudaMalloc fallback is taken on `device`, or "" for CUDA virtual memory. The variable
// is read once, when the context is made: the choice holds for the context's lifetime.
std::string fallback_reason_of(int device) {
  const char* off = std::getenv("INFERCTX_DISABLE_VMM");
  if (off != nullptr && *off != '\0' && std::string(off) != "0") {
    return std::string("INFERCTX_DISABLE_VMM=") + off + " is set in the environment";
  }
  try {
    return virtual_memory_unsupported_reason(device);
  } catch (const CudaError& e) {
    return std::string("asking the driver for virtual memory management failed: ") + e.what();
  }
}

struct Registry {
  std::mutex mutex;
  std::map<int, std::shared_ptr<InferenceContext>> contexts;
};

}  // namespace

using detail::allocate_or_null;
using detail::describe_plan;

std::shared_ptr<InferenceContext> InferenceContext::instance(int device) {
  // Resolving the device initialises the CUDA runtime before the registry below is built, so
  // the registry is destroyed at exit before the runtime tears down, while the contexts can
  // still free their memory, streams and handles.
  const int count = device_count();
  if (device == -1) {
    device = current_device();
  } else if (device < 0 || device >= count) {
    throw ConfigError("device", "device: got " + std::to_string(device) + "; valid: -1 (the current device) or 0.." +
                                    std::to_string(count - 1));
  }
  // Likewise cuBLAS's and cuBLASLt's process-wide state (blas.hpp), which the contexts' handles
  // need until they are destroyed.
  init_blas_libraries(device);
  static Registry registry;
  std::lock_guard<std::mutex> lock(registry.mutex);
  std::shared_ptr<InferenceContext>& slot = registry.contexts[device];
  if (!slot) slot.reset(new InferenceContext(device));
  return slot;
}

InferenceContext::InferenceContext(int device) : device_(device) {
  CurrentDeviceScope on(device);
  INFERCTX_CUDA(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device), device);
  INFERCTX_CUDA(cudaDeviceGetAttribute(&cc_major_, cudaDevAttrComputeCapabilityMajor, device), device);
  INFERCTX_CUDA(cudaDeviceGetAttribute(&cc_minor_, cudaDevAttrComputeCapabilityMinor, device), device);
  // The cuBLAS workspace is taken first so that the free memory the planner sees excludes it.
  cublas_ = std::make_unique<CublasHandle>(device);
  try {
    own_stream_ = Stream::create(device);
    comm_stream_ = Stream::create(device);
    compute_.store(own_stream_.handle(), std::memory_order_release);
    comp_done_ = std::make_unique<Event>(device);
    comm_done_ = std::make_unique<Event>(device);
    cublas_->set_stream(compute_.load(std::memory_order_relaxed));
    fallback_reason_ = fallback_reason_of(device);
    vmm_ = fallback_reason_.empty();
    if (vmm_) granularity_ = virtual_memory_granularity(device);
  } catch (...) {
    // The handle may be bound to the own stream, which as a later member would be destroyed
    // first: the handle goes while the stream still exists, as in the destructor.
    cublas_.reset();
    throw;
  }
}

InferenceContext::~InferenceContext() {
  CurrentDeviceScope on(device_, std::nothrow);
  // An adopted stream may already be destroyed by its owner; the handle is rebound to the own
  // stream, and destroyed while that stream still exists (members die in reverse order, which
  // would take the streams first).
  if (cublas_ && own_stream_.handle() != nullptr) cublas_->bind_stream(own_stream_.handle());
  cublas_.reset();
}

int64_t InferenceContext::views_alive_locked() const {
  return workspace_ ? static_cast<int64_t>(workspace_.use_count()) - 1 : 0;
}

void InferenceContext::commit_plan_locked(const WorkspacePlan& next) {
  plan_ = next;
  has_plan_ = true;
  ++plan_generation_;
  token_limit_.store(next.max_tokens, std::memory_order_relaxed);
}

WorkspacePlan InferenceContext::gen_workspace(const PlanRequest& request) {
  std::lock_guard<std::mutex> lock(mutex_);
  CurrentDeviceScope on(device_);

  size_t free_now = 0, total = 0;
  INFERCTX_CUDA(cudaMemGetInfo(&free_now, &total), device_);
  PlanRequest measured = request;
  measured.total_bytes = static_cast<int64_t>(total);
  measured.free_bytes = static_cast<int64_t>(free_now);
  if (vmm_) {
    measured.allocation_granularity = granularity_;
    // Mapped memory is kept and grown in place, so all of it is the new plan's, views or not.
    if (virtual_ != nullptr && !released_) {
      measured.free_bytes = std::min(measured.total_bytes, measured.free_bytes + virtual_->size());
    }
    return gen_workspace_virtual(measured);
  }
  const int64_t views = views_alive_locked();
  // Our own workspace is memory the new one may take over, but only if nothing else uses it.
  const bool can_free_old = workspace_ && views == 0;
  if (can_free_old) measured.free_bytes = std::min(measured.total_bytes, measured.free_bytes + workspace_->size());
  return gen_workspace_malloc(measured, views, can_free_old);
}

WorkspacePlan InferenceContext::gen_workspace_virtual(const PlanRequest& measured) {
  WorkspacePlan next = plan_workspace(measured);  // throws before anything changes
  const int64_t need = next.workspace_bytes;      // whole granules under the exact policy
  int64_t mapping = need;   // bytes this call maps
  int64_t wanted = need;    // bytes the workspace would hold (the error's requested_bytes)
  std::string state;
  bool ok = true;
  if (virtual_ == nullptr) {
    // Addresses for as much as the device holds: the workspace never has to move to grow.
    auto range = std::make_shared<VirtualAllocation>(device_, measured.total_bytes);
    ok = range->map(need, nullptr, 0, nullptr);
    if (ok) {
      workspace_ = range;
      virtual_ = range.get();
      released_ = false;
    }
    state = "no workspace was planned before";
  } else if (!released_) {
    wanted = virtual_->round_up(need);
    mapping = wanted - virtual_->size();
    if (mapping > 0) ok = virtual_->grow(need);
    state = "the previous plan (" + describe_plan(plan_) +
            ") and its workspace stay in force, at the same addresses with the same contents";
  } else {
    // A released workspace whose views are alive, or whose contents were kept, comes back whole
    // (as retake_workspace would) before it grows; otherwise nothing can see its old bytes.
    const int64_t extent = virtual_->size();
    const int64_t views = views_alive_locked();
    const bool whole = views > 0 || contents_kept_;
    mapping = whole ? std::max(need, extent) : need;
    wanted = mapping;
    ok = virtual_->map(mapping, contents_kept_ ? host_copy_->data() : nullptr, contents_kept_ ? extent : 0,
                       own_stream_.handle());
    if (ok) {
      released_ = false;
      contents_kept_ = false;
      set_released_range(false);
    }
    state = "the previous plan (" + describe_plan(plan_) + ") stays in force, its workspace still released" +
            (contents_kept_ ? " with its contents in host memory" : "");
    if (!ok && mapping > need) {
      // No smaller request can help: what is mapped is the old workspace, whole, not the plan.
      const std::string why = views > 0 ? std::to_string(views) + " view(s) of it are alive"
                                        : "its contents were kept (release_workspace(keep_contents=True))";
      throw WorkspaceOOMError(
          "gen_workspace: the released workspace comes back whole (" + human_bytes(mapping) +
              ") before the new plan (" + std::to_string(next.max_tokens) + " tokens, " + human_bytes(need) +
              ") can use it, because " + why + ", and mapping it failed on device " + std::to_string(device_) +
              " (free " + human_bytes(measured.free_bytes) + " of " + human_bytes(measured.total_bytes) + "); " +
              state +
              ". To plan a smaller workspace, let the old one go first: drop those views (and the torch, CuPy or "
              "JAX arrays made from them) or call release_workspace() without keep_contents, then call "
              "gen_workspace again; or free device memory",
          mapping, measured.free_bytes, measured.total_bytes, next.budget_bytes, -1, -1);
    }
  }
  if (!ok) {
    throw WorkspaceOOMError(
        "gen_workspace: mapping " + human_bytes(mapping) + " of device memory for the planned workspace (" +
            std::to_string(next.max_tokens) + " tokens, " + human_bytes(wanted) + " in all) failed on device " +
            std::to_string(device_) + " although it was within the budget of " + human_bytes(next.budget_bytes) +
            " (" + next.budget_limit + ", free " + human_bytes(measured.free_bytes) + " of " +
            human_bytes(measured.total_bytes) + "): other allocations took memory meanwhile, or the reserve left the "
            "driver too little for its own use (the page tables of the mapping); " + state +
            ". Ask for less: a larger reserve_bytes, a lower memory_fraction (of free memory) or "
            "memory_limit_bytes, or a smaller batch_size / max_out_tokens",
        wanted, measured.free_bytes, measured.total_bytes, next.budget_bytes, -1, -1);
  }
  commit_plan_locked(next);
  return next;
}

WorkspacePlan InferenceContext::gen_workspace_malloc(const PlanRequest& measured, int64_t views, bool can_free_old) {
  WorkspacePlan next = plan_workspace(measured);  // throws before anything changes
  const bool was_released = released_;

  if (!(workspace_ && workspace_->size() >= next.workspace_bytes)) {
    // Old and new side by side first: a failed regrow must not cost the KV cache.
    std::shared_ptr<DeviceAllocation> fresh = allocate_or_null(device_, next.workspace_bytes);
    bool freed_old = false, restored = false;
    if (!fresh && can_free_old) {
      workspace_.reset();
      freed_old = true;
      ++contents_epoch_;  // whatever follows, the old bytes are gone
      try {
        fresh = allocate_or_null(device_, next.workspace_bytes);
      } catch (...) {
        try {
          workspace_ = allocate_or_null(device_, plan_.workspace_bytes);
        } catch (...) {
        }
        released_ = !workspace_;
        throw;
      }
      if (!fresh) {
        try {
          workspace_ = allocate_or_null(device_, plan_.workspace_bytes);
        } catch (...) {
        }
        restored = workspace_ != nullptr;
        released_ = !restored;
      }
    }
    if (!fresh) {
      std::string state;
      Remedy remedy = Remedy::None;
      if (!has_plan_) {
        state = "no workspace was planned before";
      } else if (freed_old && restored) {
        state = "the previous plan (" + describe_plan(plan_) +
                ") stays in force; its workspace had to be freed to try and was re-allocated, so its contents "
                "are lost";
      } else if (freed_old) {
        state = "the previous plan (" + describe_plan(plan_) +
                ") is kept but its workspace could not be re-allocated: the context holds none; call "
                "retake_workspace once memory is free";
      } else if (workspace_) {
        state = "the previous plan (" + describe_plan(plan_) + ") and its workspace stay in force; it could not " +
                "be freed to make room because " + std::to_string(views) + " view(s) of it are alive";
        remedy = Remedy::DropViewsOrForceRelease;
      } else {
        state = "the previous plan (" + describe_plan(plan_) + ") stays in force, its workspace still released" +
                (contents_kept_ ? " with its contents in host memory" : "");
      }
      throw with_remedy(WorkspaceOOMError(
          "gen_workspace: cudaMalloc of " + human_bytes(next.workspace_bytes) + " for the planned workspace (" +
              std::to_string(next.max_tokens) + " tokens) failed on device " + std::to_string(device_) +
              " although it was within the budget of " + human_bytes(next.budget_bytes) + " (" + next.budget_limit +
              ", free " + human_bytes(measured.free_bytes) + " of " + human_bytes(measured.total_bytes) +
              "): other allocations took memory meanwhile, it is fragmented, or the reserve left the driver too "
              "little for its own use; " + state +
              ". Ask for less: a larger reserve_bytes, a lower memory_fraction (of free memory) or "
              "memory_limit_bytes, or a smaller batch_size / max_out_tokens",
          next.workspace_bytes, measured.free_bytes, measured.total_bytes, next.budget_bytes, -1, -1), remedy);
    }
    // With views alive the old allocation is detached here and lives on in them. The new one
    // holds the old bytes only where kept contents are copied in below.
    workspace_ = std::move(fresh);
    if (!(was_released && contents_kept_)) ++contents_epoch_;
  }
  if (was_released && contents_kept_) {
    // Kept contents come back into the new allocation, as far as it reaches.
    const int64_t n = std::min(workspace_->size(), host_copy_->size());
    try {
      copy_async(workspace_->data(), host_copy_->data(), n, own_stream_.handle(), device_);
      own_stream_.synchronize();
    } catch (...) {
      // They did not come back: the context stays released with them and its previous plan
      // (retake_workspace tries again), and a released context holds no allocation. Kept, the
      // new one was counted nowhere (held_bytes 0) and no release would free it.
      workspace_.reset();
      throw;
    }
  }
  contents_kept_ = false;
  released_ = false;
  commit_plan_locked(next);
  return next;
}

bool InferenceContext::has_plan() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return has_plan_;
}

uint64_t InferenceContext::plan_generation() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return plan_generation_;
}

WorkspacePlan InferenceContext::plan() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!has_plan_) throw WorkspaceStateError("no workspace plan: call gen_workspace first");
  return plan_;
}

std::shared_ptr<DeviceAllocation> InferenceContext::workspace() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!has_plan_) throw WorkspaceStateError("no workspace: call gen_workspace first");
  if (released_ || !workspace_) {
    throw WorkspaceStateError("workspace released: call retake_workspace (the plan of " + describe_plan(plan_) +
                              " is kept)");
  }
  return workspace_;
}

int64_t InferenceContext::workspace_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return has_plan_ ? plan_.workspace_bytes : 0;
}

int64_t InferenceContext::max_token_length() const { return token_limit_.load(std::memory_order_relaxed); }

bool InferenceContext::released() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return released_;
}

int64_t InferenceContext::views_alive() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return views_alive_locked();
}

int64_t InferenceContext::held_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return workspace_ && !released_ ? workspace_->size() : 0;
}

int64_t InferenceContext::host_copy_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return host_copy_ ? host_copy_->size() : 0;
}

uint64_t InferenceContext::contents_epoch() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return contents_epoch_;
}

void InferenceContext::advance_tokens(int64_t n) {
  if (n < 1) {
    throw ConfigError("n", "n: advance_tokens got " + std::to_string(n) + "; it must be a positive token count (>= 1)");
  }
  const int64_t limit = token_limit_.load(std::memory_order_relaxed);
  int64_t current = tokens_.load(std::memory_order_relaxed);
  do {
    // Written as a difference: current + n could overflow for a huge n.
    if (n > limit - current) {
      if (limit == 0) {
        throw TokenLimitError("advance_tokens(" + std::to_string(n) +
                                  "): no workspace is planned, so max_token_length is 0; call gen_workspace first",
                              current, n, limit);
      }
      throw TokenLimitError("advance_tokens(" + std::to_string(n) + "): " + std::to_string(current) + " + " +
                                std::to_string(n) + " tokens would pass max_token_length=" + std::to_string(limit) +
                                " (the KV cache holds " + std::to_string(limit) +
                                " positions); call reset_tokens for a new sequence, or gen_workspace with a larger "
                                "max_out_tokens",
                            current, n, limit);
    }
  } while (!tokens_.compare_exchange_weak(current, current + n, std::memory_order_relaxed));
}

void InferenceContext::reset_tokens(int64_t initial) {
  const int64_t limit = token_limit_.load(std::memory_order_relaxed);
  if (initial < 0 || initial > limit) {
    throw ConfigError("initial", "initial: reset_tokens got " + std::to_string(initial) + "; valid: 0.." +
                                     std::to_string(limit) +
                                     (limit == 0 ? " (no workspace is planned, so max_token_length is 0; call "
                                                   "gen_workspace first)"
                                                 : " (max_token_length)"));
  }
  tokens_.store(initial, std::memory_order_relaxed);
}

cudaStream_t InferenceContext::stream() const { return compute_.load(std::memory_order_acquire); }

cudaStream_t InferenceContext::comm_stream() const { return comm_stream_.handle(); }

void InferenceContext::use_stream(cudaStream_t external) {
  std::lock_guard<std::mutex> lock(mutex_);
  CurrentDeviceScope on(device_);
  // The special handles name the default streams of the current device, which here is ours.
  if (external != nullptr && external != cudaStreamLegacy && external != cudaStreamPerThread) {
    int stream_device = -1;
    INFERCTX_CUDA(cudaStreamGetDevice(external, &stream_device), device_);
    if (stream_device != device_) {
      throw with_remedy(ConfigError("stream", "stream: use_stream got a stream of device " +
                                                  std::to_string(stream_device) + " for the context of device " +
                                                  std::to_string(device_) + "; use a stream created on device " +
                                                  std::to_string(device_)),
                        Remedy::ContextOfDevice, stream_device);
    }
  }
  const cudaStream_t target = external != nullptr ? external : own_stream_.handle();
  cublas_->set_stream(target);  // first: if it fails the context keeps its previous stream
  compute_.store(target, std::memory_order_release);
}

void InferenceContext::sync_comp() { sync_comp(stream()); }

void InferenceContext::sync_comm() { sync_comm(stream()); }

void InferenceContext::sync_comp(cudaStream_t compute) {
  require_explicit_stream(compute, "sync_comp");
  std::lock_guard<std::mutex> lock(mutex_);
  CurrentDeviceScope on(device_);
  INFERCTX_CUDA(cudaEventRecord(comp_done_->handle(), compute), device_);
  INFERCTX_CUDA(cudaStreamWaitEvent(comm_stream_.handle(), comp_done_->handle(), 0), device_);
}

void InferenceContext::sync_comm(cudaStream_t compute) {
  require_explicit_stream(compute, "sync_comm");
  std::lock_guard<std::mutex> lock(mutex_);
  CurrentDeviceScope on(device_);
  INFERCTX_CUDA(cudaEventRecord(comm_done_->handle(), comm_stream_.handle()), device_);
  INFERCTX_CUDA(cudaStreamWaitEvent(compute, comm_done_->handle(), 0), device_);
}

}  // namespace inferctx

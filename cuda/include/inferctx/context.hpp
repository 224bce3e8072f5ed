// InferenceContext: one per device; owns the workspace, the cuBLAS handle, the compute and
// comm streams, the token counter and the Philox state.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "inferctx/blas.hpp"
#include "inferctx/graph_rng.hpp"
#include "inferctx/memory.hpp"
#include "inferctx/philox.hpp"
#include "inferctx/plan.hpp"
#include "inferctx/stream.hpp"
#include "inferctx/vmm.hpp"

namespace inferctx {

class InferenceContext {
 public:
  // The context of `device` (-1: the calling thread's current device), created on first use;
  // thread-safe. ConfigError("device") for an ordinal outside [0, count), NoCudaDeviceError
  // without a device.
  static std::shared_ptr<InferenceContext> instance(int device = -1);

  ~InferenceContext();
  InferenceContext(const InferenceContext&) = delete;
  InferenceContext& operator=(const InferenceContext&) = delete;

  int device() const noexcept { return device_; }
  int multiprocessor_count() const noexcept { return sm_count_; }
  int compute_capability() const noexcept { return cc_major_ * 10 + cc_minor_; }

  // The workspace lives at addresses that survive release_workspace when the device supports
  // CUDA virtual memory management (addresses_stable()): an address range as large as the
  // device's memory is reserved at the first gen_workspace and the workspace is mapped at its
  // start, in whole granules (allocation_granularity(), counted in the exact policy's bytes).
  // Otherwise, or with INFERCTX_DISABLE_VMM=1 in the environment when the context is created,
  // it is a cudaMalloc allocation (the behaviour of DeepSpeed's context), whose address changes
  // at every retake.
  bool addresses_stable() const noexcept { return vmm_; }
  // Why the cudaMalloc fallback is in force ("" when addresses are stable).
  const std::string& fallback_reason() const noexcept { return fallback_reason_; }
  int64_t allocation_granularity() const noexcept { return granularity_; }  // 0 under the fallback

  // Plans `request` against free memory read now (request.free_bytes/total_bytes are
  // replaced by the measurement) and makes the workspace fit it. On any failure the previous
  // plan stays in force with its workspace (same addresses, same contents).
  //  - Stable addresses: memory already mapped counts as free (views or not); the mapping is
  //    kept when it is large enough and otherwise grown in place, so the workspace keeps its
  //    address and every view of it stays valid. A released workspace is taken back first as
  //    retake_workspace would when views of it are alive or its contents were kept; otherwise
  //    only the new plan's bytes are mapped.
  //  - cudaMalloc: the allocation is reused when it is large enough, otherwise a new one is
  //    allocated before the old is freed; when both cannot coexist and no views are alive the old
  //    one is freed first, and on failure an allocation of the previous plan is restored. With
  //    views alive the old allocation is detached and lives on in them.
  WorkspacePlan gen_workspace(const PlanRequest& request);

  bool has_plan() const;
  WorkspacePlan plan() const;                              // WorkspaceStateError when none
  uint64_t plan_generation() const;                        // plans put in force so far
  std::shared_ptr<DeviceAllocation> workspace() const;     // WorkspaceStateError: none / released
  int64_t workspace_bytes() const;                         // bytes of the plan, 0 when none
  int64_t max_token_length() const;                        // plan's max_tokens, 0 when none
  bool released() const;
  // Other owners of the workspace allocation (views exported from it).
  int64_t views_alive() const;
  // Device memory the workspace holds now (at least workspace_bytes() while held; 0 released).
  int64_t held_bytes() const;
  // Page-locked host memory kept for release_workspace(keep_contents=true) (0 when none).
  int64_t host_copy_bytes() const;
  // How many times the workspace's contents have been given up: a release without keep_contents
  // (or one whose copy to the host could not be completed), an already released workspace's kept
  // copy dropped, a regrow that freed the old workspace or moved to a new allocation without its
  // bytes. A user of the contents (a KV cache) notes it and sees them gone when it moves.
  uint64_t contents_epoch() const;
  // True when [p, p + bytes) overlaps a released workspace's addresses: work there would touch
  // unmapped memory. Lock-free, for the checks on every kernel operand.
  bool in_released_range(const void* p, int64_t bytes) const noexcept;
  // True while the workspace is released under stable addresses (what in_released_range
  // refuses). Lock-free: a caller that must act on the state without waiting for a release or
  // retake in progress (the Python layer's list of released contexts) reads it here.
  bool addresses_released() const noexcept { return addresses_released_.load(std::memory_order_acquire); }

  // Gives the workspace's device memory back, keeping the plan. First waits for all work queued
  // on the device (cudaDeviceSynchronize, as cudaFree does): any stream, the caller's or a graph,
  // may still be using the workspace. With `keep_contents` its bytes are copied to page-locked
  // host memory first (stream-ordered; the host memory is kept for the next such release until a
  // release without keep_contents) and the next retake_workspace copies them back.
  //  - Stable addresses: the physical memory is unmapped and returned; the address range stays
  //    reserved. Views stay alive and valid for after the retake; until then nothing may touch
  //    the range (an illegal memory access), and the Python layer refuses new exports and kernel
  //    launches on it. `force` changes nothing.
  //  - cudaMalloc: with views alive, WorkspaceInUseError, or with `force` the context forgets the
  //    allocation and the last view frees it.
  // Does nothing when no workspace is held (none planned yet, or already released), except that
  // a release without keep_contents of a released workspace drops the host copy (and any kept
  // contents with it).
  void release_workspace(bool force, bool keep_contents = false);
  // Takes the released workspace back for the kept plan: the same addresses and bytes under
  // stable addresses (a new allocation of the plan's bytes under cudaMalloc), with the contents
  // copied back when they were kept (complete when this returns). WorkspaceOOMError when the
  // memory cannot be had: the context then stays released and consistent (plan kept, contents
  // still in host memory), and a later call may succeed. WorkspaceStateError when nothing was
  // ever planned; nothing to do when the workspace is held. Returns true (callers written for the
  // earlier false-when-out-of-memory contract keep working).
  bool retake_workspace();

  // Generated-token counter (DeepSpeed's current_tokens / advance_tokens / reset_tokens).
  // Lock-free and free of CUDA calls: it sits in the decode loop. Without a plan
  // max_token_length is 0, so advance_tokens always throws (saying to call gen_workspace) and
  // reset_tokens accepts only 0. A new plan leaves the counter as it is (as DeepSpeed does).
  int64_t current_tokens() const noexcept { return tokens_.load(std::memory_order_relaxed); }
  // TokenLimitError if current + n would pass max_token_length; ConfigError for n < 1.
  void advance_tokens(int64_t n = 1);
  void reset_tokens(int64_t initial = 1);  // ConfigError outside [0, max_token_length]

  // Streams. The compute stream is owned by the context unless use_stream() adopted one.
  cudaStream_t stream() const;
  cudaStream_t comm_stream() const;
  // nullptr: back to the context's own stream. The cuBLAS handle follows. The legacy default
  // stream is adopted only when asked for by name (cudaStreamLegacy); ConfigError("stream") for
  // a stream of another device.
  void use_stream(cudaStream_t external);
  void sync_comp();  // the comm stream waits for work queued so far on the compute stream
  void sync_comm();  // the compute stream waits for work queued so far on the comm stream
  // The same with the compute stream named by the caller (the Python layer's current stream).
  void sync_comp(cudaStream_t compute);
  void sync_comm(cudaStream_t compute);
  cudaStream_t own_stream() const noexcept { return own_stream_.handle(); }  // created with the context

  std::pair<uint64_t, uint64_t> increment_offset(uint64_t increment) { return philox_.increment_offset(increment); }
  // Resets the eager and the graph state (graph_rng.hpp): the graphs' device header is rewritten
  // in order on `stream` (the compute stream when not given), so replays queued there before
  // keep the old seed and those queued after start from replay 0 with the new one.
  void set_seed(uint64_t seed) { graph_rng_.set_seed(seed, stream()); }
  void set_seed(uint64_t seed, cudaStream_t stream) { graph_rng_.set_seed(seed, stream); }
  const PhiloxState& philox() const noexcept { return philox_; }
  // Philox draws under CUDA-graph capture (graph_rng.hpp).
  GraphRng& graph_rng() noexcept { return graph_rng_; }

  CublasHandle& cublas() noexcept { return *cublas_; }

 private:
  explicit InferenceContext(int device);

  int device_;
  int sm_count_ = 0;
  int cc_major_ = 0, cc_minor_ = 0;
  mutable std::mutex mutex_;  // guards the workspace, the plan and the streams
  std::unique_ptr<CublasHandle> cublas_;
  Stream own_stream_, comm_stream_;
  // own_stream_ or an adopted external stream; written under mutex_, read without it (stream()
  // is asked on every call that orders by ctx.stream).
  std::atomic<cudaStream_t> compute_{nullptr};
  std::unique_ptr<Event> comp_done_, comm_done_;
  bool has_plan_ = false;
  WorkspacePlan plan_;
  uint64_t plan_generation_ = 0;  // counts commit_plan_locked calls
  std::shared_ptr<DeviceAllocation> workspace_;  // under stable addresses: virtual_, also released
  VirtualAllocation* virtual_ = nullptr;         // workspace_ as the VMM range, when there is one
  bool released_ = false;
  bool vmm_ = false;
  std::string fallback_reason_;
  int64_t granularity_ = 0;
  std::unique_ptr<PinnedAllocation> host_copy_;
  bool contents_kept_ = false;  // host_copy_ holds the released workspace's bytes
  uint64_t contents_epoch_ = 0;  // see contents_epoch()
  // The workspace's reserved range under stable addresses, stored before addresses_released_ is
  // first raised and never changed after (virtual_ is made once); addresses_released_ says whether
  // it is released now. One flag, so that a reader never pairs one bound of the range with a
  // state the other bound does not belong to.
  std::atomic<uintptr_t> released_begin_{0}, released_end_{0};
  std::atomic<bool> addresses_released_{false};
  std::atomic<int64_t> tokens_{0};
  // The plan's max_tokens, readable without the mutex by the token counter.
  std::atomic<int64_t> token_limit_{0};
  PhiloxState philox_;
  GraphRng graph_rng_{device_, philox_};  // after philox_, which it numbers sites from

  int64_t views_alive_locked() const;
  WorkspacePlan gen_workspace_virtual(const PlanRequest& measured);
  WorkspacePlan gen_workspace_malloc(const PlanRequest& measured, int64_t views, bool can_free_old);
  void retake_locked(const char* where);
  void set_released_range(bool released) noexcept;
  void commit_plan_locked(const WorkspacePlan& next);
};

}  // namespace inferctx

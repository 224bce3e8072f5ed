// InferenceContext: one per device; owns the workspace, the cuBLAS handle, the compute and
// comm streams, the token counter and the Philox state.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>

#include "inferctx/blas.hpp"
#include "inferctx/graph_rng.hpp"
#include "inferctx/memory.hpp"
#include "inferctx/philox.hpp"
#include "inferctx/plan.hpp"
#include "inferctx/stream.hpp"

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

  // Plans `request` against free memory read now (request.free_bytes/total_bytes are
  // replaced by the measurement; memory this context's workspace holds counts as free when
  // nothing else uses it) and makes the allocation fit: reused when it is large enough,
  // otherwise a new one is allocated before the old is freed; when both cannot coexist and
  // no views are alive the old one is freed first, and on failure an allocation of the
  // previous plan is restored. On any failure the previous plan stays in force.
  WorkspacePlan gen_workspace(const PlanRequest& request);

  bool has_plan() const;
  WorkspacePlan plan() const;                              // WorkspaceStateError when none
  std::shared_ptr<DeviceAllocation> workspace() const;     // WorkspaceStateError: none / released
  int64_t workspace_bytes() const;                         // bytes of the plan, 0 when none
  int64_t max_token_length() const;                        // plan's max_tokens, 0 when none
  bool released() const;
  // Other owners of the workspace allocation (views exported from it).
  int64_t views_alive() const;

  // Frees the workspace, keeping the plan. With views alive: WorkspaceInUseError, or with
  // `force` the context forgets the allocation and the last view frees it. Does nothing when
  // no workspace is held (none planned yet, or already released).
  void release_workspace(bool force);
  // Re-allocates the released workspace for the kept plan; true when the context holds a
  // workspace afterwards, false when the allocation failed (out of memory). Other CUDA errors
  // throw; WorkspaceStateError when nothing was ever planned.
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
  cudaStream_t compute_ = nullptr;  // own_stream_ or an adopted external stream
  std::unique_ptr<Event> comp_done_, comm_done_;
  bool has_plan_ = false;
  WorkspacePlan plan_;
  std::shared_ptr<DeviceAllocation> workspace_;
  bool released_ = false;
  std::atomic<int64_t> tokens_{0};
  // The plan's max_tokens, readable without the mutex by the token counter.
  std::atomic<int64_t> token_limit_{0};
  PhiloxState philox_;
  GraphRng graph_rng_{device_, philox_};  // after philox_, which it numbers sites from

  int64_t views_alive_locked() const;
};

}  // namespace inferctx

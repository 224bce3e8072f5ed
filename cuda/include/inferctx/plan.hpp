// Workspace planning: pure host arithmetic, usable without a GPU.
#pragma once

#include <cstdint>
#include <string>

namespace inferctx {

enum class DType : int { Float32 = 0, Float16 = 1, BFloat16 = 2 };

// Bytes per element; throws ConfigError("dtype") for a value outside DType.
int64_t dtype_size(int dtype);

enum class Policy : int { Exact = 0, DeepSpeed = 1 };

struct ModelShape {
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t hidden_dim = 0;
  int64_t num_kv_heads = 0;  // 0 means num_heads
  // Size of one attention head; 0 means hidden_dim / num_heads, which must then be whole.
  // Models such as Gemma-7B (hidden 3072, 16 heads of 256) need it given.
  int64_t head_dim = 0;
};

struct PlanRequest {
  ModelShape shape;
  int64_t batch_size = 1;
  int64_t prompt_len = 1;
  int64_t max_out_tokens = 1;
  int64_t min_out_tokens = 1;
  int dtype = static_cast<int>(DType::Float16);
  int64_t mp_size = 1;
  int64_t rank = 0;
  bool external_cache = false;
  int policy = static_cast<int>(Policy::Exact);
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
  // Bytes of model weights still to be loaded on this device: the plan is cut from
  // free_bytes - weights_bytes. 0 when free_bytes is read after the weights are in memory.
  int64_t weights_bytes = 0;
  // Budget knobs of the exact policy; each applies only when its has_ flag is set.
  bool has_reserve = false;       // default: default_reserve(free_bytes - weights_bytes)
  int64_t reserve_bytes = 0;
  bool has_memory_limit = false;
  int64_t memory_limit_bytes = 0;
  bool has_memory_fraction = false;
  double memory_fraction = 1.0;   // in (0, 1], a fraction of *free* memory (after the weights)
  // Bytes the workspace's memory comes in (CUDA virtual memory maps whole granules): the exact
  // policy rounds workspace_bytes up to a multiple of it and fits the rounded bytes in the
  // budget. 0 or 1: no rounding. The deepspeed policy keeps DeepSpeed's bytes and ignores it.
  int64_t allocation_granularity = 0;
};

struct Region {
  std::string name;
  int64_t offset = 0;
  int64_t size = 0;
};

struct WorkspacePlan {
  PlanRequest request;
  int64_t elem_size = 0;
  int64_t head_dim = 0;        // the shape's head size (hidden / heads under the deepspeed policy)
  int64_t head_dim_padded = 0; // 32/64/128 when <= 128, else head_dim
  int64_t heads_per_rank = 0;
  int64_t kv_heads_per_rank = 0;  // num_heads / mp under the deepspeed policy
  int64_t max_tokens = 0;
  int64_t workspace_bytes = 0;
  int64_t planned_free_bytes = 0;  // free_bytes - weights_bytes: the memory the budget is cut from
  int64_t budget_bytes = 0;        // >= 0
  int64_t reserve_bytes = 0;
  std::string budget_limit;  // "reserve", "memory_limit" or "memory_fraction"
  std::string bound_by;      // "max_out_tokens" or "memory"
  int64_t activations_offset = 0, activations_bytes = 0;
  int64_t kv_cache_offset = 0, kv_cache_bytes = 0;
  int64_t kv_layer_stride = 0;  // bytes from layer l's K to layer l+1's K
  int64_t kv_value_offset = 0;  // bytes from a layer's K to its V
  int64_t kv_tensor_bytes = 0;  // bytes of one K (or V) tensor
  int64_t attention_scores_offset = 0, attention_scores_bytes = 0;
};

inline constexpr int64_t kRegionAlignment = 256;
inline constexpr int64_t kMiB = int64_t{1} << 20;
inline constexpr int64_t kGiB = int64_t{1} << 30;

// Validates the request (ConfigError naming the argument) and plans it; a request that
// cannot fit throws WorkspaceOOMError with the largest batch and max_out_tokens that would.
// Under the exact policy max_tokens never falls when free_bytes, memory_limit_bytes or
// memory_fraction grow, and never rises when batch_size or weights_bytes grow.
WorkspacePlan plan_workspace(const PlanRequest& request);

// Every check of plan_workspace that does not involve the memory figures (free_bytes,
// total_bytes, weights_bytes): lets a caller refuse bad arguments before reading a device.
void check_request(const PlanRequest& request);

// The exact policy's default reserve for `free` bytes (after the weights): 100 MiB up to
// 1 GiB, 500 MiB from 1 GiB + 400 MiB, and free - 924 MiB between, so that the budget
// (free - reserve) never falls as free memory grows. DeepSpeed steps from 100 to 500 MiB.
int64_t default_reserve(int64_t free);

// Regions in address order: activations, layer l's K then V for every layer (none with an
// external cache), attention scores. Computed from the plan's layout, so a plan holds no
// per-layer storage. region_at throws ConfigError("index") outside [0, region_count).
int64_t region_count(const WorkspacePlan& plan);
Region region_at(const WorkspacePlan& plan, int64_t index);

// The largest batch_size for which the request holds every one of its max_out_tokens (the
// request's batch_size is ignored); 0 when not even batch 1 does.
int64_t max_batch_size(const PlanRequest& request);

// The largest max_out_tokens whose plan holds all of them for the request's batch_size (the
// request's max_out_tokens is ignored); 0 when none >= max(prompt_len, min_out_tokens) does.
int64_t max_out_tokens_for(const PlanRequest& request);

// Bytes of `num_params` parameters in `dtype` on one of `mp_size` ranks (an even split,
// rounded up); ConfigError naming the argument when one is out of range or it overflows.
int64_t weights_bytes_for(int64_t num_params, int dtype, int64_t mp_size);

// Binary units with two decimals: "2.00 TiB", "1.50 GiB", "640.00 MiB", "1.50 KiB", else
// "123 B"; a negative count (a budget below zero) keeps its sign: "-400.00 MiB". The one byte
// formatter: Python's planning.human_bytes calls it too.
std::string human_bytes(int64_t bytes);

// Bytes the given policy needs for `tokens` tokens; throws ConfigError on overflow.
int64_t workspace_bytes_for(const PlanRequest& request, int64_t tokens);

}  // namespace inferctx

// The sizing formula: the workspace's regions, their bytes and offsets, for a request and a
// number of tokens (under either policy), and the byte count of the weights. An overflow of 64
// bits is a ConfigError naming the argument that caused it.
#include <string>
#include <vector>

#include "inferctx/errors.hpp"
#include "inferctx/plan.hpp"
#include "plan_detail.hpp"

namespace inferctx {

namespace detail {

DeepSpeedTerms deepspeed_terms(const PlanRequest& r) {
  const int64_t eff = head_padded(head_of(r));
  DeepSpeedTerms t;
  t.act = mul(mul(mul(10, r.shape.num_heads), eff), r.batch_size);
  t.temp = mul(mul(r.batch_size, r.shape.num_heads / r.mp_size), r.max_out_tokens);
  t.cache = mul(mul(mul(r.shape.num_layers, r.batch_size), mul(r.shape.num_heads, eff) / r.mp_size), 2);
  return t;
}

void layout(const PlanRequest& r, int64_t tokens, WorkspacePlan& p) {
  const int64_t elem = dtype_size(r.dtype);
  const int64_t head = head_of(r);
  const int64_t eff = head_padded(head);
  const bool deepspeed = is_deepspeed(r);
  const int64_t kv_heads = deepspeed ? r.shape.num_heads : kv_heads_of(r);
  const int64_t kv_local = kv_heads / r.mp_size;
  const int64_t heads_local = r.shape.num_heads / r.mp_size;
  const int64_t layers = r.external_cache ? 0 : r.shape.num_layers;

  int64_t act = mul(mul(mul(mul(mul(10, r.shape.num_heads), eff), r.batch_size), tokens), elem);
  int64_t kv_tensor = mul(mul(mul(mul(r.batch_size, kv_local), tokens), eff), elem);
  int64_t scores = mul(mul(mul(mul(r.batch_size, heads_local), r.max_out_tokens), tokens), elem);
  if (!deepspeed) {
    act = align_up(act);
    kv_tensor = align_up(kv_tensor);
    scores = align_up(scores);
  }
  p.elem_size = elem;
  p.head_dim = head;
  p.head_dim_padded = eff;
  p.heads_per_rank = heads_local;
  p.kv_heads_per_rank = kv_local;
  p.max_tokens = tokens;
  p.activations_offset = 0;
  p.activations_bytes = act;
  p.kv_cache_offset = act;
  p.kv_tensor_bytes = layers ? kv_tensor : 0;
  p.kv_value_offset = p.kv_tensor_bytes;
  p.kv_layer_stride = mul(2, p.kv_tensor_bytes);
  p.kv_cache_bytes = mul(layers, p.kv_layer_stride);
  p.attention_scores_offset = add(act, p.kv_cache_bytes);
  p.attention_scores_bytes = scores;
  p.workspace_bytes = add(p.attention_scores_offset, scores);
  if (!deepspeed && r.allocation_granularity > 1) {
    // The tail up to the granule is counted, so the budget holds what is really mapped.
    p.workspace_bytes = round_up(p.workspace_bytes, r.allocation_granularity);
  }
}

namespace {

bool layout_overflows(const PlanRequest& r, int64_t tokens) {
  WorkspacePlan scratch;
  try {
    if (is_deepspeed(r)) {
      const DeepSpeedTerms t = deepspeed_terms(r);
      mul(mul(add(add(t.act, t.temp), t.cache), tokens), dtype_size(r.dtype));
    }
    layout(r, tokens, scratch);
    return false;
  } catch (const Overflow&) {
    return true;
  }
}

}  // namespace

[[noreturn]] void overflow_error(const PlanRequest& r, int64_t tokens, const char* tokens_argument) {
  struct Candidate {
    const char* name;
    int64_t value;
    PlanRequest probe;
    int64_t tokens;
  };
  const bool head_given = r.shape.head_dim != 0 && !is_deepspeed(r);
  std::vector<Candidate> candidates;
  PlanRequest p = r;
  p.batch_size = 1;
  candidates.push_back({"batch_size", r.batch_size, p, tokens});
  p = r;
  p.max_out_tokens = tokens;
  candidates.push_back({"max_out_tokens", r.max_out_tokens, p, tokens});
  candidates.push_back({tokens_argument, tokens, r, 1});
  p = r;
  p.shape.num_layers = 1;
  candidates.push_back({"num_layers", r.shape.num_layers, p, tokens});
  p = r;
  p.shape.num_heads = 1;
  p.shape.num_kv_heads = 1;
  p.mp_size = 1;
  candidates.push_back({"num_heads", r.shape.num_heads, p, tokens});
  p = r;
  if (head_given) {
    p.shape.head_dim = 1;
  } else {
    p.shape.hidden_dim = r.shape.num_heads;
  }
  candidates.push_back({head_given ? "head_dim" : "hidden_dim", head_given ? r.shape.head_dim : r.shape.hidden_dim, p,
                        tokens});
  const Candidate* named = nullptr;
  for (const Candidate& c : candidates) {
    if (!layout_overflows(c.probe, c.tokens) && (named == nullptr || c.value > named->value)) named = &c;
  }
  if (named == nullptr) {
    for (const Candidate& c : candidates) {
      if (named == nullptr || c.value > named->value) named = &c;
    }
  }
  const std::string name = named->name;
  throw ConfigError(named->name, name + ": " + name + "=" + std::to_string(named->value) +
                                     " makes the workspace byte count overflow 64 bits (num_layers=" +
                                     std::to_string(r.shape.num_layers) + ", batch_size=" +
                                     std::to_string(r.batch_size) + ", max_out_tokens=" +
                                     std::to_string(r.max_out_tokens) + ", " + std::to_string(tokens) +
                                     " tokens); reduce " + name);
}

}  // namespace detail

using detail::add;
using detail::invalid;
using detail::mul;
using detail::Overflow;
using detail::require_positive;

int64_t workspace_bytes_for(const PlanRequest& request, int64_t tokens) {
  detail::validate(request);
  require_positive("tokens", tokens);
  WorkspacePlan p;
  p.request = request;
  try {
    detail::layout(request, tokens, p);
  } catch (const Overflow&) {
    detail::overflow_error(request, tokens, "tokens");
  }
  return p.workspace_bytes;
}

int64_t region_count(const WorkspacePlan& plan) {
  return plan.kv_tensor_bytes > 0 ? add(2, mul(2, plan.request.shape.num_layers)) : 2;
}

Region region_at(const WorkspacePlan& plan, int64_t index) {
  const int64_t count = region_count(plan);
  if (index < 0 || index >= count)
    invalid("index", "got " + std::to_string(index) + "; the plan has regions [0, " + std::to_string(count) + ")");
  if (index == 0) return {"activations", plan.activations_offset, plan.activations_bytes};
  if (index == count - 1) return {"attention_scores", plan.attention_scores_offset, plan.attention_scores_bytes};
  const int64_t layer = (index - 1) / 2;
  const bool value = (index - 1) % 2 == 1;
  const int64_t k = plan.kv_cache_offset + layer * plan.kv_layer_stride;
  return {"kv_cache[" + std::to_string(layer) + "]." + (value ? "value" : "key"),
          value ? k + plan.kv_value_offset : k, plan.kv_tensor_bytes};
}

int64_t weights_bytes_for(int64_t num_params, int dtype, int64_t mp_size) {
  if (num_params < 0)
    invalid("num_params", "got " + std::to_string(num_params) + "; it must be a parameter count >= 0");
  require_positive("mp_size", mp_size);
  const int64_t elem = dtype_size(dtype);
  try {
    return add(mul(num_params, elem), mp_size - 1) / mp_size;
  } catch (const Overflow&) {
    invalid("num_params", "num_params=" + std::to_string(num_params) + " makes the weights' byte count overflow 64 bits");
  }
}

}  // namespace inferctx

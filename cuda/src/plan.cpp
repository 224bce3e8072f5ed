#include "inferctx/plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "inferctx/errors.hpp"

namespace inferctx {

namespace {

// Arithmetic on byte and element counts: any overflow is a ConfigError naming what grew.
struct Overflow {};

int64_t mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw Overflow{};
  return r;
}
int64_t add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) throw Overflow{};
  return r;
}
int64_t align_up(int64_t x) { return mul((add(x, kRegionAlignment - 1)) / kRegionAlignment, kRegionAlignment); }

// snprintf rather than iostreams: the library formats no locale-dependent text.
std::string format_double(const char* fmt, double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, value);
  return buf;
}

[[noreturn]] void invalid(const char* argument, const std::string& detail) {
  throw ConfigError(argument, std::string(argument) + ": " + detail);
}

void require_positive(const char* argument, int64_t value) {
  if (value < 1) invalid(argument, "got " + std::to_string(value) + "; it must be a positive integer (>= 1)");
}

int64_t kv_heads_of(const PlanRequest& r) {
  return r.shape.num_kv_heads == 0 ? r.shape.num_heads : r.shape.num_kv_heads;
}

void validate(const PlanRequest& r) {
  require_positive("num_layers", r.shape.num_layers);
  require_positive("num_heads", r.shape.num_heads);
  require_positive("hidden_dim", r.shape.hidden_dim);
  if (r.shape.num_kv_heads < 0)
    invalid("num_kv_heads", "got " + std::to_string(r.shape.num_kv_heads) +
                                "; it must be a positive integer dividing num_heads (or 0 for num_heads)");
  const int64_t kv = kv_heads_of(r);
  if (r.shape.hidden_dim % r.shape.num_heads != 0)
    invalid("hidden_dim", "hidden_dim=" + std::to_string(r.shape.hidden_dim) + " is not divisible by num_heads=" +
                              std::to_string(r.shape.num_heads) + "; the head size must be a whole number");
  if (r.shape.num_heads % kv != 0)
    invalid("num_kv_heads", "num_heads=" + std::to_string(r.shape.num_heads) + " is not divisible by num_kv_heads=" +
                                std::to_string(kv) + "; each KV head must serve a whole group of query heads");
  require_positive("batch_size", r.batch_size);
  require_positive("prompt_len", r.prompt_len);
  require_positive("max_out_tokens", r.max_out_tokens);
  require_positive("min_out_tokens", r.min_out_tokens);
  require_positive("mp_size", r.mp_size);
  if (r.shape.num_heads % r.mp_size != 0)
    invalid("mp_size", "num_heads=" + std::to_string(r.shape.num_heads) + " is not divisible by mp_size=" +
                           std::to_string(r.mp_size) + "; heads are split evenly across model-parallel ranks");
  if (kv % r.mp_size != 0)
    invalid("mp_size", "num_kv_heads=" + std::to_string(kv) + " is not divisible by mp_size=" +
                           std::to_string(r.mp_size) + "; KV heads are split evenly across model-parallel ranks");
  if (r.rank < 0 || r.rank >= r.mp_size)
    invalid("rank", "got " + std::to_string(r.rank) + "; it must be in [0, mp_size) = [0, " +
                        std::to_string(r.mp_size) + ")");
  if (r.min_out_tokens > r.max_out_tokens)
    invalid("min_out_tokens", "min_out_tokens=" + std::to_string(r.min_out_tokens) + " exceeds max_out_tokens=" +
                                  std::to_string(r.max_out_tokens) + "; it must be <= max_out_tokens");
  if (r.prompt_len > r.max_out_tokens)
    invalid("prompt_len", "prompt_len=" + std::to_string(r.prompt_len) + " exceeds max_out_tokens=" +
                              std::to_string(r.max_out_tokens) +
                              "; max_out_tokens counts the prompt, so it must be >= prompt_len");
  dtype_size(r.dtype);
  if (r.policy != static_cast<int>(Policy::Exact) && r.policy != static_cast<int>(Policy::DeepSpeed))
    invalid("policy", "got " + std::to_string(r.policy) + "; valid: 0 (exact) or 1 (deepspeed)");
  if (r.total_bytes <= 0)
    invalid("total_bytes", "got " + std::to_string(r.total_bytes) + "; it must be a positive byte count");
  if (r.free_bytes < 0 || r.free_bytes > r.total_bytes)
    invalid("free_bytes", "got " + std::to_string(r.free_bytes) + "; it must be in [0, total_bytes=" +
                              std::to_string(r.total_bytes) + "]");
  const bool deepspeed = r.policy == static_cast<int>(Policy::DeepSpeed);
  if (r.allocation_granularity < 0)
    invalid("allocation_granularity", "got " + std::to_string(r.allocation_granularity) +
                                          "; it must be a byte count >= 0 (0: no rounding)");
  if (r.has_reserve) {
    if (deepspeed) invalid("reserve_bytes", "applies to the exact policy only; the deepspeed policy reserves 500 MiB (100 MiB when free <= 1 GiB)");
    if (r.reserve_bytes < 0)
      invalid("reserve_bytes", "got " + std::to_string(r.reserve_bytes) + "; it must be >= 0");
  }
  if (r.has_memory_limit) {
    if (deepspeed) invalid("memory_limit_bytes", "applies to the exact policy only");
    if (r.memory_limit_bytes <= 0)
      invalid("memory_limit_bytes", "got " + std::to_string(r.memory_limit_bytes) + "; it must be a positive byte count");
  }
  if (r.has_memory_fraction) {
    if (deepspeed) invalid("memory_fraction", "applies to the exact policy only");
    if (!(r.memory_fraction > 0.0 && r.memory_fraction <= 1.0)) {
      invalid("memory_fraction",
              format_double("got %g", r.memory_fraction) + "; it must be in (0, 1] (a fraction of free memory)");
    }
  }
}

int64_t head_padded(int64_t head) {
  if (head > 128) return head;
  return head <= 32 ? 32 : (head <= 64 ? 64 : 128);
}

// Per-token element counts of DeepSpeed's GenWorkSpace.
struct DeepSpeedTerms {
  int64_t act, temp, cache;
};

DeepSpeedTerms deepspeed_terms(const PlanRequest& r) {
  const int64_t eff = head_padded(r.shape.hidden_dim / r.shape.num_heads);
  DeepSpeedTerms t;
  t.act = mul(mul(mul(10, r.shape.num_heads), eff), r.batch_size);
  t.temp = mul(mul(r.batch_size, r.shape.num_heads / r.mp_size), r.max_out_tokens);
  t.cache = mul(mul(mul(r.shape.num_layers, r.batch_size), mul(r.shape.num_heads, eff) / r.mp_size), 2);
  return t;
}

// Fills the layout for `tokens` tokens (no memory check); throws Overflow.
void layout(const PlanRequest& r, int64_t tokens, WorkspacePlan& p) {
  const int64_t elem = dtype_size(r.dtype);
  const int64_t eff = head_padded(r.shape.hidden_dim / r.shape.num_heads);
  const bool deepspeed = r.policy == static_cast<int>(Policy::DeepSpeed);
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
  p.head_dim = r.shape.hidden_dim / r.shape.num_heads;
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
    const int64_t g = r.allocation_granularity;
    p.workspace_bytes = mul(add(p.workspace_bytes, g - 1) / g, g);
  }
}

void fill_regions(WorkspacePlan& p) {
  p.regions.clear();
  p.regions.push_back({"activations", p.activations_offset, p.activations_bytes});
  if (p.kv_tensor_bytes > 0) {
    for (int64_t l = 0; l < p.request.shape.num_layers; ++l) {
      const int64_t k = p.kv_cache_offset + l * p.kv_layer_stride;
      p.regions.push_back({"kv_cache[" + std::to_string(l) + "].key", k, p.kv_tensor_bytes});
      p.regions.push_back({"kv_cache[" + std::to_string(l) + "].value", k + p.kv_value_offset, p.kv_tensor_bytes});
    }
  }
  p.regions.push_back({"attention_scores", p.attention_scores_offset, p.attention_scores_bytes});
}

bool try_layout(const PlanRequest& r, int64_t tokens, WorkspacePlan& p) {
  try {
    layout(r, tokens, p);
    return true;
  } catch (const Overflow&) {
    return false;
  }
}

struct Attempt {
  bool ok = false;
  WorkspacePlan plan;
  int64_t requested = 0;  // bytes needed for the tokens that had to fit
  std::string why;
};

// Largest v in [lo, hi] with ok(v), for a predicate true on a prefix; lo - 1 when none.
template <class F>
int64_t largest_true(int64_t lo, int64_t hi, F ok) {
  int64_t best = lo - 1;
  while (lo <= hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (ok(mid)) {
      best = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return best;
}

// The largest token count within max_out_tokens whose layout fits the budget (0: none).
int64_t exact_max_tokens(const PlanRequest& r, int64_t budget) {
  WorkspacePlan scratch;
  return largest_true(1, r.max_out_tokens,
                      [&](int64_t t) { return try_layout(r, t, scratch) && scratch.workspace_bytes <= budget; });
}

Attempt attempt(const PlanRequest& r) {
  Attempt a;
  WorkspacePlan& p = a.plan;
  p.request = r;
  const int64_t elem = dtype_size(r.dtype);
  const int64_t need = std::max(r.min_out_tokens, r.prompt_len);
  const int64_t reserve = r.free_bytes > kGiB ? 500 * kMiB : 100 * kMiB;
  int64_t max_tokens = 0;
  try {
    if (r.policy == static_cast<int>(Policy::DeepSpeed)) {
      const DeepSpeedTerms t = deepspeed_terms(r);
      const int64_t per_token = add(add(t.act, t.temp), t.cache);
      const int64_t minimal = add(t.temp, reserve);  // elements plus bytes, as DeepSpeed adds them
      p.reserve_bytes = reserve;
      p.budget_limit = "reserve";
      p.budget_bytes = r.free_bytes - minimal;
      a.requested = add(mul(mul(per_token, need), elem), minimal);
      if (r.free_bytes < minimal) {
        a.why = "free memory " + human_bytes(r.free_bytes) + " is below DeepSpeed's minimum of " +
                human_bytes(minimal);
        return a;
      }
      max_tokens = std::min(r.max_out_tokens, ((r.free_bytes - minimal) / elem) / per_token);
    } else {
      p.reserve_bytes = r.has_reserve ? r.reserve_bytes : reserve;
      int64_t budget = r.free_bytes - p.reserve_bytes;
      p.budget_limit = "reserve";
      if (r.has_memory_limit && r.memory_limit_bytes < budget) {
        budget = r.memory_limit_bytes;
        p.budget_limit = "memory_limit";
      }
      if (r.has_memory_fraction) {
        const int64_t frac = static_cast<int64_t>(std::floor(r.memory_fraction * static_cast<double>(r.free_bytes)));
        if (frac < budget) {
          budget = frac;
          p.budget_limit = "memory_fraction";
        }
      }
      p.budget_bytes = budget;
      WorkspacePlan needed;
      layout(r, need, needed);  // a request whose minimum overflows 64 bits is invalid
      a.requested = needed.workspace_bytes;
      max_tokens = budget > 0 ? exact_max_tokens(r, budget) : 0;
    }
    if (max_tokens < need) {
      const char* which = r.prompt_len > r.min_out_tokens ? "prompt_len" : "min_out_tokens";
      a.why = std::to_string(max_tokens) + " tokens fit, fewer than " + which + "=" + std::to_string(need);
      return a;
    }
    layout(r, max_tokens, p);
  } catch (const Overflow&) {
    throw ConfigError("batch_size", "the workspace byte count overflows 64 bits for batch_size=" +
                                        std::to_string(r.batch_size) + ", max_out_tokens=" +
                                        std::to_string(r.max_out_tokens) + "; reduce them");
  }
  p.bound_by = max_tokens == r.max_out_tokens ? "max_out_tokens" : "memory";
  a.ok = true;  // the caller that keeps the plan fills its regions: fits() probes need none
  return a;
}

bool fits(const PlanRequest& r) {
  try {
    return attempt(r).ok;
  } catch (const ConfigError&) {
    return false;
  }
}

}  // namespace

int64_t dtype_size(int dtype) {
  switch (dtype) {
    case static_cast<int>(DType::Float32): return 4;
    case static_cast<int>(DType::Float16): return 2;
    case static_cast<int>(DType::BFloat16): return 2;
    default:
      invalid("dtype", "got code " + std::to_string(dtype) + "; valid: float32, float16, bfloat16");
  }
}

std::string human_bytes(int64_t bytes) {
  // Compared on both sides rather than through llabs, which is undefined for INT64_MIN.
  const double b = static_cast<double>(bytes);
  if (bytes >= kGiB || bytes <= -kGiB) return format_double("%.2f GiB", b / static_cast<double>(kGiB));
  if (bytes >= kMiB || bytes <= -kMiB) return format_double("%.2f MiB", b / static_cast<double>(kMiB));
  return std::to_string(bytes) + " B";
}

int64_t workspace_bytes_for(const PlanRequest& request, int64_t tokens) {
  validate(request);
  require_positive("tokens", tokens);
  WorkspacePlan p;
  p.request = request;
  if (!try_layout(request, tokens, p))
    throw ConfigError("tokens", "the workspace byte count for tokens=" + std::to_string(tokens) + " overflows 64 bits");
  return p.workspace_bytes;
}

WorkspacePlan plan_workspace(const PlanRequest& request) {
  validate(request);
  Attempt a = attempt(request);
  if (a.ok) {
    fill_regions(a.plan);
    return std::move(a.plan);
  }

  const int64_t need = std::max(request.min_out_tokens, request.prompt_len);
  PlanRequest probe = request;
  const int64_t best_batch = largest_true(1, request.batch_size - 1, [&](int64_t b) {
    probe = request;
    probe.batch_size = b;
    return fits(probe);
  });
  const int64_t best_out = largest_true(need, request.max_out_tokens - 1, [&](int64_t m) {
    probe = request;
    probe.max_out_tokens = m;
    return fits(probe);
  });
  const int64_t batch_hint = best_batch >= 1 ? best_batch : -1;
  const int64_t out_hint = best_out >= need ? best_out : -1;

  std::string msg = "workspace does not fit: " + a.why + "; needs " + human_bytes(a.requested) + " for " +
                    std::to_string(need) + " tokens, free " + human_bytes(request.free_bytes) + " of " +
                    human_bytes(request.total_bytes) + ", budget " + human_bytes(a.plan.budget_bytes) + " (" +
                    a.plan.budget_limit + ")";
  if (batch_hint > 0 || out_hint > 0) {
    msg += "; would fit:";
    if (batch_hint > 0) msg += " batch_size <= " + std::to_string(batch_hint);
    if (batch_hint > 0 && out_hint > 0) msg += " or";
    if (out_hint > 0) msg += " max_out_tokens <= " + std::to_string(out_hint);
  } else {
    msg += "; no smaller batch_size or max_out_tokens fits: free memory, use a smaller dtype, mp_size or "
           "external_cache";
  }
  throw WorkspaceOOMError(msg, a.requested, request.free_bytes, request.total_bytes, a.plan.budget_bytes,
                          batch_hint, out_hint);
}

}  // namespace inferctx

#include "inferctx/plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "inferctx/errors.hpp"

namespace inferctx {

namespace {

// Arithmetic on byte and element counts: any overflow is reported as a ConfigError naming
// the argument that made it overflow (see overflow_error).
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
int64_t round_up(int64_t x, int64_t multiple) { return mul(add(x, multiple - 1) / multiple, multiple); }
int64_t align_up(int64_t x) { return round_up(x, kRegionAlignment); }

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

bool is_deepspeed(const PlanRequest& r) { return r.policy == static_cast<int>(Policy::DeepSpeed); }

int64_t kv_heads_of(const PlanRequest& r) {
  return r.shape.num_kv_heads == 0 ? r.shape.num_heads : r.shape.num_kv_heads;
}

// The head size the policy sizes with: the shape's under the exact policy; hidden / heads
// (integer division, whatever head_dim says) under the deepspeed policy, as GenWorkSpace does.
int64_t head_of(const PlanRequest& r) {
  if (is_deepspeed(r) || r.shape.head_dim == 0) return r.shape.hidden_dim / r.shape.num_heads;
  return r.shape.head_dim;
}

int64_t head_padded(int64_t head) {
  if (head > 128) return head;
  return head <= 32 ? 32 : (head <= 64 ? 64 : 128);
}

void validate_arguments(const PlanRequest& r) {
  require_positive("num_layers", r.shape.num_layers);
  require_positive("num_heads", r.shape.num_heads);
  require_positive("hidden_dim", r.shape.hidden_dim);
  if (r.shape.num_kv_heads < 0)
    invalid("num_kv_heads", "got " + std::to_string(r.shape.num_kv_heads) +
                                "; it must be a positive integer dividing num_heads (or 0 for num_heads)");
  if (r.shape.head_dim < 0)
    invalid("head_dim", "got " + std::to_string(r.shape.head_dim) +
                            "; it must be a positive integer (or 0 for hidden_dim / num_heads)");
  const int64_t kv = kv_heads_of(r);
  if (r.shape.head_dim == 0 && r.shape.hidden_dim % r.shape.num_heads != 0)
    invalid("hidden_dim", "hidden_dim=" + std::to_string(r.shape.hidden_dim) + " is not divisible by num_heads=" +
                              std::to_string(r.shape.num_heads) +
                              "; give head_dim (the size of one head) for a model whose heads do not split "
                              "hidden_dim evenly");
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
  const bool deepspeed = is_deepspeed(r);
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

void validate(const PlanRequest& r) {
  validate_arguments(r);
  if (r.total_bytes <= 0)
    invalid("total_bytes", "got " + std::to_string(r.total_bytes) + "; it must be a positive byte count");
  if (r.free_bytes < 0 || r.free_bytes > r.total_bytes)
    invalid("free_bytes", "got " + std::to_string(r.free_bytes) + "; it must be in [0, total_bytes=" +
                              std::to_string(r.total_bytes) + "]");
  if (r.weights_bytes < 0)
    invalid("weights_bytes", "got " + std::to_string(r.weights_bytes) + "; it must be a byte count >= 0");
}

// Per-token element counts of DeepSpeed's GenWorkSpace.
struct DeepSpeedTerms {
  int64_t act, temp, cache;
};

DeepSpeedTerms deepspeed_terms(const PlanRequest& r) {
  const int64_t eff = head_padded(head_of(r));
  DeepSpeedTerms t;
  t.act = mul(mul(mul(10, r.shape.num_heads), eff), r.batch_size);
  t.temp = mul(mul(r.batch_size, r.shape.num_heads / r.mp_size), r.max_out_tokens);
  t.cache = mul(mul(mul(r.shape.num_layers, r.batch_size), mul(r.shape.num_heads, eff) / r.mp_size), 2);
  return t;
}

// Fills the layout for `tokens` tokens (no memory check); throws Overflow.
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

// The byte count for `tokens` tokens overflows 64 bits: names the argument that makes it do
// so. Each candidate is set to its smallest value in turn; of those whose change alone
// removes the overflow, the largest is named (the first on a tie), else the largest of all.
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

// The memory a request is planned against.
struct Budget {
  int64_t planned_free = 0;  // free - weights, clamped at 0
  int64_t reserve = 0;
  int64_t bytes = 0;  // >= 0
  std::string limit;  // "reserve", "memory_limit" or "memory_fraction"
  std::string short_by;  // why nothing fits at all, or empty
};

int64_t deepspeed_reserve(int64_t free) { return free > kGiB ? 500 * kMiB : 100 * kMiB; }

// floor(fraction * bytes) for fraction in (0, 1], never above bytes: the product is formed in
// double, which rounds 2^63 - 1 up to 2^63, outside int64_t.
int64_t fraction_of(double fraction, int64_t bytes) {
  if (fraction >= 1.0) return bytes;
  const double product = std::floor(fraction * static_cast<double>(bytes));
  if (!(product < 9223372036854775807.0)) return bytes;
  return std::min(bytes, static_cast<int64_t>(product));
}

Budget budget_of(const PlanRequest& r) {
  Budget b;
  const int64_t weights = r.weights_bytes;
  b.planned_free = std::max<int64_t>(0, r.free_bytes - weights);
  const std::string after = weights > 0 ? " after the weights (" + human_bytes(weights) + ")" : "";
  if (weights > r.free_bytes) {
    b.limit = "reserve";
    b.short_by = "the weights (" + human_bytes(weights) + ") exceed free memory " + human_bytes(r.free_bytes);
    return b;
  }
  if (is_deepspeed(r)) {
    b.reserve = deepspeed_reserve(b.planned_free);
    b.limit = "reserve";
    return b;  // DeepSpeed's budget depends on the terms; attempt() works it out
  }
  b.reserve = r.has_reserve ? r.reserve_bytes : default_reserve(b.planned_free);
  b.limit = "reserve";
  b.bytes = b.planned_free - b.reserve;
  if (b.bytes <= 0) {
    b.bytes = 0;
    b.short_by = "free memory " + human_bytes(b.planned_free) + after + " is not more than the reserve of " +
                 human_bytes(b.reserve) + (r.has_reserve ? " (reserve_bytes)" : " (the default reserve; set reserve_bytes)");
  }
  if (r.has_memory_limit && r.memory_limit_bytes < b.bytes) {
    b.bytes = r.memory_limit_bytes;
    b.limit = "memory_limit";
  }
  if (r.has_memory_fraction) {
    const int64_t frac = fraction_of(r.memory_fraction, b.planned_free);
    if (frac < b.bytes) {
      b.bytes = frac;
      b.limit = "memory_fraction";
    }
  }
  return b;
}

struct Attempt {
  bool ok = false;
  WorkspacePlan plan;
  int64_t requested = 0;  // bytes needed for the tokens that had to fit (weights excluded)
  std::string why;
};

std::string tokens_text(int64_t n) { return std::to_string(n) + (n == 1 ? " token" : " tokens"); }

int64_t needed_tokens(const PlanRequest& r) { return std::max(r.min_out_tokens, r.prompt_len); }
const char* needed_argument(const PlanRequest& r) {
  return r.prompt_len > r.min_out_tokens ? "prompt_len" : "min_out_tokens";
}

// Plans r without the OOM hints; a request whose minimum overflows 64 bits is a ConfigError.
Attempt attempt(const PlanRequest& r) {
  Attempt a;
  WorkspacePlan& p = a.plan;
  p.request = r;
  const int64_t elem = dtype_size(r.dtype);
  const int64_t need = needed_tokens(r);
  const Budget b = budget_of(r);
  p.planned_free_bytes = b.planned_free;
  p.reserve_bytes = b.reserve;
  p.budget_limit = b.limit;
  p.budget_bytes = b.bytes;
  int64_t max_tokens = 0;
  try {
    if (is_deepspeed(r)) {
      const DeepSpeedTerms t = deepspeed_terms(r);
      const int64_t per_token = add(add(t.act, t.temp), t.cache);
      const int64_t minimal = add(t.temp, b.reserve);  // elements plus bytes, as DeepSpeed adds them
      a.requested = add(mul(mul(per_token, need), elem), minimal);
      if (!b.short_by.empty()) {
        a.why = b.short_by;
        return a;
      }
      if (b.planned_free < minimal) {
        a.why = "free memory " + human_bytes(b.planned_free) + " is below DeepSpeed's minimum of " +
                human_bytes(minimal);
        return a;
      }
      p.budget_bytes = b.planned_free - minimal;
      max_tokens = std::min(r.max_out_tokens, ((b.planned_free - minimal) / elem) / per_token);
    } else {
      WorkspacePlan needed;
      layout(r, need, needed);
      a.requested = needed.workspace_bytes;
      if (!b.short_by.empty()) {
        a.why = b.short_by;
        return a;
      }
      WorkspacePlan scratch;
      max_tokens = largest_true(1, r.max_out_tokens, [&](int64_t t) {
        try {
          layout(r, t, scratch);
        } catch (const Overflow&) {
          return false;
        }
        return scratch.workspace_bytes <= b.bytes;
      });
      if (max_tokens < 0) max_tokens = 0;
    }
  } catch (const Overflow&) {
    overflow_error(r, need, needed_argument(r));
  }
  if (max_tokens < need) {
    a.why = tokens_text(max_tokens) + (max_tokens == 1 ? " fits" : " fit") + ", fewer than " + needed_argument(r) +
            "=" + std::to_string(need);
    return a;
  }
  layout(r, max_tokens, p);  // cannot overflow: fewer bytes than a layout that fits
  p.bound_by = max_tokens == r.max_out_tokens ? "max_out_tokens" : "memory";
  a.ok = true;
  return a;
}

bool fits(const PlanRequest& r) {
  try {
    return attempt(r).ok;
  } catch (const ConfigError&) {
    return false;
  }
}

// Whether r holds every one of its max_out_tokens.
bool holds_all(PlanRequest r) {
  r.min_out_tokens = r.max_out_tokens;
  return fits(r);
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
  struct Unit {
    const char* format;
    int64_t scale;
  };
  static constexpr Unit kUnits[] = {
      {"%.2f TiB", int64_t{1} << 40}, {"%.2f GiB", kGiB}, {"%.2f MiB", kMiB}, {"%.2f KiB", int64_t{1} << 10}};
  for (const Unit& unit : kUnits) {
    // Compared on both sides rather than through llabs, which is undefined for INT64_MIN.
    if (bytes >= unit.scale || bytes <= -unit.scale) {
      return format_double(unit.format, static_cast<double>(bytes) / static_cast<double>(unit.scale));
    }
  }
  return std::to_string(bytes) + " B";
}

int64_t default_reserve(int64_t free) {
  if (free <= kGiB) return 100 * kMiB;
  return std::min(500 * kMiB, free - 924 * kMiB);
}

void check_request(const PlanRequest& request) { validate_arguments(request); }

int64_t workspace_bytes_for(const PlanRequest& request, int64_t tokens) {
  validate(request);
  require_positive("tokens", tokens);
  WorkspacePlan p;
  p.request = request;
  try {
    layout(request, tokens, p);
  } catch (const Overflow&) {
    overflow_error(request, tokens, "tokens");
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

WorkspacePlan plan_workspace(const PlanRequest& request) {
  validate(request);
  Attempt a = attempt(request);
  if (a.ok) return std::move(a.plan);

  const int64_t need = needed_tokens(request);
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
                    tokens_text(need) + ", free " + human_bytes(request.free_bytes) + " of " +
                    human_bytes(request.total_bytes);
  if (request.weights_bytes > 0)
    msg += ", " + human_bytes(a.plan.planned_free_bytes) + " after the weights (" + human_bytes(request.weights_bytes) + ")";
  msg += ", budget " + human_bytes(a.plan.budget_bytes) + " (" + a.plan.budget_limit + ")";
  if (batch_hint > 0 || out_hint > 0) {
    msg += "; would fit:";
    if (batch_hint > 0) msg += " batch_size <= " + std::to_string(batch_hint);
    if (batch_hint > 0 && out_hint > 0) msg += " or";
    if (out_hint > 0) msg += " max_out_tokens <= " + std::to_string(out_hint);
  } else if (request.weights_bytes > request.free_bytes) {
    msg += "; the weights alone do not fit: use a larger mp_size (weights split across ranks), a smaller "
           "dtype, or a device with more memory";
  } else {
    msg += "; no smaller batch_size or max_out_tokens fits: free memory, use a smaller dtype, mp_size or "
           "external_cache";
  }
  throw WorkspaceOOMError(msg, a.requested, request.free_bytes, request.total_bytes, a.plan.budget_bytes,
                          batch_hint, out_hint);
}

int64_t max_batch_size(const PlanRequest& request) {
  PlanRequest r = request;
  r.batch_size = 1;
  validate(r);
  PlanRequest probe = r;
  // Bytes grow with the batch, so "holds all" is true on a prefix of batch sizes.
  const int64_t best = largest_true(1, int64_t{1} << 62, [&](int64_t b) {
    probe.batch_size = b;
    return holds_all(probe);
  });
  return std::max<int64_t>(best, 0);
}

int64_t max_out_tokens_for(const PlanRequest& request) {
  PlanRequest r = request;
  const int64_t need = std::max(request.min_out_tokens, request.prompt_len);
  r.max_out_tokens = need;
  validate(r);
  PlanRequest probe = r;
  const int64_t best = largest_true(need, int64_t{1} << 62, [&](int64_t m) {
    probe.max_out_tokens = m;
    return holds_all(probe);
  });
  return best >= need ? best : 0;
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

// Fitting a request in memory: the budget it is cut from (under either policy), the largest
// max_tokens whose layout fits it, and, when the request cannot fit, the largest batch_size and
// max_out_tokens that would.
#include "inferctx/plan.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "inferctx/errors.hpp"
#include "plan_detail.hpp"

namespace inferctx {

namespace {

using detail::add;
using detail::deepspeed_terms;
using detail::DeepSpeedTerms;
using detail::is_deepspeed;
using detail::layout;
using detail::mul;
using detail::overflow_error;
using detail::Overflow;
using detail::validate;

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
  int64_t fit_tokens = -1;  // where those tokens were what failed: how many fit at this batch
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
    a.fit_tokens = max_tokens;
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

int64_t default_reserve(int64_t free) {
  if (free <= kGiB) return 100 * kMiB;
  return std::min(500 * kMiB, free - 924 * kMiB);
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
  // Where the tokens that must fit (prompt_len, min_out_tokens) are what failed, asking for no
  // more than fit at this batch is an answer too (the plan is then bound by memory).
  std::string tokens_hint;
  if (a.fit_tokens >= 1) {
    for (const auto& [name, value] : {std::pair<const char*, int64_t>{"prompt_len", request.prompt_len},
                                      std::pair<const char*, int64_t>{"min_out_tokens", request.min_out_tokens}}) {
      if (value <= a.fit_tokens) continue;
      tokens_hint += (tokens_hint.empty() ? "" : " and ") + std::string(name) + " <= " + std::to_string(a.fit_tokens);
    }
  }

  std::string msg = "workspace does not fit: " + a.why + "; needs " + human_bytes(a.requested) + " for " +
                    tokens_text(need) + ", free " + human_bytes(request.free_bytes) + " of " +
                    human_bytes(request.total_bytes);
  if (request.weights_bytes > 0)
    msg += ", " + human_bytes(a.plan.planned_free_bytes) + " after the weights (" + human_bytes(request.weights_bytes) + ")";
  msg += ", budget " + human_bytes(a.plan.budget_bytes) + " (" + a.plan.budget_limit + ")";
  std::vector<std::string> hints;
  if (batch_hint > 0) hints.push_back("batch_size <= " + std::to_string(batch_hint));
  if (out_hint > 0) hints.push_back("max_out_tokens <= " + std::to_string(out_hint));
  if (!tokens_hint.empty()) hints.push_back(tokens_hint);
  if (!hints.empty()) {
    msg += "; would fit: ";
    for (size_t i = 0; i < hints.size(); ++i) msg += (i ? " or " : "") + hints[i];
  } else if (request.weights_bytes > request.free_bytes) {
    // The reason (a.why) says the weights exceed free memory. Whether a larger mp_size or a
    // smaller dtype would shrink them depends on where their bytes came from: the Python layer
    // adds that advice when they came from the parameter count.
  } else if (a.plan.budget_limit == "memory_limit" || a.plan.budget_limit == "memory_fraction") {
    msg += "; no smaller batch_size or max_out_tokens fits within the " +
           std::string(a.plan.budget_limit == "memory_limit" ? "memory_limit_bytes" : "memory_fraction of free memory") +
           " asked for: raise it, or use a smaller dtype, mp_size or external_cache";
  } else if (request.has_reserve && a.plan.budget_bytes == 0) {
    // The reserve asked for leaves nothing: no request fits until it is lowered (or more is free).
    msg += "; nothing fits beside the reserve_bytes asked for: lower it, or free memory";
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

}  // namespace inferctx

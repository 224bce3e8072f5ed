// What the planner's files share, internal to cuda/src: checked arithmetic on byte counts, the
// argument errors, and the request's head sizes. plan_request.cpp checks requests and formats
// bytes, plan_layout.cpp is the sizing formula (the regions for a number of tokens), plan.cpp
// fits a request in its memory budget.
#pragma once

#include <cstdint>
#include <string>

#include "inferctx/plan.hpp"

namespace inferctx::detail {

// Arithmetic on byte and element counts: any overflow is reported as a ConfigError naming
// the argument that made it overflow (see overflow_error).
struct Overflow {};

inline int64_t mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw Overflow{};
  return r;
}
inline int64_t add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) throw Overflow{};
  return r;
}
inline int64_t round_up(int64_t x, int64_t multiple) { return mul(add(x, multiple - 1) / multiple, multiple); }
inline int64_t align_up(int64_t x) { return round_up(x, kRegionAlignment); }

// snprintf rather than iostreams: the library formats no locale-dependent text.
std::string format_double(const char* fmt, double value);

// ConfigError(argument) with the message "argument: detail".
[[noreturn]] void invalid(const char* argument, const std::string& detail);

void require_positive(const char* argument, int64_t value);

// Every check of plan_workspace: the arguments (check_request) and the memory figures.
void validate(const PlanRequest& r);

inline bool is_deepspeed(const PlanRequest& r) { return r.policy == static_cast<int>(Policy::DeepSpeed); }

inline int64_t kv_heads_of(const PlanRequest& r) {
  return r.shape.num_kv_heads == 0 ? r.shape.num_heads : r.shape.num_kv_heads;
}

// The head size the policy sizes with: the shape's under the exact policy; hidden / heads
// (integer division, whatever head_dim says) under the deepspeed policy, as GenWorkSpace does.
inline int64_t head_of(const PlanRequest& r) {
  if (is_deepspeed(r) || r.shape.head_dim == 0) return r.shape.hidden_dim / r.shape.num_heads;
  return r.shape.head_dim;
}

inline int64_t head_padded(int64_t head) {
  if (head > 128) return head;
  return head <= 32 ? 32 : (head <= 64 ? 64 : 128);
}

// Per-token element counts of DeepSpeed's GenWorkSpace.
struct DeepSpeedTerms {
  int64_t act, temp, cache;
};

DeepSpeedTerms deepspeed_terms(const PlanRequest& r);

// Fills the layout for `tokens` tokens (no memory check); throws Overflow.
void layout(const PlanRequest& r, int64_t tokens, WorkspacePlan& p);

// The byte count for `tokens` tokens overflows 64 bits: names the argument that makes it do
// so. Each candidate is set to its smallest value in turn; of those whose change alone
// removes the overflow, the largest is named (the first on a tie), else the largest of all.
[[noreturn]] void overflow_error(const PlanRequest& r, int64_t tokens, const char* tokens_argument);

}  // namespace inferctx::detail

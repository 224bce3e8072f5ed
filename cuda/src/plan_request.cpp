// Checking a planning request (the arguments, then the memory figures), and the planner's
// formatting of figures: dtype sizes and byte counts in words.
#include <cstdio>
#include <string>

#include "inferctx/errors.hpp"
#include "inferctx/plan.hpp"
#include "plan_detail.hpp"

namespace inferctx {

namespace detail {

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

namespace {

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
  // The deepspeed policy sizes the KV cache with num_heads / mp_size, as DeepSpeed's GenWorkSpace
  // does (it has no KV heads): num_kv_heads need not divide there.
  if (kv % r.mp_size != 0 && r.policy != static_cast<int>(Policy::DeepSpeed))
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

}  // namespace

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

}  // namespace detail

using detail::format_double;
using detail::invalid;

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

void check_request(const PlanRequest& request) { detail::validate_arguments(request); }

}  // namespace inferctx

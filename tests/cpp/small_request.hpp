// The C++ tests' small model: 2 layers, 4 heads, hidden 256 (head_dim 64), 2 KV heads, fp16, the
// exact policy, prompt 1 (the PlanRequest defaults). Per token: activations 10*4*64 = 2560
// elements (5120 B), one K or V tensor 2*64 elements (256 B), attention scores 4*16 = 64 elements
// (128 B); batch 16 and 1024 tokens give 224 MiB (activations 80, KV cache 16, scores 128 MiB).
#pragma once

#include <cstdint>

#include "inferctx/plan.hpp"

inline inferctx::PlanRequest small_request(int64_t max_out_tokens, int64_t batch = 1) {
  inferctx::PlanRequest r;
  r.shape = {2, 4, 256, 2};
  r.batch_size = batch;
  r.max_out_tokens = max_out_tokens;
  return r;
}

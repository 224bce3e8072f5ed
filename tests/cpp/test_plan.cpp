// Planner cases worked out by hand (see the comments for the arithmetic).
#include <string>

#include "check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/plan.hpp"
#include "small_request.hpp"

using namespace inferctx;

namespace {

// DeepSpeed's own example: 32 layers, 32 heads, hidden 4096, batch 8, fp16, mp 1.
PlanRequest deepspeed_llama7b(int64_t free_bytes) {
  PlanRequest r;
  r.shape = {32, 32, 4096, 0};
  r.batch_size = 8;
  r.prompt_len = 1;
  r.max_out_tokens = 2048;
  r.min_out_tokens = 1;
  r.dtype = static_cast<int>(DType::Float16);
  r.policy = static_cast<int>(Policy::DeepSpeed);
  r.free_bytes = free_bytes;
  r.total_bytes = 80 * kGiB;
  return r;
}

// 2 layers, 4 heads, hidden 256 (head 64), 2 KV heads, batch 1, max_out 16, fp16.
// Per token: activations 10*4*64 = 2560 elements = 5120 B; one K (or V) tensor
// 2*64 elements = 256 B; attention scores 4*16 = 64 elements = 128 B.
PlanRequest small_exact() {
  PlanRequest r = small_request(16);
  r.free_bytes = 80 * kGiB;
  r.total_bytes = 80 * kGiB;
  return r;
}

// small_exact() with no reserve and a budget of `limit` bytes (memory_limit_bytes).
PlanRequest small_exact_within(int64_t limit) {
  PlanRequest r = small_exact();
  r.has_reserve = true;
  r.reserve_bytes = 0;
  r.has_memory_limit = true;
  r.memory_limit_bytes = limit;
  return r;
}

}  // namespace

TEST_CASE("deepspeed policy, 75 GiB free: 2048 tokens, 12,079,595,520 bytes") {
  // act 327680 + temp 524288 + cache 2097152 = 2949120 elements per token; x 2048 x 2 B.
  WorkspacePlan p = plan_workspace(deepspeed_llama7b(75 * kGiB));
  CHECK_EQ(p.max_tokens, 2048);
  CHECK_EQ(p.workspace_bytes, int64_t{12079595520});
  CHECK(p.bound_by == "max_out_tokens");
  // scores start at workspace - temp * tokens * 2 = 12079595520 - 524288*2048*2.
  CHECK_EQ(p.attention_scores_offset, int64_t{12079595520} - int64_t{524288} * 2048 * 2);
  CHECK_EQ(p.kv_cache_offset, int64_t{327680} * 2048 * 2);
  CHECK_EQ(p.kv_cache_bytes, int64_t{2097152} * 2048 * 2);
}

TEST_CASE("deepspeed policy, 8 GiB free: 1367 tokens") {
  // minimal = 524288 + 500 MiB = 524812288; (8 GiB - minimal) / 2 / 2949120 = 1367.3
  WorkspacePlan p = plan_workspace(deepspeed_llama7b(8 * kGiB));
  CHECK_EQ(p.max_tokens, 1367);
  CHECK_EQ(p.workspace_bytes, int64_t{2949120} * 1367 * 2);
  CHECK_EQ(p.attention_scores_offset, int64_t{8062894080} - int64_t{1433403392});
  CHECK(p.bound_by == "memory");
  CHECK_EQ(p.budget_bytes, int64_t{8} * kGiB - 524812288);
}

TEST_CASE("deepspeed policy with external cache leaves the cache out of the bytes only") {
  PlanRequest r = deepspeed_llama7b(8 * kGiB);
  r.external_cache = true;
  WorkspacePlan p = plan_workspace(r);
  CHECK_EQ(p.max_tokens, 1367);  // the cache term still counts in the token formula
  CHECK_EQ(p.workspace_bytes, int64_t{327680 + 524288} * 1367 * 2);
  CHECK_EQ(p.kv_cache_bytes, 0);
}

TEST_CASE("deepspeed policy: below the minimum is an OOM") {
  // 100 MiB free (<= 1 GiB): minimal = 524288 + 100 MiB = 100.50 MiB > free.
  PlanRequest r = deepspeed_llama7b(100 * kMiB);
  CHECK_THROWS(WorkspaceOOMError, plan_workspace(r));
  std::string m;
  try {
    plan_workspace(r);
  } catch (const WorkspaceOOMError& e) {
    m = e.what();
  }
  CHECK(m.find("free memory 100.00 MiB is below DeepSpeed's minimum of 100.50 MiB") != std::string::npos);
}

TEST_CASE("exact policy, bound by max_out_tokens") {
  // 16 tokens: 81920 + 4 x 4096 + 2048 = 100352 bytes, every region 256-aligned already.
  WorkspacePlan p = plan_workspace(small_exact());
  CHECK_EQ(p.max_tokens, 16);
  CHECK_EQ(p.workspace_bytes, 100352);
  CHECK(p.bound_by == "max_out_tokens");
  CHECK_EQ(region_count(p), 6);
  CHECK_EQ(p.budget_bytes, 80 * kGiB - 500 * kMiB);
}

TEST_CASE("exact policy, bound by memory, aligned regions") {
  // bytes(T) = 5120T + 4*256T + 256*ceil(T/2); T=7: 44032 <= 50000 < bytes(8) = 50176.
  PlanRequest r = small_exact();
  r.has_reserve = true;
  r.reserve_bytes = 0;
  r.has_memory_limit = true;
  r.memory_limit_bytes = 50000;
  WorkspacePlan p = plan_workspace(r);
  CHECK_EQ(p.max_tokens, 7);
  CHECK_EQ(p.workspace_bytes, 44032);
  CHECK(p.bound_by == "memory");
  CHECK(p.budget_limit == "memory_limit");
  CHECK_EQ(region_at(p, 0).offset, 0);
  CHECK_EQ(region_at(p, 0).size, 35840);
  CHECK_EQ(region_at(p, 1).offset, 35840);  // layer 0 K
  CHECK(region_at(p, 1).name == "kv_cache[0].key");
  CHECK_EQ(region_at(p, 2).offset, 37632);  // layer 0 V
  CHECK(region_at(p, 2).name == "kv_cache[0].value");
  CHECK_EQ(region_at(p, 3).offset, 39424);  // layer 1 K
  CHECK_EQ(region_at(p, 4).offset, 41216);  // layer 1 V
  CHECK_EQ(region_at(p, 4).size, 1792);     // 7 tokens x 2 KV heads x 64 x 2 B
  CHECK_EQ(region_at(p, 5).offset, 43008);  // scores: 896 B rounded to 1024
  CHECK_EQ(region_at(p, 5).size, 1024);
  CHECK(region_at(p, 5).name == "attention_scores");
  CHECK_THROWS(ConfigError, region_at(p, 6));
  CHECK_THROWS(ConfigError, region_at(p, -1));
}

TEST_CASE("exact policy, memory_fraction of free memory") {
  // fraction 0.5 of 100000 free = 50000, below free - reserve (reserve 0).
  PlanRequest r = small_exact();
  r.free_bytes = 100000;
  r.total_bytes = 200000;
  r.has_reserve = true;
  r.reserve_bytes = 0;
  r.has_memory_fraction = true;
  r.memory_fraction = 0.5;
  WorkspacePlan p = plan_workspace(r);
  CHECK_EQ(p.budget_bytes, 50000);
  CHECK(p.budget_limit == "memory_fraction");
  CHECK_EQ(p.max_tokens, 7);
}

TEST_CASE("exact policy: OOM names the largest batch and max_out_tokens that fit") {
  // batch 2, 4 tokens needed: 40960 + 8192 + 1024 = 50176 > 50000. batch 1: 25088 fits.
  // max_out m at batch 2: 49152 + align(64m) <= 50000 up to m = 12 (768); m = 13 needs 1024.
  PlanRequest r = small_exact_within(50000);
  r.batch_size = 2;
  r.min_out_tokens = 4;
  bool caught = false;
  try {
    plan_workspace(r);
  } catch (const WorkspaceOOMError& e) {
    caught = true;
    CHECK_EQ(e.requested_bytes, 50176);
    CHECK_EQ(e.budget_bytes, 50000);
    CHECK_EQ(e.max_batch_size, 1);
    CHECK_EQ(e.max_out_tokens, 12);
  }
  CHECK(caught);
}

TEST_CASE("exact policy: OOM where the tokens that must fit are too many names the most that fit") {
  // Batch 1, max_out 16, budget 50000: t tokens take act 5120t + KV 2 layers x 2 x 256t + scores
  // align256(4 heads x 16 x t x 2 B). t = 7: 35840 + 7168 + 1024 = 44032 fits; t = 8: 40960 +
  // 8192 + 1024 = 50176 does not. 12 tokens need 61440 + 12288 + 1536 = 75264.
  PlanRequest r = small_exact_within(50000);
  auto message = [](const PlanRequest& req) {
    try {
      plan_workspace(req);
    } catch (const WorkspaceOOMError& e) {
      CHECK_EQ(e.max_batch_size, -1);  // no smaller batch or max_out_tokens holds 12 tokens
      CHECK_EQ(e.max_out_tokens, -1);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  r.min_out_tokens = 12;
  std::string m = message(r);
  CHECK(m.find("7 tokens fit, fewer than min_out_tokens=12; needs 73.50 KiB for 12 tokens") != std::string::npos);
  CHECK(m.find("; would fit: min_out_tokens <= 7") != std::string::npos);
  CHECK(m.find("no smaller") == std::string::npos);
  r.prompt_len = 10;  // both over 7: both named
  m = message(r);
  CHECK(m.find("; would fit: prompt_len <= 7 and min_out_tokens <= 7") != std::string::npos);
  r.min_out_tokens = 5;  // only the prompt over 7
  m = message(r);
  CHECK(m.find("7 tokens fit, fewer than prompt_len=10") != std::string::npos);
  CHECK(m.find("; would fit: prompt_len <= 7") != std::string::npos);
  CHECK(m.find("min_out_tokens <=") == std::string::npos);
  // Each answer fits: 7 tokens asked for, the plan holds 7.
  r.prompt_len = 7;
  CHECK_EQ(plan_workspace(r).max_tokens, 7);
  r.prompt_len = 1;
  r.min_out_tokens = 7;
  CHECK_EQ(plan_workspace(r).max_tokens, 7);
}

TEST_CASE("exact policy: the batch, max_out_tokens and token answers are offered together") {
  // Batch 2, max_out 16, 4 tokens needed, budget 50000 (the case above it: batch 1 and
  // max_out_tokens 12 fit). At batch 2, t = 3: 30720 + 6144 + align256(2 x 4 x 16 x 3 x 2 = 768)
  // = 37632 fits; t = 4: 40960 + 8192 + 1024 = 50176 does not.
  PlanRequest r = small_exact_within(50000);
  r.batch_size = 2;
  r.min_out_tokens = 4;
  std::string m;
  try {
    plan_workspace(r);
  } catch (const WorkspaceOOMError& e) {
    m = e.what();
  }
  CHECK(m.find("; would fit: batch_size <= 1 or max_out_tokens <= 12 or min_out_tokens <= 3") != std::string::npos);
  r.min_out_tokens = 3;
  CHECK_EQ(plan_workspace(r).max_tokens, 3);
}

TEST_CASE("both policies refuse a prompt that does not fit") {
  auto message = [](const PlanRequest& req) {
    try {
      plan_workspace(req);
    } catch (const WorkspaceOOMError& e) {
      return std::string(e.what());
    }
    return std::string("no WorkspaceOOMError");
  };
  PlanRequest r = deepspeed_llama7b(8 * kGiB);  // 1367 tokens fit
  r.prompt_len = 1500;
  CHECK_THROWS(WorkspaceOOMError, plan_workspace(r));
  CHECK(message(r).find("1367 tokens fit, fewer than prompt_len=1500") != std::string::npos);
  r.policy = static_cast<int>(Policy::Exact);
  r.free_bytes = 2 * kGiB;
  CHECK_THROWS(WorkspaceOOMError, plan_workspace(r));
  // Exact, batch 8, max_out 2048: a token takes 10*32*128*8*2 + 64 x 8*32*128*2 + 8*32*2048*2
  // = 655360 + 4194304 + 1048576 = 5898240 B; 2 GiB - 500 MiB = 1623195648 B holds 275 tokens.
  CHECK(message(r).find("275 tokens fit, fewer than prompt_len=1500") != std::string::npos);
}

TEST_CASE("GQA: the exact policy sizes KV with num_kv_heads, deepspeed with num_heads") {
  PlanRequest r = small_exact();  // 2 KV heads of 4
  WorkspacePlan exact = plan_workspace(r);
  CHECK_EQ(exact.kv_tensor_bytes, 16 * 2 * 64 * 2);
  r.policy = static_cast<int>(Policy::DeepSpeed);
  WorkspacePlan ds = plan_workspace(r);
  CHECK_EQ(ds.kv_tensor_bytes, 16 * 4 * 64 * 2);
}

TEST_CASE("mp_size splits heads: rank plans are identical") {
  PlanRequest r = small_exact();
  r.mp_size = 2;
  r.rank = 0;
  WorkspacePlan a = plan_workspace(r);
  r.rank = 1;
  WorkspacePlan b = plan_workspace(r);
  CHECK_EQ(a.workspace_bytes, b.workspace_bytes);
  // per rank: 1 KV head, 2 query heads: K = 16*1*64*2 = 2048 B, scores 16*2*16*2 = 1024 B.
  CHECK_EQ(a.kv_tensor_bytes, 2048);
  CHECK_EQ(a.attention_scores_bytes, 1024);
  CHECK_EQ(a.workspace_bytes, 81920 + 4 * 2048 + 1024);
}

TEST_CASE("allocation_granularity: the exact policy counts the rounding and fits it in the budget") {
  // 16 tokens need 100352 bytes (above); in 2 MiB granules that is one granule.
  PlanRequest r = small_exact();
  r.allocation_granularity = 2 * kMiB;
  WorkspacePlan p = plan_workspace(r);
  CHECK_EQ(p.max_tokens, 16);
  CHECK_EQ(p.workspace_bytes, 2 * kMiB);
  CHECK_EQ(p.attention_scores_offset + p.attention_scores_bytes, 100352);  // the layout is unchanged
  CHECK_EQ(workspace_bytes_for(r, 16), 2 * kMiB);

  // max_out 1000: bytes(T) = 5120T + 4*256T + align256(8000T). Against a 3 MiB limit the
  // unrounded plan takes T = 222 (3140096 B; T = 223 needs 3154176). Rounded to 2 MiB, a plan
  // over 2 MiB would take 4 MiB, so T is the largest with bytes(T) <= 2097152: T = 148
  // (2093312 B; T = 149 needs 915456 + 1192192 = 2107648).
  r.max_out_tokens = 1000;
  r.has_reserve = true;
  r.reserve_bytes = 0;
  r.has_memory_limit = true;
  r.memory_limit_bytes = 3 * kMiB;
  r.allocation_granularity = 0;
  WorkspacePlan plain = plan_workspace(r);
  CHECK_EQ(plain.max_tokens, 222);
  CHECK_EQ(plain.workspace_bytes, 3140096);
  r.allocation_granularity = 2 * kMiB;
  WorkspacePlan rounded = plan_workspace(r);
  CHECK_EQ(rounded.max_tokens, 148);
  CHECK_EQ(rounded.workspace_bytes, 2 * kMiB);
  CHECK(rounded.bound_by == "memory");
  r.allocation_granularity = 1;  // no rounding
  CHECK_EQ(plan_workspace(r).workspace_bytes, 3140096);

  // A limit below one granule leaves no token: OOM, with the rounded bytes as the need.
  r.allocation_granularity = 2 * kMiB;
  r.memory_limit_bytes = kMiB;
  try {
    plan_workspace(r);
    CHECK(false);
  } catch (const WorkspaceOOMError& e) {
    CHECK_EQ(e.requested_bytes, 2 * kMiB);
  }
}

TEST_CASE("allocation_granularity leaves the deepspeed policy's bytes as DeepSpeed has them") {
  PlanRequest r = deepspeed_llama7b(8 * kGiB);
  WorkspacePlan plain = plan_workspace(r);
  CHECK(plain.workspace_bytes % (2 * kMiB) != 0);  // 8062894080 is not a whole number of granules
  r.allocation_granularity = 2 * kMiB;
  WorkspacePlan p = plan_workspace(r);
  CHECK_EQ(p.workspace_bytes, plain.workspace_bytes);
  CHECK_EQ(p.max_tokens, plain.max_tokens);
}

TEST_CASE("invalid requests throw ConfigError naming the argument") {
  auto arg_of = [](PlanRequest r) -> std::string {
    try {
      plan_workspace(r);
    } catch (const ConfigError& e) {
      return e.argument;
    }
    return "<no ConfigError>";
  };
  PlanRequest r;
  r = small_exact(); r.shape.num_layers = 0; CHECK(arg_of(r) == "num_layers");
  r = small_exact(); r.shape.num_heads = -1; CHECK(arg_of(r) == "num_heads");
  r = small_exact(); r.shape.hidden_dim = 250; CHECK(arg_of(r) == "hidden_dim");
  r = small_exact(); r.shape.num_kv_heads = 3; CHECK(arg_of(r) == "num_kv_heads");
  r = small_exact(); r.batch_size = 0; CHECK(arg_of(r) == "batch_size");
  r = small_exact(); r.mp_size = 4; CHECK(arg_of(r) == "mp_size");  // 2 KV heads
  r = small_exact(); r.mp_size = 3; CHECK(arg_of(r) == "mp_size");  // 4 heads
  r = small_exact(); r.mp_size = 2; r.rank = 2; CHECK(arg_of(r) == "rank");
  r = small_exact(); r.min_out_tokens = 17; CHECK(arg_of(r) == "min_out_tokens");
  r = small_exact(); r.prompt_len = 17; CHECK(arg_of(r) == "prompt_len");
  r = small_exact(); r.dtype = 7; CHECK(arg_of(r) == "dtype");
  r = small_exact(); r.policy = 5; CHECK(arg_of(r) == "policy");
  r = small_exact(); r.free_bytes = -1; CHECK(arg_of(r) == "free_bytes");
  r = small_exact(); r.free_bytes = r.total_bytes + 1; CHECK(arg_of(r) == "free_bytes");
  r = small_exact(); r.has_memory_fraction = true; r.memory_fraction = 0.0; CHECK(arg_of(r) == "memory_fraction");
  r = small_exact(); r.has_memory_fraction = true; r.memory_fraction = 1.5; CHECK(arg_of(r) == "memory_fraction");
  r = small_exact(); r.has_memory_limit = true; r.memory_limit_bytes = 0; CHECK(arg_of(r) == "memory_limit_bytes");
  r = small_exact(); r.allocation_granularity = -1; CHECK(arg_of(r) == "allocation_granularity");
  r = small_exact(); r.shape.head_dim = -1; CHECK(arg_of(r) == "head_dim");
  r = small_exact(); r.weights_bytes = -1; CHECK(arg_of(r) == "weights_bytes");
  // 64-bit overflows name the argument that overflows: 2^40 x 2^40 sequences-tokens.
  r = small_exact(); r.batch_size = int64_t{1} << 40; r.max_out_tokens = int64_t{1} << 40;
  CHECK(arg_of(r) == "batch_size");  // either alone at 1 fits; a tie names batch_size
  r = small_exact(); r.batch_size = int64_t{1} << 60;
  CHECK(arg_of(r) == "batch_size");       // 10*4*64 elements x 2^60
  r = small_exact(); r.shape.num_layers = int64_t{1} << 60;
  CHECK(arg_of(r) == "num_layers");       // 2^60 layers x 2 x 256 B
  r = small_exact(); r.shape.num_heads = int64_t{1} << 58; r.shape.num_kv_heads = 1; r.shape.head_dim = 64;
  CHECK(arg_of(r) == "num_heads");        // 10 x 2^58 x 64 elements
  r = small_exact(); r.shape.head_dim = int64_t{1} << 60;
  CHECK(arg_of(r) == "head_dim");
  r = small_exact(); r.min_out_tokens = 16;
  r.max_out_tokens = 16; r.batch_size = int64_t{1} << 50;
  CHECK(arg_of(r) == "batch_size");
}

TEST_CASE("overflow messages name the argument and its value") {
  PlanRequest r = small_exact();
  r.shape.num_layers = int64_t{1} << 60;
  try {
    plan_workspace(r);
    CHECK(false);
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    CHECK(m.find("num_layers=1152921504606846976 makes the workspace byte count overflow 64 bits") != std::string::npos);
    CHECK(m.find("reduce num_layers") != std::string::npos);
  }
}

TEST_CASE("head_dim: heads x head_dim may differ from hidden; hidden not divisible needs head_dim") {
  // Gemma-7B: hidden 3072, 16 heads of 256, 28 layers. Per token and sequence: activations
  // 10 x 16 x 256 = 40960 elements; one K: 16 x 256 = 4096 elements.
  PlanRequest r = small_exact();
  r.shape = {28, 16, 3072, 16, 256};
  r.max_out_tokens = 16;
  WorkspacePlan p = plan_workspace(r);
  CHECK_EQ(p.head_dim, 256);
  CHECK_EQ(p.head_dim_padded, 256);
  CHECK_EQ(p.activations_bytes, 40960 * 16 * 2);
  CHECK_EQ(p.kv_tensor_bytes, 4096 * 16 * 2);
  // Without head_dim 3072 / 16 = 192 is whole, and is what the deepspeed policy uses anyway.
  r.policy = static_cast<int>(Policy::DeepSpeed);
  WorkspacePlan ds = plan_workspace(r);
  CHECK_EQ(ds.head_dim, 192);
  CHECK_EQ(ds.kv_tensor_bytes, 16 * 192 * 16 * 2);
  // 4100 / 32 is not whole: refused without head_dim, accepted with it.
  PlanRequest odd = small_exact();
  odd.shape = {2, 32, 4100, 0, 0};
  CHECK_THROWS(ConfigError, plan_workspace(odd));
  odd.shape.head_dim = 128;
  CHECK_EQ(plan_workspace(odd).head_dim, 128);
}

TEST_CASE("weights: the budget is cut from free - weights, under both policies") {
  PlanRequest r = small_exact();
  r.free_bytes = 10 * kGiB;
  r.weights_bytes = 4 * kGiB;
  WorkspacePlan p = plan_workspace(r);
  CHECK_EQ(p.planned_free_bytes, 6 * kGiB);
  CHECK_EQ(p.budget_bytes, 6 * kGiB - 500 * kMiB);
  r.policy = static_cast<int>(Policy::DeepSpeed);
  // DeepSpeed's minimum: temp 4 x 16 = 64 elements + 500 MiB.
  CHECK_EQ(plan_workspace(r).budget_bytes, 6 * kGiB - 500 * kMiB - 64);
  // Weights above free memory: an OOM that says so.
  r = small_exact();
  r.free_bytes = kGiB;
  r.weights_bytes = 2 * kGiB;
  try {
    plan_workspace(r);
    CHECK(false);
  } catch (const WorkspaceOOMError& e) {
    const std::string m = e.what();
    CHECK(m.find("the weights (2.00 GiB) exceed free memory 1.00 GiB") != std::string::npos);
    CHECK_EQ(e.max_batch_size, -1);
    CHECK_EQ(e.budget_bytes, 0);
  }
}

TEST_CASE("default reserve: 100 MiB up to 1 GiB, a ramp, then 500 MiB; the budget never falls") {
  CHECK_EQ(default_reserve(0), 100 * kMiB);
  CHECK_EQ(default_reserve(kGiB), 100 * kMiB);
  CHECK_EQ(default_reserve(kGiB + 1), 100 * kMiB + 1);
  CHECK_EQ(default_reserve(kGiB + 200 * kMiB), 300 * kMiB);
  CHECK_EQ(default_reserve(kGiB + 400 * kMiB), 500 * kMiB);
  CHECK_EQ(default_reserve(80 * kGiB), 500 * kMiB);
  // Llama-2-7B shape, batch 1, fp16: 1 GiB free and 1 GiB + 1 byte give the same tokens
  // (the step of DeepSpeed's reserve gave 138 and then 78).
  PlanRequest r = small_exact();
  r.shape = {32, 32, 4096, 0, 0};
  r.max_out_tokens = 100000;
  r.free_bytes = kGiB;
  r.total_bytes = 2 * kGiB;
  const int64_t at_1g = plan_workspace(r).max_tokens;
  // 1 GiB - 100 MiB = 968884224 B at 81920 + 524288 + 32 x 100000 x 2 = 7006208 B a token: 138.
  CHECK_EQ(at_1g, 138);
  r.free_bytes = kGiB + 1;
  CHECK_EQ(plan_workspace(r).max_tokens, at_1g);
  int64_t previous = 0;
  for (int64_t free = 900 * kMiB; free <= 1600 * kMiB; free += 7 * kMiB) {
    r.free_bytes = free;
    const int64_t t = plan_workspace(r).max_tokens;
    CHECK(t >= previous);
    previous = t;
  }
}

TEST_CASE("a reserve at or above free memory is named in the OOM, with a zero budget") {
  PlanRequest r = small_exact();
  r.free_bytes = 50 * kMiB;
  try {
    plan_workspace(r);
    CHECK(false);
  } catch (const WorkspaceOOMError& e) {
    const std::string m = e.what();
    CHECK(m.find("is not more than the reserve of 100.00 MiB") != std::string::npos);
    CHECK_EQ(e.budget_bytes, 0);
  }
}

TEST_CASE("memory_fraction 1.0 of 2^63 - 1 free bytes stays 2^63 - 1 (no double-to-int64 wrap)") {
  PlanRequest r = small_exact();
  r.free_bytes = INT64_MAX;
  r.total_bytes = INT64_MAX;
  r.has_memory_fraction = true;
  r.memory_fraction = 1.0;
  WorkspacePlan p = plan_workspace(r);
  CHECK_EQ(p.budget_bytes, INT64_MAX - 500 * kMiB);
  CHECK_EQ(p.max_tokens, 16);
  r.memory_fraction = 0.9999999999999999;  // 1 - 2^-53: of 2^63 (the double nearest 2^63 - 1), 2^63 - 1024
  p = plan_workspace(r);
  CHECK(p.budget_bytes > 0);
  CHECK(p.budget_bytes <= INT64_MAX - 500 * kMiB);
  // 2^63 - 1024 is above free - reserve: the reserve still sets the budget.
  CHECK_EQ(p.budget_bytes, INT64_MAX - 500 * kMiB);
  CHECK(p.budget_limit == "reserve");
  // With no reserve the fraction is the limit: (1 - 2^-53) x 2^63 = 2^63 - 1024 exactly, no wrap.
  r.has_reserve = true;
  r.reserve_bytes = 0;
  p = plan_workspace(r);
  CHECK_EQ(p.budget_bytes, int64_t{9223372036854774784});
  CHECK(p.budget_limit == "memory_fraction");
  CHECK_EQ(p.max_tokens, 16);
}

TEST_CASE("max_batch_size and max_out_tokens_for: the largest request that holds every token") {
  // small_exact, 16 tokens per sequence: 5120 x 16 + 4 x 256 x 16 + 4 x 16 x 16 x 2 = 100352 B,
  // all 256-aligned, so b sequences need 100352b: 4 GiB / 100352 = 42799 sequences.
  PlanRequest r = small_exact();
  r.has_reserve = true;
  r.reserve_bytes = 0;
  r.has_memory_limit = true;
  r.memory_limit_bytes = 4 * kGiB;
  CHECK_EQ(max_batch_size(r), 4 * kGiB / 100352);
  r.batch_size = 42799;
  CHECK_EQ(plan_workspace(r).max_tokens, 16);
  r.batch_size = 42800;
  CHECK(plan_workspace(r).max_tokens < 16);
  // Batch 1, m tokens with max_out m: 5120m + 1024m + align256(4 x m x m x 2) <= 50000:
  // m = 8: 40960 + 8192 + 512 = 49664 fits; m = 9: 46080 + 9216 + 768 = 56064 does not.
  r = small_exact();
  r.has_reserve = true;
  r.reserve_bytes = 0;
  r.has_memory_limit = true;
  r.memory_limit_bytes = 50000;
  CHECK_EQ(max_out_tokens_for(r), 8);
  r.memory_limit_bytes = 1000;  // not even one token (6144 + 256 B)
  CHECK_EQ(max_out_tokens_for(r), 0);
  CHECK_EQ(max_batch_size(r), 0);
}

TEST_CASE("weights_bytes_for: parameters x element size / mp, rounded up") {
  CHECK_EQ(weights_bytes_for(6738415616, static_cast<int>(DType::Float16), 1), int64_t{13476831232});
  CHECK_EQ(weights_bytes_for(6738415616, static_cast<int>(DType::Float32), 1), int64_t{26953662464});
  CHECK_EQ(weights_bytes_for(7, static_cast<int>(DType::Float16), 4), 4);  // 14 / 4 rounded up
  CHECK_EQ(weights_bytes_for(0, static_cast<int>(DType::BFloat16), 8), 0);
  CHECK_THROWS(ConfigError, weights_bytes_for(-1, 1, 1));
  CHECK_THROWS(ConfigError, weights_bytes_for(INT64_MAX, 1, 1));
  CHECK_THROWS(ConfigError, weights_bytes_for(1, 1, 0));
}

TEST_CASE("check_request refuses bad arguments without looking at the memory figures") {
  PlanRequest r = small_exact();
  r.free_bytes = -5;  // not checked here
  r.total_bytes = 0;
  check_request(r);
  r.mp_size = 3;
  CHECK_THROWS(ConfigError, check_request(r));
}

TEST_CASE("human_bytes: binary units with two decimals, the sign kept") {
  CHECK(human_bytes(0) == "0 B");
  CHECK(human_bytes(1023) == "1023 B");
  CHECK(human_bytes(1024) == "1.00 KiB");
  CHECK(human_bytes(1536) == "1.50 KiB");
  CHECK(human_bytes(640 * kMiB) == "640.00 MiB");
  CHECK(human_bytes(3 * kGiB / 2) == "1.50 GiB");
  CHECK(human_bytes(int64_t{5} << 41) == "10.00 TiB");
  CHECK(human_bytes(-400 * kMiB) == "-400.00 MiB");
  CHECK(human_bytes(INT64_MIN) == "-8388608.00 TiB");
}

CHECK_MAIN()

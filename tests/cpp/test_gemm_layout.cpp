// gemm_layout and check_gemm_addresses: operands' shapes and strides to the GEMM problem, and
// the refusals, with every expected value worked out by hand. Host code: runs without a GPU.
#include <cstdio>
#include <string>
#include <vector>

#include "check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/gemm.hpp"

using namespace inferctx;

namespace {

GemmOperand array(int dtype, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  GemmOperand x;
  x.dtype = dtype;
  x.shape = std::move(shape);
  x.strides = std::move(strides);
  return x;
}

GemmOperand f32(std::vector<int64_t> shape, std::vector<int64_t> strides) { return array(0, shape, strides); }

// The ConfigError a layout throws: its argument and message ("" when it did not throw).
struct Refusal {
  std::string argument, message;
  int remedy = 0;
};

template <class F>
Refusal refusal(F f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return {e.argument, e.what(), static_cast<int>(e.remedy)};
  }
  return {};
}

bool has(const std::string& text, const char* word) { return text.find(word) != std::string::npos; }

// m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c, trans_a, trans_b
std::vector<int64_t> fields(const GemmProblem& p) {
  return {p.m, p.n, p.k, p.lda, p.ldb, p.ldc, p.batch, p.stride_a, p.stride_b, p.stride_c, p.trans_a, p.trans_b};
}

}  // namespace

TEST_CASE("contiguous operands give the packed problem") {
  // (8, 16) @ (16, 32) float16: lda = k = 16, ldb = ldc = n = 32.
  GemmLayout L = gemm_layout(2, false, false, array(1, {8, 16}, {16, 1}), array(1, {16, 32}, {32, 1}), nullptr);
  // The same problem as the cache keys it (a packed problem keeps its batch strides for batch 1).
  CHECK(fields(normalized_gemm_problem(L.problem)) == fields(normalized_gemm_problem(packed_gemm_problem(1, 8, 32, 16))));
  CHECK(fields(L.problem) == (std::vector<int64_t>{8, 32, 16, 16, 32, 32, 1, 0, 0, 256, 0, 0}));
  CHECK(L.out_shape == (std::vector<int64_t>{8, 32}));
  CHECK(!L.swap);
  // A weight (32, 16) used as w.T, a column-major (16, 32) view: the packed trans_b problem.
  L = gemm_layout(2, false, false, array(1, {8, 16}, {16, 1}), array(1, {16, 32}, {1, 16}), nullptr);
  CHECK(fields(normalized_gemm_problem(L.problem)) ==
        fields(normalized_gemm_problem(packed_gemm_problem(1, 8, 32, 16, 1, false, true))));
  // By hand: b is the stored (32, 16) weight transposed, so trans_b with ldb = 16 (its rows).
  CHECK(fields(L.problem) == (std::vector<int64_t>{8, 32, 16, 16, 16, 32, 1, 0, 0, 256, 0, 1}));
  CHECK(L.out_shape == (std::vector<int64_t>{8, 32}));
  CHECK(!L.swap);
}

TEST_CASE("transposed views, padded rows and trans flags") {
  // a (5, 3) padded to rows of 8, trans_a: op(a) is 3 x 5, so m 3, k 5, stored transposed, lda 8.
  // b (7, 5) column-major (strides (1, 7)), trans_b: op(b) = b^T is 5 x 7; the stored matrix is
  // b^T (5 x 7, ld 7) itself, so no transpose.
  GemmLayout L = gemm_layout(2, true, true, f32({5, 3}, {8, 1}), f32({7, 5}, {1, 7}), nullptr);
  CHECK(fields(L.problem) == (std::vector<int64_t>{3, 7, 5, 8, 7, 7, 1, 0, 0, 21, 1, 0}));
}

TEST_CASE("column-major out swaps the operands") {
  // (4, 6) @ (6, 5) into out (4, 5) with strides (1, 4): out^T = b^T a^T, a 5 x 4 problem.
  const GemmOperand out = f32({4, 5}, {1, 4});
  GemmLayout L = gemm_layout(2, false, false, f32({4, 6}, {6, 1}), f32({6, 5}, {5, 1}), &out);
  CHECK(L.swap);
  CHECK(fields(L.problem) == (std::vector<int64_t>{5, 4, 6, 5, 6, 4, 1, 0, 0, 0, 1, 1}));
}

TEST_CASE("bmm: broadcast b, interleaved out") {
  // a (4, 3, 6) padded to rows of 9 (batch stride 27); b (1, 5, 6) with trans_b; out (4, 3, 5)
  // as a view of (3, 4, 5): strides (5, 20, 1).
  GemmOperand out = f32({4, 3, 5}, {5, 20, 1});
  GemmLayout L = gemm_layout(3, false, true, f32({4, 3, 6}, {27, 9, 1}), f32({1, 5, 6}, {30, 6, 1}), &out);
  CHECK(fields(L.problem) == (std::vector<int64_t>{3, 5, 6, 9, 6, 20, 4, 27, 0, 5, 0, 1}));
  CHECK_EQ(L.span_b.batch, int64_t{1});  // one b for every a
  CHECK_EQ(L.span_c.batch, int64_t{4});
}

TEST_CASE("a single strided row is read as a column") {
  // (1, 5) with strides (10, 2): its elements are 2 apart, so it is the 5 x 1 transpose, ld 2.
  GemmLayout L = gemm_layout(2, false, false, f32({1, 5}, {10, 2}), f32({5, 3}, {3, 1}), nullptr);
  CHECK(fields(L.problem) == (std::vector<int64_t>{1, 3, 5, 2, 3, 3, 1, 0, 0, 3, 1, 0}));
}

TEST_CASE("refusals name the argument") {
  const GemmOperand a45 = f32({4, 5}, {5, 1}), b52 = f32({5, 2}, {2, 1});
  Refusal r = refusal([&] { gemm_layout(2, false, false, a45, f32({6, 7}, {7, 1}), nullptr); });
  CHECK(r.argument == "b" && has(r.message, "(4, 5)") && has(r.message, "(6, 7)") && has(r.message, "5 columns"));
  r = refusal([&] { gemm_layout(2, false, false, f32({4}, {1}), b52, nullptr); });
  CHECK(r.argument == "a" && has(r.message, "2-D") && has(r.message, "(4,)") && r.remedy == 0);
  r = refusal([&] { gemm_layout(2, false, false, f32({2, 4, 5}, {20, 5, 1}), b52, nullptr); });
  CHECK(r.argument == "a" && r.remedy == static_cast<int>(Remedy::BatchedGemm));
  GemmOperand f64 = array(-1, {4, 5}, {5, 1});
  f64.dtype_name = "float64";
  r = refusal([&] { gemm_layout(2, false, false, f64, b52, nullptr); });
  CHECK(r.argument == "a" && has(r.message, "float64"));
  r = refusal([&] { gemm_layout(2, false, false, a45, array(1, {5, 2}, {2, 1}), nullptr); });
  CHECK(r.argument == "b" && has(r.message, "float32") && has(r.message, "float16"));
  r = refusal([&] { gemm_layout(2, false, false, f32({4, 5}, {10, 2}), b52, nullptr); });
  CHECK(r.argument == "a" && has(r.message, "(10, 2)") && r.remedy == static_cast<int>(Remedy::MakeContiguous));
  r = refusal([&] { gemm_layout(3, false, false, f32({2, 4, 5}, {20, 5, 1}), f32({3, 5, 2}, {10, 2, 1}), nullptr); });
  CHECK(r.argument == "b" && has(r.message, "batch sizes 2 and 3"));
  GemmOperand out = f32({4, 3}, {3, 1});
  r = refusal([&] { gemm_layout(2, false, false, a45, b52, &out); });
  CHECK(r.argument == "out" && has(r.message, "(4, 3)") && has(r.message, "(4, 2)"));
  out = array(1, {4, 2}, {2, 1});
  r = refusal([&] { gemm_layout(2, false, false, a45, b52, &out); });
  CHECK(r.argument == "out" && has(r.message, "float16"));
  out = f32({3, 4, 2}, {0, 2, 1});  // one matrix written three times
  r = refusal([&] { gemm_layout(3, false, false, f32({3, 4, 5}, {20, 5, 1}), f32({3, 5, 2}, {10, 2, 1}), &out); });
  CHECK(r.argument == "out" && has(r.message, "overlap"));
}

TEST_CASE("addresses: out sharing an input, side by side, misaligned") {
  // a (4, 4) float32 at 0x1000 (64 bytes), b likewise at 0x2000.
  const GemmOperand sq = f32({4, 4}, {4, 1});
  GemmLayout L = gemm_layout(2, false, false, sq, sq, &sq);
  Refusal r = refusal([&] { check_gemm_addresses(L, 0x1000, 0x2000, 0x1000); });
  CHECK(r.argument == "out" && has(r.message, "shares memory with a"));
  r = refusal([&] { check_gemm_addresses(L, 0x1000, 0x2000, 0x2030); });  // out's first row is b's last
  CHECK(r.argument == "out" && has(r.message, "shares memory with b"));
  CHECK(refusal([&] { check_gemm_addresses(L, 0x1000, 0x2000, 0x1040); }).argument.empty());  // just past a
  // a is columns [0, 4) of a (6, 12) buffer and out columns [4, 12): rows of 12, apart.
  GemmOperand out = f32({6, 8}, {12, 1});
  L = gemm_layout(2, false, false, f32({6, 4}, {12, 1}), f32({4, 8}, {8, 1}), &out);
  CHECK(refusal([&] { check_gemm_addresses(L, 0x1000, 0x9000, 0x1000 + 16); }).argument.empty());
  r = refusal([&] { check_gemm_addresses(L, 0x1000, 0x9000, 0x1000 + 12); });  // out from column 3
  CHECK(r.argument == "out" && has(r.message, "shares memory with a"));
  r = refusal([&] { check_gemm_addresses(L, 0x1000, 0x9002, 0x20000); });
  CHECK(r.argument == "b" && has(r.message, "0x9002") && has(r.message, "4-byte"));
}

TEST_CASE("addresses: bmm's out beside or between an input's matrices") {
  // a (3, 4, 4) float32, matrices 32 elements apart (every other one of a (6, 4, 4) buffer at
  // 0x1000); out the same, in the matrices between: from element 16 (0x1040) it is apart.
  const GemmOperand spaced = f32({3, 4, 4}, {32, 4, 1}), packed = f32({3, 4, 4}, {16, 4, 1});
  GemmLayout L = gemm_layout(3, false, false, spaced, packed, &spaced);
  CHECK(refusal([&] { check_gemm_addresses(L, 0x1000, 0x9000, 0x1040); }).argument.empty());
  CHECK(refusal([&] { check_gemm_addresses(L, 0x1040, 0x9000, 0x1000); }).argument.empty());  // out first
  Refusal r = refusal([&] { check_gemm_addresses(L, 0x1000, 0x9000, 0x103c); });  // out's first is a's last
  CHECK(r.argument == "out" && has(r.message, "shares memory with a"));
  r = refusal([&] { check_gemm_addresses(L, 0x1000, 0x9000, 0x1044); });  // a's second matrix's first
  CHECK(r.argument == "out" && has(r.message, "shares memory with a"));
  // a (2, 4, 3) as columns [0, 3) of rows of 7, out (2, 4, 4) as columns [3, 7), batch stride 28.
  const GemmOperand a = f32({2, 4, 3}, {28, 7, 1}), b = f32({2, 3, 4}, {12, 4, 1}), out = f32({2, 4, 4}, {28, 7, 1});
  L = gemm_layout(3, false, false, a, b, &out);
  CHECK(refusal([&] { check_gemm_addresses(L, 0x1000, 0x9000, 0x1000 + 3 * 4); }).argument.empty());
  r = refusal([&] { check_gemm_addresses(L, 0x1000, 0x9000, 0x1000 + 2 * 4); });  // out from column 2
  CHECK(r.argument == "out" && has(r.message, "shares memory with a"));
  // A broadcast b (one matrix) beside out's rows, out's batch stride a multiple of the rows' 8.
  const GemmOperand b1 = f32({1, 3, 4}, {12, 8, 1}), out8 = f32({2, 3, 4}, {24, 8, 1});
  L = gemm_layout(3, false, false, f32({2, 3, 3}, {9, 3, 1}), b1, &out8);
  CHECK(refusal([&] { check_gemm_addresses(L, 0x1000, 0x2000, 0x2000 + 4 * 4); }).argument.empty());
  r = refusal([&] { check_gemm_addresses(L, 0x1000, 0x2000, 0x2000 + 3 * 4); });
  CHECK(r.argument == "out" && has(r.message, "shares memory with b"));
}

TEST_CASE("a negative batch stride is named as such; a batch of one ignores it") {
  Refusal r = refusal([&] { gemm_layout(3, false, false, f32({2, 4, 4}, {-16, 4, 1}), f32({2, 4, 4}, {16, 4, 1}), nullptr); });
  CHECK(r.argument == "a" && has(r.message, "batch stride -16 is negative") && has(r.message, "(-16, 4, 1)"));
  GemmLayout L = gemm_layout(3, false, false, f32({1, 4, 4}, {-16, 4, 1}), f32({1, 4, 4}, {16, 4, 1}), nullptr);
  CHECK(fields(L.problem) == (std::vector<int64_t>{4, 4, 4, 4, 4, 4, 1, 0, 0, 16, 0, 0}));
}

CHECK_MAIN()

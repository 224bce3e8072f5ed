// GEMM against a float64 host reference on fresh random inputs; the autotuner; the cache's
// export / import; argument errors. Cases named "args: ..." need no GPU and run everywhere;
// "gpu: ..." cases need a device (without one the binary runs the former and exits 77).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "check.hpp"
#include "gemm_reference.hpp"
#include "inferctx/blas.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/gemm.hpp"
#include "inferctx/memory.hpp"

using namespace inferctx;
using namespace gemm_reference;

namespace {

// A problem with every leading dimension and batch stride padded beyond what it needs.
GemmProblem padded(int dtype, int64_t m, int64_t n, int64_t k, int64_t batch, bool ta, bool tb, int64_t pad = 3) {
  GemmProblem p = packed_gemm_problem(dtype, m, n, k, batch, ta, tb, false);
  p.lda += pad;
  p.ldb += pad;
  p.ldc += pad;
  p.stride_a = (ta ? k : m) * p.lda + 5 * pad;
  p.stride_b = (tb ? n : k) * p.ldb + 5 * pad;
  p.stride_c = m * p.ldc + 5 * pad;
  return p;
}

template <typename F>
std::string config_error_argument(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    std::printf("    (ConfigError %s: %s)\n", e.argument.c_str(), e.what());
    return e.argument;
  } catch (const std::exception& e) {
    return std::string("other exception: ") + e.what();
  }
  return "no exception";
}

std::string config_error_message(const GemmProblem& p) {
  try {
    validate_gemm(p);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

// ---------------------------------------------------------------------------------------
// Argument validation (no GPU)

TEST_CASE("args: dtype, negative dimensions and batch range name the field") {
  GemmProblem p = packed_gemm_problem(F16, 4, 5, 6);
  p.dtype = 3;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "dtype");
  CHECK(contains(config_error_message(p), "got 3"));
  CHECK(contains(config_error_message(p), "bfloat16"));
  p = packed_gemm_problem(F16, 4, 5, 6);
  p.m = -1;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "m");
  CHECK(contains(config_error_message(p), "-1"));
  p = packed_gemm_problem(F16, 4, 5, 6);
  p.k = -7;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "k");
  p = packed_gemm_problem(F16, 4, 5, 6);
  p.batch = -2;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "batch");
  p = packed_gemm_problem(F16, 1, 1, 1);
  p.batch = int64_t{1} << 32;
  p.stride_a = p.stride_b = 1;
  p.stride_c = 1;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "batch");
  CHECK(config_error_argument([&] { packed_gemm_problem(F32, -1, 2, 3); }) == "m");
  CHECK(config_error_argument([&] { packed_gemm_problem(F32, 1, 2, 3, -1); }) == "batch");
}

TEST_CASE("args: leading dimensions shorter than the stored row are refused") {
  GemmProblem p = packed_gemm_problem(BF16, 8, 16, 32);  // A 8 x 32, B 32 x 16, C 8 x 16
  p.lda = 31;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "lda");
  const std::string msg = config_error_message(p);
  CHECK(contains(msg, "got 31"));
  CHECK(contains(msg, ">= 32"));
  p = packed_gemm_problem(BF16, 8, 16, 32, 1, /*trans_a=*/true);  // A stored 32 x 8
  CHECK_EQ(p.lda, int64_t{8});
  p.lda = 7;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "lda");
  CHECK(contains(config_error_message(p), "trans_a=true"));
  p = packed_gemm_problem(BF16, 8, 16, 32, 1, false, /*trans_b=*/true);  // B stored 16 x 32
  CHECK_EQ(p.ldb, int64_t{32});
  p.ldb = 16;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "ldb");
  p = packed_gemm_problem(BF16, 8, 16, 32);
  p.ldc = 15;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "ldc");
  // Empty matrices still need ld >= 1.
  p = packed_gemm_problem(F32, 0, 0, 0);
  CHECK_EQ(p.lda, int64_t{1});
  p.ldc = 0;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "ldc");
}

TEST_CASE("args: batch strides: negative refused, overlapping C refused, broadcast inputs and interleaved C accepted") {
  GemmProblem p = packed_gemm_problem(F16, 4, 5, 6, 3);
  p.stride_a = -1;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "stride_a");
  p = packed_gemm_problem(F16, 4, 5, 6, 3);
  p.stride_c = 19;  // one matrix spans 20 elements
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "stride_c");
  CHECK(contains(config_error_message(p), ">= 20"));
  p.stride_c = 0;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "stride_c");
  p = packed_gemm_problem(F16, 4, 5, 6, 3);
  p.stride_a = 0;  // one A for every matrix of the batch
  p.stride_b = 0;
  validate_gemm(p);
  // C as a (batch, m, n) view of an (m, batch, n) array: rows interleave, elements do not.
  p.ldc = 3 * 5;
  p.stride_c = 5;
  validate_gemm(p);
  // Batch strides do not matter for a single matrix.
  p = packed_gemm_problem(F16, 4, 5, 6, 1);
  p.stride_a = p.stride_b = p.stride_c = -5;
  validate_gemm(p);
}

TEST_CASE("args: spans beyond 2^63 bytes are refused") {
  GemmProblem p = packed_gemm_problem(F32, 2, 2, 2, 2);
  p.stride_a = std::numeric_limits<int64_t>::max() / 2;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "stride_a");
  p = packed_gemm_problem(F32, 3, 2, 2);
  p.ldc = std::numeric_limits<int64_t>::max() / 4;
  CHECK(config_error_argument([&] { validate_gemm(p); }) == "ldc");
}

TEST_CASE("args: malformed cache entries are refused before anything is imported") {
  clear_gemm_cache();
  GemmCacheEntry e;
  e.device = 0;
  e.problem = packed_gemm_problem(BF16, 16, 16, 16);
  e.backend = 0;
  e.algo = {1, 2, 3};
  CHECK(config_error_argument([&] { import_gemm_cache({e}); }) == "algo");
  e.algo.assign(8, 0);
  e.align_b = 3;
  CHECK(config_error_argument([&] { import_gemm_cache({e}); }) == "align_b");
  e.align_b = 512;
  CHECK(config_error_argument([&] { import_gemm_cache({e}); }) == "align_b");
  e.align_b = 256;
  e.backend = 5;
  CHECK(config_error_argument([&] { import_gemm_cache({e}); }) == "backend");
  e.backend = 0;
  e.device = -1;
  CHECK(config_error_argument([&] { import_gemm_cache({e}); }) == "device");
  e.device = 0;
  e.problem.lda = 1;
  CHECK(config_error_argument([&] { import_gemm_cache({e}); }) == "lda");
  e.problem = packed_gemm_problem(BF16, 0, 16, 16);
  CHECK(config_error_argument([&] { import_gemm_cache({e}); }) == "problem");
  // The error says which entry: here the second, after a valid one (which is not imported either).
  GemmCacheEntry valid = e;
  valid.problem = packed_gemm_problem(BF16, 16, 16, 16);
  GemmCacheEntry bad = valid;
  bad.align_c = 100;
  std::string message;
  try {
    import_gemm_cache({valid, bad});
  } catch (const ConfigError& err) {
    CHECK(err.argument == "align_c");
    message = err.what();
  }
  std::printf("    (%s)\n", message.c_str());
  CHECK(contains(message, "entry 1: align_c: got 100"));
  CHECK_EQ(gemm_cache_size(), int64_t{0});
}

// ---------------------------------------------------------------------------------------
// Correctness (GPU)

TEST_CASE("gpu: every transpose combination in every dtype, padded leading dimensions") {
  for (int dtype : {F32, F16, BF16}) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        expect_correct(*gpu().handle, gpu().stream, padded(dtype, 37, 53, 71, 1, ta, tb));
        expect_correct(*gpu().handle, gpu().stream, packed_gemm_problem(dtype, 64, 48, 96, 1, ta, tb));
      }
    }
  }
}

TEST_CASE("gpu: odd sizes 1, 7 and 4097") {
  const int64_t shapes[][3] = {{1, 1, 1}, {1, 7, 4097}, {7, 1, 33}, {4097, 7, 9}, {7, 4097, 1}, {1, 4097, 7}};
  for (int dtype : {F32, F16, BF16}) {
    for (const auto& s : shapes) {
      expect_correct(*gpu().handle, gpu().stream, packed_gemm_problem(dtype, s[0], s[1], s[2]));
      expect_correct(*gpu().handle, gpu().stream, packed_gemm_problem(dtype, s[0], s[1], s[2], 1, true, true));
    }
  }
}

TEST_CASE("gpu: strided batches, every transpose, padded strides, broadcast inputs, interleaved C") {
  for (int dtype : {F32, F16, BF16}) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        expect_correct(*gpu().handle, gpu().stream, padded(dtype, 19, 23, 29, 5, ta, tb));
      }
    }
    GemmProblem p = packed_gemm_problem(dtype, 16, 24, 40, 6);
    p.stride_a = 0;  // one A against six B
    expect_correct(*gpu().handle, gpu().stream, p);
    p = packed_gemm_problem(dtype, 16, 24, 40, 6, false, true);
    p.stride_b = 0;  // six A against one B
    expect_correct(*gpu().handle, gpu().stream, p);
    p = packed_gemm_problem(dtype, 16, 24, 40, 4);
    p.ldc = 4 * 24;  // C is a (batch, m, n) view of an (m, batch, n) array
    p.stride_c = 24;
    expect_correct(*gpu().handle, gpu().stream, p);
  }
}

TEST_CASE("gpu: alpha and beta, accumulation into C") {
  for (int dtype : {F32, F16, BF16}) {
    expect_correct(*gpu().handle, gpu().stream, padded(dtype, 33, 17, 65, 1, false, true), 0.75f, -1.25f);
    expect_correct(*gpu().handle, gpu().stream, packed_gemm_problem(dtype, 32, 32, 32), 1.0f, 1.0f);
    expect_correct(*gpu().handle, gpu().stream, padded(dtype, 9, 11, 13, 3, true, false), -2.0f, 0.5f);
    expect_correct(*gpu().handle, gpu().stream, packed_gemm_problem(dtype, 8, 8, 8), 0.0f, 0.5f);
  }
}

TEST_CASE("gpu: k = 0 gives beta * C (zeros for beta = 0); m, n or batch = 0 touch nothing") {
  for (int dtype : {F32, F16, BF16}) {
    expect_correct(*gpu().handle, gpu().stream, padded(dtype, 5, 7, 0, 1, false, false), 1.0f, 0.0f);
    expect_correct(*gpu().handle, gpu().stream, padded(dtype, 5, 7, 0, 3, false, false), 1.0f, 2.0f);
  }
  // Nothing is read or written: null operands are fine, and C keeps its bytes.
  HostMatrix sentinel(BF16, 64);
  for (int64_t i = 0; i < 64; ++i) sentinel.set(i, 3.5f);
  DeviceMatrix dc(sentinel);
  gemm(*gpu().handle, gpu().stream, packed_gemm_problem(BF16, 0, 8, 8), nullptr, nullptr, dc.data());
  gemm(*gpu().handle, gpu().stream, packed_gemm_problem(BF16, 8, 0, 8), nullptr, nullptr, dc.data());
  gemm(*gpu().handle, gpu().stream, packed_gemm_problem(BF16, 8, 8, 8, 0), nullptr, nullptr, dc.data());
  INFERCTX_CUDA(cudaStreamSynchronize(gpu().stream), 0);
  HostMatrix after(BF16, 64);
  dc.download(after);
  bool same = true;
  for (int64_t i = 0; i < 64; ++i) same = same && sentinel.same_bits(after, i);
  CHECK(same);
}

TEST_CASE("gpu: fp32 without TF32 is fp32-accurate; with TF32 within 1e-3") {
  GemmProblem p = packed_gemm_problem(F32, 64, 64, 4096);
  const Outcome exact = run_and_check(*gpu().handle, gpu().stream, p, 1.0f, 0.0f);
  p.tf32 = true;
  const Outcome fast = run_and_check(*gpu().handle, gpu().stream, p, 1.0f, 0.0f);
  std::printf("  fp32 relative error %.2e without TF32, %.2e with\n", exact.error, fast.error);
  CHECK(exact.error < 1e-5);
  CHECK(fast.error < 1e-3);
  // The handle's own TF32 math mode must not leak into a call that did not ask for it.
  gpu().handle->set_tf32(true);
  p.tf32 = false;
  const Outcome strict = run_and_check(*gpu().handle, gpu().stream, p, 1.0f, 0.0f);
  gpu().handle->set_tf32(false);
  CHECK(strict.error < 1e-5);
}

TEST_CASE("gpu: null operands and the null stream are refused") {
  HostMatrix h(F16, 64);
  for (int64_t i = 0; i < 64; ++i) h.set(i, 1.0f);
  DeviceMatrix d(h);
  const GemmProblem p = packed_gemm_problem(F16, 4, 4, 4);
  CHECK(config_error_argument([&] { gemm(*gpu().handle, gpu().stream, p, nullptr, d.data(), d.data()); }) == "a");
  CHECK(config_error_argument([&] { gemm(*gpu().handle, gpu().stream, p, d.data(), nullptr, d.data()); }) == "b");
  CHECK(config_error_argument([&] { gemm(*gpu().handle, gpu().stream, p, d.data(), d.data(), nullptr); }) == "c");
  // The null handle is the legacy default stream: refused unless asked for as cudaStreamLegacy.
  CHECK(config_error_argument([&] { gemm(*gpu().handle, nullptr, p, d.data(), d.data(), d.data()); }) ==
        "stream");
  CHECK(config_error_argument([&] { tune_gemm(*gpu().handle, nullptr, p); }) == "stream");
  GemmProblem bad = p;
  bad.ldc = 3;
  CHECK(config_error_argument([&] { gemm(*gpu().handle, gpu().stream, bad, d.data(), d.data(), d.data()); }) ==
        "ldc");
}

TEST_CASE("gpu: a gemm can be captured in a CUDA graph and replayed") {
  const GemmProblem p = packed_gemm_problem(BF16, 32, 64, 128);
  const Layout la = layout_a(p), lb = layout_b(p), lc = layout_c(p);
  HostMatrix a(BF16, la.span()), b(BF16, lb.span()), c(BF16, lc.span());
  for (int64_t i = 0; i < a.count(); ++i) a.set(i, uniform(-1.0f, 1.0f));
  for (int64_t i = 0; i < b.count(); ++i) b.set(i, uniform(-1.0f, 1.0f));
  for (int64_t i = 0; i < c.count(); ++i) c.set_bits(i, 0xFF);
  DeviceMatrix da(a), db(b), dc(c);
  cudaStream_t s = gpu().stream;
  // The first call outside capture looks the plan up; the captured one then does no host work
  // that capture forbids.
  gemm(*gpu().handle, s, p, da.data(), db.data(), dc.data());
  INFERCTX_CUDA(cudaStreamSynchronize(s), 0);
  dc.upload(c);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  INFERCTX_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), 0);
  gemm(*gpu().handle, s, p, da.data(), db.data(), dc.data());
  INFERCTX_CUDA(cudaStreamEndCapture(s, &graph), 0);
  INFERCTX_CUDA(cudaGraphInstantiate(&exec, graph, 0), 0);
  INFERCTX_CUDA(cudaGraphLaunch(exec, s), 0);
  INFERCTX_CUDA(cudaStreamSynchronize(s), 0);
  HostMatrix out(BF16, lc.span());
  dc.download(out);
  double diff2 = 0.0, ref2 = 0.0;
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      double sum = 0.0;
      for (int64_t l = 0; l < p.k; ++l) sum += double(a.get(la.index(0, i, l))) * b.get(lb.index(0, l, j));
      const double got = out.get(lc.index(0, i, j));
      diff2 += (got - sum) * (got - sum);
      ref2 += sum * sum;
    }
  }
  const double error = std::sqrt(diff2 / ref2);
  CHECK(error < 1e-2);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// ---------------------------------------------------------------------------------------
// Autotuning and the cache (GPU)

namespace {

GemmTuneOptions quick_options() {
  GemmTuneOptions o;
  o.max_algorithms = 12;
  o.warmup = 2;
  o.repeats = 3;
  o.min_batch_ms = 0.05;
  return o;
}

bool same_problem(const GemmProblem& x, const GemmProblem& y) {
  return x.dtype == y.dtype && x.trans_a == y.trans_a && x.trans_b == y.trans_b && x.m == y.m && x.n == y.n &&
         x.k == y.k && x.batch == y.batch && x.lda == y.lda && x.ldb == y.ldb && x.ldc == y.ldc &&
         x.stride_a == y.stride_a && x.stride_b == y.stride_b && x.stride_c == y.stride_c && x.tf32 == y.tf32;
}

// The problem as the cache keys it: batch strides dropped for one matrix, TF32 for fp32 only.
GemmProblem as_cached(GemmProblem p) {
  if (p.batch <= 1) p.stride_a = p.stride_b = p.stride_c = 0;
  if (p.dtype != F32) p.tf32 = false;
  return p;
}

// The 8 words of the first algorithm cuBLASLt's heuristic offers for an unbatched fp32 problem
// without TF32, within the handle's workspace, as a cache entry holds them; empty when it offers
// none. Described the way gemm describes the problem to cuBLASLt: row-major C = op(A) op(B) is
// column-major C^T = op(B)^T op(A)^T, so cuBLASLt's A is our B.
std::vector<uint64_t> lt_first_algo(const CublasHandle& handle, const GemmProblem& p) {
  const int device = handle.device();
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t lt_a = nullptr, lt_b = nullptr, lt_c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  INFERCTX_CUBLAS(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), device);
  const int32_t op_lt_a = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t op_lt_b = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  INFERCTX_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &op_lt_a, sizeof op_lt_a), device);
  INFERCTX_CUBLAS(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &op_lt_b, sizeof op_lt_b), device);
  // A stored row-major r x c matrix is column-major c x r with the same leading dimension.
  const int64_t b_rows = p.trans_b ? p.n : p.k, b_cols = p.trans_b ? p.k : p.n;
  const int64_t a_rows = p.trans_a ? p.k : p.m, a_cols = p.trans_a ? p.m : p.k;
  INFERCTX_CUBLAS(cublasLtMatrixLayoutCreate(&lt_a, CUDA_R_32F, b_cols, b_rows, p.ldb), device);
  INFERCTX_CUBLAS(cublasLtMatrixLayoutCreate(&lt_b, CUDA_R_32F, a_cols, a_rows, p.lda), device);
  INFERCTX_CUBLAS(cublasLtMatrixLayoutCreate(&lt_c, CUDA_R_32F, p.n, p.m, p.ldc), device);
  INFERCTX_CUBLAS(cublasLtMatmulPreferenceCreate(&pref), device);
  const uint64_t workspace = static_cast<uint64_t>(handle.workspace_bytes());
  INFERCTX_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                       sizeof workspace),
                  device);
  cublasLtMatmulHeuristicResult_t result;
  std::memset(&result, 0, sizeof result);
  int returned = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle.lt(), op, lt_a, lt_b, lt_c, lt_c, pref, 1, &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(lt_c);
  cublasLtMatrixLayoutDestroy(lt_b);
  cublasLtMatrixLayoutDestroy(lt_a);
  cublasLtMatmulDescDestroy(op);
  if (status != CUBLAS_STATUS_SUCCESS || returned < 1 || result.state != CUBLAS_STATUS_SUCCESS) return {};
  std::vector<uint64_t> words(8);
  static_assert(sizeof result.algo == 8 * sizeof(uint64_t), "cublasLtMatmulAlgo_t is 8 words");
  std::memcpy(words.data(), &result.algo, sizeof result.algo);
  return words;
}

}  // namespace

TEST_CASE("gpu: autotuned results equal untuned ones and the float64 reference") {
  const GemmProblem problems[] = {
      packed_gemm_problem(BF16, 128, 256, 512),
      packed_gemm_problem(F16, 1, 1024, 1024),
      packed_gemm_problem(F16, 4, 64, 32, 8, false, true),  // attention-like Q K^T
      packed_gemm_problem(F32, 96, 80, 200),
      packed_gemm_problem(F32, 96, 80, 200, 1, true, false, /*tf32=*/true),
  };
  for (const GemmProblem& p : problems) {
    clear_gemm_cache();
    FixedOperands ops(p);
    const HostMatrix untuned = ops.run(*gpu().handle, gpu().stream);
    const GemmTuneResult r = tune_gemm(*gpu().handle, gpu().stream, p, quick_options());
    std::printf("  %s: %d candidates, %d valid, default %.4f ms, best %.4f ms (%s, index %d, algo id %d), %d sets\n",
                describe(p, 1, 0).c_str(), r.candidates, r.valid, r.default_ms, r.best_ms,
                r.backend == 0 ? "cublasLt" : r.backend == 1 ? "cublas" : "gemv", r.algo_index, r.algo_id,
                r.rotated_sets);
    CHECK(r.candidates >= 1);
    CHECK(r.valid >= 1);
    CHECK(r.best_ms > 0.0);
    CHECK(r.default_ms <= 0.0 || r.best_ms <= r.default_ms);
    // cuBLASLt only when clearly faster than cublasGemmEx.
    CHECK(r.algo_index == 0 || r.best_ms <= r.default_ms * (1.0 - kTuneMinGain));
    CHECK(r.default_ms > 0.0);  // cublasGemmEx, the untuned default, runs for every problem
    CHECK((r.algo_index == 0) == (r.backend == 1));  // candidate 0 is cublasGemmEx
    CHECK(r.backend == 0 ? r.algo.size() == 8 : r.algo.empty());  // cuBLASLt's words, or none
    // inferctx's kernel is the last candidate, for the one-row problem only.
    CHECK(r.backend != 2 || (p.m == 1 && r.algo_index == r.candidates - 1));
    const auto entries = export_gemm_cache();
    CHECK_EQ(entries.size(), size_t{1});
    if (entries.size() == 1) {
      CHECK(same_problem(entries[0].problem, as_cached(p)));
      CHECK_EQ(entries[0].backend, r.backend);
      CHECK_EQ(entries[0].align_a, 256);
      CHECK(entries[0].time_ms > 0.0);
    }
    const HostMatrix tuned = ops.run(*gpu().handle, gpu().stream);
    const double diff = ops.relative_difference(tuned, untuned);
    if (!(diff < tolerance(p))) std::printf("  tuned vs untuned differ by %.3e\n", diff);
    CHECK(diff < tolerance(p));
    expect_correct(*gpu().handle, gpu().stream, p);  // fresh operands through the tuned entry
  }
  clear_gemm_cache();
}

TEST_CASE("gpu: inferctx's few-row kernel through an imported entry, and where it cannot run") {
  struct Case {
    GemmProblem p;
    float alpha, beta;
    bool eligible;
  };
  std::vector<Case> cases;
  for (int dt : {F32, F16, BF16}) {
    for (int64_t m : {1, 3, 8}) {
      // n = 264: one or two whole column tiles and a part; k = 300: a whole k chunk and a part.
      cases.push_back({packed_gemm_problem(dt, m, 264, 300), 1.0f, 0.0f, true});
      cases.push_back({packed_gemm_problem(dt, m, 512, 1024, 1, true, false), 0.5f, 0.25f, true});
    }
    GemmProblem pad = packed_gemm_problem(dt, 5, 136, 520);  // padded rows; B's stay 16-byte aligned
    pad.lda += 3;
    pad.ldb += 8;
    pad.ldc += 5;
    cases.push_back({pad, -1.5f, 0.75f, true});
    cases.push_back({packed_gemm_problem(dt, 9, 264, 300), 1.0f, 0.0f, false});                // 9 rows
    cases.push_back({packed_gemm_problem(dt, 4, 264, 300, 1, false, true), 1.0f, 0.0f, false});  // b^T
    cases.push_back({packed_gemm_problem(dt, 4, 262, 300), 1.0f, 0.0f, false});  // n not 16-byte rows
    cases.push_back({packed_gemm_problem(dt, 2, 264, 300, 3), 1.0f, 0.0f, false});             // a batch
  }
  for (const Case& c : cases) {
    clear_gemm_cache();
    expect_correct(*gpu().handle, gpu().stream, c.p, c.alpha, c.beta);  // untuned: the cache's entry
    const auto heuristic = export_gemm_cache(false);
    CHECK_EQ(heuristic.size(), size_t{1});
    if (heuristic.size() != 1) continue;
    GemmCacheEntry forced = heuristic[0];
    forced.backend = static_cast<int>(GemmBackend::Gemv);
    forced.algo.clear();
    CHECK_EQ(import_gemm_cache({forced}), int64_t{1});
    // Through the imported entry: the kernel where it takes the problem, cublasGemmEx elsewhere;
    // C's padding survives and beta = 0 ignores the NaN C starts with (expect_correct).
    expect_correct(*gpu().handle, gpu().stream, c.p, c.alpha, c.beta);
    const auto after = export_gemm_cache(true);
    if (after.size() != (c.eligible ? 1u : 0u)) std::printf("  %s: entry kept %zu\n", describe(c.p, 1, 0).c_str(), after.size());
    CHECK_EQ(after.size(), c.eligible ? size_t{1} : size_t{0});
    if (after.size() == 1) CHECK_EQ(after[0].backend, static_cast<int>(GemmBackend::Gemv));
    if (c.eligible && c.beta == 0.0f) {
      // The chunks' sums are added in a fixed order: the same bits on every run.
      FixedOperands ops(c.p);
      const HostMatrix first = ops.run(*gpu().handle, gpu().stream);
      const HostMatrix second = ops.run(*gpu().handle, gpu().stream);
      CHECK(first.bytes == second.bytes);
    }
  }
  clear_gemm_cache();
}

TEST_CASE("gpu: export / import round trip, stale and foreign entries") {
  clear_gemm_cache();
  const GemmProblem p32 = packed_gemm_problem(F32, 64, 128, 256);
  const GemmProblem p16 = packed_gemm_problem(BF16, 64, 128, 256, 2, true, false);
  tune_gemm(*gpu().handle, gpu().stream, p32, quick_options());
  tune_gemm(*gpu().handle, gpu().stream, p16, quick_options());
  const auto exported = export_gemm_cache();
  CHECK_EQ(exported.size(), size_t{2});
  CHECK(export_gemm_cache(false).size() >= exported.size());
  clear_gemm_cache();
  CHECK_EQ(gemm_cache_size(), int64_t{0});
  CHECK_EQ(import_gemm_cache(exported), int64_t{2});
  auto again = export_gemm_cache();
  CHECK_EQ(again.size(), exported.size());
  for (const auto& e : exported) {
    bool found = false;
    for (const auto& f : again) {
      if (same_problem(e.problem, f.problem) && e.device == f.device && e.device_name == f.device_name &&
          e.cublas_version == f.cublas_version && e.align_a == f.align_a && e.align_b == f.align_b &&
          e.align_c == f.align_c && e.backend == f.backend && e.algo == f.algo && e.time_ms == f.time_ms) {
        found = true;
      }
    }
    CHECK(found);
  }
  // Imported entries are checked on first use and give correct results.
  expect_correct(*gpu().handle, gpu().stream, p32);
  expect_correct(*gpu().handle, gpu().stream, p16);

  // An algorithm made for another problem (fp32) offered for bf16: rejected by the check on
  // first use, and the heuristic's choice computes the right answer. The tuner may keep
  // cublasGemmEx for p32 (no cuBLASLt entry then): the fp32 entry then gets cuBLASLt's own first
  // algorithm for p32, so that the check always runs.
  std::vector<GemmCacheEntry> offered = exported;
  bool lt_f32 = false;
  for (const auto& e : exported) lt_f32 = lt_f32 || (e.problem.dtype == F32 && e.backend == 0);
  if (!lt_f32) {
    for (auto& e : offered) {
      if (e.problem.dtype != F32) continue;
      std::vector<uint64_t> algo = lt_first_algo(*gpu().handle, e.problem);
      CHECK_EQ(algo.size(), size_t{8});
      if (algo.size() != 8) continue;
      e.backend = static_cast<int>(GemmBackend::CublasLt);
      e.algo = std::move(algo);
    }
  }
  int offered_as_bf16 = 0;
  for (const auto& e : offered) {
    if (e.problem.dtype != F32 || e.backend != 0) continue;
    GemmCacheEntry wrong = e;
    wrong.problem.dtype = BF16;
    clear_gemm_cache();
    CHECK_EQ(import_gemm_cache({wrong}), int64_t{1});
    expect_correct(*gpu().handle, gpu().stream, wrong.problem);
    ++offered_as_bf16;
  }
  CHECK(offered_as_bf16 >= 1);

  // Entries from another GPU, another cuBLAS or a device this machine lacks are skipped.
  clear_gemm_cache();
  GemmCacheEntry foreign = exported[0];
  foreign.device_name = "Some Other GPU";
  CHECK_EQ(import_gemm_cache({foreign}), int64_t{0});
  foreign = exported[0];
  foreign.cublas_version += 1;
  CHECK_EQ(import_gemm_cache({foreign}), int64_t{0});
  foreign = exported[0];
  foreign.device = 4096;
  CHECK_EQ(import_gemm_cache({foreign}), int64_t{0});
  CHECK_EQ(gemm_cache_size(), int64_t{0});
  clear_gemm_cache();
}

TEST_CASE("gpu: untuned choices are bounded in number, tuned ones stay") {
  // Every call signature seen leaves a choice; 4,146 signatures (m = 1..4146) must leave at
  // most 4,096 untuned ones (kHeuristicEntryLimit), and the tuned entry made first survives.
  clear_gemm_cache();
  const GemmProblem tuned = packed_gemm_problem(F32, 64, 128, 256);
  tune_gemm(*gpu().handle, gpu().stream, tuned, quick_options());
  CHECK_EQ(export_gemm_cache().size(), size_t{1});
  const int64_t before = gemm_cache_size();  // the tuned entry (and any untuned ones the tuning left)
  const int64_t rows = 4146;
  DeviceAllocation a(0, rows * 8 * 4), b(0, 8 * 8 * 4), c(0, rows * 8 * 4);
  INFERCTX_CUDA(cudaMemset(a.data(), 0, static_cast<size_t>(a.size())), 0);
  INFERCTX_CUDA(cudaMemset(b.data(), 0, static_cast<size_t>(b.size())), 0);
  INFERCTX_CUDA(cudaDeviceSynchronize(), 0);
  int64_t most = 0;
  for (int64_t m = 1; m <= rows; ++m) {
    gemm(*gpu().handle, gpu().stream, packed_gemm_problem(F32, m, 8, 8), a.data(), b.data(), c.data(), 1.0f, 0.0f);
    most = std::max(most, gemm_cache_size());
  }
  INFERCTX_CUDA(cudaStreamSynchronize(gpu().stream), 0);
  std::printf("    (most entries at once: %lld, at the end: %lld)\n", static_cast<long long>(most),
              static_cast<long long>(gemm_cache_size()));
  CHECK(most <= 4096 + 1);
  // Each m is a signature of its own: the untuned entries grow one a call up to the limit, the
  // tuned one beside them (4096 + 1); the call past the limit drops every untuned one and adds
  // its own, so after 4146 calls the entries of the last 4146 - 4096 remain, with what was there
  // before (the tuned entry, and any untuned ones, which were the first to count).
  CHECK_EQ(most, int64_t{4096} + 1);
  CHECK_EQ(gemm_cache_size(), before + (rows - 4096));
  const auto kept = export_gemm_cache();
  CHECK_EQ(kept.size(), size_t{1});
  if (!kept.empty()) CHECK(same_problem(kept[0].problem, normalized_gemm_problem(tuned)));
  clear_gemm_cache();
}

TEST_CASE("gpu: tuning arguments are checked") {
  GemmTuneOptions o = quick_options();
  o.max_algorithms = 0;
  CHECK(config_error_argument([&] {
          tune_gemm(*gpu().handle, gpu().stream, packed_gemm_problem(F16, 8, 8, 8), o);
        }) == "max_algorithms");
  o = quick_options();
  o.repeats = 0;
  CHECK(config_error_argument([&] {
          tune_gemm(*gpu().handle, gpu().stream, packed_gemm_problem(F16, 8, 8, 8), o);
        }) == "repeats");
  CHECK(config_error_argument([&] {
          tune_gemm(*gpu().handle, gpu().stream, packed_gemm_problem(F16, 0, 8, 8), quick_options());
        }) == "m");
}

int main() {
  check::run_seed();
  return check::run_all_or_cpu_cases("args:");
}

// The GEMM problem: its types, stored shapes and alignment, validation, the normalized form
// that is cached and run, and the packed problem made from shapes alone.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "inferctx/errors.hpp"
#include "inferctx/gemm.hpp"
#include "array_checks.hpp"
#include "gemm_detail.hpp"

namespace inferctx {

namespace detail {

cudaDataType_t data_type(int dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::Float32: return CUDA_R_32F;
    case DType::Float16: return CUDA_R_16F;
    default: return CUDA_R_16BF;
  }
}

bool uses_tf32(const GemmProblem& p) { return p.tf32 && p.dtype == static_cast<int>(DType::Float32); }

cublasComputeType_t compute_type(const GemmProblem& p) {
  return uses_tf32(p) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

[[noreturn]] void reject(const char* field, const std::string& message) {
  throw ConfigError(field, std::string(field) + ": " + message);
}

std::string str(int64_t v) { return std::to_string(v); }

int64_t span_elements(const char* ld_field, const char* stride_field, Stored s, int64_t ld, int64_t batch,
                      int64_t stride, int64_t esize) {
  if (s.rows == 0 || s.cols == 0 || batch == 0) return 0;
  int64_t rows_part = 0, batch_part = 0, total = 0, bytes = 0;
  if (__builtin_mul_overflow(s.rows - 1, ld, &rows_part) || __builtin_add_overflow(rows_part, s.cols, &total) ||
      __builtin_mul_overflow(total, esize, &bytes)) {
    reject(ld_field, "got " + str(ld) + " for " + str(s.rows) + " rows: one matrix would span more than 2^63 bytes");
  }
  if (__builtin_mul_overflow(batch - 1, stride, &batch_part) || __builtin_add_overflow(total, batch_part, &total) ||
      __builtin_mul_overflow(total, esize, &bytes)) {
    reject(stride_field, "got " + str(stride) + " for a batch of " + str(batch) +
                             ": the batch would span more than 2^63 bytes");
  }
  return total;
}

bool matrices_distinct(int64_t batch, int64_t rows, int64_t cols, int64_t ld, int64_t stride) {
  if (batch <= 1) return true;
  const int64_t sizes[3] = {batch, rows, cols};
  const int64_t strides[3] = {stride, ld, 1};
  return elements_distinct(sizes, strides, 3);
}

GemmProblem normalized(const GemmProblem& p) {
  GemmProblem q = p;
  if (q.dtype != static_cast<int>(DType::Float32)) q.tf32 = false;
  if (q.batch <= 1) q.stride_a = q.stride_b = q.stride_c = 0;
  return q;
}

int alignment_of(const void* ptr, int64_t batch, int64_t stride, int64_t esize) {
  uint64_t bits = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr)) | kMaxAlignment;
  if (batch > 1) bits |= static_cast<uint64_t>(stride) * static_cast<uint64_t>(esize);
  return static_cast<int>(bits & (~bits + 1));
}

}  // namespace detail

using namespace detail;

namespace {

void check_dimension(const char* field, int64_t value) {
  if (value < 0) reject(field, "got " + str(value) + "; a dimension must be >= 0");
}

void check_leading_dimension(const char* field, int64_t ld, const char* operand, Stored s, const char* dims,
                             const char* trans, bool transposed) {
  const int64_t need = std::max<int64_t>(1, s.cols);
  if (ld < need) {
    const std::string how = trans == nullptr ? std::string(dims)
                                             : std::string(dims) + ", " + trans + "=" + (transposed ? "true" : "false");
    reject(field, "got " + str(ld) + "; " + operand + " is stored as " + str(s.rows) + " x " + str(s.cols) +
                      " rows (" + how + "), so " + field + " must be >= " + str(need));
  }
}

void check_c_does_not_overlap(const GemmProblem& p) {
  if (matrices_distinct(p.batch, p.m, p.n, p.ldc, p.stride_c)) return;
  const int64_t each = (p.m - 1) * p.ldc + p.n;
  reject("stride_c", "got " + str(p.stride_c) + " with batch " + str(p.batch) + ", m " + str(p.m) + ", n " +
                         str(p.n) + ", ldc " + str(p.ldc) + ": the matrices of C would overlap; use stride_c >= " +
                         str(each) + " (the elements one matrix spans)");
}

}  // namespace

GemmProblem packed_gemm_problem(int dtype, int64_t m, int64_t n, int64_t k, int64_t batch, bool trans_a,
                                bool trans_b, bool tf32) {
  GemmProblem p;
  p.dtype = dtype;
  p.trans_a = trans_a;
  p.trans_b = trans_b;
  p.m = m;
  p.n = n;
  p.k = k;
  p.batch = batch;
  p.tf32 = tf32;
  check_dimension("m", m);
  check_dimension("n", n);
  check_dimension("k", k);
  check_dimension("batch", batch);
  p.lda = std::max<int64_t>(1, trans_a ? m : k);
  p.ldb = std::max<int64_t>(1, trans_b ? k : n);
  p.ldc = std::max<int64_t>(1, n);
  if (__builtin_mul_overflow(m, k, &p.stride_a) || __builtin_mul_overflow(k, n, &p.stride_b) ||
      __builtin_mul_overflow(m, n, &p.stride_c)) {
    reject("m", "the matrices of " + str(m) + " x " + str(n) + " x " + str(k) + " have more than 2^63 elements");
  }
  validate_gemm(p);
  return p;
}

void validate_gemm(const GemmProblem& p) {
  if (p.dtype < 0 || p.dtype > 2) {
    reject("dtype", "got " + str(p.dtype) + "; valid: 0 (float32), 1 (float16), 2 (bfloat16)");
  }
  check_dimension("m", p.m);
  check_dimension("n", p.n);
  check_dimension("k", p.k);
  check_dimension("batch", p.batch);
  if (p.batch > INT32_MAX) {
    reject("batch", "got " + str(p.batch) + "; at most 2147483647 matrices per call");
  }
  check_leading_dimension("lda", p.lda, "A", stored_a(p), p.trans_a ? "k x m" : "m x k", "trans_a", p.trans_a);
  check_leading_dimension("ldb", p.ldb, "B", stored_b(p), p.trans_b ? "n x k" : "k x n", "trans_b", p.trans_b);
  check_leading_dimension("ldc", p.ldc, "C", Stored{p.m, p.n}, "m x n", nullptr, false);
  if (p.batch > 1) {
    if (p.stride_a < 0) reject("stride_a", "got " + str(p.stride_a) + "; batch strides must be >= 0");
    if (p.stride_b < 0) reject("stride_b", "got " + str(p.stride_b) + "; batch strides must be >= 0");
    if (p.stride_c < 0) reject("stride_c", "got " + str(p.stride_c) + "; batch strides must be >= 0");
  }
  const int64_t es = dtype_size(p.dtype);
  const int64_t batch_for_span = p.batch > 1 ? p.batch : 1;
  span_elements("lda", "stride_a", stored_a(p), p.lda, batch_for_span, p.batch > 1 ? p.stride_a : 0, es);
  span_elements("ldb", "stride_b", stored_b(p), p.ldb, batch_for_span, p.batch > 1 ? p.stride_b : 0, es);
  span_elements("ldc", "stride_c", Stored{p.m, p.n}, p.ldc, batch_for_span, p.batch > 1 ? p.stride_c : 0, es);
  check_c_does_not_overlap(p);
}

}  // namespace inferctx

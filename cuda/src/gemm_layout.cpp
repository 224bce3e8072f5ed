// A call's operands to its GEMM problem: each array read as stored row-major matrices (a
// column-major one as its transpose), the product's sizes, broadcasting over the batch, out's
// layout, and the checks of the addresses (out sharing memory with an input, misalignment).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "inferctx/errors.hpp"
#include "inferctx/gemm.hpp"
#include "gemm_detail.hpp"

namespace inferctx {

using namespace detail;

namespace {

// "(4, 5)", "(4,)": a shape or strides as the caller writes them.
std::string tuple_text(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + str(v[i]);
  return s + (v.size() == 1 ? ",)" : ")");
}

std::string shaped(const char* name, const GemmOperand& x) { return std::string(name) + " of shape " + tuple_text(x.shape); }

std::string dtype_text(const GemmOperand& x) {
  if (!x.dtype_name.empty()) return x.dtype_name;
  switch (x.dtype) {
    case 0: return "float32";
    case 1: return "float16";
    case 2: return "bfloat16";
    default: return "unknown dtype";
  }
}

[[noreturn]] void refuse(const char* argument, const std::string& facts, Remedy remedy = Remedy::None) {
  throw with_remedy(ConfigError(argument, std::string(argument) + ": " + facts), remedy);
}

// The leading dimension of an r x c matrix with strides (sr, sc) read row-major; -1 when it is
// not stored so (its elements along a row must be adjacent, its rows apart by at least c).
int64_t row_major_ld(int64_t r, int64_t c, int64_t sr, int64_t sc) {
  if (r == 0 || c == 0) return c > 0 ? c : 1;
  if (c != 1 && sc != 1) return -1;
  if (r == 1) return c;
  return sr >= c ? sr : -1;
}

struct Read {
  GemmSpan span;  // batch and stride as the array has them (stride kept for a batch of 1)
  bool flipped;   // its last two dimensions are column-major: the transpose is stored
};

// The array's matrices as stored row-major, or refuses it (naming `argument`).
Read read_operand(const char* argument, const GemmOperand& x) {
  const size_t d = x.shape.size();
  int64_t batch = 1, sb = 0;
  if (d == 3) {
    batch = x.shape[0];
    sb = x.strides[0];
  }
  const int64_t r = x.shape[d - 2], c = x.shape[d - 1], sr = x.strides[d - 2], sc = x.strides[d - 1];
  if (sb < 0 && batch > 1) {
    refuse(argument, "shape " + tuple_text(x.shape) + " with strides " + tuple_text(x.strides) +
                         " (in elements); its batch stride " + str(sb) + " is negative, and cuBLAS takes "
                         "batches only in increasing memory order (0 or more)",
           Remedy::MakeContiguous);
  }
  if (batch <= 1) sb = std::max<int64_t>(sb, 0);  // one matrix: its batch stride is never used
  if (const int64_t ld = row_major_ld(r, c, sr, sc); ld >= 0) return {{batch, sb, r, c, ld}, false};
  if (const int64_t ld = row_major_ld(c, r, sc, sr); ld >= 0) return {{batch, sb, c, r, ld}, true};
  refuse(argument, "shape " + tuple_text(x.shape) + " with strides " + tuple_text(x.strides) +
                       " (in elements); one of its last two dimensions must have stride 1 and the other a "
                       "stride at least its length",
         Remedy::MakeContiguous);
}

void check_rank(int ndim, const GemmOperand& a, const GemmOperand& b) {
  const bool a_bad = a.shape.size() != static_cast<size_t>(ndim);
  if (!a_bad && b.shape.size() == static_cast<size_t>(ndim)) return;
  const char* bad = a_bad ? "a" : "b";
  const size_t rank = (a_bad ? a : b).shape.size();
  refuse(bad, std::string("must be ") + str(ndim) + "-D (" + (ndim == 2 ? "(m, k)" : "(batch, m, k)") +
                  " and so on); got " + shaped("a", a) + " and " + shaped("b", b),
         ndim == 2 && rank == 3 ? Remedy::BatchedGemm : Remedy::None);
}

void check_dtypes(const GemmOperand& a, const GemmOperand& b) {
  const std::string both = shaped("a", a) + " (" + dtype_text(a) + ") and " + shaped("b", b) + " (" + dtype_text(b) + ")";
  if (a.dtype < 0 || b.dtype < 0) {
    const char* bad = a.dtype < 0 ? "a" : "b";
    refuse(bad, both + ": " + bad + " has a dtype GEMM does not take; valid: float32, float16, bfloat16");
  }
  if (a.dtype != b.dtype) refuse("b", both + " have different dtypes; both must be one of float32, float16, bfloat16");
}

void check_operand(const char* argument, const GemmOperand& x) {
  if (x.strides.size() != x.shape.size()) {
    refuse(argument, "shape " + tuple_text(x.shape) + " comes with " + str(static_cast<int64_t>(x.strides.size())) + " strides");
  }
  for (int64_t n : x.shape) {
    if (n < 0) refuse(argument, "shape " + tuple_text(x.shape) + " has a negative size");
  }
}

// out's batch x m x n elements must be distinct (matrices_distinct), or the product would write
// some of them twice.
void check_out_is_distinct(const GemmOperand& out, const GemmSpan& c) {
  if (matrices_distinct(c.batch, c.rows, c.cols, c.ld, c.stride)) return;
  refuse("out", "shape " + tuple_text(out.shape) + " with strides " + tuple_text(out.strides) +
                    ": its matrices overlap, so the product would write some elements twice");
}

// Bytes from a span's first element to just past its last (0 when it is empty).
int64_t span_bytes(const GemmSpan& s, int64_t esize) {
  if (s.batch == 0 || s.rows == 0 || s.cols == 0) return 0;
  return ((s.batch - 1) * s.stride + (s.rows - 1) * s.ld + s.cols) * esize;
}

bool intersects(uintptr_t x, int64_t x_bytes, uintptr_t y, int64_t y_bytes) {
  if (x_bytes == 0 || y_bytes == 0) return false;
  return x < y + static_cast<uint64_t>(y_bytes) && y < x + static_cast<uint64_t>(x_bytes);
}

// Whether [0, x_len) and [y_at, y_at + y_len) are disjoint on a circle of `period` elements, y_at
// taken modulo the period (negative offsets included).
bool apart_modulo(int64_t period, int64_t y_at, int64_t x_len, int64_t y_len) {
  if (period <= 0 || x_len > period || y_len > period - x_len) return false;
  const int64_t at = (y_at % period + period) % period;
  return x_len <= at && at + y_len <= period;
}

// Elements from a matrix's first to just past its last (0 when it is empty).
int64_t matrix_elements(const GemmSpan& s) { return s.rows == 0 || s.cols == 0 ? 0 : (s.rows - 1) * s.ld + s.cols; }

// Whether each matrix of a span starts a whole number of `period` elements from its first.
bool batches_on(const GemmSpan& s, int64_t period) { return s.batch <= 1 || s.stride % period == 0; }

// Whether `in` and out take disjoint elements of one buffer, seen through a period both repeat
// with: side by side in the same rows (the period is their common leading dimension, each batch
// stride a multiple of it; the input takes columns [0, cols) and out others), or interleaved
// matrix by matrix (the period is their common batch stride; each matrix fits within it).
// Conservative: false when neither pattern shows them apart.
bool side_by_side(const GemmSpan& in, uintptr_t in_ptr, const GemmSpan& c, uintptr_t c_ptr, int64_t esize) {
  const int64_t diff = static_cast<int64_t>(c_ptr - in_ptr);
  if (diff % esize != 0) return false;
  const int64_t at = diff / esize;
  if (in.ld == c.ld && batches_on(in, in.ld) && batches_on(c, c.ld) && apart_modulo(in.ld, at, in.cols, c.cols)) {
    return true;
  }
  const int64_t period = in.batch > 1 ? in.stride : c.stride;  // the batch stride they share
  if (in.batch <= 1 && c.batch <= 1) return false;  // one matrix each: the rows' test above decides
  if ((in.batch > 1 && in.stride != period) || (c.batch > 1 && c.stride != period)) return false;
  return apart_modulo(period, at, matrix_elements(in), matrix_elements(c));
}

}  // namespace

GemmProblem normalized_gemm_problem(const GemmProblem& problem) { return normalized(problem); }

int packed_operand_alignment(int64_t batch, int64_t stride, int64_t esize) {
  return alignment_of(nullptr, batch, stride, esize);
}

GemmLayout gemm_layout(int ndim, bool trans_a, bool trans_b, const GemmOperand& a, const GemmOperand& b,
                       const GemmOperand* out) {
  if (ndim != 2 && ndim != 3) reject("ndim", "got " + str(ndim) + "; valid: 2 (gemm) or 3 (a batch)");
  check_operand("a", a);
  check_operand("b", b);
  check_rank(ndim, a, b);
  check_dtypes(a, b);
  const Read ra = read_operand("a", a), rb = read_operand("b", b);
  const GemmSpan &sa = ra.span, &sb = rb.span;
  // op(a) is m x k; the stored matrix is op(a) itself unless exactly one of trans_a and the
  // array's own column-major order transposes it.
  const bool ta = trans_a != ra.flipped, tb = trans_b != rb.flipped;
  const int64_t m = ta ? sa.cols : sa.rows, k = ta ? sa.rows : sa.cols;
  const int64_t kb = tb ? sb.cols : sb.rows, n = tb ? sb.rows : sb.cols;
  if (kb != k) {
    refuse("b", shaped("a", a) + (trans_a ? " (trans_a)" : "") + " and " + shaped("b", b) +
                    (trans_b ? " (trans_b)" : "") + " do not multiply: op(a) has " + str(k) +
                    " columns but op(b) has " + str(kb) + " rows");
  }
  // A batch of 1 is broadcast against the other, whatever its size (0 included, as NumPy and torch do).
  const int64_t batch = sa.batch == 1 ? sb.batch : sa.batch;
  if (sa.batch != sb.batch && sa.batch != 1 && sb.batch != 1) {
    refuse("b", shaped("a", a) + " and " + shaped("b", b) + " have batch sizes " + str(sa.batch) + " and " +
                    str(sb.batch) + "; they must be equal (or one of them 1, to broadcast)");
  }

  GemmLayout L;
  L.out_shape = ndim == 2 ? std::vector<int64_t>{m, n} : std::vector<int64_t>{batch, m, n};
  GemmProblem& p = L.problem;
  p.dtype = a.dtype;
  p.trans_a = ta;
  p.trans_b = tb;
  p.m = m;
  p.n = n;
  p.k = k;
  p.batch = batch;
  p.lda = sa.ld;
  p.ldb = sb.ld;
  p.stride_a = sa.batch == 1 ? 0 : sa.stride;
  p.stride_b = sb.batch == 1 ? 0 : sb.stride;
  L.span_a = {p.stride_a != 0 ? batch : 1, p.stride_a, sa.rows, sa.cols, sa.ld};
  L.span_b = {p.stride_b != 0 ? batch : 1, p.stride_b, sb.rows, sb.cols, sb.ld};
  if (out == nullptr) {
    p.ldc = n > 0 ? n : 1;
    if (__builtin_mul_overflow(m, n, &p.stride_c)) refuse("b", "the result of " + shaped("a", a) + " and " + shaped("b", b) + " has more than 2^63 elements");
    L.span_c = {batch, p.stride_c, m, n, p.ldc};
  } else {
    check_operand("out", *out);
    if (out->shape != L.out_shape) {
      refuse("out", "has shape " + tuple_text(out->shape) + ", but " + shaped("a", a) + " and " + shaped("b", b) +
                        " give " + tuple_text(L.out_shape));
    }
    if (out->dtype != a.dtype) {
      refuse("out", "shape " + tuple_text(out->shape) + ", " + dtype_text(*out) + ", but a and b are " + dtype_text(a) +
                        "; out must have their dtype");
    }
    const Read rc = read_operand("out", *out);
    L.swap = rc.flipped;
    p.ldc = rc.span.ld;
    p.stride_c = batch == 1 ? 0 : rc.span.stride;
    L.span_c = {batch, p.stride_c, rc.span.rows, rc.span.cols, rc.span.ld};
    check_out_is_distinct(*out, L.span_c);
  }
  if (L.swap) {  // out^T = op(b)^T op(a)^T, written row-major
    const bool t = p.trans_a;
    p.trans_a = !p.trans_b;
    p.trans_b = !t;
    std::swap(p.lda, p.ldb);
    std::swap(p.stride_a, p.stride_b);
    std::swap(p.m, p.n);
  }
  validate_gemm(p);
  return L;
}

void check_gemm_addresses(const GemmLayout& layout, uintptr_t a, uintptr_t b, uintptr_t c) {
  const int64_t es = dtype_size(layout.problem.dtype);
  const int64_t c_bytes = span_bytes(layout.span_c, es);
  const struct {
    const char* name;
    uintptr_t ptr;
    const GemmSpan& span;
  } inputs[2] = {{"a", a, layout.span_a}, {"b", b, layout.span_b}};
  for (const auto& in : inputs) {
    if (!intersects(in.ptr, span_bytes(in.span, es), c, c_bytes)) continue;
    if (side_by_side(in.span, in.ptr, layout.span_c, c, es)) continue;
    refuse("out", std::string("out shares memory with ") + in.name + ": their elements overlap, or interleave in "
                      "a way this check cannot prove apart, so the product could overwrite its own input. Write "
                      "into a separate array");
  }
  const struct {
    const char* name;
    uintptr_t ptr;
  } operands[3] = {{"a", a}, {"b", b}, {"out", c}};
  for (const auto& x : operands) {
    if (x.ptr % static_cast<uint64_t>(es) == 0) continue;
    char at[32];
    std::snprintf(at, sizeof at, "%#llx", static_cast<unsigned long long>(x.ptr));
    refuse(x.name, std::string(x.name) + " starts at " + at + ", which is not a multiple of its " + str(es) +
                       "-byte elements; cuBLAS needs element-aligned operands (an array that starts at a byte "
                       "offset inside another must start at a whole element)");
  }
}

}  // namespace inferctx

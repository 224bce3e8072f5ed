// What the GEMM tests share: host matrices in the GEMM's dtypes, a product on fresh random
// operands checked against a float64 host reference (with C's padding checked to survive), and
// fixed operands for comparing two runs' bits. Included by one translation unit per test.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "device_memory.cuh"
#include "inferctx/blas.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/gemm.hpp"
#include "inferctx/memory.hpp"

namespace gemm_reference {

using namespace inferctx;

constexpr int F32 = static_cast<int>(DType::Float32);
constexpr int F16 = static_cast<int>(DType::Float16);
constexpr int BF16 = static_cast<int>(DType::BFloat16);
inline const char* kDTypeNames[] = {"float32", "float16", "bfloat16"};

using check::rng;

inline float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng()); }

// Host storage in the GEMM's dtype, with rounding conversions.
struct HostMatrix {
  int dtype = F32;
  std::vector<uint8_t> bytes;

  HostMatrix(int dtype_, int64_t count) : dtype(dtype_), bytes(static_cast<size_t>(count * dtype_size(dtype_))) {}
  int64_t count() const { return static_cast<int64_t>(bytes.size()) / dtype_size(dtype); }

  float get(int64_t i) const {
    if (dtype == F32) {
      float v;
      std::memcpy(&v, &bytes[i * 4], 4);
      return v;
    }
    if (dtype == F16) {
      __half h;
      std::memcpy(&h, &bytes[i * 2], 2);
      return __half2float(h);
    }
    __nv_bfloat16 h;
    std::memcpy(&h, &bytes[i * 2], 2);
    return __bfloat162float(h);
  }
  void set(int64_t i, float v) {
    if (dtype == F32) {
      std::memcpy(&bytes[i * 4], &v, 4);
    } else if (dtype == F16) {
      const __half h = __float2half_rn(v);
      std::memcpy(&bytes[i * 2], &h, 2);
    } else {
      const __nv_bfloat16 h = __float2bfloat16_rn(v);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  void set_bits(int64_t i, uint8_t byte) { std::memset(&bytes[i * dtype_size(dtype)], byte, dtype_size(dtype)); }
  bool same_bits(const HostMatrix& o, int64_t i) const {
    return std::memcmp(&bytes[i * dtype_size(dtype)], &o.bytes[i * dtype_size(dtype)], dtype_size(dtype)) == 0;
  }
};

struct Layout {
  int64_t rows, cols, ld, batch, stride;
  int64_t index(int64_t b, int64_t r, int64_t c) const { return b * stride + r * ld + c; }
  int64_t span() const {
    if (rows == 0 || cols == 0 || batch == 0) return 0;
    return (batch - 1) * stride + (rows - 1) * ld + cols;
  }
};

inline Layout layout_a(const GemmProblem& p) {
  return {p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k, p.lda, p.batch, p.batch > 1 ? p.stride_a : 0};
}
inline Layout layout_b(const GemmProblem& p) {
  return {p.trans_b ? p.n : p.k, p.trans_b ? p.k : p.n, p.ldb, p.batch, p.batch > 1 ? p.stride_b : 0};
}
inline Layout layout_c(const GemmProblem& p) { return {p.m, p.n, p.ldc, p.batch, p.batch > 1 ? p.stride_c : 0}; }

// Device copy of a host matrix (at least 256 bytes, so even empty operands have an address),
// landed when an upload returns (the tests' streams are non-blocking).
struct DeviceMatrix {
  std::unique_ptr<DeviceAllocation> memory;
  explicit DeviceMatrix(const HostMatrix& h) {
    memory = std::make_unique<DeviceAllocation>(0, std::max<int64_t>(256, static_cast<int64_t>(h.bytes.size())));
    upload(h);
  }
  void upload(const HostMatrix& h) const {
    test_memory::upload(memory->data(), h.bytes.data(), h.bytes.size(), 0);
  }
  void* data() const { return memory->data(); }
  void download(HostMatrix& h) const {
    INFERCTX_CUDA(cudaMemcpy(h.bytes.data(), memory->data(), h.bytes.size(), cudaMemcpyDeviceToHost), 0);
  }
};

inline double tolerance(const GemmProblem& p) {
  if (p.dtype == F32) return p.tf32 ? 1e-3 : 1e-5;
  return 1e-2;
}

struct Outcome {
  double error = INFINITY;     // relative Frobenius error against the float64 reference
  bool padding_intact = true;  // elements of C's allocation outside its matrices unchanged
  HostMatrix result{F32, 0};
};

// Relative Frobenius error of `result` (C's allocation after the product) against the float64
// product alpha * op(a) @ op(b) + beta * c0; infinite where it holds a NaN or an infinity.
inline double reference_error(const GemmProblem& p, const HostMatrix& a, const HostMatrix& b, const HostMatrix& c0,
                              const HostMatrix& result, float alpha, float beta) {
  const Layout la = layout_a(p), lb = layout_b(p), lc = layout_c(p);
  double diff2 = 0.0, ref2 = 0.0;
  bool finite = true;
  for (int64_t bt = 0; bt < p.batch; ++bt) {
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t j = 0; j < p.n; ++j) {
        double sum = 0.0;
        for (int64_t l = 0; l < p.k; ++l) {
          const double av = p.trans_a ? a.get(la.index(bt, l, i)) : a.get(la.index(bt, i, l));
          const double bv = p.trans_b ? b.get(lb.index(bt, j, l)) : b.get(lb.index(bt, l, j));
          sum += av * bv;
        }
        const int64_t at = lc.index(bt, i, j);
        double ref = static_cast<double>(alpha) * sum;
        if (beta != 0.0f) ref += static_cast<double>(beta) * c0.get(at);
        const double got = result.get(at);
        if (!std::isfinite(got)) finite = false;
        diff2 += (got - ref) * (got - ref);
        ref2 += ref * ref;
      }
    }
  }
  return !finite ? INFINITY : (ref2 > 0.0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2));
}

// Runs one product on fresh random operands (every element of each allocation random, the
// gaps between rows included) and compares it with a float64 host reference. C's matrix
// elements start as NaN when beta = 0 (so an unwritten element fails), else random; its
// gaps hold a sentinel that must survive.
inline Outcome run_and_check(CublasHandle& handle, cudaStream_t stream, const GemmProblem& p, float alpha, float beta) {
  const Layout la = layout_a(p), lb = layout_b(p), lc = layout_c(p);
  HostMatrix a(p.dtype, la.span()), b(p.dtype, lb.span()), c0(p.dtype, lc.span());
  for (int64_t i = 0; i < a.count(); ++i) a.set(i, uniform(-1.0f, 1.0f));
  for (int64_t i = 0; i < b.count(); ++i) b.set(i, uniform(-1.0f, 1.0f));
  std::vector<bool> in_c(static_cast<size_t>(c0.count()), false);
  for (int64_t bt = 0; bt < p.batch; ++bt)
    for (int64_t r = 0; r < p.m; ++r)
      for (int64_t col = 0; col < p.n; ++col) in_c[static_cast<size_t>(lc.index(bt, r, col))] = true;
  for (int64_t i = 0; i < c0.count(); ++i) {
    if (!in_c[static_cast<size_t>(i)]) {
      c0.set(i, 77.25f);
    } else if (beta == 0.0f) {
      c0.set_bits(i, 0xFF);  // NaN in every dtype
    } else {
      c0.set(i, uniform(-1.0f, 1.0f));
    }
  }
  DeviceMatrix da(a), db(b), dc(c0);
  gemm(handle, stream, p, da.data(), db.data(), dc.data(), alpha, beta);
  INFERCTX_CUDA(cudaStreamSynchronize(stream), 0);
  Outcome out;
  out.result = HostMatrix(p.dtype, c0.count());
  dc.download(out.result);

  out.error = reference_error(p, a, b, c0, out.result, alpha, beta);
  for (int64_t i = 0; i < c0.count(); ++i) {
    if (!in_c[static_cast<size_t>(i)] && !c0.same_bits(out.result, i)) out.padding_intact = false;
  }
  return out;
}

inline std::string describe(const GemmProblem& p, float alpha, float beta) {
  char text[320];
  std::snprintf(text, sizeof text,
                "%s m=%lld n=%lld k=%lld batch=%lld trans_a=%d trans_b=%d lda=%lld ldb=%lld ldc=%lld "
                "strides=%lld/%lld/%lld tf32=%d alpha=%g beta=%g",
                kDTypeNames[p.dtype], (long long)p.m, (long long)p.n, (long long)p.k, (long long)p.batch, p.trans_a,
                p.trans_b, (long long)p.lda, (long long)p.ldb, (long long)p.ldc, (long long)p.stride_a,
                (long long)p.stride_b, (long long)p.stride_c, p.tf32, alpha, beta);
  return text;
}

// Runs and checks against the dtype's bound; prints the problem on failure.
inline void expect_correct(CublasHandle& handle, cudaStream_t stream, const GemmProblem& p, float alpha = 1.0f,
                    float beta = 0.0f) {
  const Outcome out = run_and_check(handle, stream, p, alpha, beta);
  const bool ok = out.error < tolerance(p) && out.padding_intact;
  if (!ok) {
    std::printf("  %s: error %.3e (bound %.0e), padding %s\n", describe(p, alpha, beta).c_str(), out.error,
                tolerance(p), out.padding_intact ? "intact" : "OVERWRITTEN");
  }
  CHECK(out.error < tolerance(p));
  CHECK(out.padding_intact);
}

// The tests' device (0), cuBLAS handle and non-blocking stream. The handle is made while the
// static is built: cuBLAS's process-wide state, built with the first handle, is then torn down
// after the static's destructor has destroyed the handle (blas.hpp).
struct Gpu {
  std::unique_ptr<CublasHandle> handle;
  cudaStream_t stream = nullptr;
};

inline Gpu& gpu() {
  static Gpu g = [] {
    Gpu x;
    INFERCTX_CUDA(cudaSetDevice(0), 0);
    x.handle = std::make_unique<CublasHandle>(0);
    INFERCTX_CUDA(cudaStreamCreateWithFlags(&x.stream, cudaStreamNonBlocking), 0);
    return x;
  }();
  return g;
}

// Runs `p` on fixed operands and returns C's bytes, for comparing two algorithms' results.
struct FixedOperands {
  GemmProblem p;
  HostMatrix a, b, c;
  std::unique_ptr<DeviceMatrix> da, db, dc;
  explicit FixedOperands(const GemmProblem& problem)
      : p(problem),
        a(problem.dtype, layout_a(problem).span()),
        b(problem.dtype, layout_b(problem).span()),
        c(problem.dtype, layout_c(problem).span()) {
    for (int64_t i = 0; i < a.count(); ++i) a.set(i, uniform(-1.0f, 1.0f));
    for (int64_t i = 0; i < b.count(); ++i) b.set(i, uniform(-1.0f, 1.0f));
    da = std::make_unique<DeviceMatrix>(a);
    db = std::make_unique<DeviceMatrix>(b);
    for (int64_t i = 0; i < c.count(); ++i) c.set_bits(i, 0xFF);
    dc = std::make_unique<DeviceMatrix>(c);
  }
  HostMatrix run(CublasHandle& handle, cudaStream_t stream) {
    // On the gemm's own stream: a cudaMemset on the legacy stream is not ordered before it.
    INFERCTX_CUDA(cudaMemsetAsync(dc->data(), 0xFF, c.bytes.size(), stream), 0);
    gemm(handle, stream, p, da->data(), db->data(), dc->data());
    INFERCTX_CUDA(cudaStreamSynchronize(stream), 0);
    HostMatrix out(p.dtype, c.count());
    dc->download(out);
    return out;
  }
  double relative_difference(const HostMatrix& x, const HostMatrix& y) const {
    const Layout lc = layout_c(p);
    double d2 = 0.0, r2 = 0.0;
    for (int64_t bt = 0; bt < p.batch; ++bt)
      for (int64_t i = 0; i < p.m; ++i)
        for (int64_t j = 0; j < p.n; ++j) {
          const double u = x.get(lc.index(bt, i, j)), v = y.get(lc.index(bt, i, j));
          if (!std::isfinite(u) || !std::isfinite(v)) return INFINITY;
          d2 += (u - v) * (u - v);
          r2 += v * v;
        }
    return std::sqrt(d2 / r2);
  }
};

}  // namespace gemm_reference

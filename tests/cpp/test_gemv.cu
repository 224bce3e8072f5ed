// inferctx's few-row GEMM kernel (gemm_gemv.cu) on its own: each product runs through an
// imported cache entry that names the kernel, so this process launches no cuBLAS kernel at all
// (test_gemm's cases run cublasGemmEx first). That lets compute-sanitizer's racecheck, which
// stops inside cuBLAS's kernels on Hopper, look at the kernel's shared memory and barriers.
// Every result is checked against a float64 host reference, C's padding must survive, and a
// product with beta = 0 must give the same bits twice.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.hpp"
#include "gemm_reference.hpp"
#include "inferctx/blas.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/gemm.hpp"

using namespace inferctx;
using namespace gemm_reference;

namespace {

// A cache entry that makes gemm run the few-row kernel on `p` (device 0, operands at addresses
// aligned to 256 bytes, as the tests' allocations are).
GemmCacheEntry kernel_entry(const GemmProblem& p) {
  cudaDeviceProp prop{};
  INFERCTX_CUDA(cudaGetDeviceProperties(&prop, 0), 0);
  GemmCacheEntry e;
  e.device = 0;
  e.device_name = prop.name;
  e.cublas_version = static_cast<int64_t>(cublasLtGetVersion());
  e.problem = p;
  e.backend = static_cast<int>(GemmBackend::Gemv);
  return e;
}

struct Case {
  GemmProblem p;
  float alpha, beta;
};

std::vector<Case> kernel_cases() {
  std::vector<Case> cases;
  for (int dt : {F32, F16, BF16}) {
    for (int64_t m : {1, 2, 3, 4, 5, 7, 8}) {  // each of the kernel's four row counts, full and not
      // n = 264: whole column tiles and a part (128 columns a tile in fp32, 256 in 16-bit);
      // k = 300: a whole k chunk of 256 rows and a part.
      cases.push_back({packed_gemm_problem(dt, m, 264, 300), 1.0f, 0.0f});
      // a^T, four whole k chunks, alpha and beta.
      cases.push_back({packed_gemm_problem(dt, m, 512, 1024, 1, true, false), 0.5f, 0.25f});
    }
    GemmProblem pad = packed_gemm_problem(dt, 6, 136, 520);  // padded rows; B's stay 16-byte aligned
    pad.lda += 3;
    pad.ldb += 8;
    pad.ldc += 5;
    cases.push_back({pad, -1.5f, 0.75f});
  }
  return cases;
}

}  // namespace

TEST_CASE("gpu: the few-row kernel alone, 1 to 8 rows, every dtype, against the float64 reference") {
  int ran = 0;
  for (const Case& c : kernel_cases()) {
    clear_gemm_cache();
    CHECK_EQ(import_gemm_cache({kernel_entry(c.p)}), int64_t{1});
    expect_correct(*gpu().handle, gpu().stream, c.p, c.alpha, c.beta);
    // The entry still names the kernel after its first use (it takes the problem), so the product
    // came from the kernel and not from cublasGemmEx.
    const auto after = export_gemm_cache(true);
    CHECK_EQ(after.size(), size_t{1});
    if (after.size() == 1) {
      CHECK_EQ(after[0].backend, static_cast<int>(GemmBackend::Gemv));
      if (after[0].backend == static_cast<int>(GemmBackend::Gemv)) ++ran;
    }
    if (c.beta == 0.0f) {
      // The chunks' sums are added in a fixed order: the same bits on every run.
      FixedOperands ops(c.p);
      const HostMatrix first = ops.run(*gpu().handle, gpu().stream);
      const HostMatrix second = ops.run(*gpu().handle, gpu().stream);
      if (first.bytes != second.bytes) std::printf("  %s: bits differ\n", describe(c.p, 1, 0).c_str());
      CHECK(first.bytes == second.bytes);
    }
  }
  CHECK_EQ(ran, static_cast<int>(kernel_cases().size()));
  clear_gemm_cache();
}

TEST_CASE("gpu: the few-row kernel on two streams at once, each result against the reference") {
  // Two products queued back to back on two non-blocking streams, so that the kernels can run at
  // the same time: each stream has its own workspace for the partial sums.
  cudaStream_t other = nullptr;
  INFERCTX_CUDA(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), 0);
  for (int dt : {F32, F16, BF16}) {
    const GemmProblem p = packed_gemm_problem(dt, 4, 1024, 2048);
    clear_gemm_cache();
    CHECK_EQ(import_gemm_cache({kernel_entry(p)}), int64_t{1});
    FixedOperands x(p), y(p);
    // Each set's result alone first, then both sets queued together on the two streams.
    const HostMatrix x_alone = x.run(*gpu().handle, gpu().stream);
    const HostMatrix y_alone = y.run(*gpu().handle, other);
    INFERCTX_CUDA(cudaMemsetAsync(x.dc->data(), 0xFF, x.c.bytes.size(), gpu().stream), 0);
    INFERCTX_CUDA(cudaMemsetAsync(y.dc->data(), 0xFF, y.c.bytes.size(), other), 0);
    gemm(*gpu().handle, gpu().stream, p, x.da->data(), x.db->data(), x.dc->data());
    gemm(*gpu().handle, other, p, y.da->data(), y.db->data(), y.dc->data());
    INFERCTX_CUDA(cudaDeviceSynchronize(), 0);
    HostMatrix x_both(p.dtype, x.c.count()), y_both(p.dtype, y.c.count());
    x.dc->download(x_both);
    y.dc->download(y_both);
    CHECK(x_both.bytes == x_alone.bytes);
    CHECK(y_both.bytes == y_alone.bytes);
    // And they are the products: within the dtype's bound of the float64 reference.
    const double x_error = reference_error(p, x.a, x.b, x.c, x_both, 1.0f, 0.0f);
    const double y_error = reference_error(p, y.a, y.b, y.c, y_both, 1.0f, 0.0f);
    if (!(x_error < tolerance(p) && y_error < tolerance(p))) {
      std::printf("  %s: errors %.3e and %.3e\n", describe(p, 1, 0).c_str(), x_error, y_error);
    }
    CHECK(x_error < tolerance(p));
    CHECK(y_error < tolerance(p));
    const auto after = export_gemm_cache(true);
    CHECK_EQ(after.size(), size_t{1});
    if (after.size() == 1) CHECK_EQ(after[0].backend, static_cast<int>(GemmBackend::Gemv));
  }
  clear_gemm_cache();
  INFERCTX_CUDA(cudaStreamDestroy(other), 0);
}

int main() {
  check::skip_without_gpu();
  check::run_seed();
  return check::run_all();
}

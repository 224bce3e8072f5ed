// Running one GEMM: through cuBLASLt with the cached algorithm, or through cublasGemmEx (or its
// strided batched form); C = beta * C for k = 0. See gemm_detail.hpp for the row-major terms.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/gemm.hpp"
#include "inferctx/stream.hpp"
#include "gemm_detail.hpp"

namespace inferctx {

using namespace detail;

namespace {

bool fits_int(int64_t v) { return v <= INT_MAX; }

void check_pointer(const char* field, const void* ptr, const char* what, int64_t rows, int64_t cols) {
  if (ptr == nullptr) {
    reject(field, std::string("null device pointer for ") + what + " (" + str(rows) + " x " + str(cols) + ")");
  }
}

}  // namespace

namespace detail {

cublasStatus_t run_lt(const CublasHandle& handle, cudaStream_t stream, const AlgoChoice& choice,
                      const cublasLtMatmulAlgo_t* algo, const void* a, const void* b, void* c, const float* alpha,
                      const float* beta) {
  return cublasLtMatmul(handle.lt(), choice.op(), alpha, b, choice.lt_a(), a, choice.lt_b(), beta, c, choice.lt_c(),
                        c, choice.lt_c(), algo, handle.bound_workspace(),
                        static_cast<size_t>(handle.bound_workspace_bytes()), stream);
}

const char* cublas_call_name(const GemmProblem& p) {
  return p.batch > 1 ? "cublasGemmStridedBatchedEx" : "cublasGemmEx";
}

cublasStatus_t run_cublas(CublasHandle& handle, const GemmProblem& p, const void* a, const void* b, void* c,
                          const float* alpha, const float* beta) {
  // The handle is bound to the call's stream (CublasHandle::begin_use).
  const cublasOperation_t op_first = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // our B goes first
  const cublasOperation_t op_second = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  // With CUBLAS_COMPUTE_32F cuBLAS follows the handle's math mode, which may allow TF32.
  cublasComputeType_t compute = compute_type(p);
  if (p.dtype == static_cast<int>(DType::Float32) && !uses_tf32(p) && handle.tf32()) {
    compute = CUBLAS_COMPUTE_32F_PEDANTIC;
  }
  const cudaDataType_t type = data_type(p.dtype);
  const bool small = fits_int(p.m) && fits_int(p.n) && fits_int(p.k) && fits_int(p.lda) && fits_int(p.ldb) &&
                     fits_int(p.ldc) && fits_int(p.batch);
  if (p.batch <= 1) {
    if (small) {
      return cublasGemmEx(handle.get(), op_first, op_second, static_cast<int>(p.n), static_cast<int>(p.m),
                          static_cast<int>(p.k), alpha, b, type, static_cast<int>(p.ldb), a, type,
                          static_cast<int>(p.lda), beta, c, type, static_cast<int>(p.ldc), compute,
                          CUBLAS_GEMM_DEFAULT);
    }
    return cublasGemmEx_64(handle.get(), op_first, op_second, p.n, p.m, p.k, alpha, b, type, p.ldb, a, type, p.lda,
                           beta, c, type, p.ldc, compute, CUBLAS_GEMM_DEFAULT);
  }
  if (small) {
    return cublasGemmStridedBatchedEx(handle.get(), op_first, op_second, static_cast<int>(p.n),
                                      static_cast<int>(p.m), static_cast<int>(p.k), alpha, b, type,
                                      static_cast<int>(p.ldb), p.stride_b, a, type, static_cast<int>(p.lda),
                                      p.stride_a, beta, c, type, static_cast<int>(p.ldc), p.stride_c,
                                      static_cast<int>(p.batch), compute, CUBLAS_GEMM_DEFAULT);
  }
  return cublasGemmStridedBatchedEx_64(handle.get(), op_first, op_second, p.n, p.m, p.k, alpha, b, type, p.ldb,
                                       p.stride_b, a, type, p.lda, p.stride_a, beta, c, type, p.ldc, p.stride_c,
                                       p.batch, compute, CUBLAS_GEMM_DEFAULT);
}

}  // namespace detail

void gemm(CublasHandle& handle, cudaStream_t stream, const GemmProblem& problem, const void* a, const void* b,
          void* c, float alpha, float beta) {
  require_explicit_stream(stream, "gemm");
  validate_gemm(problem);
  if (problem.m == 0 || problem.n == 0 || problem.batch == 0) return;
  check_pointer("c", c, "C", problem.m, problem.n);
  const GemmProblem p = normalized(problem);
  const int device = handle.device();
  CurrentDeviceScope scope(device);
  if (p.k == 0) {
    launch_scale(p, c, beta, stream, device);
    return;
  }
  WorkspaceUse use(handle, stream);
  check_pointer("a", a, "A", stored_a(p).rows, stored_a(p).cols);
  check_pointer("b", b, "B", stored_b(p).rows, stored_b(p).cols);

  const int64_t es = dtype_size(p.dtype);
  const int align_a = alignment_of(a, p.batch, p.stride_a, es);
  const int align_b = alignment_of(b, p.batch, p.stride_b, es);
  const int align_c = alignment_of(c, p.batch, p.stride_c, es);
  const Key key = make_key(device, p, align_a, align_b, align_c);
  std::shared_ptr<const AlgoChoice> choice = find_choice(key);
  if (!choice) {
    // Stored only where the key still has no entry: an import (or a tuning) of it that another
    // thread made meanwhile stays in force.
    choice = store_choice_if(key, nullptr, heuristic_choice(handle, p, align_a, align_b, align_c));
  }
  while (!choice->verified) choice = verify_imported(handle, key, p, *choice);

  // A tuned choice that needs more workspace than the stream has bound (none while it is first
  // captured) gives way to cublasGemmEx for this call.
  if (choice->backend == GemmBackend::Gemv &&
      choice->workspace_bytes <= static_cast<size_t>(handle.bound_workspace_bytes())) {
    launch_gemv(p, a, b, c, alpha, beta, handle.bound_workspace(), stream, device);
    return;
  }
  if (choice->backend == GemmBackend::CublasLt &&
      choice->workspace_bytes <= static_cast<size_t>(handle.bound_workspace_bytes())) {
    const cublasStatus_t status = run_lt(handle, stream, *choice, &choice->algo, a, b, c, &alpha, &beta);
    if (status != CUBLAS_STATUS_NOT_SUPPORTED) {
      check_cublas(status, "cublasLtMatmul", device);
      return;
    }
    // cuBLASLt declined this configuration at run time: cublasGemmEx serves it from now on.
    auto fallback = new_choice(p, device);
    fallback->backend = GemmBackend::Cublas;
    fallback->source = choice->source;
    store_choice_if(key, choice.get(), std::move(fallback));
  }
  check_cublas(run_cublas(handle, p, a, b, c, &alpha, &beta), cublas_call_name(p), device);
}

void gemm(CublasHandle& handle, cudaStream_t stream, const GemmLayout& layout, const void* a, const void* b,
          void* c, float alpha, float beta, bool tf32) {
  check_gemm_addresses(layout, reinterpret_cast<uintptr_t>(a), reinterpret_cast<uintptr_t>(b),
                       reinterpret_cast<uintptr_t>(c));
  GemmProblem p = layout.problem;
  p.tf32 = tf32;
  if (layout.swap) std::swap(a, b);
  gemm(handle, stream, p, a, b, c, alpha, beta);
}

}  // namespace inferctx

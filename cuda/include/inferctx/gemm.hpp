// GEMM and strided-batched GEMM in row-major terms on a CublasHandle, through cuBLASLt,
// with an autotuner and a process-wide cache of the algorithm chosen for each problem.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "inferctx/blas.hpp"
#include "inferctx/plan.hpp"

namespace inferctx {

// For i in [0, batch):  C[i] = alpha * op(A[i]) * op(B[i]) + beta * C[i]
// with op(A) m x k, op(B) k x n and C m x n, every matrix stored row-major (NumPy / PyTorch
// order) with unit stride inside a row:
//   A is stored as m x k rows, or k x m when trans_a (then op(A) = A^T); likewise B as k x n,
//   or n x k when trans_b; C as m x n.
// lda/ldb/ldc are the elements from one stored row to the next (>= the stored row length);
// stride_a/b/c the elements from one matrix of the batch to the next (used when batch > 1;
// 0 for A or B repeats one matrix for the whole batch). Accumulation is fp32 in every case;
// alpha and beta are fp32.
struct GemmProblem {
  int dtype = static_cast<int>(DType::Float16);  // DType of A, B and C
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t batch = 1;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  // Float32 only: allow TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32). Ignored for
  // Float16 / BFloat16, whose products are exact in fp32 anyway.
  bool tf32 = false;
};

// A problem whose operands are densely packed (leading dimensions = row lengths, batch
// strides = matrix sizes); the shape every autotuned entry made from shapes alone has.
GemmProblem packed_gemm_problem(int dtype, int64_t m, int64_t n, int64_t k, int64_t batch = 1,
                                bool trans_a = false, bool trans_b = false, bool tf32 = false);

// Throws ConfigError naming the field (dtype, m, n, k, batch, lda, ldb, ldc, stride_a,
// stride_b, stride_c) with its value and what is valid. Zero m, n, k or batch are valid
// (see gemm).
void validate_gemm(const GemmProblem& problem);

// Queues the product on `stream`, on the handle's device (made current for the call; the
// caller's current device is the same afterwards). nullptr, the legacy default stream, is
// refused with ConfigError("stream") as everywhere in inferctx (pass cudaStreamLegacy to mean
// it). a and b must not be null when the product reads them, nor c when it writes it
// (ConfigError "a" / "b" / "c"). m, n or batch = 0: nothing to do. k = 0: C = beta * C
// (zeros when beta = 0), as BLAS defines it.
// The algorithm is the autotuned one when the cache has it for this problem (same device,
// shape, leading dimensions, batch strides, dtype, transposes and operand alignment),
// otherwise cuBLASLt's heuristic first choice, looked up once per problem and cached.
// Calls sharing a handle must not run concurrently on different streams: they share the
// handle's workspace (as cuBLAS's own calls do).
void gemm(CublasHandle& handle, cudaStream_t stream, const GemmProblem& problem, const void* a,
          const void* b, void* c, float alpha = 1.0f, float beta = 0.0f);

// Which library call runs a cached algorithm.
enum class GemmBackend : int {
  CublasLt = 0,  // cublasLtMatmul with the stored cublasLtMatmulAlgo_t
  Cublas = 1,    // cublasGemmEx / cublasGemmStridedBatchedEx with CUBLAS_GEMM_DEFAULT
};

struct GemmTuneOptions {
  int max_algorithms = 32;     // candidates asked of cublasLtMatmulAlgoGetHeuristic, 1..256
  int warmup = 3;              // untimed runs of each candidate, >= 0
  int repeats = 7;             // timed batches per candidate (the median counts), >= 1
  double min_batch_ms = 0.25;  // runs per timed batch are chosen to last at least this, > 0
  bool include_cublas = true;  // also time cublasGemmEx (the path PyTorch takes)
};

struct GemmTuneResult {
  int backend = 0;             // GemmBackend of the winner
  int algo_index = 0;          // position in the heuristic's list (0: its first choice); -1: Cublas
  std::vector<uint64_t> algo;  // the winner's cublasLtMatmulAlgo_t words (8), empty for Cublas
  int algo_id = -1, tile_id = -1, stages_id = -1, splitk = -1;  // its configuration (-1: Cublas)
  double default_ms = 0.0;     // median time of the heuristic's first choice
  double best_ms = 0.0;        // median time of the winner
  int candidates = 0;          // algorithms tried
  int valid = 0;               // of those, ones that ran and matched the first choice's result
  int rotated_sets = 1;        // operand copies cycled through so that no run hits in L2
};

// Times cuBLASLt's candidate algorithms for `problem` (and cublasGemmEx unless disabled) on
// operands it allocates and fills with random values (256-byte aligned, laid out as the
// problem says), keeps the fastest whose result matches the heuristic's first choice within
// the dtype's tolerance, and caches it for this device. Synchronises `stream`. Needs
// m, n, k, batch >= 1 (ConfigError). Same concurrency rule as gemm.
GemmTuneResult tune_gemm(CublasHandle& handle, cudaStream_t stream, const GemmProblem& problem,
                         const GemmTuneOptions& options = GemmTuneOptions());

// One cache entry as plain data, for saving to a file and loading back.
struct GemmCacheEntry {
  int device = 0;
  std::string device_name;     // cudaDeviceProp::name of the device it was tuned on
  int64_t cublas_version = 0;  // cublasLtGetVersion() of the library it was tuned with
  GemmProblem problem;
  // Largest power of two (<= 256) dividing each operand's address, and its batch stride in
  // bytes when batch > 1: cuBLASLt kernels differ by the alignment they assume.
  int align_a = 256, align_b = 256, align_c = 256;
  int backend = 0;             // GemmBackend
  std::vector<uint64_t> algo;  // 8 words of cublasLtMatmulAlgo_t for CublasLt, empty for Cublas
  double time_ms = -1.0;       // median time measured by tune_gemm, -1 when not measured
};

// Autotuned entries (with `tuned_only` false, heuristic ones too), in no particular order.
std::vector<GemmCacheEntry> export_gemm_cache(bool tuned_only = true);

// Adds entries as autotuned ones (replacing any for the same problem) and returns how many
// it took. It skips, without error, entries for a device ordinal that does not exist here,
// whose device_name differs from that device's, or whose cublas_version differs from the
// library loaded now. Malformed entries throw ConfigError (nothing is added then). An
// imported algorithm is checked with cublasLtMatmulAlgoCheck on first use; one that fails
// the check is replaced by the heuristic's choice.
int64_t import_gemm_cache(const std::vector<GemmCacheEntry>& entries);

void clear_gemm_cache();
int64_t gemm_cache_size();  // entries of any kind

}  // namespace inferctx

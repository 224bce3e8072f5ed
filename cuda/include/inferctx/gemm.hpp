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

// ---------------------------------------------------------------------------------------
// A call's operands as the caller holds them (gemm / bmm in Python), and the problem they make.

// An array as given: any rank, any element type. Shapes and strides count elements.
struct GemmOperand {
  int dtype = -1;          // DType code; -1 for an element type GEMM does not take
  std::string dtype_name;  // the caller's name for the element type, for messages
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

// One operand's stored (row-major) matrices: `batch` of them, `stride` elements apart, each
// `rows` x `cols` with leading dimension `ld`.
struct GemmSpan {
  int64_t batch = 1, stride = 0, rows = 0, cols = 0, ld = 1;
};

// What a call needs beyond its pointers, worked out once per signature from its operands'
// shapes and strides.
struct GemmLayout {
  GemmProblem problem;  // as it runs (tf32 is the call's; see gemm below)
  bool swap = false;    // out is column-major: the problem is out^T = op(b)^T op(a)^T, so b's
                        // address goes in as A and a's as B
  std::vector<int64_t> out_shape;  // (m, n) or (batch, m, n), as the caller sees them
  GemmSpan span_a, span_b, span_c;  // the stored matrices of a, b and out (batch 1 when broadcast)
};

// The layout of op(a) @ op(b) for operands of `ndim` (2: gemm, 3: bmm, whose batch size 1
// broadcasts) dimensions, with unit stride along one of their last two dimensions (a
// column-major one is read as its transpose); `out` is null when the result is allocated as a
// dense row-major array. Throws ConfigError naming "a", "b" or "out" (rank, dtype, layout,
// inner or batch sizes, out's shape and dtype, out's matrices overlapping each other).
GemmLayout gemm_layout(int ndim, bool trans_a, bool trans_b, const GemmOperand& a, const GemmOperand& b,
                       const GemmOperand* out);

// Throws ConfigError("out") where out shares memory with a or b (out side by side with an input
// in the rows of one buffer is allowed), and ConfigError naming the operand whose address is not
// a multiple of its element size.
void check_gemm_addresses(const GemmLayout& layout, uintptr_t a, uintptr_t b, uintptr_t c);

// The form the algorithm cache keys a problem by (export_gemm_cache gives it): TF32 only for
// Float32, batch strides 0 without a batch.
GemmProblem normalized_gemm_problem(const GemmProblem& problem);

// The alignment (bytes) the algorithm cache records for an operand whose first matrix is at
// least 256-byte aligned (a pool block, as the tuner's are): 256, lowered for a batch by the
// batch stride's bytes (every matrix after the first starts that far on).
int packed_operand_alignment(int64_t batch, int64_t stride, int64_t esize);

// Queues the product on `stream`, on the handle's device (made current for the call; the
// caller's current device is the same afterwards). nullptr, the legacy default stream, is
// refused with ConfigError("stream") as everywhere in inferctx (pass cudaStreamLegacy to mean
// it). a and b must not be null when the product reads them, nor c when it writes it
// (ConfigError "a" / "b" / "c"). m, n or batch = 0: nothing to do. k = 0: C = beta * C
// (zeros when beta = 0), as BLAS defines it.
// The algorithm is the autotuned one when the cache has it for this problem (same device,
// shape, leading dimensions, batch strides, dtype, transposes and operand alignment),
// otherwise cublasGemmEx (or its strided batched form) with CUBLAS_GEMM_DEFAULT, the call
// torch.matmul makes, so that an untuned product gives torch's bits.
// Calls sharing a handle may run on different streams at once, from any thread: each stream
// gets a workspace of its own (CublasHandle::begin_use), and the handle's lock is held from
// binding the stream to the cuBLAS call.
void gemm(CublasHandle& handle, cudaStream_t stream, const GemmProblem& problem, const void* a,
          const void* b, void* c, float alpha = 1.0f, float beta = 0.0f);

// A call of a worked-out layout: check_gemm_addresses, then the product above with the
// operands in the layout's order and `tf32` for Float32.
void gemm(CublasHandle& handle, cudaStream_t stream, const GemmLayout& layout, const void* a, const void* b,
          void* c, float alpha, float beta, bool tf32);

// Which library call runs a cached algorithm.
enum class GemmBackend : int {
  CublasLt = 0,  // cublasLtMatmul with the stored cublasLtMatmulAlgo_t
  Cublas = 1,    // cublasGemmEx / cublasGemmStridedBatchedEx with CUBLAS_GEMM_DEFAULT
  // inferctx's kernel for 1 to 8 rows (decoding) against an untransposed B: unbatched, B's rows
  // 16-byte aligned and n a multiple of 16 bytes' elements; fp32 partial sums in the stream's
  // cuBLAS workspace, added in a fixed order (cuda/src/gemm_gemv.cu). Only autotune_gemm (or an
  // imported cache entry) chooses it.
  Gemv = 2,
};

struct GemmTuneOptions {
  int max_algorithms = 32;     // candidates asked of cublasLtMatmulAlgoGetHeuristic, 1..256
  int warmup = 3;              // untimed runs of each candidate, >= 0
  int repeats = 7;             // timed batches per candidate (the median counts), >= 1
  double min_batch_ms = 0.25;  // runs per timed batch are chosen to last at least this, > 0
};

struct GemmTuneResult {
  int backend = 0;             // GemmBackend of the winner
  int algo_index = 0;          // 0: cublasGemmEx (the untuned default); i > 0: cuBLASLt's i-th candidate,
                               // or, the last index, inferctx's kernel (backend Gemv)
  std::vector<uint64_t> algo;  // the winner's cublasLtMatmulAlgo_t words (8), empty otherwise
  int algo_id = -1, tile_id = -1, stages_id = -1, splitk = -1;  // its configuration (-1: not cuBLASLt)
  double default_ms = 0.0;     // median time of cublasGemmEx, what gemm runs untuned
  double best_ms = 0.0;        // median time of the winner
  int candidates = 0;          // algorithms tried
  int valid = 0;               // of those, ones that ran and matched cublasGemmEx's result
  int rotated_sets = 1;        // operand copies cycled through so that no run hits in L2
};

// A cuBLASLt algorithm replaces cublasGemmEx (torch.matmul's call, and its bits) only when its
// median time is at least this fraction below cublasGemmEx's: medians of a few batches differ by
// noise of about that size, and a win on noise would give up torch's bits for nothing.
inline constexpr double kTuneMinGain = 0.01;

// Times cublasGemmEx (what gemm runs untuned) and cuBLASLt's candidate algorithms for
// `problem` on operands it allocates and fills with random values (256-byte aligned, laid out
// as the problem says), keeps the fastest whose result matches cublasGemmEx's within the
// dtype's tolerance (cublasGemmEx unless another beats it by kTuneMinGain), and caches it for
// this device. Synchronises `stream`. Needs
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
  std::vector<uint64_t> algo;  // 8 words of cublasLtMatmulAlgo_t for CublasLt, empty for the others
  double time_ms = -1.0;       // median time measured by tune_gemm, -1 when not measured
};

// Autotuned entries (with `tuned_only` false, heuristic ones too), in no particular order.
std::vector<GemmCacheEntry> export_gemm_cache(bool tuned_only = true);

// Adds entries as autotuned ones (replacing any for the same problem) and returns how many
// it took. It skips, without error, entries for a device ordinal that does not exist here,
// whose device_name differs from that device's, or whose cublas_version differs from the
// library loaded now. Malformed entries throw ConfigError (nothing is added then). An
// imported algorithm is checked with cublasLtMatmulAlgoCheck on first use, a Gemv entry against
// the problems that kernel takes; one that fails the check is replaced by the heuristic's choice.
int64_t import_gemm_cache(const std::vector<GemmCacheEntry>& entries);

// The checks import_gemm_cache makes before it takes anything, alone: ConfigError naming the
// first malformed entry ("entry i: ..."); nothing is added to the cache.
void check_gemm_cache(const std::vector<GemmCacheEntry>& entries);

void clear_gemm_cache();
int64_t gemm_cache_size();  // entries of any kind

}  // namespace inferctx

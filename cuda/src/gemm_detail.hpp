// What the GEMM files share, internal to cuda/src: the problem's stored shapes and checks
// (gemm_problem.cpp), the helper kernels (gemm_kernels.cu), the algorithm cache
// (gemm_algo_cache.cpp), running one product (gemm.cpp); the tuner is gemm_tune.cpp, and
// gemm_layout.cpp turns a call's operands into a problem.
//
// Row-major C = op(A) op(B) is, read as column-major memory, C^T = op(B)^T op(A)^T: cuBLASLt
// is given our B as its A and our A as its B, with the transposes unchanged, and the problem
// n x m x k. A matrix stored row-major as r x c with leading dimension ld is, in cuBLASLt's
// column-major terms, a c x r matrix with the same ld.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "inferctx/blas.hpp"
#include "inferctx/gemm.hpp"

namespace inferctx::detail {

constexpr int kMaxAlignment = 256;
constexpr int kAlgoWords = 8;
static_assert(sizeof(cublasLtMatmulAlgo_t) == kAlgoWords * sizeof(uint64_t),
              "cublasLtMatmulAlgo_t is exported as 8 64-bit words");

// ---------------------------------------------------------------------------------------
// The problem (gemm_problem.cpp)

cudaDataType_t data_type(int dtype);
bool uses_tf32(const GemmProblem& p);
cublasComputeType_t compute_type(const GemmProblem& p);

// Stored (row-major) shape of each operand.
struct Stored {
  int64_t rows, cols;
};
inline Stored stored_a(const GemmProblem& p) { return p.trans_a ? Stored{p.k, p.m} : Stored{p.m, p.k}; }
inline Stored stored_b(const GemmProblem& p) { return p.trans_b ? Stored{p.n, p.k} : Stored{p.k, p.n}; }

[[noreturn]] void reject(const char* field, const std::string& message);
std::string str(int64_t v);

// Elements from the first to the last element of a (batched) stored matrix; rejects layouts
// whose span does not fit in 64 bits.
int64_t span_elements(const char* ld_field, const char* stride_field, Stored s, int64_t ld, int64_t batch,
                      int64_t stride, int64_t esize);

// Whether the batch x rows x cols elements of a matrix batch with row stride ld and batch stride
// `stride` are distinct (sufficient condition: sorted by stride, each stride exceeds the span of the
// dimensions with smaller strides; a span past 2^63 counts as overlapping what follows it).
bool matrices_distinct(int64_t batch, int64_t rows, int64_t cols, int64_t ld, int64_t stride);

// TF32 only for Float32, batch strides 0 without a batch: the form cached and run.
GemmProblem normalized(const GemmProblem& p);

// Largest power of two <= 256 dividing the address and, for a batch, the batch stride in bytes.
int alignment_of(const void* ptr, int64_t batch, int64_t stride, int64_t esize);

// ---------------------------------------------------------------------------------------
// Helper kernels (gemm_kernels.cu): C = beta * C for k = 0, and the autotuner's random fill,
// comparison and spin.

struct CompareSums {
  double diff2;  // sum (x - y)^2
  double ref2;   // sum y^2
  unsigned long long nonfinite;
};

void launch_scale(const GemmProblem& p, void* c, float beta, cudaStream_t stream, int device);
void launch_fill(int dtype, void* p, int64_t count, uint64_t seed, cudaStream_t stream, int device);
void launch_compare(const GemmProblem& p, const void* x, const void* y, CompareSums* sums, cudaStream_t stream,
                    int device);
// Keeps the GPU busy for `cycles` clock cycles.
void launch_spin(long long cycles, cudaStream_t stream, int device);
// Blocks for a grid-stride loop over `total` elements: enough to cover them, at least 1, at most 4096.
int grid_for(int64_t total, int threads);

// ---------------------------------------------------------------------------------------
// inferctx's kernel for few rows (gemm_gemv.cu, GemmBackend::Gemv)

constexpr int64_t kGemvMaxRows = 8;

// Whether the kernel takes normalized problem p with B at alignment align_b (batch 1, 1 <= m <=
// kGemvMaxRows, B untransposed with 16-byte aligned rows, n a multiple of 16 bytes' elements) with
// a workspace of `workspace_bytes` for its partial sums.
bool gemv_runs(const GemmProblem& p, int align_b, int64_t workspace_bytes);
// Bytes of fp32 partial sums it needs in the workspace.
size_t gemv_workspace_bytes(const GemmProblem& p);
// C = alpha * op(A) B + beta * C on `stream`, partial sums in `workspace` (>= gemv_workspace_bytes).
void launch_gemv(const GemmProblem& p, const void* a, const void* b, void* c, float alpha, float beta,
                 void* workspace, cudaStream_t stream, int device);

// ---------------------------------------------------------------------------------------
// The algorithm cache (gemm_algo_cache.cpp)

enum class Source : int { Heuristic = 0, Tuned = 1, Imported = 2 };

// Heuristic choices the algorithm cache keeps at most: past it, they are all dropped (made
// again when next needed); tuned and imported ones are never dropped this way.
constexpr size_t kHeuristicEntryLimit = 4096;

struct Key {
  enum Field {
    Device, DTypeF, TransA, TransB, Tf32, M, N, K, Batch, Lda, Ldb, Ldc, StrideA, StrideB, StrideC, AlignA, AlignB,
    AlignC, Count
  };
  int64_t v[Count];
  bool operator==(const Key& o) const { return std::memcmp(v, o.v, sizeof v) == 0; }
};

// `p` normalized (see normalized()).
Key make_key(int device, const GemmProblem& p, int align_a, int align_b, int align_c);

// Everything a call needs once a problem has been seen: the cuBLASLt descriptors (built in
// place, never copied, so no allocation happens on later calls) and the algorithm chosen.
// Immutable once published in the cache.
struct AlgoChoice {
  cublasLtMatmulDescOpaque_t op_storage;
  cublasLtMatrixLayoutOpaque_t lt_a_storage;  // cuBLASLt's A: our B
  cublasLtMatrixLayoutOpaque_t lt_b_storage;  // cuBLASLt's B: our A
  cublasLtMatrixLayoutOpaque_t lt_c_storage;  // C and D
  GemmBackend backend = GemmBackend::CublasLt;
  cublasLtMatmulAlgo_t algo;
  size_t workspace_bytes = 0;
  Source source = Source::Heuristic;
  bool verified = true;
  double time_ms = -1.0;

  cublasLtMatmulDesc_t op() const { return const_cast<cublasLtMatmulDescOpaque_t*>(&op_storage); }
  cublasLtMatrixLayout_t lt_a() const { return const_cast<cublasLtMatrixLayoutOpaque_t*>(&lt_a_storage); }
  cublasLtMatrixLayout_t lt_b() const { return const_cast<cublasLtMatrixLayoutOpaque_t*>(&lt_b_storage); }
  cublasLtMatrixLayout_t lt_c() const { return const_cast<cublasLtMatrixLayoutOpaque_t*>(&lt_c_storage); }
};

// A choice with its descriptors built for the normalized problem `p`; the algorithm is unset.
std::shared_ptr<AlgoChoice> new_choice(const GemmProblem& p, int device);

// The choice gemm uses for a problem seen for the first time (see gemm_algo_cache.cpp).
std::shared_ptr<AlgoChoice> heuristic_choice(const CublasHandle& handle, const GemmProblem& p, int align_a,
                                             int align_b, int align_c);

std::shared_ptr<const AlgoChoice> find_choice(const Key& key);
// Stores `choice` for `key`, replacing any entry (tune_gemm, import_gemm_cache).
void store_choice(const Key& key, std::shared_ptr<const AlgoChoice> choice);
// Stores `choice` for `key` only while the entry there is still `expected` (null: no entry), so
// that a choice worked out from what find_choice gave never replaces one that another thread
// stored meanwhile (a tuned or imported entry); returns the entry in force then, or `choice`
// itself where the key has none (cleared meanwhile: it serves this call without being stored).
std::shared_ptr<const AlgoChoice> store_choice_if(const Key& key, const AlgoChoice* expected,
                                                  std::shared_ptr<const AlgoChoice> choice);

// An imported cuBLASLt algorithm is checked against this library and device once, an imported
// Gemv choice against gemv_runs with the handle's workspace; if the check fails, the
// heuristic's choice takes its place. Returns the entry in force afterwards, which is another
// thread's where it replaced `imported` meanwhile (that one may need its own check).
std::shared_ptr<const AlgoChoice> verify_imported(const CublasHandle& handle, const Key& key, const GemmProblem& p,
                                                  const AlgoChoice& imported);

std::vector<uint64_t> algo_words(const cublasLtMatmulAlgo_t& algo);

// ---------------------------------------------------------------------------------------
// Running one product (gemm.cpp)

cublasStatus_t run_lt(const CublasHandle& handle, cudaStream_t stream, const AlgoChoice& choice,
                      const cublasLtMatmulAlgo_t* algo, const void* a, const void* b, void* c, const float* alpha,
                      const float* beta);

const char* cublas_call_name(const GemmProblem& p);

// cublasGemmEx / cublasGemmStridedBatchedEx of p on the stream the handle is bound to.
cublasStatus_t run_cublas(CublasHandle& handle, const GemmProblem& p, const void* a, const void* b, void* c,
                          const float* alpha, const float* beta);

}  // namespace inferctx::detail

// GEMM through cuBLASLt in row-major terms, the algorithm cache and the autotuner.
//
// Row-major C = op(A) op(B) is, read as column-major memory, C^T = op(B)^T op(A)^T: cuBLASLt
// is given our B as its A and our A as its B, with the transposes unchanged, and the problem
// n x m x k. A matrix stored row-major as r x c with leading dimension ld is, in cuBLASLt's
// column-major terms, a c x r matrix with the same ld.
#include "inferctx/gemm.hpp"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/memory.hpp"
#include "inferctx/pool.hpp"
#include "inferctx/stream.hpp"
#include "elem.cuh"

namespace inferctx {

namespace {

constexpr int kMaxAlignment = 256;
constexpr int kAlgoWords = 8;
static_assert(sizeof(cublasLtMatmulAlgo_t) == kAlgoWords * sizeof(uint64_t),
              "cublasLtMatmulAlgo_t is exported as 8 64-bit words");

// ---------------------------------------------------------------------------------------
// Types

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

// Stored (row-major) shape of each operand.
struct Stored {
  int64_t rows, cols;
};
Stored stored_a(const GemmProblem& p) { return p.trans_a ? Stored{p.k, p.m} : Stored{p.m, p.k}; }
Stored stored_b(const GemmProblem& p) { return p.trans_b ? Stored{p.n, p.k} : Stored{p.k, p.n}; }

// ---------------------------------------------------------------------------------------
// Validation

[[noreturn]] void reject(const char* field, const std::string& message) {
  throw ConfigError(field, std::string(field) + ": " + message);
}

std::string str(int64_t v) { return std::to_string(v); }

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

// Elements from the first to the last element of a (batched) stored matrix; rejects layouts
// whose span does not fit in 64 bits.
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

// Sufficient condition for C's batch x m x n elements to be distinct: sorted by stride, each
// stride exceeds the span of the dimensions with smaller strides.
void check_c_does_not_overlap(const GemmProblem& p) {
  if (p.batch <= 1 || p.m == 0 || p.n == 0) return;
  struct Dim {
    int64_t stride, extent;
  };
  Dim dims[3] = {{1, p.n}, {p.ldc, p.m}, {p.stride_c, p.batch}};
  std::sort(dims, dims + 3, [](const Dim& x, const Dim& y) { return x.stride < y.stride; });
  int64_t span = 0;
  for (const Dim& d : dims) {
    if (d.extent == 1) continue;
    if (d.stride <= span) {
      const int64_t each = (p.m - 1) * p.ldc + p.n;
      reject("stride_c", "got " + str(p.stride_c) + " with batch " + str(p.batch) + ", m " + str(p.m) + ", n " +
                             str(p.n) + ", ldc " + str(p.ldc) +
                             ": the matrices of C would overlap; use stride_c >= " + str(each) +
                             " (the elements one matrix spans)");
    }
    span += d.stride * (d.extent - 1);
  }
}

GemmProblem normalized(const GemmProblem& p) {
  GemmProblem q = p;
  if (q.dtype != static_cast<int>(DType::Float32)) q.tf32 = false;
  if (q.batch <= 1) q.stride_a = q.stride_b = q.stride_c = 0;
  return q;
}

// ---------------------------------------------------------------------------------------
// Device helpers

// Largest power of two <= 256 dividing the address and, for a batch, the batch stride in bytes.
int alignment_of(const void* ptr, int64_t batch, int64_t stride, int64_t esize) {
  uint64_t bits = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr)) | kMaxAlignment;
  if (batch > 1) bits |= static_cast<uint64_t>(stride) * static_cast<uint64_t>(esize);
  return static_cast<int>(bits & (~bits + 1));
}

std::string device_name(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, std::string> names;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = names.find(device);
  if (it != names.end()) return it->second;
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties", device);
  return names.emplace(device, prop.name).first->second;
}

int64_t cublas_lt_version() { return static_cast<int64_t>(cublasLtGetVersion()); }

// ---------------------------------------------------------------------------------------
// Kernels: C = beta * C for k = 0, and the autotuner's random fill, comparison and spin.

using detail::Elem;

// Offset of the i-th element, in row-major order over (batch, m, n), of strided row-major matrices.
__device__ inline int64_t matrix_element(int64_t i, int64_t m, int64_t n, int64_t ld, int64_t stride) {
  const int64_t col = i % n;
  const int64_t row = (i / n) % m;
  const int64_t b = i / (n * m);
  return b * stride + row * ld + col;
}

template <typename T>
__global__ void scale_kernel(T* c, int64_t m, int64_t n, int64_t ldc, int64_t batch, int64_t stride_c, float beta) {
  const int64_t total = batch * m * n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    T* e = c + matrix_element(i, m, n, ldc, stride_c);
    // beta = 0 writes zeros without reading C, so NaN or garbage there does not survive.
    *e = Elem<T>::from_float(beta == 0.0f ? 0.0f : beta * Elem<T>::to_float(*e));
  }
}

__device__ inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform values in [-1, 1) from a counter-based hash: fresh data without a generator state.
template <typename T>
__global__ void fill_random_kernel(T* p, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = mix64(seed ^ mix64(static_cast<uint64_t>(i)));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = Elem<T>::from_float(2.0f * u - 1.0f);
  }
}

struct CompareSums {
  double diff2;  // sum (x - y)^2
  double ref2;   // sum y^2
  unsigned long long nonfinite;
};

template <typename V>
__device__ inline V warp_sum(V v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__global__ void compare_kernel(const T* x, const T* y, int64_t m, int64_t n, int64_t ld, int64_t batch,
                               int64_t stride, CompareSums* out) {
  double d2 = 0.0, r2 = 0.0;
  unsigned long long bad = 0;
  const int64_t total = batch * m * n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = matrix_element(i, m, n, ld, stride);
    const double xv = Elem<T>::to_float(x[at]);
    const double yv = Elem<T>::to_float(y[at]);
    if (!isfinite(xv) || !isfinite(yv)) {
      ++bad;
      continue;
    }
    d2 += (xv - yv) * (xv - yv);
    r2 += yv * yv;
  }
  d2 = warp_sum(d2);
  r2 = warp_sum(r2);
  bad = warp_sum(bad);
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&out->diff2, d2);
    atomicAdd(&out->ref2, r2);
    atomicAdd(&out->nonfinite, bad);
  }
}

// Keeps the GPU busy while the host queues a timed batch, so that launch overhead stays out
// of the measured interval.
__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

int grid_for(int64_t total, int threads) {
  const int64_t blocks = (total + threads - 1) / threads;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 4096));
}

void launch_scale(const GemmProblem& p, void* c, float beta, cudaStream_t stream, int device) {
  const int threads = 256;
  const int grid = grid_for(p.batch * p.m * p.n, threads);
  switch (p.dtype) {
    case 0:
      scale_kernel<float><<<grid, threads, 0, stream>>>(static_cast<float*>(c), p.m, p.n, p.ldc, p.batch, p.stride_c,
                                                        beta);
      break;
    case 1:
      scale_kernel<__half><<<grid, threads, 0, stream>>>(static_cast<__half*>(c), p.m, p.n, p.ldc, p.batch,
                                                         p.stride_c, beta);
      break;
    default:
      scale_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(static_cast<__nv_bfloat16*>(c), p.m, p.n, p.ldc,
                                                                p.batch, p.stride_c, beta);
      break;
  }
  check_cuda(cudaGetLastError(), "scale_kernel<<<>>> (gemm with k = 0)", device);
}

void launch_fill(int dtype, void* p, int64_t count, uint64_t seed, cudaStream_t stream, int device) {
  const int threads = 256;
  const int grid = grid_for(count, threads);
  switch (dtype) {
    case 0: fill_random_kernel<float><<<grid, threads, 0, stream>>>(static_cast<float*>(p), count, seed); break;
    case 1: fill_random_kernel<__half><<<grid, threads, 0, stream>>>(static_cast<__half*>(p), count, seed); break;
    default:
      fill_random_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(static_cast<__nv_bfloat16*>(p), count, seed);
      break;
  }
  check_cuda(cudaGetLastError(), "fill_random_kernel<<<>>>", device);
}

void launch_compare(const GemmProblem& p, const void* x, const void* y, CompareSums* sums, cudaStream_t stream,
                    int device) {
  const int threads = 256;
  const int grid = std::min(grid_for(p.batch * p.m * p.n, threads), 1024);
  switch (p.dtype) {
    case 0:
      compare_kernel<float><<<grid, threads, 0, stream>>>(static_cast<const float*>(x), static_cast<const float*>(y),
                                                          p.m, p.n, p.ldc, p.batch, p.stride_c, sums);
      break;
    case 1:
      compare_kernel<__half><<<grid, threads, 0, stream>>>(static_cast<const __half*>(x),
                                                           static_cast<const __half*>(y), p.m, p.n, p.ldc, p.batch,
                                                           p.stride_c, sums);
      break;
    default:
      compare_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x),
                                                                  static_cast<const __nv_bfloat16*>(y), p.m, p.n,
                                                                  p.ldc, p.batch, p.stride_c, sums);
      break;
  }
  check_cuda(cudaGetLastError(), "compare_kernel<<<>>>", device);
}

// ---------------------------------------------------------------------------------------
// Cache keys and plans

enum class Source : int { Heuristic = 0, Tuned = 1, Imported = 2 };

struct Key {
  enum Field {
    Device, DTypeF, TransA, TransB, Tf32, M, N, K, Batch, Lda, Ldb, Ldc, StrideA, StrideB, StrideC, AlignA, AlignB,
    AlignC, Count
  };
  int64_t v[Count];
  bool operator==(const Key& o) const { return std::memcmp(v, o.v, sizeof v) == 0; }
};

struct KeyHash {
  size_t operator()(const Key& key) const noexcept {
    uint64_t h = 0x84222325cbf29ce4ull;
    for (int64_t x : key.v) {
      h ^= static_cast<uint64_t>(x) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return static_cast<size_t>(h);
  }
};

// `p` normalized (see normalized()).
Key make_key(int device, const GemmProblem& p, int align_a, int align_b, int align_c) {
  Key key;
  key.v[Key::Device] = device;
  key.v[Key::DTypeF] = p.dtype;
  key.v[Key::TransA] = p.trans_a;
  key.v[Key::TransB] = p.trans_b;
  key.v[Key::Tf32] = p.tf32;
  key.v[Key::M] = p.m;
  key.v[Key::N] = p.n;
  key.v[Key::K] = p.k;
  key.v[Key::Batch] = p.batch;
  key.v[Key::Lda] = p.lda;
  key.v[Key::Ldb] = p.ldb;
  key.v[Key::Ldc] = p.ldc;
  key.v[Key::StrideA] = p.stride_a;
  key.v[Key::StrideB] = p.stride_b;
  key.v[Key::StrideC] = p.stride_c;
  key.v[Key::AlignA] = align_a;
  key.v[Key::AlignB] = align_b;
  key.v[Key::AlignC] = align_c;
  return key;
}

GemmProblem problem_of(const Key& key) {
  GemmProblem p;
  p.dtype = static_cast<int>(key.v[Key::DTypeF]);
  p.trans_a = key.v[Key::TransA] != 0;
  p.trans_b = key.v[Key::TransB] != 0;
  p.tf32 = key.v[Key::Tf32] != 0;
  p.m = key.v[Key::M];
  p.n = key.v[Key::N];
  p.k = key.v[Key::K];
  p.batch = key.v[Key::Batch];
  p.lda = key.v[Key::Lda];
  p.ldb = key.v[Key::Ldb];
  p.ldc = key.v[Key::Ldc];
  p.stride_a = key.v[Key::StrideA];
  p.stride_b = key.v[Key::StrideB];
  p.stride_c = key.v[Key::StrideC];
  return p;
}

// Everything a call needs once a problem has been seen: the cuBLASLt descriptors (built in
// place, never copied, so no allocation happens on later calls) and the algorithm.
// Immutable once published in the cache.
struct Plan {
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

void init_layout(cublasLtMatrixLayoutOpaque_t* storage, cudaDataType_t type, Stored s, int64_t ld, int64_t batch,
                 int64_t stride, int device) {
  // Row-major r x c is column-major c x r with the same leading dimension.
  check_cublas(cublasLtMatrixLayoutInit(storage, type, static_cast<uint64_t>(s.cols), static_cast<uint64_t>(s.rows), ld),
               "cublasLtMatrixLayoutInit", device);
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    check_cublas(cublasLtMatrixLayoutSetAttribute(storage, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count),
                 "cublasLtMatrixLayoutSetAttribute(CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT)", device);
    check_cublas(cublasLtMatrixLayoutSetAttribute(storage, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof stride),
                 "cublasLtMatrixLayoutSetAttribute(CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET)", device);
  }
}

// A plan with its descriptors built for the normalized problem `p`; the algorithm is unset.
std::shared_ptr<Plan> new_plan(const GemmProblem& p, int device) {
  auto plan = std::make_shared<Plan>();
  std::memset(&plan->algo, 0, sizeof plan->algo);
  check_cublas(cublasLtMatmulDescInit(&plan->op_storage, compute_type(p), CUDA_R_32F), "cublasLtMatmulDescInit",
               device);
  const int32_t op_lt_a = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t op_lt_b = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_cublas(cublasLtMatmulDescSetAttribute(&plan->op_storage, CUBLASLT_MATMUL_DESC_TRANSA, &op_lt_a, sizeof op_lt_a),
               "cublasLtMatmulDescSetAttribute(CUBLASLT_MATMUL_DESC_TRANSA)", device);
  check_cublas(cublasLtMatmulDescSetAttribute(&plan->op_storage, CUBLASLT_MATMUL_DESC_TRANSB, &op_lt_b, sizeof op_lt_b),
               "cublasLtMatmulDescSetAttribute(CUBLASLT_MATMUL_DESC_TRANSB)", device);
  const cudaDataType_t type = data_type(p.dtype);
  init_layout(&plan->lt_a_storage, type, stored_b(p), p.ldb, p.batch, p.stride_b, device);
  init_layout(&plan->lt_b_storage, type, stored_a(p), p.lda, p.batch, p.stride_a, device);
  init_layout(&plan->lt_c_storage, type, Stored{p.m, p.n}, p.ldc, p.batch, p.stride_c, device);
  return plan;
}

// cuBLASLt's candidates for a plan's problem, best estimate first, keeping those that succeed
// within the handle's workspace. Empty when cuBLASLt has none for this configuration.
std::vector<cublasLtMatmulHeuristicResult_t> heuristic(const CublasHandle& handle, const Plan& plan, int align_a,
                                                       int align_b, int align_c, int count) {
  const int device = handle.device();
  cublasLtMatmulPreferenceOpaque_t pref;
  check_cublas(cublasLtMatmulPreferenceInit(&pref), "cublasLtMatmulPreferenceInit", device);
  const uint64_t workspace = static_cast<uint64_t>(handle.workspace_bytes());
  check_cublas(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                    sizeof workspace),
               "cublasLtMatmulPreferenceSetAttribute(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)", device);
  // cuBLASLt's A is our B and its B our A.
  const uint32_t aligns[4] = {static_cast<uint32_t>(align_b), static_cast<uint32_t>(align_a),
                              static_cast<uint32_t>(align_c), static_cast<uint32_t>(align_c)};
  const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    check_cublas(cublasLtMatmulPreferenceSetAttribute(&pref, attrs[i], &aligns[i], sizeof aligns[i]),
                 "cublasLtMatmulPreferenceSetAttribute(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES)", device);
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(count));
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle.lt(), plan.op(), plan.lt_a(), plan.lt_b(),
                                                               plan.lt_c(), plan.lt_c(), &pref, count,
                                                               results.data(), &returned);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return {};
  check_cublas(status, "cublasLtMatmulAlgoGetHeuristic", device);
  std::vector<cublasLtMatmulHeuristicResult_t> usable;
  for (int i = 0; i < returned; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= workspace) usable.push_back(results[i]);
  }
  return usable;
}

// The plan gemm uses for a problem seen for the first time: cublasGemmEx (or its strided
// batched form), the call torch.matmul makes, so that an untuned product takes the algorithm
// torch's takes and gives its bits. autotune_gemm replaces it with the fastest correct
// candidate, cuBLASLt's included.
std::shared_ptr<Plan> heuristic_plan(const CublasHandle& handle, const GemmProblem& p, int align_a, int align_b,
                                     int align_c) {
  (void)align_a;
  (void)align_b;
  (void)align_c;
  std::shared_ptr<Plan> plan = new_plan(p, handle.device());
  plan->backend = GemmBackend::Cublas;
  plan->source = Source::Heuristic;
  plan->verified = true;
  return plan;
}

struct PlanCache {
  std::mutex mutex;
  std::unordered_map<Key, std::shared_ptr<const Plan>, KeyHash> plans;
};

PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache();  // never destroyed: usable from other statics' destructors
  return *cache;
}

std::shared_ptr<const Plan> find_plan(const Key& key) {
  PlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  auto it = cache.plans.find(key);
  return it == cache.plans.end() ? nullptr : it->second;
}

void store_plan(const Key& key, std::shared_ptr<const Plan> plan) {
  PlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.plans[key] = std::move(plan);
}

// An imported cuBLASLt algorithm is checked against this library and device once; if the
// check fails, the heuristic's choice takes its place.
std::shared_ptr<const Plan> verify_imported(const CublasHandle& handle, const Key& key, const GemmProblem& p,
                                            const Plan& imported) {
  const int device = handle.device();
  std::shared_ptr<Plan> plan = new_plan(p, device);
  cublasLtMatmulHeuristicResult_t check_result;
  std::memset(&check_result, 0, sizeof check_result);
  const cublasStatus_t status = cublasLtMatmulAlgoCheck(handle.lt(), plan->op(), plan->lt_a(), plan->lt_b(),
                                                        plan->lt_c(), plan->lt_c(), &imported.algo, &check_result);
  if (status == CUBLAS_STATUS_SUCCESS &&
      check_result.workspaceSize <= static_cast<size_t>(handle.workspace_bytes())) {
    plan->backend = GemmBackend::CublasLt;
    plan->algo = imported.algo;
    plan->workspace_bytes = check_result.workspaceSize;
    plan->source = Source::Imported;
    plan->time_ms = imported.time_ms;
    plan->verified = true;
  } else {
    plan = heuristic_plan(handle, p, static_cast<int>(key.v[Key::AlignA]), static_cast<int>(key.v[Key::AlignB]),
                          static_cast<int>(key.v[Key::AlignC]));
  }
  std::shared_ptr<const Plan> published = plan;
  store_plan(key, published);
  return published;
}

// ---------------------------------------------------------------------------------------
// Running one product

cublasStatus_t run_lt(const CublasHandle& handle, cudaStream_t stream, const Plan& plan,
                      const cublasLtMatmulAlgo_t* algo, const void* a, const void* b, void* c, const float* alpha,
                      const float* beta) {
  return cublasLtMatmul(handle.lt(), plan.op(), alpha, b, plan.lt_a(), a, plan.lt_b(), beta, c, plan.lt_c(), c,
                        plan.lt_c(), algo, handle.bound_workspace(), static_cast<size_t>(handle.bound_workspace_bytes()),
                        stream);
}

bool fits_int(int64_t v) { return v <= INT_MAX; }

const char* cublas_call_name(const GemmProblem& p) {
  return p.batch > 1 ? "cublasGemmStridedBatchedEx" : "cublasGemmEx";
}

cublasStatus_t run_cublas(CublasHandle& handle, cudaStream_t stream, const GemmProblem& p, const void* a,
                          const void* b, void* c, const float* alpha, const float* beta) {
  (void)stream;  // the handle is bound to it (CublasHandle::begin_use)
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

void check_pointer(const char* field, const void* ptr, const char* what, int64_t rows, int64_t cols) {
  if (ptr == nullptr) {
    reject(field, std::string("null device pointer for ") + what + " (" + str(rows) + " x " + str(cols) + ")");
  }
}

std::vector<uint64_t> algo_words(const cublasLtMatmulAlgo_t& algo) {
  std::vector<uint64_t> words(kAlgoWords);
  std::memcpy(words.data(), &algo, sizeof algo);
  return words;
}

template <typename T>
T algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof value, &written) != CUBLAS_STATUS_SUCCESS) {
    return T{};
  }
  return value;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Relative Frobenius distance allowed between a candidate's result and the default's: both
// accumulate in fp32, so they differ by summation order and the output's rounding.
double tune_tolerance(const GemmProblem& p) {
  switch (p.dtype) {
    case 0: return uses_tf32(p) ? 5e-3 : 1e-4;
    case 1: return 1e-2;
    default: return 2e-2;
  }
}

uint64_t fresh_seed() {
  static std::atomic<uint64_t> counter{0};
  std::random_device device;
  const uint64_t entropy = (static_cast<uint64_t>(device()) << 32) ^ device();
  return entropy ^ (0x9e3779b97f4a7c15ull * ++counter);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Public API

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
  std::shared_ptr<const Plan> plan = find_plan(key);
  if (!plan) {
    std::shared_ptr<const Plan> fresh = heuristic_plan(handle, p, align_a, align_b, align_c);
    store_plan(key, fresh);
    plan = std::move(fresh);
  } else if (!plan->verified) {
    plan = verify_imported(handle, key, p, *plan);
  }

  // A tuned cuBLASLt algorithm that needs more workspace than the stream has bound (none while
  // it is first captured) gives way to cublasGemmEx for this call.
  if (plan->backend == GemmBackend::CublasLt &&
      plan->workspace_bytes <= static_cast<size_t>(handle.bound_workspace_bytes())) {
    const cublasStatus_t status = run_lt(handle, stream, *plan, &plan->algo, a, b, c, &alpha, &beta);
    if (status != CUBLAS_STATUS_NOT_SUPPORTED) {
      check_cublas(status, "cublasLtMatmul", device);
      return;
    }
    // cuBLASLt declined this configuration at run time: cublasGemmEx serves it from now on.
    auto fallback = new_plan(p, device);
    fallback->backend = GemmBackend::Cublas;
    fallback->source = plan->source;
    store_plan(key, std::move(fallback));
  }
  check_cublas(run_cublas(handle, stream, p, a, b, c, &alpha, &beta), cublas_call_name(p), device);
}

GemmTuneResult tune_gemm(CublasHandle& handle, cudaStream_t stream, const GemmProblem& problem,
                         const GemmTuneOptions& options) {
  require_explicit_stream(stream, "tune_gemm");
  validate_gemm(problem);
  if (problem.m < 1 || problem.n < 1 || problem.k < 1 || problem.batch < 1) {
    reject("m", "tuning needs m, n, k and batch >= 1; got m " + str(problem.m) + ", n " + str(problem.n) + ", k " +
                    str(problem.k) + ", batch " + str(problem.batch));
  }
  if (options.max_algorithms < 1 || options.max_algorithms > 256) {
    reject("max_algorithms", "got " + str(options.max_algorithms) + "; valid: 1..256");
  }
  if (options.warmup < 0) reject("warmup", "got " + str(options.warmup) + "; must be >= 0");
  if (options.repeats < 1) reject("repeats", "got " + str(options.repeats) + "; must be >= 1");
  if (!(options.min_batch_ms > 0.0) || !std::isfinite(options.min_batch_ms)) {
    reject("min_batch_ms", "got " + std::to_string(options.min_batch_ms) + "; must be > 0");
  }

  const GemmProblem p = normalized(problem);
  const int device = handle.device();
  CurrentDeviceScope scope(device);
  const int64_t es = dtype_size(p.dtype);
  const int64_t span_a = span_elements("lda", "stride_a", stored_a(p), p.lda, p.batch, p.stride_a, es);
  const int64_t span_b = span_elements("ldb", "stride_b", stored_b(p), p.ldb, p.batch, p.stride_b, es);
  const int64_t span_c = span_elements("ldc", "stride_c", Stored{p.m, p.n}, p.ldc, p.batch, p.stride_c, es);
  const int64_t bytes_ab = (span_a + span_b) * es;
  const int64_t bytes_c = span_c * es;

  // Enough copies of A and B that cycling through them defeats L2, as the inputs of a real
  // model's successive layers would; bounded by a quarter of free memory.
  int l2_bytes = 0, clock_khz = 0;
  check_cuda(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device), "cudaDeviceGetAttribute", device);
  check_cuda(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device), "cudaDeviceGetAttribute", device);
  if (clock_khz <= 0) clock_khz = 2000000;
  int64_t sets = std::max<int64_t>(1, (3 * static_cast<int64_t>(l2_bytes) + bytes_ab - 1) / std::max<int64_t>(bytes_ab, 1));
  sets = std::min<int64_t>(sets, 64);
  const int64_t free_bytes = memory_info(device).free_bytes;
  while (sets > 1 && sets * bytes_ab + 2 * bytes_c > free_bytes / 4) --sets;

  // Temporaries come from the device's stream-ordered pool, on the tuning stream.
  WorkspaceUse use(handle, stream);
  if (use.capturing()) reject("stream", "tune_gemm cannot run while the stream is captured into a CUDA graph; tune before capturing");
  const std::shared_ptr<DevicePool> pool = DevicePool::of(device);
  std::vector<std::shared_ptr<PooledAllocation>> a_sets, b_sets;
  for (int64_t s = 0; s < sets; ++s) {
    a_sets.push_back(pool->allocate(span_a * es, stream));
    b_sets.push_back(pool->allocate(span_b * es, stream));
  }
  const std::shared_ptr<PooledAllocation> c_ref_memory = pool->allocate(bytes_c, stream);
  const std::shared_ptr<PooledAllocation> c_try_memory = pool->allocate(bytes_c, stream);
  const std::shared_ptr<PooledAllocation> sums_memory = pool->allocate(static_cast<int64_t>(sizeof(CompareSums)), stream);
  DeviceAllocation& c_ref = *c_ref_memory;
  DeviceAllocation& c_try = *c_try_memory;
  auto* sums = static_cast<CompareSums*>(sums_memory->data());
  const uint64_t seed = fresh_seed();
  for (int64_t s = 0; s < sets; ++s) {
    launch_fill(p.dtype, a_sets[s]->data(), span_a, seed + 2 * static_cast<uint64_t>(s), stream, device);
    launch_fill(p.dtype, b_sets[s]->data(), span_b, seed + 2 * static_cast<uint64_t>(s) + 1, stream, device);
  }
  const int align_a = alignment_of(a_sets[0]->data(), p.batch, p.stride_a, es);
  const int align_b = alignment_of(b_sets[0]->data(), p.batch, p.stride_b, es);
  const int align_c = alignment_of(c_ref.data(), p.batch, p.stride_c, es);

  struct Candidate {
    GemmBackend backend;
    cublasLtMatmulAlgo_t algo;
    size_t workspace_bytes;
    int index;  // 0: the untuned default; i > 0: the i-th other candidate; -1: cuBLAS
    bool valid;
    int runs;   // per timed batch
    double ms;
  };
  std::shared_ptr<Plan> base = new_plan(p, device);
  const auto first = heuristic(handle, *base, align_a, align_b, align_c, 1);
  const auto listed = heuristic(handle, *base, align_a, align_b, align_c, options.max_algorithms);
  std::vector<Candidate> cands;
  cublasLtMatmulAlgo_t no_algo;
  std::memset(&no_algo, 0, sizeof no_algo);
  if (!first.empty()) {
    cands.push_back({GemmBackend::CublasLt, first[0].algo, first[0].workspaceSize, 0, false, 1, 0.0});
    for (const auto& r : listed) {
      if (std::memcmp(&r.algo, &first[0].algo, sizeof r.algo) == 0) continue;
      cands.push_back({GemmBackend::CublasLt, r.algo, r.workspaceSize, static_cast<int>(cands.size()), false, 1, 0.0});
    }
  }
  // cuBLAS is the untuned default when cuBLASLt has nothing for the problem.
  if (options.include_cublas || first.empty()) {
    cands.push_back({GemmBackend::Cublas, no_algo, 0, -1, false, 1, 0.0});
  }

  const float one = 1.0f, zero = 0.0f;
  auto run = [&](const Candidate& cand, int64_t set, void* out) -> cublasStatus_t {
    const void* a = a_sets[static_cast<size_t>(set)]->data();
    const void* b = b_sets[static_cast<size_t>(set)]->data();
    if (cand.backend == GemmBackend::Cublas) return run_cublas(handle, stream, p, a, b, out, &one, &zero);
    return run_lt(handle, stream, *base, &cand.algo, a, b, out, &one, &zero);
  };
  auto compare = [&](const void* x, const void* y) -> CompareSums {
    check_cuda(cudaMemsetAsync(sums, 0, sizeof(CompareSums), stream), "cudaMemsetAsync", device);
    launch_compare(p, x, y, sums, stream, device);
    CompareSums host;
    check_cuda(cudaMemcpyAsync(&host, sums, sizeof host, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync", device);
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize", device);
    return host;
  };
  // 0xFF bytes are NaN in all three dtypes: an element a candidate fails to write shows up.
  auto poison = [&](void* out) {
    check_cuda(cudaMemsetAsync(out, 0xFF, static_cast<size_t>(bytes_c), stream), "cudaMemsetAsync", device);
  };

  // The reference is what gemm computes untuned.
  poison(c_ref.data());
  check_cublas(run(cands[0], 0, c_ref.data()),
               cands[0].backend == GemmBackend::Cublas ? cublas_call_name(p) : "cublasLtMatmul", device);
  if (compare(c_ref.data(), c_ref.data()).nonfinite != 0) {
    throw_cublas_error(CUBLAS_STATUS_EXECUTION_FAILED,
                       "cublasLtMatmul (tune_gemm: the default algorithm left non-finite values on random inputs)",
                       device);
  }
  const double tolerance = tune_tolerance(p);
  for (Candidate& cand : cands) {
    poison(c_try.data());
    if (run(cand, 0, c_try.data()) != CUBLAS_STATUS_SUCCESS) continue;
    const CompareSums s = compare(c_try.data(), c_ref.data());
    if (s.nonfinite != 0) continue;
    const double error = s.ref2 > 0.0 ? std::sqrt(s.diff2 / s.ref2) : std::sqrt(s.diff2);
    cand.valid = error <= tolerance;
  }

  std::vector<std::unique_ptr<Event>> starts, ends;
  auto events = [&](size_t n) {
    while (starts.size() < n) {
      starts.push_back(std::make_unique<Event>(device, true));
      ends.push_back(std::make_unique<Event>(device, true));
    }
  };
  int64_t rotation = 0;
  // Launching costs the host a few microseconds per run: the spin covers that, so the GPU
  // runs the batch back to back.
  auto timed_batch = [&](const Candidate& cand, size_t slot) -> bool {
    const double spin_us = std::min(20000.0, 8.0 * cand.runs + 20.0);
    spin_kernel<<<1, 1, 0, stream>>>(static_cast<long long>(spin_us * clock_khz / 1000.0));
    check_cuda(cudaGetLastError(), "spin_kernel<<<>>>", device);
    starts[slot]->record(stream);
    for (int r = 0; r < cand.runs; ++r) {
      if (run(cand, rotation++ % sets, c_try.data()) != CUBLAS_STATUS_SUCCESS) return false;
    }
    ends[slot]->record(stream);
    return true;
  };
  auto batch_ms = [&](const Candidate& cand, size_t slot) {
    return static_cast<double>(ends[slot]->elapsed_ms_since(*starts[slot])) / cand.runs;
  };

  // Round 1: every valid candidate, median of `repeats` batches.
  events(static_cast<size_t>(options.repeats));
  for (Candidate& cand : cands) {
    if (!cand.valid) continue;
    for (int w = 0; w < options.warmup && cand.valid; ++w) {
      cand.valid = run(cand, rotation++ % sets, c_try.data()) == CUBLAS_STATUS_SUCCESS;
    }
    cand.runs = 1;
    if (!cand.valid || !timed_batch(cand, 0)) {
      cand.valid = false;
      continue;
    }
    ends[0]->synchronize();
    const double once = std::max(batch_ms(cand, 0), 1e-4);
    cand.runs = static_cast<int>(std::min(1000.0, std::max(1.0, std::ceil(options.min_batch_ms / once))));
    std::vector<double> times;
    for (int r = 0; r < options.repeats && cand.valid; ++r) cand.valid = timed_batch(cand, static_cast<size_t>(r));
    if (!cand.valid) continue;
    ends[static_cast<size_t>(options.repeats - 1)]->synchronize();
    for (int r = 0; r < options.repeats; ++r) times.push_back(batch_ms(cand, static_cast<size_t>(r)));
    cand.ms = median(times);
  }
  int valid = 0;
  for (const Candidate& cand : cands) valid += cand.valid ? 1 : 0;
  if (valid == 0) {
    throw_cublas_error(CUBLAS_STATUS_NOT_SUPPORTED, "cublasLtMatmul (tune_gemm: no candidate algorithm ran correctly)",
                       device);
  }

  // Round 2: the default and the three fastest others, interleaved so that clock and
  // thermal drift fall on all of them alike.
  std::vector<size_t> order;
  for (size_t i = 1; i < cands.size(); ++i) {
    if (cands[i].valid) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return cands[x].ms < cands[y].ms; });
  std::vector<size_t> finalists;
  if (cands[0].valid) finalists.push_back(0);
  for (size_t i = 0; i < order.size() && i < 3; ++i) finalists.push_back(order[i]);
  const int rounds = std::max(options.repeats, 5);
  events(finalists.size() * static_cast<size_t>(rounds));
  std::vector<bool> ran(finalists.size(), true);
  for (int r = 0; r < rounds; ++r) {
    for (size_t f = 0; f < finalists.size(); ++f) {
      if (ran[f]) ran[f] = timed_batch(cands[finalists[f]], static_cast<size_t>(r) * finalists.size() + f);
    }
  }
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize", device);
  size_t winner = finalists.front();
  double best_ms = INFINITY, default_ms = -1.0;
  for (size_t f = 0; f < finalists.size(); ++f) {
    if (!ran[f]) continue;
    std::vector<double> times;
    for (int r = 0; r < rounds; ++r) {
      times.push_back(batch_ms(cands[finalists[f]], static_cast<size_t>(r) * finalists.size() + f));
    }
    const double ms = median(times);
    if (finalists[f] == 0) default_ms = ms;
    if (ms < best_ms) {
      best_ms = ms;
      winner = finalists[f];
    }
  }
  if (!std::isfinite(best_ms)) {
    throw_cublas_error(CUBLAS_STATUS_EXECUTION_FAILED, "cublasLtMatmul (tune_gemm: timing runs failed)", device);
  }

  const Candidate& win = cands[winner];
  std::shared_ptr<Plan> tuned = new_plan(p, device);
  tuned->backend = win.backend;
  tuned->algo = win.algo;
  tuned->workspace_bytes = win.workspace_bytes;
  tuned->source = Source::Tuned;
  tuned->time_ms = best_ms;
  tuned->verified = true;
  store_plan(make_key(device, p, align_a, align_b, align_c), std::move(tuned));

  GemmTuneResult result;
  result.backend = static_cast<int>(win.backend);
  result.algo_index = win.index;
  if (win.backend == GemmBackend::CublasLt) {
    result.algo = algo_words(win.algo);
    result.algo_id = algo_config<int32_t>(win.algo, CUBLASLT_ALGO_CONFIG_ID);
    result.tile_id = static_cast<int>(algo_config<uint32_t>(win.algo, CUBLASLT_ALGO_CONFIG_TILE_ID));
    result.stages_id = static_cast<int>(algo_config<uint32_t>(win.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID));
    result.splitk = algo_config<int32_t>(win.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  }
  result.default_ms = default_ms;
  result.best_ms = best_ms;
  result.candidates = static_cast<int>(cands.size());
  result.valid = valid;
  result.rotated_sets = static_cast<int>(sets);
  return result;
}

std::vector<GemmCacheEntry> export_gemm_cache(bool tuned_only) {
  std::vector<std::pair<Key, std::shared_ptr<const Plan>>> snapshot;
  {
    PlanCache& cache = plan_cache();
    std::lock_guard<std::mutex> lock(cache.mutex);
    snapshot.assign(cache.plans.begin(), cache.plans.end());
  }
  std::vector<GemmCacheEntry> entries;
  for (const auto& [key, plan] : snapshot) {
    if (tuned_only && plan->source == Source::Heuristic) continue;
    GemmCacheEntry e;
    e.device = static_cast<int>(key.v[Key::Device]);
    e.device_name = device_name(e.device);
    e.cublas_version = cublas_lt_version();
    e.problem = problem_of(key);
    e.align_a = static_cast<int>(key.v[Key::AlignA]);
    e.align_b = static_cast<int>(key.v[Key::AlignB]);
    e.align_c = static_cast<int>(key.v[Key::AlignC]);
    e.backend = static_cast<int>(plan->backend);
    if (plan->backend == GemmBackend::CublasLt) e.algo = algo_words(plan->algo);
    e.time_ms = plan->time_ms;
    entries.push_back(std::move(e));
  }
  return entries;
}

int64_t import_gemm_cache(const std::vector<GemmCacheEntry>& entries) {
  for (const GemmCacheEntry& e : entries) {
    validate_gemm(e.problem);
    if (e.problem.m < 1 || e.problem.n < 1 || e.problem.k < 1 || e.problem.batch < 1) {
      reject("problem", "a cache entry needs m, n, k and batch >= 1; got m " + str(e.problem.m) + ", n " +
                            str(e.problem.n) + ", k " + str(e.problem.k) + ", batch " + str(e.problem.batch));
    }
    if (e.device < 0) reject("device", "got " + str(e.device) + "; device ordinals are >= 0");
    if (e.backend != static_cast<int>(GemmBackend::CublasLt) && e.backend != static_cast<int>(GemmBackend::Cublas)) {
      reject("backend", "got " + str(e.backend) + "; valid: 0 (cublasLt), 1 (cublas)");
    }
    if (e.backend == static_cast<int>(GemmBackend::CublasLt) && e.algo.size() != kAlgoWords) {
      reject("algo", "got " + str(static_cast<int64_t>(e.algo.size())) + " words; a cuBLASLt algorithm has 8");
    }
    const std::pair<const char*, int> aligns[3] = {{"align_a", e.align_a}, {"align_b", e.align_b}, {"align_c", e.align_c}};
    for (const auto& [field, value] : aligns) {
      if (value < 1 || value > kMaxAlignment || (value & (value - 1)) != 0) {
        reject(field, "got " + str(value) + "; an alignment is a power of two from 1 to 256");
      }
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  const int64_t version = cublas_lt_version();
  int64_t accepted = 0;
  for (const GemmCacheEntry& e : entries) {
    if (e.device >= count || e.cublas_version != version || e.device_name != device_name(e.device)) continue;
    const GemmProblem p = normalized(e.problem);
    std::shared_ptr<Plan> plan = new_plan(p, e.device);
    plan->backend = static_cast<GemmBackend>(e.backend);
    if (plan->backend == GemmBackend::CublasLt) std::memcpy(&plan->algo, e.algo.data(), sizeof plan->algo);
    plan->source = Source::Imported;
    plan->time_ms = e.time_ms;
    plan->verified = plan->backend == GemmBackend::Cublas;
    store_plan(make_key(e.device, p, e.align_a, e.align_b, e.align_c), std::move(plan));
    ++accepted;
  }
  return accepted;
}

void clear_gemm_cache() {
  PlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.plans.clear();
}

int64_t gemm_cache_size() {
  PlanCache& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  return static_cast<int64_t>(cache.plans.size());
}

}  // namespace inferctx

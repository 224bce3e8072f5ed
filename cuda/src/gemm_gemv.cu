// inferctx's own kernel for products with few rows (decoding: one to eight tokens against a
// weight matrix), an autotuner candidate beside cuBLAS's. Memory-bound: each element of B is
// read once, with 16-byte loads, by a grid of (column tile, k chunk) blocks wide enough to keep
// the device's memory busy; each block sums its chunk in fp32 and writes one partial row per row
// of A to the stream's cuBLAS workspace; a second kernel adds the chunks' partials in a fixed
// order and applies alpha and beta. The result is the same bits on every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "inferctx/cuda_check.hpp"
#include "inferctx/gemm.hpp"
#include "dtype_dispatch.hpp"
#include "elem.cuh"
#include "gemm_detail.hpp"

namespace inferctx::detail {

namespace {

constexpr int kGemvThreads = 256;  // 8 warps: the lanes span a column tile, the warps a k chunk
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr int64_t kGemvChunk = 256;  // rows of B per block

template <typename T>
struct GemvShape {
  static constexpr int V = 16 / static_cast<int>(sizeof(T));  // columns per lane: one 16-byte load
  static constexpr int TN = 32 * V;                           // columns per block
};

// The V elements of one 16-byte load, widened to float.
template <typename T>
__device__ __forceinline__ void widen(const uint4& raw, float* out) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int v = 0; v < GemvShape<T>::V; ++v) out[v] = Elem<T>::to_float(e[v]);
}

template <typename T, int M>
__device__ __forceinline__ void accumulate(float (&acc)[M][GemvShape<T>::V], const uint4& raw,
                                           const float (*a_s)[kGemvChunk], int kk) {
  constexpr int V = GemvShape<T>::V;
  float bv[V];
  widen<T>(raw, bv);
#pragma unroll
  for (int i = 0; i < M; ++i) {
    const float av = a_s[i][kk];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[i][v] = fmaf(av, bv[v], acc[i][v]);
  }
}

// Block (x: column tile, y: k chunk). partial[(y * m + i) * n + col] = sum over the chunk's rows
// kk of op(A)[i][kk] * B[kk][col], for i < m (M >= m rows are computed, the rest of A read as 0).
template <typename T, int M>
__global__ void __launch_bounds__(kGemvThreads)
gemv_partial_kernel(const T* __restrict__ a, const T* __restrict__ b, float* __restrict__ partial, int m, int64_t n,
                    int64_t k, int64_t lda, int64_t ldb, bool trans_a) {
  constexpr int V = GemvShape<T>::V;
  constexpr int TN = GemvShape<T>::TN;
  __shared__ float a_s[M][kGemvChunk];
  __shared__ float red[kGemvWarps / 2][M][TN];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int64_t k0 = static_cast<int64_t>(blockIdx.y) * kGemvChunk;
  const int kc = static_cast<int>(k - k0 < kGemvChunk ? k - k0 : kGemvChunk);

  for (int idx = static_cast<int>(threadIdx.x); idx < M * kGemvChunk; idx += kGemvThreads) {
    const int i = idx / static_cast<int>(kGemvChunk);
    const int kk = idx % static_cast<int>(kGemvChunk);
    float v = 0.0f;
    if (i < m && kk < kc) v = Elem<T>::to_float(trans_a ? a[(k0 + kk) * lda + i] : a[i * lda + k0 + kk]);
    a_s[i][kk] = v;
  }
  __syncthreads();

  float acc[M][V];
#pragma unroll
  for (int i = 0; i < M; ++i) {
#pragma unroll
    for (int v = 0; v < V; ++v) acc[i][v] = 0.0f;
  }
  const int64_t col = static_cast<int64_t>(blockIdx.x) * TN + lane * V;
  if (col < n) {
    const T* column = b + k0 * ldb + col;
    int kk = warp;
    // Four rows in flight per lane, then the rest one at a time.
    for (; kk + 3 * kGemvWarps < kc; kk += 4 * kGemvWarps) {
      uint4 r[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        r[u] = __ldg(reinterpret_cast<const uint4*>(column + static_cast<int64_t>(kk + u * kGemvWarps) * ldb));
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) accumulate<T, M>(acc, r[u], a_s, kk + u * kGemvWarps);
    }
    for (; kk < kc; kk += kGemvWarps) {
      const uint4 r = __ldg(reinterpret_cast<const uint4*>(column + static_cast<int64_t>(kk) * ldb));
      accumulate<T, M>(acc, r, a_s, kk);
    }
  }

  // The warps' sums, added pairwise in a fixed order (4 + 4, 2 + 2, 1 + 1).
#pragma unroll
  for (int half = kGemvWarps / 2; half >= 1; half >>= 1) {
    if (warp >= half && warp < 2 * half) {
#pragma unroll
      for (int i = 0; i < M; ++i) {
#pragma unroll
        for (int v = 0; v < V; ++v) red[warp - half][i][lane * V + v] = acc[i][v];
      }
    }
    __syncthreads();
    if (warp < half) {
#pragma unroll
      for (int i = 0; i < M; ++i) {
#pragma unroll
        for (int v = 0; v < V; ++v) acc[i][v] += red[warp][i][lane * V + v];
      }
    }
    __syncthreads();
  }
  if (warp == 0 && col < n) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      if (i >= m) break;
      float* row = partial + (static_cast<int64_t>(blockIdx.y) * m + i) * n + col;
#pragma unroll
      for (int v = 0; v < V; v += 4) {
        *reinterpret_cast<float4*>(row + v) = make_float4(acc[i][v], acc[i][v + 1], acc[i][v + 2], acc[i][v + 3]);
      }
    }
  }
}

// C[i][j] = alpha * (sum over the chunks, in order) + beta * C[i][j]; C is not read when beta
// is 0, as BLAS defines it.
template <typename T>
__global__ void gemv_finish_kernel(const float* __restrict__ partial, T* __restrict__ c, int m, int64_t n,
                                   int64_t ldc, int chunks, float alpha, float beta) {
  const int64_t total = static_cast<int64_t>(m) * n;  // also one chunk's partial sums
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int q = 0; q < chunks; ++q) s += partial[q * total + idx];
    const int64_t i = idx / n;
    const int64_t j = idx - i * n;
    T* e = c + i * ldc + j;
    float r = alpha * s;
    if (beta != 0.0f) r = fmaf(beta, Elem<T>::to_float(*e), r);
    *e = Elem<T>::from_float(r);
  }
}

int64_t gemv_chunks(const GemmProblem& p) { return (p.k + kGemvChunk - 1) / kGemvChunk; }

template <typename T, int M>
void launch_partial(const GemmProblem& p, const void* a, const void* b, float* partial, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.n + GemvShape<T>::TN - 1) / GemvShape<T>::TN),
                  static_cast<unsigned>(gemv_chunks(p)));
  gemv_partial_kernel<T, M><<<grid, kGemvThreads, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                                               partial, static_cast<int>(p.m), p.n, p.k, p.lda,
                                                               p.ldb, p.trans_a);
}

}  // namespace

bool gemv_runs(const GemmProblem& p, int align_b, int64_t workspace_bytes) {
  if (p.dtype < static_cast<int>(DType::Float32) || p.dtype > static_cast<int>(DType::BFloat16)) return false;
  const int64_t es = dtype_size(p.dtype);
  const int64_t per_load = 16 / es;  // GemvShape<T>::V
  return p.batch == 1 && p.m >= 1 && p.m <= kGemvMaxRows && p.k >= 1 && p.n >= 1 && !p.trans_b &&
         p.n % per_load == 0 && (p.ldb * es) % 16 == 0 && align_b >= 16 && gemv_chunks(p) <= 65535 &&
         (p.n + 32 * per_load - 1) / (32 * per_load) <= 0x7fffffff &&
         gemv_workspace_bytes(p) <= static_cast<size_t>(workspace_bytes);
}

size_t gemv_workspace_bytes(const GemmProblem& p) {
  return static_cast<size_t>(gemv_chunks(p)) * static_cast<size_t>(p.m) * static_cast<size_t>(p.n) * sizeof(float);
}

void launch_gemv(const GemmProblem& p, const void* a, const void* b, void* c, float alpha, float beta,
                 void* workspace, cudaStream_t stream, int device) {
  auto* partial = static_cast<float*>(workspace);
  with_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (p.m <= 1) {
      launch_partial<T, 1>(p, a, b, partial, stream);
    } else if (p.m <= 2) {
      launch_partial<T, 2>(p, a, b, partial, stream);
    } else if (p.m <= 4) {
      launch_partial<T, 4>(p, a, b, partial, stream);
    } else {
      launch_partial<T, 8>(p, a, b, partial, stream);
    }
    check_cuda(cudaGetLastError(), "gemv_partial_kernel<<<>>>", device);
    const int threads = 256;
    gemv_finish_kernel<T><<<grid_for(p.m * p.n, threads), threads, 0, stream>>>(
        partial, static_cast<T*>(c), static_cast<int>(p.m), p.n, p.ldc, static_cast<int>(gemv_chunks(p)), alpha, beta);
  });
  check_cuda(cudaGetLastError(), "gemv_finish_kernel<<<>>>", device);
}

}  // namespace inferctx::detail

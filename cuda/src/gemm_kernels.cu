// GEMM's helper kernels: C = beta * C for k = 0, and the autotuner's random fill, comparison
// and spin.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "inferctx/cuda_check.hpp"
#include "inferctx/gemm.hpp"
#include "dtype_dispatch.hpp"
#include "elem.cuh"
#include "gemm_detail.hpp"

namespace inferctx::detail {

namespace {

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

}  // namespace

int grid_for(int64_t total, int threads) {
  const int64_t blocks = (total + threads - 1) / threads;
  return static_cast<int>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 4096));
}

void launch_scale(const GemmProblem& p, void* c, float beta, cudaStream_t stream, int device) {
  const int threads = 256;
  const int grid = grid_for(p.batch * p.m * p.n, threads);
  with_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    scale_kernel<T><<<grid, threads, 0, stream>>>(static_cast<T*>(c), p.m, p.n, p.ldc, p.batch, p.stride_c, beta);
  });
  check_cuda(cudaGetLastError(), "scale_kernel<<<>>> (gemm with k = 0)", device);
}

void launch_fill(int dtype, void* p, int64_t count, uint64_t seed, cudaStream_t stream, int device) {
  const int threads = 256;
  const int grid = grid_for(count, threads);
  with_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    fill_random_kernel<T><<<grid, threads, 0, stream>>>(static_cast<T*>(p), count, seed);
  });
  check_cuda(cudaGetLastError(), "fill_random_kernel<<<>>>", device);
}

void launch_compare(const GemmProblem& p, const void* x, const void* y, CompareSums* sums, cudaStream_t stream,
                    int device) {
  const int threads = 256;
  const int grid = std::min(grid_for(p.batch * p.m * p.n, threads), 1024);
  with_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    compare_kernel<T><<<grid, threads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(y), p.m, p.n,
                                                    p.ldc, p.batch, p.stride_c, sums);
  });
  check_cuda(cudaGetLastError(), "compare_kernel<<<>>>", device);
}

void launch_spin(long long cycles, cudaStream_t stream, int device) {
  spin_kernel<<<1, 1, 0, stream>>>(cycles);
  check_cuda(cudaGetLastError(), "spin_kernel<<<>>>", device);
}

}  // namespace inferctx::detail

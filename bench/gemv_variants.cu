// Design study for the few-row GEMM kernel (cuda/src/gemm_gemv.cu): variants of a CUDA-core
// GEMM for 1 or 8 rows of A, bf16 with fp32 sums, each timed against cublasGemmEx (the call
// torch.matmul and an untuned inferctx.gemm make) on the decoding shapes of bench/gemm.py.
//   * "chunk C U u fused=false": the shipped design. Blocks of (256-column tile, C rows of k),
//     u 16-byte loads in flight per lane, partial sums to a workspace, a second kernel adding
//     them in order. "fused=true": the last block of a column tile adds them instead (a counter
//     per tile), one launch.
//   * "whole-k T thr N cols U u": no split of k across blocks; T threads own N columns over all
//     of k, sums reduced by shuffles and shared memory in a fixed order.
// Every variant's result is compared with cuBLAS's (relative Frobenius difference). Figures
// and conclusions: docs/benchmarks.md ("The few-row kernel").
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -I<cublas include> bench/gemv_variants.cu -L<cublas lib> \
//        -l:libcublas.so.13 -o /tmp/gemv_variants && /tmp/gemv_variants
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s line %d\n", #x, cudaGetErrorString(e_), __LINE__); exit(1);} } while (0)
#define CB(x) do { cublasStatus_t s_ = (x); if (s_ != CUBLAS_STATUS_SUCCESS) { printf("%s: %d\n", #x, (int)s_); exit(1);} } while (0)

using T = __nv_bfloat16;
constexpr int V = 8, TN = 256;

template <int M, int THREADS, int CHUNK, int U, bool FUSED>
__global__ void __launch_bounds__(THREADS) partial_kernel(const T* __restrict__ a, const T* __restrict__ b, float* __restrict__ partial,
                                                         unsigned* __restrict__ counters, T* __restrict__ c, int m, int64_t n, int64_t k) {
  constexpr int W = THREADS / 32;
  __shared__ float a_s[M][CHUNK];
  __shared__ float red[W / 2][M][TN];
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t k0 = (int64_t)blockIdx.y * CHUNK;
  const int kc = (int)(k - k0 < CHUNK ? k - k0 : CHUNK);
  for (int idx = threadIdx.x; idx < M * CHUNK; idx += THREADS) {
    const int i = idx / CHUNK, kk = idx % CHUNK;
    a_s[i][kk] = (i < m && kk < kc) ? __bfloat162float(a[i * k + k0 + kk]) : 0.f;
  }
  __syncthreads();
  float acc[M][V];
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int v = 0; v < V; ++v) acc[i][v] = 0.f;
  const int64_t col = (int64_t)blockIdx.x * TN + lane * V;
  const T* column = b + k0 * n + col;
  int kk = warp;
  for (; kk + (U - 1) * W < kc; kk += U * W) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = __ldg(reinterpret_cast<const uint4*>(column + (int64_t)(kk + u * W) * n));
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const T* e = reinterpret_cast<const T*>(&r[u]);
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float av = a_s[i][kk + u * W];
#pragma unroll
        for (int v = 0; v < V; ++v) acc[i][v] = fmaf(av, __bfloat162float(e[v]), acc[i][v]);
      }
    }
  }
  for (; kk < kc; kk += W) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(column + (int64_t)kk * n));
    const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
      for (int v = 0; v < V; ++v) acc[i][v] = fmaf(a_s[i][kk], __bfloat162float(e[v]), acc[i][v]);
  }
#pragma unroll
  for (int half = W / 2; half >= 1; half >>= 1) {
    if (warp >= half && warp < 2 * half) {
#pragma unroll
      for (int i = 0; i < M; ++i)
#pragma unroll
        for (int v = 0; v < V; ++v) red[warp - half][i][v * 32 + lane] = acc[i][v];
    }
    __syncthreads();
    if (warp < half) {
#pragma unroll
      for (int i = 0; i < M; ++i)
#pragma unroll
        for (int v = 0; v < V; ++v) acc[i][v] += red[warp][i][v * 32 + lane];
    }
    __syncthreads();
  }
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      if (i >= m) break;
      float* row = partial + ((int64_t)blockIdx.y * m + i) * n + col;
#pragma unroll
      for (int v = 0; v < V; v += 4) *reinterpret_cast<float4*>(row + v) = make_float4(acc[i][v], acc[i][v + 1], acc[i][v + 2], acc[i][v + 3]);
    }
  }
  if (!FUSED) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < m * TN; idx += THREADS) {
    const int i = idx / TN, j = idx % TN;
    const int64_t cj = (int64_t)blockIdx.x * TN + j;
    float s = 0.f;
    for (int q = 0; q < (int)gridDim.y; ++q) s += __ldcg(&partial[((int64_t)q * m + i) * n + cj]);
    c[i * n + cj] = __float2bfloat16_rn(s);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

__global__ void finish_kernel(const float* __restrict__ partial, T* __restrict__ c, int m, int64_t n, int chunks) {
  const int64_t total = (int64_t)m * n;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total; idx += (int64_t)gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int q = 0; q < chunks; ++q) s += partial[q * total + idx];
    c[idx] = __float2bfloat16_rn(s);
  }
}

struct Bufs {
  std::vector<T*> a, b;
  T* c;
  float* partial;
  unsigned* counters;
  int sets;
};

template <int M, int THREADS, int CHUNK, int U, bool FUSED>
void launch(const Bufs& B, int set, int m, int64_t n, int64_t k, cudaStream_t s) {
  dim3 grid((unsigned)(n / TN), (unsigned)((k + CHUNK - 1) / CHUNK));
  partial_kernel<M, THREADS, CHUNK, U, FUSED><<<grid, THREADS, 0, s>>>(B.a[set], B.b[set], B.partial, B.counters, B.c, m, n, k);
  if (!FUSED) {
    int total = m * n;
    finish_kernel<<<std::min(4096, (total + 255) / 256), 256, 0, s>>>(B.partial, B.c, m, n, (int)grid.y);
  }
}


// No split across blocks: each block owns TNB columns over all of k; threads split k, sums
// reduced in a fixed order (shuffles, then warps through shared memory). One kernel, no workspace.
template <int M, int THREADS, int TNB, int U>
__global__ void __launch_bounds__(THREADS) whole_k_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c,
                                                         int m, int64_t n, int64_t k) {
  constexpr int L = TNB / V;           // lanes per row
  constexpr int RW = 32 / L;           // rows per warp per load
  constexpr int W = THREADS / 32;
  constexpr int R = THREADS / L;       // rows per block step
  __shared__ float red[W][M][TNB];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int cg = lane % L;
  const int row0 = warp * RW + lane / L;
  const int64_t col = (int64_t)blockIdx.x * TNB + cg * V;
  float acc[M][V];
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int v = 0; v < V; ++v) acc[i][v] = 0.f;
  const T* column = b + col;
  int64_t kk = row0;
  for (; kk + (int64_t)(U - 1) * R < k; kk += (int64_t)U * R) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = __ldg(reinterpret_cast<const uint4*>(column + (kk + u * R) * n));
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const T* e = reinterpret_cast<const T*>(&r[u]);
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float av = i < m ? __bfloat162float(a[i * k + kk + u * R]) : 0.f;
#pragma unroll
        for (int v = 0; v < V; ++v) acc[i][v] = fmaf(av, __bfloat162float(e[v]), acc[i][v]);
      }
    }
  }
  for (; kk < k; kk += R) {
    const uint4 r = __ldg(reinterpret_cast<const uint4*>(column + kk * n));
    const T* e = reinterpret_cast<const T*>(&r);
#pragma unroll
    for (int i = 0; i < M; ++i) {
      const float av = i < m ? __bfloat162float(a[i * k + kk]) : 0.f;
#pragma unroll
      for (int v = 0; v < V; ++v) acc[i][v] = fmaf(av, __bfloat162float(e[v]), acc[i][v]);
    }
  }
#pragma unroll
  for (int off = 16; off >= L; off >>= 1) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
      for (int v = 0; v < V; ++v) acc[i][v] += __shfl_xor_sync(0xffffffffu, acc[i][v], off);
  }
  if (lane < L) {
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
      for (int v = 0; v < V; ++v) red[warp][i][cg * V + v] = acc[i][v];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < m * TNB; idx += THREADS) {
    const int i = idx / TNB, j = idx % TNB;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) s += red[w][i][j];
    c[i * n + (int64_t)blockIdx.x * TNB + j] = __float2bfloat16_rn(s);
  }
}

template <int M, int THREADS, int TNB, int U>
void launch_whole(const Bufs& B, int set, int m, int64_t n, int64_t k, cudaStream_t s) {
  whole_k_kernel<M, THREADS, TNB, U><<<(unsigned)(n / TNB), THREADS, 0, s>>>(B.a[set], B.b[set], B.c, m, n, k);
}

__global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}

template <typename F>
float time_us(F f, int sets, cudaStream_t s) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 10; ++i) f(i % sets);
  std::vector<float> t;
  const int runs = 100;
  for (int rep = 0; rep < 9; ++rep) {
    spin<<<1, 1, 0, s>>>(2000000);
    CK(cudaEventRecord(e0, s));
    for (int r = 0; r < runs; ++r) f(r % sets);
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms * 1000.f / runs);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

__global__ void fill(T* p, int64_t count, unsigned seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x) {
    unsigned x = (unsigned)i * 2654435761u ^ seed;
    x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    p[i] = __float2bfloat16_rn(((x & 0xffff) / 32768.f) - 1.f);
  }
}

double rel_diff(const T* x, const T* y, int64_t count) {
  std::vector<T> hx(count), hy(count);
  CK(cudaMemcpy(hx.data(), x, count * sizeof(T), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hy.data(), y, count * sizeof(T), cudaMemcpyDeviceToHost));
  double d = 0, r = 0;
  for (int64_t i = 0; i < count; ++i) {
    double a = __bfloat162float(hx[i]), b = __bfloat162float(hy[i]);
    d += (a - b) * (a - b);
    r += b * b;
  }
  return std::sqrt(d / r);
}

template <int M>
void run_shape(cublasHandle_t h, int m, int64_t n, int64_t k, cudaStream_t s) {
  Bufs B;
  const int64_t bbytes = k * n * 2;
  B.sets = (int)std::max<int64_t>(1, std::min<int64_t>(16, (int64_t)(125.0 * 1048576 / bbytes) + 1));
  for (int i = 0; i < B.sets; ++i) {
    T *pa, *pb;
    CK(cudaMalloc(&pa, m * k * 2));
    CK(cudaMalloc(&pb, bbytes));
    fill<<<1024, 256>>>(pa, m * k, 17u + i);
    fill<<<1024, 256>>>(pb, k * n, 91u + i);
    B.a.push_back(pa);
    B.b.push_back(pb);
  }
  T* cref;
  CK(cudaMalloc(&B.c, m * n * 2));
  CK(cudaMalloc(&cref, m * n * 2));
  CK(cudaMalloc(&B.partial, (size_t)((k + 31) / 32) * m * n * 4));
  CK(cudaMalloc(&B.counters, 65536 * 4));
  CK(cudaMemset(B.counters, 0, 65536 * 4));
  CK(cudaDeviceSynchronize());
  const float one = 1.f, zero = 0.f;
  auto cub = [&](int set) {
    CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, (int)n, m, (int)k, &one, B.b[set], CUDA_R_16BF, (int)n, B.a[set], CUDA_R_16BF,
                    (int)k, &zero, cref, CUDA_R_16BF, (int)n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  const float tc = time_us(cub, B.sets, s);
  cub(0);
  const double gb = bbytes / 1e3;
  printf("m=%d n=%lld k=%lld sets=%d  cublas %7.2f us (%6.0f GB/s)\n", m, (long long)n, (long long)k, B.sets, tc, gb / tc);
  auto one_variant = [&](const char* name, auto fn) {
    const float t = time_us(fn, B.sets, s);
    // The output is poisoned (0xFFFF is a bf16 NaN) before the checked call: wherever a variant
    // writes nothing, B.c would still hold an earlier variant's correct result.
    CK(cudaMemsetAsync(B.c, 0xFF, (size_t)m * n * sizeof(T), s));
    fn(0);
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    printf("   %-28s %7.2f us (%6.0f GB/s) %.3fx  diff %.1e\n", name, t, gb / t, t / tc, rel_diff(B.c, cref, m * n));
  };
#define VAR(TH, CH, U, F) one_variant(#TH " thr chunk " #CH " U" #U " fused=" #F, [&](int set) { launch<M, TH, CH, U, F>(B, set, m, n, k, s); })
  VAR(256, 256, 4, false);
  VAR(256, 256, 8, false);
  VAR(256, 128, 4, false);
  VAR(256, 256, 4, true);
  VAR(256, 256, 8, true);
  VAR(256, 128, 4, true);
  VAR(256, 128, 8, true);
  VAR(256, 64, 8, true);
  VAR(128, 128, 8, true);
  VAR(128, 64, 4, true);
  VAR(128, 256, 8, true);
#define WHOLE(TH, TNB, U) one_variant("whole-k " #TH " thr " #TNB " cols U" #U, [&](int set) { launch_whole<M, TH, TNB, U>(B, set, m, n, k, s); })
  if constexpr (M == 1) {
    WHOLE(1024, 32, 4);
    WHOLE(1024, 64, 4);
    WHOLE(1024, 16, 4);
    WHOLE(512, 32, 8);
    WHOLE(512, 64, 8);
    WHOLE(512, 16, 8);
    WHOLE(256, 32, 8);
  } else {
    WHOLE(512, 32, 4);
    WHOLE(512, 64, 4);
    WHOLE(512, 16, 4);
    WHOLE(256, 32, 8);
    WHOLE(256, 64, 4);
  }
  if constexpr (M == 1) {
    VAR(256, 512, 8, false);
    VAR(256, 512, 8, true);
    VAR(512, 256, 4, true);
    VAR(512, 512, 8, true);
    VAR(256, 1024, 8, true);
  }
  for (auto p : B.a) cudaFree(p);
  for (auto p : B.b) cudaFree(p);
  cudaFree(B.c); cudaFree(cref); cudaFree(B.partial); cudaFree(B.counters);
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasHandle_t h;
  CB(cublasCreate(&h));
  CB(cublasSetStream(h, s));
  const int64_t shapes[][2] = {{4096, 4096}, {14336, 4096}, {4096, 14336}, {8192, 8192}};  // {n, k}
  for (auto& sh : shapes) {
    run_shape<1>(h, 1, sh[0], sh[1], s);
    run_shape<8>(h, 8, sh[0], sh[1], s);
  }
  return 0;
}

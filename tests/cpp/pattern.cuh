// A byte pattern that depends on each byte's index and a seed, written and checked on the GPU:
// for whole-workspace contents checks (gigabytes) without copying them to the host.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "inferctx/cuda_check.hpp"
#include "inferctx/memory.hpp"

namespace test_pattern {

__host__ __device__ inline unsigned char byte_at(int64_t i, uint32_t seed) {
  uint64_t x = static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return static_cast<unsigned char>(x >> 56);
}

__device__ inline unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits `spin_ns` (0: not at all), then writes the pattern over [p, p + n).
__global__ void fill_kernel(unsigned char* p, int64_t n, uint32_t seed, unsigned long long spin_ns) {
  if (spin_ns != 0) {
    const unsigned long long start = global_ns();
    while (global_ns() - start < spin_ns) {
    }
  }
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = byte_at(i, seed);
}

__global__ void count_kernel(const unsigned char* p, int64_t n, uint32_t seed, unsigned long long* bad) {
  unsigned long long mine = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    mine += p[i] != byte_at(i, seed);
  if (mine != 0) atomicAdd(bad, mine);
}

// Queues the pattern over [p, p + n) on `s` (after `spin_ns` of spinning on the GPU).
inline void fill(void* p, int64_t n, uint32_t seed, cudaStream_t s, unsigned long long spin_ns = 0) {
  fill_kernel<<<1024, 256, 0, s>>>(static_cast<unsigned char*>(p), n, seed, spin_ns);
  INFERCTX_CUDA(cudaGetLastError(), -1);
}

// Bytes of [p, p + n) that differ from the pattern, counted on `s` (synchronised).
inline int64_t mismatches(const void* p, int64_t n, uint32_t seed, cudaStream_t s) {
  inferctx::DeviceAllocation counter(-1, sizeof(unsigned long long));
  INFERCTX_CUDA(cudaMemsetAsync(counter.data(), 0, sizeof(unsigned long long), s), -1);
  count_kernel<<<1024, 256, 0, s>>>(static_cast<const unsigned char*>(p), n, seed,
                                    static_cast<unsigned long long*>(counter.data()));
  INFERCTX_CUDA(cudaGetLastError(), -1);
  unsigned long long bad = 0;
  INFERCTX_CUDA(cudaMemcpyAsync(&bad, counter.data(), sizeof bad, cudaMemcpyDeviceToHost, s), -1);
  INFERCTX_CUDA(cudaStreamSynchronize(s), -1);
  return static_cast<int64_t>(bad);
}

}  // namespace test_pattern

// Device-memory helpers shared by the tests.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "inferctx/cuda_check.hpp"
#include "inferctx/memory.hpp"

namespace test_memory {

// Copies `bytes` from host memory to `dst` and returns once they are there: cudaMemcpy from
// pageable memory may return before its DMA lands, and work on a non-blocking stream is not
// ordered after the legacy stream's, so the copy ends with a device-wide synchronisation (which
// also waits for any cudaMemset queued before it).
inline void upload(void* dst, const void* src, size_t bytes, int device) {
  if (bytes == 0) return;
  INFERCTX_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), device);
  INFERCTX_CUDA(cudaDeviceSynchronize(), device);
}

__global__ void fill_bytes(unsigned char* p, int64_t n, unsigned char value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

// Writes `value` over the first and last 4 KiB of the allocation and reads them back.
inline bool writable(const inferctx::DeviceAllocation& a, cudaStream_t s, unsigned char value) {
  const int device = a.device();
  const int64_t n = std::min<int64_t>(a.size(), 4096);
  auto* base = static_cast<unsigned char*>(a.data());
  fill_bytes<<<8, 256, 0, s>>>(base, n, value);
  fill_bytes<<<8, 256, 0, s>>>(base + a.size() - n, n, value);
  INFERCTX_CUDA(cudaGetLastError(), device);
  std::vector<unsigned char> head(static_cast<size_t>(n)), tail(static_cast<size_t>(n));
  INFERCTX_CUDA(cudaMemcpyAsync(head.data(), base, static_cast<size_t>(n), cudaMemcpyDeviceToHost, s), device);
  INFERCTX_CUDA(cudaMemcpyAsync(tail.data(), base + a.size() - n, static_cast<size_t>(n), cudaMemcpyDeviceToHost, s),
                device);
  INFERCTX_CUDA(cudaStreamSynchronize(s), device);
  for (int64_t i = 0; i < n; ++i)
    if (head[i] != value || tail[i] != value) return false;
  return true;
}

}  // namespace test_memory

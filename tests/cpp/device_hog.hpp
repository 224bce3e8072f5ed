// Device memory held by a test, so that an allocation larger than what is left must fail.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "inferctx/cuda_check.hpp"

namespace test_memory {

// Takes the current device's free memory with cudaMalloc, in blocks of 1 GiB and then smaller
// ones, until about `leave` bytes are left; gives it back when it goes out of scope.
class Hog {
 public:
  explicit Hog(int64_t leave) {
    int64_t want = free_bytes() - leave;
    int64_t block = int64_t{1} << 30;
    while (want > 0) {
      const int64_t n = std::min(block, want);
      void* p = nullptr;
      if (cudaMalloc(&p, static_cast<size_t>(n)) != cudaSuccess) {
        cudaGetLastError();
        if (block <= (int64_t{2} << 20)) break;
        block /= 2;
        continue;
      }
      blocks_.push_back(p);
      want -= n;
    }
  }
  ~Hog() {
    for (void* p : blocks_) cudaFree(p);
  }
  Hog(const Hog&) = delete;
  Hog& operator=(const Hog&) = delete;

  static int64_t free_bytes() {
    size_t f = 0, t = 0;
    INFERCTX_CUDA(cudaMemGetInfo(&f, &t), -1);
    return static_cast<int64_t>(f);
  }

 private:
  std::vector<void*> blocks_;
};

}  // namespace test_memory

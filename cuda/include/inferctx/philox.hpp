// The (seed, offset) state of the Philox4x32-10 generator shared by the context's kernels.
#pragma once

#include <cstdint>
#include <mutex>
#include <utility>

namespace inferctx {

class PhiloxState {
 public:
  explicit PhiloxState(uint64_t seed = 0) : seed_(seed) {}

  // Returns (seed, offset) to use now and advances the offset by `increment` rounded up to a
  // multiple of 4 (one Philox counter yields 4 values). Thread-safe: concurrent callers get
  // disjoint ranges. ConfigError("increment") if the offset would pass 2^64 - 1 (the state is
  // then unchanged). An increment of 0 returns the current offset without advancing it.
  std::pair<uint64_t, uint64_t> increment_offset(uint64_t increment);
  // Sets the seed and resets the offset to 0.
  void set_seed(uint64_t seed);
  uint64_t seed() const;
  uint64_t offset() const;
  std::pair<uint64_t, uint64_t> state() const;  // (seed, offset), read together

 private:
  mutable std::mutex mutex_;
  uint64_t seed_ = 0;
  uint64_t offset_ = 0;
};

}  // namespace inferctx

#include "inferctx/philox.hpp"

#include <limits>
#include <string>

#include "inferctx/errors.hpp"

namespace inferctx {

std::pair<uint64_t, uint64_t> PhiloxState::increment_offset(uint64_t increment) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  std::lock_guard<std::mutex> lock(mutex_);
  // Rounding first keeps every offset a multiple of 4, so a range never starts inside a
  // Philox counter whose 4 outputs another caller already owns.
  const bool round_overflows = increment > kMax - 3;
  const uint64_t step = round_overflows ? 0 : (increment + 3) & ~uint64_t{3};
  if (round_overflows || step > kGraphOffsetBase - offset_) {
    throw ConfigError("increment", "increment: got " + std::to_string(increment) + " (rounded up to a multiple of 4" +
                                       (round_overflows ? std::string(", which overflows 64 bits")
                                                        : ": " + std::to_string(step)) +
                                       "); the Philox offset is " + std::to_string(offset_) +
                                       " and eager offsets cannot pass 2^63 = " + std::to_string(kGraphOffsetBase) +
                                       " (the upper half is for CUDA-graph replays); call set_seed to start a new "
                                       "sequence (it resets the offset to 0)");
  }
  const std::pair<uint64_t, uint64_t> result{seed_, offset_};
  offset_ += step;
  return result;
}

GraphSite PhiloxState::capture_site() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (sites_ >= kGraphSites) {
    throw ConfigError("site", "site: " + std::to_string(sites_) +
                                  " call sites were captured into CUDA graphs on this context, the most it numbers "
                                  "(2^28, each with its own band of Philox subsequences); capture fewer call sites "
                                  "(reuse captured graphs)");
  }
  return GraphSite{seed_, epoch_, sites_++};
}

void PhiloxState::set_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(mutex_);
  seed_ = seed;
  offset_ = 0;
  ++epoch_;
}

uint64_t PhiloxState::seed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return seed_;
}

uint64_t PhiloxState::offset() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return offset_;
}

std::pair<uint64_t, uint64_t> PhiloxState::state() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {seed_, offset_};
}

PhiloxSnapshot PhiloxState::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {seed_, offset_, epoch_, sites_};
}

}  // namespace inferctx

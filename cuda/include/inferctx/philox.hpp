// The (seed, offset) state of the Philox4x32-10 generator shared by the context's kernels, and
// the arithmetic that keeps draws made under CUDA-graph capture apart from every other draw.
//
// Where a draw's numbers come from (element i of a kernel uses curand_init(seed, subsequence,
// offset), dropout.hpp):
//
//   eager call (host state)          subsequence i / 4,              offset o < 2^63 (increment_offset)
//   captured call site k, replay r   subsequence k * 2^36 + i / 4,   offset 2^63 + step * r
//
// where step is the site's increment rounded up to a multiple of 4 (4 for dropout).
//
// The offset space is split at 2^63: eager calls take the lower half through the host counter
// (unchanged cost), graph replays the upper half. A captured call site gets, at capture time, the
// context's next site number k (never reused); its 2^36-wide band of subsequences keeps it apart
// from every other site (a drawn array has at most 2^38 elements, so i / 4 < 2^36: 512 GiB of
// fp16), and the replay number r, a device-side counter that the captured kernel advances as it
// runs (graph_rng.hpp), keeps its replays apart. So no two draws between two set_seed calls
// share a (subsequence, offset) pair: eager ones differ from graph ones in offset bit 63, two
// sites in their subsequence band, two replays of one site in the offset. Replays per site:
// 2^63 / step (2^61 for dropout: 73 years at a replay per nanosecond); sites per context: 2^28.
//
// set_seed starts a new sequence for both: eager offset 0, and every captured site's replay
// number back to 0 with the new seed (the epoch changes; graph_rng.hpp). Site numbers go on (a
// graph captured after set_seed must not repeat the numbers of one still alive). Same seed, same
// eager calls and captures, same number of replays: same bits on any GPU.
#pragma once

#include <cstdint>
#include <mutex>
#include <utility>

namespace inferctx {

// First offset of the graph half of the offset space; eager offsets stay below it.
constexpr uint64_t kGraphOffsetBase = uint64_t{1} << 63;
// A captured site's subsequences start at site << kGraphSiteShift.
constexpr int kGraphSiteShift = 36;
// Site numbers of a context: (site << 36) + i / 4 must fit in 64 bits.
constexpr uint64_t kGraphSites = uint64_t{1} << 28;
// Elements of one array drawn under capture: i / 4 must stay below 2^36.
constexpr int64_t kGraphMaxElements = int64_t{1} << 38;
// Largest offset step of a site (its increment rounded up to a multiple of 4).
constexpr uint64_t kGraphMaxStep = uint64_t{1} << 62;

// The offset step of a site drawing `increment` values per element group: a multiple of 4, at
// least 4 (every replay moves to a fresh Philox counter).
constexpr uint64_t graph_step(uint64_t increment) { return increment <= 4 ? 4 : (increment + 3) & ~uint64_t{3}; }
// Replays a site of offset step `step` can make before its offsets would pass 2^64 - 1.
constexpr uint64_t graph_max_replays(uint64_t step) { return kGraphOffsetBase / step; }

// The Philox (subsequence base, offset) of replay `replay` of site `site`: the draw of element i
// uses subsequence base + i / 4 and this offset.
constexpr uint64_t graph_subsequence_base(uint64_t site) { return site << kGraphSiteShift; }
constexpr uint64_t graph_offset(uint64_t replay, uint64_t step = 4) { return kGraphOffsetBase + step * replay; }

// A captured call site as the host numbered it.
struct GraphSite {
  uint64_t seed;   // the seed in force at capture (replays read the current one, graph_rng.hpp)
  uint64_t epoch;  // set_seed calls so far
  uint64_t site;   // k: sites captured before this one
};

// The whole state, read together.
struct PhiloxSnapshot {
  uint64_t seed;
  uint64_t offset;  // next eager offset
  uint64_t epoch;   // set_seed calls so far (0 for a new state)
  uint64_t sites;   // call sites captured so far (the next one's number)
};

class PhiloxState {
 public:
  explicit PhiloxState(uint64_t seed = 0) : seed_(seed) {}

  // Returns (seed, offset) to use now and advances the offset by `increment` rounded up to a
  // multiple of 4 (one Philox counter yields 4 values). Thread-safe: concurrent callers get
  // disjoint ranges. ConfigError("increment") if the offset would pass 2^63 (the upper half
  // belongs to graph replays; the state is then unchanged). An increment of 0 returns the
  // current offset without advancing it.
  std::pair<uint64_t, uint64_t> increment_offset(uint64_t increment);
  // Numbers a new captured call site. ConfigError("site") once 2^28 sites were captured (the
  // state is then unchanged).
  GraphSite capture_site();
  // Sets the seed, resets the offset to 0 and starts a new epoch (site numbers go on).
  void set_seed(uint64_t seed);
  uint64_t seed() const;
  uint64_t offset() const;
  std::pair<uint64_t, uint64_t> state() const;  // (seed, offset), read together
  PhiloxSnapshot snapshot() const;

 private:
  mutable std::mutex mutex_;
  uint64_t seed_ = 0;
  uint64_t offset_ = 0;
  uint64_t epoch_ = 0;
  uint64_t sites_ = 0;
};

}  // namespace inferctx

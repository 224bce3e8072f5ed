// PhiloxState: rounding of increments, seeding, disjoint ranges under contention, overflow.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include "check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/philox.hpp"

using namespace inferctx;

TEST_CASE("increments round up to multiples of 4; 0 reads the offset without advancing") {
  PhiloxState s(7);
  CHECK_EQ(s.seed(), uint64_t{7});
  CHECK_EQ(s.offset(), uint64_t{0});
  auto r = s.increment_offset(1);  // takes [0, 4)
  CHECK_EQ(r.first, uint64_t{7});
  CHECK_EQ(r.second, uint64_t{0});
  CHECK_EQ(s.offset(), uint64_t{4});
  r = s.increment_offset(4);  // [4, 8)
  CHECK_EQ(r.second, uint64_t{4});
  CHECK_EQ(s.offset(), uint64_t{8});
  r = s.increment_offset(5);  // 5 -> 8: [8, 16)
  CHECK_EQ(r.second, uint64_t{8});
  CHECK_EQ(s.offset(), uint64_t{16});
  r = s.increment_offset(0);
  CHECK_EQ(r.second, uint64_t{16});
  CHECK_EQ(s.offset(), uint64_t{16});
  r = s.increment_offset(3);  // 3 -> 4
  CHECK_EQ(r.second, uint64_t{16});
  CHECK_EQ(s.offset(), uint64_t{20});
  r = s.increment_offset(1001);  // 1001 -> 1004
  CHECK_EQ(r.second, uint64_t{20});
  CHECK_EQ(s.offset(), uint64_t{1024});
  CHECK(s.state() == std::make_pair(uint64_t{7}, uint64_t{1024}));
  s.set_seed(9);
  CHECK(s.state() == std::make_pair(uint64_t{9}, uint64_t{0}));
}

TEST_CASE("default seed is 0") {
  PhiloxState s;
  CHECK_EQ(s.seed(), uint64_t{0});
  CHECK_EQ(s.increment_offset(4).first, uint64_t{0});
}

TEST_CASE("set_seed sets the seed and resets the offset to 0") {
  PhiloxState s(1);
  s.increment_offset(100);
  CHECK_EQ(s.offset(), uint64_t{100});
  s.set_seed(0xDEADBEEFCAFEull);
  CHECK_EQ(s.seed(), uint64_t{0xDEADBEEFCAFEull});
  CHECK_EQ(s.offset(), uint64_t{0});
  auto r = s.increment_offset(2);
  CHECK_EQ(r.first, uint64_t{0xDEADBEEFCAFEull});
  CHECK_EQ(r.second, uint64_t{0});
  CHECK_EQ(s.offset(), uint64_t{4});
}

TEST_CASE("16 threads x 10000 increments give disjoint, gap-free ranges") {
  constexpr int kThreads = 16;
  constexpr int kCalls = 10000;
  PhiloxState s(99);
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> taken(kThreads);  // (start, rounded length)
  std::atomic<bool> go{false};
  std::atomic<int> seeds_wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      taken[t].reserve(kCalls);
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kCalls; ++i) {
        const uint64_t inc = static_cast<uint64_t>(1 + (t * 7 + i) % 13);  // 1..13, most not multiples of 4
        const auto r = s.increment_offset(inc);
        if (r.first != 99) seeds_wrong.fetch_add(1);
        taken[t].push_back({r.second, (inc + 3) / 4 * 4});
      }
    });
  }
  go.store(true);
  for (auto& th : threads) th.join();

  std::vector<std::pair<uint64_t, uint64_t>> all;
  uint64_t expected_total = 0;
  for (const auto& v : taken) {
    for (const auto& r : v) {
      all.push_back(r);
      expected_total += r.second;
    }
  }
  CHECK_EQ(seeds_wrong.load(), 0);
  CHECK_EQ(all.size(), static_cast<size_t>(kThreads) * kCalls);
  std::sort(all.begin(), all.end());
  // Sorted by start, each range must begin exactly where the previous one ended.
  uint64_t next = 0;
  int bad = 0;
  for (const auto& r : all) {
    if (r.first != next || r.first % 4 != 0) ++bad;
    next = r.first + r.second;
  }
  CHECK_EQ(bad, 0);
  CHECK_EQ(next, expected_total);
  CHECK_EQ(s.offset(), expected_total);
}

TEST_CASE("an offset that would pass 2^64 - 1 is a ConfigError and leaves the state") {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  PhiloxState s(5);
  // The largest multiple of 4 is accepted from offset 0.
  auto r = s.increment_offset(kMax - 3);
  CHECK_EQ(r.second, uint64_t{0});
  CHECK_EQ(s.offset(), kMax - 3);
  CHECK_THROWS(ConfigError, s.increment_offset(1));
  CHECK_EQ(s.offset(), kMax - 3);
  CHECK_EQ(s.increment_offset(0).second, kMax - 3);  // reading without advancing still works

  try {
    s.increment_offset(4);
    CHECK(false);
  } catch (const ConfigError& e) {
    CHECK(e.argument == "increment");
    CHECK(std::string(e.what()).find("set_seed") != std::string::npos);
  }
  s.set_seed(5);
  CHECK_EQ(s.increment_offset(4).second, uint64_t{0});

  // Rounding itself overflows for the top three values.
  PhiloxState t;
  CHECK_THROWS(ConfigError, t.increment_offset(kMax));
  CHECK_THROWS(ConfigError, t.increment_offset(kMax - 2));
  CHECK_EQ(t.offset(), uint64_t{0});
}

CHECK_MAIN()

// PhiloxState: rounding of increments, seeding, disjoint ranges under contention, the eager limit at
// 2^63, and the arithmetic of draws under CUDA-graph capture (site numbers, epochs, offsets).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
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

TEST_CASE("an eager offset that would pass 2^63 is a ConfigError and leaves the state") {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  constexpr uint64_t kHalf = uint64_t{1} << 63;  // the graph half of the offset space starts here
  PhiloxState s(5);
  // The whole lower half in one increment is accepted from offset 0.
  auto r = s.increment_offset(kHalf);
  CHECK_EQ(r.second, uint64_t{0});
  CHECK_EQ(s.offset(), kHalf);
  CHECK_THROWS(ConfigError, s.increment_offset(1));
  CHECK_EQ(s.offset(), kHalf);
  CHECK_EQ(s.increment_offset(0).second, kHalf);  // reading without advancing still works

  try {
    s.increment_offset(4);
    CHECK(false);
  } catch (const ConfigError& e) {
    CHECK(e.argument == "increment");
    CHECK(std::string(e.what()).find("set_seed") != std::string::npos);
    CHECK(std::string(e.what()).find("2^63") != std::string::npos);
  }
  s.set_seed(5);
  CHECK_EQ(s.increment_offset(4).second, uint64_t{0});

  // One step short of the half: the last multiple of 4 below 2^63 is still an eager offset.
  PhiloxState u;
  u.increment_offset(kHalf - 4);
  CHECK_EQ(u.increment_offset(4).second, kHalf - 4);
  CHECK_THROWS(ConfigError, u.increment_offset(4));
  CHECK_EQ(u.offset(), kHalf);

  // Past the half in one step, and rounding that itself overflows for the top three values.
  PhiloxState t;
  CHECK_THROWS(ConfigError, t.increment_offset(kHalf + 1));
  CHECK_THROWS(ConfigError, t.increment_offset(kMax));
  CHECK_THROWS(ConfigError, t.increment_offset(kMax - 2));
  CHECK_EQ(t.offset(), uint64_t{0});
}

// ---- the graph half of the state (philox.hpp) ----------------------------------------------

TEST_CASE("graph arithmetic: offsets, steps, replay limits and subsequence bands, by hand") {
  CHECK_EQ(kGraphOffsetBase, uint64_t{9223372036854775808ull});
  CHECK_EQ(graph_offset(0), uint64_t{9223372036854775808ull});
  CHECK_EQ(graph_offset(5), uint64_t{9223372036854775828ull});         // 2^63 + 20
  CHECK_EQ(graph_offset(3, 12), uint64_t{9223372036854775844ull});     // 2^63 + 36
  CHECK_EQ(graph_step(0), uint64_t{4});
  CHECK_EQ(graph_step(1), uint64_t{4});
  CHECK_EQ(graph_step(4), uint64_t{4});
  CHECK_EQ(graph_step(5), uint64_t{8});
  CHECK_EQ(graph_step(1001), uint64_t{1004});
  CHECK_EQ(graph_step(uint64_t{1} << 62), uint64_t{1} << 62);
  // Dropout (step 4): 2^61 replays, the last at offset 2^64 - 4, whose counter is the top one.
  CHECK_EQ(graph_max_replays(4), uint64_t{1} << 61);
  CHECK_EQ(graph_offset(graph_max_replays(4) - 1), uint64_t{18446744073709551612ull});
  CHECK_EQ(graph_max_replays(uint64_t{1} << 62), uint64_t{2});
  CHECK_EQ(graph_offset(1, uint64_t{1} << 62), uint64_t{13835058055282163712ull});  // 2^63 + 2^62
  // Site k owns subsequences [k * 2^36, (k + 1) * 2^36); the last site's band ends at 2^64 - 1.
  CHECK_EQ(graph_subsequence_base(0), uint64_t{0});
  CHECK_EQ(graph_subsequence_base(1), uint64_t{68719476736ull});
  CHECK_EQ(graph_subsequence_base(3), uint64_t{206158430208ull});
  CHECK_EQ(graph_subsequence_base(kGraphSites - 1) + ((uint64_t{1} << 36) - 1), uint64_t{18446744073709551615ull});
  CHECK_EQ(kGraphSites, uint64_t{268435456});
  CHECK_EQ(kGraphMaxElements, int64_t{274877906944});  // 2^38: i / 4 < 2^36
}

TEST_CASE("graph arithmetic: the site folds into the subsequence's top word without carries") {
  // The kernels form hi32(k * 2^36 + i / 4) as (k << 4) ^ hi32(i / 4): exact while i / 4 < 2^36.
  std::mt19937_64& g = check::rng();
  int bad = 0;
  for (int t = 0; t < 100000; ++t) {
    const uint64_t k = g() % kGraphSites;
    const uint64_t s = g() % (uint64_t{1} << 36);
    const uint64_t sub = graph_subsequence_base(k) + s;
    const uint32_t folded = static_cast<uint32_t>(k << 4) ^ static_cast<uint32_t>(s >> 32);
    if (static_cast<uint32_t>(sub >> 32) != folded || static_cast<uint32_t>(sub) != static_cast<uint32_t>(s)) ++bad;
    // The subsequences of two different sites differ.
    const uint64_t k2 = (k + 1 + g() % (kGraphSites - 1)) % kGraphSites;
    const uint64_t s2 = g() % (uint64_t{1} << 36);
    if (graph_subsequence_base(k2) + s2 == sub) ++bad;
  }
  CHECK_EQ(bad, 0);
}

TEST_CASE("capture_site numbers sites from 0; set_seed starts an epoch and leaves the numbering") {
  PhiloxState s(11);
  PhiloxSnapshot z = s.snapshot();
  CHECK_EQ(z.seed, uint64_t{11});
  CHECK_EQ(z.offset, uint64_t{0});
  CHECK_EQ(z.epoch, uint64_t{0});
  CHECK_EQ(z.sites, uint64_t{0});
  s.increment_offset(8);
  GraphSite a = s.capture_site();
  GraphSite b = s.capture_site();
  CHECK_EQ(a.seed, uint64_t{11});
  CHECK_EQ(a.epoch, uint64_t{0});
  CHECK_EQ(a.site, uint64_t{0});
  CHECK_EQ(b.site, uint64_t{1});
  // Sites leave the eager offset alone, and the reverse.
  CHECK_EQ(s.offset(), uint64_t{8});
  CHECK_EQ(s.increment_offset(4).second, uint64_t{8});
  CHECK_EQ(s.capture_site().site, uint64_t{2});
  PhiloxSnapshot m = s.snapshot();
  CHECK_EQ(m.offset, uint64_t{12});
  CHECK_EQ(m.sites, uint64_t{3});
  s.set_seed(11);  // the same seed again: eager offsets restart, site numbers do not
  PhiloxSnapshot r = s.snapshot();
  CHECK_EQ(r.seed, uint64_t{11});
  CHECK_EQ(r.offset, uint64_t{0});
  CHECK_EQ(r.sites, uint64_t{3});
  CHECK_EQ(r.epoch, uint64_t{1});
  GraphSite c = s.capture_site();
  CHECK_EQ(c.site, uint64_t{3});
  CHECK_EQ(c.epoch, uint64_t{1});
  s.set_seed(12);
  CHECK_EQ(s.snapshot().epoch, uint64_t{2});
  CHECK_EQ(s.capture_site().seed, uint64_t{12});
}

TEST_CASE("site 2^28 is a ConfigError that leaves the state, set_seed or not") {
  PhiloxState s(3);
  for (uint64_t i = 0; i + 1 < kGraphSites; ++i) s.capture_site();
  CHECK_EQ(s.capture_site().site, kGraphSites - 1);
  try {
    s.capture_site();
    CHECK(false);
  } catch (const ConfigError& e) {
    CHECK(e.argument == "site");
    CHECK(std::string(e.what()).find("2^28") != std::string::npos);
  }
  CHECK_EQ(s.snapshot().sites, kGraphSites);
  s.set_seed(3);
  CHECK_THROWS(ConfigError, s.capture_site());
  CHECK_EQ(s.increment_offset(4).second, uint64_t{0});  // eager draws are unaffected
}

TEST_CASE("8 threads taking sites and offsets at once get unique, gap-free numbers of both") {
  constexpr int kThreads = 8;
  constexpr int kCalls = 5000;
  PhiloxState s(21);
  std::vector<std::vector<uint64_t>> sites(kThreads), offsets(kThreads);
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kCalls; ++i) {
        if ((i + t) % 2 == 0) {
          sites[t].push_back(s.capture_site().site);
        } else {
          offsets[t].push_back(s.increment_offset(4).second);
        }
      }
    });
  }
  go.store(true);
  for (auto& th : threads) th.join();
  std::vector<uint64_t> all_sites, all_offsets;
  for (int t = 0; t < kThreads; ++t) {
    all_sites.insert(all_sites.end(), sites[t].begin(), sites[t].end());
    all_offsets.insert(all_offsets.end(), offsets[t].begin(), offsets[t].end());
  }
  std::sort(all_sites.begin(), all_sites.end());
  std::sort(all_offsets.begin(), all_offsets.end());
  int bad = 0;
  for (size_t i = 0; i < all_sites.size(); ++i)
    if (all_sites[i] != i) ++bad;
  for (size_t i = 0; i < all_offsets.size(); ++i)
    if (all_offsets[i] != 4 * i) ++bad;
  CHECK_EQ(bad, 0);
  CHECK_EQ(all_sites.size() + all_offsets.size(), static_cast<size_t>(kThreads) * kCalls);
  CHECK_EQ(s.snapshot().sites, static_cast<uint64_t>(all_sites.size()));
  CHECK_EQ(s.offset(), 4 * static_cast<uint64_t>(all_offsets.size()));
}

CHECK_MAIN()

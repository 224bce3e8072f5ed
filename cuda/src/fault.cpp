#include "inferctx/fault.hpp"

#if defined(INFERCTX_FAULT_INJECTION) && INFERCTX_FAULT_INJECTION

#include <atomic>

namespace inferctx::fault {

namespace {

struct Counter {
  std::atomic<int64_t> seen{0};
  std::atomic<int64_t> nth{0};
  std::atomic<int> code{0};
};

Counter counters[kSiteCount];

Counter& of(Site site) noexcept { return counters[static_cast<int>(site)]; }

}  // namespace

int injected(Site site) noexcept {
  Counter& c = of(site);
  const int64_t n = c.seen.fetch_add(1, std::memory_order_relaxed) + 1;
  const int64_t want = c.nth.load(std::memory_order_acquire);
  return want > 0 && n == want ? c.code.load(std::memory_order_relaxed) : 0;
}

void arm(Site site, int64_t nth, int code) noexcept {
  Counter& c = of(site);
  c.nth.store(0, std::memory_order_release);
  c.seen.store(0, std::memory_order_relaxed);
  c.code.store(code, std::memory_order_relaxed);
  c.nth.store(nth > 0 ? nth : 0, std::memory_order_release);
}

void disarm_all() noexcept {
  for (int i = 0; i < kSiteCount; ++i) arm(static_cast<Site>(i), 0, 0);
}

int64_t calls(Site site) noexcept { return of(site).seen.load(std::memory_order_relaxed); }

}  // namespace inferctx::fault

#endif

// The failure-injection counters themselves (host code: with or without a GPU). The ctest build
// compiles them in (INFERCTX_FAULT_INJECTION); elsewhere the test skips.
#include <cstdio>
#include <thread>
#include <vector>

#include "check.hpp"
#include "inferctx/fault.hpp"

using namespace inferctx;
using fault::Site;

#if defined(INFERCTX_FAULT_INJECTION) && INFERCTX_FAULT_INJECTION

TEST_CASE("the nth call fails with the armed code, once; the others run") {
  fault::arm(Site::stream, 3, 42);
  int ran = 0;
  std::vector<int> got;
  for (int i = 0; i < 5; ++i) got.push_back(fault::invoke<int>(Site::stream, [&] { ++ran; return 0; }));
  CHECK(got == (std::vector<int>{0, 0, 42, 0, 0}));
  CHECK_EQ(ran, 4);  // the failed call never ran
  CHECK_EQ(fault::calls(Site::stream), int64_t{5});
  CHECK_EQ(fault::calls(Site::event), int64_t{0});  // sites count apart
  CHECK_EQ(fault::injected(Site::event), 0);
  fault::disarm_all();
  CHECK_EQ(fault::calls(Site::stream), int64_t{0});
  CHECK_EQ(fault::injected(Site::stream), 0);
}

TEST_CASE("disarmed or nth <= 0: nothing fails") {
  fault::arm(Site::cublas, 0, 13);
  for (int i = 0; i < 100; ++i) CHECK_EQ(fault::injected(Site::cublas), 0);
  fault::arm(Site::cublas, -5, 13);
  for (int i = 0; i < 100; ++i) CHECK_EQ(fault::injected(Site::cublas), 0);
  fault::disarm_all();
}

TEST_CASE("threads: exactly one of 8 x 1000 calls fails") {
  fault::arm(Site::device_alloc, 4321, 2);
  std::vector<int> failed(8, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&failed, t] {
      for (int i = 0; i < 1000; ++i) failed[t] += fault::injected(Site::device_alloc) == 2;
    });
  }
  for (auto& th : threads) th.join();
  int total = 0;
  for (int f : failed) total += f;
  CHECK_EQ(total, 1);
  CHECK_EQ(fault::calls(Site::device_alloc), int64_t{8000});
  fault::disarm_all();
}

int main() { return check::run_all(); }

#else

int main() {
  static_assert(!fault::kCompiledIn, "");
  static_assert(fault::injected(Site::cublas) == 0, "compiled out: a constant");
  std::printf("SKIP: built without INFERCTX_FAULT_INJECTION\n");
  return 77;
}

#endif

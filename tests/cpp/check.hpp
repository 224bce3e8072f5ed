// A minimal test harness: CHECK records a failure and goes on; main() returns the count.
// GPU tests call skip_without_gpu() first, which exits 77 (ctest's SKIP_RETURN_CODE).
#pragma once

#include <cuda_runtime_api.h>

#include <execinfo.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace check {

inline int& failures() {
  static int n = 0;
  return n;
}

struct Case {
  const char* name;
  std::function<void()> body;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> c;
  return c;
}

struct Register {
  Register(const char* name, std::function<void()> body) { cases().push_back({name, std::move(body)}); }
};

// The case running now, for the crash report; after the last one, the process's exit.
inline const char*& running() {
  static const char* name = "(before the first case)";
  return name;
}

// A crash (an abort from the C library's heap checks, a segmentation fault) names the case it
// came from and prints the stack, instead of ending the log at the last buffered line.
extern "C" inline void check_crash_report(int sig) {
  const char* name = running();
  const char head[] = "\nCRASH: signal ";
  char num[8];
  int len = 0;
  for (int v = sig; v > 0 && len < 7; v /= 10) num[len++] = static_cast<char>('0' + v % 10);
  ssize_t ignored = write(2, head, sizeof head - 1);
  while (len > 0) ignored = write(2, &num[--len], 1);
  ignored = write(2, " in ", 4);
  ignored = write(2, name, std::strlen(name));
  ignored = write(2, "\n", 1);
  (void)ignored;
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

inline int run_all() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a crash loses no line already printed
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, check_crash_report);
  void* warm[1];
  backtrace(warm, 1);  // loads the unwinder now: in the handler the heap may be corrupt
  for (auto& c : cases()) {
    running() = c.name;
    const int before = failures();
    try {
      c.body();
    } catch (const std::exception& e) {
      std::printf("  unexpected exception: %s\n", e.what());
      ++failures();
    }
    std::printf("[%s] %s\n", failures() == before ? "PASS" : "FAIL", c.name);
  }
  running() = "(after the last case: the process's exit)";
  std::printf("%zu cases, %d failed checks\n", cases().size(), failures());
  return failures() == 0 ? 0 : 1;
}

inline void skip_without_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("SKIP: no CUDA device\n");
    std::exit(77);
  }
}

// Runs every case when there is a GPU. Without one, runs only the cases whose names start with
// `cpu_prefix`, then reports a skip (exit code 77) so ctest shows that the GPU cases did not run.
inline int run_all_or_cpu_cases(const char* cpu_prefix) {
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) return run_all();
  cudaGetLastError();
  auto& all = cases();
  const size_t len = std::strlen(cpu_prefix);
  all.erase(std::remove_if(all.begin(), all.end(),
                           [&](const Case& c) { return std::strncmp(c.name, cpu_prefix, len) != 0; }),
            all.end());
  const int rc = run_all();
  if (rc != 0) return rc;
  std::printf("SKIP: no CUDA device (the GPU cases did not run)\n");
  return 77;
}

// The seed of this run's random inputs: INFERCTX_TEST_SEED when set, else a fresh one. Printed
// once, so a failing run can be repeated.
inline uint64_t run_seed() {
  static const uint64_t seed = [] {
    uint64_t s = 0;
    if (const char* env = std::getenv("INFERCTX_TEST_SEED")) {
      s = std::strtoull(env, nullptr, 10);
    } else {
      std::random_device rd;
      s = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    }
    std::printf("random seed for this run: %llu (INFERCTX_TEST_SEED=<seed> repeats it)\n",
                static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

inline std::mt19937_64& rng() {
  static std::mt19937_64 g(run_seed());
  return g;
}

}  // namespace check

#define CHECK_CONCAT2(a, b) a##b
#define CHECK_CONCAT(a, b) CHECK_CONCAT2(a, b)
#define TEST_CASE(name)                                                                    \
  static void CHECK_CONCAT(test_fn_, __LINE__)();                                          \
  static ::check::Register CHECK_CONCAT(test_reg_, __LINE__)(name, CHECK_CONCAT(test_fn_, __LINE__)); \
  static void CHECK_CONCAT(test_fn_, __LINE__)()

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::printf("  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);          \
      ++::check::failures();                                                          \
    }                                                                                 \
  } while (0)

#define CHECK_EQ(a, b)                                                                        \
  do {                                                                                        \
    auto va_ = (a);                                                                           \
    auto vb_ = (b);                                                                           \
    if (!(va_ == vb_)) {                                                                      \
      std::printf("  %s:%d: CHECK_EQ(%s, %s) failed: %s vs %s\n", __FILE__, __LINE__, #a, #b, \
                  std::to_string(va_).c_str(), std::to_string(vb_).c_str());                  \
      ++::check::failures();                                                                  \
    }                                                                                         \
  } while (0)

// Checks that `expr` throws exactly type T (or a subclass).
#define CHECK_THROWS(T, expr)                                                                       \
  do {                                                                                              \
    bool caught_ = false;                                                                           \
    try {                                                                                           \
      (void)(expr);                                                                                 \
    } catch (const T&) {                                                                            \
      caught_ = true;                                                                               \
    } catch (const std::exception& e) {                                                             \
      std::printf("  %s:%d: %s threw another type: %s\n", __FILE__, __LINE__, #expr, e.what());     \
    }                                                                                               \
    if (!caught_) {                                                                                 \
      std::printf("  %s:%d: %s did not throw %s\n", __FILE__, __LINE__, #expr, #T);                 \
      ++::check::failures();                                                                        \
    }                                                                                               \
  } while (0)

#define CHECK_MAIN() \
  int main() { return ::check::run_all(); }

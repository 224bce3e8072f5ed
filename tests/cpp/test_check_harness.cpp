// The test harness itself (check.hpp): a case that crashes is named in the report, with a stack,
// and the run still dies of its signal, so that ctest and the sanitizer steps see the failure.
#include <sys/resource.h>
#include <sys/wait.h>

#include <csignal>
#include <stdexcept>
#include <string>

#include "check.hpp"

namespace {

struct ChildRun {
  int status = 0;
  std::string out;  // stdout and stderr together
};

// Runs, in a forked child, a harness whose cases are `first` (passes) and `second` (`body`).
ChildRun run_in_child(void (*body)()) {
  ChildRun r;
  int fds[2];
  if (pipe(fds) != 0) return r;
  const pid_t pid = fork();
  if (pid == 0) {
    const rlimit no_core{0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    ::check::failures() = 0;  // the parent's count so far is not the child's
    ::check::cases().clear();
    ::check::cases().push_back({"a case that passes", [] {}});
    ::check::cases().push_back({"a case that crashes", body});
    _exit(::check::run_all());  // the run's own exit code
  }
  close(fds[1]);
  char buf[4096];
  ssize_t n = 0;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) r.out.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  waitpid(pid, &r.status, 0);
  return r;
}

bool has(const std::string& text, const char* what) { return text.find(what) != std::string::npos; }

}  // namespace

TEST_CASE("cpu: an abort is reported with the case's name and a stack; the process still dies of SIGABRT") {
  const ChildRun r = run_in_child([] { std::abort(); });
  CHECK(WIFSIGNALED(r.status));
  CHECK_EQ(WIFSIGNALED(r.status) ? WTERMSIG(r.status) : 0, SIGABRT);
  CHECK(has(r.out, "[PASS] a case that passes\n"));  // printed before the crash, not lost with it
  CHECK(has(r.out, "CRASH: signal 6 in a case that crashes\n"));
  CHECK(has(r.out, "abort"));  // a frame of the stack
  CHECK(!has(r.out, "cases, "));  // no summary line: the run did not go on
  if (!has(r.out, "CRASH: signal 6")) std::printf("  child's output:\n%s\n", r.out.c_str());
}

TEST_CASE("cpu: a segmentation fault is reported too") {
  const ChildRun r = run_in_child([] { std::raise(SIGSEGV); });
  CHECK_EQ(WIFSIGNALED(r.status) ? WTERMSIG(r.status) : 0, SIGSEGV);
  CHECK(has(r.out, "CRASH: signal 11 in a case that crashes\n"));
}

TEST_CASE("cpu: a clean run exits 0 and says so") {
  const ChildRun r = run_in_child([] {});
  CHECK(WIFEXITED(r.status));
  CHECK_EQ(WIFEXITED(r.status) ? WEXITSTATUS(r.status) : -1, 0);
  CHECK(has(r.out, "[PASS] a case that crashes\n"));  // (the second case, here one that does nothing)
  CHECK(has(r.out, "2 cases, 0 failed checks"));
  CHECK(!has(r.out, "CRASH"));
}

TEST_CASE("cpu: failed checks are counted, the case marked FAIL, and the run exits 1") {
  const ChildRun r = run_in_child([] {
    CHECK(1 + 1 == 3);
    CHECK_EQ(2 + 2, 5);
    CHECK_THROWS(std::runtime_error, (void)0);  // throws nothing
  });
  CHECK_EQ(WIFEXITED(r.status) ? WEXITSTATUS(r.status) : -1, 1);
  CHECK(has(r.out, "[PASS] a case that passes\n"));
  CHECK(has(r.out, "[FAIL] a case that crashes\n"));
  CHECK(has(r.out, "CHECK(1 + 1 == 3) failed"));
  CHECK(has(r.out, "CHECK_EQ(2 + 2, 5) failed: 4 vs 5"));
  CHECK(has(r.out, "did not throw std::runtime_error"));
  CHECK(has(r.out, "2 cases, 3 failed checks"));
  // An exception out of a case is a failure too.
  const ChildRun t = run_in_child([] { throw std::runtime_error("out of the case"); });
  CHECK_EQ(WIFEXITED(t.status) ? WEXITSTATUS(t.status) : -1, 1);
  CHECK(has(t.out, "unexpected exception: out of the case"));
  CHECK(has(t.out, "2 cases, 1 failed checks"));
}

CHECK_MAIN()

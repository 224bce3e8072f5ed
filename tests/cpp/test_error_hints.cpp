// What an error message adds about the process: a sticky error (the CUDA context is lost) says
// to restart; any error in a child forked after this library was loaded says how to start
// workers instead. Host code only: it holds with or without a GPU.
#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "check.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"

using namespace inferctx;

static bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

TEST_CASE("sticky errors are those that lose the CUDA context") {
  CHECK(is_sticky_error(cudaErrorIllegalAddress));    // 700
  CHECK(is_sticky_error(cudaErrorLaunchFailure));     // 719
  CHECK(is_sticky_error(cudaErrorMisalignedAddress)); // 716
  CHECK(is_sticky_error(cudaErrorAssert));            // 710
  CHECK(!is_sticky_error(cudaSuccess));
  CHECK(!is_sticky_error(cudaErrorMemoryAllocation));     // 2: the next call may succeed
  CHECK(!is_sticky_error(cudaErrorInvalidValue));         // 1
  CHECK(!is_sticky_error(cudaErrorLaunchOutOfResources)); // 701: not sticky
  CHECK_EQ(static_cast<int>(cudaErrorIllegalAddress), 700);  // the same value as CUDA_ERROR_ILLEGAL_ADDRESS
}

TEST_CASE("a sticky error's message says to restart; an ordinary one adds nothing") {
  CHECK(contains(process_state_hint(cudaErrorIllegalAddress), "restart the process"));
  CHECK(process_state_hint(cudaErrorMemoryAllocation).empty());
  CHECK(process_state_hint(cudaErrorInvalidValue).empty());
  try {
    throw_cuda_error(cudaErrorIllegalAddress, "cudaStreamSynchronize(stream)", 0);
    CHECK(false);
  } catch (const CudaError& e) {
    const std::string what = e.what();
    CHECK(contains(what, "cudaErrorIllegalAddress"));
    CHECK(contains(what, "cudaStreamSynchronize(stream) on device 0"));
    CHECK(contains(what, "restart the process"));
  }
  try {
    throw_cuda_error(cudaErrorMemoryAllocation, "cudaMalloc", 0);
    CHECK(false);
  } catch (const CudaError& e) {
    CHECK(!contains(e.what(), "restart"));
  }
}

TEST_CASE("no device: the error holds the facts and names its remedy, not the Python API or the CLI") {
  try {
    throw_cuda_error(cudaErrorNoDevice, "cudaGetDeviceCount", -1);
    CHECK(false);
  } catch (const NoCudaDeviceError& e) {
    const std::string what = e.what();
    CHECK(contains(what, "cudaErrorNoDevice"));
    CHECK(contains(what, "no usable CUDA device or driver"));
    CHECK(!contains(what, "--"));
    CHECK(!contains(what, "plan_workspace"));
    CHECK(e.remedy == Remedy::PlanWithoutDevice);
    CHECK_EQ(e.code, static_cast<int>(cudaErrorNoDevice));
  }
  try {
    throw_cuda_error(cudaErrorInvalidValue, "cudaMemcpy", 0);
    CHECK(false);
  } catch (const CudaError& e) {
    CHECK(e.remedy == Remedy::None);
  }
}

TEST_CASE("the translation for Python carries every field by name") {
  ErrorInfo info;
  try {
    throw with_remedy(WorkspaceOOMError("too big", 10, 20, 30, 40, 5, -1), Remedy::FreeMemoryThenRetake);
  } catch (...) {
    info = current_error_info();
  }
  CHECK_EQ(info.kind, static_cast<int>(ErrorKind::WorkspaceOOM));
  CHECK(info.message == "too big");
  CHECK_EQ(info.remedy, static_cast<int>(Remedy::FreeMemoryThenRetake));
  CHECK_EQ(info.requested_bytes, int64_t{10});
  CHECK_EQ(info.free_bytes, int64_t{20});
  CHECK_EQ(info.total_bytes, int64_t{30});
  CHECK_EQ(info.budget_bytes, int64_t{40});
  CHECK_EQ(info.max_batch_size, int64_t{5});
  CHECK_EQ(info.max_out_tokens, int64_t{-1});
  try {
    throw with_remedy(ConfigError("stream", "stream: of device 1"), Remedy::ContextOfDevice, 1);
  } catch (...) {
    info = current_error_info();
  }
  CHECK(info.argument == "stream");
  CHECK_EQ(info.remedy, static_cast<int>(Remedy::ContextOfDevice));
  CHECK_EQ(info.remedy_device, 1);
  try {
    throw TokenLimitError("past the limit", 7, 3, 8);
  } catch (...) {
    info = current_error_info();
  }
  CHECK_EQ(info.current, int64_t{7});
  CHECK_EQ(info.requested, int64_t{3});
  CHECK_EQ(info.limit, int64_t{8});
  CHECK_EQ(info.remedy, 0);
  try {
    throw WorkspaceInUseError("views", 2);
  } catch (...) {
    info = current_error_info();
  }
  CHECK_EQ(info.views_alive, int64_t{2});
}

TEST_CASE("in a forked child every error says it was forked and how to start workers instead") {
  CHECK(!contains(process_state_hint(cudaErrorInitializationError), "fork"));  // the parent
  const pid_t pid = fork();
  if (pid == 0) {
    // The child: exit 0 when the hint is there, 1 otherwise (no CUDA call is made).
    const std::string hint = process_state_hint(cudaErrorInitializationError);
    const bool ok = contains(hint, "forked") && contains(hint, "spawn") &&
                    contains(process_state_hint(cudaErrorInvalidValue), "forked");
    _exit(ok ? 0 : 1);
  }
  CHECK(pid > 0);
  int status = -1;
  CHECK_EQ(waitpid(pid, &status, 0), pid);
  CHECK(WIFEXITED(status));
  CHECK_EQ(WEXITSTATUS(status), 0);
  CHECK(!contains(process_state_hint(cudaErrorInitializationError), "fork"));  // the parent, still
}
CHECK_MAIN()

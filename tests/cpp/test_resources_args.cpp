// Argument checks of the resource owners that run before any CUDA call, so they hold with or
// without a GPU; and what a machine without a GPU reports.
#include <cuda_runtime_api.h>

#include <string>

#include "check.hpp"
#include "inferctx/blas.hpp"
#include "inferctx/context.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/memory.hpp"
#include "inferctx/stream.hpp"

using namespace inferctx;

TEST_CASE("cuBLAS workspace: 4 MiB before sm_90, 32 MiB from sm_90 on") {
  CHECK_EQ(cublas_workspace_bytes(7), int64_t{4} << 20);
  CHECK_EQ(cublas_workspace_bytes(8), int64_t{4} << 20);
  CHECK_EQ(cublas_workspace_bytes(9), int64_t{32} << 20);
  CHECK_EQ(cublas_workspace_bytes(10), int64_t{32} << 20);
  CHECK_EQ(cublas_workspace_bytes(12), int64_t{32} << 20);
  CHECK_THROWS(ConfigError, cublas_workspace_bytes(0));
  CHECK_THROWS(ConfigError, cublas_workspace_bytes(-9));
}

TEST_CASE("byte counts: negative is a ConfigError, zero owns nothing") {
  CHECK_THROWS(ConfigError, DeviceAllocation(0, -1));
  CHECK_THROWS(ConfigError, PinnedAllocation(-4096));
  DeviceAllocation empty(0, 0);
  CHECK(empty.data() == nullptr);
  CHECK_EQ(empty.size(), int64_t{0});
  PinnedAllocation empty_host(0);
  CHECK(empty_host.data() == nullptr);
  CHECK_EQ(empty_host.size(), int64_t{0});
}

TEST_CASE("the null stream is refused, naming the explicit alternatives") {
  try {
    require_explicit_stream(nullptr, "test");
    CHECK(false);
  } catch (const ConfigError& e) {
    CHECK(e.argument == "stream");
    CHECK(std::string(e.what()).find("cudaStreamLegacy") != std::string::npos);
  }
  require_explicit_stream(cudaStreamLegacy, "test");
  require_explicit_stream(cudaStreamPerThread, "test");
  CHECK_THROWS(ConfigError, Stream::borrow(nullptr, 0));
  char a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  char b[8] = {};
  CHECK_THROWS(ConfigError, copy_async(b, a, 8, nullptr, -1));
  CHECK_THROWS(ConfigError, copy_async(b, a, -1, cudaStreamLegacy, -1));
  CHECK_THROWS(ConfigError, copy_async(nullptr, a, 8, cudaStreamLegacy, -1));
  copy_async(nullptr, nullptr, 0, nullptr, -1);  // nothing to copy, nothing checked or called
  Stream none;
  CHECK(none.handle() == nullptr);
  CHECK(!none.owned());
  CHECK_THROWS(ConfigError, none.synchronize());
}

TEST_CASE("without a GPU the context says so with NoCudaDeviceError") {
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) {
    std::printf("  (a GPU is present: the no-GPU path is covered on CI)\n");
    return;
  }
  cudaGetLastError();
  CHECK_THROWS(NoCudaDeviceError, InferenceContext::instance(-1));
  CHECK_THROWS(NoCudaDeviceError, InferenceContext::instance(0));
  CHECK_THROWS(NoCudaDeviceError, DeviceAllocation(0, 1024));
  CHECK_THROWS(NoCudaDeviceError, Stream::create(0));
}

CHECK_MAIN()

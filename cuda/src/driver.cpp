#include "driver.hpp"

#include <string>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"

namespace inferctx::detail {

namespace {

// The ABI asked of the driver: every entry point below has kept its signature since CUDA 10.2
// (the _v10020 typedefs and older), and any driver that runs this build's runtime is at least 12.0.
constexpr unsigned int kDriverApiVersion = 12000;

template <class Fn>
void load(Fn& fn, const char* symbol, std::string& missing) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t status =
      cudaGetDriverEntryPointByVersion(symbol, &address, kDriverApiVersion, cudaEnableDefault, &found);
  if (status != cudaSuccess) {
    const std::string call = std::string("cudaGetDriverEntryPointByVersion(\"") + symbol + "\", " +
                             std::to_string(kDriverApiVersion) + ")";
    throw_cuda_error(status, call.c_str(), -1);
  }
  if (found != cudaDriverEntryPointSuccess || address == nullptr) {
    if (!missing.empty()) missing += ", ";
    missing += symbol;
    missing += found == cudaDriverEntryPointVersionNotSufficent ? " (too old)" : " (not found)";
    return;
  }
  fn = reinterpret_cast<Fn>(address);
}

DriverApi load_driver_api() {
  DriverApi api;
  load(api.get_error_name, "cuGetErrorName", api.missing);
  load(api.get_error_string, "cuGetErrorString", api.missing);
  load(api.device_get, "cuDeviceGet", api.missing);
  load(api.device_get_attribute, "cuDeviceGetAttribute", api.missing);
  load(api.ctx_get_current, "cuCtxGetCurrent", api.missing);
  load(api.stream_get_ctx, "cuStreamGetCtx", api.missing);
  load(api.get_granularity, "cuMemGetAllocationGranularity", api.missing);
  load(api.address_reserve, "cuMemAddressReserve", api.missing);
  load(api.address_free, "cuMemAddressFree", api.missing);
  load(api.create, "cuMemCreate", api.missing);
  load(api.release, "cuMemRelease", api.missing);
  load(api.map, "cuMemMap", api.missing);
  load(api.unmap, "cuMemUnmap", api.missing);
  load(api.set_access, "cuMemSetAccess", api.missing);
  return api;
}

}  // namespace

const DriverApi& driver() {
  static const DriverApi* const api = new DriverApi(load_driver_api());
  return *api;
}

[[noreturn]] void throw_driver_error(CUresult status, const std::string& call, int device) {
  const DriverApi& api = driver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (api.get_error_name == nullptr || api.get_error_name(status, &name) != CUDA_SUCCESS || name == nullptr) {
    name = "CUDA_ERROR_UNKNOWN";
  }
  if (api.get_error_string == nullptr || api.get_error_string(status, &text) != CUDA_SUCCESS || text == nullptr) {
    text = "unrecognized error code";
  }
  const std::string where = device >= 0 ? " on device " + std::to_string(device) : "";
  const std::string hint =
      (status == CUDA_ERROR_OUT_OF_MEMORY ? "; free memory on the device or plan a smaller workspace" : "") +
      process_state_hint(static_cast<int>(status));
  throw CudaError(std::string(name) + ": " + text + " (in " + call + where + ")" + hint, call,
                  static_cast<int>(status), name, device);
}

void check_driver(CUresult status, const std::string& call, int device) {
  if (status != CUDA_SUCCESS) throw_driver_error(status, call, device);
}

}  // namespace inferctx::detail

// The CUDA driver entry points inferctx calls, reached through the runtime
// (cudaGetDriverEntryPointByVersion), so that nothing links against libcuda. Internal to cuda/src.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

namespace inferctx::detail {

struct DriverApi {
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuCtxGetCurrent_v4000 ctx_get_current = nullptr;
  PFN_cuStreamGetCtx_v9020 stream_get_ctx = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 get_granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 address_free = nullptr;
  PFN_cuMemCreate_v10020 create = nullptr;
  PFN_cuMemRelease_v10020 release = nullptr;
  PFN_cuMemMap_v10020 map = nullptr;
  PFN_cuMemUnmap_v10020 unmap = nullptr;
  PFN_cuMemSetAccess_v10020 set_access = nullptr;
  std::string missing;  // the entry points the driver does not have, "" when it has them all
};

// Loaded on first use; a failure to ask (no driver) throws CudaError and is retried by the next
// caller. Never destroyed: allocations freed by static destructors at exit still reach the driver.
const DriverApi& driver();

// CudaError for a failed driver call: its name, text, the call and the device.
[[noreturn]] void throw_driver_error(CUresult status, const std::string& call, int device);
void check_driver(CUresult status, const std::string& call, int device);

}  // namespace inferctx::detail

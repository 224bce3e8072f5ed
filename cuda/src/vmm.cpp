#include "inferctx/vmm.hpp"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/plan.hpp"
#include "inferctx/stream.hpp"
#include "driver.hpp"

namespace inferctx {

namespace {

using detail::check_driver;
using detail::driver;
using detail::DriverApi;

// The driver entry points, or WorkspaceStateError when some are missing (callers check
// virtual_memory_unsupported_reason first; this guards the ones that did not).
const DriverApi& driver_with_vmm() {
  const DriverApi& api = driver();
  if (!api.missing.empty()) {
    throw WorkspaceStateError("CUDA virtual memory management is unavailable: the driver lacks " + api.missing);
  }
  return api;
}

std::string bytes_arg(int64_t bytes) { return std::to_string(bytes) + " bytes"; }

std::string at_arg(unsigned long long address, int64_t bytes) {
  char hex[32];
  std::snprintf(hex, sizeof hex, "%#llx", address);
  return std::string(hex) + ", " + bytes_arg(bytes);
}

// The driver calls below act in the device's primary context, which cudaSetDevice makes current
// on the calling thread (and initialises, since CUDA 12) even when the device is current already.
void bind_primary_context(int device) { INFERCTX_CUDA(cudaSetDevice(device), device); }

CUdevice driver_device(const DriverApi& api, int device) {
  CUdevice d = 0;
  check_driver(api.device_get(&d, device), "cuDeviceGet(" + std::to_string(device) + ")", device);
  return d;
}

// Pinned memory of `device` (`ordinal` in the runtime's numbering), usable by GPUDirect RDMA where
// the device allows it with virtual memory (as cudaMalloc memory is): NCCL and other network
// transports may then read and write the workspace in place.
CUmemAllocationProp pinned_device_memory(const DriverApi& api, int ordinal) {
  const CUdevice device = driver_device(api, ordinal);
  int rdma = 0;
  check_driver(api.device_get_attribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, device),
               "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)", ordinal);
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = static_cast<int>(device);
  prop.allocFlags.gpuDirectRDMACapable = rdma != 0 ? 1 : 0;
  return prop;
}

int resolve_device(int device) { return device < 0 ? current_device() : device; }

// Runs share(0) .. share(n - 1) at once: share(0) on the calling thread, the others in threads of
// their own (on the calling thread too when no thread can be had); returns when all are done.
// Each share binds its own thread to the device first (a new thread has no current context), so
// the calling thread ends with `device` current, as it began (its callers hold a device scope).
template <class Share>
void run_in_threads(size_t n, Share&& share) {
  std::vector<std::thread> threads;
  threads.reserve(n > 0 ? n - 1 : 0);
  size_t started = 1;
  try {
    for (; started < n; ++started) threads.emplace_back(share, started);
  } catch (...) {
    // No thread to be had: the shares left run on this one.
  }
  if (n > 0) share(size_t{0});
  for (size_t i = started; i < n; ++i) share(i);
  for (std::thread& t : threads) t.join();
}

// A virtual-memory driver call, which a test build may fail on purpose (fault::Site::virtual_memory).
template <class Call>
CUresult vm_call(Call&& call) {
  return fault::invoke<CUresult>(fault::Site::virtual_memory, std::forward<Call>(call));
}

}  // namespace

std::string virtual_memory_unsupported_reason(int device) {
  const DriverApi& api = driver();
  if (!api.missing.empty()) return "the CUDA driver lacks the entry points " + api.missing;
  int supported = 0;
  check_driver(api.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                        driver_device(api, device)),
               "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)", device);
  if (supported == 0) {
    return "device " + std::to_string(device) +
           " does not support virtual memory management (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED "
           "is 0)";
  }
  return "";
}

int64_t virtual_memory_granularity(int device) {
  const DriverApi& api = driver_with_vmm();
  const CUmemAllocationProp prop = pinned_device_memory(api, device);
  size_t granularity = 0;
  check_driver(api.get_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
               "cuMemGetAllocationGranularity(pinned device memory, CU_MEM_ALLOC_GRANULARITY_MINIMUM)", device);
  if (granularity == 0) {
    throw CudaError("cuMemGetAllocationGranularity gave 0 for pinned memory on device " + std::to_string(device),
                    "cuMemGetAllocationGranularity", static_cast<int>(CUDA_ERROR_INVALID_VALUE),
                    "CUDA_ERROR_INVALID_VALUE", device);
  }
  return static_cast<int64_t>(granularity);
}

VirtualAllocation::VirtualAllocation(int device, int64_t capacity)
    : DeviceAllocation(Borrowed{}, resolve_device(device), nullptr, 0) {
  if (capacity <= 0) {
    throw ConfigError("capacity", "capacity: VirtualAllocation got " + std::to_string(capacity) +
                                      "; it must be a positive byte count");
  }
  const DriverApi& api = driver_with_vmm();
  CurrentDeviceScope on(device_);
  bind_primary_context(device_);
  granularity_ = virtual_memory_granularity(device_);
  capacity_ = (capacity + granularity_ - 1) / granularity_ * granularity_;
  CUdeviceptr base = 0;
  check_driver(vm_call([&] {
                 return api.address_reserve(&base, static_cast<size_t>(capacity_), static_cast<size_t>(granularity_), 0, 0);
               }),
               "cuMemAddressReserve(" + bytes_arg(capacity_) + ", alignment " + std::to_string(granularity_) + ")",
               device_);
  base_ = base;
  ptr_ = reinterpret_cast<void*>(static_cast<uintptr_t>(base));
}

VirtualAllocation::~VirtualAllocation() {
  if (base_ == 0) return;
  const DriverApi& api = driver();
  CurrentDeviceScope on(device_, std::nothrow);
  if (cudaSetDevice(device_) != cudaSuccess) cudaGetLastError();
  if (!chunks_.empty()) {
    // As cudaFree does: work still queued (a graph replay, say) must not run on unmapped memory.
    if (cudaDeviceSynchronize() != cudaSuccess) cudaGetLastError();
    release_chunks(0);
  }
  if (api.address_free != nullptr) api.address_free(base_, static_cast<size_t>(capacity_));
}

int64_t VirtualAllocation::mapped_bytes() const noexcept { return accessible() ? bytes_ : 0; }

int64_t VirtualAllocation::round_up(int64_t bytes) const {
  if (bytes < 0 || bytes > capacity_) {
    throw ConfigError("bytes", "bytes: got " + std::to_string(bytes) + "; the reserved range on device " +
                                   std::to_string(device_) + " holds 0.." + std::to_string(capacity_) + " (" +
                                   human_bytes(capacity_) + ")");
  }
  return (bytes + granularity_ - 1) / granularity_ * granularity_;
}

bool VirtualAllocation::map(int64_t bytes, const void* restore, int64_t restore_bytes, cudaStream_t stream) {
  if (accessible()) throw WorkspaceStateError("VirtualAllocation::map: memory is mapped already");
  const int64_t target = round_up(bytes);
  if (restore_bytes <= 0) restore = nullptr;
  if (restore != nullptr) require_explicit_stream(stream, "VirtualAllocation::map");
  CurrentDeviceScope on(device_);
  bind_primary_context(device_);
  if (!map_range(0, target, restore, std::min(restore_bytes, target), stream)) return false;
  if (restore != nullptr) {
    const cudaError_t status = cudaStreamSynchronize(stream);
    if (status != cudaSuccess) {
      release_chunks(0);
      throw_cuda_error(status, "cudaStreamSynchronize (contents copied back from host memory)", device_);
    }
  }
  bytes_ = target;
  mapped_.store(true, std::memory_order_release);
  return true;
}

bool VirtualAllocation::grow(int64_t bytes) {
  if (!accessible()) throw WorkspaceStateError("VirtualAllocation::grow: nothing is mapped to grow");
  const int64_t target = round_up(bytes);
  if (target <= bytes_) return true;
  CurrentDeviceScope on(device_);
  bind_primary_context(device_);
  if (!map_range(bytes_, target, nullptr, 0, nullptr)) return false;
  bytes_ = target;
  return true;
}

bool VirtualAllocation::map_range(int64_t from, int64_t to, const void* restore, int64_t restore_bytes,
                                  cudaStream_t stream) {
  if (restore == nullptr && to - from >= kParallelBytes) return map_range_parallel(from, to);
  const DriverApi& api = driver_with_vmm();
  const CUmemAllocationProp prop = pinned_device_memory(api, device_);
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const size_t first = chunks_.size();
  // Undoes what this call mapped; the copies queued into it must be done first.
  auto undo = [&] {
    if (restore != nullptr && cudaStreamSynchronize(stream) != cudaSuccess) cudaGetLastError();
    release_chunks(first);
  };
  // Without contents to copy there is nothing to overlap: one handle, as few calls as cudaMalloc.
  const int64_t chunk = restore != nullptr ? kChunkBytes : to - from;
  try {
    for (int64_t offset = from; offset < to;) {
      const int64_t n = std::min(chunk, to - offset);
      const CUdeviceptr at = static_cast<CUdeviceptr>(base_ + static_cast<unsigned long long>(offset));
      CUmemGenericAllocationHandle handle = 0;
      CUresult status = vm_call([&] { return api.create(&handle, static_cast<size_t>(n), &prop, 0); });
      if (status == CUDA_ERROR_OUT_OF_MEMORY) {
        undo();
        return false;
      }
      check_driver(status, "cuMemCreate(" + bytes_arg(n) + ", pinned device memory)", device_);
      status = vm_call([&] { return api.map(at, static_cast<size_t>(n), 0, handle, 0); });
      if (status != CUDA_SUCCESS) {
        api.release(handle);
        if (status == CUDA_ERROR_OUT_OF_MEMORY) {
          undo();
          return false;
        }
        check_driver(status, "cuMemMap(" + at_arg(at, n) + ")", device_);
      }
      chunks_.push_back({offset, n, handle});
      status = vm_call([&] { return api.set_access(at, static_cast<size_t>(n), &access, 1); });
      if (status == CUDA_ERROR_OUT_OF_MEMORY) {
        undo();
        return false;
      }
      check_driver(status, "cuMemSetAccess(" + at_arg(at, n) + ", read/write for the device)", device_);
      const int64_t copy = restore != nullptr ? std::min(n, restore_bytes - offset) : 0;
      if (copy > 0) {
        // Queued now, it runs while the next chunk is being mapped.
        const auto* src = static_cast<const unsigned char*>(restore) + offset;
        INFERCTX_CUDA_AT(copy,
                         cudaMemcpyAsync(reinterpret_cast<void*>(static_cast<uintptr_t>(at)), src,
                                         static_cast<size_t>(copy), cudaMemcpyHostToDevice, stream),
                         device_);
      }
      offset += n;
    }
  } catch (...) {
    undo();
    throw;
  }
  return true;
}

bool VirtualAllocation::map_range_parallel(int64_t from, int64_t to) {
  const DriverApi& api = driver_with_vmm();
  const CUmemAllocationProp prop = pinned_device_memory(api, device_);
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  struct Part {
    int64_t offset = 0;
    int64_t bytes = 0;
    CUmemGenericAllocationHandle handle = 0;
    cudaError_t runtime = cudaSuccess;  // cudaSetDevice's, in the part's thread
    CUresult status = CUDA_SUCCESS;     // the first failed driver call's
    const char* call = nullptr;         // its name
  };
  const int64_t per = round_up((to - from + kMapThreads - 1) / kMapThreads);
  std::vector<Part> parts;
  for (int64_t offset = from; offset < to; offset += per) {
    Part p;
    p.offset = offset;
    p.bytes = std::min(per, to - offset);
    parts.push_back(p);
  }
  const int device = device_;
  const unsigned long long base = base_;
  auto run = [&api, &prop, device, base](Part& p) {
    p.runtime = cudaSetDevice(device);  // a thread of its own starts with no current context
    if (p.runtime != cudaSuccess) {
      p.call = "cudaSetDevice";
      return;
    }
    CUmemGenericAllocationHandle handle = 0;
    p.status = vm_call([&] { return api.create(&handle, static_cast<size_t>(p.bytes), &prop, 0); });
    if (p.status != CUDA_SUCCESS) {
      p.call = "cuMemCreate";
      return;
    }
    p.handle = handle;
    p.status = vm_call([&] {
      return api.map(static_cast<CUdeviceptr>(base + static_cast<unsigned long long>(p.offset)),
                     static_cast<size_t>(p.bytes), 0, handle, 0);
    });
    if (p.status != CUDA_SUCCESS) p.call = "cuMemMap";
  };
  run_in_threads(parts.size(), [&](size_t i) { run(parts[i]); });

  const size_t first = chunks_.size();
  for (const Part& p : parts) {
    if (p.handle != 0) chunks_.push_back({p.offset, p.bytes, p.handle});
  }
  for (const Part& p : parts) {
    if (p.call == nullptr) continue;
    release_chunks(first);  // unmapping a part never mapped fails harmlessly
    if (p.runtime != cudaSuccess) throw_cuda_error(p.runtime, p.call, device_);
    if (p.status == CUDA_ERROR_OUT_OF_MEMORY) return false;
    check_driver(p.status, std::string(p.call) + "(" + at_arg(base_ + static_cast<unsigned long long>(p.offset), p.bytes) + ")",
                 device_);
  }
  const CUdeviceptr at = static_cast<CUdeviceptr>(base_ + static_cast<unsigned long long>(from));
  const CUresult status = vm_call([&] { return api.set_access(at, static_cast<size_t>(to - from), &access, 1); });
  if (status != CUDA_SUCCESS) {
    release_chunks(first);
    if (status == CUDA_ERROR_OUT_OF_MEMORY) return false;
    check_driver(status, "cuMemSetAccess(" + at_arg(at, to - from) + ", read/write for the device)", device_);
  }
  return true;
}

void VirtualAllocation::unmap(void* save, cudaStream_t stream) {
  if (!accessible()) return;
  if (save != nullptr) require_explicit_stream(stream, "VirtualAllocation::unmap");
  CurrentDeviceScope on(device_);
  bind_primary_context(device_);
  std::vector<std::unique_ptr<Event>> copied;
  if (save != nullptr) {
    copied.reserve(chunks_.size());
    for (const Chunk& c : chunks_) {
      auto* dst = static_cast<unsigned char*>(save) + c.offset;
      const void* src = reinterpret_cast<const void*>(static_cast<uintptr_t>(base_ + c.offset));
      INFERCTX_CUDA_AT(copy, cudaMemcpyAsync(dst, src, static_cast<size_t>(c.bytes), cudaMemcpyDeviceToHost, stream),
                       device_);
      copied.push_back(std::make_unique<Event>(device_));
      copied.back()->record(stream);
    }
  }
  // From here on the memory is going, whatever fails: views refuse new exports.
  mapped_.store(false, std::memory_order_release);
  const DriverApi& api = driver_with_vmm();
  if (save == nullptr && chunks_.size() > 1 && bytes_ >= kParallelBytes) {
    unmap_parallel();
    return;
  }
  // After a failure at chunk `next`: the copies may still run into host memory that the caller
  // frees once this throws, so they finish first; then the rest goes, best effort.
  auto give_up_from = [&](size_t next) {
    if (!copied.empty() && cudaStreamSynchronize(stream) != cudaSuccess) cudaGetLastError();
    release_chunks(next);
    chunks_.clear();  // those before `next` are gone already
  };
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk c = chunks_[i];
    if (!copied.empty()) {
      try {
        copied[i]->synchronize();
      } catch (...) {
        give_up_from(i);
        throw;
      }
    }
    const CUdeviceptr at = static_cast<CUdeviceptr>(base_ + c.offset);
    const CUresult unmapped = vm_call([&] { return api.unmap(at, static_cast<size_t>(c.bytes)); });
    // A handle may be released while still mapped: its memory then goes with the mapping.
    const CUresult released = vm_call([&] { return api.release(c.handle); });
    if (unmapped != CUDA_SUCCESS || released != CUDA_SUCCESS) {
      // This chunk goes too, best effort: what failed is tried once more (a mapping left behind
      // would keep its memory and block the range for the next map).
      if (unmapped != CUDA_SUCCESS) api.unmap(at, static_cast<size_t>(c.bytes));
      if (released != CUDA_SUCCESS) api.release(c.handle);
      give_up_from(i + 1);
      check_driver(unmapped, "cuMemUnmap(" + at_arg(at, c.bytes) + ")", device_);
      check_driver(released, "cuMemRelease(" + bytes_arg(c.bytes) + ")", device_);
    }
  }
  chunks_.clear();
}

void VirtualAllocation::unmap_parallel() {
  const DriverApi& api = driver_with_vmm();
  struct Outcome {
    cudaError_t runtime = cudaSuccess;  // cudaSetDevice's, in the chunk's thread
    CUresult unmapped = CUDA_SUCCESS;
    CUresult released = CUDA_SUCCESS;
  };
  std::vector<Outcome> outcomes(chunks_.size());
  const int device = device_;
  const unsigned long long base = base_;
  const std::vector<Chunk>& chunks = chunks_;
  // Share t takes chunks t, t + shares, ...; each chunk is unmapped, then its handle released.
  const size_t shares = std::min(chunks_.size(), static_cast<size_t>(kMapThreads));
  run_in_threads(shares, [&api, &outcomes, &chunks, device, base, shares](size_t t) {
    const cudaError_t bound = cudaSetDevice(device);
    for (size_t i = t; i < chunks.size(); i += shares) {
      Outcome& o = outcomes[i];
      o.runtime = bound;
      if (bound != cudaSuccess) continue;
      o.unmapped = vm_call(
          [&] { return api.unmap(static_cast<CUdeviceptr>(base + chunks[i].offset), static_cast<size_t>(chunks[i].bytes)); });
      o.released = vm_call([&] { return api.release(chunks[i].handle); });
    }
  });
  // What failed is tried once more on this thread, so that no chunk keeps its memory or blocks the
  // range for the next map; then the first failure is reported.
  const Outcome* failed = nullptr;
  Chunk failed_chunk{};
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Outcome& o = outcomes[i];
    const bool unmap_again = o.runtime != cudaSuccess || o.unmapped != CUDA_SUCCESS;
    const bool release_again = o.runtime != cudaSuccess || o.released != CUDA_SUCCESS;
    if (unmap_again) api.unmap(static_cast<CUdeviceptr>(base_ + chunks_[i].offset), static_cast<size_t>(chunks_[i].bytes));
    if (release_again) api.release(chunks_[i].handle);
    if (failed == nullptr && (unmap_again || release_again)) {
      failed = &o;
      failed_chunk = chunks_[i];
    }
  }
  chunks_.clear();
  if (failed != nullptr) {
    const Chunk& c = failed_chunk;
    if (failed->runtime != cudaSuccess) throw_cuda_error(failed->runtime, "cudaSetDevice", device_);
    check_driver(failed->unmapped, "cuMemUnmap(" + at_arg(base_ + c.offset, c.bytes) + ")", device_);
    check_driver(failed->released, "cuMemRelease(" + bytes_arg(c.bytes) + ")", device_);
  }
}

void VirtualAllocation::release_chunks(size_t first) noexcept {
  const DriverApi& api = driver();
  for (size_t i = first; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    if (api.unmap != nullptr) api.unmap(static_cast<CUdeviceptr>(base_ + c.offset), static_cast<size_t>(c.bytes));
    if (api.release != nullptr) api.release(c.handle);
  }
  chunks_.resize(std::min(first, chunks_.size()));
}

}  // namespace inferctx

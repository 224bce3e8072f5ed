// Device memory at addresses that survive its release, through CUDA virtual memory management:
// an address range is reserved once, physical memory is created (cuMemCreate) and mapped into
// it, and returned again (cuMemUnmap, cuMemRelease) while the range, and so every pointer into
// it, stays reserved. Mapping memory there again gives the same addresses back, so views, DLPack
// capsules and captured CUDA graphs that hold them stay valid across a release.
//
// The driver's entry points are reached through the runtime (cudaGetDriverEntryPointByVersion),
// so nothing links libcuda; cuda.h is included for its types only.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "inferctx/memory.hpp"

namespace inferctx {

// Why `device` cannot hold memory this way, or "" when it can: an entry point the driver does not
// have, or CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0. Other failures throw.
std::string virtual_memory_unsupported_reason(int device);

// The granularity (cuMemGetAllocationGranularity, minimum) of pinned memory on `device`: physical
// memory is created and mapped in whole multiples of it (2 MiB on current GPUs).
int64_t virtual_memory_granularity(int device);

// One reserved address range of `capacity` bytes on one device, mapped from its start: bytes
// [0, size()) are backed by physical memory while accessible(), and size() is what views may
// span. Not thread-safe: the owner (the context) serialises calls; accessible() may be read from
// any thread.
//
// Physical memory comes in chunks, each its own cuMemCreate handle: one for a whole map() or
// grow() of less than kParallelBytes (the fewest driver calls, as one cudaMalloc makes), or
// kMapThreads chunks created and mapped at once by as many threads for a larger one (the
// driver's work per handle grows with its size and runs concurrently: on an H200, 104 GiB took
// 265 ms in 4 threads against 303 ms as one handle and 302 ms for cudaMalloc), or chunks of at
// most kChunkBytes when contents are copied in, so that the copy of one chunk runs while the next
// is being mapped. A grow adds chunks without touching those mapped before. An unmap of such a
// mapping without contents to save releases its chunks in as many threads.
class VirtualAllocation final : public DeviceAllocation {
 public:
  static constexpr int64_t kChunkBytes = int64_t{2} << 30;
  static constexpr int64_t kParallelBytes = int64_t{8} << 30;
  static constexpr int kMapThreads = 4;

  // Reserves `capacity` bytes (rounded up to the granularity) of addresses on `device` (-1: the
  // current one), aligned to the granularity. Nothing is mapped yet: size() is 0.
  VirtualAllocation(int device, int64_t capacity);
  // Unmaps and releases what is mapped and frees the address range.
  ~VirtualAllocation() override;

  bool accessible() const noexcept override { return mapped_.load(std::memory_order_acquire); }
  int64_t granularity() const noexcept { return granularity_; }
  int64_t capacity() const noexcept { return capacity_; }
  int64_t mapped_bytes() const noexcept;   // physical bytes held now (size() or 0)
  int64_t round_up(int64_t bytes) const;   // to the granularity; ConfigError past the capacity

  // While nothing is mapped: backs [0, round_up(bytes)) of the range and makes it readable and
  // writable by the device; size() becomes that. With `restore` (host memory, page-locked for an
  // asynchronous copy), its first `restore_bytes` bytes are copied to the start of the range on
  // `stream`, each chunk's part right after the chunk is mapped, and the call returns once the
  // copies are complete. Returns false, with nothing mapped and size() as it was, when the device
  // is out of memory; any other failure throws CudaError (also with nothing mapped).
  bool map(int64_t bytes, const void* restore, int64_t restore_bytes, cudaStream_t stream);

  // While mapped: extends the mapping to [0, round_up(bytes)) (a smaller `bytes` does nothing).
  // Returns false, with the mapping as it was, when the device is out of memory.
  bool grow(int64_t bytes);

  // Returns all physical memory; the range stays reserved and size() stays, for the next map().
  // With `save` (page-locked host memory of size() bytes), the contents are first copied there on
  // `stream`: every copy is queued before anything is unmapped (a failure to queue them leaves the
  // mapping untouched), and each chunk is unmapped once its copy is complete. The caller orders
  // the work that uses the memory before this call (see InferenceContext::release_workspace).
  void unmap(void* save, cudaStream_t stream);

 private:
  struct Chunk {
    int64_t offset;
    int64_t bytes;
    unsigned long long handle;  // CUmemGenericAllocationHandle
  };

  // Creates, maps and opens [from, to), appending to chunks_: one chunk, or with `restore` chunks of
  // kChunkBytes, each followed by the queued copy of its part of restore[0, restore_bytes). False
  // on out of memory after undoing the chunks it added; throws after undoing them on any other
  // failure.
  bool map_range(int64_t from, int64_t to, const void* restore, int64_t restore_bytes, cudaStream_t stream);
  // map_range without contents for a range of at least kParallelBytes: kMapThreads chunks
  // created and mapped concurrently (the calling thread takes one), then one cuMemSetAccess.
  bool map_range_parallel(int64_t from, int64_t to);
  // unmap() without contents to save, of a mapping of at least kParallelBytes in several chunks:
  // the chunks unmapped and released by up to kMapThreads threads (the calling thread takes a
  // share), as they were mapped; a failed call is tried once more, then reported.
  void unmap_parallel();
  // Unmaps and releases chunks_[first..] and forgets them; best effort, for failure paths and the
  // destructor.
  void release_chunks(size_t first) noexcept;

  int64_t granularity_ = 0;
  int64_t capacity_ = 0;
  unsigned long long base_ = 0;  // CUdeviceptr of the reservation
  std::vector<Chunk> chunks_;
  std::atomic<bool> mapped_{false};
};

}  // namespace inferctx

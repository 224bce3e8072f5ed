// Graph RNG state: capture-time bookkeeping of call sites, their device slots and the CUDA user
// objects that tie those slots to the graphs' lifetimes (see graph_rng.hpp for the scheme).
#include "inferctx/graph_rng.hpp"

#include <cuda_runtime.h>

#include <new>
#include <utility>
#include <string>
#include <vector>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/stream.hpp"
#include "graph_rng.cuh"

namespace inferctx {

namespace {

// Slots per allocation: 32 KiB. A decode graph takes one slot per dropout call site, so one
// slab holds a few dozen captured graphs of a 32-layer model.
constexpr int64_t kSlabSlots = 1024;

bool special_stream(cudaStream_t stream) {
  return stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread;
}

// The node to capture after a drawing kernel that does not advance its site itself: replay r
// leaves r + 1 for the next one (1 when the slot was not this site's in this epoch).
__global__ void advance_site_kernel(const GraphRngHeader* header, GraphRngSlot* slot, uint64_t uid,
                                    uint64_t max_replays) {
  const detail::GraphDraw d = detail::read_graph_draw(header, slot, uid);
  detail::write_graph_slot(slot, uid, d.epoch, detail::next_graph_replay(d.replay, max_replays));
}

__global__ void write_header_kernel(GraphRngHeader* header, uint64_t seed, uint64_t epoch) {
  *reinterpret_cast<ulonglong2*>(header) = make_ulonglong2(seed, epoch);
}

// The calling thread's capture interaction mode set to relaxed for a scope: the allocations made
// at capture time are not part of the graph, and cudaMalloc is a "potentially unsafe" call that
// would otherwise invalidate a capture begun in the global mode (torch.cuda.graph's default).
class RelaxedCaptureMode {
 public:
  explicit RelaxedCaptureMode(int device) {
    INFERCTX_CUDA(cudaThreadExchangeStreamCaptureMode(&mode_), device);
  }
  ~RelaxedCaptureMode() {
    if (cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess) cudaGetLastError();
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Device memory freed on scope exit unless released.
class ScopedDeviceMemory {
 public:
  ScopedDeviceMemory() = default;
  ~ScopedDeviceMemory() {
    if (ptr_ != nullptr && cudaFree(ptr_) != cudaSuccess) cudaGetLastError();
  }
  ScopedDeviceMemory(const ScopedDeviceMemory&) = delete;
  ScopedDeviceMemory& operator=(const ScopedDeviceMemory&) = delete;
  void allocate(int device, size_t bytes) { INFERCTX_CUDA_AT(device_alloc, cudaMalloc(&ptr_, bytes), device); }
  void* get() const noexcept { return ptr_; }
  void* release() noexcept {
    void* p = ptr_;
    ptr_ = nullptr;
    return p;
  }

 private:
  void* ptr_ = nullptr;
};

}  // namespace

// Owned by the GraphRng while its context lives; then by the last site alive (see ~GraphRng).
struct GraphRng::Shared {
  int device = -1;
  std::mutex mutex;  // guards everything below; user-object destructors take it
  GraphRngHeader* header = nullptr;
  std::vector<GraphRngSlot*> slabs;
  std::vector<GraphRngSlot*> free_slots;
  cudaStream_t init_stream = nullptr;  // non-blocking: initial writes never touch a capturing stream
  uint64_t next_uid = 1;
  int64_t live = 0;       // sites whose graph still holds them
  bool orphaned = false;  // the GraphRng is gone

  // Frees the device memory and the stream (a normal thread, never a user-object destructor).
  void free_device() noexcept {
    for (GraphRngSlot* slab : slabs)
      if (cudaFree(slab) != cudaSuccess) cudaGetLastError();
    slabs.clear();
    free_slots.clear();
    if (header != nullptr && cudaFree(header) != cudaSuccess) cudaGetLastError();
    header = nullptr;
    if (init_stream != nullptr && cudaStreamDestroy(init_stream) != cudaSuccess) cudaGetLastError();
    init_stream = nullptr;
  }
};

namespace {

// The payload of a site's user object.
struct SiteHold {
  GraphRng::Shared* shared;
  GraphRngSlot* slot;
};

// User-object destructor: runs on a CUDA thread once the graph and every executable graph made
// from it are destroyed (after their launches complete). It may not call CUDA, so it only gives
// the slot back; the next site to take the slot has another uid, so it starts from replay 0.
void CUDART_CB release_site(void* payload) {
  auto* hold = static_cast<SiteHold*>(payload);
  GraphRng::Shared* shared = hold->shared;
  bool last = false;
  {
    std::lock_guard<std::mutex> lock(shared->mutex);
    shared->free_slots.push_back(hold->slot);
    --shared->live;
    last = shared->orphaned && shared->live == 0;
  }
  delete hold;
  // The context is gone and this was its last graph: the bookkeeping goes, the device memory is
  // left for the process's end (no CUDA call is allowed here).
  if (last) delete shared;
}

}  // namespace

bool stream_capturing(cudaStream_t stream, int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  INFERCTX_CUDA(cudaStreamIsCapturing(stream, &status), device);
  if (status == cudaStreamCaptureStatusInvalidated)
    throw_cuda_error(cudaErrorStreamCaptureInvalidated, "cudaStreamIsCapturing", device);
  return status == cudaStreamCaptureStatusActive;
}

void advance_graph_site(const GraphPhilox& site, cudaStream_t stream, int device) {
  if (site.header == nullptr || site.slot == nullptr || site.uid == 0)
    throw ConfigError("site", "site: not a captured call site (null state or uid 0)");
  if (site.step % 4 != 0 || site.step == 0 || site.step > kGraphMaxStep)
    throw ConfigError("site", "site: step " + std::to_string(site.step) + " is not a multiple of 4 in [4, 2^62]");
  CurrentDeviceScope scoped(device);
  advance_site_kernel<<<1, 1, 0, stream>>>(site.header, site.slot, site.uid, graph_max_replays(site.step));
  INFERCTX_CUDA(cudaGetLastError(), scoped.device());
}

GraphRng::GraphRng(int device, PhiloxState& philox) : device_(device), philox_(philox), shared_(new Shared) {
  shared_->device = device;
}

GraphRng::~GraphRng() {
  if (header_written_ != nullptr) {
    CurrentDeviceScope on(device_, std::nothrow);
    if (cudaEventDestroy(header_written_) != cudaSuccess) cudaGetLastError();
  }
  bool free_now = false;
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->orphaned = true;
    free_now = shared_->live == 0;
  }
  // Otherwise graphs still replay from this memory; the last one's destructor takes `shared_`.
  if (free_now) {
    CurrentDeviceScope on(device_, std::nothrow);
    shared_->free_device();
    delete shared_;
  }
}

PhiloxSource GraphRng::draw(cudaStream_t stream, uint64_t increment) {
  bool capturing;
  if (special_stream(stream)) {
    // The special handles name a stream of the current device: the context's one here.
    CurrentDeviceScope on(device_);
    capturing = stream_capturing(stream, device_);
  } else {
    capturing = stream_capturing(stream, device_);
  }
  if (!capturing) {
    const std::pair<uint64_t, uint64_t> s = philox_.increment_offset(increment);
    return PhiloxSource::host(s.first, s.second);
  }
  return PhiloxSource::site(capture(stream, increment));
}

void GraphRng::ensure_slot_locked() {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    if (shared_->header != nullptr && !shared_->free_slots.empty()) return;
  }
  RelaxedCaptureMode relaxed(device_);
  if (shared_->init_stream == nullptr) {
    cudaStream_t s = nullptr;
    INFERCTX_CUDA_AT(stream, cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), device_);
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->init_stream = s;
  }
  // header and init_stream change only here and in ~GraphRng, both under mutex_ (held).
  const cudaStream_t init = shared_->init_stream;
  ScopedDeviceMemory header;
  if (shared_->header == nullptr) {
    header.allocate(device_, sizeof(GraphRngHeader));
    const PhiloxSnapshot snap = philox_.snapshot();  // set_seed waits for mutex_, which we hold
    write_header_kernel<<<1, 1, 0, init>>>(static_cast<GraphRngHeader*>(header.get()), snap.seed, snap.epoch);
    INFERCTX_CUDA(cudaGetLastError(), device_);
  }
  ScopedDeviceMemory slab;
  slab.allocate(device_, sizeof(GraphRngSlot) * kSlabSlots);
  // Zero: uid 0 belongs to no site, so every slot starts at replay 0.
  INFERCTX_CUDA(cudaMemsetAsync(slab.get(), 0, sizeof(GraphRngSlot) * kSlabSlots, init), device_);
  // Before any replay can read them (the capture has not even ended yet).
  INFERCTX_CUDA(cudaStreamSynchronize(init), device_);

  std::lock_guard<std::mutex> lock(shared_->mutex);
  if (header.get() != nullptr) shared_->header = static_cast<GraphRngHeader*>(header.release());
  auto* slots = static_cast<GraphRngSlot*>(slab.release());
  shared_->slabs.push_back(slots);
  for (int64_t i = kSlabSlots - 1; i >= 0; --i) shared_->free_slots.push_back(slots + i);
}

GraphPhilox GraphRng::capture(cudaStream_t stream, uint64_t increment) {
  if (increment > kGraphMaxStep)
    throw ConfigError("increment", "increment: got " + std::to_string(increment) +
                                       "; a draw captured into a CUDA graph takes at most 2^62 values per element "
                                       "group");
  CurrentDeviceScope on(device_);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long capture_id = 0;
  cudaGraph_t graph = nullptr;
  INFERCTX_CUDA(cudaStreamGetCaptureInfo(stream, &status, &capture_id, &graph), device_);
  if (status == cudaStreamCaptureStatusInvalidated)
    throw_cuda_error(cudaErrorStreamCaptureInvalidated, "cudaStreamGetCaptureInfo", device_);
  if (status != cudaStreamCaptureStatusActive || graph == nullptr)
    throw ConfigError("stream", "stream: is not capturing a CUDA graph; a call site is taken only under capture");
  // Not cudaStreamGetDevice, which would end the capture in error (see stream_is_on_device).
  if (!stream_is_on_device(stream, device_))
    throw ConfigError("stream", "stream: captures on another device than the context's (cuda:" +
                                    std::to_string(device_) + "); capture on a stream of cuda:" +
                                    std::to_string(device_));

  std::lock_guard<std::mutex> lock(mutex_);
  // Numbers are taken last, once nothing can fail, so that a failed capture leaves the sequence
  // as it was; only the limit is checked first.
  if (philox_.snapshot().sites >= kGraphSites) philox_.capture_site();  // throws ConfigError("site")
  ensure_slot_locked();

  GraphRngSlot* slot = nullptr;
  uint64_t uid = 0;
  {
    std::lock_guard<std::mutex> guard(shared_->mutex);
    slot = shared_->free_slots.back();
    shared_->free_slots.pop_back();
    uid = shared_->next_uid++;
    ++shared_->live;
  }
  auto* hold = new SiteHold{shared_, slot};
  cudaUserObject_t object = nullptr;
  cudaError_t rc = cudaUserObjectCreate(&object, hold, release_site, 1, cudaUserObjectNoDestructorSync);
  if (rc != cudaSuccess) {
    release_site(hold);
    throw_cuda_error(rc, "cudaUserObjectCreate", device_);
  }
  // The graph takes our reference: the slot lives as long as the graph or an executable of it.
  rc = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
  if (rc != cudaSuccess) {
    if (cudaUserObjectRelease(object, 1) != cudaSuccess) cudaGetLastError();  // runs release_site
    throw_cuda_error(rc, "cudaGraphRetainUserObject", device_);
  }
  const GraphSite site = philox_.capture_site();
  GraphPhilox g;
  {
    std::lock_guard<std::mutex> guard(shared_->mutex);
    g.header = shared_->header;
  }
  g.slot = slot;
  g.uid = uid;
  g.site = site.site;
  g.step = graph_step(increment);
  return g;
}

void GraphRng::set_seed(uint64_t seed, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  GraphRngHeader* header = nullptr;
  {
    std::lock_guard<std::mutex> guard(shared_->mutex);
    header = shared_->header;
  }
  if (header != nullptr) {
    // The header is written first: if that fails, nothing has changed.
    CurrentDeviceScope on(device_);
    if (stream_capturing(stream, device_)) {
      throw ConfigError("stream", "set_seed: the context's stream is capturing a CUDA graph, which would bake the "
                                  "reset into every replay; call set_seed before or after the capture");
    }
    // Two set_seed calls on different streams would otherwise write in either order on the GPU:
    // the header could keep the earlier seed while the host state has the later one.
    if (header_written_ == nullptr) {
      INFERCTX_CUDA_AT(event, cudaEventCreateWithFlags(&header_written_, cudaEventDisableTiming), device_);
    } else {
      INFERCTX_CUDA(cudaStreamWaitEvent(stream, header_written_, 0), device_);
    }
    write_header_kernel<<<1, 1, 0, stream>>>(header, seed, philox_.snapshot().epoch + 1);
    INFERCTX_CUDA(cudaGetLastError(), device_);
    INFERCTX_CUDA(cudaEventRecord(header_written_, stream), device_);
  }
  philox_.set_seed(seed);
}

GraphRngStats GraphRng::stats() const {
  const PhiloxSnapshot snap = philox_.snapshot();
  std::lock_guard<std::mutex> guard(shared_->mutex);
  return {snap.seed, snap.offset, snap.epoch, snap.sites, shared_->live,
          static_cast<int64_t>(shared_->slabs.size()) * kSlabSlots};
}

}  // namespace inferctx

// Philox draws that stay fresh at every replay of a CUDA graph.
//
// Under stream capture a kernel's arguments are baked into the graph, so a (seed, offset) read
// on the host at capture would give every replay the same numbers. A kernel captured through
// the context instead reads its Philox state from device memory at run time:
//
// - At capture (GraphRng::capture, on the host, once per call site): the site gets the next site
//   number k of the context's PhiloxState (philox.hpp: subsequences k * 2^36 + i / 4), a slot of
//   device memory holding its replay counter, and a CUDA user object, retained by the graph being
//   captured, that keeps the slot (and the context's device header) alive for as long as the
//   graph or any executable graph instantiated from it exists.
// - At replay (no host call): every block of the kernel reads the seed from the header and the
//   replay number r from the slot, and draws with offset 2^63 + step * r (step 4 for dropout).
//   Then each block counts itself in the slot's arrivals (an acq_rel atomic); the last block to
//   arrive, when every block has read the state, advances the slot to r + 1 and clears the
//   count. So a captured call stays one kernel node. (A kernel that cannot do this is followed
//   by advance_graph_site's one-thread node instead.) Launches of one executable graph are
//   serialised by CUDA, so replay r + 1 always sees the counter that replay r left. (Executable
//   graphs instantiated twice from one captured graph share its counters: do not run those
//   concurrently.)
// - set_seed: the host state restarts (philox.hpp) and the header gets the new seed and a new
//   epoch, written by a one-thread kernel on the stream passed (the context's compute stream), so
//   it is ordered after the replays queued there before and before those queued after, and after
//   the header write of the previous set_seed whatever stream that one was given. A slot
//   whose epoch is not the header's counts as 0 replays: every graph starts again from replay 0
//   with the new seed, with no host call per graph. Once a site was ever captured, set_seed
//   refuses to run while that stream is capturing (the write would be baked into the graph);
//   before that it is host work only.
//
// Lifetimes: the device memory (header and slots) is shared by the context and the graphs. A
// graph that outlives its context keeps replaying correctly from memory that its user object
// keeps allocated; the context's destructor frees the memory only when no graph holds a site,
// and a graph destroyed later cannot free it (user-object destructors run on a CUDA thread
// that may not call CUDA), so it is then released with the process. Contexts live as long as
// the process, so that is the only time this happens.
//
// Capture-time errors (all before anything is captured for the call): a stream of another
// device than the context's (ConfigError "stream"), a capture that is invalidated, more than
// 2^28 sites on one context (ConfigError "site"), and any failed CUDA call (CudaError). Device
// memory is allocated at capture time, in slabs, under the relaxed capture mode so that a capture
// started in the global mode (torch.cuda.graph's default) is not invalidated by cudaMalloc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>

#include "inferctx/philox.hpp"

namespace inferctx {

// Device words read by the captured kernels (layouts shared with cuda/src/graph_rng.cuh).
struct alignas(16) GraphRngHeader {
  uint64_t seed;
  uint64_t epoch;
};

struct alignas(32) GraphRngSlot {
  uint64_t replays;  // replays run since `epoch` began (valid only while epoch and uid match)
  uint64_t epoch;
  uint64_t uid;      // the site that owns the slot now (slots are reused after a graph dies)
  uint64_t arrivals; // blocks of the running launch that have read the state (0 between launches)
};

// One captured call site: what its kernels read at replay time.
struct GraphPhilox {
  const GraphRngHeader* header = nullptr;
  GraphRngSlot* slot = nullptr;
  uint64_t uid = 0;   // never 0 for a real site (a zeroed slot then belongs to nobody)
  uint64_t site = 0;  // k: subsequences start at k << kGraphSiteShift
  uint64_t step = 4;  // offset step per replay (graph_step of the increment): offsets 2^63 + step * r
};

// Where a kernel's Philox state comes from: host values (eager calls, explicit seed/offset; under
// capture these are baked into the graph) or a captured call site.
struct PhiloxSource {
  bool captured = false;
  uint64_t seed = 0;
  uint64_t offset = 0;
  GraphPhilox graph;

  static PhiloxSource host(uint64_t seed, uint64_t offset) {
    PhiloxSource s;
    s.seed = seed;
    s.offset = offset;
    return s;
  }
  static PhiloxSource site(const GraphPhilox& g) {
    PhiloxSource s;
    s.captured = true;
    s.graph = g;
    return s;
  }
};

// Counters of a context's graph RNG state (host bookkeeping; no device read).
struct GraphRngStats {
  uint64_t seed;
  uint64_t offset;       // the next eager offset
  uint64_t epoch;        // set_seed calls so far
  uint64_t sites;        // call sites captured so far (never reset, set_seed included)
  int64_t live_sites;    // sites whose graph (or an executable graph of it) still exists
  int64_t slots;         // device slots allocated (live or free for reuse)
};

// True while `stream` is capturing (one driver query, no lock). CudaError for a capture that was
// invalidated, and for the legacy stream while a blocking stream is capturing.
bool stream_capturing(cudaStream_t stream, int device);

// Queues on `stream` the advance of `site`'s replay counter: the node to follow a captured kernel
// that reads the site's state but does not advance it itself (dropout's kernels do). Also usable
// outside capture (then it counts a call).
void advance_graph_site(const GraphPhilox& site, cudaStream_t stream, int device = -1);

class GraphRng {
 public:
  // The graph state of the context of `device`, numbering sites from `philox` (the context's
  // state, which must outlive this object).
  GraphRng(int device, PhiloxState& philox);
  ~GraphRng();
  GraphRng(const GraphRng&) = delete;
  GraphRng& operator=(const GraphRng&) = delete;

  // The Philox source for a kernel that draws `increment` values on `stream`: the host state's
  // increment_offset(increment) when the stream is not capturing (one capture query more than
  // increment_offset alone), a new call site (capture) when it is.
  PhiloxSource draw(cudaStream_t stream, uint64_t increment);
  // A new call site, drawing `increment` values per element group, of the graph being captured on
  // `stream` (see the errors above; ConfigError("increment") past kGraphMaxStep).
  GraphPhilox capture(cudaStream_t stream, uint64_t increment);
  // PhiloxState::set_seed, and the device header's reset ordered on `stream`.
  void set_seed(uint64_t seed, cudaStream_t stream);
  GraphRngStats stats() const;
  int device() const noexcept { return device_; }

  struct Shared;  // device memory and slot bookkeeping, shared with the graphs' user objects

 private:
  void ensure_slot_locked();  // mutex_ held

  int device_;
  PhiloxState& philox_;
  mutable std::mutex mutex_;  // orders capture and set_seed (site numbers and the header)
  Shared* shared_;
  // Recorded after each header write of set_seed (made at the first): the next write, on whatever
  // stream it is given, waits for it, so the header ends as the last set_seed on the host left it.
  cudaEvent_t header_written_ = nullptr;
};

}  // namespace inferctx

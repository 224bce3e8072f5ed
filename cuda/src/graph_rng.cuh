// Device side of the graph draws (graph_rng.hpp): how a kernel captured at a call site reads its
// Philox state at run time. Included by the kernels that draw (through dropout_philox.cuh) and
// by graph_rng.cu.
#pragma once

#include <cuda/atomic>
#include <cuda_runtime.h>

#include <cstdint>

#include "inferctx/graph_rng.hpp"

namespace inferctx {
namespace detail {

struct GraphDraw {
  uint64_t seed;
  uint64_t epoch;
  uint64_t replay;  // replays this site has run since the epoch began
};

// The header's seed and epoch, and the site's replay number: the slot's count while the slot
// belongs to this site (uid) in this epoch, 0 otherwise (a slot just taken, or after set_seed).
// Plain loads: the slot is written only by other kernels, before this one starts.
__device__ __forceinline__ GraphDraw read_graph_draw(const GraphRngHeader* header, const GraphRngSlot* slot,
                                                     uint64_t uid) {
  const ulonglong2 h = *reinterpret_cast<const ulonglong2*>(header);           // seed, epoch
  const ulonglong2 count = *reinterpret_cast<const ulonglong2*>(slot);         // replays, epoch
  const ulonglong2 owner = *(reinterpret_cast<const ulonglong2*>(slot) + 1);   // uid, arrivals
  GraphDraw d;
  d.seed = h.x;
  d.epoch = h.y;
  d.replay = (owner.x == uid && count.y == h.y) ? count.x : 0;
  return d;
}

// Writes the slot for the next launch: replay `next` of this site in epoch d.epoch, no arrivals.
__device__ __forceinline__ void write_graph_slot(GraphRngSlot* slot, uint64_t uid, uint64_t epoch, uint64_t next) {
  *reinterpret_cast<ulonglong2*>(slot) = make_ulonglong2(next, epoch);
  *(reinterpret_cast<ulonglong2*>(slot) + 1) = make_ulonglong2(uid, 0);
}

// The replay number after `replay`, saturating at the last one a site of `max_replays` allows
// (2^61 for dropout, never reached in practice) rather than wrapping into the eager half.
__device__ __forceinline__ uint64_t next_graph_replay(uint64_t replay, uint64_t max_replays) {
  return replay + 1 < max_replays ? replay + 1 : max_replays - 1;
}

// Called by every thread of every block once the block's threads have read the state (`d`):
// thread 0 counts the block in the slot's arrivals, and the last block of the grid to arrive,
// when no block can still read the slot, advances it for the next launch. The arrival is an
// acq_rel atomic at device scope: every block's reads (ordered before its thread 0 by the
// barrier) happen before the last block's write.
__device__ __forceinline__ void arrive_and_advance(GraphRngSlot* slot, uint64_t uid, const GraphDraw& d,
                                                   uint64_t max_replays) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  cuda::atomic_ref<unsigned long long, cuda::thread_scope_device> arrivals(
      *reinterpret_cast<unsigned long long*>(&slot->arrivals));
  const unsigned long long before = arrivals.fetch_add(1ull, cuda::memory_order_acq_rel);
  if (before + 1 == static_cast<unsigned long long>(gridDim.x) * gridDim.y * gridDim.z)
    write_graph_slot(slot, uid, d.epoch, next_graph_replay(d.replay, max_replays));
}

}  // namespace detail
}  // namespace inferctx

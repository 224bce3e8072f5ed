// Device side of the graph draws (graph_rng.hpp): how a kernel captured at a call site reads its
// Philox state at run time. Included by the kernels that draw (dropout.cu) and by graph_rng.cu.
#pragma once

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
  const ulonglong2 owner = *(reinterpret_cast<const ulonglong2*>(slot) + 1);   // uid, reserved
  GraphDraw d;
  d.seed = h.x;
  d.epoch = h.y;
  d.replay = (owner.x == uid && count.y == h.y) ? count.x : 0;
  return d;
}

}  // namespace detail
}  // namespace inferctx

// The Philox side of the dropout kernels (dropout_kernels.cu): the block of outputs an element
// draws from, with the call's inputs taken from the host (an eager call) or formed at run time
// from a call site's state (a call captured into a CUDA graph). Internal to cuda/src.
//
// The Philox counter of element i is {offset/4, i/4} (128 bits); the key schedule and the first
// round's product of the offset word are the same for every element and are computed once on
// the host, so they reach the kernel through its parameter space (constant bank) and cost no
// registers.
//
// A call captured into a CUDA graph (graph_rng.hpp) cannot take its Philox inputs from the host:
// they change at every replay. The same kernels are instantiated for a second source of inputs,
// GraphPhiloxParams, from which each thread forms them at run time (the seed from the context's
// header, the counter from the site's replay number, the site folded into the subsequence's top
// word); the key schedule is then key + r * (W0, W1), one add per round, rather than 20 registers.
// The last block to have read the state advances the site for the next replay (graph_rng.cuh:
// arrive_and_advance), so a captured call is one kernel node. The eager instantiations take the
// inputs from the parameter space exactly as before.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "inferctx/graph_rng.hpp"
#include "graph_rng.cuh"

namespace inferctx {
namespace detail {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// Philox4x32-10 inputs shared by every element of one call.
struct PhiloxConstants {
  uint32_t key0[kPhiloxRounds];  // round r uses key + r * (W0, W1)
  uint32_t key1[kPhiloxRounds];
  uint32_t r1_x;  // round 1, counter word 1 and key word 0: ctr1 ^ key0
  uint32_t r1_z;  // round 1: hi32(M0 * ctr0) ^ key1
  uint32_t r1_w;  // round 1: lo32(M0 * ctr0)

  __device__ __forceinline__ uint32_t k0(int r) const { return key0[r]; }
  __device__ __forceinline__ uint32_t k1(int r) const { return key1[r]; }
};

// The same inputs formed in registers by each thread of a captured call (philox_inputs below).
struct PhiloxRegisters {
  uint32_t seed0, seed1;  // the key
  uint32_t r1_x, r1_z, r1_w;

  __device__ __forceinline__ uint32_t k0(int r) const { return seed0 + static_cast<uint32_t>(r) * kPhiloxW0; }
  __device__ __forceinline__ uint32_t k1(int r) const { return seed1 + static_cast<uint32_t>(r) * kPhiloxW1; }
};

// What a captured call's kernel gets: where its site's state lives.
struct GraphPhiloxParams {
  const GraphRngHeader* header;
  GraphRngSlot* slot;
  uint64_t uid;
  uint64_t counters_per_replay;  // the site's offset step / 4
  uint64_t max_replays;          // graph_max_replays(step)
  uint32_t site_word;            // site << 4: subsequence (site << 36) + i / 4 has top word site_word | hi32(i / 4)
};

// The Philox inputs of a call: the parameter-space constants themselves (eager), or, for a
// captured call, those of replay r of its site: counter (2^63 + step * r) / 4, key = the seed read
// now, and the site's subsequence band folded into round 1's z word (z = r1_z ^ hi32(subsequence)
// and site_word's bits are above those of hi32(i / 4) < 2^4). Every thread of the block calls it
// (the captured form counts the block in the site's arrivals: a barrier).
__device__ __forceinline__ const PhiloxConstants& philox_inputs(const PhiloxConstants& c) { return c; }

__device__ __forceinline__ PhiloxRegisters philox_inputs(const GraphPhiloxParams& g) {
  const GraphDraw d = read_graph_draw(g.header, g.slot, g.uid);
  arrive_and_advance(g.slot, g.uid, d, g.max_replays);
  const uint64_t counter = kGraphOffsetBase / 4 + d.replay * g.counters_per_replay;
  const uint32_t ctr0 = static_cast<uint32_t>(counter);
  const uint32_t ctr1 = static_cast<uint32_t>(counter >> 32);
  PhiloxRegisters k;
  k.seed0 = static_cast<uint32_t>(d.seed);
  k.seed1 = static_cast<uint32_t>(d.seed >> 32);
  k.r1_x = ctr1 ^ k.seed0;
  k.r1_z = __umulhi(kPhiloxM0, ctr0) ^ k.seed1 ^ g.site_word;
  k.r1_w = kPhiloxM0 * ctr0;
  return k;
}

inline PhiloxConstants make_philox_constants(uint64_t seed, uint64_t offset) {
  PhiloxConstants c{};
  const uint64_t counter = offset / 4;
  const uint32_t ctr0 = static_cast<uint32_t>(counter);
  const uint32_t ctr1 = static_cast<uint32_t>(counter >> 32);
  for (int r = 0; r < kPhiloxRounds; ++r) {
    c.key0[r] = static_cast<uint32_t>(seed) + static_cast<uint32_t>(r) * kPhiloxW0;
    c.key1[r] = static_cast<uint32_t>(seed >> 32) + static_cast<uint32_t>(r) * kPhiloxW1;
  }
  const uint64_t product = static_cast<uint64_t>(kPhiloxM0) * ctr0;
  c.r1_x = ctr1 ^ c.key0[0];
  c.r1_z = static_cast<uint32_t>(product >> 32) ^ c.key1[0];
  c.r1_w = static_cast<uint32_t>(product);
  return c;
}

// Philox4x32-10 of counter {ctr0, ctr1, lo32(s), hi32(s)}: the first block of
// curand_init(seed, s, offset) with offset % 4 == 0.
template <typename Keys>
__device__ __forceinline__ uint4 philox_block(const Keys& c, uint64_t s) {
  const uint32_t s0 = static_cast<uint32_t>(s);
  const uint32_t s1 = static_cast<uint32_t>(s >> 32);
  uint32_t x = __umulhi(kPhiloxM1, s0) ^ c.r1_x;
  uint32_t y = kPhiloxM1 * s0;
  uint32_t z = c.r1_z ^ s1;
  uint32_t w = c.r1_w;
#pragma unroll
  for (int r = 1; r < kPhiloxRounds; ++r) {
    const uint32_t hi0 = __umulhi(kPhiloxM0, x);
    const uint32_t lo0 = kPhiloxM0 * x;
    const uint32_t hi1 = __umulhi(kPhiloxM1, z);
    const uint32_t lo1 = kPhiloxM1 * z;
    x = hi1 ^ y ^ c.k0(r);
    y = lo1;
    z = hi0 ^ w ^ c.k1(r);
    w = lo0;
  }
  return make_uint4(x, y, z, w);
}

}  // namespace detail
}  // namespace inferctx

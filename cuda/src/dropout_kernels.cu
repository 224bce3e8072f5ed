// Philox dropout kernels (see dropout.hpp for the random stream and the arithmetic).
//
// Work is cut into tiles of 1024 elements = 32 mask words. In a tile, lane l of a warp owns the
// 16-byte chunks l, l + 32, l + 64, ... so every load and store instruction of the warp touches
// one contiguous 512-byte span. A mask word covers 32 / V consecutive chunks (V elements per
// chunk), whose keep bits come from as many consecutive lanes: each lane puts its chunks' bits in
// a row of shared memory, lane w reads and packs those of word w, and the warp writes its 32
// words as one 128-byte store. (OR-ing them together with shuffles took 32 shuffles per lane and
// tile for fp32 and spilled registers; the row takes CH one-byte stores and one load.)
//
// Each warp takes one unit of 4 KiB of input (two tiles of a 16-bit type, one of fp32), issues
// all of its loads before any arithmetic, then computes and stores; the grid has one warp per
// unit, so the block scheduler refills a multiprocessor as soon as a block retires. On an H200
// this reaches 91-99 % of a device-to-device copy's bandwidth at 256 MiB and 2 GiB, where a
// persistent grid walking the array with a stride and prefetching one tile ahead reached 86-91 %
// (docs/benchmarks.md).
//
// Elements that do not fill a whole tile, and arrays whose pointers are not 16-byte aligned, take
// a scalar path: one thread per 32-element group (one mask word). Both paths compute each element
// from (seed, offset, i, p) alone, so they agree bit for bit and the launch shape never shows in
// the result.
//// Instead of forming curand's float and comparing it with p, the kernel compares the 32-bit
// Philox output with a host-computed threshold: the float is a non-decreasing function of the
// output, so `u > p` is exactly `r >= threshold`. The Philox inputs of a call, eager or captured,
// and the Philox block itself are in dropout_philox.cuh; the argument checks and the values of p
// that need no kernel are in dropout.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "inferctx/cuda_check.hpp"
#include "inferctx/dropout.hpp"
#include "inferctx/graph_rng.hpp"
#include "array_checks.hpp"
#include "dropout_detail.hpp"
#include "dropout_philox.cuh"
#include "dtype_dispatch.hpp"
#include "elem.cuh"

namespace inferctx {

namespace {

using detail::GraphPhiloxParams;
using detail::PhiloxConstants;
using detail::philox_block;
using detail::philox_inputs;
using detail::address;

constexpr int kThreads = 256;          // threads per block
constexpr int64_t kGroup = 32;         // elements per mask word
constexpr int64_t kTile = 32 * kGroup; // elements per warp tile
constexpr unsigned kFullWarp = 0xffffffffu;

// Source: PhiloxConstants (eager) or GraphPhiloxParams (captured).
template <typename Source>
struct ForwardParams {
  Source philox;
  uint32_t threshold;  // keep iff the Philox output >= threshold (< 2^32 here: p < 1)
  float scale;
  int64_t n;
};

struct ApplyParams {
  float scale;
  int64_t n;
};

// Bit e set iff output e of the block is kept.
__device__ __forceinline__ uint32_t keep_bits(uint4 r, uint32_t threshold) {
  return static_cast<uint32_t>(r.x >= threshold) | (static_cast<uint32_t>(r.y >= threshold) << 1) |
         (static_cast<uint32_t>(r.z >= threshold) << 2) | (static_cast<uint32_t>(r.w >= threshold) << 3);
}

using detail::Elem;

__device__ __forceinline__ float scaled_or_zero(float v, bool keep, float scale) { return keep ? v * scale : 0.0f; }

// One 16-bit pair (a 32-bit word of a chunk) of fp16 or bf16, scaled where kept.
__device__ __forceinline__ uint32_t pair_apply(__half, uint32_t word, uint32_t bits2, float scale) {
  const float lo = __half2float(__ushort_as_half(static_cast<unsigned short>(word & 0xffffu)));
  const float hi = __half2float(__ushort_as_half(static_cast<unsigned short>(word >> 16)));
  const __half2 h = __floats2half2_rn(scaled_or_zero(lo, bits2 & 1u, scale), scaled_or_zero(hi, bits2 & 2u, scale));
  uint32_t out;
  memcpy(&out, &h, sizeof(out));
  return out;
}

__device__ __forceinline__ uint32_t pair_apply(__nv_bfloat16, uint32_t word, uint32_t bits2, float scale) {
  const float lo = __uint_as_float(word << 16);
  const float hi = __uint_as_float(word & 0xffff0000u);
  const __nv_bfloat162 h =
      __floats2bfloat162_rn(scaled_or_zero(lo, bits2 & 1u, scale), scaled_or_zero(hi, bits2 & 2u, scale));
  uint32_t out;
  memcpy(&out, &h, sizeof(out));
  return out;
}

// Scales the V elements of a 16-byte chunk where bit e of `bits` is set, zeroes the others.
template <typename T>
__device__ __forceinline__ uint4 chunk_apply(uint4 d, uint32_t bits, float scale) {
  if constexpr (sizeof(T) == 4) {
    d.x = __float_as_uint(scaled_or_zero(__uint_as_float(d.x), bits & 1u, scale));
    d.y = __float_as_uint(scaled_or_zero(__uint_as_float(d.y), bits & 2u, scale));
    d.z = __float_as_uint(scaled_or_zero(__uint_as_float(d.z), bits & 4u, scale));
    d.w = __float_as_uint(scaled_or_zero(__uint_as_float(d.w), bits & 8u, scale));
  } else {
    d.x = pair_apply(T{}, d.x, bits, scale);
    d.y = pair_apply(T{}, d.y, bits >> 2, scale);
    d.z = pair_apply(T{}, d.z, bits >> 4, scale);
    d.w = pair_apply(T{}, d.w, bits >> 6, scale);
  }
  return d;
}

// Four mask bits (low nibble) to four 0/1 bytes: the shifted copies never overlap.
__device__ __forceinline__ uint32_t nibble_to_bytes(uint32_t b) { return (b * 0x00204081u) & 0x01010101u; }

// Bit e set iff byte e of `word` is nonzero.
__device__ __forceinline__ uint32_t bytes_to_nibble(uint32_t word) {
  return static_cast<uint32_t>((word & 0x000000ffu) != 0) | (static_cast<uint32_t>((word & 0x0000ff00u) != 0) << 1) |
         (static_cast<uint32_t>((word & 0x00ff0000u) != 0) << 2) | (static_cast<uint32_t>((word & 0xff000000u) != 0) << 3);
}

// Elements per 16-byte chunk (V), chunks per mask word (CH, also chunks per lane per tile), and
// tiles per warp unit (kUnitTiles: 4 KiB of input, 8 chunks per lane). kMinBlocks caps registers:
// 3 blocks of 256 threads per multiprocessor for 16-bit types (<= 80 registers; two Philox blocks
// per chunk), 4 for fp32 (<= 64). ptxas (sm_90, CUDA 13.0) reports a few spilled bytes under these
// caps (4 in two fp32 instantiations, 16-36 in the 16-bit byte-mask and no-mask ones); a tighter
// fp32 cap (5 or 6 blocks) spills 84-208 bytes.
template <typename T>
struct ChunkShape {
  static constexpr int V = 16 / static_cast<int>(sizeof(T));
  static constexpr int CH = 32 / V;
  static constexpr int kUnitTiles = 4096 / static_cast<int>(kTile * sizeof(T));
  static constexpr int kMinBlocks = sizeof(T) == 4 ? 4 : 3;
};

// For each unit of kUnitTiles whole tiles this warp owns: load(tile, k, lane) for every tile k of
// the unit, then finish(tile, k, lane) for every one (arithmetic and stores), so all of a unit's
// loads are in flight before the first of them is used.
template <typename T, typename Load, typename Finish>
__device__ __forceinline__ void for_each_unit(int64_t tiles, Load&& load, Finish&& finish) {
  constexpr int U = ChunkShape<T>::kUnitTiles;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll 1
  for (int64_t t0 = warp * U; t0 < tiles; t0 += warps * U) {
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (t0 + k < tiles) load(t0 + k, k, lane);
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (t0 + k < tiles) finish(t0 + k, k, lane);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward

template <typename T>
struct TileData {
  uint4 chunk[ChunkShape<T>::CH];
};

// Chunks j * 32 + lane (j < CH) of tile `tile`.
template <typename T>
__device__ __forceinline__ TileData<T> load_tile(const T* x, int64_t tile, int lane) {
  constexpr int V = ChunkShape<T>::V;
  const uint4* xs = reinterpret_cast<const uint4*>(x) + tile * (kTile / V);
  TileData<T> d;
#pragma unroll
  for (int j = 0; j < ChunkShape<T>::CH; ++j) d.chunk[j] = xs[j * 32 + lane];
  return d;
}

template <typename T, MaskMode M, typename Keys, typename Params>
__device__ __forceinline__ void forward_tile(const Keys& keys, const Params& P, const TileData<T>& d, T* y, void* mask,
                                             int64_t tile, int lane) {
  constexpr int V = ChunkShape<T>::V;
  constexpr int CH = ChunkShape<T>::CH;
  const int64_t chunk0 = tile * (kTile / V);
  uint4* ys = reinterpret_cast<uint4*>(y) + chunk0;

  uint32_t bits[CH];
#pragma unroll
  for (int j = 0; j < CH; ++j) {
    const int64_t c = chunk0 + j * 32 + lane;
    const uint64_t s = static_cast<uint64_t>(c) * (V / 4);  // first Philox block of the chunk
    uint32_t b = keep_bits(philox_block(keys, s), P.threshold);
    if constexpr (V == 8) b |= keep_bits(philox_block(keys, s + 1), P.threshold) << 4;
    bits[j] = b;
    ys[j * 32 + lane] = chunk_apply<T>(d.chunk[j], b, P.scale);
    if constexpr (M == MaskMode::Bytes) {
      if constexpr (V == 8) {
        reinterpret_cast<uint2*>(mask)[c] = make_uint2(nibble_to_bytes(b & 0xfu), nibble_to_bytes(b >> 4));
      } else {
        reinterpret_cast<uint32_t*>(mask)[c] = nibble_to_bytes(b);
      }
    }
  }

  if constexpr (M == MaskMode::Bits) {
    // The keep bits of chunk c of the tile go to byte c of the warp's row in shared memory. Word
    // w covers chunks w * CH ... w * CH + CH - 1, i.e. CH consecutive bytes: lane w reads them in
    // one load and packs them (a byte per chunk for 16-bit types, a nibble per chunk for fp32).
    __shared__ __align__(16) uint8_t rows[kThreads / 32][kTile / V];
    uint8_t* row = rows[threadIdx.x / 32];
    __syncwarp();  // the warp's reads of its previous tile's row are done
#pragma unroll
    for (int j = 0; j < CH; ++j) row[j * 32 + lane] = static_cast<uint8_t>(bits[j]);
    __syncwarp();
    uint32_t word;
    if constexpr (V == 8) {
      word = reinterpret_cast<const uint32_t*>(row)[lane];
    } else {
      // Bytes b0..b3 of v.x hold nibbles: v.x | v.x >> 4 has b0 | b1 << 4 in byte 0 and
      // b2 | b3 << 4 in byte 2; the same for v.y, whose two bytes go on top.
      const uint2 v = reinterpret_cast<const uint2*>(row)[lane];
      word = __byte_perm(v.x | (v.x >> 4), v.y | (v.y >> 4), 0x6420);
    }
    static_cast<uint32_t*>(mask)[tile * 32 + lane] = word;
  }
}

// Elements [32 g, min(32 g + 32, n)) one at a time: any alignment, any remainder.
template <typename T, MaskMode M, typename Keys, typename Params>
__device__ __forceinline__ void forward_group(const Keys& keys, const Params& P, const T* x, T* y, void* mask,
                                              int64_t g) {
  const int64_t base = g * kGroup;
  const int64_t left = P.n - base;
  uint32_t word = 0;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    if (q * 4 < left) {
      const uint4 r = philox_block(keys, static_cast<uint64_t>(g) * 8 + q);
      const uint32_t b = keep_bits(r, P.threshold);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = q * 4 + e;
        if (k < left) {
          const bool keep = (b >> e) & 1u;
          y[base + k] = Elem<T>::from_float(scaled_or_zero(Elem<T>::to_float(x[base + k]), keep, P.scale));
          if constexpr (M == MaskMode::Bytes) static_cast<uint8_t*>(mask)[base + k] = keep ? 1 : 0;
        }
      }
      word |= b << (q * 4);
    }
  }
  if constexpr (M == MaskMode::Bits) {
    if (left < kGroup) word &= (1u << left) - 1u;
    static_cast<uint32_t*>(mask)[g] = word;
  }
}

template <typename T, MaskMode M, bool Vector, typename Source>
__global__ void __launch_bounds__(kThreads, ChunkShape<T>::kMinBlocks)
    dropout_forward_kernel(const T* x, T* y, void* mask, ForwardParams<Source> P) {
  decltype(auto) keys = philox_inputs(P.philox);  // a reference to P's constants when eager
  int64_t first_group = 0;
  if constexpr (Vector) {
    const int64_t tiles = P.n / kTile;
    TileData<T> d[ChunkShape<T>::kUnitTiles];
    for_each_unit<T>(
        tiles, [&](int64_t tile, int k, int lane) { d[k] = load_tile(x, tile, lane); },
        [&](int64_t tile, int k, int lane) { forward_tile<T, M>(keys, P, d[k], y, mask, tile, lane); });
    first_group = tiles * (kTile / kGroup);
  }
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t groups = (P.n + kGroup - 1) / kGroup;
  for (int64_t g = first_group + thread; g < groups; g += threads) forward_group<T, M>(keys, P, x, y, mask, g);
}

// ---------------------------------------------------------------------------------------------
// Backward (apply a stored mask)

template <typename T>
struct ApplyData {
  uint4 chunk[ChunkShape<T>::CH];
  uint32_t mask[ChunkShape<T>::CH];  // Bits: mask[0] is word `lane` of the tile; Bytes: chunk j's V keep bits
};

// Chunks j * 32 + lane of tile `tile` of grad and the mask covering them.
template <typename T, MaskMode M>
__device__ __forceinline__ ApplyData<T> load_apply_tile(const T* grad, const void* mask, int64_t tile, int lane) {
  constexpr int V = ChunkShape<T>::V;
  constexpr int CH = ChunkShape<T>::CH;
  const int64_t chunk0 = tile * (kTile / V);
  const uint4* gs = reinterpret_cast<const uint4*>(grad) + chunk0;
  ApplyData<T> a;
#pragma unroll
  for (int j = 0; j < CH; ++j) a.chunk[j] = gs[j * 32 + lane];
  if constexpr (M == MaskMode::Bits) {
    a.mask[0] = static_cast<const uint32_t*>(mask)[tile * 32 + lane];
  } else {
#pragma unroll
    for (int j = 0; j < CH; ++j) {
      const int64_t c = chunk0 + j * 32 + lane;
      if constexpr (V == 8) {
        const uint2 m = reinterpret_cast<const uint2*>(mask)[c];
        a.mask[j] = bytes_to_nibble(m.x) | (bytes_to_nibble(m.y) << 4);
      } else {
        a.mask[j] = bytes_to_nibble(reinterpret_cast<const uint32_t*>(mask)[c]);
      }
    }
  }
  return a;
}

template <typename T, MaskMode M>
__device__ __forceinline__ void apply_tile(const ApplyParams& P, const ApplyData<T>& a, T* out, int64_t tile,
                                           int lane) {
  constexpr int V = ChunkShape<T>::V;
  constexpr int CH = ChunkShape<T>::CH;
  uint4* os = reinterpret_cast<uint4*>(out) + tile * (kTile / V);
#pragma unroll
  for (int j = 0; j < CH; ++j) {
    uint32_t bits;
    if constexpr (M == MaskMode::Bits) {
      // Chunk j * 32 + lane of the tile is in word (j * 32 + lane) / CH, which lane w loaded.
      const uint32_t w = __shfl_sync(kFullWarp, a.mask[0], j * V + lane / CH);
      bits = (w >> ((lane % CH) * V)) & ((1u << V) - 1u);
    } else {
      bits = a.mask[j];
    }
    os[j * 32 + lane] = chunk_apply<T>(a.chunk[j], bits, P.scale);
  }
}

template <typename T, MaskMode M>
__device__ __forceinline__ void apply_group(const ApplyParams& P, const T* grad, const void* mask, T* out,
                                            int64_t g) {
  const int64_t base = g * kGroup;
  const int64_t left = P.n - base;
  uint32_t word = 0;
  if constexpr (M == MaskMode::Bits) word = static_cast<const uint32_t*>(mask)[g];
#pragma unroll
  for (int k = 0; k < kGroup; ++k) {
    if (k < left) {
      bool keep;
      if constexpr (M == MaskMode::Bits) {
        keep = (word >> k) & 1u;
      } else {
        keep = static_cast<const uint8_t*>(mask)[base + k] != 0;
      }
      out[base + k] = Elem<T>::from_float(scaled_or_zero(Elem<T>::to_float(grad[base + k]), keep, P.scale));
    }
  }
}

template <typename T, MaskMode M, bool Vector>
__global__ void __launch_bounds__(kThreads, ChunkShape<T>::kMinBlocks)
    dropout_apply_kernel(const T* grad, const void* mask, T* out, ApplyParams P) {
  int64_t first_group = 0;
  if constexpr (Vector) {
    const int64_t tiles = P.n / kTile;
    ApplyData<T> a[ChunkShape<T>::kUnitTiles];
    for_each_unit<T>(
        tiles, [&](int64_t tile, int k, int lane) { a[k] = load_apply_tile<T, M>(grad, mask, tile, lane); },
        [&](int64_t tile, int k, int lane) { apply_tile<T, M>(P, a[k], out, tile, lane); });
    first_group = tiles * (kTile / kGroup);
  }
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t groups = (P.n + kGroup - 1) / kGroup;
  for (int64_t g = first_group + thread; g < groups; g += threads) apply_group<T, M>(P, grad, mask, out, g);
}

// ---------------------------------------------------------------------------------------------
// Launchers

// Threads a launch over n elements can use: a warp per unit of whole tiles, a thread per
// remaining group (the scalar path: a thread per group).
template <typename T>
int64_t threads_needed(int64_t n, bool vector) {
  const int64_t groups = (n + kGroup - 1) / kGroup;
  if (!vector) return groups;
  const int64_t tiles = n / kTile;
  const int64_t units = (tiles + ChunkShape<T>::kUnitTiles - 1) / ChunkShape<T>::kUnitTiles;
  const int64_t tail_groups = groups - tiles * (kTile / kGroup);
  return units * 32 > tail_groups ? units * 32 : tail_groups;
}

// One block per kThreads threads of work, at most max_blocks (<= 0: the hardware's limit); the
// kernels loop over whatever a smaller grid leaves.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int64_t threads, int max_blocks, cudaStream_t stream, int device,
            Args... args) {
  const int64_t cap = max_blocks > 0 ? max_blocks : INT_MAX;
  int64_t blocks = (threads + kThreads - 1) / kThreads;
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args...);
  INFERCTX_CUDA(cudaGetLastError(), device);
}

template <typename T, MaskMode M, typename Source>
void launch_forward_mode(const void* x, void* y, void* mask, const ForwardParams<Source>& P, bool vector,
                         cudaStream_t stream, int device, int max_blocks) {
  const auto kernel = vector ? dropout_forward_kernel<T, M, true, Source> : dropout_forward_kernel<T, M, false, Source>;
  launch(kernel, threads_needed<T>(P.n, vector), max_blocks, stream, device, static_cast<const T*>(x),
         static_cast<T*>(y), mask, P);
}

template <typename T, typename Source>
void launch_forward(const void* x, void* y, void* mask, MaskMode mode, const ForwardParams<Source>& P, bool vector,
                    cudaStream_t stream, int device, int max_blocks) {
  switch (mode) {
    case MaskMode::None: return launch_forward_mode<T, MaskMode::None>(x, y, mask, P, vector, stream, device, max_blocks);
    case MaskMode::Bytes: return launch_forward_mode<T, MaskMode::Bytes>(x, y, mask, P, vector, stream, device, max_blocks);
    case MaskMode::Bits: return launch_forward_mode<T, MaskMode::Bits>(x, y, mask, P, vector, stream, device, max_blocks);
  }
}

template <typename T, MaskMode M>
void launch_apply_mode(const void* grad, const void* mask, void* out, const ApplyParams& P, bool vector,
                       cudaStream_t stream, int device, int max_blocks) {
  const auto kernel = vector ? dropout_apply_kernel<T, M, true> : dropout_apply_kernel<T, M, false>;
  launch(kernel, threads_needed<T>(P.n, vector), max_blocks, stream, device, static_cast<const T*>(grad), mask,
         static_cast<T*>(out), P);
}

template <typename T>
void launch_apply(const void* grad, const void* mask, void* out, MaskMode mode, const ApplyParams& P, bool vector,
                  cudaStream_t stream, int device, int max_blocks) {
  if (mode == MaskMode::Bits) {
    launch_apply_mode<T, MaskMode::Bits>(grad, mask, out, P, vector, stream, device, max_blocks);
  } else {
    launch_apply_mode<T, MaskMode::Bytes>(grad, mask, out, P, vector, stream, device, max_blocks);
  }
}

// Whether the 16-byte path can take a call: both arrays aligned to 16 bytes, and a byte mask to
// a chunk's V elements (a bit mask is written a 32-bit word per lane: its own alignment does).
template <typename T>
bool vectorizable(const void* a, const void* b, const void* mask, MaskMode mode) {
  return address(a) % 16 == 0 && address(b) % 16 == 0 &&
         (mode != MaskMode::Bytes || address(mask) % static_cast<uint64_t>(ChunkShape<T>::V) == 0);
}

}  // namespace

namespace detail {

void launch_dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, MaskMode mode,
                            uint32_t threshold, float scale, const PhiloxSource& source, cudaStream_t stream,
                            int device, int max_blocks) {
  const auto run = [&](const auto& P) {
    with_dtype(dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch_forward<T>(x, y, mask, mode, P, vectorizable<T>(x, y, mask, mode), stream, device, max_blocks);
    });
  };
  if (!source.captured) {
    ForwardParams<PhiloxConstants> P{};
    P.philox = make_philox_constants(source.seed, source.offset);
    P.threshold = threshold;
    P.scale = scale;
    P.n = n;
    run(P);
    return;
  }
  const GraphPhilox& g = source.graph;
  ForwardParams<GraphPhiloxParams> P{};
  P.philox.header = g.header;
  P.philox.slot = g.slot;
  P.philox.uid = g.uid;
  P.philox.counters_per_replay = g.step / 4;
  P.philox.max_replays = graph_max_replays(g.step);
  P.philox.site_word = static_cast<uint32_t>(graph_subsequence_base(g.site) >> 32);
  P.threshold = threshold;
  P.scale = scale;
  P.n = n;
  run(P);  // its last block to read the site's state advances it: the next launch sees r + 1
}

void launch_dropout_apply(const void* grad, const void* mask, void* out, int64_t n, int dtype, MaskMode mode,
                          float scale, cudaStream_t stream, int device, int max_blocks) {
  ApplyParams P{};
  P.scale = scale;
  P.n = n;
  with_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_apply<T>(grad, mask, out, mode, P, vectorizable<T>(grad, out, mask, mode), stream, device, max_blocks);
  });
}

}  // namespace detail

}  // namespace inferctx

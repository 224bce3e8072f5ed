// Philox dropout: forward (y and a keep mask) and its backward (apply a mask to a gradient).
//
// The random stream (DESIGN.md, "Kernels"): element i is kept iff u_i > p, where u_i is output
// i % 4 of curand_uniform4 on a curandStatePhilox4_32_10 from curand_init(seed, i / 4, offset).
// With offset % 4 == 0 that state's first block is Philox4x32-10 of
//     counter = {lo32(offset / 4), hi32(offset / 4), lo32(i / 4), hi32(i / 4)},  key = {lo32(seed), hi32(seed)}
// and curand's float is u = fl32(fl32(r) * 2^-32 + 2^-33), r the 32-bit output (so u can be 1.0f).
// Every element depends only on (seed, offset, i, p): results never depend on the launch shape,
// the path taken (vector or scalar) or the GPU.
//
// Arithmetic, reproducible bit for bit on any IEEE host (p is a double):
//     kept  = u_i > (float)p                        (curand's uniform is a float)
//     scale = (float)(1.0 / (1.0 - p))              (worked out in double, rounded once, as torch
//                                                    rounds a Python float scalar for a float op)
//     y_i   = kept ? to_dtype(fl32((float)x_i * scale)) : +0
// so, given the same mask, y equals `where(mask, x * (1 / (1 - p)), 0)` bit for bit, and torch's
// `x * mask * (1 / (1 - p))` wherever they can agree: that product gives -0 for a dropped
// negative x_i and NaN for a dropped infinity or NaN, where y is +0. to_dtype rounds to nearest
// even (identity for fp32). A dropped element is +0 whatever x_i is.
// (float)p == 0: y is a byte copy of x (NaN payloads and -0 kept), every mask bit/byte set.
// (float)p == 1: y is all +0, the mask all clear.
//
// Masks: MaskMode::Bits stores bit i % 32 of uint32 word i / 32 (ceil(n / 32) words; the bits
// past n in the last word are 0). MaskMode::Bytes stores one uint8 per element, 1 kept, 0
// dropped. MaskMode::None stores nothing (the mask pointer is ignored).
//
// Pointers are device pointers (or any memory the device can address) of contiguous arrays;
// y may be x itself (in place) but may not partly overlap it, and the mask may overlap neither.
// Work is queued on `stream` of `device` (-1: the calling thread's current device); the calling
// thread's current device is the same afterwards. The grid has one warp per 4 KiB of input;
// max_blocks > 0 caps it (the kernels then loop; results are the same), <= 0 leaves it uncapped.
// Argument errors throw ConfigError naming the argument before anything is queued; CUDA errors
// throw CudaError.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "inferctx/graph_rng.hpp"

namespace inferctx {

enum class MaskMode : int { None = 0, Bytes = 1, Bits = 2 };

// Bytes the mask of n elements takes: 0 (None), n (Bytes) or 4 * ceil(n / 32) (Bits).
// ConfigError("n") for n < 0, ConfigError("mask_mode") for an unknown mode.
int64_t dropout_mask_bytes(int64_t n, int mask_mode);

// Elements of the mask array: 0 (None), n uint8 (Bytes) or ceil(n / 32) uint32 (Bits).
int64_t dropout_mask_elements(int64_t n, int mask_mode);

// The factor applied to kept elements: (float)(1.0 / (1.0 - p)) for p in [0, 1), and
// 0 for p == 1 (nothing is kept, and apply_mask then gives zeros rather than inf * g).
// ConfigError("p") for NaN or p outside [0, 1].
float dropout_scale(double p);

// The smallest 32-bit Philox output r whose curand uniform fl32(fl32(r) * 2^-32 + 2^-33) is
// greater than (float)p: element i is kept iff r_i >= threshold. 2^32 (nothing kept) for p == 1,
// 0 (everything kept) for p == 0. ConfigError("p") as dropout_scale.
uint64_t dropout_keep_threshold(double p);

// Forward: y = dropout(x) and the keep mask, for n contiguous elements of `dtype` (DType:
// 0 fp32, 1 fp16, 2 bf16). mask_mode is a MaskMode value; `mask` must hold
// dropout_mask_bytes(n, mask_mode) bytes (4-byte aligned for Bits). `offset` must be a multiple
// of 4 (one Philox counter per 4 elements; the context's increment_offset(4) gives such
// offsets). Any n >= 0; null pointers are allowed when n == 0 (nothing is queued).
void dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, double p, int mask_mode,
                     uint64_t seed, uint64_t offset, cudaStream_t stream, int device = -1, int max_blocks = 0);

// Forward drawing from `source` (graph_rng.hpp): host (seed, offset) as above, or a captured call
// site. For a site the kernel reads the seed and the replay number r from the site's device state
// when it runs, so element i uses curand_init(seed, (site << 36) + i / 4, 2^63 + site.step * r),
// and the last of its blocks to read that state advances r (at every replay of the graph the
// call was captured into; outside capture, at every call): a captured call is one kernel node.
// ConfigError("n") for more than 2^38 elements from a site, ConfigError("site") for a malformed
// site. p rounding to 0 or 1 draws nothing and leaves r as it is.
void dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, double p, int mask_mode,
                     const PhiloxSource& source, cudaStream_t stream, int device = -1, int max_blocks = 0);

// Forward drawing from `rng` (a context's graph_rng(): increment_offset(4) on a stream that is
// not capturing, a new call site on one that is), after the arguments are checked: a call
// refused for its arguments takes no offset and no site.
void dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, double p, int mask_mode,
                     GraphRng& rng, cudaStream_t stream, int device = -1, int max_blocks = 0);

// Backward: out_i = mask_i ? to_dtype(fl32((float)grad_i * dropout_scale(p))) : +0, for a mask
// made by dropout_forward with the same p (Bytes: any nonzero byte counts as set; Bits: the
// layout above, bits past n ignored). out may be grad itself. mask_mode must be Bytes or Bits.
void dropout_apply_mask(const void* grad, const void* mask, void* out, int64_t n, int dtype, double p,
                        int mask_mode, cudaStream_t stream, int device = -1, int max_blocks = 0);

}  // namespace inferctx

// Fused elementwise kernels of the reference decoder (python/inferctx/decoder): each replaces a
// sequence of torch's eager elementwise kernels and rounds every intermediate to the element type
// exactly where that sequence does, so its bits are the sequence's.
//
// Arithmetic. An eager torch kernel on float16 / bfloat16 computes each operation in float32 and
// rounds its result to the element type (round to nearest even); on float32 each operation is one
// IEEE float operation. These kernels do the same with explicitly rounded float operations
// (__fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn: the compiler never contracts them into a
// fused multiply-add) and, after each operation of the sequence, a rounding to the element type.
// Python float scalars enter as torch passes them to a float kernel: the double rounded to float.
// tanhf and expf are CUDA's (the library torch's kernels call as well). Whether a given torch build
// computes a sequence this way is checked by the decoder against that build before it uses them
// (decoder/_fused.py); these kernels make no claim about torch beyond the sequences below.
//
// Pointers are device pointers; strides count elements. Work is queued on `stream` of `device`
// (-1: the calling thread's current device), which is the current device again afterwards.
// Argument errors throw ConfigError naming the argument before anything is queued; CUDA errors
// throw CudaError. dtype: DType (float32, float16 or bfloat16).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace inferctx {

// How x**3 is rounded, as torch.pow(x, 3.0) may compute it on a 16-bit type:
//   0: r(r(x * x) * x)   (the element type's own multiplication, rounded after each product)
//   1: r((x * x) * x)    (float products, one rounding at the end)
//   2: r(powf(x, 3))
// (for float32, 0 and 1 are the same).
enum class CubeRounding : int { EachProduct = 0, Float = 1, Powf = 2 };

// transformers' NewGELUActivation in place over n contiguous elements, as the sequence
//   t = pow(x, 3.0); t *= 0.044715; t += x; t *= sqrt(2 / pi); t = tanh(t); t += 1; x *= 0.5; x *= t
// (every step rounded to dtype). ConfigError: n < 0, x null or misaligned, dtype, cube.
void gelu_new_inplace(void* x, int64_t n, int dtype, int cube, cudaStream_t stream, int device);

// gate <- silu(gate) * up over a rows x cols matrix (row strides ld_gate, ld_up >= cols, unit
// column stride), as F.silu(gate, inplace=True) then gate.mul_(up):
//   s = r(x / (1 + expf(-x))); gate = r(s * up).
// gate and up must not overlap. ConfigError: sizes, strides, pointers, dtype.
void silu_mul_inplace(void* gate, const void* up, int64_t rows, int64_t cols, int64_t ld_gate, int64_t ld_up,
                      int dtype, cudaStream_t stream, int device);

// Llama's rotary embedding of src [batch, tokens, heads, head_dim] into dst of the same shape,
// each with its own four strides (the last 1), cos and sin rows of head_dim contiguous elements
// (row of token t at t * cs_token_stride; 0 broadcasts one row):
//   dst[:h]  = r(r(src[:h] * cos[:h]) - r(src[h:] * sin[:h]))
//   dst[h:]  = r(r(src[h:] * cos[h:]) + r(src[:h] * sin[h:]))        (h = head_dim / 2)
// which is src * cos + rotate_half(src) * sin, rotate_half(x) = cat(-x2, x1), rounded as the
// eager sequence rounds it. head_dim even; dst may not overlap src, cos or sin, and no two of its
// (batch, token, head) rows may share an element (ConfigError("dst_strides")).
void rope_apply(const void* src, void* dst, const void* cos, const void* sin, int64_t batch, int64_t tokens,
                int64_t heads, int64_t head_dim, const int64_t src_strides[3], const int64_t dst_strides[3],
                int64_t cs_token_stride, int dtype, cudaStream_t stream, int device);

}  // namespace inferctx

// Element conversions shared by the kernels: exact widening of fp32 / fp16 / bf16 to float and
// round-to-nearest-even narrowing back.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace inferctx {
namespace detail {

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  __device__ static float to_float(float v) { return v; }
  __device__ static float from_float(float v) { return v; }
};

template <>
struct Elem<__half> {
  __device__ static float to_float(__half v) { return __half2float(v); }
  __device__ static __half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct Elem<__nv_bfloat16> {
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

}  // namespace detail
}  // namespace inferctx

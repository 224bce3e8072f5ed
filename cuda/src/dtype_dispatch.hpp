// The one switch from a DType code to its C++ element type, for the host code that launches
// kernels (dropout_kernels.cu, gemm_kernels.cu). Internal to cuda/src.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "inferctx/plan.hpp"

namespace inferctx::detail {

template <typename T>
struct TypeTag {
  using type = T;
};

// Returns f(TypeTag<T>{}) with T the element type of `dtype`: float, __half or __nv_bfloat16.
// The caller has checked dtype (dtype_size, validate_gemm); any other code is taken as BFloat16.
// In f: `using T = typename decltype(tag)::type;`.
template <typename F>
decltype(auto) with_dtype(int dtype, F&& f) {
  switch (static_cast<DType>(dtype)) {
    case DType::Float32: return f(TypeTag<float>{});
    case DType::Float16: return f(TypeTag<__half>{});
    default: return f(TypeTag<__nv_bfloat16>{});
  }
}

}  // namespace inferctx::detail

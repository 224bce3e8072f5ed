# cython: language_level=3
# extern declarations of inferctx_core's fused decoder kernels (cuda/include/inferctx/decoder_ops.hpp).

from libc.stdint cimport int64_t

from inferctx._decl_errors cimport raise_inferctx_error
from inferctx._decl_gpu cimport cudaStream_t


cdef extern from "inferctx/decoder_ops.hpp" namespace "inferctx" nogil:
    void gelu_new_inplace(void* x, int64_t n, int dtype, int cube, cudaStream_t stream,
                          int device) except +raise_inferctx_error
    void silu_mul_inplace(void* gate, const void* up, int64_t rows, int64_t cols, int64_t ld_gate,
                          int64_t ld_up, int dtype, cudaStream_t stream,
                          int device) except +raise_inferctx_error
    void rope_apply(const void* src, void* dst, const void* cos, const void* sin, int64_t batch,
                    int64_t tokens, int64_t heads, int64_t head_dim, const int64_t* src_strides,
                    const int64_t* dst_strides, int64_t cs_token_stride, int dtype,
                    cudaStream_t stream, int device) except +raise_inferctx_error

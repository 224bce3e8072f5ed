# Part of _core.pyx: the reference decoder's fused elementwise kernels (decoder_ops.hpp), for
# python/inferctx/decoder/_fused.py, which checks them against torch's eager sequences before it
# uses them. Raw device addresses, element strides and a stream handle (0: the legacy default
# stream, as torch reports it); the C++ side checks every argument before it queues anything.

from libc.stdint cimport int64_t, uintptr_t

from inferctx._decl_decoder_ops cimport gelu_new_inplace, rope_apply, silu_mul_inplace
from inferctx._decl_gpu cimport cudaStreamLegacy, cudaStream_t


cdef inline cudaStream_t _raw_stream(uintptr_t handle) noexcept:
    return cudaStreamLegacy if handle == 0 else <cudaStream_t>handle


def _fused_gelu_new(uintptr_t x, int64_t n, int dtype, int cube, uintptr_t stream, int device):
    """x <- gelu_new(x) in place over n contiguous elements (decoder_ops.hpp, gelu_new_inplace)."""
    cdef cudaStream_t s = _raw_stream(stream)
    with nogil:
        gelu_new_inplace(<void*>x, n, dtype, cube, s, device)


def _fused_silu_mul(uintptr_t gate, uintptr_t up, int64_t rows, int64_t cols, int64_t ld_gate,
                    int64_t ld_up, int dtype, uintptr_t stream, int device):
    """gate <- silu(gate) * up over rows x cols (decoder_ops.hpp, silu_mul_inplace)."""
    cdef cudaStream_t s = _raw_stream(stream)
    with nogil:
        silu_mul_inplace(<void*>gate, <const void*>up, rows, cols, ld_gate, ld_up, dtype, s, device)


cdef int _three_strides(object strides, int64_t* out, str name) except -1:
    if not isinstance(strides, tuple) or len(strides) != 3:
        raise _ConfigError(f"{name}: got {strides!r}; give the (batch, token, head) strides as a tuple "
                           f"of three ints", argument=name)
    for k in range(3):
        out[k] = strides[k]
    return 0


def _fused_rope(uintptr_t src, uintptr_t dst, uintptr_t cos, uintptr_t sin, int64_t batch,
                int64_t tokens, int64_t heads, int64_t head_dim, src_strides, dst_strides,
                int64_t cs_token_stride, int dtype, uintptr_t stream, int device):
    """dst <- rope(src) with the cos / sin rows (decoder_ops.hpp, rope_apply)."""
    cdef int64_t ss[3]
    cdef int64_t ds[3]
    _three_strides(src_strides, ss, "src_strides")
    _three_strides(dst_strides, ds, "dst_strides")
    cdef cudaStream_t s = _raw_stream(stream)
    with nogil:
        rope_apply(<const void*>src, <void*>dst, <const void*>cos, <const void*>sin, batch, tokens,
                   heads, head_dim, ss, ds, cs_token_stride, dtype, s, device)

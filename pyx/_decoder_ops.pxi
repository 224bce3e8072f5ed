# Part of _core.pyx: the reference decoder's fused elementwise kernels (decoder_ops.hpp), for
# python/inferctx/decoder/_fused.py, which checks them against torch's eager sequences before it
# uses them. Raw device addresses, element strides and a stream (None: torch's current stream on
# the device, the decoder's case; else anything stream= takes); the C++ side checks every other
# argument before it queues anything.

from libc.stdint cimport int64_t, uintptr_t

from inferctx._decl_decoder_ops cimport gelu_new_inplace, rope_apply, silu_mul_inplace
from inferctx._decl_gpu cimport cudaStream_t


cdef uintptr_t _decoder_stream(object stream, int device) except 0:
    if stream is None:
        _refresh_packages()
        if _torch_raw_stream is None:
            raise _ConfigError("stream: None means torch's current stream, and torch (with CUDA) "
                               "is not imported; pass a stream", argument="stream")
        return _package_stream(PKG_TORCH, device)
    return _stream_handle(stream, "stream")


def _fused_gelu_new(uintptr_t x, int64_t n, int dtype, int cube, object stream, int device):
    """x <- gelu_new(x) in place over n contiguous elements (decoder_ops.hpp, gelu_new_inplace)."""
    cdef cudaStream_t s = <cudaStream_t>_decoder_stream(stream, device)
    with nogil:
        gelu_new_inplace(<void*>x, n, dtype, cube, s, device)


def _fused_silu_mul(uintptr_t gate, uintptr_t up, int64_t rows, int64_t cols, int64_t ld_gate,
                    int64_t ld_up, int dtype, object stream, int device):
    """gate <- silu(gate) * up over rows x cols (decoder_ops.hpp, silu_mul_inplace)."""
    cdef cudaStream_t s = <cudaStream_t>_decoder_stream(stream, device)
    with nogil:
        silu_mul_inplace(<void*>gate, <const void*>up, rows, cols, ld_gate, ld_up, dtype, s, device)


cdef int _three_strides(object strides, int64_t* out, str name) except -1:
    if not isinstance(strides, tuple) or len(strides) != 3:
        raise _ConfigError(f"{name}: got {_brief(strides)}; give the (batch, token, head) "
                           "strides as a tuple of three ints", argument=name)
    for k in range(3):
        out[k] = _int_arg(strides[k], f"{name}[{k}]")
    return 0


def _fused_rope(uintptr_t src, uintptr_t dst, uintptr_t cos, uintptr_t sin, int64_t batch,
                int64_t tokens, int64_t heads, int64_t head_dim, src_strides, dst_strides,
                int64_t cs_token_stride, int dtype, object stream, int device):
    """dst <- rope(src) with the cos / sin rows (decoder_ops.hpp, rope_apply)."""
    cdef int64_t ss[3]
    cdef int64_t ds[3]
    _three_strides(src_strides, ss, "src_strides")
    _three_strides(dst_strides, ds, "dst_strides")
    cdef cudaStream_t s = <cudaStream_t>_decoder_stream(stream, device)
    with nogil:
        rope_apply(<const void*>src, <void*>dst, <const void*>cos, <const void*>sin, batch, tokens,
                   heads, head_dim, ss, ds, cs_token_stride, dtype, s, device)

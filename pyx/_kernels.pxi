# Part of _core.pyx: the dropout kernels (dropout, apply_mask); GEMM is in _gemm.pxi.

from libc.math cimport isnan
from libc.stdint cimport int64_t, uint64_t, uintptr_t

from inferctx._decl_gpu cimport cudaStream_t
from inferctx._decl_kernels cimport dropout_apply_mask, dropout_mask_elements

# inferctx::MaskMode codes. (inferctx::DType codes are the dtype indices DT_FLOAT32, DT_FLOAT16
# and DT_BFLOAT16.)
cdef dict _MASK_MODES = {None: 0, "bytes": 1, "bits": 2}


cdef double _probability_arg(object p) except? -1:
    if _is_flag(p) or not isinstance(p, (int, float)) and not hasattr(p, "__float__"):
        raise _ConfigError(f"p: got {_brief(p)}; it must be a number in [0, 1], the probability of "
                           f"dropping an element", argument="p")
    cdef double v
    try:
        v = float(p)
    except (OverflowError, ValueError, TypeError):
        raise _ConfigError(f"p: got {_brief(p)}, which is not a finite number; it must be a "
                           "number in [0, 1], the probability of dropping an element",
                           argument="p") from None
    if isnan(v) or v < 0.0 or v > 1.0:
        raise _ConfigError(f"p: got {v!r}; it must be in [0, 1], the probability of dropping an "
                           f"element", argument="p")
    return v


cdef int _kernel_dtype(CudaArray a, str argument) except -1:
    """The inferctx::DType code of a kernel's input, which is its dtype index."""
    if a._dtype != DT_FLOAT32 and a._dtype != DT_FLOAT16 and a._dtype != DT_BFLOAT16:
        raise _ConfigError(f"{argument}: dtype {a.dtype} is not supported; valid: float32, float16, "
                           f"bfloat16", argument=argument)
    if not a.contiguous:
        raise _ConfigError(f"{argument}: shape {list(a.shape)} with strides {list(a.strides)} (elements) "
                           f"is not contiguous; pass a contiguous copy ({argument}.contiguous() in "
                           f"torch, cupy.ascontiguousarray({argument}) in CuPy)", argument=argument)
    return a._dtype


cdef CudaArray _out_arg(_Call call, object out, CudaArray like, str what):
    cdef CudaArray o = call.array(out, "out")
    if o.device != like.device or o.dtype != like.dtype or tuple(o.shape) != tuple(like.shape):
        raise _ConfigError(
            f"out: got {o.dtype}{list(o.shape)} on cuda:{o.device}; it must match {what}: "
            f"{like.dtype}{list(like.shape)} on cuda:{like.device}", argument="out")
    if not o.contiguous:
        raise _ConfigError(f"out: shape {list(o.shape)} with strides {list(o.strides)} (elements) is "
                           f"not contiguous; pass a contiguous array of that shape, or no out= for "
                           f"a new result", argument="out")
    if o.read_only:
        raise _ConfigError("out: the array is read-only; pass a writable one, or no out= for a new "
                           "result", argument="out")
    return o


cdef int _mask_arg(CudaArray m, str argument, int mode, CudaArray like, str what) except -1:
    """Checks the dropout mask `m`, named `argument`, for the elements of `like` (named `what`);
    returns its MaskMode.

    mode 0: a mask to read (apply_mask's), its format taken from its dtype. mode 1 (bytes) or
    2 (bits): a mask to write in that format (dropout's mask_out), so it must be writable.
    """
    if m.device != like.device:
        raise _ConfigError(f"{argument}: is on cuda:{m.device}, {what} on cuda:{like.device}",
                           argument=argument)
    if not m.contiguous:
        raise _ConfigError(f"{argument}: shape {list(m.shape)} with strides {list(m.strides)} "
                           f"(elements) is not contiguous; pass a contiguous array"
                           + (f", or no {argument}= for a new one" if mode != 0 else ""),
                           argument=argument)
    if mode != 0 and m.read_only:
        raise _ConfigError(f"{argument}: the array is read-only; pass a writable one, or no "
                           f"{argument}= for a new one", argument=argument)
    # Bits are uint32 words (int32 taken as well), bytes one uint8 (int8, bool) per element.
    cdef bint words = m._dtype == DT_UINT32 or m._dtype == DT_INT32
    cdef bint bytes_ = m._dtype == DT_UINT8 or m._dtype == DT_INT8 or m._dtype == DT_BOOL
    if mode == 0:
        if not words and not bytes_:
            raise _ConfigError(f"{argument}: dtype {m.dtype} is not a dropout mask; valid: uint32 "
                               f"(bits) or uint8 (bytes)", argument=argument)
        mode = 2 if words else 1
    cdef int64_t n = like.size
    cdef int64_t elements = dropout_mask_elements(n, mode)
    if mode == 2 and not (words and m.size == elements):
        raise _ConfigError(f"{argument}: a bit mask for {n} elements is {elements} uint32 (or "
                           f"int32) words; got {m.dtype}{list(m.shape)}", argument=argument)
    if mode == 1 and not (bytes_ and m.size == elements):
        raise _ConfigError(f"{argument}: a byte mask for {n} elements is {elements} uint8 values; "
                           f"got {m.dtype}{list(m.shape)}", argument=argument)
    return mode


def dropout(x, p, *, ctx=None, out=None, mask="bits", mask_out=None, seed=None, offset=None,
            stream=None):
    """Dropout of a CUDA array: ``y = x / (1 - p)`` where kept, 0 elsewhere; returns (y, mask).

    Element i is kept iff output ``i % 4`` of ``curand_uniform4`` on a Philox4_32_10 state from
    ``curand_init(seed, i // 4, offset)`` exceeds ``p`` (rounded to float32), so the result
    depends only on (seed, offset), never on the launch or the GPU. Kept elements are scaled by
    ``float32(1 / (1 - p))`` worked out in double: ``y`` equals
    ``torch.where(mask, x * (1 / (1 - p)), 0)`` bit for bit. A dropped element is +0 whatever
    ``x`` held, where torch's ``x * mask * (1 / (1 - p))`` gives -0 for a negative ``x`` and
    NaN for an infinite or NaN one; elsewhere the two agree bit for bit.

    The call contract: the kernel runs on the current stream of the arrays' package (torch's
    ``current_stream``, CuPy's current stream; of x, out and mask_out, the first that belongs
    to a package decides), or ``ctx.stream`` where none does (DeviceView, other arrays);
    ``stream=`` overrides. Results come back in that package (torch in, torch out, from
    torch's caching allocator; CuPy likewise; DeviceView from the context's pool) and are
    complete before any later work on the caller's current stream: no synchronize is needed.

    Parameters
    ----------
    x : CUDA array (torch, CuPy, DeviceView, DLPack or __cuda_array_interface__)
        Contiguous float32, float16 or bfloat16.
    p : float
        Drop probability in [0, 1]; 0 copies x bit for bit, 1 gives zeros.
    ctx : InferenceContext, optional
        Defaults to the context of x's device. Its ``increment_offset(4)`` supplies (seed,
        offset) unless both are given; on a stream capturing a CUDA graph, a call site of the
        graph does instead, so every replay draws fresh numbers (docs/graphs.md).
    out : CUDA array, optional
        Receives y (same shape, dtype and device as x; may be x itself).
    mask : {"bits", "bytes", None}
        "bits": bit ``i % 32`` of 32-bit word ``i // 32`` (uint32 words; int32 for torch, which
        has no full uint32 support: the same bits); "bytes": one uint8 per element, 1 kept.
    mask_out : CUDA array, optional
        Receives the mask (uint32 or int32 words for "bits", uint8 for "bytes"), so that a
        loop reuses one buffer instead of allocating a mask per call.
    seed, offset : int, optional
        An explicit Philox state (offset a multiple of 4); give both or neither. Under capture
        it stays fixed: every replay draws the same mask.
    stream : stream-like, optional
        Run on this stream (a stream of x's device) instead of the caller's current stream;
        the caller's current stream still waits for the result.

    Returns
    -------
    (y, mask) : y in the arrays' package (or ``out``), mask likewise (or ``mask_out``) or None.
    """
    if (out is None and mask_out is None and stream is None and seed is None and offset is None
            and type(mask) is str and mask == "bits"):
        done = _torch_dropout(x, p, ctx)
        if done is not None:
            return done
    cdef double prob = _probability_arg(p)
    # (a list or dict would make the lookup raise TypeError: unhashable)
    if not (mask is None or isinstance(mask, str)) or mask not in _MASK_MODES:
        raise _ConfigError(f"mask: got {_brief(mask)}; valid: 'bits' (default), 'bytes' or None",
                           argument="mask")
    cdef int mode = _MASK_MODES[mask]
    if (seed is None) != (offset is None):
        raise _ConfigError("seed/offset: give both (an explicit Philox state) or neither (taken "
                           "from ctx.increment_offset(4))", argument="seed" if seed is None else "offset")
    if mask_out is not None and mode == 0:
        raise _ConfigError("mask_out: given with mask=None; pass mask='bits' or 'bytes'",
                           argument="mask_out")
    cdef uint64_t s = 0, o = 0
    if seed is not None:  # checked before the operands' device is looked up
        s = _uint64_arg(seed, "seed")
        o = _uint64_arg(offset, "offset")
    cdef _Call call = _begin_call((x, out, mask_out), ctx, stream)
    try:
        done = _dropout_on(call, x, prob, out, mode, mask_out, seed is not None, s, o)
    except BaseException:
        call.abandon()
        raise
    call.finish()
    return done


cdef tuple _dropout_on(_Call call, object x, double prob, object out, int mode, object mask_out,
                       bint explicit, uint64_t s, uint64_t o):
    """dropout's checks, results and launch on a begun call (see dropout)."""
    cdef InferenceContext context = call.ctx
    cdef CudaArray a = call.array(x, "x")
    cdef int dtype = _kernel_dtype(a, "x")
    cdef int64_t n = a.size
    # The outputs given are checked before any is allocated.
    cdef uintptr_t y_ptr = 0
    cdef uintptr_t mask_ptr = 0
    cdef CudaArray mk
    cdef CudaArray written = None  # out's import, kept until the kernel is queued (its owner holds the memory)
    if out is not None:
        written = _out_arg(call, out, a, "x")
        y_ptr = written.ptr
    if mask_out is not None:
        mk = call.array(mask_out, "mask_out")
        _mask_arg(mk, "mask_out", mode, a, "x")
        mask_ptr = mk.ptr
    y = out
    if out is None:
        y = call.result(a._dtype, a.shape, x if call._like is x and call.package == PKG_TORCH else None, "out",
                        " and mask_out= (or mask=None)" if mask_out is None and mode != 0 else "")
        y_ptr = _result_ptr(y)
    m = mask_out
    if mask_out is None and mode != 0:
        if mode == 2:  # ceil(n / 32) 32-bit words
            m = call.result(DT_INT32 if call.package == PKG_TORCH else DT_UINT32,
                            (dropout_mask_elements(n, mode),), None, "mask_out", " (or mask=None)")
        else:  # a uint8 per element, in x's shape
            m = call.result(DT_UINT8, a.shape, None, "mask_out", " (or mask=None)")
        mask_ptr = _result_ptr(m)
    cdef const void* xp = <const void*>a.ptr
    cdef void* yp = <void*>y_ptr
    cdef int dev = a.device
    # The context's state (increment_offset(4), or a graph call site under capture; _graph_rng.pxi)
    # unless seed/offset were given.
    _dropout_launch(context, xp, yp, <void*>mask_ptr, n, dtype, prob, mode, explicit, s, o,
                    call.kernel, dev)
    return y, m


cdef object _torch_dropout(object x, object p, object ctx):
    """dropout(x, p) of a torch tensor with the default arguments, in compiled code: what the
    general path does for it (the same checks, results and kernel) without its generality.
    None where the call needs more (a first call on the device, a dtype or layout the general
    path refuses with its message, an empty tensor, a released workspace whose addresses the
    general path refuses): the general path then takes it."""
    if _released_contexts:
        return None  # the general path refuses operands in a released workspace
    if _torch_tensor is None:
        _refresh_packages()
        if _torch_tensor is None:
            return None
    if not isinstance(x, _torch_tensor):
        return None
    dt = _torch_to_dt.get(x.dtype)
    if dt is None or <int>dt > DT_BFLOAT16:
        return None
    cdef int device = x.get_device()
    if device < 0:
        return None
    cdef InferenceContext context = _fast_path_context(ctx, device)
    if context is None:
        return None
    cdef int64_t n = x.numel()
    if n == 0 or not x.is_contiguous() or x.is_neg():
        return None
    cdef double prob = _probability_arg(p)
    cdef uintptr_t stream = _package_stream(PKG_TORCH, device)
    y = _torch_empty_like(x)
    m = _torch_mask_words(x, device, dropout_mask_elements(n, 2))
    cdef uintptr_t xp = x.data_ptr()
    cdef uintptr_t yp = y.data_ptr()
    cdef uintptr_t mp = m.data_ptr()
    _dropout_launch(context, <const void*>xp, <void*>yp, <void*>mp, n, <int>dt, prob, 2, False, 0, 0,
                    stream, device)
    return y, m


cdef dict _torch_word_templates = {}  # device -> an empty int32 tensor there


cdef object _torch_mask_words(object x, int device, int64_t words):
    """A new int32 torch tensor of `words` elements on x's device (cuda:`device`), from torch's
    caching allocator. new_empty of an int32 tensor with one int argument is the cheapest
    allocation torch's Python binding offers (no dtype keyword to parse). The template is a
    plain torch.Tensor's: a subclass's `x` makes its own, as the general path's results do, and
    is not kept (it would make every later mask on the device of its class)."""
    if type(x) is not _torch_tensor:
        return x.new_empty(words, dtype=_dt_to_torch[DT_INT32])
    template = _torch_word_templates.get(device)
    if template is None:
        template = x.new_empty(0, dtype=_dt_to_torch[DT_INT32])
        _torch_word_templates[device] = template
    return template.new_empty(words)


def apply_mask(grad, mask, p, *, ctx=None, out=None, stream=None):
    """The backward of dropout: ``grad / (1 - p)`` where ``mask`` kept the element, 0 elsewhere.

    ``mask`` is what ``dropout`` returned: 32-bit words (bits) or uint8 (bytes, any nonzero
    byte keeps). Same ``ctx``, ``out`` and ``stream`` rules, and the same call contract, as
    ``dropout``; returns the result (in the arrays' package, or ``out``). p = 1 gives zeros (+0)
    whatever the mask keeps.
    """
    cdef double prob = _probability_arg(p)
    cdef _Call call = _begin_call((grad, mask, out), ctx, stream, "grad")
    try:
        result = _apply_mask_on(call, grad, mask, prob, out)
    except BaseException:
        call.abandon()
        raise
    call.finish()
    return result


cdef object _apply_mask_on(_Call call, object grad, object mask, double prob, object out):
    """apply_mask's checks, result and launch on a begun call (see apply_mask)."""
    cdef CudaArray g = call.array(grad, "grad")
    cdef int dtype = _kernel_dtype(g, "grad")
    cdef CudaArray mk = call.array(mask, "mask")
    cdef int mode = _mask_arg(mk, "mask", 0, g, "grad")
    cdef uintptr_t out_ptr
    cdef CudaArray written = None  # out's import, kept until the kernel is queued (its owner holds the memory)
    if out is None:
        result = call.result(g._dtype, g.shape,
                             grad if call._like is grad and call.package == PKG_TORCH else None, "out")
        out_ptr = _result_ptr(result)
    else:
        written = _out_arg(call, out, g, "grad")
        out_ptr = written.ptr
        result = out
    cdef const void* gp = <const void*>g.ptr
    cdef const void* mp = <const void*>mk.ptr
    cdef void* op = <void*>out_ptr
    cdef int64_t n = g.size
    cdef int dev = g.device
    cdef uintptr_t handle = call.kernel
    with nogil:
        dropout_apply_mask(gp, mp, op, n, dtype, prob, mode, <cudaStream_t>handle, dev, 0)
    return result


cdef uintptr_t _result_ptr(object r) except? 0:
    """The device address of a result that _Call.result made."""
    if isinstance(r, DeviceView):
        return (<DeviceView>r)._ptr
    if _torch_tensor is not None and isinstance(r, _torch_tensor):
        return <uintptr_t>r.data_ptr()
    return <uintptr_t>r.data.ptr  # cupy.ndarray

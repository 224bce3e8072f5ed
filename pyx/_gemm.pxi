# Part of _core.pyx: GEMM on the context's cuBLAS handle. The layout of a call's operands is
# worked out by inferctx::gemm_layout (cuda/src/gemm_layout.cpp) once per call signature and
# kept here, for the general path (_gemm, on operands the call contract imported) and for the
# torch fast path (_torch_product) behind the public gemm and bmm; then the tuner and algorithm-cache glue of python/inferctx/gemm.py.

from libc.float cimport FLT_MAX
from libc.math cimport fabs
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libcpp.vector cimport vector as cpp_vector

from inferctx._decl_gemm cimport (
    GemmCacheEntry, GemmLayout, GemmOperand, GemmProblem, GemmTuneOptions, GemmTuneResult,
    check_gemm_addresses, check_gemm_cache, clear_gemm_cache, export_gemm_cache, gemm as cpp_gemm, gemm_layout,
    import_gemm_cache, normalized_gemm_problem, packed_gemm_problem, packed_operand_alignment,
    tune_gemm)
from inferctx._decl_gpu cimport CppInferenceContext, cudaStream_t


cdef class _GemmLayout:
    """A worked-out inferctx::GemmLayout."""
    cdef GemmLayout c
    cdef tuple out_shape
    cdef tuple out_strides  # a new result's: packed row-major, as torch lays out a new tensor
    # Some operand has every stride of its dimensions longer than 1 even, as a torch view with
    # the negative bit (z.conj().imag: strides twice the complex ones) has: the torch fast path
    # asks such operands is_neg(), which the general path refuses.
    cdef bint may_be_negated


cdef bint _even_strides(tuple shape, tuple strides):
    for n, s in zip(shape, strides):
        if n > 1 and s % 2 != 0:
            return False
    return True


# Layouts by call signature: (ndim, trans_a, trans_b, then dtype index, shape and strides of a,
# b and out; None for out's when there is no out). Bounded; cleared when full.
cdef dict _gemm_layouts = {}
cdef Py_ssize_t _GEMM_LAYOUT_LIMIT = 4096

# The torch fast path's guarded layouts: for (a.numel(), b.numel(), flags of _torch_product), up
# to _GUARDS_PER_KEY pairs (check, layout), `check` the bound check method of a torch
# TensorGuards made from operands the layout was found for. One call of it compares each
# operand's Python type, dispatch keys (its device type, negative bit, inference mode), dtype,
# device index, requires_grad, sizes and strides with theirs in torch's C++: what _layout_key and
# the fast path's device and is_neg checks read, at a fraction of their host time. Bounded;
# cleared when full, and dropped for good if torch's guards ever fail (the keyed path remains).
cdef dict _torch_guarded = {}
cdef int _GUARDS_PER_KEY = 4


cdef inline tuple _layout_key(int ndim, bint trans_a, bint trans_b, object dt_a, object shape_a,
                              object strides_a, object dt_b, object shape_b, object strides_b,
                              object dt_c, object shape_c, object strides_c):
    """The key of _gemm_layouts: one construction for the general path and the torch fast path,
    whose lookups must agree (torch.Size and stride() tuples equal the CudaArray's tuples)."""
    return (ndim, trans_a, trans_b, dt_a, shape_a, strides_a, dt_b, shape_b, strides_b, dt_c,
            shape_c, strides_c)


cdef GemmOperand _gemm_operand(int dtype, str dtype_name, tuple shape, tuple strides) except *:
    cdef GemmOperand x
    x.dtype = dtype if DT_FLOAT32 <= dtype <= DT_BFLOAT16 else -1
    x.dtype_name = dtype_name.encode()
    for n in shape:
        x.shape.push_back(n)
    for s in strides:
        x.strides.push_back(s)
    return x


cdef _GemmLayout _new_gemm_layout(int ndim, bint trans_a, bint trans_b, GemmOperand* a,
                                  GemmOperand* b, GemmOperand* out):
    cdef _GemmLayout layout = _GemmLayout.__new__(_GemmLayout)
    layout.c = gemm_layout(ndim, trans_a, trans_b, a[0], b[0], out)
    layout.out_shape = tuple(layout.c.out_shape)
    layout.out_strides = _packed_strides(layout.out_shape)
    return layout


cdef tuple _packed_strides(tuple shape):
    """Row-major strides of `shape` as torch gives a new tensor: a dimension of size 0 counts
    as 1 (torch.empty(3, 0).stride() is (1, 1))."""
    strides = []
    cdef Py_ssize_t step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(<Py_ssize_t>n, 1)
    return tuple(reversed(strides))


cdef _GemmLayout _gemm_layout_of(int ndim, bint trans_a, bint trans_b, CudaArray a, CudaArray b,
                                 CudaArray c):
    """The layout of a call on imported operands (c None for a new result), worked out once per
    signature; ConfigError naming a, b or out for what cannot be run."""
    key = (_layout_key(ndim, trans_a, trans_b, a._dtype, a.shape, a.strides, b._dtype, b.shape,
                       b.strides, None, None, None) if c is None else
           _layout_key(ndim, trans_a, trans_b, a._dtype, a.shape, a.strides, b._dtype, b.shape,
                       b.strides, c._dtype, c.shape, c.strides))
    found = _gemm_layouts.get(key)
    if found is not None:
        return <_GemmLayout>found
    cdef GemmOperand oa = _gemm_operand(a._dtype, a.dtype, a.shape, a.strides)
    cdef GemmOperand ob = _gemm_operand(b._dtype, b.dtype, b.shape, b.strides)
    cdef GemmOperand oc
    if c is not None:
        oc = _gemm_operand(c._dtype, c.dtype, c.shape, c.strides)
    cdef _GemmLayout layout = _new_gemm_layout(ndim, trans_a, trans_b, &oa, &ob,
                                               <GemmOperand*>NULL if c is None else &oc)
    layout.may_be_negated = (_even_strides(a.shape, a.strides) or _even_strides(b.shape, b.strides)
                             or (c is not None and _even_strides(c.shape, c.strides)))
    if len(_gemm_layouts) >= _GEMM_LAYOUT_LIMIT:
        _gemm_layouts.clear()
    _gemm_layouts[key] = layout
    return layout


cdef int _run_gemm(InferenceContext ctx, uintptr_t stream, _GemmLayout layout, uintptr_t a,
                   uintptr_t b, uintptr_t c, float alpha, float beta, bint tf32) except -1:
    """inferctx::gemm of a layout: the address checks, then the product queued on `stream`."""
    cdef CppInferenceContext* cx = ctx._c
    cdef GemmLayout* lp = &layout.c
    with nogil:
        cpp_gemm(cx.cublas(), <cudaStream_t>stream, lp[0], <const void*>a, <const void*>b, <void*>c,
             alpha, beta, tf32)
    return 0


def _gemm(_Call call, int ndim, CudaArray a, CudaArray b, CudaArray c, object out, bint trans_a,
          bint trans_b, float alpha, float beta, bint tf32):
    """gemm (ndim 2) or bmm (ndim 3) of operands the call imported (c: out's, None for a new
    result), queued on the call's stream; returns out, or the new result in the call's package.
    ConfigError naming a, b or out, before anything is launched, for what cannot be run."""
    cdef _GemmLayout layout = _gemm_layout_of(ndim, trans_a, trans_b, a, b, c)
    cdef uintptr_t c_ptr
    if c is None:
        out = call.result(a._dtype, layout.out_shape, None, "out")
        c_ptr = _result_ptr(out)
    else:
        c_ptr = c.ptr
    _run_gemm(call.ctx, call.kernel, layout, a.ptr, b.ptr, c_ptr, alpha, beta, tf32)
    return out


cdef object _gemm_general = None  # gemm.py's _product: every call the fast path does not take


def _set_gemm_general(general):
    """Sets the function gemm and bmm hand a call to when their torch fast path does not take it:
    ``general(name, ndim, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32, stream)``."""
    global _gemm_general
    _gemm_general = general


def gemm(a, b, *, out=None, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, ctx=None,
         tf32=False, stream=None):
    """``alpha * op(a) @ op(b) + beta * out`` for 2-D CUDA arrays, as NumPy / PyTorch define it.

    Parameters
    ----------
    a, b
        2-D CUDA arrays of the same dtype (float32, float16 or bfloat16) on one device:
        ``a`` is (m, k), or (k, m) with ``trans_a``; ``b`` is (k, n), or (n, k) with ``trans_b``.
        Either may be a transposed view (unit stride along its first dimension).
    out
        (m, n) array of the same dtype to write into (row- or column-major); when None, a new
        result in the operands' package (see Returns).
    trans_a, trans_b
        Use the transpose of ``a`` / ``b``.
    alpha, beta
        Scale factors (fp32). ``beta`` other than 0 needs ``out``, whose values it scales.
    ctx
        The InferenceContext whose cuBLAS handle runs the product; by default the one of the
        operands' device.
    tf32
        float32 only: allow TF32 tensor cores (relative error near 3e-4 instead of near 1e-6).
    stream
        Run on this stream (of the operands' device) instead of the caller's current stream;
        the caller's current stream still waits for the result.

    Returns
    -------
    ``out``, or a new array in the operands' package: a torch tensor for torch operands, a CuPy
    array for CuPy ones, an inferctx.DeviceView otherwise. Accumulation is fp32 for every
    dtype. The product runs on the caller's current stream (the call contract: README,
    inferctx.gemm's module docstring) and is complete before any later work there; m, n or k may be 0 (k = 0 gives
    ``beta * out``, zeros for a new result). Untuned, it makes the cuBLAS call torch.matmul
    makes (``cublasGemmEx``), so it gives torch's bits at torch's speed; ``autotune_gemm``
    may find a faster cuBLASLt algorithm.
    """
    if stream is None:  # torch tensors of a problem seen before: compiled, in one call
        done = _torch_product(2, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32)
        if done is not NotImplemented:
            return done
    return _gemm_general("gemm", 2, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32, stream)


def bmm(a, b, *, out=None, trans_a=False, trans_b=False, alpha=1.0, beta=0.0, ctx=None,
        tf32=False, stream=None):
    """Batched ``gemm`` of 3-D CUDA arrays: ``out[i] = alpha * op(a[i]) @ op(b[i]) + beta * out[i]``.

    ``a`` is (batch, m, k) (or (batch, k, m) with ``trans_a``), ``b`` is (batch, k, n) (or
    (batch, n, k) with ``trans_b``); a batch size of 1 in one operand is broadcast over the
    other's. Any batch stride works, so a (batch, m, n) view of an (m, batch, n) array does
    too. Returns ``out`` or a new (batch, m, n) array in the operands' package. Other arguments,
    and the call contract, as in ``gemm``.
    """
    if stream is None:
        done = _torch_product(3, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32)
        if done is not NotImplemented:
            return done
    return _gemm_general("bmm", 3, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32, stream)


def _torch_gemm(int ndim, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32):
    """What gemm (ndim 2) or bmm (3) does first: the torch fast path, or NotImplemented."""
    return _torch_product(ndim, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32)


cdef object _torch_product(int ndim, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32):
    """gemm / bmm of torch tensors on torch's current stream (gemm and bmm try it first when no
    stream= is given), when nothing in the call needs more than reading the tensors: the layout
    of their signature was worked out before (by the general path), and the devices agree with
    each other and ctx. Returns NotImplemented otherwise (also while a workspace is released),
    and gemm.py's path (which says what is wrong) takes the call."""
    if _torch_to_dt is None:
        _refresh_packages()
    if (_torch_to_dt is None or _released_contexts
            or not isinstance(a, _torch_tensor)
            or not isinstance(b, _torch_tensor)
            or (out is not None and not isinstance(out, _torch_tensor))
            or type(alpha) is not float
            or type(beta) is not float
            or (trans_a is not True and trans_a is not False)
            or (trans_b is not True and trans_b is not False)
            or (tf32 is not True and tf32 is not False)
            or (out is None and beta != 0.0)
            or not (fabs(<double>alpha) <= FLT_MAX and fabs(<double>beta) <= FLT_MAX)):
        return NotImplemented  # gemm.py's path says what is wrong (alpha or beta not finite in fp32)
    cdef int device = a.get_device()
    if device < 0:
        return NotImplemented
    cdef InferenceContext context = _fast_path_context(ctx, device)
    if context is None:
        return NotImplemented
    cdef int flags = (ndim << 3) | (4 if out is not None else 0) | (2 if trans_a else 0) | (
        1 if trans_b else 0)
    guard_key = (a.numel(), b.numel(), flags)
    cdef _GemmLayout layout = _guarded_layout(guard_key, a, b, out)
    if layout is None:
        layout = _keyed_layout(ndim, trans_a, trans_b, a, b, out, device)
        if layout is None:
            return NotImplemented
        _guard_layout(guard_key, a, b, out, layout)
    if out is None:
        if (_torch_empty_strided is not None and type(a) is _torch_tensor
                and _torch_current_device() == device):
            # torch's caching allocator on the current device (a's), without the argument
            # parsing and dispatch of new_empty, whose host time it saves in part.
            out = _torch_empty_strided(layout.out_shape, layout.out_strides, a.dtype)
        else:
            # A subclass of torch.Tensor makes its own result (its __torch_function__), and
            # another device's is made there. Sizes as separate ints: torch parses them faster
            # than one tuple; out_shape has two or three.
            out = a.new_empty(*layout.out_shape)
    cdef uintptr_t stream = _package_stream(PKG_TORCH, device)
    _run_gemm(context, stream, layout, a.data_ptr(), b.data_ptr(), out.data_ptr(), alpha, beta, tf32)
    return out


cdef _GemmLayout _guarded_layout(tuple guard_key, a, b, out):
    """The layout whose guards a, b (and out) pass, else None."""
    global _tensor_guards
    entries = _torch_guarded.get(guard_key)
    if entries is None:
        return None
    try:
        for check, layout in <tuple>entries:
            if check(a, b) if out is None else check(a, b, out):
                return <_GemmLayout>layout
    except Exception:  # a torch whose guards changed: the keyed path serves every call from now on
        _tensor_guards = None
        _torch_guarded.clear()
    return None


cdef _GemmLayout _keyed_layout(int ndim, bint trans_a, bint trans_b, a, b, out, int device):
    """The layout _gemm_layouts holds for the signature of torch tensors a, b (and out) on
    `device`, else None (also where a device differs or an operand is negated: the general path
    says what is wrong)."""
    if b.get_device() != device or (out is not None and out.get_device() != device):
        return None
    cdef object dt_a = _torch_to_dt.get(a.dtype)
    cdef object dt_b = _torch_to_dt.get(b.dtype)
    key = (_layout_key(ndim, trans_a, trans_b, dt_a, a.shape, a.stride(), dt_b, b.shape, b.stride(),
                       None, None, None) if out is None else
           _layout_key(ndim, trans_a, trans_b, dt_a, a.shape, a.stride(), dt_b, b.shape, b.stride(),
                       _torch_to_dt.get(out.dtype), out.shape, out.stride()))
    found = _gemm_layouts.get(key)
    if found is None:
        return None
    cdef _GemmLayout layout = <_GemmLayout>found
    if layout.may_be_negated and (a.is_neg() or b.is_neg() or (out is not None and out.is_neg())):
        return None
    return layout


cdef int _guard_layout(tuple guard_key, a, b, out, _GemmLayout layout) except -1:
    """Keeps TensorGuards of a, b (and out), which _keyed_layout found `layout` for, under
    guard_key: the next call of the same signature finds it by _guarded_layout."""
    global _tensor_guards
    if _tensor_guards is None:
        return 0
    try:
        guards = (_tensor_guards(a, b, dynamic_dims_sizes=None, dynamic_dims_strides=None)
                  if out is None else
                  _tensor_guards(a, b, out, dynamic_dims_sizes=None, dynamic_dims_strides=None))
        check = guards.check
    except Exception:  # a torch whose TensorGuards takes other arguments: the keyed path serves
        _tensor_guards = None
        _torch_guarded.clear()
        return 0
    entries = _torch_guarded.get(guard_key)
    if entries is None and len(_torch_guarded) >= _GEMM_LAYOUT_LIMIT:
        _torch_guarded.clear()
    # A new tuple replaces the old one: a thread reading the old one meanwhile reads it whole.
    _torch_guarded[guard_key] = ((check, layout),) + (
        () if entries is None else (<tuple>entries)[:_GUARDS_PER_KEY - 1])
    return 0


def _gemm_layout(int ndim, bint trans_a, bint trans_b, a, b, out=None, addresses=None):
    """The layout inferctx::gemm_layout works out for operands given as (dtype name, shape,
    strides) tuples (out None for a new result), on the host: nothing is launched. A dict of its
    GemmProblem fields, ``swap`` and ``out_shape``. With ``addresses`` (a, b, out as ints),
    check_gemm_addresses runs on them too."""
    cdef GemmOperand ops[3]
    cdef int i
    for i, spec in enumerate((a, b, out)):
        if spec is not None:
            name, shape, strides = spec
            ops[i] = _gemm_operand(_DTYPE_BY_NAME.get(name, -1), name, tuple(shape), tuple(strides))
    cdef _GemmLayout layout = _new_gemm_layout(ndim, trans_a, trans_b, &ops[0], &ops[1],
                                               <GemmOperand*>NULL if out is None else &ops[2])
    cdef uintptr_t pa, pb, pc
    if addresses is not None:
        pa, pb, pc = addresses
        check_gemm_addresses(layout.c, pa, pb, pc)
    d = _problem_dict(layout.c.problem)
    d["swap"] = layout.c.swap
    d["out_shape"] = layout.out_shape
    return d


cdef GemmProblem _gemm_problem(int dtype, bint trans_a, bint trans_b, int64_t m, int64_t n, int64_t k,
                               int64_t batch, int64_t lda, int64_t ldb, int64_t ldc, int64_t stride_a,
                               int64_t stride_b, int64_t stride_c, bint tf32) noexcept:
    cdef GemmProblem p
    p.dtype = dtype
    p.trans_a = trans_a
    p.trans_b = trans_b
    p.m, p.n, p.k, p.batch = m, n, k, batch
    p.lda, p.ldb, p.ldc = lda, ldb, ldc
    p.stride_a, p.stride_b, p.stride_c = stride_a, stride_b, stride_c
    p.tf32 = tf32
    return p


cdef dict _problem_dict(const GemmProblem& p):
    return {"dtype": p.dtype, "trans_a": p.trans_a, "trans_b": p.trans_b, "m": p.m, "n": p.n,
            "k": p.k, "batch": p.batch, "lda": p.lda, "ldb": p.ldb, "ldc": p.ldc,
            "stride_a": p.stride_a, "stride_b": p.stride_b, "stride_c": p.stride_c, "tf32": p.tf32}


def _gemm_packed_problem(int dtype, int64_t m, int64_t n, int64_t k, int64_t batch, bint trans_a,
                         bint trans_b, bint tf32):
    """The problem of densely packed operands as the algorithm cache keys it (normalized), as a
    dict: what autotune_gemm tunes for a shape, and what a contiguous call of it runs."""
    return _problem_dict(normalized_gemm_problem(
        packed_gemm_problem(dtype, m, n, k, batch, trans_a, trans_b, tf32)))


def _gemm_packed_alignments(int64_t batch, int64_t stride_a, int64_t stride_b, int64_t stride_c,
                            int64_t itemsize):
    """The alignments (bytes) the algorithm cache records for a, b and c of a packed problem
    (inferctx::packed_operand_alignment), as autotune_gemm's tuner records them."""
    return (packed_operand_alignment(batch, stride_a, itemsize),
            packed_operand_alignment(batch, stride_b, itemsize),
            packed_operand_alignment(batch, stride_c, itemsize))


def _gemm_tune(InferenceContext ctx, int dtype, bint trans_a, bint trans_b, int64_t m, int64_t n,
               int64_t k, int64_t batch, bint tf32, int max_algorithms, int warmup, int repeats):
    """inferctx::tune_gemm of the packed problem of a shape, on the context's handle, on
    ctx.stream; the GemmTuneResult as a dict."""
    cdef GemmProblem p = packed_gemm_problem(dtype, m, n, k, batch, trans_a, trans_b, tf32)
    cdef GemmTuneOptions options
    options.max_algorithms = max_algorithms
    options.warmup = warmup
    options.repeats = repeats
    cdef CppInferenceContext* cx = ctx._c
    cdef GemmTuneResult r
    cdef uintptr_t stream = _ctx_stream(ctx)
    with nogil:
        r = tune_gemm(cx.cublas(), <cudaStream_t>stream, p, options)
    return {
        "backend": r.backend, "algo_index": r.algo_index, "algo": [w for w in r.algo],
        "algo_id": r.algo_id, "tile_id": r.tile_id, "stages_id": r.stages_id, "splitk": r.splitk,
        "default_ms": r.default_ms, "best_ms": r.best_ms, "candidates": r.candidates,
        "valid": r.valid, "rotated_sets": r.rotated_sets,
    }


def _gemm_cache_export(tuned_only):
    """The GEMM algorithm cache as a list of dicts (GemmCacheEntry fields)."""
    cdef bint only = _bool_arg(tuned_only, "tuned_only")
    cdef cpp_vector[GemmCacheEntry] entries
    with nogil:
        entries = export_gemm_cache(only)
    out = []
    cdef size_t i
    cdef GemmCacheEntry* e
    for i in range(entries.size()):
        e = &entries[i]
        out.append({
            "device": e.device, "device_name": e.device_name.decode("utf-8", "replace"),
            "cublas_version": e.cublas_version, "problem": _problem_dict(e.problem),
            "align_a": e.align_a, "align_b": e.align_b, "align_c": e.align_c,
            "backend": e.backend, "algo": [w for w in e.algo], "time_ms": e.time_ms,
        })
    return out


cdef cpp_vector[GemmCacheEntry] _cache_entries(entries) except *:
    """Cache entries (dicts as _gemm_cache_export gives) as inferctx::GemmCacheEntry values."""
    cdef cpp_vector[GemmCacheEntry] v
    cdef GemmCacheEntry e
    for d in entries:
        e.device = d["device"]
        e.device_name = str(d["device_name"]).encode()
        e.cublas_version = d["cublas_version"]
        q = d["problem"]
        e.problem = _gemm_problem(q["dtype"], q["trans_a"], q["trans_b"], q["m"], q["n"], q["k"],
                                  q["batch"], q["lda"], q["ldb"], q["ldc"], q["stride_a"],
                                  q["stride_b"], q["stride_c"], q["tf32"])
        e.align_a, e.align_b, e.align_c = d["align_a"], d["align_b"], d["align_c"]
        e.backend = d["backend"]
        e.algo.clear()
        for w in d["algo"]:
            e.algo.push_back(<uint64_t>w)
        e.time_ms = d["time_ms"]
        v.push_back(e)
    return v


def _gemm_cache_import(entries):
    """Adds cache entries (dicts as _gemm_cache_export gives); returns how many were taken."""
    cdef cpp_vector[GemmCacheEntry] v = _cache_entries(entries)
    cdef int64_t taken
    with nogil:
        taken = import_gemm_cache(v)
    return taken


def _gemm_cache_keys(entries):
    """What the cache keys each entry by (dicts as _gemm_cache_export gives): device, device name,
    cuBLAS version, the normalized problem and the three alignments, as tuples, after the checks
    _gemm_cache_import makes (ConfigError "entry i: ..."); nothing is added to the cache."""
    cdef cpp_vector[GemmCacheEntry] v = _cache_entries(entries)
    with nogil:
        check_gemm_cache(v)
    keys = []
    cdef size_t i
    cdef GemmProblem p
    for i in range(v.size()):
        p = normalized_gemm_problem(v[i].problem)
        keys.append((v[i].device, v[i].device_name, v[i].cublas_version,
                     tuple(_problem_dict(p).items()), v[i].align_a, v[i].align_b, v[i].align_c))
    return keys


def _gemm_cache_clear():
    """Empties the GEMM algorithm cache."""
    with nogil:
        clear_gemm_cache()

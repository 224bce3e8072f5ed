# Part of _core.pyx: the call contract of every entry point that launches GPU work (dropout,
# apply_mask, gemm, bmm and any later kernel).
#
# - The stream. By default the work runs on the current stream of the operands' package:
#   torch.cuda.current_stream(device) for torch tensors, CuPy's current stream for CuPy arrays.
#   With operands of several packages, the first operand (in argument order) that belongs to a
#   package decides. Operands that belong to no package (DeviceView, a bare
#   __cuda_array_interface__ or DLPack object) use ctx.stream. ``stream=`` overrides all of it.
# - ctx.stream is the stream use_stream() adopted, or else DeepSpeed's "current stream": torch's
#   current stream of the context's device once torch is imported, else CuPy's once CuPy is
#   imported, else the context's own stream. So "a kernel, then sync_comp(), then work on
#   comm_stream" is ordered without a use_stream call; with torch and CuPy both imported (and
#   no stream adopted) sync_comp / sync_comm also order CuPy's current stream, where a CuPy
#   caller's kernels ran.
# - Ordering. The caller's streams are the current streams of the operands' packages (and
#   ctx.stream for package-less operands). Where one differs from the stream the work runs on,
#   the work first waits for it (inputs are read after their producer's pending work, and out=
#   is written after the caller's pending reads of it), and it then waits for the work (results
#   are complete before any later work on it). Each join is one event record and one wait; when
#   all the streams are one (the default case), there are none.
# - Results come back in the package that decided the stream: torch.Tensor from torch's caching
#   allocator, cupy.ndarray from CuPy's pool, DeviceView from the context's stream-ordered pool.
#   A torch or CuPy result is allocated on the caller's current stream; where the work ran on
#   another stream, the join above orders every later use and reuse of the block on the
#   caller's stream after the work (what record_stream would give).
# torch and CuPy are never imported here: their types are known once the caller imported them.

from libc.stdint cimport int64_t, uintptr_t

from inferctx._decl_dlpack cimport kDLCUDA, kDLCUDAManaged
from inferctx._decl_gpu cimport (
    cudaError_t, cudaGetLastError, cudaStreamCaptureStatus, cudaStreamCaptureStatusNone,
    cudaStreamGetDevice, cudaStreamIsCapturing, cudaStreamLegacy, cudaStreamPerThread, cudaStream_t,
    cudaSuccess, stream_is_on_device)

import sys as _sys

cdef enum:
    PKG_NONE = 0
    PKG_TORCH = 1
    PKG_CUPY = 2

cdef object _torch_tensor = None       # torch.Tensor, once torch is imported (with CUDA)
cdef object _torch_raw_stream = None   # torch._C._cuda_getCurrentRawStream
cdef object _torch_empty_like = None
# torch._C._dynamo.guards._empty_strided_cuda(sizes, strides, dtype): a tensor on the current
# device from torch's caching allocator without torch's argument parser and dispatcher (what
# torch's own compiled code allocates with), and torch._C._cuda_getDevice; None where this torch
# lacks either (Tensor.new_empty is used then).
cdef object _torch_empty_strided = None
cdef object _torch_current_device = None
# torch._C._dynamo.guards.TensorGuards: the torch gemm fast path's guards (_gemm.pxi); None where
# this torch lacks it, or its guards failed once.
cdef object _tensor_guards = None
cdef dict _torch_to_dt = None          # torch dtype -> dtype table index
cdef dict _dt_to_torch = None
cdef object _cupy = None
cdef object _cupy_ndarray = None
cdef bint _cupy_stream_takes_device = True
cdef Py_ssize_t _modules_seen = -1      # len(sys.modules) when the packages were last looked for


cdef int _refresh_packages() except -1:
    """Learns torch's and CuPy's types once the caller has imported them (looked for again only
    when a module was imported since the last look).

    Another thread may be importing torch meanwhile: it is in sys.modules before its __init__
    has bound all it exports. Such a torch is left for a later look (while its import runs the
    count is not recorded, so the next call looks again: the import may end without adding a
    module), and torch's caches are set together, only from a module that has all they take: a
    call never finds some of them set and torch.Tensor's still None."""
    global _torch_tensor, _torch_raw_stream, _torch_empty_like, _torch_to_dt
    global _torch_empty_strided, _torch_current_device, _tensor_guards
    global _dt_to_torch, _cupy, _cupy_ndarray, _modules_seen
    cdef Py_ssize_t modules = len(_sys.modules)
    if modules == _modules_seen:
        return 0
    cdef bint settled = True
    if _torch_tensor is None:
        torch = _sys.modules.get("torch")
        if torch is not None:
            tensor = getattr(torch, "Tensor", None)
            empty_like = getattr(torch, "empty_like", None)
            if tensor is None or empty_like is None or not hasattr(torch, "bfloat16"):
                # Not (yet) the torch inferctx uses: part way through its import (every torch
                # has these), or another module of that name.
                settled = not getattr(getattr(torch, "__spec__", None), "_initializing", False)
            else:
                torch_c = getattr(torch, "_C", None)
                raw = getattr(torch_c, "_cuda_getCurrentRawStream", None)
                if raw is not None:  # a CPU-only build of torch has no CUDA streams
                    pairs = [("float32", DT_FLOAT32), ("float16", DT_FLOAT16),
                             ("bfloat16", DT_BFLOAT16), ("float64", DT_FLOAT64), ("int8", DT_INT8),
                             ("int16", DT_INT16), ("int32", DT_INT32), ("int64", DT_INT64),
                             ("uint8", DT_UINT8), ("uint16", DT_UINT16), ("uint32", DT_UINT32),
                             ("uint64", DT_UINT64), ("bool", DT_BOOL)]
                    to_dt = {}
                    from_dt = {}
                    for name, dt in pairs:
                        t = getattr(torch, name, None)
                        if t is not None:
                            to_dt[t] = dt
                            from_dt[dt] = t
                    guards = getattr(getattr(torch_c, "_dynamo", None), "guards", None)
                    empty_strided = getattr(guards, "_empty_strided_cuda", None)
                    tensor_guards = getattr(guards, "TensorGuards", None)
                    current_device = getattr(torch_c, "_cuda_getDevice", None)
                    if empty_strided is None or current_device is None:
                        empty_strided = current_device = None
                    # From here to the last assignment nothing runs Python code: no other thread
                    # sees part of them.
                    _torch_empty_strided = empty_strided
                    _tensor_guards = tensor_guards
                    _torch_current_device = current_device
                    _torch_to_dt = to_dt
                    _dt_to_torch = from_dt
                    _torch_raw_stream = raw
                    _torch_empty_like = empty_like
                    _torch_tensor = tensor
    if _cupy_ndarray is None:
        cupy = _sys.modules.get("cupy")
        if cupy is not None and hasattr(cupy, "ndarray") and hasattr(cupy, "cuda"):
            _cupy = cupy
            _cupy_ndarray = cupy.ndarray
    # Last: a thread that finds the count unchanged must find the types learned above.
    if settled:
        _modules_seen = modules
    return 0


cdef inline int _package_of(object obj) except -1:
    if _torch_tensor is None or _cupy_ndarray is None:
        _refresh_packages()
    if _torch_tensor is not None and isinstance(obj, _torch_tensor):
        return PKG_TORCH
    if _cupy_ndarray is not None and isinstance(obj, _cupy_ndarray):
        return PKG_CUPY
    return PKG_NONE


cdef object _cupy_current_stream(int device):
    """CuPy's current stream object on `device`."""
    global _cupy_stream_takes_device
    if _cupy_stream_takes_device:
        try:
            return _cupy.cuda.get_current_stream(device)
        except TypeError:  # a CuPy whose get_current_stream takes no device
            _cupy_stream_takes_device = False
    with _cupy.cuda.Device(device):
        return _cupy.cuda.get_current_stream()


cdef uintptr_t _package_stream(int package, int device) except 0:
    """The current stream of `package` on `device` (never 0: the legacy stream is 1)."""
    cdef object handle
    if package == PKG_TORCH:
        handle = _torch_raw_stream(device)
    else:
        handle = _cupy_current_stream(device).ptr
    if handle == 0:
        return <uintptr_t>cudaStreamLegacy
    return <uintptr_t>handle


# What ctx.stream was the last time it followed no adopted stream (InferenceContext._served).
cdef enum:
    SERVED_NONE = 0  # nothing yet, or torch's current stream (which it follows from then on)
    SERVED_OWN = 1   # the context's own stream: neither torch nor CuPy was imported
    SERVED_CUPY = 2  # CuPy's current stream: CuPy was imported, torch not


cdef uintptr_t _ctx_stream(InferenceContext ctx) except 0:
    """ctx.stream's handle: the adopted stream, else torch's current stream once torch is
    imported, else CuPy's once CuPy is, else the context's own. When an import moves it (own to
    CuPy's or torch's, CuPy's to torch's), the new stream first waits for what was queued on the
    one it leaves (kernels, copies, results still to be read)."""
    if ctx._adopted is not None:
        return <uintptr_t>ctx._c.stream()
    if _torch_tensor is None or _cupy_ndarray is None:
        _refresh_packages()
    cdef uintptr_t s
    cdef uintptr_t before = 0
    # _served moves only once the join is queued: _order runs without the GIL, and a thread that
    # saw the move as done meanwhile would queue its work before the join.
    if _torch_tensor is not None:
        s = _package_stream(PKG_TORCH, ctx.device)
        if ctx._served != SERVED_NONE:
            if ctx._served == SERVED_OWN:
                before = <uintptr_t>ctx._c.own_stream()
            else:
                before = _package_stream(PKG_CUPY, ctx.device)
            ctx._order(before, s)
            ctx._served = SERVED_NONE
        return s
    if _cupy_ndarray is not None:
        s = _package_stream(PKG_CUPY, ctx.device)
        if ctx._served != SERVED_CUPY:
            if ctx._served == SERVED_OWN:
                before = <uintptr_t>ctx._c.own_stream()
            if before != 0:
                ctx._order(before, s)
            ctx._served = SERVED_CUPY
        return s
    ctx._served = SERVED_OWN
    return <uintptr_t>ctx._c.own_stream()


cdef uintptr_t _cupy_stream_too(InferenceContext ctx, uintptr_t ctx_stream) except? 0:
    """CuPy's current stream on ctx's device where torch's current stream is ctx.stream (torch
    and CuPy both imported, no stream adopted) and the two differ, neither being captured into
    a CUDA graph; else 0. A CuPy caller's kernels run on CuPy's stream, so sync_comp / sync_comm
    order that one too."""
    if ctx._adopted is not None or _torch_tensor is None or _cupy_ndarray is None:
        return 0
    cdef uintptr_t s = _package_stream(PKG_CUPY, ctx.device)
    if s == ctx_stream:
        return 0
    cdef cudaError_t ignored = cudaSuccess  # a stream that does not exist: sync_comp reports it
    with nogil:  # under CUDA-graph capture the extra join could cross a capture's boundary
        if (_capture_id(<cudaStream_t>s, &ignored) != 0
                or _capture_id(<cudaStream_t>ctx_stream, &ignored) != 0):
            s = 0
    return s


cdef uintptr_t _checked_stream(object stream, int device, str argument) except 0:
    """The handle of a caller's ``stream=``: a stream of `device` that exists. ConfigError naming
    `argument` otherwise, before anything is launched."""
    return _checked_handle(stream, _stream_handle(stream, argument), device, argument)


cdef uintptr_t _checked_handle(object stream, uintptr_t handle, int device, str argument) except 0:
    """_checked_stream of a ``stream=`` whose handle (_stream_handle's) is known."""
    cdef int on = -1
    if handle <= <uintptr_t>cudaStreamPerThread:
        # The default streams of whichever device is current: inferctx runs them on ctx's. An
        # object that says it is of another device (torch.cuda.default_stream(1)) is refused.
        on = _declared_device(stream)
        if on >= 0 and on != device:
            raise _ConfigError(f"{argument}: is the default stream of cuda:{on} but the operands "
                               f"are on cuda:{device}; pass a stream of cuda:{device}",
                               argument=argument)
        return handle
    on = _stream_device(stream, handle, device, argument)  # leaves a capture alone
    if on < 0:
        raise _ConfigError(f"{argument}: {handle:#x} is a stream of another device than the "
                           f"operands' cuda:{device}; pass a stream of cuda:{device}",
                           argument=argument)
    if on != device:
        raise _ConfigError(f"{argument}: is a stream of cuda:{on} but the operands are on "
                           f"cuda:{device}; pass a stream of cuda:{device}", argument=argument)
    return handle


cdef int _operand_device(object obj, int package, str argument) except -2:
    """The CUDA device of an operand, -1 where only an import tells."""
    cdef int d
    if package == PKG_TORCH:
        d = obj.get_device()
        return d if d >= 0 else -1
    if package == PKG_CUPY:
        return obj.device.id
    return _cuda_device_of(obj, argument)


cdef int _cuda_device_of(object obj, str argument) except -2:
    """The CUDA device of `obj` where it can be read without importing the array (a DeviceView,
    or a DLPack exporter's __dlpack_device__); -1 where only an import tells (or `obj` is not
    CUDA memory, which the import then reports)."""
    if isinstance(obj, DeviceView):
        return (<DeviceView>obj)._device
    if hasattr(obj, "__dlpack__"):  # as_cuda_array imports it through DLPack
        dlpack_device = getattr(obj, "__dlpack_device__", None)
        if dlpack_device is not None:
            device_type, device_id = _dlpack_device_checked(obj, dlpack_device, argument)
            if device_type == kDLCUDA or device_type == kDLCUDAManaged:
                return device_id
    return -1


def _dlpack_device_of(obj, dlpack_device, argument):
    """_dlpack_device_checked for gemm.py."""
    return _dlpack_device_checked(obj, dlpack_device, argument)


cdef tuple _dlpack_device_checked(object obj, object dlpack_device, str argument):
    """obj.__dlpack_device__() as (device_type, device_id), checked: ConfigError naming the
    argument when it gives anything but two ints."""
    got = dlpack_device()
    if _is_device_pair(got):
        return (int(got[0]), int(got[1]))
    raise _ConfigError(f"{argument}: {_type_name(obj)}.__dlpack_device__() returned "
                       f"{_brief(got)}; DLPack gives a (device_type, device_id) tuple of "
                       f"two 32-bit ints", argument=argument)


cdef CudaArray _from_torch(object t, str argument):
    """A CUDA torch tensor read directly (no DLPack exchange); None when the generic import must
    take it (it then says what is wrong)."""
    dt = _torch_to_dt.get(t.dtype)
    cdef int device = t.get_device()
    if dt is None or device < 0:
        return None
    if t.is_neg():
        # Its memory holds the negation of its values (a lazy view such as z.conj().imag): read
        # or written through the pointer, every value would have the wrong sign.
        raise _ConfigError(f"{argument}: is a torch tensor with its negative bit set (its memory "
                           f"holds -{argument}); pass {argument}.resolve_neg()", argument=argument)
    return _cuda_array(<uintptr_t>t.data_ptr(), tuple(t.shape), t.stride(), t.numel(), <int>dt,
                       device, t, False)


cdef CudaArray _from_cupy(object a, str argument):
    dt = _DTYPE_BY_NAME.get(a.dtype.name)
    if dt is None:
        return None
    cdef int64_t itemsize = _DTYPE_ITEMSIZE[<int>dt]
    strides = tuple([s // itemsize for s in a.strides]) if all(
        s % itemsize == 0 for s in a.strides) else None
    if strides is None:
        return None
    return _cuda_array(<uintptr_t>a.data.ptr, tuple(a.shape), strides, a.size, <int>dt, a.device.id,
                       a, False)


cdef class _Call:
    """One call's streams and result package under the call contract (see _contract.pxi)."""

    cdef readonly InferenceContext ctx
    cdef readonly uintptr_t kernel   # the stream the work runs on
    cdef readonly int package        # PKG_* of the results
    cdef readonly int device
    cdef object _like                # an operand of the result package (for its device)
    cdef list _joins                 # the caller's streams other than `kernel`

    def __init__(self, *args, **kwargs):
        raise TypeError("_Call objects are made by inferctx._core._begin_call")

    cdef CudaArray array(self, object obj, str argument):
        """Operand `obj` as a CudaArray whose reads and writes on `kernel` are ordered."""
        cdef CudaArray a = None
        cdef int package = _package_of(obj)
        if package == PKG_TORCH:
            a = _from_torch(obj, argument)
        elif package == PKG_CUPY:
            a = _from_cupy(obj, argument)
        if a is None:
            a = as_cuda_array(obj, argument, self.kernel)
        if a.device != self.device:
            raise _ConfigError(f"{argument}: is on cuda:{a.device} but the call runs on cuda:"
                               f"{self.device} (ctx, or its first operand)", argument=argument)
        return a

    cdef object result(self, int dtype, tuple shape, object like, str argument, str also=""):
        """A new C-contiguous result in the call's package; `like` (or None) is an operand of
        that dtype and shape whose empty_like gives it fastest. A DeviceView result is refused
        under CUDA-graph capture (see _pooled_view), naming `argument`, the keyword that takes
        the caller's own array instead (`also`: the call's other such keywords)."""
        if self.package == PKG_TORCH:
            if like is not None:
                return _torch_empty_like(like)
            return self._like.new_empty(shape, dtype=_dt_to_torch[dtype])
        if self.package == PKG_CUPY:
            if dtype == DT_BFLOAT16:  # CuPy (NumPy's dtypes) has none: numpy's bare TypeError
                raise _ConfigError(
                    f"{argument}: the call's results are CuPy arrays (the package of its "
                    f"operands), and CuPy has no bfloat16; pass {argument}={also} a torch "
                    f"tensor or a DeviceView", argument=argument)
            with _cupy.cuda.Device(self.device):
                return _cupy.empty(shape, dtype=_DTYPE_NAMES[dtype])
        return _pooled_view(self.ctx, dtype, shape, self.kernel, argument,
                            f"pass {argument}={also}, made before the capture")

    cdef int finish(self) except -1:
        """The caller's streams wait for the work queued on `kernel`. Every join is tried, a
        failed one included (each caller's stream that can wait does, and a stream made to join
        a CUDA-graph capture is joined back where any join can); the first error is raised."""
        if self._joins:
            _join_back(self.ctx, self.kernel, self._joins, len(self._joins))
        return 0

    cdef int abandon(self) except -1:
        """finish() for a call given up after _begin_call (an argument refused, a launch that
        failed): a stream it made join a CUDA-graph capture is joined back, or the capture could
        not end. A failure here gives way to the error that ended the call."""
        if self._joins:
            _join_back(self.ctx, self.kernel, self._joins, len(self._joins), True)
        return 0

    # Python-level access for python/inferctx/gemm.py
    def import_array(self, obj, argument):
        return self.array(obj, argument)

    def done(self):
        self.finish()

    def given_up(self):
        self.abandon()


cdef uintptr_t _ctx_stream_args(object ctx, object stream) except? 0:
    """What needs no device is named first: a bad ctx or stream object is the caller's error
    even where the operands' device cannot be read (no GPU, or not CUDA memory). Returns the
    handle of ``stream`` (0 for None), whose device _checked_handle checks once it is known."""
    if ctx is not None and not isinstance(ctx, InferenceContext):
        _bad_ctx(ctx)
    if stream is not None:
        return _stream_handle(stream, "stream")
    return 0


def _check_ctx_stream(ctx, stream):
    """_ctx_stream_args for python/inferctx/gemm.py, which reads devices before _begin: the
    handle of ``stream`` (0 for None), for _begin's ``handle``."""
    return _ctx_stream_args(ctx, stream)


cdef int _bad_ctx(object ctx) except -1:
    raise _ConfigError(f"ctx: got {_type_name(ctx)}; pass an inferctx.InferenceContext or None",
                       argument="ctx")


cdef _Call _begin_call(tuple operands, object ctx, object stream, str first="x",
                       object handle_of_stream=None):
    """The streams of a call on `operands` (its arrays in argument order; None for absent ones):
    picks the context, the stream the work runs on and the result package, and makes that
    stream wait for the caller's others. Raises ConfigError for a bad ctx or stream before
    anything is launched. `handle_of_stream`: what _ctx_stream_args returned for ctx and stream,
    where the caller has run it (a stream's __cuda_stream__ is asked once per call)."""
    cdef _Call call = _Call.__new__(_Call)
    cdef int mask = 0
    cdef int package
    cdef bint plain = False
    cdef int device = -1
    cdef uintptr_t handle = (_ctx_stream_args(ctx, stream) if handle_of_stream is None
                             else <uintptr_t>handle_of_stream)
    primary = operands[0]
    cdef int primary_package = _package_of(primary)
    for obj in operands:
        if obj is None:
            continue
        package = primary_package if obj is primary else _package_of(obj)
        if package == PKG_NONE:
            plain = True
        else:
            mask |= 1 << package
            if call.package == PKG_NONE:
                call.package = package
                call._like = obj
    device = _operand_device(primary, primary_package, first)
    if device < 0:
        if ctx is not None:
            device = (<InferenceContext>ctx).device
        else:
            device = as_cuda_array(primary, first, 0).device  # raises for what is not CUDA memory
    cdef InferenceContext context
    if ctx is None:
        context = _context_of(device)
    else:  # an InferenceContext: _ctx_stream_args refused anything else
        context = <InferenceContext>ctx
        if device != context.device:  # the operand's device: ctx is the one to blame
            raise _ConfigError(f"ctx: the operands are on cuda:{device} but ctx is the context "
                               f"of cuda:{context.device}; pass "
                               f"ctx=InferenceContext.instance({device}) or leave ctx=None",
                               argument="ctx")
    call.ctx = context
    call.device = context.device
    if stream is not None:
        call.kernel = _checked_handle(stream, handle, context.device, "stream")
    elif call.package != PKG_NONE:
        call.kernel = _package_stream(call.package, context.device)
    else:
        call.kernel = _ctx_stream(context)
    cdef list joins = None
    cdef uintptr_t s
    for package in (PKG_TORCH, PKG_CUPY):
        if mask & (1 << package):
            if stream is None and package == call.package:
                continue  # it is the kernel's stream
            s = _package_stream(package, context.device)
            if s != call.kernel and (joins is None or s not in joins):
                joins = [s] if joins is None else joins + [s]
    if plain:
        s = _ctx_stream(context)
        if s != call.kernel and (joins is None or s not in joins):
            joins = [s] if joins is None else joins + [s]
    call._joins = joins
    cdef Py_ssize_t forked = 0
    if joins is not None:
        try:
            for s in joins:
                context._order(s, call.kernel, True)  # finish() joins the kernel stream back
                forked += 1
        except BaseException:
            # The streams joined so far may have made the kernel's stream join a CUDA-graph
            # capture: joined back, or the capture could not end. The error that ended the call
            # is the one raised.
            _join_back(context, call.kernel, joins, forked, True)
            raise
    return call


cdef int _join_back(InferenceContext ctx, uintptr_t kernel, list streams, Py_ssize_t count,
                    bint quiet=False) except -1:
    """The first `count` of `streams` wait for the work queued on `kernel`: every one is tried,
    and the first error is raised once all were. `quiet`: on an error path, whose own error is
    the one to raise: an Exception here is let go (a KeyboardInterrupt still comes through)."""
    cdef object failed = None
    cdef Py_ssize_t i
    for i in range(count):
        try:
            ctx._order(kernel, <uintptr_t>streams[i])
        except BaseException as error:
            if failed is None and not (quiet and isinstance(error, Exception)):
                failed = error
    if failed is not None:
        raise failed
    return 0


def _begin(operands, ctx=None, stream=None, first="a", handle=None):
    """The call contract for python/inferctx/gemm.py: a _Call for `operands` (a tuple) whose first
    is named `first` in errors; `handle` is what _check_ctx_stream(ctx, stream) returned."""
    return _begin_call(tuple(operands), ctx, stream, first, handle)


# Part of _core.pyx: DeviceView, a typed window on device memory that keeps its allocation
# alive, and its exports (DLPack, the CUDA array interface) and copies.

from cpython.bool cimport PyBool_Check
from libc.stdint cimport int64_t, uintptr_t
from libcpp.memory cimport shared_ptr

from inferctx._decl_dlpack cimport DLPACK_FLAG_BITMASK_IS_COPIED, kDLCPU, kDLCUDA, kDLCUDAHost
from inferctx._decl_gpu cimport DeviceAllocation, copy_async, cudaStreamLegacy


cdef tuple _contiguous_strides(tuple shape):
    """Strides in elements of a C-contiguous array of `shape`."""
    strides = []
    cdef int64_t stride = 1
    for n in reversed(shape):
        strides.append(stride)
        stride *= n
    strides.reverse()
    return tuple(strides)


cdef str _HOST_ACCESS_HINT = (
    "a DeviceView is GPU memory, which NumPy and the Python buffer protocol cannot read. "
    "Zero-copy on the GPU: torch.from_dlpack(view), cupy.from_dlpack(view), "
    "jax.dlpack.from_dlpack(view). A copy in host memory: np.from_dlpack(view, device='cpu'), "
    "or view.copy_to_host(buf) into buf = inferctx.PinnedBuffer(view.nbytes), then "
    "buf.synchronize() and np.frombuffer(buf, dtype)")


# What the factories of DeviceView, InferenceContext and MemoryPool pass to __new__. Their
# __cinit__ refuses anything else, so that X.__new__(X) from Python raises TypeError instead of
# giving an object whose C++ side was never made (any use of it would dereference null).
cdef object _MAKE = object()


class _NoTypestr(AttributeError, TypeError):
    """A view of a dtype the CUDA array interface cannot describe (bfloat16). An AttributeError,
    so that ``hasattr(view, "__cuda_array_interface__")`` (Numba's is_cuda_array, CuPy's and
    JAX's checks) answers False and the consumer takes DLPack; a TypeError, as it was."""


cdef class DeviceView:
    """A typed, C-contiguous window on device memory that keeps its allocation alive.

    Views come from an InferenceContext (``workspace``, ``kv_cache(layer)``, ``activations``,
    ``attention_scores``), from ``view()`` and from the kernels. Every consumer reaches the
    memory without a copy through DLPack (``torch.from_dlpack(view)``, ``cupy.from_dlpack``,
    ``jax.dlpack.from_dlpack``) or ``__cuda_array_interface__`` (CuPy, Numba; not for bfloat16,
    which it cannot describe); the memory stays allocated as long as the view, or anything made
    from it that keeps it (DLPack imports do, CuPy's and Numba's arrays do), is alive. JAX's
    ``jnp.asarray(view)`` reads the array interface and keeps no reference: keep the view alive
    as long as that array, or use ``jax.dlpack.from_dlpack(view)``. Work on it is ordered by
    its context's ``ctx.stream`` (torch's current stream in a torch program): DLPack and copies
    synchronise with it. Kernel results that are DeviceViews live in the device's stream-ordered
    pool (``ctx.memory_pool``).
    ``strides`` count elements, as in DLPack and torch.
    """

    cdef shared_ptr[DeviceAllocation] _alloc
    cdef InferenceContext _ctx  # its compute stream orders work on this memory
    cdef uintptr_t _ptr
    cdef int64_t _size  # elements
    cdef int64_t _nbytes
    cdef tuple _shape
    cdef int _dtype
    cdef int _device
    cdef object __weakref__

    def __cinit__(self, *args, **kwargs):
        # DeviceView.__new__(DeviceView) from Python would give a view with no allocation.
        if kwargs or len(args) != 1 or args[0] is not _MAKE:
            raise TypeError("DeviceView objects come from an InferenceContext (workspace, "
                            "kv_cache, activations, attention_scores), from DeviceView.view and "
                            "from the kernels; they cannot be constructed directly")

    def __dealloc__(self):
        # The last view of a pool block lets the block go, and a block used on a stream that may
        # be gone, or by a consumer not known, waits for the whole device first (pool.hpp). That
        # wait runs without the GIL: a host callback queued on a stream may need it to finish,
        # and other Python threads go on meanwhile.
        cdef shared_ptr[DeviceAllocation] last
        last.swap(self._alloc)
        if last.use_count() == 1:  # the last owner: the allocation goes now (views of one share it)
            with nogil:
                last.reset()

    # -- description -----------------------------------------------------------------------
    @property
    def ptr(self):
        """Device address of the first element (int)."""
        return self._ptr

    @property
    def nbytes(self):
        return self._nbytes

    @property
    def size(self):
        """Number of elements."""
        return self._size

    @property
    def shape(self):
        return self._shape

    @property
    def ndim(self):
        return len(self._shape)

    @property
    def strides(self):
        """Strides in elements (C-contiguous), as DLPack and torch count them."""
        return _contiguous_strides(self._shape)

    @property
    def dtype(self):
        """Element type name: 'float16', 'bfloat16', 'float32', 'uint8', ..."""
        return _DTYPE_NAMES[self._dtype]

    @property
    def itemsize(self):
        return _DTYPE_ITEMSIZE[self._dtype]

    @property
    def device(self):
        """CUDA device ordinal."""
        return self._device

    @property
    def offset(self):
        """Byte offset of the view in its allocation (the workspace, for context views)."""
        return self._ptr - <uintptr_t>self._alloc.get().data()

    @property
    def context(self):
        """The InferenceContext of the view's device, whose compute stream orders its use."""
        return self._ctx

    def __len__(self):
        if not self._shape:
            raise TypeError("len() of a 0-d DeviceView")
        return self._shape[0]

    def __repr__(self):
        return (f"<inferctx.DeviceView {_DTYPE_NAMES[self._dtype]}{list(self._shape)} "
                f"on cuda:{self._device} at {self._ptr:#x}>")

    # -- typed sub-views -----------------------------------------------------------------------
    def view(self, dtype, shape=-1, offset=0):
        """A view of this view's bytes from byte ``offset`` as a C-contiguous ``dtype`` array.

        Parameters
        ----------
        dtype : str, numpy or torch dtype
            The element type of the new view.
        shape : int or tuple of int
            Its shape; one size may be -1 to take as many elements as fit (the default, -1,
            gives a 1-D view of everything after ``offset``).
        offset : int
            Bytes from the start of this view; the address must be aligned to the item size.
        """
        cdef int dt = _dtype_index(dtype, "dtype")
        cdef int64_t itemsize = _DTYPE_ITEMSIZE[dt]
        cdef int64_t start = _int_arg(offset, "offset")
        dims = _shape_arg(shape, "shape")
        if start < 0 or start > self._nbytes:
            raise _ConfigError(f"offset: got {start}; valid: 0..{self._nbytes} (bytes into this "
                               f"{self._nbytes}-byte view)", argument="offset")
        if (self._ptr + start) % itemsize:
            raise _ConfigError(
                f"offset: got {start}; the address {self._ptr + start:#x} is not aligned to the "
                f"{itemsize}-byte items of {_DTYPE_NAMES[dt]}: use a multiple of {itemsize}",
                argument="offset")
        available = self._nbytes - start
        if dims.count(-1) > 1:
            raise _ConfigError(f"shape: got {_brief(shape)}; at most one size may be -1",
                               argument="shape")
        known = 1
        for n in dims:
            if n != -1:
                known *= n
        if -1 in dims:
            if known == 0:
                raise _ConfigError(f"shape: got {_brief(shape)}; -1 cannot be inferred next to "
                                   "a 0 size",
                                   argument="shape")
            dims = tuple(available // itemsize // known if n == -1 else n for n in dims)
            known *= available // itemsize // known
        if known == 0 and _suffix_bytes(dims, itemsize) > INT64_MAX:
            # No bytes, but its C-contiguous strides would wrap: (0, 2**62, 4) of uint8.
            raise _ConfigError(f"shape: {dims} of {_DTYPE_NAMES[dt]} has strides of more than "
                               f"2**63 - 1 bytes", argument="shape")
        if known * itemsize > available:
            raise _ConfigError(
                f"shape: {dims} of {_DTYPE_NAMES[dt]} needs {known * itemsize} bytes; "
                f"{available} remain after offset {start} in this {self._nbytes}-byte view",
                argument="shape")
        base = self._ptr - <uintptr_t>self._alloc.get().data()
        return _make_view(self._alloc, base + start, dims, known, dt, self._ctx)

    # -- copies to and from page-locked host memory ----------------------------------------
    def copy_to_host(self, pinned, stream=None):
        """Queues a copy of the view's bytes into ``pinned`` (a PinnedBuffer at least as large).

        ``stream`` (default: ``ctx.stream``) runs the copy after the work queued so far on
        ``ctx.stream``, and ``ctx.stream`` waits for it, so that work queued there later (a
        kernel writing into the view) cannot change the bytes before they are copied. It
        returns at once; ``pinned.synchronize()`` waits for it (reading the buffer through NumPy
        or DLPack waits too). Captured into a CUDA graph, the copy is made at each replay, which
        ``pinned.synchronize()`` does not wait for: wait for the replay before reading.
        """
        _require_accessible(self, "copy_to_host")
        cdef PinnedBuffer host = _pinned_arg(pinned, self._nbytes, "pinned")
        cdef uintptr_t producer = _ctx_stream(self._ctx)
        cdef uintptr_t on = producer if stream is None else _checked_stream(stream, self._device,
                                                                            "stream")
        self._ctx._order(producer, on, True)  # joined back below
        try:
            _note_use(self, on)
            _copy(host._ptr, self._ptr, self._nbytes, on, self._device)
            host._track(self._device, on, _capturing(on))
        except BaseException:
            # `on` may have been made to join a CUDA-graph capture of `producer`'s: joined back,
            # or the capture could not end (the copy's error is the one raised)
            _join_back(self._ctx, on, [producer], 1, True)
            raise
        self._ctx._order(on, producer)

    def copy_from_host(self, pinned, stream=None):
        """Queues a copy of ``pinned``'s first ``nbytes`` bytes into the view.

        ``stream`` (default: ``ctx.stream``) is ordered after ``ctx.stream`` before the copy,
        and ``ctx.stream`` after it, so kernels queued later see the data. The buffer must stay
        unchanged until ``pinned.synchronize()`` returns. Captured into a CUDA graph, the copy
        reads the buffer at each replay: keep it unchanged until the replay is done, and let
        the copies queued into it before the capture finish before the first replay.
        """
        _require_accessible(self, "copy_from_host")
        cdef PinnedBuffer host = _pinned_arg(pinned, self._nbytes, "pinned")
        cdef uintptr_t producer = _ctx_stream(self._ctx)
        cdef uintptr_t on = producer if stream is None else _checked_stream(stream, self._device,
                                                                            "stream")
        cdef bint captured
        self._ctx._order(producer, on, True)  # joined back below
        try:
            # After the order: a `stream=` that is not capturing has now joined a capture of
            # ctx.stream's. (In a capture the copy is made at replays, which a wait now would
            # not order; and a host wait there would end a capture made in the global mode.)
            captured = _capturing(on)
            if not captured:
                host._wait_copies()
            _note_use(self, on)
            _copy(self._ptr, host._ptr, self._nbytes, on, self._device)
            host._track(self._device, on, captured)
        except BaseException:
            # `on` may have been made to join a CUDA-graph capture of `producer`'s: joined back,
            # or the capture could not end (the copy's error is the one raised)
            _join_back(self._ctx, on, [producer], 1, True)
            raise
        self._ctx._order(on, producer)

    cdef PinnedBuffer _host_copy(self):
        """A synchronous copy into new page-locked memory (DLPack exports to the CPU)."""
        cdef uintptr_t producer = _ctx_stream(self._ctx)
        if _capturing(producer):
            # The copy would be made at the graph's replays only, not for this export.
            raise BufferError(
                f"__dlpack__: a DeviceView goes to the CPU by a copy on ctx.stream "
                f"({producer:#x}), which is capturing a CUDA graph: the copy would be made only "
                "when the graph is replayed. Export before or after the capture, or call "
                "view.copy_to_host(buf) in it and read buf after a replay")
        cdef PinnedBuffer host = PinnedBuffer(self._nbytes)
        _note_use(self, producer)
        _copy(host._ptr, self._ptr, self._nbytes, producer, self._device)
        host._track(self._device, producer, False)  # not capturing: refused above
        host._wait_copies()
        return host

    cdef DeviceView _device_copy(self, uintptr_t producer):
        """A copy in a new allocation, queued on `producer` (the view's stream)."""
        cdef DeviceView out = _pooled_view(self._ctx, self._dtype, self._shape, producer, "copy",
                                           "export without copy=True, or copy before the capture")
        _note_use(self, producer)
        _copy(out._ptr, self._ptr, self._nbytes, producer, self._device)
        return out

    # -- DLPack ----------------------------------------------------------------------------
    def __dlpack__(self, stream=None, *, max_version=None, dl_device=None, copy=None):
        """Exports the view as a DLPack capsule (the DLPack Python specification).

        ``stream`` is the consumer's stream: None or 1 the legacy default stream, 2 the
        per-thread default stream, a handle otherwise; the consumer's stream then waits (on
        the GPU, by an event) for the work queued so far on ``ctx.stream``. -1 asks for no
        synchronisation. A versioned capsule comes back when ``max_version`` is
        (1, 0) or newer. ``dl_device=(1, 0)`` (the CPU) or ``(3, 0)`` (CUDA host memory) gives a
        synchronous host copy flagged IS_COPIED (refused with ``copy=False``, and while
        ``ctx.stream`` captures a CUDA graph); ``copy=True`` on the GPU gives a device copy.
        """
        _require_accessible(self, "__dlpack__")
        cdef bint versioned = _wants_versioned(max_version)
        cdef int mode = _copy_mode(copy)
        cdef tuple target = _dl_device_arg(dl_device)
        cdef uintptr_t consumer = 0
        cdef bint sync = _consumer_stream(stream, &consumer)
        cdef uintptr_t producer
        cdef DeviceView copied
        cdef PinnedBuffer host
        if target is None or (target[0] == kDLCUDA and target[1] == self._device):
            producer = _ctx_stream(self._ctx)
            if mode == 1:
                copied = self._device_copy(producer)
                if sync:
                    self._ctx._order(producer, consumer)
                _note_use(copied, consumer if sync else 0)
                return _export_capsule(copied, <void*>copied._ptr, kDLCUDA, self._device,
                                       self._shape, self._dtype, versioned,
                                       DLPACK_FLAG_BITMASK_IS_COPIED)
            if sync:
                self._ctx._order(producer, consumer)
            _note_use(self, consumer if sync else 0)
            return _export_capsule(self, <void*>self._ptr, kDLCUDA, self._device, self._shape,
                                   self._dtype, versioned, 0)
        if (target[0] == kDLCPU or target[0] == kDLCUDAHost) and target[1] == 0:
            if mode == 0:
                raise BufferError(
                    f"__dlpack__: this DeviceView is in GPU memory; exporting it to dl_device="
                    f"{_brief(dl_device)} needs a copy, which copy=False forbids. Pass "
                    "copy=None or True, or import it on the GPU (torch.from_dlpack, "
                    "cupy.from_dlpack)")
            host = self._host_copy()
            return _export_capsule(host, <void*>host._ptr, target[0], 0, self._shape,
                                   self._dtype, versioned, DLPACK_FLAG_BITMASK_IS_COPIED)
        raise BufferError(
            f"__dlpack__: cannot export to dl_device={_brief(dl_device)}; this DeviceView is on "
            f"(2, {self._device}) (kDLCUDA) and can be copied to the CPU, (1, 0), or to CUDA host "
            f"memory, (3, 0)")

    def __dlpack_device__(self):
        """(2, device): kDLCUDA and the device ordinal."""
        return (kDLCUDA, self._device)

    # -- CUDA array interface --------------------------------------------------------------
    @property
    def __cuda_array_interface__(self):
        """Version 3 of the CUDA array interface; "stream" is ``ctx.stream``, which a consumer
        must synchronise with (CuPy and Numba do). The consumer's own streams are not known, so
        a pool block exported this way is freed after a device-wide synchronisation."""
        _require_accessible(self, "__cuda_array_interface__")
        typestr = _DTYPE_TYPESTRS[self._dtype]
        if typestr is None:
            raise _NoTypestr(
                f"__cuda_array_interface__: {_DTYPE_NAMES[self._dtype]} has no typestr in the "
                f"CUDA array interface; use DLPack, which carries it: torch.from_dlpack(view), "
                f"cupy.from_dlpack(view), jax.dlpack.from_dlpack(view)")
        cdef uintptr_t producer = _ctx_stream(self._ctx)
        _note_use(self, 0)
        return {
            "shape": self._shape,
            "typestr": typestr,
            "data": (self._ptr if self._size else 0, False),
            "version": 3,
            "strides": None,  # C-contiguous
            "stream": producer,
        }

    # -- host access is refused, with the ways to reach the data ---------------------------
    def __getbuffer__(self, Py_buffer* buffer, int flags):
        raise BufferError(_HOST_ACCESS_HINT)

    def __array__(self, dtype=None, copy=None):
        raise TypeError(_HOST_ACCESS_HINT)


cdef DeviceView _make_view(const shared_ptr[DeviceAllocation]& alloc, int64_t offset, tuple shape,
                           int64_t size, int dtype, InferenceContext ctx):
    """A view of `size` elements of shape `shape` at byte `offset` of `alloc` (bounds checked)."""
    cdef DeviceAllocation* allocation = alloc.get()
    cdef int64_t nbytes = size * _DTYPE_ITEMSIZE[dtype]
    if offset < 0 or nbytes > allocation.size() - offset:
        raise _WorkspaceStateError(
            f"a view of {nbytes} bytes at offset {offset} does not fit the allocation of "
            f"{allocation.size()} bytes (the workspace changed while the view was made: retry)")
    cdef DeviceView view = DeviceView.__new__(DeviceView, _MAKE)
    view._alloc = alloc
    view._ctx = ctx
    view._ptr = <uintptr_t>allocation.data() + <uintptr_t>offset
    view._size = size
    view._nbytes = nbytes
    view._shape = shape
    view._dtype = dtype
    view._device = ctx.device
    return view


cdef DeviceView _new_view(int device, int dtype, tuple shape):
    """A new C-contiguous view in a block of its own from the device's stream-ordered pool,
    usable on ctx.stream."""
    cdef InferenceContext ctx = _context_of(device)
    return _pooled_view(ctx, dtype, _shape_arg(shape, "shape"), _ctx_stream(ctx), "shape",
                        "make the view before the capture")


cdef DeviceView new_device_view(int device, str dtype, tuple shape):
    """A fresh C-contiguous DeviceView of `dtype` x `shape` on `device`, in its own allocation."""
    return _new_view(device, _dtype_index(dtype, "dtype"), shape)


def _empty(device, shape, dtype="float32"):
    """An uninitialised DeviceView of ``shape`` and ``dtype`` on ``device`` (None: current)."""
    return _new_view(_device_arg(device), _dtype_index(dtype, "dtype"), _shape_arg(shape, "shape"))


cdef int _copy(uintptr_t dst, uintptr_t src, int64_t nbytes, uintptr_t stream,
               int device) except -1:
    with nogil:
        copy_async(<void*>dst, <const void*>src, nbytes, <void*>stream, device)
    return 0


cdef bint _consumer_stream(object stream, uintptr_t* consumer) except -1:
    """Reads __dlpack__'s stream argument: True and the consumer's stream when it asks for
    synchronisation, False for -1."""
    if stream is None:
        consumer[0] = <uintptr_t>cudaStreamLegacy  # the specification's meaning of None
        return True
    if PyBool_Check(stream) or not isinstance(stream, int):
        raise _ConfigError(f"stream: got {_brief(stream)}; __dlpack__ takes None, -1, 1, 2 or "
                           "a CUDA stream handle (int)", argument="stream")
    if stream == -1:
        return False
    if stream == 0:
        raise _ConfigError("stream: got 0, which the DLPack specification disallows as ambiguous; "
                           "pass 1 for the legacy default stream or 2 for the per-thread one",
                           argument="stream")
    if stream < -1 or stream >= (1 << 64):
        raise _ConfigError(f"stream: got {stream}; pass None, -1, 1, 2 or a CUDA stream handle",
                           argument="stream")
    consumer[0] = <uintptr_t>stream  # 1 and 2 are cudaStreamLegacy and cudaStreamPerThread
    return True

# Part of _core.pyx: element types, DeviceView (typed windows on device memory that keep
# their allocation alive) and PinnedBuffer (page-locked host memory).

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES
from libc.string cimport memcpy


cdef enum:
    # Indices into the dtype table below. The first three are inferctx::DType's codes (0, 1,
    # 2), so a plan's dtype is also the index of its views' dtype.
    DT_FLOAT32 = <int>DType.Float32
    DT_FLOAT16 = <int>DType.Float16
    DT_BFLOAT16 = <int>DType.BFloat16
    DT_FLOAT64 = 3
    DT_INT8 = 4
    DT_INT16 = 5
    DT_INT32 = 6
    DT_INT64 = 7
    DT_UINT8 = 8
    DT_UINT16 = 9
    DT_UINT32 = 10
    DT_UINT64 = 11
    DT_BOOL = 12
    NUM_DTYPES = 13


# name, DLPack type code, bits, __cuda_array_interface__ typestr (None: the interface has none)
cdef tuple _DTYPE_TABLE = (
    ("float32", kDLFloat, 32, "<f4"),
    ("float16", kDLFloat, 16, "<f2"),
    ("bfloat16", kDLBfloat, 16, None),
    ("float64", kDLFloat, 64, "<f8"),
    ("int8", kDLInt, 8, "|i1"),
    ("int16", kDLInt, 16, "<i2"),
    ("int32", kDLInt, 32, "<i4"),
    ("int64", kDLInt, 64, "<i8"),
    ("uint8", kDLUInt, 8, "|u1"),
    ("uint16", kDLUInt, 16, "<u2"),
    ("uint32", kDLUInt, 32, "<u4"),
    ("uint64", kDLUInt, 64, "<u8"),
    ("bool", kDLBool, 8, "|b1"),
)
cdef dict _DTYPE_ALIASES = {
    "fp32": DT_FLOAT32, "f32": DT_FLOAT32, "float": DT_FLOAT32, "single": DT_FLOAT32,
    "fp16": DT_FLOAT16, "f16": DT_FLOAT16, "half": DT_FLOAT16,
    "bf16": DT_BFLOAT16,
    "fp64": DT_FLOAT64, "f64": DT_FLOAT64, "double": DT_FLOAT64,
    "byte": DT_UINT8, "bool_": DT_BOOL,
}

cdef uint8_t _DTYPE_DLPACK_CODE[NUM_DTYPES]
cdef uint8_t _DTYPE_BITS[NUM_DTYPES]
cdef int64_t _DTYPE_ITEMSIZE[NUM_DTYPES]
cdef tuple _DTYPE_NAMES = tuple(row[0] for row in _DTYPE_TABLE)
cdef tuple _DTYPE_TYPESTRS = tuple(row[3] for row in _DTYPE_TABLE)
cdef dict _DTYPE_BY_NAME = {row[0]: i for i, row in enumerate(_DTYPE_TABLE)}
_DTYPE_BY_NAME.update(_DTYPE_ALIASES)
cdef dict _DTYPE_BY_DLPACK = {(row[1], row[2]): i for i, row in enumerate(_DTYPE_TABLE)}
# typestr without its byte-order character ('<', '|' or '=') -> index
cdef dict _DTYPE_BY_TYPESTR = {row[3][1:]: i for i, row in enumerate(_DTYPE_TABLE) if row[3]}
for _i, _row in enumerate(_DTYPE_TABLE):
    _DTYPE_DLPACK_CODE[_i] = _row[1]
    _DTYPE_BITS[_i] = _row[2]
    _DTYPE_ITEMSIZE[_i] = _row[2] // 8
del _i, _row


cdef int _dtype_index(object dtype, str argument) except -1:
    """The dtype table index of a name ('float16', 'bf16', ...) or a NumPy/torch dtype."""
    index = _DTYPE_BY_NAME.get(dtype) if type(dtype) is str else None
    if index is not None:
        return index
    if isinstance(dtype, str):
        name = dtype
    else:  # a NumPy, torch, JAX or ml_dtypes dtype (_coerce.pxi)
        name = _name_of(dtype)
    if isinstance(name, str):
        index = _DTYPE_BY_NAME.get(name.strip().lower())
    if index is None:
        raise _ConfigError(f"{argument}: got {dtype!r}; valid: {', '.join(_DTYPE_NAMES)} (or the "
                           f"NumPy/torch dtype of one of them)", argument=argument)
    return index


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


cdef class DeviceView:
    """A typed, C-contiguous window on device memory that keeps its allocation alive.

    Views come from an InferenceContext (``workspace``, ``kv_cache(layer)``, ``activations``,
    ``attention_scores``), from ``view()`` and from the kernels. Every consumer reaches the
    memory without a copy through DLPack (``torch.from_dlpack(view)``, ``cupy.from_dlpack``,
    ``jax.dlpack.from_dlpack``) or ``__cuda_array_interface__`` (CuPy, Numba); the memory stays
    allocated as long as the view or anything made from it is alive. Work on it is ordered by
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

    def __init__(self, *args, **kwargs):
        raise TypeError("DeviceView objects come from an InferenceContext (workspace, kv_cache, "
                        "activations, attention_scores), from DeviceView.view and from the "
                        "kernels; they cannot be constructed directly")

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
            raise _ConfigError(f"shape: got {shape!r}; at most one size may be -1",
                               argument="shape")
        known = 1
        for n in dims:
            if n != -1:
                known *= n
        if -1 in dims:
            if known == 0:
                raise _ConfigError(f"shape: got {shape!r}; -1 cannot be inferred next to a 0 size",
                                   argument="shape")
            dims = tuple(available // itemsize // known if n == -1 else n for n in dims)
            known *= available // itemsize // known
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
        ``ctx.stream``. It returns at once; ``pinned.synchronize()`` waits for it (reading the
        buffer through NumPy or DLPack waits too).
        """
        _require_accessible(self, "copy_to_host")
        cdef PinnedBuffer host = _pinned_arg(pinned, self._nbytes, "pinned")
        cdef uintptr_t producer = _ctx_stream(self._ctx)
        cdef uintptr_t on = producer if stream is None else _checked_stream(stream, self._device,
                                                                            "stream")
        self._ctx._order(producer, on)
        _note_use(self, on)
        _copy(host._ptr, self._ptr, self._nbytes, on, self._device)
        host._track(self._device, on)

    def copy_from_host(self, pinned, stream=None):
        """Queues a copy of ``pinned``'s first ``nbytes`` bytes into the view.

        ``stream`` (default: ``ctx.stream``) is ordered after ``ctx.stream`` before the copy,
        and ``ctx.stream`` after it, so kernels queued later see the data. The buffer must stay
        unchanged until ``pinned.synchronize()`` returns.
        """
        _require_accessible(self, "copy_from_host")
        cdef PinnedBuffer host = _pinned_arg(pinned, self._nbytes, "pinned")
        host._wait_copies()
        cdef uintptr_t producer = _ctx_stream(self._ctx)
        cdef uintptr_t on = producer if stream is None else _checked_stream(stream, self._device,
                                                                            "stream")
        self._ctx._order(producer, on)
        _note_use(self, on)
        _copy(self._ptr, host._ptr, self._nbytes, on, self._device)
        host._track(self._device, on)
        self._ctx._order(on, producer)

    cdef PinnedBuffer _host_copy(self):
        """A synchronous copy into new page-locked memory (DLPack exports to the CPU)."""
        cdef PinnedBuffer host = PinnedBuffer(self._nbytes)
        cdef uintptr_t producer = _ctx_stream(self._ctx)
        _note_use(self, producer)
        _copy(host._ptr, self._ptr, self._nbytes, producer, self._device)
        host._track(self._device, producer)
        host._wait_copies()
        return host

    cdef DeviceView _device_copy(self, uintptr_t producer):
        """A copy in a new allocation, queued on `producer` (the view's stream)."""
        cdef DeviceView out = _pooled_view(self._ctx, self._dtype, self._shape, producer)
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
        (1, 0) or newer. ``dl_device=(1, 0)`` (the CPU) gives a synchronous host copy flagged
        IS_COPIED (refused with ``copy=False``); ``copy=True`` on the GPU gives a device copy.
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
                    f"{dl_device!r} needs a copy, which copy=False forbids. Pass copy=None or "
                    f"True, or import it on the GPU (torch.from_dlpack, cupy.from_dlpack)")
            host = self._host_copy()
            return _export_capsule(host, <void*>host._ptr, target[0], 0, self._shape,
                                   self._dtype, versioned, DLPACK_FLAG_BITMASK_IS_COPIED)
        raise BufferError(
            f"__dlpack__: cannot export to dl_device={dl_device!r}; this DeviceView is on "
            f"(2, {self._device}) (kDLCUDA) and can be copied to the CPU, (1, 0)")

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
            raise TypeError(
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
    cdef DeviceView view = DeviceView.__new__(DeviceView)
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
    return _pooled_view(ctx, dtype, _shape_arg(shape, "shape"), _ctx_stream(ctx))


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
        raise _ConfigError(f"stream: got {stream!r}; __dlpack__ takes None, -1, 1, 2 or a CUDA "
                           f"stream handle (int)", argument="stream")
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


cdef PinnedBuffer _pinned_arg(object pinned, int64_t nbytes, str argument):
    if not isinstance(pinned, PinnedBuffer):
        raise _ConfigError(f"{argument}: got a {_type_name(pinned)}; pass an inferctx.PinnedBuffer "
                           f"(page-locked memory, needed for an asynchronous copy)",
                           argument=argument)
    cdef PinnedBuffer host = <PinnedBuffer>pinned
    if host._nbytes < nbytes:
        raise _ConfigError(f"{argument}: the PinnedBuffer holds {host._nbytes} bytes; the view "
                           f"needs {nbytes}", argument=argument)
    return host


cdef char* _BYTE_FORMAT = b"B"  # struct-module format of unsigned bytes (static storage)


cdef class PinnedBuffer:
    """Page-locked host memory: NumPy sees it without a copy, and copies to and from the GPU
    run asynchronously.

    ``PinnedBuffer(nbytes)``; ``np.frombuffer(buf, dtype)`` or ``np.asarray(buf)`` view it
    (writable, no copy), ``np.from_dlpack(buf)`` too (DLPack device kDLCUDAHost, or kDLCPU when
    the consumer asks for the CPU). Reading it through NumPy or DLPack, and ``synchronize()``,
    first wait for the asynchronous copies queued to or from it.
    """

    cdef unique_ptr[PinnedAllocation] _alloc
    cdef uintptr_t _ptr
    cdef Py_ssize_t _nbytes
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]
    cdef unique_ptr[CppEvent] _last_copy  # recorded after the last copy queued to or from it
    cdef bint _copy_pending
    cdef object __weakref__

    def __init__(self, nbytes):
        cdef int64_t n = _count_arg(nbytes, "nbytes", 0)
        if self._alloc.get() != NULL:
            raise TypeError("PinnedBuffer.__init__ called twice")
        with nogil:
            self._alloc.reset(new PinnedAllocation(n))
        self._ptr = <uintptr_t>self._alloc.get().data()
        self._nbytes = <Py_ssize_t>n
        self._shape[0] = self._nbytes
        self._strides[0] = 1

    def __dealloc__(self):
        # A copy still queued must not read or write the memory after it is freed.
        if self._copy_pending and self._last_copy.get() != NULL:
            with nogil:
                if cudaEventSynchronize(self._last_copy.get().handle()) != cudaSuccess:
                    cudaGetLastError()

    @property
    def ptr(self):
        """Host address of the buffer (int)."""
        return self._ptr

    @property
    def nbytes(self):
        return self._nbytes

    def __len__(self):
        return self._nbytes

    def __repr__(self):
        return f"<inferctx.PinnedBuffer {self._nbytes} bytes at {self._ptr:#x}>"

    def synchronize(self):
        """Blocks until the asynchronous copies queued to or from this buffer are done."""
        self._wait_copies()

    cdef int _wait_copies(self) except -1:
        cdef CppEvent* event = self._last_copy.get()
        if self._copy_pending:
            with nogil:
                event.synchronize()
            self._copy_pending = False
        return 0

    cdef int _track(self, int device, uintptr_t stream) except -1:
        """Records that a copy using this buffer was queued on `stream` of `device`."""
        if self._last_copy.get() == NULL or self._last_copy.get().device() != device:
            self._wait_copies()
            with nogil:
                self._last_copy.reset(new CppEvent(device, False))
        cdef CppEvent* event = self._last_copy.get()
        with nogil:
            event.record(<cudaStream_t>stream)
        self._copy_pending = True
        return 0

    # -- the buffer protocol: writable, one dimension of bytes -----------------------------
    def __getbuffer__(self, Py_buffer* buffer, int flags):
        self._wait_copies()
        buffer.buf = <void*>self._ptr
        # The buffer holds a reference to this object (released by PyBuffer_Release), so the
        # memory outlives every NumPy array made from it.
        buffer.obj = self
        buffer.len = self._nbytes
        buffer.readonly = 0
        buffer.itemsize = 1
        buffer.format = NULL
        if flags & PyBUF_FORMAT:
            buffer.format = _BYTE_FORMAT
        buffer.ndim = 1
        buffer.shape = NULL
        if flags & PyBUF_ND:
            buffer.shape = self._shape
        buffer.strides = NULL
        if (flags & PyBUF_STRIDES) == PyBUF_STRIDES:
            buffer.strides = self._strides
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __releasebuffer__(self, Py_buffer* buffer):
        pass

    # -- DLPack ----------------------------------------------------------------------------
    def __dlpack__(self, stream=None, *, max_version=None, dl_device=None, copy=None):
        """Exports the bytes as a 1-D uint8 DLPack tensor in host memory.

        The device is kDLCUDAHost (3) unless the consumer asks for the CPU with
        ``dl_device=(1, 0)`` (as ``np.from_dlpack(buf, device='cpu')`` does), which is the same
        memory. ``copy=True`` exports a copy. ``stream`` is not used: the memory is the host's.
        """
        cdef bint versioned = _wants_versioned(max_version)
        cdef int mode = _copy_mode(copy)
        cdef tuple target = _dl_device_arg(dl_device)
        cdef int32_t device_type = kDLCUDAHost
        cdef PinnedBuffer out
        if target is not None:
            if target[1] != 0 or (target[0] != kDLCPU and target[0] != kDLCUDAHost):
                raise BufferError(f"__dlpack__: cannot export a PinnedBuffer to dl_device="
                                  f"{dl_device!r}; it is host memory: (3, 0) or the CPU, (1, 0)")
            device_type = target[0]
        self._wait_copies()
        if mode == 1:
            out = PinnedBuffer(self._nbytes)
            if self._nbytes:
                memcpy(<void*>out._ptr, <const void*>self._ptr, self._nbytes)
            return _export_capsule(out, <void*>out._ptr, device_type, 0, (out._nbytes,), DT_UINT8,
                                   versioned, DLPACK_FLAG_BITMASK_IS_COPIED)
        return _export_capsule(self, <void*>self._ptr, device_type, 0, (self._nbytes,), DT_UINT8,
                               versioned, 0)

    def __dlpack_device__(self):
        """(3, 0): kDLCUDAHost."""
        return (kDLCUDAHost, 0)

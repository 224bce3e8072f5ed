# Part of _core.pyx: PinnedBuffer, page-locked host memory that NumPy reads without a copy and
# that DeviceView copies to and from asynchronously.

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES
from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t
from libc.string cimport memcpy
from libcpp.memory cimport shared_ptr

from inferctx._decl_dlpack cimport DLPACK_FLAG_BITMASK_IS_COPIED, kDLCPU, kDLCUDAHost
from inferctx._decl_gpu cimport (
    CppEvent, PinnedAllocation, cudaEventSynchronize, cudaGetLastError, cudaStream_t, cudaSuccess)


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
    the consumer asks for the CPU). Making such a view, and ``synchronize()``, first wait for the
    asynchronous copies queued to or from it; an array made before a copy was queued is not
    waited for when it is read: call ``synchronize()`` (or make the view anew) after the copy.
    A copy captured into a CUDA graph is made at each replay, and those copies are not waited
    for here: wait for the replay (``torch.cuda.synchronize()``, or its stream's) before reading
    the buffer, and keep the buffer alive as long as the graph. While a capture is being made in
    CUDA's global mode (torch.cuda.graph's default), waiting for a buffer's copies (a read, or
    ``synchronize()``) or freeing it ends the capture: do those outside it.
    """

    cdef unique_ptr[PinnedAllocation] _alloc
    cdef uintptr_t _ptr
    cdef Py_ssize_t _nbytes
    cdef Py_ssize_t _shape[1]
    cdef Py_ssize_t _strides[1]
    # Recorded after the last copy queued to or from it, on a stream made to wait for the copies
    # before it that are not waited for yet (_track): it covers them all, whatever their
    # streams. Shared: a thread waiting on it without the GIL keeps it alive while another
    # thread replaces it (a copy on another device).
    cdef shared_ptr[CppEvent] _last_copy
    cdef bint _copy_pending
    cdef uint64_t _copies  # copies tracked so far: a wait clears _copy_pending only if none came since
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
        cdef shared_ptr[CppEvent] event = self._last_copy  # alive until this returns
        # The wait covers the copies tracked before it began (an event's wait takes its state at
        # the call): a copy another thread tracks meanwhile keeps the buffer pending.
        cdef uint64_t seen = self._copies
        if self._copy_pending and event.get() != NULL:
            with nogil:
                event.get().synchronize()
            if self._copies == seen:
                self._copy_pending = False
        return 0

    cdef int _track(self, int device, uintptr_t stream, bint captured) except -1:
        """Records that a copy using this buffer was queued on `stream` of `device`. A copy
        queued while `stream` captures a CUDA graph (`captured`, which the caller asked once)
        is not: it is made at each replay of the graph, which the caller waits for, as for all
        a replay writes (an event recorded in the capture could not be waited for by the host
        at all: cudaErrorCapturedEvent)."""
        if captured:
            return 0
        if self._last_copy.get() == NULL or self._last_copy.get().device() != device:
            self._wait_copies()
            self._last_copy.reset(new CppEvent(device, False))
        elif self._copy_pending:
            # The one event covers every copy not waited for: those queued before this one, on
            # another stream perhaps, too. `stream` waits for them after its copy (a wait that
            # changes nothing where they were queued on it), so the record below completes only
            # after them all. (Work queued on `stream` later waits for them as well.)
            self._last_copy.get().make_wait(<cudaStream_t>stream)
        # With the GIL from the wait to the record (both asynchronous): no other thread records
        # this buffer's event in between, which would leave its copy out of the event.
        self._last_copy.get().record(<cudaStream_t>stream)
        self._copies += 1
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
                                  f"{_brief(dl_device)}; it is host memory: (3, 0) or the CPU, "
                                  "(1, 0)")
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

# Part of _core.pyx: the stream-ordered device pool (cuda/include/inferctx/pool.hpp) that holds
# what inferctx allocates itself, and DeviceViews made in it.

from libcpp.cast cimport dynamic_cast
from libc.stdint cimport int64_t, uintptr_t
from libcpp.memory cimport shared_ptr

from inferctx._decl_gpu cimport (
    DeviceAllocation, DevicePool, PoolStats, PooledAllocation, PooledAllocationPtr, cudaStream_t)


cdef class MemoryPool:
    """The stream-ordered pool of one device, from which inferctx allocates kernel results that
    are DeviceViews and its own temporaries (``ctx.memory_pool``).

    Freed blocks stay reserved for the next allocation (after warm-up no call reaches
    ``cudaMalloc`` or ``cudaFree``); a block is handed out again only after every stream seen
    using it (kernels, DLPack exports with the consumer's stream) has finished with it: by an
    event on the default streams, the contexts' own and comm streams and each
    ``inferctx.Stream()`` while it exists, by a device-wide synchronisation when a use was on
    another stream (a torch or CuPy side stream, which may no longer exist) or on a stream not
    known (``__cuda_array_interface__`` exports, ``__dlpack__(stream=-1)``). ``trim()`` gives the
    unused memory back to the device.
    """

    cdef shared_ptr[DevicePool] _pool

    def __cinit__(self, *args, **kwargs):
        # MemoryPool.__new__(MemoryPool) from Python would have no pool behind it.
        if kwargs or len(args) != 1 or args[0] is not _MAKE:
            raise TypeError("MemoryPool objects come from InferenceContext.memory_pool")

    cdef PoolStats _stats(self):
        cdef PoolStats s
        with nogil:
            s = self._pool.get().stats()
        return s

    @property
    def device(self):
        return self._pool.get().device()

    @property
    def reserved_bytes(self):
        """Device memory the pool holds now (handed out or kept for reuse)."""
        return self._stats().reserved_bytes

    @property
    def used_bytes(self):
        """Bytes of blocks handed out and not yet freed."""
        return self._stats().used_bytes

    @property
    def peak_reserved_bytes(self):
        """Most memory reserved at once since the pool was made or ``reset_peak()``."""
        return self._stats().peak_reserved_bytes

    @property
    def peak_used_bytes(self):
        """Most memory handed out at once since the pool was made or ``reset_peak()``."""
        return self._stats().peak_used_bytes

    @property
    def allocations(self):
        """Blocks handed out and not yet freed."""
        return self._stats().allocations

    def stats(self):
        """All the figures at once, as a dict."""
        cdef PoolStats s = self._stats()
        return {"reserved_bytes": s.reserved_bytes, "used_bytes": s.used_bytes,
                "peak_reserved_bytes": s.peak_reserved_bytes, "peak_used_bytes": s.peak_used_bytes,
                "allocations": s.allocations}

    def reset_peak(self):
        """Starts the peak figures again from the current ones."""
        with nogil:
            self._pool.get().reset_peak()

    def trim(self, keep_bytes=0):
        """Waits for all work queued on the device (``cudaDeviceSynchronize``), so that the frees
        still queued are done, then returns unused memory to the device, keeping at least
        ``keep_bytes`` reserved; returns the bytes reserved afterwards."""
        cdef int64_t keep = _count_arg(keep_bytes, "keep_bytes", 0)
        cdef int64_t left
        with nogil:
            left = self._pool.get().trim(keep)
        return left

    def __repr__(self):
        cdef PoolStats s = self._stats()
        return (f"<inferctx.MemoryPool cuda:{self.device}: {s.used_bytes} of {s.reserved_bytes} "
                f"bytes in use in {s.allocations} blocks>")


cdef MemoryPool _memory_pool(int device):
    cdef MemoryPool pool = MemoryPool.__new__(MemoryPool, _MAKE)
    with nogil:
        pool._pool = DevicePool.of(device)
    return pool


cdef DeviceView _pooled_view(InferenceContext ctx, int dtype, tuple shape, uintptr_t stream, str argument,
                             str advice):
    """A new C-contiguous view of `dtype` x `shape` in a block of ctx's device pool, usable on
    `stream` in stream order. While `stream` captures a CUDA graph the pool takes no memory: a
    block made in the capture would belong to the graph, and letting one go there needs a device
    synchronisation, which ends the capture. ConfigError naming `argument` then, with `advice`,
    before anything is allocated."""
    if _capturing(stream):  # (a stream CUDA will not answer for is refused where it is used)
        raise _ConfigError(f"{argument}: a new DeviceView comes from inferctx's memory pool, which takes no "
                           f"memory while the stream ({stream:#x}) captures a CUDA graph; {advice}",
                           argument=argument)
    cdef int64_t size = _shape_size(shape, _DTYPE_ITEMSIZE[dtype], "shape")
    cdef int64_t nbytes = size * _DTYPE_ITEMSIZE[dtype]
    cdef int device = ctx.device
    cdef shared_ptr[PooledAllocation] block
    cdef shared_ptr[DevicePool] pool
    with nogil:
        pool = DevicePool.of(device)
        block = pool.get().allocate(nbytes, <cudaStream_t>stream)
    return _make_view(<shared_ptr[DeviceAllocation]>block, 0, shape, size, dtype, ctx)


cdef inline int _note_use(DeviceView view, uintptr_t stream) except -1:
    """Records that `stream` uses the view's memory, when it is a pool block (0: a stream that is
    not known)."""
    cdef PooledAllocation* block = dynamic_cast[PooledAllocationPtr](view._alloc.get())
    if block == NULL:
        return 0
    if stream == 0:
        block.note_unknown_use()
    else:
        with nogil:
            block.note_use(<cudaStream_t>stream)
    return 0

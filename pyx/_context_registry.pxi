# Part of _core.pyx: the InferenceContext of each device. inferctx::InferenceContext::instance
# (cuda/src/context.cpp) makes and owns the C++ contexts; this keeps the one Python object of each,
# which holds the context's Python-side state (the plan in force, the Stream objects).

from libc.stdint cimport int64_t
from libcpp.memory cimport shared_ptr

from inferctx._decl_gpu cimport (
    CppEvent, CppInferenceContext, DevicePool, cudaError_t, cudaGetDevice, cudaGetLastError,
    cudaSuccess)

import threading as _threading


# device ordinal -> its InferenceContext; contexts live as long as the process, as in C++.
cdef dict _contexts = {}
# The class every context is made as: the public subclass once it has registered itself
# through _set_context_class (python/inferctx/context.py), which adds what needs the Python
# layer (argument coercion, WorkspacePlan, logging).
cdef type _context_class = None


def _set_context_class(cls):
    """Makes every context from now on an instance of `cls`, a subclass of InferenceContext."""
    global _context_class
    if not (isinstance(cls, type) and issubclass(cls, InferenceContext)):
        raise TypeError(f"{cls!r} is not a subclass of inferctx._core.InferenceContext")
    _context_class = cls


cdef InferenceContext _context_of(object device):
    """The context of `device` (None: the calling thread's current device)."""
    cdef int d = 0
    cdef int64_t n
    cdef cudaError_t status
    if device is None:
        with nogil:
            status = cudaGetDevice(&d)
        if status != cudaSuccess:
            with nogil:
                cudaGetLastError()
            return _create_context(-1)  # raises the runtime's error (NoCudaDeviceError, ...)
    else:
        n = _int_arg(device, "device")
        if not 0 <= n < (1 << 31):
            raise _ConfigError(f"device: got {_brief(device)}; it must be the ordinal of a visible "
                               "device (0, 1, ...), or None for the current device",
                               argument="device")
        d = <int>n
    found = _contexts.get(d)
    if found is not None:
        return <InferenceContext>found
    if device is not None:
        # Said here in Python's terms (the C++ layer's message offers -1 for the current device).
        count = _device_count()  # NoCudaDeviceError where there is none
        if d >= count:
            raise _ConfigError(f"device: got {d}; valid: 0..{count - 1} ({count} visible "
                               f"device{'s' if count != 1 else ''}), or None for the current device",
                               argument="device")
    return _create_context(d)


cdef InferenceContext _create_context(int device):
    cdef shared_ptr[CppInferenceContext] owner
    with nogil:
        owner = CppInferenceContext.instance(device)
    cdef int d = owner.get().device()
    found = _contexts.get(d)
    if found is not None:
        return <InferenceContext>found
    cls = InferenceContext if _context_class is None else _context_class
    cdef InferenceContext ctx = cls.__new__(cls, _MAKE)
    ctx._owner = owner
    ctx._c = owner.get()
    ctx.device = d
    ctx._workspace_lock = _threading.Lock()
    ctx._stream_lock = _threading.Lock()
    cdef shared_ptr[DevicePool] pool
    with nogil:
        ctx._handshake.reset(new CppEvent(d, False))
        # The context's streams live as long as the process: the pool may order frees after them.
        pool = DevicePool.of(d)
        pool.get().note_durable(ctx._c.own_stream())
        pool.get().note_durable(ctx._c.comm_stream())
    # Another thread may have made one meanwhile: every caller gets the same object.
    stored = _contexts.setdefault(d, ctx)
    if stored is ctx:
        ctx._created(None if ctx._c.addresses_stable()
                     else ctx._c.fallback_reason().decode("utf-8", "replace"))
    return <InferenceContext>stored


cdef InferenceContext _fast_path_context(object ctx, int device):
    """The context a compiled torch path runs on: ctx when it is the context of `device`, the
    existing context of `device` when ctx is None; None otherwise (the general path then takes
    the call, making the context or saying what is wrong)."""
    if ctx is None:
        found = _contexts.get(device)
        return None if found is None else <InferenceContext>found
    if isinstance(ctx, InferenceContext) and (<InferenceContext>ctx).device == device:
        return <InferenceContext>ctx
    return None

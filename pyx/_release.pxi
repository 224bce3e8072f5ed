# Part of _core.pyx: what a released workspace refuses. Under CUDA virtual memory a released
# workspace keeps its addresses but has no memory behind them until retake_workspace; a kernel,
# a copy or a consumer touching them then makes an illegal memory access, which kills the CUDA
# context of the whole process. So exports of its views and kernel launches on its addresses
# raise WorkspaceStateError instead, until the retake. (Under the cudaMalloc fallback a view
# keeps its own allocation alive and stays usable; nothing is refused.)

from libc.stdint cimport int64_t, uintptr_t


# device -> InferenceContext, for the contexts whose workspace is released under virtual memory.
# Empty in the common case, so the check on every kernel operand costs one test.
cdef dict _released_contexts = {}


cdef str _released_words(int device, str what):
    return (f"{what}: the workspace of device {device} is released (release_workspace); its "
            f"addresses stay reserved but have no memory behind them until retake_workspace(), "
            f"and touching them now would be an illegal memory access. Call ctx.retake_workspace() "
            f"first; views, tensors and CUDA graphs made before the release are valid again after "
            f"it")


cdef int _require_accessible(DeviceView view, str what) except -1:
    """Raises WorkspaceStateError when `view` is of a released workspace."""
    if not view._alloc.get().accessible():
        raise _WorkspaceStateError(_released_words(view._device, what))
    return 0


cdef int _require_mapped(uintptr_t ptr, int64_t nbytes, int device) except -1:
    """Raises WorkspaceStateError when a kernel operand lies in a released workspace."""
    if not _released_contexts:
        return 0
    found = _released_contexts.get(device)
    if found is not None and (<InferenceContext>found)._c.in_released_range(<const void*>ptr,
                                                                             nbytes):
        raise _WorkspaceStateError(_released_words(device, "a kernel operand"))
    return 0


cdef int _note_released(InferenceContext ctx) except -1:
    """Brings _released_contexts up to date with `ctx` after a release, retake or plan."""
    if ctx._c.addresses_stable() and _released_now(ctx):
        _released_contexts[ctx.device] = ctx
    else:
        _released_contexts.pop(ctx.device, None)
    return 0

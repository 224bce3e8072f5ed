# Part of _core.pyx: what a released workspace refuses. Under CUDA virtual memory a released
# workspace keeps its addresses but has no memory behind them until retake_workspace; a kernel,
# a copy or a consumer touching them then makes an illegal memory access, which kills the CUDA
# context of the whole process. So exports of its views and kernel launches on its addresses
# raise WorkspaceStateError instead, until the retake. (Under the cudaMalloc fallback a view
# keeps its own allocation alive and stays usable; nothing is refused.)

from libc.stdint cimport INT64_MAX, int64_t, uintptr_t


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


cdef int _require_mapped(uintptr_t ptr, tuple shape, tuple strides, int64_t itemsize,
                         int device) except -1:
    """Raises WorkspaceStateError when a kernel operand (`strides` in elements) reaches into a
    released workspace: any byte from its lowest element's to its highest's, wherever its
    strides (negative ones too) place them; an empty one at its pointer."""
    if not _released_contexts:
        return 0
    found = _released_contexts.get(device)
    if found is None:
        return 0
    low = 0
    high = 0
    for n, step in zip(shape, strides):
        if n == 0:
            low = high = 0  # no element: the pointer alone
            itemsize = 0
            break
        reach = (n - 1) * step * itemsize
        if reach < 0:
            low += reach
        else:
            high += reach
    begin = max(<object>ptr + low, 0)
    # (within int64, and not past the top of the address space, where the range test would wrap)
    nbytes = min(max(<object>ptr + high + itemsize - begin, 0), INT64_MAX, (1 << 64) - 1 - begin)
    if (<InferenceContext>found)._c.in_released_range(<const void*><uintptr_t>begin,
                                                      <int64_t>nbytes):
        raise _WorkspaceStateError(_released_words(device, "a kernel operand"))
    return 0


cdef int _note_released(InferenceContext ctx) except -1:
    """Brings _released_contexts up to date with `ctx` after a release, retake or plan.

    The state is read lock-free and applied with the GIL held throughout: a read that waited for
    the context's lock without the GIL could be applied after another thread's release or retake
    had noted the newer state, and a released workspace would then be missing from the list (its
    kernels no longer refused: an illegal memory access) or a held one left in it. Read this way,
    the last note made after the last release or retake is the one that stands."""
    cdef object device = ctx.device
    if ctx._c.addresses_released():
        _released_contexts[device] = ctx
    else:
        _released_contexts.pop(device, None)
    return 0

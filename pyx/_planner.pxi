# Part of _core.pyx: the planner's bindings (_planner_api.pxi) and the device queries.

from inferctx._decl_gpu cimport MemoryInfo, current_device, device_count, memory_info

include "_planner_api.pxi"


def _device_count():
    """Number of visible CUDA devices; NoCudaDeviceError when none."""
    cdef int n
    with nogil:
        n = device_count()
    return n


def _current_device():
    cdef int d
    with nogil:
        d = current_device()
    return d


def _memory_info(int device):
    """(free_bytes, total_bytes) of `device`, read now."""
    cdef MemoryInfo m
    with nogil:
        m = memory_info(device)
    return m.free_bytes, m.total_bytes

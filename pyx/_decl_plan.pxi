# extern declarations of inferctx_core (cuda/include/inferctx): the planner's (_decl_planner.pxi)
# and the device queries. Included by _core.pxd.

include "_decl_planner.pxi"


cdef extern from "inferctx/cuda_check.hpp" namespace "inferctx" nogil:
    cdef cppclass MemoryInfo:
        int64_t free_bytes
        int64_t total_bytes

    int device_count() except +raise_inferctx_error
    int current_device() except +raise_inferctx_error
    MemoryInfo memory_info(int device) except +raise_inferctx_error

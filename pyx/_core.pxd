# cython: language_level=3
# Declarations of the extension module inferctx._core: the C++ API it binds (one
# _decl_*.pxi per header group) and its module-level cdef functions.

from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.vector cimport vector

# Raises the Python twin of the C++ exception being handled (`except +raise_inferctx_error`).
cdef int raise_inferctx_error() except -1

include "_decl_plan.pxi"
include "_decl_gpu.pxi"
include "_decl_kernels.pxi"
include "_decl_gemm.pxi"

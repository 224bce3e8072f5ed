# cython: language_level=3
# Declarations of the extension module inferctx._plan: the host-only planner it binds.

from libc.stdint cimport int64_t
from libcpp cimport bool
from libcpp.string cimport string

# Raises the Python twin of the C++ exception being handled (`except +raise_inferctx_error`).
cdef int raise_inferctx_error() except -1

include "_decl_planner.pxi"

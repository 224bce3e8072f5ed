# cython: language_level=3
# extern declarations of cuda/include/inferctx/errors.hpp (in inferctx_plan): the facts of the C++
# error being handled, and the handler that every `except +raise_inferctx_error` names.

from libc.stdint cimport int64_t
from libcpp.string cimport string


cdef extern from *:
    # Raises the Python twin of the C++ exception being handled. Each module that binds
    # inferctx defines it once (_errors.pxi, `cdef public` so that its C name is this one).
    int raise_inferctx_error() except -1


cdef extern from "inferctx/errors.hpp" namespace "inferctx" nogil:
    cdef cppclass ErrorInfo:
        int kind
        string message
        int remedy
        int remedy_device
        string argument
        int64_t requested_bytes, free_bytes, total_bytes, budget_bytes
        int64_t max_batch_size, max_out_tokens
        int64_t current, requested, limit
        int64_t views_alive
        string call
        string code_name
        int code
        int device

    ErrorInfo current_error_info()

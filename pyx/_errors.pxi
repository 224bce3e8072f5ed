# Included by _core.pyx and _plan.pyx: the C++ -> Python error translation.

from inferctx._decl_errors cimport ErrorInfo, current_error_info
cdef object _brief = _errors._brief  # a value as error messages show it (a raising __repr__ too)

# ErrorKind codes of cuda/include/inferctx/errors.hpp
cdef dict _KIND_TO_CLASS = {
    1: _errors.ConfigError,
    2: _errors.WorkspaceOOMError,
    3: _errors.TokenLimitError,
    4: _errors.WorkspaceStateError,
    5: _errors.WorkspaceInUseError,
    6: _errors.CudaError,
    7: _errors.CublasError,
    8: _errors.NoCudaDeviceError,
}


# `public` gives it the plain C name that _decl_errors.pxd declares for every `except +` handler.
cdef public int raise_inferctx_error() except -1:
    """Handler for `except +raise_inferctx_error`: raises the Python twin of the C++ error.

    The Python class words the error's remedy (InferCtxError._from_core)."""
    cdef ErrorInfo info = current_error_info()
    message = info.message.decode("utf-8", "replace")
    if info.kind == -1:
        raise MemoryError(message)
    cls = _KIND_TO_CLASS.get(info.kind)
    if cls is None:
        raise _errors.InferCtxError(f"internal error: {message}")
    remedy = (info.remedy, None if info.remedy_device < 0 else info.remedy_device)
    if info.kind == 1:
        raise cls._from_core(message, *remedy, argument=info.argument.decode())
    if info.kind == 2:
        raise cls._from_core(message, *remedy, requested_bytes=info.requested_bytes,
                             free_bytes=info.free_bytes, total_bytes=info.total_bytes,
                             budget_bytes=info.budget_bytes,
                             max_batch_size=None if info.max_batch_size < 0 else info.max_batch_size,
                             max_out_tokens=None if info.max_out_tokens < 0 else info.max_out_tokens)
    if info.kind == 3:
        raise cls._from_core(message, *remedy, current=info.current, requested=info.requested,
                             limit=info.limit)
    if info.kind == 5:
        raise cls._from_core(message, *remedy, views_alive=info.views_alive)
    if info.kind in (6, 7, 8):
        raise cls._from_core(message, *remedy, call=info.call.decode(), code=info.code,
                             name=info.code_name.decode(),
                             device=None if info.device < 0 else info.device)
    raise cls._from_core(message, *remedy)

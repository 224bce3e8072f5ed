# Included by _core.pyx and _plan.pyx: the C++ -> Python error translation.

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


cdef int raise_inferctx_error() except -1:
    """Handler for `except +raise_inferctx_error`: raises the Python twin of the C++ error."""
    cdef ErrorInfo info = current_error_info()
    message = info.message.decode("utf-8", "replace")
    if info.kind == -1:
        raise MemoryError(message)
    cls = _KIND_TO_CLASS.get(info.kind)
    if cls is None:
        raise _errors.InferCtxError(f"internal error: {message}")
    if info.kind == 1:
        raise cls(message, argument=info.argument.decode())
    if info.kind == 2:
        raise cls(message, requested_bytes=info.values[0], free_bytes=info.values[1],
                  total_bytes=info.values[2], budget_bytes=info.values[3],
                  max_batch_size=None if info.values[4] < 0 else info.values[4],
                  max_out_tokens=None if info.values[5] < 0 else info.values[5])
    if info.kind == 3:
        raise cls(message, current=info.values[0], requested=info.values[1], limit=info.values[2])
    if info.kind == 5:
        raise cls(message, views_alive=info.values[0])
    if info.kind in (6, 7, 8):
        raise cls(message, call=info.call.decode(), code=info.code,
                  name=info.code_name.decode(), device=None if info.device < 0 else info.device)
    raise cls(message)



"""The exceptions inferctx raises; every one is picklable and says what to do."""

from __future__ import annotations

__all__ = [
    "InferCtxError",
    "ConfigError",
    "WorkspaceOOMError",
    "TokenLimitError",
    "WorkspaceStateError",
    "WorkspaceInUseError",
    "CudaError",
    "CublasError",
    "NoCudaDeviceError",
]


class InferCtxError(Exception):
    """Base class of every inferctx error."""

    _fields: tuple[str, ...] = ()

    def __init__(self, message: str, **fields):
        super().__init__(message)
        for name in self._fields:
            setattr(self, name, fields.pop(name, None))
        if fields:
            raise TypeError(f"{type(self).__name__} got unknown fields {sorted(fields)}")

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, {n: getattr(self, n) for n in self._fields}))


def _rebuild(cls, message, fields):
    return cls(message, **fields)


class ConfigError(InferCtxError, ValueError):
    """An argument is invalid; ``argument`` names it."""

    _fields = ("argument",)


class WorkspaceOOMError(InferCtxError, MemoryError):
    """The workspace does not fit in the memory budget.

    ``requested_bytes``, ``free_bytes``, ``total_bytes`` and ``budget_bytes`` give the
    figures; ``max_batch_size`` and ``max_out_tokens`` the largest values that would fit
    with everything else unchanged (None when none would).
    """

    _fields = ("requested_bytes", "free_bytes", "total_bytes", "budget_bytes", "max_batch_size",
               "max_out_tokens")


class TokenLimitError(InferCtxError, IndexError):
    """Advancing the token counter would pass ``max_token_length``."""

    _fields = ("current", "requested", "limit")


class WorkspaceStateError(InferCtxError, RuntimeError):
    """The workspace is not in a state that allows the call (none planned, released)."""


class WorkspaceInUseError(WorkspaceStateError):
    """The workspace cannot be released: ``views_alive`` exported views still use it."""

    _fields = ("views_alive",)


class CudaError(InferCtxError, RuntimeError):
    """A CUDA runtime call failed: ``call``, ``code``, ``name`` and ``device`` say which."""

    _fields = ("call", "code", "name", "device")


class CublasError(CudaError):
    """A cuBLAS call failed: ``call`` and the status ``code`` / ``name``."""


class NoCudaDeviceError(CudaError):
    """No usable CUDA device (none present or no driver); planning works without one."""

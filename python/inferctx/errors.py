"""The exceptions inferctx raises; every one is picklable and says what to do."""

from __future__ import annotations

from typing import Any

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
    "CudaLibraryError",
]


class InferCtxError(Exception):
    """Base class of every inferctx error."""

    _fields: tuple[str, ...] = ()

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        for name in self._fields:
            setattr(self, name, fields.pop(name, None))
        if fields:
            raise TypeError(f"{type(self).__name__} got unknown fields {sorted(fields)}")

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    @classmethod
    def _from_core(cls, message: str, remedy: int = 0, remedy_device: int | None = None,
                   **fields: Any) -> InferCtxError:
        """The error the C++ layer threw: its message (the facts), then its remedy worded here."""
        return cls(message + _REMEDIES.get(remedy, "").format(device=remedy_device), **fields)

    def __reduce__(self) -> tuple[Any, ...]:
        # The fields rebuild the error through its constructor; what else its __dict__ holds
        # (add_note's __notes__, attributes set on it) is restored after, as for any exception.
        fields = {n: getattr(self, n) for n in self._fields}
        extra = {k: v for k, v in self.__dict__.items() if k not in fields}
        return (_rebuild, (type(self), self.message, fields), extra or None)


def _rebuild(cls: type[InferCtxError], message: str, fields: dict[str, Any]) -> InferCtxError:
    return cls(message, **fields)


# What the caller can do, by the codes of inferctx::Remedy (cuda/include/inferctx/errors.hpp):
# the C++ message holds the facts, and this the fix in the Python API's terms ({device}: the
# device the remedy names).
_REMEDIES: dict[int, str] = {
    1: "; or drop the views of the workspace, or release_workspace(force=True), and retry",
    2: "; drop them first, or pass force=True to detach the workspace: its memory is then freed "
       "when the last view dies",
    3: "; free device memory (for torch: drop tensors, then torch.cuda.empty_cache()) and call "
       "retake_workspace again",
    4: ", or InferenceContext.instance({device}) for that stream",
    5: " Planning (plan_workspace, `inferctx plan --free-gb ... --total-gb ...`) works without one.",
    6: "; use bmm for batches",
    7: " (call .contiguous() first)",
}


def _brief(value: object, limit: int = 60) -> str:
    """A value as an error message shows it: its repr, clipped to about `limit` characters.

    Integers too long to print whole (Python refuses str() beyond 4300 digits) are described
    by their size.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value):,} characters)"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class ConfigError(InferCtxError, ValueError):
    """An argument is invalid; ``argument`` names it."""

    _fields = ("argument",)
    argument: str | None


class WorkspaceOOMError(InferCtxError, MemoryError):
    """The workspace does not fit in the memory budget.

    ``requested_bytes``, ``free_bytes``, ``total_bytes`` and ``budget_bytes`` give the
    figures; ``max_batch_size`` and ``max_out_tokens`` the largest values that would fit
    with everything else unchanged (None when none would).
    """

    _fields = ("requested_bytes", "free_bytes", "total_bytes", "budget_bytes", "max_batch_size",
               "max_out_tokens")
    requested_bytes: int | None
    free_bytes: int | None
    total_bytes: int | None
    budget_bytes: int | None
    max_batch_size: int | None
    max_out_tokens: int | None


class TokenLimitError(InferCtxError, IndexError):
    """Advancing the token counter would pass ``max_token_length``."""

    _fields = ("current", "requested", "limit")
    current: int | None
    requested: int | None
    limit: int | None


class WorkspaceStateError(InferCtxError, RuntimeError):
    """The workspace is not in a state that allows the call (none planned, released)."""


class WorkspaceInUseError(WorkspaceStateError):
    """The workspace cannot be released: ``views_alive`` exported views still use it."""

    _fields = ("views_alive",)
    views_alive: int | None


class CudaError(InferCtxError, RuntimeError):
    """A CUDA runtime call failed: ``call``, ``code``, ``name`` and ``device`` say which."""

    _fields = ("call", "code", "name", "device")
    call: str | None
    code: int | None
    name: str | None
    device: int | None


class CublasError(CudaError):
    """A cuBLAS call failed: ``call`` and the status ``code`` / ``name``."""


class NoCudaDeviceError(CudaError):
    """No usable CUDA device (none present or no driver); planning works without one."""


class CudaLibraryError(InferCtxError, ImportError):
    """The GPU module cannot load a CUDA library it needs (cuBLAS); the message names the wheel
    that provides it. Planning works without it."""

    _fields = ("name", "path")
    name: str | None
    path: str | None

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

    def __init__(self, *args: object, **fields: Any) -> None:
        # As any exception: no arguments, or several, are accepted and kept in `args`; the
        # message is the first. The fields are keywords only (``message=`` names the message).
        if "message" in fields and "message" not in self._fields:
            if args:
                raise TypeError(f"{type(self).__name__} got the message twice: positionally and as "
                                f"message=")
            args = (fields.pop("message"),)
        super().__init__(*args)
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
        # The error comes back with the same args (whatever their number and types) and, as its
        # state, its fields and whatever else it holds (add_note's __notes__, attributes set on
        # it), without calling the class's __init__ again: a subclass whose constructor takes
        # other arguments pickles and copies too.
        state = {n: getattr(self, n) for n in self._fields if hasattr(self, n)}
        state.update(self.__dict__)
        return (_restore, (type(self), self.args), state or None)


def _restore(cls: type[InferCtxError], args: tuple[Any, ...]) -> InferCtxError:
    """An error of `cls` with `args`, made as the built-in exception it extends makes one (an
    ImportError keeps its ``msg``); its fields come after, as its pickled state."""
    error = BaseException.__new__(cls, *args)
    if isinstance(error, ImportError):
        ImportError.__init__(error, *args)
    return error


def _rebuild(cls: type[InferCtxError], message: str, fields: dict[str, Any]) -> InferCtxError:
    """Unpickles errors pickled by earlier versions (the message and the fields)."""
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
    5: " Planning (plan_workspace with gpu=, a GPU preset, or free_bytes= and total_bytes=; `inferctx "
       "plan --gpu PRESET` or `--free-gb ... --total-gb ...`) works without one.",
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
        text = _brief_items(value, limit)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _brief_items(value: object, limit: int, depth: int = 0) -> str:
    """A list or tuple whose repr failed (an integer too long to print in it, or an item whose
    __repr__ raises), shown item by item as _brief shows each; any other value by its type."""
    if not isinstance(value, (list, tuple)) or type(value) not in (list, tuple) or depth > 3:
        return f"<{type(value).__name__} object>"
    shown: list[str] = []
    for item in value:
        if sum(len(text) + 2 for text in shown) > limit:
            shown.append("...")
            break
        shown.append(_brief_items(item, limit, depth + 1) if type(item) in (list, tuple)
                     else _brief(item, limit))
    if isinstance(value, tuple):
        return f"({', '.join(shown)}{',' if len(shown) == 1 else ''})"
    return f"[{', '.join(shown)}]"


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

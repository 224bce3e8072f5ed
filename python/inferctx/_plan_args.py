"""Planning's argument coercion: integers that fit int64_t, fractions, policy names, and the
byte formatter of every message (inferctx.planning re-exports human_bytes)."""

from __future__ import annotations

import decimal
import math
import numbers
import operator

from . import _plan
from .errors import ConfigError, _brief

POLICIES = {"exact": 0, "deepspeed": 1}
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# The CUDA runtime takes a device ordinal as a C int: [0, 2**31).
DEVICE_LIMIT = 1 << 31


def _is_flag(value: object) -> bool:
    """A bool, or an array or tensor of booleans: torch.tensor(True) indexes as 1, but a flag is
    not a count."""
    if isinstance(value, bool):
        return True
    try:
        dtype = getattr(value, "dtype", None)
    except Exception:  # noqa: BLE001 - a broken attribute is no dtype
        return False
    return dtype is not None and str(dtype) in ("bool", "torch.bool")


def _index(value: object, argument: str) -> int:
    """An integer argument, of any size (bool and floats refused: True is not a count)."""
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{argument}: got {value!r}; it must be an integer", argument=argument)
    if _is_flag(value):
        raise ConfigError(f"{argument}: got {_brief(value)} ({type(value).__name__}), a boolean; it must be an "
                          f"integer", argument=argument)
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{argument}: got {_brief(value)} ({type(value).__name__}); it must be an integer",
                          argument=argument) from None


def _as_int(value: object, argument: str, *, minimum: int | None = None) -> int:
    """An integer argument that fits int64_t (bool and floats refused: True is not a count)."""
    n = _index(value, argument)
    if n > INT64_MAX:
        raise ConfigError(f"{argument}: got {_brief(n)}; it must be below 2**63 = {1 << 63:,}",
                          argument=argument)
    if minimum is not None and n < minimum:
        raise ConfigError(f"{argument}: got {_brief(n)}; it must be >= {minimum}", argument=argument)
    if n < INT64_MIN:
        raise ConfigError(f"{argument}: got {_brief(n)}; it must be >= -2**63 = {INT64_MIN:,}",
                          argument=argument)
    return n


def _as_device(value: object) -> int:
    """A device ordinal: an integer in [0, 2**31), the C int the CUDA runtime takes."""
    n = _index(value, "device")
    if not 0 <= n < DEVICE_LIMIT:
        bound = ">= 0" if n < 0 else "below 2**31 (the CUDA runtime's int)"
        raise ConfigError(f"device: got {_brief(n)}; it must be a device ordinal {bound}", argument="device")
    return n


def _as_opt_int(value: object, argument: str, *, minimum: int | None = None) -> int | None:
    return None if value is None else _as_int(value, argument, minimum=minimum)


def _as_fraction(value: object, argument: str = "memory_fraction") -> float | None:
    """A number in (0, 1], or None: any real (float, int, NumPy scalar, Fraction, Decimal), or a
    0-d array of one (a 0-d torch tensor or NumPy array), as the integer arguments take 0-d
    integer tensors."""
    if value is None:
        return None
    what = "it must be a number in (0, 1], a fraction of free memory"
    scalar = (not isinstance(value, (bool, str, bytes))
              and (isinstance(value, (numbers.Real, decimal.Decimal))
                   or (getattr(value, "ndim", None) == 0 and hasattr(value, "__float__")
                       and str(getattr(value, "dtype", "")) not in ("bool", "torch.bool"))))
    if not scalar:
        raise ConfigError(f"{argument}: got {_brief(value)}, of type {type(value).__name__}; it must be a real "
                          f"number (a float, an int, a NumPy scalar or a 0-d tensor) in (0, 1], a fraction of "
                          f"free memory", argument=argument)
    try:
        f = float(value)  # type: ignore[arg-type]
    except (OverflowError, ValueError, TypeError, RuntimeError):  # 2**1024; a complex 0-d array
        raise ConfigError(f"{argument}: got {_brief(value)}; {what}", argument=argument) from None
    if math.isnan(f) or not 0.0 < f <= 1.0:
        raise ConfigError(f"{argument}: got {_brief(value)}; {what}", argument=argument)
    return f


# Past this the TiB figure is beyond a float: no byte count comes near it.
_HUMAN_BYTES_LIMIT = 1 << 1024


def human_bytes(n: int) -> str:
    """1536 -> '1.50 KiB'; binary units (the C++ formatter that every message uses).

    ``n`` is a byte count: an integer (a Python or NumPy int; bool and floats raise TypeError).
    Counts outside int64, which the C++ formatter cannot take, are formatted here in the same
    way (TiB, two decimals); beyond 2**1024 in magnitude they raise ConfigError.
    """
    if _is_flag(n) or not hasattr(type(n), "__index__"):
        raise TypeError(f"human_bytes: n must be an integer byte count, got {_brief(n)} ({type(n).__name__})")
    count = operator.index(n)
    if INT64_MIN <= count <= INT64_MAX:
        return _plan._human_bytes(count)
    if not -_HUMAN_BYTES_LIMIT < count < _HUMAN_BYTES_LIMIT:
        raise ConfigError(f"n: got {_brief(count)}; a byte count must be below 2**1024 in magnitude",
                          argument="n")
    return f"{count / (1 << 40):.2f} TiB"  # as the C++ formatter words a count of 1 TiB or more


# Users see it, and pickles name it, as inferctx.planning.human_bytes, the module that exports it.
human_bytes.__module__ = "inferctx.planning"

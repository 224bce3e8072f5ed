"""Planning's argument coercion: integers that fit int64_t, fractions, policy names, and the
byte formatter of every message (inferctx.planning re-exports human_bytes)."""

from __future__ import annotations

import math
import numbers
import operator

from . import _plan
from .errors import ConfigError, _brief

POLICIES = {"exact": 0, "deepspeed": 1}
INT64_MAX = (1 << 63) - 1


def _as_int(value: object, argument: str, *, minimum: int | None = None) -> int:
    """An integer argument that fits int64_t (bool and floats refused: True is not a count)."""
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{argument}: got {value!r}; it must be an integer", argument=argument)
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(f"{argument}: got {_brief(value)} ({type(value).__name__}); it must be an integer",
                          argument=argument) from None
    if not -(1 << 63) <= n <= INT64_MAX:
        raise ConfigError(f"{argument}: got {_brief(n)}; it must be below 2**63 = {1 << 63:,}",
                          argument=argument)
    if minimum is not None and n < minimum:
        raise ConfigError(f"{argument}: got {n}; it must be >= {minimum}", argument=argument)
    return n


def _as_opt_int(value: object, argument: str, *, minimum: int | None = None) -> int | None:
    return None if value is None else _as_int(value, argument, minimum=minimum)


def _as_fraction(value: object, argument: str = "memory_fraction") -> float | None:
    """A number in (0, 1] (any real: float, int, numpy scalar, Fraction), or None."""
    if value is None:
        return None
    what = "it must be a number in (0, 1], a fraction of free memory"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{argument}: got {_brief(value)} ({type(value).__name__}); {what}",
                          argument=argument)
    try:
        f = float(value)
    except (OverflowError, ValueError, TypeError):
        raise ConfigError(f"{argument}: got {_brief(value)}; {what}", argument=argument) from None
    if math.isnan(f) or not 0.0 < f <= 1.0:
        raise ConfigError(f"{argument}: got {_brief(value)}; {what}", argument=argument)
    return f


def human_bytes(n: int) -> str:
    """1536 -> '1.50 KiB'; binary units (the C++ formatter that every message uses)."""
    return _plan._human_bytes(n)


# Users see it, and pickles name it, as inferctx.planning.human_bytes, the module that exports it.
human_bytes.__module__ = "inferctx.planning"

"""Dtype coercion: strings, NumPy dtypes and torch dtypes (torch is never imported)."""

from __future__ import annotations

from . import _plan
from ._plan import _name_of
from .errors import ConfigError, _brief

# Codes and sizes of inferctx::DType (cuda/include/inferctx/plan.hpp), through the planner.
FLOAT32, FLOAT16, BFLOAT16 = _plan.DTYPE_FLOAT32, _plan.DTYPE_FLOAT16, _plan.DTYPE_BFLOAT16

NAMES = {FLOAT32: "float32", FLOAT16: "float16", BFLOAT16: "bfloat16"}
ITEMSIZE = dict(_plan.DTYPE_ITEMSIZE)

# The planner's dtypes by name and by alias ('fp16', 'half', ...: the compiled layer's one table).
_ALIASES = {name: code for code, name in NAMES.items()}
_ALIASES.update({alias: _ALIASES[name] for alias, name in _plan.DTYPE_ALIASES.items()
                 if name in _ALIASES})

VALID = "'float32' ('fp32'), 'float16' ('fp16', 'half') or 'bfloat16' ('bf16')"


def dtype_code(dtype: object, argument: str = "dtype") -> int:
    """The inferctx dtype code of a string, NumPy dtype or torch dtype."""
    name = _name_of(dtype)
    code = _ALIASES.get(name.strip().lower()) if name is not None else None
    if code is None:
        raise ConfigError(f"{argument}: got {_brief(dtype)}; valid: {VALID}, or the NumPy/torch "
                          f"dtype of one of them", argument=argument)
    return code


def dtype_name(dtype: object, argument: str = "dtype") -> str:
    """The canonical name ('float32', 'float16', 'bfloat16') of a dtype."""
    return NAMES[dtype_code(dtype, argument)]

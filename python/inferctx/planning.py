"""Workspace planning in Python: the planner's entry points over the C++ planner (works without a GPU).

plan_workspace, max_batch_size and max_out_tokens_for check a request, turn it into the fields
the planner takes and ask it. This module exports the planning API; the model's shape is in
_model_shape.py, the plan and its regions in _workspace_plan.py, the argument coercion and the
byte formatter in _plan_args.py.

The planner is the compiled module inferctx._plan, pure host code: planning loads no CUDA
library. Only reading a real device's memory (free_bytes or total_bytes omitted, and no gpu=)
loads the GPU module inferctx._core.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, Union

from . import _plan, dtypes
from ._model_shape import ModelShape, _as_shape
from ._plan_args import POLICIES, _as_device, _as_fraction, _as_int, _as_opt_int, human_bytes
from ._workspace_plan import Region, Regions, WorkspacePlan  # noqa: F401  (Regions: plans' pickles name it here)
from .errors import ConfigError, NoCudaDeviceError, WorkspaceOOMError, _brief

if TYPE_CHECKING:
    from .presets import GpuPreset

__all__ = ["ModelShape", "Region", "WorkspacePlan", "plan_workspace", "max_batch_size",
           "max_out_tokens_for", "human_bytes"]

Policy = Literal["exact", "deepspeed"]
Weights = Union[int, Literal["auto"], None]


def _request_fields(shape: object, *, batch_size: object, prompt_len: object, max_out_tokens: object,
                    min_out_tokens: object = 1, dtype: object = "float16", mp_size: object = 1,
                    rank: object = 0, external_cache: object = False, policy: object = "exact",
                    free_bytes: object, total_bytes: object, weights_bytes: object = 0,
                    reserve_bytes: object = None, memory_limit_bytes: object = None,
                    memory_fraction: object = None) -> dict[str, Any]:
    """Coerces planning arguments into the dict the compiled planner takes (every int fits int64)."""
    s = _as_shape(shape)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ConfigError(f"policy: got {_brief(policy)}; valid: 'exact' (default) or 'deepspeed'",
                          argument="policy")
    return {
        "num_layers": s.num_layers,
        "num_heads": s.num_heads,
        "hidden_dim": s.hidden_dim,
        "num_kv_heads": s.num_kv_heads,
        # 0 when it is hidden / heads, so that the planner names hidden_dim in its messages
        "head_dim": 0 if s.head_dim * s.num_heads == s.hidden_dim else s.head_dim,
        "batch_size": _as_int(batch_size, "batch_size"),
        "prompt_len": _as_int(prompt_len, "prompt_len"),
        "max_out_tokens": _as_int(max_out_tokens, "max_out_tokens"),
        "min_out_tokens": _as_int(min_out_tokens, "min_out_tokens"),
        "dtype": dtypes.dtype_code(dtype),
        "mp_size": _as_int(mp_size, "mp_size"),
        "rank": _as_int(rank, "rank"),
        "external_cache": _plan._as_bool(external_cache, "external_cache"),
        "policy": POLICIES[policy],
        "free_bytes": _as_int(free_bytes, "free_bytes"),
        "total_bytes": _as_int(total_bytes, "total_bytes"),
        "weights_bytes": _as_int(weights_bytes, "weights_bytes"),
        "reserve_bytes": _as_opt_int(reserve_bytes, "reserve_bytes"),
        "memory_limit_bytes": _as_opt_int(memory_limit_bytes, "memory_limit_bytes"),
        "memory_fraction": _as_fraction(memory_fraction),
    }


def _device_memory(device: object) -> tuple[int, int]:
    from . import _core

    dev = _core._current_device() if device is None else _as_device(device)
    free, total = _core._memory_info(dev)
    return int(free), int(total)


def _resolve(shape: object, *, batch_size: object, prompt_len: object, max_out_tokens: object,
             min_out_tokens: object, dtype: object, mp_size: object, rank: object, external_cache: object,
             policy: object, free_bytes: object, total_bytes: object, gpu: object, weights_bytes: object,
             reserve_bytes: object, memory_limit_bytes: object, memory_fraction: object,
             device: object) -> tuple[dict[str, Any], dict[str, str]]:
    """The planner's fields and where the memory figures come from; every argument is checked
    before a device is read."""
    from . import presets

    s = _as_shape(shape)
    notes: dict[str, str] = {}
    preset: GpuPreset | None = None
    if gpu is not None:
        if free_bytes is not None or total_bytes is not None or device is not None:
            raise ConfigError("gpu: give either gpu= (a GPU preset) or free_bytes=/total_bytes=/device=, "
                              "not both", argument="gpu")
        preset = gpu if isinstance(gpu, presets.GpuPreset) else presets._gpu_preset(gpu, "gpu")
        if preset.total_mib <= presets.CUDA_OVERHEAD_MIB:
            raise ConfigError(f"gpu: GPU preset {_brief(preset.name)} has total_mib={preset.total_mib}, not more "
                              f"than the {presets.CUDA_OVERHEAD_MIB} MiB the CUDA driver, context and cuBLAS "
                              f"take (presets.CUDA_OVERHEAD_MIB): no memory is left to plan against",
                              argument="gpu")
        free_bytes, total_bytes = preset.free_bytes, preset.total_bytes
        notes["memory"] = (f"GPU preset {preset.name}: total less {presets.CUDA_OVERHEAD_MIB} MiB for the "
                           f"CUDA driver, context and cuBLAS")
        notes["gpu_preset"] = preset.name
    elif device is not None and free_bytes is not None and total_bytes is not None:
        # Both figures given: nothing would be read from the device. With one of them given, the
        # other is read from this device, as from the current one when device= is omitted.
        raise ConfigError("device: give either device= (read its memory) or free_bytes= and total_bytes=, "
                          "not both", argument="device")
    read_device = free_bytes is None or total_bytes is None
    weights_bytes = _as_weights(weights_bytes)
    if weights_bytes is None:
        weights_bytes = "auto" if preset is not None else 0
        if preset is not None and s.num_params is None:
            raise ConfigError(f"weights_bytes: GPU preset {preset.name} plans against the card's whole "
                              f"memory, so the model's weights must be counted: pass weights_bytes= "
                              f"(0 if they live elsewhere) or a ModelShape with num_params",
                              argument="weights_bytes")
    fields = _request_fields(s, batch_size=batch_size, prompt_len=prompt_len, max_out_tokens=max_out_tokens,
                             min_out_tokens=min_out_tokens, dtype=dtype, mp_size=mp_size, rank=rank,
                             external_cache=external_cache, policy=policy,
                             free_bytes=0 if free_bytes is None else free_bytes,
                             total_bytes=1 if total_bytes is None else total_bytes,
                             weights_bytes=0 if weights_bytes == "auto" else weights_bytes,
                             reserve_bytes=reserve_bytes, memory_limit_bytes=memory_limit_bytes,
                             memory_fraction=memory_fraction)
    ordinal = None if device is None else _as_device(device)  # checked once, named in the notes
    _plan._check(fields)  # argument errors before any device is read
    _check_given_memory(fields, free_given=free_bytes is not None, total_given=total_bytes is not None)
    if weights_bytes == "auto":
        if s.num_params is None:
            raise ConfigError("weights_bytes: 'auto' needs the model's parameter count: use a preset or "
                              "ModelShape(..., num_params=N)", argument="weights_bytes")
        fields["weights_bytes"] = s.weights_bytes(dtype, fields["mp_size"])
        mp = fields["mp_size"]
        notes["weights"] = f"{s.num_params:,} parameters x {_elem_size(fields)} B" + (f" / mp {mp}" if mp > 1 else "")
    if read_device:
        try:
            dev_free, dev_total = _device_memory(ordinal)
        except NoCudaDeviceError as exc:
            raise NoCudaDeviceError(
                _joined(exc.message, _missing_figures(free_bytes is None, total_bytes is None)),
                call=exc.call, code=exc.code, name=exc.name, device=exc.device
            ) from None
        fields["free_bytes"] = dev_free if free_bytes is None else fields["free_bytes"]
        fields["total_bytes"] = dev_total if total_bytes is None else fields["total_bytes"]
        notes.setdefault("memory", "device " + ("current" if ordinal is None else str(ordinal)) + ", read now")
        notes.setdefault("device", "current" if ordinal is None else str(ordinal))
    return fields, notes


def _check_given_memory(fields: dict[str, Any], *, free_given: bool, total_given: bool) -> None:
    """The ranges of the memory figures given (the planner's own words), before a device is read
    for one that was not: a wrong figure is named, not a missing device. free_bytes above
    total_bytes is left to the planner, which knows both once the device is read."""
    if fields["weights_bytes"] < 0:
        raise ConfigError(f"weights_bytes: got {fields['weights_bytes']}; it must be a byte count >= 0",
                          argument="weights_bytes")
    if total_given and fields["total_bytes"] <= 0:
        raise ConfigError(f"total_bytes: got {fields['total_bytes']}; it must be a positive byte count",
                          argument="total_bytes")
    if free_given and fields["free_bytes"] < 0:
        bound = f"total_bytes={fields['total_bytes']}" if total_given else "total_bytes"
        raise ConfigError(f"free_bytes: got {fields['free_bytes']}; it must be in [0, {bound}]",
                          argument="free_bytes")


def _as_weights(value: object) -> int | str | None:
    """weights_bytes as given: a byte count (the planner checks its range), 'auto' or None."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, (str, bool)) or not hasattr(type(value), "__index__"):
        raise ConfigError(f"weights_bytes: got {_brief(value)} ({type(value).__name__}); valid: a byte count "
                          f"(an integer >= 0), 'auto' (from the model's num_params) or None",
                          argument="weights_bytes")
    return _as_int(value, "weights_bytes")


def _missing_figures(free_missing: bool, total_missing: bool) -> str:
    """Which memory figures were to be read from the device, and what to pass instead."""
    if free_missing and total_missing:
        return ("free_bytes and total_bytes were not given, so they were to be read from the device: "
                "pass both (or gpu=, a GPU preset) to plan without a GPU.")
    given, missing = ("free_bytes", "total_bytes") if total_missing else ("total_bytes", "free_bytes")
    return (f"{missing} was not given (only {given}), so it was to be read from the device: pass "
            f"{missing}= as well (or gpu=, a GPU preset, instead of {given}=) to plan without a GPU.")


def _joined(message: str, sentence: str) -> str:
    """Two sentences, with one full stop between them."""
    message = message.rstrip()
    return f"{message} {sentence}" if message.endswith(".") else f"{message}. {sentence}"


def _elem_size(fields: dict[str, Any]) -> int:
    return int(dtypes.ITEMSIZE[fields["dtype"]])


_PLAN_DOC_PARAMETERS = """
    Parameters
    ----------
    shape : ModelShape or str
        The model, or a preset name such as ``'llama-2-70b'``.
    batch_size, prompt_len, max_out_tokens, min_out_tokens : int
        The request, as DeepSpeed's GenWorkSpace takes it; ``max_out_tokens`` counts the prompt.
    dtype : str, numpy or torch dtype
        ``'float16'`` (default), ``'bfloat16'`` or ``'float32'``.
    mp_size, rank : int
        Model-parallel size and this process's rank; heads are split across ranks.
    external_cache : bool
        The KV cache lives outside the workspace (default False): the plan has no KV regions.
    policy : {'exact', 'deepspeed'}
        ``'exact'`` (default): consistent units, GQA-aware, aligned regions. ``'deepspeed'``:
        DeepSpeed's numbers, quirks included.
    free_bytes, total_bytes : int, optional
        Device memory to plan against, as free now. With ``gpu`` they come from the GPU preset
        (give neither); otherwise each one omitted is read from ``device`` now, which needs a GPU.
    gpu : str or GpuPreset, optional
        Plan against a GPU preset instead: free = total less the CUDA overhead
        (``presets.CUDA_OVERHEAD_MIB``), less the weights.
    weights_bytes : int, 'auto' or None
        Weights still to be loaded on this device, subtracted from free memory. 'auto': the
        shape's ``num_params`` x the dtype's size / mp_size. None (default): 'auto' with
        ``gpu``, else 0 (free memory read or given after the weights are loaded).
    reserve_bytes, memory_limit_bytes, memory_fraction : optional
        Budget knobs of the exact policy: memory kept free (default 100 MiB up to 1 GiB free,
        500 MiB from 1 GiB + 400 MiB, a ramp between so that the budget never falls as free
        memory grows), a cap in bytes, and a cap as a fraction of free memory (after the weights).
    device : int, optional
        The device to read memory from (default: the current one).
"""

# The Raises sections: plan_workspace refuses a request that does not fit; the two searches
# answer 0 instead.
_RAISES_COMMON = """
    ConfigError
        An invalid argument (the message and ``argument`` name it).
    NoCudaDeviceError
        Memory figures omitted and no GPU to read them from.
"""
_PLAN_DOC_RAISES = """
    Raises
    ------""" + _RAISES_COMMON + """    WorkspaceOOMError
        The request does not fit; it carries the largest batch_size and max_out_tokens that would.
"""
_SEARCH_DOC_RAISES = """
    Raises
    ------""" + _RAISES_COMMON + """
    Nothing that fits is no error: the answer is then 0 (never WorkspaceOOMError).
"""


def plan_workspace(shape: ModelShape | str, *, batch_size: int, prompt_len: int, max_out_tokens: int,
                   min_out_tokens: int = 1, dtype: Any = "float16", mp_size: int = 1, rank: int = 0,
                   external_cache: bool = False, policy: Policy = "exact", free_bytes: int | None = None,
                   total_bytes: int | None = None, gpu: str | GpuPreset | None = None,
                   weights_bytes: Weights = None, reserve_bytes: int | None = None,
                   memory_limit_bytes: int | None = None, memory_fraction: float | None = None,
                   device: int | None = None) -> WorkspacePlan:
    fields, notes = _resolve(shape, batch_size=batch_size, prompt_len=prompt_len, max_out_tokens=max_out_tokens,
                             min_out_tokens=min_out_tokens, dtype=dtype, mp_size=mp_size, rank=rank,
                             external_cache=external_cache, policy=policy, free_bytes=free_bytes,
                             total_bytes=total_bytes, gpu=gpu, weights_bytes=weights_bytes,
                             reserve_bytes=reserve_bytes, memory_limit_bytes=memory_limit_bytes,
                             memory_fraction=memory_fraction, device=device)
    try:
        result = _plan._plan(fields)
    except WorkspaceOOMError as exc:
        hint = _mp_hint(_as_shape(shape), fields) if "weights" in notes else None
        if hint is None:
            raise
        raise WorkspaceOOMError(f"{exc.message}; {hint}", requested_bytes=exc.requested_bytes,
                                free_bytes=exc.free_bytes, total_bytes=exc.total_bytes,
                                budget_bytes=exc.budget_bytes, max_batch_size=exc.max_batch_size,
                                max_out_tokens=exc.max_out_tokens) from None
    return WorkspacePlan._from_result(fields, result, notes, shape=_as_shape(shape))


# Past this many heads (no real model's) the mp_size hint is left out: finding the divisors of
# the heads count takes up to its square root in steps.
_MP_HINT_MOST_HEADS = 1 << 40


def _divisors(n: int) -> list[int]:
    """The divisors of n (n >= 1), ascending."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def _mp_hint(shape: ModelShape, fields: dict[str, Any]) -> str | None:
    """For weights (from the parameter count) that take all of free memory or more: the smallest
    mp_size that splits them below it, or the most the heads allow."""
    if shape.num_params is None or fields["weights_bytes"] < fields["free_bytes"]:
        return None
    deepspeed = fields["policy"] == POLICIES["deepspeed"]  # its KV cache splits num_heads only
    most = shape.num_heads if deepspeed else math.gcd(shape.num_heads, shape.num_kv_heads)
    if most > _MP_HINT_MOST_HEADS:
        return None
    for mp in _divisors(most):  # mp_size must divide every head count it splits
        if mp <= fields["mp_size"]:
            continue
        per_rank = int(_plan._weights_bytes(shape.num_params, fields["dtype"], mp))
        if per_rank < fields["free_bytes"]:
            return f"mp_size={mp} would put {human_bytes(per_rank)} of weights on each GPU"
    per_rank = int(_plan._weights_bytes(shape.num_params, fields["dtype"], most))
    heads = (f"num_heads={shape.num_heads}" if deepspeed else
             f"num_heads={shape.num_heads} and num_kv_heads={shape.num_kv_heads}")
    if most <= fields["mp_size"]:
        return (f"no larger mp_size divides {heads}: it would take a device with more memory, or "
                f"weights in a smaller dtype")
    return (f"even mp_size={most} (the most that divides {heads}) leaves {human_bytes(per_rank)} "
            f"of weights on each GPU")


plan_workspace.__doc__ = ("Plans a workspace without allocating anything.\n" + _PLAN_DOC_PARAMETERS
                          + _PLAN_DOC_RAISES)


def max_batch_size(shape: ModelShape | str, *, max_out_tokens: int, prompt_len: int = 1,
                   min_out_tokens: int = 1, dtype: Any = "float16", mp_size: int = 1, rank: int = 0,
                   external_cache: bool = False, policy: Policy = "exact", free_bytes: int | None = None,
                   total_bytes: int | None = None, gpu: str | GpuPreset | None = None,
                   weights_bytes: Weights = None, reserve_bytes: int | None = None,
                   memory_limit_bytes: int | None = None, memory_fraction: float | None = None,
                   device: int | None = None) -> int:
    fields, _ = _resolve(shape, batch_size=1, prompt_len=prompt_len, max_out_tokens=max_out_tokens,
                         min_out_tokens=min_out_tokens, dtype=dtype, mp_size=mp_size, rank=rank,
                         external_cache=external_cache, policy=policy, free_bytes=free_bytes,
                         total_bytes=total_bytes, gpu=gpu, weights_bytes=weights_bytes,
                         reserve_bytes=reserve_bytes, memory_limit_bytes=memory_limit_bytes,
                         memory_fraction=memory_fraction, device=device)
    return int(_plan._max_batch_size(fields))


max_batch_size.__doc__ = (
    "The largest batch_size whose plan holds every one of ``max_out_tokens`` tokens (0: none).\n\n"
    "    Takes plan_workspace's arguments, without batch_size (prompt_len defaults to 1).\n"
    + _PLAN_DOC_PARAMETERS + _SEARCH_DOC_RAISES)


def max_out_tokens_for(shape: ModelShape | str, *, batch_size: int, prompt_len: int = 1,
                       min_out_tokens: int = 1, dtype: Any = "float16", mp_size: int = 1, rank: int = 0,
                       external_cache: bool = False, policy: Policy = "exact", free_bytes: int | None = None,
                       total_bytes: int | None = None, gpu: str | GpuPreset | None = None,
                       weights_bytes: Weights = None, reserve_bytes: int | None = None,
                       memory_limit_bytes: int | None = None, memory_fraction: float | None = None,
                       device: int | None = None) -> int:
    fields, _ = _resolve(shape, batch_size=batch_size, prompt_len=prompt_len,
                         max_out_tokens=max(_as_int(prompt_len, "prompt_len"),
                                            _as_int(min_out_tokens, "min_out_tokens"), 1),
                         min_out_tokens=min_out_tokens, dtype=dtype, mp_size=mp_size, rank=rank,
                         external_cache=external_cache, policy=policy, free_bytes=free_bytes,
                         total_bytes=total_bytes, gpu=gpu, weights_bytes=weights_bytes,
                         reserve_bytes=reserve_bytes, memory_limit_bytes=memory_limit_bytes,
                         memory_fraction=memory_fraction, device=device)
    return int(_plan._max_out_tokens_for(fields))


def _context_max_out_tokens(shape: ModelShape, *, batch_size: int, prompt_len: int, dtype: Any,
                            free_bytes: int, total_bytes: int, allocation_granularity: int) -> int:
    """max_out_tokens_for as a context's gen_workspace plans it: the request its gen_workspace
    makes (_request_fields, defaults for the rest), its memory figures and its mapping's
    granularity, to which the workspace is rounded up."""
    fields = _request_fields(shape, batch_size=batch_size, prompt_len=prompt_len,
                             max_out_tokens=max(_as_int(prompt_len, "prompt_len"), 1), dtype=dtype,
                             free_bytes=free_bytes, total_bytes=total_bytes)
    fields["allocation_granularity"] = _as_int(allocation_granularity, "allocation_granularity")
    return int(_plan._max_out_tokens_for(fields))


max_out_tokens_for.__doc__ = (
    "The most tokens a batch holds: the largest max_out_tokens whose plan holds all of them for\n"
    "    ``batch_size`` sequences (0: not even max(prompt_len, min_out_tokens)).\n\n"
    "    Takes plan_workspace's arguments, without max_out_tokens (prompt_len defaults to 1).\n"
    + _PLAN_DOC_PARAMETERS + _SEARCH_DOC_RAISES)

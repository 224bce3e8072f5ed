"""Workspace planning in Python: argument coercion over the C++ planner (works without a GPU)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import NamedTuple

from . import dtypes
from .errors import ConfigError

__all__ = ["ModelShape", "Region", "WorkspacePlan", "plan_workspace", "human_bytes"]

POLICIES = {"exact": 0, "deepspeed": 1}


def _as_int(value, argument: str, *, optional: bool = False):
    if value is None and optional:
        return None
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{argument}: got {value!r}; it must be an integer", argument=argument)
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(f"{argument}: got {value!r} ({type(value).__name__}); it must be an integer",
                          argument=argument) from None


def _as_bool(value, argument: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{argument}: got {value!r}; it must be True or False", argument=argument)
    return value


def human_bytes(n: int) -> str:
    """1536 -> '1.50 KiB'; binary units."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class ModelShape:
    """The attention shape of a transformer: layers, heads, hidden size, KV heads (GQA/MQA)."""

    num_layers: int
    num_heads: int
    hidden_dim: int
    num_kv_heads: int | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_heads", "hidden_dim"):
            value = _as_int(getattr(self, name), name)
            if value < 1:
                raise ConfigError(f"{name}: got {value}; it must be a positive integer", argument=name)
            object.__setattr__(self, name, value)
        kv = self.num_kv_heads
        kv = self.num_heads if kv is None else _as_int(kv, "num_kv_heads")
        if kv < 1:
            raise ConfigError(f"num_kv_heads: got {kv}; it must be a positive integer dividing "
                              f"num_heads={self.num_heads}", argument="num_kv_heads")
        object.__setattr__(self, "num_kv_heads", kv)

    @classmethod
    def from_preset(cls, name: str) -> "ModelShape":
        """The shape of a built-in model preset, e.g. ``ModelShape.from_preset('llama-2-70b')``."""
        from .presets import model_preset

        return model_preset(name)

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads


def _as_shape(shape) -> ModelShape:
    if isinstance(shape, ModelShape):
        return shape
    if isinstance(shape, str):
        return ModelShape.from_preset(shape)
    raise ConfigError(f"shape: got {shape!r}; pass an inferctx.ModelShape or a preset name "
                      f"such as 'llama-2-7b'", argument="shape")


def _request_fields(shape, *, batch_size, prompt_len, max_out_tokens, min_out_tokens=1,
                    dtype="float16", mp_size=1, rank=0, external_cache=False, policy="exact",
                    free_bytes, total_bytes, reserve_bytes=None, memory_limit_bytes=None,
                    memory_fraction=None) -> dict:
    """Coerces planning arguments into the dict the compiled planner takes."""
    shape = _as_shape(shape)
    if policy not in POLICIES:
        raise ConfigError(f"policy: got {policy!r}; valid: 'exact' (default) or 'deepspeed'",
                          argument="policy")
    if memory_fraction is not None:
        if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)):
            raise ConfigError(f"memory_fraction: got {memory_fraction!r}; it must be a number in "
                              f"(0, 1], a fraction of free memory", argument="memory_fraction")
        memory_fraction = float(memory_fraction)
        if math.isnan(memory_fraction) or not 0.0 < memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction: got {memory_fraction}; it must be in (0, 1], "
                              f"a fraction of free memory", argument="memory_fraction")
    return {
        "num_layers": shape.num_layers,
        "num_heads": shape.num_heads,
        "hidden_dim": shape.hidden_dim,
        "num_kv_heads": shape.num_kv_heads,
        "batch_size": _as_int(batch_size, "batch_size"),
        "prompt_len": _as_int(prompt_len, "prompt_len"),
        "max_out_tokens": _as_int(max_out_tokens, "max_out_tokens"),
        "min_out_tokens": _as_int(min_out_tokens, "min_out_tokens"),
        "dtype": dtypes.dtype_code(dtype),
        "mp_size": _as_int(mp_size, "mp_size"),
        "rank": _as_int(rank, "rank"),
        "external_cache": _as_bool(external_cache, "external_cache"),
        "policy": POLICIES[policy],
        "free_bytes": _as_int(free_bytes, "free_bytes"),
        "total_bytes": _as_int(total_bytes, "total_bytes"),
        "reserve_bytes": _as_int(reserve_bytes, "reserve_bytes", optional=True),
        "memory_limit_bytes": _as_int(memory_limit_bytes, "memory_limit_bytes", optional=True),
        "memory_fraction": memory_fraction,
    }


class Region(NamedTuple):
    """One region of the workspace: name, byte offset, byte size."""

    name: str
    offset: int
    size: int


class WorkspacePlan:
    """The planner's answer: max_tokens, workspace_bytes, regions, budget, and what bound it."""

    __slots__ = ("_fields", "_result", "shape", "regions")

    def __init__(self, fields: dict, result: dict):
        self._fields = dict(fields)
        self._result = dict(result)
        self.shape = ModelShape(fields["num_layers"], fields["num_heads"], fields["hidden_dim"],
                                fields["num_kv_heads"])
        self.regions = tuple(Region(*r) for r in result["regions"])

    @classmethod
    def _from_result(cls, fields: dict, result: dict) -> "WorkspacePlan":
        return cls(fields, result)

    # -- the request -------------------------------------------------------------------
    batch_size = property(lambda self: self._fields["batch_size"])
    prompt_len = property(lambda self: self._fields["prompt_len"])
    max_out_tokens = property(lambda self: self._fields["max_out_tokens"])
    min_out_tokens = property(lambda self: self._fields["min_out_tokens"])
    mp_size = property(lambda self: self._fields["mp_size"])
    rank = property(lambda self: self._fields["rank"])
    external_cache = property(lambda self: self._fields["external_cache"])
    free_bytes = property(lambda self: self._fields["free_bytes"])
    total_bytes = property(lambda self: self._fields["total_bytes"])

    @property
    def dtype(self) -> str:
        return dtypes.NAMES[self._fields["dtype"]]

    @property
    def policy(self) -> str:
        return next(k for k, v in POLICIES.items() if v == self._fields["policy"])

    # -- the answer --------------------------------------------------------------------
    max_tokens = property(lambda self: self._result["max_tokens"])
    workspace_bytes = property(lambda self: self._result["workspace_bytes"])
    budget_bytes = property(lambda self: self._result["budget_bytes"])
    reserve_bytes = property(lambda self: self._result["reserve_bytes"])
    budget_limit = property(lambda self: self._result["budget_limit"])
    bound_by = property(lambda self: self._result["bound_by"])
    elem_size = property(lambda self: self._result["elem_size"])
    head_dim = property(lambda self: self._result["head_dim"])
    head_dim_padded = property(lambda self: self._result["head_dim_padded"])
    heads_per_rank = property(lambda self: self._result["heads_per_rank"])
    kv_heads_per_rank = property(lambda self: self._result["kv_heads_per_rank"])
    activations_offset = property(lambda self: self._result["activations_offset"])
    activations_bytes = property(lambda self: self._result["activations_bytes"])
    kv_cache_offset = property(lambda self: self._result["kv_cache_offset"])
    kv_cache_bytes = property(lambda self: self._result["kv_cache_bytes"])
    kv_layer_stride = property(lambda self: self._result["kv_layer_stride"])
    kv_value_offset = property(lambda self: self._result["kv_value_offset"])
    kv_tensor_bytes = property(lambda self: self._result["kv_tensor_bytes"])
    attention_scores_offset = property(lambda self: self._result["attention_scores_offset"])
    attention_scores_bytes = property(lambda self: self._result["attention_scores_bytes"])

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """Shape of one K (or V) tensor: [batch, kv_heads/mp, max_tokens, head_dim_padded]."""
        return (self.batch_size, self.kv_heads_per_rank, self.max_tokens, self.head_dim_padded)

    def to_dict(self) -> dict:
        """Plain data: the request, the answer and every region (JSON-serialisable)."""
        request = {k: v for k, v in self._fields.items() if k not in ("dtype", "policy")}
        request["dtype"] = self.dtype
        request["policy"] = self.policy
        answer = {k: v for k, v in self._result.items() if k != "regions"}
        answer["regions"] = [r._asdict() for r in self.regions]
        return {"request": request, "plan": answer}

    def __eq__(self, other):
        if not isinstance(other, WorkspacePlan):
            return NotImplemented
        return self._fields == other._fields and self._result == other._result

    def __repr__(self):
        return (f"WorkspacePlan(max_tokens={self.max_tokens}, workspace_bytes={self.workspace_bytes}, "
                f"policy={self.policy!r}, dtype={self.dtype!r}, bound_by={self.bound_by!r})")

    def __str__(self):
        s = self.shape
        kv_note = f"{s.num_kv_heads} KV" if s.num_kv_heads != s.num_heads else "MHA"
        why = {"reserve": f"free - reserve {human_bytes(self.reserve_bytes)}",
               "memory_limit": "memory_limit_bytes",
               "memory_fraction": f"memory_fraction={self._fields['memory_fraction']} of free"}
        bound = ("max_out_tokens" if self.bound_by == "max_out_tokens"
                 else f"memory (budget {human_bytes(self.budget_bytes)})")
        lines = [
            f"inferctx workspace plan  (policy {self.policy}, {self.dtype})",
            f"  model      {s.num_layers} layers, {s.num_heads} heads ({kv_note}), hidden {s.hidden_dim}, "
            f"head {self.head_dim} (padded {self.head_dim_padded})",
            f"  request    batch {self.batch_size}, prompt {self.prompt_len}, max_out_tokens "
            f"{self.max_out_tokens}, min_out_tokens {self.min_out_tokens}, mp {self.mp_size} "
            f"(rank {self.rank}){', external KV cache' if self.external_cache else ''}",
            f"  memory     free {human_bytes(self.free_bytes)} of {human_bytes(self.total_bytes)}; "
            f"budget {human_bytes(self.budget_bytes)} ({why[self.budget_limit]})",
            f"  max tokens {self.max_tokens}  (bound by {bound})",
            f"  workspace  {human_bytes(self.workspace_bytes)}  ({self.workspace_bytes:,} bytes)",
            "",
            f"  {'region':<34}{'offset':>18}{'size':>14}",
        ]

        def row(name, offset, size):
            lines.append(f"  {name:<34}{offset:>18,}{human_bytes(size):>14}")

        row("activations", self.activations_offset, self.activations_bytes)
        if self.kv_cache_bytes:
            b, h, t, d = self.kv_shape
            row(f"kv_cache ({s.num_layers} layers x K,V)", self.kv_cache_offset, self.kv_cache_bytes)
            lines.append(f"    each K or V [{b}, {h}, {t}, {d}] {self.dtype}: "
                         f"{human_bytes(self.kv_tensor_bytes)}")
        else:
            lines.append("  kv_cache                          (external)")
        row("attention_scores", self.attention_scores_offset, self.attention_scores_bytes)
        return "\n".join(lines)


def _device_memory(device) -> tuple[int, int]:
    from . import _core

    dev = _core._current_device() if device is None else _as_int(device, "device")
    return _core._memory_info(dev)


def plan_workspace(shape, *, batch_size, prompt_len, max_out_tokens, min_out_tokens=1,
                   dtype="float16", mp_size=1, rank=0, external_cache=False, policy="exact",
                   free_bytes=None, total_bytes=None, reserve_bytes=None, memory_limit_bytes=None,
                   memory_fraction=None, device=None) -> WorkspacePlan:
    """Plans a workspace without allocating anything.

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
    policy : {'exact', 'deepspeed'}
        ``'exact'`` (default): consistent units, GQA-aware, aligned regions. ``'deepspeed'``:
        DeepSpeed's numbers, quirks included.
    free_bytes, total_bytes : int, optional
        Device memory to plan against; read from the device when omitted (required without a GPU).
    reserve_bytes, memory_limit_bytes, memory_fraction : optional
        Budget knobs of the exact policy: memory kept free (default 500 MiB, 100 MiB when
        free <= 1 GiB), a cap in bytes, and a cap as a fraction of *free* memory.

    Raises
    ------
    ConfigError
        An invalid argument (the message names it).
    WorkspaceOOMError
        The request does not fit; it carries the largest batch_size and max_out_tokens that would.
    NoCudaDeviceError
        Memory figures omitted and no GPU to read them from.
    """
    if free_bytes is None or total_bytes is None:
        from .errors import NoCudaDeviceError

        try:
            dev_free, dev_total = _device_memory(device)
        except NoCudaDeviceError as exc:
            raise NoCudaDeviceError(
                f"{exc.message}; free_bytes and total_bytes were not given, so they were to be read "
                f"from the device. Pass free_bytes= and total_bytes= (or a GPU preset) to plan "
                f"without a GPU.", call=exc.call, code=exc.code, name=exc.name, device=exc.device
            ) from None
        free_bytes = dev_free if free_bytes is None else free_bytes
        total_bytes = dev_total if total_bytes is None else total_bytes
    fields = _request_fields(shape, batch_size=batch_size, prompt_len=prompt_len,
                             max_out_tokens=max_out_tokens, min_out_tokens=min_out_tokens,
                             dtype=dtype, mp_size=mp_size, rank=rank, external_cache=external_cache,
                             policy=policy, free_bytes=free_bytes, total_bytes=total_bytes,
                             reserve_bytes=reserve_bytes, memory_limit_bytes=memory_limit_bytes,
                             memory_fraction=memory_fraction)
    from . import _core

    return WorkspacePlan(fields, _core._plan(fields))

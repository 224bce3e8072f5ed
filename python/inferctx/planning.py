"""Workspace planning in Python: argument coercion over the C++ planner (works without a GPU).

The planner is the compiled module inferctx._plan, pure host code: planning loads no CUDA
library. Only reading a real device's memory (free_bytes and total_bytes omitted) loads the
GPU module inferctx._core.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Union, overload

from . import _plan, dtypes
from .errors import ConfigError, NoCudaDeviceError, WorkspaceOOMError, _brief

if TYPE_CHECKING:
    from .presets import GpuPreset

__all__ = ["ModelShape", "Region", "WorkspacePlan", "plan_workspace", "max_batch_size",
           "max_out_tokens_for", "human_bytes"]

POLICIES = {"exact": 0, "deepspeed": 1}
INT64_MAX = (1 << 63) - 1

Policy = Literal["exact", "deepspeed"]
Weights = Union[int, Literal["auto"], None]


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


class ModelShape:
    """The attention shape of a transformer: layers, heads, hidden size, KV heads (GQA/MQA).

    Parameters
    ----------
    num_layers, num_heads, hidden_dim : int
    num_kv_heads : int, optional
        KV heads (GQA/MQA); default num_heads.
    head_dim : int, optional
        Size of one head; default hidden_dim / num_heads, which must then be whole. Give it for
        models whose heads x head_dim differs from hidden_dim (Gemma-7B: 16 heads of 256, hidden 3072).
    num_params : int, optional
        The model's parameter count, from which plan_workspace(weights_bytes="auto") works out
        the weights' bytes; the presets carry it.
    """

    __slots__ = ("num_layers", "num_heads", "hidden_dim", "num_kv_heads", "head_dim", "num_params")
    num_layers: int
    num_heads: int
    hidden_dim: int
    num_kv_heads: int
    head_dim: int
    num_params: int | None

    def __init__(self, num_layers: int, num_heads: int, hidden_dim: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, num_params: int | None = None) -> None:
        layers = _as_int(num_layers, "num_layers")
        heads = _as_int(num_heads, "num_heads")
        hidden = _as_int(hidden_dim, "hidden_dim")
        for name, value in (("num_layers", layers), ("num_heads", heads), ("hidden_dim", hidden)):
            if value < 1:
                raise ConfigError(f"{name}: got {value}; it must be a positive integer", argument=name)
        kv = heads if num_kv_heads is None else _as_int(num_kv_heads, "num_kv_heads")
        if kv < 1:
            raise ConfigError(f"num_kv_heads: got {kv}; it must be a positive integer dividing "
                              f"num_heads={heads}", argument="num_kv_heads")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"hidden_dim: hidden_dim={hidden} is not divisible by num_heads={heads}; "
                                  f"give head_dim= (the size of one head) for a model whose heads do not "
                                  f"split hidden_dim evenly", argument="hidden_dim")
            head = hidden // heads
        else:
            head = _as_int(head_dim, "head_dim")
            if head < 1:
                raise ConfigError(f"head_dim: got {head}; it must be a positive integer", argument="head_dim")
        params = _as_opt_int(num_params, "num_params", minimum=0)
        values: tuple[tuple[str, int | None], ...] = (
            ("num_layers", layers), ("num_heads", heads), ("hidden_dim", hidden),
            ("num_kv_heads", kv), ("head_dim", head), ("num_params", params))
        for name, field in values:
            object.__setattr__(self, name, field)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ModelShape is immutable: make a new one instead of setting {name}")

    def _key(self) -> tuple[int | None, ...]:
        return (self.num_layers, self.num_heads, self.hidden_dim, self.num_kv_heads, self.head_dim,
                self.num_params)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelShape):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        extra = "" if self.num_params is None else f", num_params={self.num_params}"
        return (f"ModelShape(num_layers={self.num_layers}, num_heads={self.num_heads}, "
                f"hidden_dim={self.hidden_dim}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}{extra})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (ModelShape, self._key())

    def replace(self, **changes: Any) -> ModelShape:
        """A copy with some fields changed, e.g. ``shape.replace(num_kv_heads=8)``."""
        fields: dict[str, Any] = dict(zip(self.__slots__, self._key()))
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"ModelShape has no fields {sorted(unknown)}")
        fields.update(changes)
        return ModelShape(**fields)

    @classmethod
    def from_preset(cls, name: str) -> ModelShape:
        """The shape of a built-in model preset, e.g. ``ModelShape.from_preset('llama-2-70b')``."""
        from .presets import model_preset

        return model_preset(name)

    def weights_bytes(self, dtype: Any = "float16", mp_size: int = 1) -> int:
        """Bytes of the model's weights in ``dtype`` on one of ``mp_size`` ranks (an even split)."""
        if self.num_params is None:
            raise ConfigError("weights_bytes: this ModelShape has no num_params, so its weights' bytes are "
                              "unknown; give ModelShape(..., num_params=N) or pass weights_bytes=",
                              argument="weights_bytes")
        return int(_plan._weights_bytes(self.num_params, dtypes.dtype_code(dtype),
                                        _as_int(mp_size, "mp_size")))


def _as_shape(shape: object) -> ModelShape:
    if isinstance(shape, ModelShape):
        return shape
    if isinstance(shape, str):
        return ModelShape.from_preset(shape)
    raise ConfigError(f"shape: got {_brief(shape)}; pass an inferctx.ModelShape or a preset name "
                      f"such as 'llama-2-7b'", argument="shape")


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


class Region(NamedTuple):
    """One region of the workspace: name, byte offset, byte size."""

    name: str
    offset: int
    size: int


class Regions(Sequence[Region]):
    """The regions of a plan in address order, computed on access (a plan stores no per-layer list):
    activations, each layer's K then V (none with an external cache), attention scores."""

    __slots__ = ("_result", "_num_layers", "_len")

    def __init__(self, result: dict[str, Any], num_layers: int) -> None:
        self._result = result
        self._num_layers = num_layers
        self._len = int(_plan._region_count(result, num_layers))

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> Region: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Region, ...]: ...

    def __getitem__(self, index: int | slice) -> Region | tuple[Region, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._len)))
        i = operator.index(index)  # TypeError for a non-integer, as a sequence raises
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"region index {index} out of range for {self._len} regions")
        return Region(*_plan._region(self._result, self._num_layers, i))

    def __iter__(self) -> Iterator[Region]:
        for i in range(self._len):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Regions):
            return self._len == other._len and all(a == b for a, b in zip(self, other))
        if isinstance(other, (tuple, list)):
            return len(other) == self._len and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"<{self._len} regions: {', '.join(r.name for r in self[:3])}{', ...' if self._len > 3 else ''}>"


class WorkspacePlan:
    """The planner's answer: max_tokens, workspace_bytes, regions, budget, and what bound it."""

    __slots__ = ("_fields", "_result", "_notes", "shape", "regions")

    def __init__(self, fields: dict[str, Any], result: dict[str, Any], notes: dict[str, str] | None = None) -> None:
        self._fields = dict(fields)
        self._result = dict(result)
        self._notes = dict(notes or {})
        self.shape = ModelShape(fields["num_layers"], fields["num_heads"], fields["hidden_dim"],
                                fields["num_kv_heads"] or fields["num_heads"],
                                head_dim=fields["head_dim"] or None)
        self.regions = Regions(self._result, self.shape.num_layers)

    @classmethod
    def _from_result(cls, fields: dict[str, Any], result: dict[str, Any],
                     notes: dict[str, str] | None = None) -> WorkspacePlan:
        return cls(fields, result, notes)

    # -- the request -------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self._fields["batch_size"])

    @property
    def prompt_len(self) -> int:
        return int(self._fields["prompt_len"])

    @property
    def max_out_tokens(self) -> int:
        return int(self._fields["max_out_tokens"])

    @property
    def min_out_tokens(self) -> int:
        return int(self._fields["min_out_tokens"])

    @property
    def mp_size(self) -> int:
        return int(self._fields["mp_size"])

    @property
    def rank(self) -> int:
        return int(self._fields["rank"])

    @property
    def external_cache(self) -> bool:
        return bool(self._fields["external_cache"])

    @property
    def free_bytes(self) -> int:
        """Free device memory the request gave (or that was read), weights not yet subtracted."""
        return int(self._fields["free_bytes"])

    @property
    def total_bytes(self) -> int:
        return int(self._fields["total_bytes"])

    @property
    def weights_bytes(self) -> int:
        """Bytes of weights still to be loaded, subtracted from free_bytes (0: none counted)."""
        return int(self._fields["weights_bytes"])

    @property
    def dtype(self) -> str:
        return dtypes.NAMES[self._fields["dtype"]]

    @property
    def policy(self) -> str:
        return next(k for k, v in POLICIES.items() if v == self._fields["policy"])

    @property
    def memory_source(self) -> str:
        """Where free_bytes and total_bytes come from: 'given', a GPU preset, or a device read now."""
        return self._notes.get("memory", "given")

    @property
    def weights_source(self) -> str:
        """What weights_bytes is: 'none' (0), 'given', or the parameter count it comes from."""
        return self._notes.get("weights", "given" if self.weights_bytes else "none")

    # -- the answer --------------------------------------------------------------------
    def _r(self, key: str) -> int:
        return int(self._result[key])

    @property
    def max_tokens(self) -> int:
        return self._r("max_tokens")

    @property
    def workspace_bytes(self) -> int:
        return self._r("workspace_bytes")

    @property
    def planned_free_bytes(self) -> int:
        """free_bytes - weights_bytes: the free memory the budget is cut from."""
        return self._r("planned_free_bytes")

    @property
    def budget_bytes(self) -> int:
        return self._r("budget_bytes")

    @property
    def reserve_bytes(self) -> int:
        return self._r("reserve_bytes")

    @property
    def budget_limit(self) -> str:
        return str(self._result["budget_limit"])

    @property
    def bound_by(self) -> str:
        return str(self._result["bound_by"])

    @property
    def elem_size(self) -> int:
        return self._r("elem_size")

    @property
    def head_dim(self) -> int:
        """The head size the plan sizes with (hidden / heads under the deepspeed policy)."""
        return self._r("head_dim")

    @property
    def head_dim_padded(self) -> int:
        return self._r("head_dim_padded")

    @property
    def heads_per_rank(self) -> int:
        return self._r("heads_per_rank")

    @property
    def kv_heads_per_rank(self) -> int:
        return self._r("kv_heads_per_rank")

    @property
    def activations_offset(self) -> int:
        return self._r("activations_offset")

    @property
    def activations_bytes(self) -> int:
        return self._r("activations_bytes")

    @property
    def kv_cache_offset(self) -> int:
        return self._r("kv_cache_offset")

    @property
    def kv_cache_bytes(self) -> int:
        return self._r("kv_cache_bytes")

    @property
    def kv_layer_stride(self) -> int:
        return self._r("kv_layer_stride")

    @property
    def kv_value_offset(self) -> int:
        return self._r("kv_value_offset")

    @property
    def kv_tensor_bytes(self) -> int:
        return self._r("kv_tensor_bytes")

    @property
    def attention_scores_offset(self) -> int:
        return self._r("attention_scores_offset")

    @property
    def attention_scores_bytes(self) -> int:
        return self._r("attention_scores_bytes")

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """Shape of one K (or V) tensor: [batch, kv_heads/mp, max_tokens, head_dim_padded]."""
        return (self.batch_size, self.kv_heads_per_rank, self.max_tokens, self.head_dim_padded)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable): the request, the answer, where the memory figures come
        from. ``plan.regions`` lists activations, kv_cache (all layers: layer l's K at
        kv_cache_offset + l * kv_layer_stride, its V kv_value_offset after) and attention_scores."""
        request = {k: v for k, v in self._fields.items() if k not in ("dtype", "policy")}
        request["dtype"] = self.dtype
        request["policy"] = self.policy
        request["head_dim"] = self.shape.head_dim
        answer = dict(self._result)
        answer["regions"] = [
            {"name": "activations", "offset": self.activations_offset, "size": self.activations_bytes},
            {"name": "kv_cache", "offset": self.kv_cache_offset, "size": self.kv_cache_bytes},
            {"name": "attention_scores", "offset": self.attention_scores_offset,
             "size": self.attention_scores_bytes},
        ]
        return {"request": request, "plan": answer,
                "sources": {"memory": self.memory_source, "weights": self.weights_source}}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkspacePlan):
            return NotImplemented
        return self._fields == other._fields and self._result == other._result

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"WorkspacePlan(max_tokens={self.max_tokens}, workspace_bytes={self.workspace_bytes}, "
                f"policy={self.policy!r}, dtype={self.dtype!r}, bound_by={self.bound_by!r})")

    def __str__(self) -> str:
        s = self.shape
        kv_note = f"{s.num_kv_heads} KV" if s.num_kv_heads != s.num_heads else "MHA"
        why = {"reserve": f"free - reserve {human_bytes(self.reserve_bytes)}",
               "memory_limit": "memory_limit_bytes",
               "memory_fraction": f"memory_fraction={self._fields['memory_fraction']} of free"}
        bound = ("max_out_tokens" if self.bound_by == "max_out_tokens"
                 else f"memory (budget {human_bytes(self.budget_bytes)})")
        if self.weights_bytes:
            weights = f"{human_bytes(self.weights_bytes)} still to load ({self.weights_source})"
            planned = f"{human_bytes(self.planned_free_bytes)} free after the weights"
        else:
            weights = ("none counted: free memory is taken as read with the weights already loaded"
                       if self.weights_source == "none" else self.weights_source)
            planned = f"{human_bytes(self.planned_free_bytes)} free"
        lines = [
            f"inferctx workspace plan  (policy {self.policy}, {self.dtype})",
            f"  model      {s.num_layers} layers, {s.num_heads} heads ({kv_note}), hidden {s.hidden_dim}, "
            f"head {self.head_dim} (padded {self.head_dim_padded})",
            f"  request    batch {self.batch_size}, prompt {self.prompt_len}, max_out_tokens "
            f"{self.max_out_tokens}, min_out_tokens {self.min_out_tokens}, mp {self.mp_size} "
            f"(rank {self.rank}){', external KV cache' if self.external_cache else ''}",
            f"  memory     free {human_bytes(self.free_bytes)} of {human_bytes(self.total_bytes)} "
            f"({self.memory_source})",
            f"  weights    {weights}",
            f"  planned    against {planned}; budget {human_bytes(self.budget_bytes)} "
            f"({why[self.budget_limit]})",
            f"  max tokens {self.max_tokens}  (bound by {bound})",
            f"  workspace  {human_bytes(self.workspace_bytes)}  ({self.workspace_bytes:,} bytes)",
            "",
            f"  {'region':<34}{'offset':>18}{'size':>14}",
        ]

        def row(name: str, offset: int, size: int) -> None:
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


def _device_memory(device: object) -> tuple[int, int]:
    from . import _core

    dev = _core._current_device() if device is None else _as_int(device, "device", minimum=0)
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
        preset = gpu if isinstance(gpu, presets.GpuPreset) else presets.gpu_preset(gpu)  # type: ignore[arg-type]
        free_bytes, total_bytes = preset.free_bytes, preset.total_bytes
        notes["memory"] = (f"GPU preset {preset.name}: total less {presets.CUDA_OVERHEAD_MIB} MiB for the "
                           f"CUDA driver, context and cuBLAS")
    elif device is not None and (free_bytes is not None or total_bytes is not None):
        raise ConfigError("device: give either device= (read its memory) or free_bytes= and total_bytes=, "
                          "not both", argument="device")
    read_device = free_bytes is None or total_bytes is None
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
    if device is not None:
        _as_int(device, "device", minimum=0)
    _plan._check(fields)  # argument errors before any device is read
    if isinstance(weights_bytes, str):
        if weights_bytes != "auto":
            raise ConfigError(f"weights_bytes: got {_brief(weights_bytes)}; valid: a byte count, 'auto' "
                              f"(from the model's num_params) or None", argument="weights_bytes")
        if s.num_params is None:
            raise ConfigError("weights_bytes: 'auto' needs the model's parameter count: use a preset or "
                              "ModelShape(..., num_params=N)", argument="weights_bytes")
        fields["weights_bytes"] = s.weights_bytes(dtype, fields["mp_size"])
        mp = fields["mp_size"]
        notes["weights"] = f"{s.num_params:,} parameters x {_elem_size(fields)} B" + (f" / mp {mp}" if mp > 1 else "")
    if read_device:
        try:
            dev_free, dev_total = _device_memory(device)
        except NoCudaDeviceError as exc:
            raise NoCudaDeviceError(
                f"{exc.message}; free_bytes and total_bytes were not given, so they were to be read "
                f"from the device. Pass free_bytes= and total_bytes= (or gpu=, a GPU preset) to plan "
                f"without a GPU.", call=exc.call, code=exc.code, name=exc.name, device=exc.device
            ) from None
        fields["free_bytes"] = dev_free if free_bytes is None else fields["free_bytes"]
        fields["total_bytes"] = dev_total if total_bytes is None else fields["total_bytes"]
        notes.setdefault("memory", "device " + ("current" if device is None else str(device)) + ", read now")
    return fields, notes


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
    policy : {'exact', 'deepspeed'}
        ``'exact'`` (default): consistent units, GQA-aware, aligned regions. ``'deepspeed'``:
        DeepSpeed's numbers, quirks included.
    free_bytes, total_bytes : int, optional
        Device memory to plan against, as free now. Omitted (with ``gpu``): read from
        ``device`` now, which needs a GPU.
    gpu : str or GpuPreset, optional
        Plan against a GPU preset instead: free = total less the CUDA overhead
        (``presets.CUDA_OVERHEAD_MIB``), less the weights.
    weights_bytes : int, 'auto' or None
        Weights still to be loaded on this device, subtracted from free memory. 'auto': the
        shape's ``num_params`` x the dtype's size / mp_size. None (default): 'auto' with
        ``gpu``, else 0 (free memory read or given after the weights are loaded).
    reserve_bytes, memory_limit_bytes, memory_fraction : optional
        Budget knobs of the exact policy: memory kept free (default 100 MiB up to 1 GiB free,
        500 MiB from 1.39 GiB, a ramp between so that the budget never falls as free memory
        grows), a cap in bytes, and a cap as a fraction of free memory (after the weights).
    device : int, optional
        The device to read memory from (default: the current one).

    Raises
    ------
    ConfigError
        An invalid argument (the message and ``argument`` name it).
    WorkspaceOOMError
        The request does not fit; it carries the largest batch_size and max_out_tokens that would.
    NoCudaDeviceError
        Memory figures omitted and no GPU to read them from.
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
    return WorkspacePlan(fields, result, notes)


def _mp_hint(shape: ModelShape, fields: dict[str, Any]) -> str | None:
    """For weights (from the parameter count) above free memory: the smallest mp_size that
    splits them below it, or the most the heads allow."""
    if shape.num_params is None or fields["weights_bytes"] <= fields["free_bytes"]:
        return None
    most = math.gcd(shape.num_heads, shape.num_kv_heads)  # mp_size must divide both
    for mp in range(fields["mp_size"] + 1, most + 1):
        if most % mp == 0:
            per_rank = int(_plan._weights_bytes(shape.num_params, fields["dtype"], mp))
            if per_rank < fields["free_bytes"]:
                return f"mp_size={mp} would put {human_bytes(per_rank)} of weights on each GPU"
    per_rank = int(_plan._weights_bytes(shape.num_params, fields["dtype"], most))
    return (f"even mp_size={most} (the most that divides num_heads={shape.num_heads} and "
            f"num_kv_heads={shape.num_kv_heads}) leaves {human_bytes(per_rank)} of weights on each GPU")


plan_workspace.__doc__ = "Plans a workspace without allocating anything.\n" + _PLAN_DOC_PARAMETERS


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
    "    Takes plan_workspace's arguments, without batch_size.\n" + _PLAN_DOC_PARAMETERS)


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


max_out_tokens_for.__doc__ = (
    "The most tokens a batch holds: the largest max_out_tokens whose plan holds all of them for\n"
    "    ``batch_size`` sequences (0: not even max(prompt_len, min_out_tokens)).\n\n"
    "    Takes plan_workspace's arguments, without max_out_tokens.\n" + _PLAN_DOC_PARAMETERS)

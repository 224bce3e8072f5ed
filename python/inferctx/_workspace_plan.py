"""WorkspacePlan, the planner's answer, and the regions of the workspace it lays out."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, overload

from . import _plan, dtypes
from ._model_shape import ModelShape
from ._plan_args import POLICIES, human_bytes
from .errors import _brief


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
            raise IndexError(f"region index {_brief(operator.index(index))} out of range for {self._len} regions")
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
    """The planner's answer: max_tokens, workspace_bytes, regions, budget, and what bound it.

    Plans come from plan_workspace and an InferenceContext's gen_workspace; the class is not
    called directly.
    """

    __slots__ = ("_fields", "_result", "_notes", "shape", "regions")
    _fields: dict[str, Any]
    _result: dict[str, Any]
    _notes: dict[str, str]
    shape: ModelShape
    regions: Regions

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("WorkspacePlan is not made directly: plans come from inferctx.plan_workspace(...) "
                        "or an InferenceContext's gen_workspace(...)")

    @classmethod
    def _from_result(cls, fields: dict[str, Any], result: dict[str, Any],
                     notes: dict[str, str] | None = None, shape: ModelShape | None = None) -> WorkspacePlan:
        """A plan from the planner's request and answer (the dicts of inferctx._plan)."""
        plan = cls.__new__(cls)
        plan._fields = dict(fields)
        plan._result = dict(result)
        plan._notes = dict(notes or {})
        # The model as planned, num_params included; rebuilt from the request when not given
        # (the request carries no parameter count).
        plan.shape = shape if shape is not None else ModelShape(
            fields["num_layers"], fields["num_heads"], fields["hidden_dim"],
            fields["num_kv_heads"] or fields["num_heads"], head_dim=fields["head_dim"] or None)
        plan.regions = Regions(plan._result, plan.shape.num_layers)
        return plan

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
        from. Its ``["plan"]["regions"]`` lists activations, kv_cache (all layers: layer l's K at
        kv_cache_offset + l * kv_layer_stride, its V kv_value_offset after) and attention_scores
        (the attribute ``plan.regions`` lists each layer's K and V on its own)."""
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
        return {"request": request, "plan": answer, "sources": self._sources()}

    def _sources(self) -> dict[str, Any]:
        """Where the memory and weights figures come from: the words of memory_source and
        weights_source, and the same as fields a program reads: memory_from ('gpu_preset',
        'device' or 'given') with gpu_preset (its name) and device (an ordinal, or 'current'),
        None where they do not apply; weights_from ('parameters', 'given' or 'none')."""
        device = self._notes.get("device")
        memory_from = ("gpu_preset" if "gpu_preset" in self._notes else "device" if device is not None
                       else "given")
        weights_from = ("parameters" if "weights" in self._notes else "given" if self.weights_bytes
                        else "none")
        return {"memory": self.memory_source, "weights": self.weights_source, "memory_from": memory_from,
                "gpu_preset": self._notes.get("gpu_preset"),
                "device": None if device is None else device if device == "current" else int(device),
                "weights_from": weights_from}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkspacePlan):
            return NotImplemented
        return self._fields == other._fields and self._result == other._result

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"WorkspacePlan(max_tokens={self.max_tokens}, workspace_bytes={self.workspace_bytes}, "
                f"policy={self.policy!r}, dtype={self.dtype!r}, bound_by={self.bound_by!r})")

    def _deepspeed_temp_note(self) -> str:
        """Under the deepspeed policy the budget is free - (reserve + DeepSpeed's temp term, an
        element count it adds to the bytes): that term, for a budget set by the reserve."""
        extra = self.planned_free_bytes - self.reserve_bytes - self.budget_bytes
        if self.policy != "deepspeed" or self.budget_limit != "reserve" or self.budget_bytes <= 0 or extra <= 0:
            return ""
        return f" - DeepSpeed's temp term {human_bytes(extra)}"

    def __str__(self) -> str:
        s = self.shape
        kv_note = f"{s.num_kv_heads} KV" if s.num_kv_heads != s.num_heads else "MHA"
        why = {"reserve": f"free - reserve {human_bytes(self.reserve_bytes)}" + self._deepspeed_temp_note(),
               "memory_limit": "memory_limit_bytes",
               "memory_fraction": f"memory_fraction={self._fields['memory_fraction']} of free"}
        bound = ("max_out_tokens" if self.bound_by == "max_out_tokens"
                 else f"memory (budget {human_bytes(self.budget_bytes)})")
        if self.weights_bytes:
            weights = f"{human_bytes(self.weights_bytes)} still to load ({self.weights_source})"
            planned = f"{human_bytes(self.planned_free_bytes)} free after the weights"
        else:
            if self.weights_source != "none":
                weights = self.weights_source
            elif self.memory_source.startswith("GPU preset"):  # nothing was read: a card's whole memory
                weights = "none counted: they live elsewhere"
            else:
                weights = "none counted: free memory is taken as read with the weights already loaded"
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


# Users see them, their reprs and their pickles under inferctx.planning, the module that exports them.
for _cls in (Region, Regions, WorkspacePlan):
    _cls.__module__ = "inferctx.planning"
del _cls

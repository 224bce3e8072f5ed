"""Where the decoder's products run and its buffers come from (and how buffers are cut out of a region).

``GpuBackend``: an ``InferenceContext``; products through ``inferctx.gemm`` / ``inferctx.bmm`` on the
context's cuBLAS handle (on torch's current stream, so a ``torch.cuda.graph`` captures them), dropout
through ``inferctx.dropout``, buffers are ``torch.from_dlpack`` views of the workspace.

``CpuBackend``: the same decoder on the CPU, to check its arithmetic against Hugging Face without a
GPU. ``CpuContext`` plans with the same planner (``inferctx.plan_workspace``) and lays the regions
out in one host allocation as the GPU context does; its products follow the contract of
``inferctx.gemm`` / ``bmm`` (row-major, ``trans_b``, ``alpha``, ``beta``, float32 accumulation and one
rounding) and refuse the operands that those refuse (a layout without a unit stride in one of the
last two dimensions, ``out`` of another shape or dtype, or sharing memory with an input), so a
layout error shows on the CPU too. Released memory is refilled with NaN bytes at a retake without
``keep_contents``, as undefined memory may hold anything.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.dlpack import from_dlpack

from ..errors import ConfigError, TokenLimitError, WorkspaceStateError, _brief
from ..planning import ModelShape, WorkspacePlan, plan_workspace
from .._plan_args import INT64_MAX, INT64_MIN
from ._spec import _flag, _index

__all__ = ["GpuBackend", "CpuBackend", "CpuContext"]

_ALIGN = 256  # bytes between carved buffers, as the planner aligns regions


class GpuBackend:
    """inferctx's kernels on ``ctx``."""

    on_gpu = True

    def __init__(self, ctx: Any) -> None:
        import inferctx

        self.ctx = ctx
        self.device = torch.device("cuda", ctx.device)
        self._gemm = inferctx.gemm
        self._bmm = inferctx.bmm
        self._dropout = inferctx.dropout

    def tensor(self, view: Any) -> torch.Tensor:
        return from_dlpack(view)

    def gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, trans_b: bool = False,
             alpha: float = 1.0, beta: float = 0.0) -> None:
        self._gemm(a, b, out=out, trans_b=trans_b, alpha=alpha, beta=beta, ctx=self.ctx)

    def bmm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, trans_b: bool = False,
            alpha: float = 1.0) -> None:
        self._bmm(a, b, out=out, trans_b=trans_b, alpha=alpha, ctx=self.ctx)

    def dropout(self, x: torch.Tensor, p: float, mask: torch.Tensor) -> None:
        self._dropout(x, p, out=x, mask_out=mask, ctx=self.ctx)


def _matrix_ok(t: torch.Tensor) -> bool:
    """inferctx.gemm's layout rule: unit stride along one of the last two dimensions, the other's
    stride at least that dimension's length (a row of length 1 or an empty matrix always passes)."""
    r, c = t.shape[-2], t.shape[-1]
    sr, sc = t.stride(-2), t.stride(-1)
    if t.dim() == 3 and t.stride(0) < 0:
        return False
    if r == 0 or c == 0:
        return True
    if r == 1 or (sc == 1 and sr >= c) or c == 1:
        return True
    return sr == 1 and sc >= r


def _span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def _check(name: str, ndim: int, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
           trans_b: bool) -> None:
    for arg, t in (("a", a), ("b", b), ("out", out)):
        if t.dim() != ndim:
            raise ConfigError(f"{name}: {arg} must be {ndim}-D; got shape {tuple(t.shape)}", argument=arg)
        if not _matrix_ok(t):
            raise ConfigError(f"{name}: {arg} of shape {tuple(t.shape)} has strides {t.stride()}; one of "
                              f"its last two dimensions must have stride 1", argument=arg)
        if t.dtype != a.dtype:
            raise ConfigError(f"{name}: {arg} is {t.dtype}, a is {a.dtype}", argument=arg)
    m, k = a.shape[-2], a.shape[-1]
    kb, n = (b.shape[-1], b.shape[-2]) if trans_b else (b.shape[-2], b.shape[-1])
    if k != kb:
        raise ConfigError(f"{name}: a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply", argument="b")
    expected: tuple[int, ...] = (m, n)
    if ndim == 3:
        batch = max(a.shape[0], b.shape[0])
        if a.shape[0] not in (1, batch) or b.shape[0] not in (1, batch):
            raise ConfigError(f"{name}: batch sizes {a.shape[0]} and {b.shape[0]}", argument="b")
        expected = (batch, m, n)
    if tuple(out.shape) != expected:
        raise ConfigError(f"{name}: out has shape {tuple(out.shape)}, expected {expected}", argument="out")
    lo, hi = _span(out)
    for arg, t in (("a", a), ("b", b)):
        tlo, thi = _span(t)
        if tlo < hi and lo < thi:
            raise ConfigError(f"{name}: out shares memory with {arg}", argument="out")


class CpuBackend:
    """The decoder's products with torch on the CPU, under inferctx.gemm's contract."""

    on_gpu = False

    def __init__(self, ctx: CpuContext) -> None:
        self.ctx = ctx
        self.device = torch.device("cpu")

    def tensor(self, view: Any) -> torch.Tensor:
        assert isinstance(view, torch.Tensor)
        return view

    def _product(self, name: str, ndim: int, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 trans_b: bool, alpha: float, beta: float) -> None:
        _check(name, ndim, a, b, out, trans_b)
        self.ctx._require_held(name)
        rhs = b.transpose(-1, -2) if trans_b else b
        acc = torch.matmul(a.float(), rhs.float())
        if alpha != 1.0:
            acc = acc * alpha
        if beta != 0.0:
            acc = acc + beta * out.float()
        out.copy_(acc)

    def gemm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, trans_b: bool = False,
             alpha: float = 1.0, beta: float = 0.0) -> None:
        self._product("gemm", 2, a, b, out, trans_b, alpha, beta)

    def bmm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, trans_b: bool = False,
            alpha: float = 1.0) -> None:
        self._product("bmm", 3, a, b, out, trans_b, alpha, 0.0)

    def dropout(self, x: torch.Tensor, p: float, mask: torch.Tensor) -> None:
        if not x.is_contiguous():
            raise ConfigError("dropout: x must be contiguous", argument="x")
        keep = torch.rand(x.shape) > p
        x.mul_(keep.to(x.dtype)).mul_(1.0 / (1.0 - p))


_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _int_arg(value: object, argument: str) -> int:
    """An int64 argument, as InferenceContext takes one: an int or a NumPy integer (bools, floats
    and strings refused), within the 64-bit range."""
    n = _index(value)
    if n is None:
        raise ConfigError(f"{argument}: got {_brief(value)}; it must be an int", argument=argument)
    if not INT64_MIN <= n <= INT64_MAX:
        raise ConfigError(f"{argument}: got {_brief(n)}; it is outside the 64-bit integer range", argument=argument)
    return n


class CpuContext:
    """The part of InferenceContext the decoder uses, in host memory, laid out by the same plan.
    ``free_bytes``: the memory its plans may take (free and total alike), a positive byte count."""

    device = -1
    addresses_stable = True

    def __init__(self, free_bytes: int = 8 << 30) -> None:
        # The host memory the plans may take (free and total alike): no device is read.
        free = _index(free_bytes)
        if free is None or not 1 <= free <= INT64_MAX:
            raise ConfigError(f"free_bytes: got {_brief(free_bytes)}; it must be a positive byte count below 2**63 "
                              f"(the memory the CPU context plans its workspace in)", argument="free_bytes")
        self._free = free
        self._plan: WorkspacePlan | None = None
        self._ws = torch.empty(0, dtype=torch.uint8)
        self._released = False
        self._saved: torch.Tensor | None = None
        self._tokens = 0
        self._contents_epoch = 0  # releases that gave the contents up, as InferenceContext counts

    def gen_workspace(self, shape: ModelShape, *, batch_size: int, prompt_len: int, max_out_tokens: int,
                      min_out_tokens: int = 1, dtype: str = "float16") -> WorkspacePlan:
        plan = plan_workspace(shape, batch_size=batch_size, prompt_len=prompt_len,
                              max_out_tokens=max_out_tokens, min_out_tokens=min_out_tokens, dtype=dtype,
                              free_bytes=self._free, total_bytes=self._free)
        if self._released:  # as InferenceContext: it comes back, with any kept contents, first
            self.retake_workspace()
        if self._plan is None or plan != self._plan:
            self._plan = plan
            self._ws = torch.full((plan.workspace_bytes,), 0xFF, dtype=torch.uint8)  # NaN in every dtype
            self._contents_epoch += 1
        return self._plan

    @property
    def plan(self) -> WorkspacePlan:
        if self._plan is None:
            raise WorkspaceStateError("plan: no workspace is planned; call gen_workspace(...) first")
        return self._plan

    def _require_held(self, what: str) -> None:
        if self._released:
            raise WorkspaceStateError(f"{what}: the workspace is released; call retake_workspace() first")

    def _region(self, offset: int, nbytes: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        self._require_held("view")
        t = self._ws[offset:offset + nbytes].view(_TORCH[self.plan.dtype])
        return t if shape is None else t[:_numel(shape)].view(shape)

    @property
    def workspace_bytes(self) -> int:
        return 0 if self._plan is None else self._plan.workspace_bytes

    @property
    def workspace(self) -> torch.Tensor:
        self._require_held("workspace")
        return self._ws

    @property
    def activations(self) -> torch.Tensor:
        p = self.plan
        return self._region(p.activations_offset, p.activations_bytes)

    @property
    def attention_scores(self) -> torch.Tensor:
        p = self.plan
        return self._region(p.attention_scores_offset, p.attention_scores_bytes)

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of ``layer`` (0..num_layers-1): [batch, kv_heads, max_tokens, head_dim_padded]."""
        index = _int_arg(layer, "layer")  # as InferenceContext.kv_cache
        if self._plan is None:
            raise WorkspaceStateError("kv_cache: no workspace is planned on the CPU; call gen_workspace(...) first")
        p = self._plan
        layers = p.shape.num_layers
        if not 0 <= index < layers:
            raise ConfigError(f"layer: got {index}; valid: 0..{layers - 1} (the plan's num_layers is {layers})",
                              argument="layer")
        key = p.kv_cache_offset + index * p.kv_layer_stride
        return (self._region(key, p.kv_tensor_bytes, p.kv_shape),
                self._region(key + p.kv_value_offset, p.kv_tensor_bytes, p.kv_shape))

    @property
    def max_token_length(self) -> int:
        return 0 if self._plan is None else self._plan.max_tokens

    @property
    def released(self) -> bool:
        return self._released

    def release_workspace(self, force: bool = False, *, keep_contents: bool = False) -> None:
        _flag(force, "force")  # as InferenceContext: flags are True or False
        keep_contents = _flag(keep_contents, "keep_contents")
        if self._released:  # as InferenceContext: only a kept copy can still be given up
            if not keep_contents and self._saved is not None:
                self._saved = None
                self._contents_epoch += 1
            return
        self._saved = self._ws.clone() if keep_contents else None
        self._released = True
        if not keep_contents:
            self._contents_epoch += 1

    def retake_workspace(self) -> bool:
        # As InferenceContext: an error before any plan, nothing to do while the workspace is held.
        if self._plan is None:
            raise WorkspaceStateError("retake_workspace: no workspace plan to retake: call gen_workspace first")
        if not self._released:
            return True
        if self._saved is not None:
            self._ws.copy_(self._saved)
        else:
            self._ws.fill_(0xFF)
        self._saved = None
        self._released = False
        return True

    @property
    def current_tokens(self) -> int:
        return self._tokens

    def advance_tokens(self, n: int = 1) -> None:
        """Counts ``n`` more tokens; TokenLimitError if that would pass ``max_token_length``
        (InferenceContext.advance_tokens, its words)."""
        count = _int_arg(n, "n")
        if count < 1:
            raise ConfigError(f"n: advance_tokens got {count}; it must be a positive token count (>= 1)",
                              argument="n")
        limit = self.max_token_length
        if count > limit - self._tokens:
            if limit == 0:
                message = (f"advance_tokens({count}): no workspace is planned, so max_token_length is 0; call "
                           f"gen_workspace first")
            else:
                message = (f"advance_tokens({count}): {self._tokens} + {count} tokens would pass max_token_length="
                           f"{limit} (the KV cache holds {limit} positions); call reset_tokens for a new sequence, "
                           f"or gen_workspace with a larger max_out_tokens")
            raise TokenLimitError(message, current=self._tokens, requested=count, limit=limit)
        self._tokens += count

    def reset_tokens(self, initial: int = 1) -> None:
        """Starts a new sequence at ``initial`` tokens (0..max_token_length)."""
        start = _int_arg(initial, "initial")
        limit = self.max_token_length
        if not 0 <= start <= limit:
            why = (" (no workspace is planned, so max_token_length is 0; call gen_workspace first)" if limit == 0
                   else " (max_token_length)")
            raise ConfigError(f"initial: reset_tokens got {start}; valid: 0..{limit}{why}", argument="initial")
        self._tokens = start


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_STREAMS: dict[int, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """The decoders' stream of ``device``, one for the process: every decoder runs, warms up and
    captures on it, so inferctx gives its GEMMs one cuBLAS workspace that stays theirs (it keeps
    workspaces for a few streams; a stream per decoder would cycle them under older graphs)."""
    index = torch.device(device).index or 0
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return _STREAMS[index]


class _Carver:
    """Cuts aligned 1-D buffers out of a region; what does not fit goes to one extra allocation."""

    def __init__(self, region: torch.Tensor, groups: list[list[list[tuple[str, int]]]],
                 device: torch.device) -> None:
        # groups: each a list of alternatives (overlaid: they share one base), each a list of (name, numel)
        step = max(1, _ALIGN // region.element_size())

        def up(n: int) -> int:
            return -(-n // step) * step

        placed: list[tuple[bool, int, list[list[tuple[str, int]]]]] = []
        used = extra = 0
        for alternatives in groups:
            size = max(sum(up(n) for _, n in alt) for alt in alternatives)
            if used + size <= region.numel():
                placed.append((True, used, alternatives))
                used += size
            else:
                placed.append((False, extra, alternatives))
                extra += size
        self.extra = torch.empty(extra, dtype=region.dtype, device=device) if extra else None
        self.extra_bytes = extra * region.element_size()
        self.buffers: dict[str, torch.Tensor] = {}
        for in_region, base, alternatives in placed:
            source = region if in_region else self.extra
            assert source is not None
            for alt in alternatives:
                offset = base
                for name, n in alt:
                    self.buffers[name] = source[offset:offset + n]
                    offset += up(n)

"""ReferenceDecoder: greedy decoding of a GPT-2 or Llama-architecture model inside an inferctx
workspace, the prompt eager and every decode step one replay of a CUDA graph captured once.
See the package docstring for the layout and the graph."""

from __future__ import annotations

import contextlib
import math
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Generic, Iterator, Literal, TypeVar, overload

import torch

from ..errors import ConfigError, TokenLimitError, WorkspaceOOMError, WorkspaceStateError, _brief
from . import _layers as L
from ._backend import CpuBackend, CpuContext, GpuBackend, _Carver, _side_stream
from ._fused import FusedOps, fused_ops, unfused
from ._models import TORCH_DTYPES, Weights
from ._spec import (ModelSpec, _check_positions, _check_request, _decoder_terms, _flag, _positive, _real,
                    dtype_name)

__all__ = ["ReferenceDecoder", "Generation"]

# The decoder whose sequences each context's workspace holds: the last to prefill on it. Decoders
# with the same plan share the context's workspace (an equal request gives the plan in force).
_HOLDER: weakref.WeakKeyDictionary[Any, weakref.ref[ReferenceDecoder]] = weakref.WeakKeyDictionary()


def _too_long(exc: WorkspaceOOMError, s: ModelSpec, batch: int, prompt_len: int, new: int,
              dtype: str, granularity: int) -> WorkspaceOOMError:
    """The planner's refusal of a full-length plan, in the decoder's terms: what the memory it
    measured holds, and the max_new_tokens or batch_size that would fit. `exc` itself where it
    is no such refusal (the plan fits those figures: the memory went, or the mapping failed)."""
    from ..planning import _context_max_out_tokens, human_bytes

    if exc.free_bytes is None or exc.total_bytes is None:
        return exc
    # The planner's own hint gives the batch (every row holding all its tokens); a request that
    # must hold all of them has no smaller max_out_tokens to offer, so that one is asked here,
    # as the context plans: its memory figures and its mapping's granularity.
    most = _context_max_out_tokens(s.model_shape(), batch_size=batch, prompt_len=prompt_len, dtype=dtype,
                                   free_bytes=exc.free_bytes, total_bytes=exc.total_bytes,
                                   allocation_granularity=granularity)
    if most >= prompt_len + new:
        return exc
    rows = exc.max_batch_size or 0
    hints = ([f"max_new_tokens <= {most - prompt_len}"] if most > prompt_len else []) + (
        [f"batch_size <= {rows}"] if rows >= 1 else [])
    need = f"needs {human_bytes(exc.requested_bytes)}, " if exc.requested_bytes is not None else ""
    budget = f"a budget of {human_bytes(exc.budget_bytes)}" if exc.budget_bytes is not None else "the budget"
    return WorkspaceOOMError(
        f"max_new_tokens: a batch of {batch} rows of prompt_len + max_new_tokens = {prompt_len + new} tokens "
        f"does not fit: it {need}and {budget} (free {human_bytes(exc.free_bytes)}) holds "
        f"{most if most >= prompt_len else 0} tokens per row; "
        + (f"would fit: {' or '.join(hints)}" if hints else "no smaller batch_size or max_new_tokens fits"),
        requested_bytes=exc.requested_bytes, free_bytes=exc.free_bytes, total_bytes=exc.total_bytes,
        budget_bytes=exc.budget_bytes, max_batch_size=rows or None,
        max_out_tokens=most if most > prompt_len else None)


# The type of Generation.logits: a tensor where generate was asked for them, None where not (what
# a type checker sees of a call with return_logits=True, or left out).
_Logits = TypeVar("_Logits", bound="torch.Tensor | None")


@dataclass
class Generation(Generic[_Logits]):
    """What ``generate`` returns. ``tokens`` [batch, n] (on the decoder's device); ``logits``
    [n, batch, vocab] when asked for (row i predicts tokens[:, i]); ``prefill_ms`` and
    ``step_ms`` (one per decode step; CUDA-event times on the GPU) when timed."""

    tokens: torch.Tensor
    logits: _Logits = None  # type: ignore[assignment]  # None is the value of Generation[None]
    prefill_ms: float | None = None
    step_ms: list[float] = field(default_factory=list)
    graph: bool = False


# The dtypes of token ids the decoder takes: those torch reads as indices and compares on every
# device (uint16 / uint32 / uint64 have no min / max kernels).
_TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _check_prompt(prompt: Any, name: str = "prompt", dims: str = "[batch, length]") -> None:
    """ConfigError(argument=name) unless `prompt` is a 2-D tensor of token ids (`dims`: its [rows, columns])."""
    if (not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.dtype.is_floating_point
            or prompt.dtype.is_complex or prompt.dtype == torch.bool):
        got = (f"a {tuple(prompt.shape)} {str(prompt.dtype).replace('torch.', '')} tensor"
               if isinstance(prompt, torch.Tensor) else f"a {type(prompt).__name__}")
        raise ConfigError(f"{name}: got {got}; it must be a 2-D integer tensor {dims} of token ids",
                          argument=name)
    if prompt.layout != torch.strided or prompt.device.type == "meta":
        where = ("on the meta device, which holds no values" if prompt.device.type == "meta"
                 else f"of layout {str(prompt.layout).replace('torch.', '')}")
        raise ConfigError(f"{name}: got a {tuple(prompt.shape)} {str(prompt.dtype).replace('torch.', '')} tensor "
                          f"{where}; it must be a dense (strided) tensor of token ids on the CPU or a GPU",
                          argument=name)
    if prompt.dtype not in _TOKEN_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in _TOKEN_DTYPES)
        raise ConfigError(f"{name}: got a {tuple(prompt.shape)} {str(prompt.dtype).replace('torch.', '')} tensor; "
                          f"token ids must be one of {names}", argument=name)


def _check_token_range(tokens: torch.Tensor, vocab_size: int, name: str = "prompt") -> None:
    """ConfigError(argument=name) unless every id of `tokens` is in 0..vocab_size-1 (one
    synchronisation where they are on a GPU)."""
    lo, hi = torch.stack(torch.aminmax(tokens)).tolist()
    if lo < 0 or hi >= vocab_size:
        raise ConfigError(f"{name}: token ids must be in 0..{vocab_size - 1}; got {lo}..{hi}", argument=name)


def _model_config(model: object) -> Any:
    """The Hugging Face config of `model`; ConfigError(argument="model") for anything that is no
    transformers model."""
    config = getattr(model, "config", None) if isinstance(model, torch.nn.Module) else None
    if config is None:
        raise ConfigError(f"model: got {_brief(model)} ({type(model).__name__}); it must be a transformers "
                          f"GPT2LMHeadModel or LlamaForCausalLM, such as build_hf_model(model_spec(name)) makes",
                          argument="model")
    return config


def _is_gpu_context(ctx: object) -> bool:
    """An InferenceContext: told without importing the GPU module (an instance means it is loaded)."""
    core = sys.modules.get("inferctx._core")
    return core is not None and isinstance(ctx, core.InferenceContext)


class ReferenceDecoder:
    """A GPT-2 or Llama-architecture decoder equal to a Hugging Face model, run in ``ctx``'s workspace.

    Parameters
    ----------
    model
        A transformers GPT2LMHeadModel or LlamaForCausalLM (see ``build_hf_model``); its weights are
        copied to the device in ``dtype`` (shared when they already are there in that dtype).
    batch_size, prompt_len, max_new_tokens
        The plan: up to ``batch_size`` sequences of up to ``prompt_len`` prompt tokens, and
        ``prompt_len + max_new_tokens`` tokens in the KV cache (``max_out_tokens``). Integers (NumPy's
        too). GPT-2 feeds at most its ``n_positions`` positions: ``prompt_len + max_new_tokens - 1``
        (the last new token is not fed back, as in transformers' ``generate``), and ``step`` stops
        there; Llama's ``max_position_embeddings`` bounds nothing here (default RoPE turns any
        position, in transformers as here).
    dtype
        'float16' (default), 'bfloat16' or 'float32': the weights', the workspace's and the logits'.
    ctx
        The InferenceContext (default: the one of ``device``, or the current device), or a
        ``CpuContext`` to run on the CPU. Its workspace is planned here (``gen_workspace``).
    device
        The device whose context is taken when ``ctx`` is None (default: the current device).
    dropout
        Probability p of MC-dropout on each block's output before the residual add (GPT-2's
        resid_pdrop places), through ``inferctx.dropout``; 0 (default) runs none.
    use_graph
        Replay each decode step from a CUDA graph captured at the first one (GPU only). This and
        every other flag of the decoder is True or False (a numpy.bool_ too).
    fused
        Run GELU, SiLU times the up projection and RoPE as one inferctx kernel each instead of
        torch's sequences of small kernels, where each gives the sequence's bits on this torch
        build (checked once per device and dtype; ``fused_kernels`` says which are in use). GPU only.
    """

    def __init__(self, model: Any, *, batch_size: int, prompt_len: int, max_new_tokens: int,
                 dtype: Any = "float16", ctx: Any = None, device: int | None = None, dropout: float = 0.0,
                 use_graph: bool = True, fused: bool = True) -> None:
        self.spec = ModelSpec.from_hf_config(_model_config(model))
        self.batch = _positive(batch_size, "batch_size")
        self.prompt_len = _positive(prompt_len, "prompt_len")
        self.max_new_tokens = _positive(max_new_tokens, "max_new_tokens")
        self.dtype_name = dtype_name(dtype)
        self.dtype = TORCH_DTYPES[self.dtype_name]
        p = _real(dropout)
        if p is None or not 0.0 <= p < 1.0:
            raise ConfigError(f"dropout: got {_brief(dropout)}; it must be a probability in [0, 1)",
                              argument="dropout")
        self.dropout = p
        use_graph = _flag(use_graph, "use_graph")
        fused = _flag(fused, "fused")
        if ctx is not None and not isinstance(ctx, CpuContext) and not _is_gpu_context(ctx):
            raise ConfigError(f"ctx: got {_brief(ctx)} ({type(ctx).__name__}); it must be an InferenceContext, a "
                              f"CpuContext, or None for the context of device", argument="ctx")
        s = self.spec
        total = self.prompt_len + self.max_new_tokens
        _check_positions(s, self.prompt_len, self.max_new_tokens)
        # Llama has no such bound here: RoPE's tables are made for the planned length, as
        # transformers makes them for any position (max_position_embeddings bounds no default RoPE).
        _check_request(s, self.batch, self.prompt_len, self.max_new_tokens, self.dtype_name)  # no weights copied yet
        if isinstance(ctx, CpuContext):
            self.backend: GpuBackend | CpuBackend = CpuBackend(ctx)
        else:
            if ctx is None:
                from ..context import InferenceContext
                from ..errors import NoCudaDeviceError

                try:
                    ctx = InferenceContext.instance(device)
                except NoCudaDeviceError as exc:  # what works without a GPU: this decoder, on the CPU
                    raise NoCudaDeviceError(f"{exc.message} ReferenceDecoder decodes on the CPU with "
                                            f"ctx=CpuContext() (inferctx.decoder.CpuContext).", call=exc.call,
                                            code=exc.code, name=exc.name, device=exc.device) from None
            self.backend = GpuBackend(ctx)
        self.ctx = ctx
        self.device = self.backend.device
        self.use_graph = use_graph and self.backend.on_gpu
        index = self.device.index if self.backend.on_gpu else -1
        self._ops: FusedOps = (fused_ops(index, self.dtype) if fused and self.backend.on_gpu
                               else unfused(index, self.dtype))
        self.weights = Weights.from_hf(model, s, self.device, self.dtype)  # before the plan reads free memory
        try:
            # Every row's prompt and new tokens, or nothing: a plan cut short by memory would let
            # generate() run most of its steps and then fail.
            self.plan = ctx.gen_workspace(s.model_shape(), batch_size=self.batch, prompt_len=self.prompt_len,
                                          max_out_tokens=total, min_out_tokens=total, dtype=self.dtype_name)
        except ConfigError as exc:  # the planner's names (max_out_tokens, ...) in the decoder's
            worded = _decoder_terms(exc, s, self.batch, self.prompt_len, self.max_new_tokens, self.dtype_name)
            if worded is exc:
                raise
            raise worded from None
        except WorkspaceOOMError as exc:
            too_long = _too_long(exc, s, self.batch, self.prompt_len, self.max_new_tokens, self.dtype_name,
                                 getattr(ctx, "allocation_granularity", 0))
            if too_long is exc:
                raise
            raise too_long from None
        self.max_tokens = self.plan.max_tokens
        self.eps = float(model.config.layer_norm_epsilon if s.arch == "gpt2" else model.config.rms_norm_eps)
        scale = s.head_dim ** -0.5
        self.scale = scale
        self._scale_in_product = math.frexp(scale)[0] == 0.5  # a power of two: scaling there rounds alike
        self._minval = torch.finfo(self.dtype).min
        self._stream = _side_stream(self.device) if self.backend.on_gpu else None
        self._graph: Any = None
        self._prefilled = False
        self._next = 0  # the KV-cache position the next step writes (the device's pos), on the host
        self._epoch = -1  # ctx._contents_epoch at the prefill: the KV cache is gone once it moves
        self._unbound = False  # views dropped by release() under the cudaMalloc fallback
        self._state_small()
        self._bind()

    # -- buffers -------------------------------------------------------------------------------
    def _state_small(self) -> None:
        """Small device state outside the workspace: token ids, the position, masks, RoPE tables."""
        b, T, dev = self.batch, self.max_tokens, self.device
        i64 = torch.int64
        self.pos = torch.zeros(1, dtype=i64, device=dev)  # the position the next decode step writes
        self.tokens = torch.zeros(b, dtype=i64, device=dev)  # the next input token of each sequence
        self.out_ids = torch.zeros(b, T + 1, dtype=i64, device=dev)  # every sequence's tokens by position
        self._prompt = torch.zeros(b * self.prompt_len, dtype=i64, device=dev)
        self._arange = torch.arange(T, dtype=i64, device=dev)
        self._mask_now = torch.zeros(T, dtype=torch.bool, device=dev)  # keys after pos
        self._causal = torch.ones(self.prompt_len, self.prompt_len, dtype=torch.bool, device=dev).triu(1)
        n = self.batch * self.prompt_len * self.spec.hidden
        self._drop_mask = torch.zeros(-(-n // 32), dtype=torch.int32, device=dev) if self.dropout else None
        if self.spec.arch == "llama":
            assert self.weights.inv_freq is not None
            self._cos, self._sin = L.rope_tables(self.weights.inv_freq, T, self.dtype)
            self._cos_now = torch.empty(1, self.spec.head_dim, dtype=self.dtype, device=dev)
            self._sin_now = torch.empty_like(self._cos_now)

    def _bind(self) -> None:
        """Views of the workspace: KV cache per layer, buffers carved from activations and scores."""
        ctx, s, b = self.ctx, self.spec, self.batch
        be = self.backend
        N = b * self.prompt_len
        h, hd, nh, nkv = s.hidden, s.head_dim, s.num_heads, s.num_kv_heads
        H, KV, V, I = nh * hd, nkv * hd, s.vocab_size, s.intermediate
        llama = s.arch == "llama"
        common = [("logits", b * V), ("x", N * h), ("tmp", N * h)] + ([("y", N * h)] if llama else [])
        attention = [("qkv", N * (H + 2 * KV)), ("qh", N * H), ("ctx", N * H)]
        if llama:
            attention += [("ra", N * H), ("rb", N * H), ("kr", N * KV)]
        mlp = [("mlp", N * (2 * I if llama else I))] + ([] if llama else [("gelu", N * I)])
        acts = _Carver(be.tensor(ctx.activations), [[common], [attention, mlp]], self.device)
        T = self.max_tokens
        scores_n = b * nh * max(T, self.prompt_len * self.prompt_len)
        scores = _Carver(be.tensor(ctx.attention_scores), [[[("scores", scores_n)]], [[("probs", scores_n)]]],
                         self.device)
        self.buf = {**acts.buffers, **scores.buffers}
        self.extra_bytes = acts.extra_bytes + scores.extra_bytes
        self._extra = (acts.extra, scores.extra)
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in range(s.num_layers):
            k_view, v_view = ctx.kv_cache(layer)
            self.kv.append((be.tensor(k_view), be.tensor(v_view)))

    @property
    def logits(self) -> torch.Tensor:
        """The last step's logits [batch, vocab] (a workspace view, overwritten by the next step).
        WorkspaceStateError while the workspace is released (no memory is behind the view), before
        a prefill, and once another decoder's prefill or a release without keep_contents has
        taken the workspace's contents since this decoder's."""
        self._check_state("logits")
        self._check_sequence("logits")
        return self._logits()

    def _logits(self) -> torch.Tensor:
        return self.buf["logits"].view(self.batch, self.spec.vocab_size)

    @property
    def fused_kernels(self) -> tuple[str, ...]:
        """The fused inferctx kernels this decoder runs in place of torch's sequences: a subset of
        ("gelu_new", "silu_mul", "rope"); empty on the CPU or with ``fused=False``."""
        return self._ops.names

    @property
    def workspace_bytes(self) -> int:
        return int(self.plan.workspace_bytes)

    # -- checks --------------------------------------------------------------------------------
    def _check_state(self, what: str) -> None:
        ctx = self.ctx
        if ctx.released:
            raise WorkspaceStateError(f"{what}: the workspace is released; call retake() (or "
                                      f"ctx.retake_workspace()) first")
        if ctx.plan is not self.plan:
            raise WorkspaceStateError(f"{what}: the context's workspace was planned again (gen_workspace) "
                                      f"since this decoder planned it; make a new ReferenceDecoder")
        if self._unbound:  # released under the cudaMalloc fallback, taken back by ctx.retake_workspace()
            self._rebind()

    def _check_sequence(self, what: str) -> None:
        """WorkspaceStateError naming `what` unless the workspace still holds this decoder's
        sequences: prefilled, by no other decoder since, with no contents given up since."""
        if not self._prefilled:
            raise WorkspaceStateError(f"{what}: no sequence in the KV cache; call prefill(prompt) or generate()")
        holder = _HOLDER.get(self.ctx)
        if holder is None or holder() is not self:
            self._prefilled = False
            raise WorkspaceStateError(f"{what}: another ReferenceDecoder prefilled on this context since "
                                      f"(decoders of one plan share its workspace, and the KV cache now holds "
                                      f"its sequences); call prefill(prompt) or generate() again")
        if self.ctx._contents_epoch != self._epoch:
            self._prefilled = False
            raise WorkspaceStateError(f"{what}: the workspace was released without keep_contents since the "
                                      f"prefill, so the KV cache is gone; call prefill(prompt) or generate() "
                                      f"again (release(keep_contents=True) keeps it)")

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None:
            with torch.no_grad():
                yield
        else:
            with torch.no_grad(), torch.cuda.stream(self._stream):
                yield

    # -- the model -----------------------------------------------------------------------------
    def _linear(self, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
        """out <- a @ W (+ bias), rounded once (the bias goes in as beta * out, as torch's addmm)."""
        if bias is None:
            self.backend.gemm(a, w, out, trans_b=self.weights.trans)
        else:
            out.copy_(bias.expand_as(out))
            self.backend.gemm(a, w, out, trans_b=self.weights.trans, beta=1.0)

    def _norm(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.spec.arch == "gpt2":
            return L.layer_norm(x, w, bias, self.eps)
        rows = x.shape[0]
        return L.rms_norm(x, w, self.eps, self.buf["y"][:rows * x.shape[1]].view(rows, x.shape[1]))

    def _run(self, n: int, decode: bool) -> None:
        """The forward pass of n tokens per sequence: the prompt (decode False: positions 0..n-1),
        or one token at position ``pos`` (decode True: static shapes, the position on the device)."""
        s, w, be, buf = self.spec, self.weights, self.backend, self.buf
        b, T = self.batch, self.max_tokens
        N = b * n
        h, hd, nh, nkv, g = s.hidden, s.head_dim, s.num_heads, s.num_kv_heads, s.group
        H, KV = nh * hd, nkv * hd
        llama = s.arch == "llama"
        x = buf["x"][:N * h].view(N, h)
        tmp = buf["tmp"][:N * h].view(N, h)
        qkv = buf["qkv"][:N * (H + 2 * KV)].view(N, H + 2 * KV)
        qh = buf["qh"][:N * H]  # queries head-major [b, nh, n, hd]; the prompt's attention output after
        ctx_out = buf["ctx"][:N * H].view(N, H)  # attention output token-major [b * n, nh * hd]
        keys = T if decode else n
        scores = buf["scores"][:b * nh * n * keys].view(b * nkv, g * n, keys)
        probs = buf["probs"][:b * nh * n * keys].view(b * nkv, g * n, keys)
        ids = self.tokens if decode else self._prompt[:N]
        torch.index_select(w.embed, 0, ids, out=x)
        if w.positions is not None:  # GPT-2's learned positions
            if decode:
                torch.index_select(w.positions, 0, self.pos, out=tmp[:1])
                x.add_(tmp[:1])
            else:
                x.view(b, n, h).add_(w.positions[:n])
        if decode:
            torch.gt(self._arange, self.pos, out=self._mask_now)
        if llama:
            if decode:
                torch.index_select(self._cos, 0, self.pos, out=self._cos_now)
                torch.index_select(self._sin, 0, self.pos, out=self._sin_now)
                cos, sin = self._cos_now.view(1, 1, 1, hd), self._sin_now.view(1, 1, 1, hd)
            else:
                cos, sin = self._cos[:n].view(1, n, 1, hd), self._sin[:n].view(1, n, 1, hd)
        for layer, lw in enumerate(w.layers):
            k_full, v_full = self.kv[layer]  # [b, nkv, T, head_dim_padded]
            he = k_full.shape[-1]
            k_cache, v_cache = k_full[..., :hd], v_full[..., :hd]
            self._linear(self._norm(x, lw.norm1_w, lw.norm1_b), lw.qkv, lw.qkv_b, qkv)
            q = qkv[:, :H].view(b, n, nh, hd)
            k = qkv[:, H:H + KV].view(b, n, nkv, hd)
            v = qkv[:, H + KV:].view(b, n, nkv, hd)
            q_dst = qh.view(b, nh, n, hd).transpose(1, 2)
            if llama:
                ra, rb = buf["ra"][:N * H].view(b, n, nh, hd), buf["rb"][:N * H].view(b, n, nh, hd)
                self._ops.rope(q, cos, sin, q_dst, ra, rb)
                k_rot = buf["kr"][:N * KV].view(b, n, nkv, hd)
                self._ops.rope(k, cos, sin, k_rot, buf["ra"][:N * KV].view(b, n, nkv, hd),
                               buf["rb"][:N * KV].view(b, n, nkv, hd))
                k = k_rot
            else:
                q_dst.copy_(q)
            if decode:  # at the device position: static addresses for the graph
                k_cache.index_copy_(2, self.pos, k.transpose(1, 2))
                v_cache.index_copy_(2, self.pos, v.transpose(1, 2))
            else:
                k_cache[:, :, :n].copy_(k.transpose(1, 2))
                v_cache[:, :, :n].copy_(v.transpose(1, 2))
            # grouped-query attention: the g query heads of a KV head are one matrix of g * n rows
            q3 = qh.view(b * nkv, g * n, hd)
            k3 = k_full.view(b * nkv, T, he)[:, :keys, :hd]
            v3 = v_full.view(b * nkv, T, he)[:, :keys, :hd]
            if self._scale_in_product:
                be.bmm(q3, k3, scores, trans_b=True, alpha=self.scale)
            else:
                be.bmm(q3, k3, scores, trans_b=True)
                scores.mul_(self.scale)
            if decode:
                scores.masked_fill_(self._mask_now, self._minval)
            else:
                scores.view(b * nkv, g, n, n).masked_fill_(self._causal[:n, :n], self._minval)
            L.softmax(scores, probs, float32_first=llama)
            if decode:  # one query per head: head-major is token-major
                be.bmm(probs, v3, ctx_out.view(b * nkv, g, hd))
            else:
                be.bmm(probs, v3, qh.view(b * nkv, g * n, hd))
                ctx_out.view(b, n, nh, hd).copy_(qh.view(b, nh, n, hd).transpose(1, 2))
            self._linear(ctx_out, lw.out, lw.out_b, tmp)
            self._residual(x, tmp, N)
            xn = self._norm(x, lw.norm2_w, lw.norm2_b)
            if llama:
                I = s.intermediate
                gate_up = buf["mlp"][:N * 2 * I].view(N, 2 * I)
                self._linear(xn, lw.up, lw.up_b, gate_up)
                gate = gate_up[:, :I]
                self._ops.silu_mul_(gate, gate_up[:, I:])
                self._linear(gate, lw.down, lw.down_b, tmp)
            else:
                I = s.intermediate
                up = buf["mlp"][:N * I].view(N, I)
                self._linear(xn, lw.up, lw.up_b, up)
                self._ops.gelu_new_(up, buf["gelu"][:N * I].view(N, I))
                self._linear(up, lw.down, lw.down_b, tmp)
            self._residual(x, tmp, N)
        last = x if decode else x.view(b, n, h)[:, n - 1]
        be.gemm(self._norm(last, w.norm_w, w.norm_b), w.lm_head, self._logits(), trans_b=True)
        torch.argmax(self._logits(), -1, out=self.tokens)
        if decode:
            self.pos.add_(1)
            self.out_ids.index_copy_(1, self.pos, self.tokens.view(b, 1))

    def _residual(self, x: torch.Tensor, block_out: torch.Tensor, rows: int) -> None:
        if self.dropout:
            assert self._drop_mask is not None
            self.backend.dropout(block_out, self.dropout, self._drop_mask[:-(-rows * block_out.shape[1] // 32)])
        x.add_(block_out)

    # -- generation ----------------------------------------------------------------------------
    def prefill(self, prompt: torch.Tensor) -> None:
        """Starts a sequence: runs the prompt [rows, L] (rows <= batch_size, L <= prompt_len) eagerly,
        fills the KV cache's first L positions and picks each sequence's next token. Rows below
        batch_size are padded with the first row (their results are dropped). The work runs on the
        decoder's own stream after the work queued so far on the caller's current stream, and the
        caller's stream waits for it: ``logits`` and ``out_ids`` read there need no synchronize."""
        self._check_prompt_fits(prompt)
        self._prefill(prompt)
        self._join_caller()

    def _join_caller(self) -> None:
        """The caller's current stream waits for the work queued on the decoder's."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _check_prompt_fits(self, prompt: Any) -> None:
        """ConfigError unless `prompt` is a prompt (_check_prompt) whose [rows, length] fit the plan
        (batch_size, prompt_len)."""
        _check_prompt(prompt)
        rows, n = prompt.shape
        if rows > self.batch:
            raise ConfigError(f"batch_size: the prompt has {rows} sequences but the decoder was planned for "
                              f"batch_size={self.batch}; make a ReferenceDecoder with batch_size={rows}",
                              argument="batch_size")
        if rows < 1:
            raise ConfigError(f"batch_size: the prompt has 0 sequences; give 1..{self.batch} (batch_size)",
                              argument="batch_size")
        if not 1 <= n <= self.prompt_len:
            raise ConfigError(f"prompt_len: the prompt has {n} tokens per sequence; the decoder was planned "
                              f"for 1..{self.prompt_len} (prompt_len)", argument="prompt_len")

    def _prefill(self, prompt: torch.Tensor) -> None:
        """prefill of a prompt _check_prompt_fits passed, the caller's stream not made to wait for it
        (generate does that once)."""
        rows, n = prompt.shape
        _check_token_range(prompt, self.spec.vocab_size)
        self._check_state("prefill")
        self._prefilled = False
        _HOLDER[self.ctx] = weakref.ref(self)
        self._epoch = self.ctx._contents_epoch
        self.ctx.reset_tokens(0)
        self.ctx.advance_tokens(n)
        caller = torch.cuda.current_stream(self.device) if self._stream is not None else None
        with self._on_stream():
            if self._stream is not None and caller is not None:
                self._stream.wait_stream(caller)
            ids = self._prompt[:self.batch * n].view(self.batch, n)
            # Asynchronous only from device memory (ordered by record_stream below): a copy from
            # page-locked host memory would read it after this returns, when the caller may have
            # written the next prompt there.
            ids[:rows].copy_(prompt, non_blocking=prompt.device == self.device)
            if self._stream is not None and prompt.device == self.device:
                prompt.record_stream(self._stream)  # read here: not reused before the copy
            if rows < self.batch:
                ids[rows:].copy_(ids[:1].expand(self.batch - rows, n))
            for _, v_full in self.kv:  # what attention reads past the sequence must be finite: zeros
                v_full[:, :, n:].zero_()
            self._run(n, decode=False)
            self.out_ids[:, :n].copy_(ids)
            self.out_ids[:, n].copy_(self.tokens)
            self.pos.fill_(n)
        self._rows, self._length = rows, n
        self._next = n
        self._prefilled = True

    def step(self, use_graph: bool | None = None) -> None:
        """One decode step of every sequence: feeds each its last token, writes K and V at the current
        position and picks the next token. TokenLimitError, before anything is queued, when the KV
        cache is full (ctx.max_token_length). With the graph, the first step runs eagerly and is
        captured; later steps (of this and later generations) replay it. Ordered as prefill is:
        after the caller's current stream, which then waits for the step."""
        graph = None if use_graph is None else _flag(use_graph, "use_graph")
        caller = torch.cuda.current_stream(self.device) if self._stream is not None else None
        self._step(graph, caller)
        self._join_caller()

    def _step(self, use_graph: bool | None, caller: Any) -> None:
        """step, after the work queued on `caller` (None: no wait, as within generate), the
        caller's stream not made to wait for it."""
        self._check_state("step")
        self._check_sequence("step")
        graph = self.use_graph if use_graph is None else use_graph and self.backend.on_gpu
        if self._next >= self.max_tokens:
            # The context's counter is shared (reset_tokens by anyone holding the context): this
            # decoder's own position bounds its writes to the KV cache.
            raise TokenLimitError(f"step: the KV cache is full: this decoder's sequences hold all {self.max_tokens} "
                                  f"positions (max_tokens); call prefill(prompt) or generate() for new ones",
                                  current=self._next, requested=1, limit=self.max_tokens)
        if self.spec.arch == "gpt2" and self._next >= self.spec.max_positions:
            # The plan holds prompt_len + max_new_tokens positions, one more than a generation feeds
            # (its last token is not fed back), and GPT-2's learned positions may end before it.
            limit = self.spec.max_positions
            raise TokenLimitError(f"step: GPT-2's learned positions end at n_positions={limit}, and this "
                                  f"decoder's sequences have fed all {limit}; call prefill(prompt) or generate() "
                                  f"for new ones", current=self._next, requested=1, limit=limit)
        self.ctx.advance_tokens(1)  # raises TokenLimitError at max_token_length: nothing is launched
        with self._on_stream():
            if caller is not None and self._stream is not None:
                self._stream.wait_stream(caller)  # the caller's reads of the last step come first
            if graph and self._graph is not None:
                self._graph.replay()
            else:
                self._run(1, decode=True)
                if graph:
                    self._capture()
        self._next += 1

    def _capture(self) -> None:
        """Captures the decode step (its state already advanced by the eager step just run, the
        warm-up on this side stream): capturing queues nothing, so the state is unchanged."""
        assert self._stream is not None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self._stream):
            self._run(1, decode=True)
        self._graph = graph

    @overload
    def generate(self, prompt: torch.Tensor, max_new_tokens: int | None = None, *, return_logits: Literal[True],
                 use_graph: bool | None = None, timing: bool = False) -> Generation[torch.Tensor]: ...

    @overload
    def generate(self, prompt: torch.Tensor, max_new_tokens: int | None = None, *,
                 return_logits: Literal[False] = False, use_graph: bool | None = None,
                 timing: bool = False) -> Generation[None]: ...

    @overload
    def generate(self, prompt: torch.Tensor, max_new_tokens: int | None = None, *, return_logits: bool,
                 use_graph: bool | None = None, timing: bool = False) -> Generation[torch.Tensor | None]: ...

    def generate(self, prompt: torch.Tensor, max_new_tokens: int | None = None, *, return_logits: bool = False,
                 use_graph: bool | None = None, timing: bool = False) -> Generation[Any]:
        """Greedy decoding: ``max_new_tokens`` (default: the planned number) tokens after ``prompt``
        [rows, L]; the prefill gives the first, each decode step one more."""
        n = self.max_new_tokens if max_new_tokens is None else _positive(max_new_tokens, "max_new_tokens")
        graph = self.use_graph if use_graph is None else _flag(use_graph, "use_graph") and self.backend.on_gpu
        return_logits = _flag(return_logits, "return_logits")
        timing = _flag(timing, "timing")
        self._check_prompt_fits(prompt)  # before the logits are allocated for n steps
        # Before the token limit, which is that of the plan in force: another decoder's, if it
        # planned the workspace again, whose limit this one could not meet whatever it asked.
        self._check_state("generate")
        on_gpu = self._stream is not None
        rows, length = prompt.shape
        # The prefill takes the prompt's tokens, each step one more: all must fit the KV cache
        # (ctx.max_token_length), checked before anything is queued.
        limit = int(self.ctx.max_token_length)
        if length <= limit and length + n - 1 > limit:
            raise TokenLimitError(
                f"generate: max_new_tokens={n} after a prompt of {length} tokens needs {length + n - 1} "
                f"token slots, and the KV cache holds {limit} (ctx.max_token_length); "
                f"max_new_tokens <= {limit - length + 1} fits", current=0, requested=length + n - 1,
                limit=limit)
        logits = (torch.empty(n, rows, self.spec.vocab_size, dtype=self.dtype, device=self.device)
                  if return_logits else None)
        marks: list[Any] = []

        def mark() -> None:
            if not timing:
                return
            if on_gpu:
                e = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                e.record(self._stream)
                marks.append(e)
            else:
                marks.append(time.perf_counter())

        try:
            mark()
            self._prefill(prompt)
            mark()
            rows, length = self._rows, self._length
            if logits is not None:
                with self._on_stream():
                    logits[0].copy_(self._logits()[:rows])
            for i in range(1, n):
                self._step(graph, None)  # TokenLimitError past max_token_length
                mark()
                if logits is not None:
                    with self._on_stream():
                        logits[i].copy_(self._logits()[:rows])
        finally:
            if self._stream is not None:  # the caller's stream waits for what was queued here
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
        tokens = self.out_ids[:rows, length:length + n].clone()
        times: list[float] = []
        if timing:
            if on_gpu:
                marks[-1].synchronize()
                times = [a.elapsed_time(z) for a, z in zip(marks, marks[1:])]
            else:
                times = [(z - a) * 1e3 for a, z in zip(marks, marks[1:])]
        return Generation(tokens, logits, times[0] if times else None, times[1:], graph)

    # -- release and retake --------------------------------------------------------------------
    def release(self, keep_contents: bool = False) -> None:
        """Gives the workspace's memory back (``ctx.release_workspace``). With ``keep_contents`` the KV
        cache survives and the sequence goes on after ``retake()``; without, a new generation must
        start. The CUDA graph is kept where the workspace keeps its addresses
        (``ctx.addresses_stable``); under the cudaMalloc fallback the decoder's views and graph are
        dropped first (so that the allocation can be freed) and made again at the retake."""
        keep_contents = _flag(keep_contents, "keep_contents")
        stable = bool(self.ctx.addresses_stable)
        if not stable:
            # Under the cudaMalloc fallback the allocation is freed only once no view holds it: the
            # decoder's own views (and its graph, made on them) go first, and come back at the next
            # retake() or call after ctx.retake_workspace().
            self.kv, self.buf, self._graph = [], {}, None
            self._unbound = True
        try:
            self.ctx.release_workspace(force=not stable, keep_contents=keep_contents)
        except BaseException:
            if not stable and not self.ctx.released:
                self._rebind()  # still held: the views again
            raise
        if not keep_contents:
            self._prefilled = False

    def retake(self) -> None:
        """Takes the workspace back (``ctx.retake_workspace``). Where addresses are not stable (the
        cudaMalloc fallback), the views are made again and the graph is captured again."""
        self.ctx.retake_workspace()
        if not self.ctx.addresses_stable:
            self._rebind()

    def _rebind(self) -> None:
        self._bind()
        self._graph = None
        self._unbound = False

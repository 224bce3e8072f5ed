"""A reference decoder that runs inside an inferctx workspace and equals Hugging Face's model.

Two architectures, built from Hugging Face configs with random weights under a fixed seed (nothing
is downloaded): GPT-2 (multi-head attention, learned positions, LayerNorm, gelu_new, LM head tied
to the embedding) and Llama (grouped-query attention, RoPE, RMSNorm, SwiGLU). Needs torch and
transformers (``pip install 'inferctx[demo]'``); ``import inferctx`` imports neither.

.. code-block:: python

    import torch
    from inferctx.decoder import ReferenceDecoder, build_hf_model, model_spec

    spec = model_spec("llama-tiny")
    model = build_hf_model(spec, seed=0)                          # transformers' LlamaForCausalLM
    dec = ReferenceDecoder(model, batch_size=4, prompt_len=32, max_new_tokens=64, dtype="float16")
    prompt = torch.randint(0, spec.vocab_size, (4, 32), device="cuda")
    out = dec.generate(prompt)            # out.tokens [4, 64]

**What runs where.** The projections, the MLP and the LM head are ``inferctx.gemm(..., out=)`` on the
context's cuBLAS handle; attention's QK^T and PV are ``inferctx.bmm``; MC-dropout (off unless
``dropout=p``) is ``inferctx.dropout(..., out=, mask_out=)``. Embedding lookup, norms, RoPE, GELU /
SiLU, softmax, the mask, KV writes and argmax are torch operations on workspace views, written as
transformers writes them (same operations, order and dtypes) so that the roundings agree. GELU,
SiLU times the up projection and RoPE run instead as one inferctx kernel each (``_fused.py``,
``cuda/src/decoder_ops.cu``) once each has given the bits of torch's sequence on the installed torch
(GELU and SiLU over every float16 / bfloat16 value, a million float32 values; RoPE on random rows of
a prompt and of a decode step); ``fused_kernels`` lists those in use, ``fused=False`` keeps torch's
sequences.

**Buffers.** ``gen_workspace(spec.model_shape(), batch_size=, prompt_len=, max_out_tokens=prompt_len
+ max_new_tokens, min_out_tokens=prompt_len + max_new_tokens, dtype=)`` plans the workspace (all of
it, or WorkspaceOOMError naming the max_new_tokens or batch_size that would fit). K and V of layer l are ``ctx.kv_cache(l)``
([batch, kv_heads, max_tokens, head_dim_padded]; the first head_dim columns are used). The
activations region is cut (256-byte aligned) into: logits [batch, vocab], the residual stream x,
the block output, Llama's RMSNorm output, then one area shared by the attention phase (fused QKV
projection, queries head-major, attention output, RoPE scratch, rotated keys) and the MLP phase
(the up / gate-up projection, GELU scratch), each sized for batch x prompt_len rows; a decode step
uses the first batch rows of the same buffers. Attention scores and softmax probabilities are two
buffers of the attention-scores region. Where a region is too small for its part (a plan whose
max_tokens hardly exceeds prompt_len), that part is allocated once, up front, by torch
(``decoder.extra_bytes`` says how much; 0 in the usual case). Outside the workspace: LayerNorm's
output and RMSNorm's float32 statistics (torch operations without ``out=``; under capture they
live in the graph's memory pool), a few int64 vectors (token ids, the position, the output tokens),
the masks and the RoPE cos / sin tables.

**Positions and the CUDA graph.** The prompt runs eagerly (positions 0..L-1, a causal mask over the
L keys). Each decode step reads its position from a device tensor ``pos``: the embedding / RoPE row
is gathered at ``pos``, K and V are written with ``index_copy_`` at ``pos``, and attention runs over
the full planned length ``max_tokens`` with the keys after ``pos`` masked out (a mask computed on
the device from ``pos``); the step ends by taking the argmax into the next input token, adding 1
to ``pos`` and storing the token. So the step has static shapes and addresses and no host input:
it is captured once (``torch.cuda.CUDAGraph``) on the decoder's side stream, right after the first
decode step has run eagerly on that stream (the warm-up), and replayed for every later step of
this and later generations. Before each step the host counts the token (``ctx.advance_tokens(1)``,
which raises TokenLimitError at ``ctx.max_token_length`` before anything is queued). The prompt's
prefill sets V past the prompt to zero, so that the masked positions (zero weight) add exact zeros
whatever the memory held.

**Release and retake.** ``decoder.release(keep_contents=...)`` / ``decoder.retake()`` (or the
context's own calls) keep the graph: the workspace keeps its addresses (``ctx.addresses_stable``);
under the cudaMalloc fallback ``retake()`` makes the views again and the graph is captured again.
With ``keep_contents=True`` a generation goes on after the retake with the same tokens.

**On the CPU** (``ctx=CpuContext()``): the same code, planned by the same planner, with products
through torch under inferctx.gemm's contract and no graph; used to check the arithmetic against
Hugging Face without a GPU.

Limits: greedy decoding of equal-length prompts (no padding masks); a batch smaller than planned is
padded with its first row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._spec import ALIASES, PRESETS, ModelSpec, model_spec  # no torch: the CLI checks these first

# name -> the submodule that defines it (they import torch): loaded on first access (PEP 562)
_LAZY = {"ReferenceDecoder": "_decoder", "Generation": "_decoder", "build_hf_model": "_models",
         "hf_reference_logits": "_models", "CpuContext": "_backend"}

if TYPE_CHECKING:
    from ._backend import CpuContext as CpuContext
    from ._decoder import Generation as Generation, ReferenceDecoder as ReferenceDecoder
    from ._models import build_hf_model as build_hf_model, hf_reference_logits as hf_reference_logits


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    try:
        loaded = importlib.import_module(f".{module}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name not in ("torch", "transformers"):
            raise
        raise ModuleNotFoundError(f"inferctx.decoder.{name} needs torch (and transformers for the Hugging Face "
                                  f"models): pip install 'inferctx[demo]'", name=exc.name) from exc
    value = getattr(loaded, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["ReferenceDecoder", "Generation", "ModelSpec", "PRESETS", "ALIASES", "model_spec",
           "build_hf_model", "hf_reference_logits", "CpuContext"]

"""The Hugging Face model built from a spec with random weights under a fixed seed, the weights
taken from it, and the Hugging Face reference run (its own KV cache, one token at a time) that the
decoder is checked against.

torch and transformers are imported here, never by ``import inferctx``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, _brief
from .._plan_args import INT64_MAX
from ._spec import ModelSpec, _index

__all__ = ["build_hf_model", "Weights", "LayerWeights", "hf_reference_logits", "TORCH_DTYPES"]

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build_hf_model(spec: ModelSpec, seed: int = 0) -> Any:
    """The Hugging Face model of ``spec`` (GPT2LMHeadModel or LlamaForCausalLM) in float32 on the
    CPU (whatever torch's default device), its weights drawn by the model's own initialisation from
    the CPU generator seeded with ``seed``, as ``torch.manual_seed(seed)`` seeds it; the caller's
    RNG state, the CPU's and every accelerator's, is kept. Nothing is downloaded. ``seed``: an
    integer in [0, 2**64), the seeds torch's generator holds (torch.manual_seed also takes
    negative ones, which are other names of seeds in that range)."""
    import importlib

    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"spec: got {_brief(spec)} ({type(spec).__name__}); it must be a ModelSpec, such as "
                          f"model_spec('gpt2-tiny') gives", argument="spec")
    n = _index(seed)
    if n is None or not 0 <= n < 1 << 64:
        raise ConfigError(f"seed: got {_brief(seed)}; it must be an integer in [0, 2**64)", argument="seed")
    weights = spec.num_params * 4  # float32
    if weights > INT64_MAX:
        raise ConfigError(f"spec: the model has {spec.num_params:,} parameters: in float32 its weights need more "
                          f"than 2**63 bytes; give smaller num_layers, hidden, vocab_size or intermediate",
                          argument="spec")
    transformers: Any = importlib.import_module("transformers")
    config = spec.hf_config()
    cls: Any = transformers.GPT2LMHeadModel if spec.arch == "gpt2" else transformers.LlamaForCausalLM
    # Only the CPU generator is seeded (torch.manual_seed would seed every CUDA device's too, and
    # fork_rng(devices=[]) restores the CPU's alone); the model is made on the CPU even where a
    # default device is set, so its weights come from that generator.
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.default_generator.manual_seed(n)
        model = cls(config)
    model.eval()
    for flag in ("eos_token_id", "bos_token_id"):  # generation runs its full length
        setattr(model.generation_config, flag, None)
    model.generation_config.pad_token_id = 0
    return model


def _hf_generate_kwargs(prompt: torch.Tensor, n: int) -> dict[str, Any]:
    """transformers' generate for exactly the decoder's greedy run of `n` new tokens on `prompt`.
    The attention mask says every prompt token is real: the model's pad_token_id is 0 (above),
    and without a mask generate takes every prompt token 0 for padding and masks it."""
    return dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0,
                attention_mask=torch.ones_like(prompt))


@dataclass
class LayerWeights:
    """One layer's weights in the layout the decoder multiplies with.

    ``qkv``: GPT-2's c_attn weight [hidden, 3 * hidden] (used as is), or Llama's q, k and v
    weights stacked [(heads + 2 * kv_heads) * head_dim, hidden] (used transposed); likewise
    ``up`` is GPT-2's c_fc [hidden, intermediate] or Llama's gate and up stacked
    [2 * intermediate, hidden]; ``Weights.trans`` says which.
    """

    norm1_w: torch.Tensor
    norm1_b: torch.Tensor | None
    qkv: torch.Tensor
    qkv_b: torch.Tensor | None
    out: torch.Tensor
    out_b: torch.Tensor | None
    norm2_w: torch.Tensor
    norm2_b: torch.Tensor | None
    up: torch.Tensor
    up_b: torch.Tensor | None
    down: torch.Tensor
    down_b: torch.Tensor | None


@dataclass
class Weights:
    """The model's weights on the decoder's device, in its dtype."""

    embed: torch.Tensor  # [vocab, hidden]
    positions: torch.Tensor | None  # GPT-2's wpe [max_positions, hidden]
    layers: list[LayerWeights]
    norm_w: torch.Tensor
    norm_b: torch.Tensor | None
    lm_head: torch.Tensor  # [vocab, hidden], used transposed (GPT-2: the embedding itself)
    inv_freq: torch.Tensor | None  # Llama's RoPE inverse frequencies (float32), as the model holds them
    trans: bool  # projections are [out, in] (Llama, nn.Linear) rather than [in, out] (GPT-2, Conv1D)

    @classmethod
    def from_hf(cls, model: Any, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> Weights:
        sd: dict[str, torch.Tensor] = {k: v.detach() for k, v in model.state_dict().items()}
        meta = next((k for k, v in sd.items() if v.device.type == "meta"), None)
        if meta is not None:
            raise ConfigError(f"model: a {type(model).__name__} whose weights are on the meta device (such as "
                              f"{meta!r}), which holds no values; it must hold its weights on the CPU or a GPU "
                              f"(load or initialise them first)", argument="model")
        # The causal-LM classes' names of the weights; the bare ones (GPT2Model, LlamaModel) lack
        # the prefix and the LM head.
        first = "transformer.wte.weight" if spec.arch == "gpt2" else "model.embed_tokens.weight"
        if first not in sd:
            kind = "GPT2LMHeadModel" if spec.arch == "gpt2" else "LlamaForCausalLM"
            raise ConfigError(f"model: a {type(model).__name__} has no {first!r} among its weights; the "
                              f"reference decoder takes the causal-LM model ({kind}, as "
                              f"AutoModelForCausalLM gives it)", argument="model")

        def get(key: str) -> torch.Tensor:
            if key not in sd:
                raise ConfigError(f"model: a {type(model).__name__} has no {key!r} among its weights, which "
                                  f"its config ({spec.arch}, {spec.num_layers} layers) calls for",
                                  argument="model")
            return sd[key].to(device=device, dtype=dtype).contiguous()

        def opt(key: str) -> torch.Tensor | None:
            return get(key) if key in sd else None

        def cat(*keys: str) -> torch.Tensor:
            return torch.cat([get(k) for k in keys], dim=0)

        def opt_cat(*keys: str) -> torch.Tensor | None:
            return cat(*keys) if all(k in sd for k in keys) else None

        layers = []
        if spec.arch == "gpt2":
            for i in range(spec.num_layers):
                p = f"transformer.h.{i}."
                layers.append(LayerWeights(
                    get(p + "ln_1.weight"), get(p + "ln_1.bias"), get(p + "attn.c_attn.weight"),
                    get(p + "attn.c_attn.bias"), get(p + "attn.c_proj.weight"), get(p + "attn.c_proj.bias"),
                    get(p + "ln_2.weight"), get(p + "ln_2.bias"), get(p + "mlp.c_fc.weight"),
                    get(p + "mlp.c_fc.bias"), get(p + "mlp.c_proj.weight"), get(p + "mlp.c_proj.bias")))
            embed = get("transformer.wte.weight")
            head = get("lm_head.weight") if "lm_head.weight" in sd and not _tied(model) else embed
            return cls(embed, get("transformer.wpe.weight"), layers, get("transformer.ln_f.weight"),
                       get("transformer.ln_f.bias"), head, None, trans=False)
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layers.append(LayerWeights(
                get(p + "input_layernorm.weight"), None,
                cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                opt_cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                get(a + "o_proj.weight"), opt(a + "o_proj.bias"), get(p + "post_attention_layernorm.weight"), None,
                cat(m + "gate_proj.weight", m + "up_proj.weight"), opt_cat(m + "gate_proj.bias", m + "up_proj.bias"),
                get(m + "down_proj.weight"), opt(m + "down_proj.bias")))
        embed = get("model.embed_tokens.weight")
        head = embed if _tied(model) or "lm_head.weight" not in sd else get("lm_head.weight")
        inv_freq: torch.Tensor = model.model.rotary_emb.inv_freq.detach().to(device=device, dtype=torch.float32)
        return cls(embed, None, layers, get("model.norm.weight"), None, head, inv_freq, trans=True)


def _tied(model: Any) -> bool:
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    return out is not None and inp is not None and out.weight.data_ptr() == inp.weight.data_ptr()


def _check_reference_args(model: Any, prompt: Any, new_tokens: Any) -> None:
    """ConfigError naming `model`, `prompt` or `new_tokens` for what hf_reference_logits cannot run."""
    from ._decoder import _check_prompt, _check_token_range, _model_config

    config = _model_config(model)
    vocab = int(config.vocab_size)
    _check_prompt(prompt)
    _check_prompt(new_tokens, "new_tokens", "[batch, n]")
    rows, length = prompt.shape
    if length < 1 or rows < 1:
        raise ConfigError(f"prompt: got a {tuple(prompt.shape)} tensor; it needs at least one sequence of at least "
                          f"one token", argument="prompt")
    if new_tokens.shape[0] != rows or new_tokens.shape[1] < 1:
        raise ConfigError(f"new_tokens: got shape {tuple(new_tokens.shape)}; it must be [{rows}, n] with n >= 1 (the "
                          f"prompt's {rows} sequences)", argument="new_tokens")
    device = next((t.device for t in model.parameters()), None)
    if device is not None and device.type == "meta":
        raise ConfigError(f"model: a {type(model).__name__} whose weights are on the meta device, which holds no "
                          f"values; it must hold its weights on the CPU or a GPU", argument="model")
    for name, t in (("prompt", prompt), ("new_tokens", new_tokens)):
        if device is not None and t.device != device:
            raise ConfigError(f"{name}: it is on {t.device} and the model on {device}; give it on {device}",
                              argument=name)
        _check_token_range(t, vocab, name)
    total = length + new_tokens.shape[1] - 1  # the last new token is not fed
    positions = getattr(config, "n_positions", None) if getattr(config, "model_type", None) == "gpt2" else None
    if positions is not None and total > positions:
        raise ConfigError(f"new_tokens: a prompt of {length} tokens and {new_tokens.shape[1]} new tokens feed "
                          f"{total} positions, past GPT-2's n_positions={positions}", argument="new_tokens")


def _cache_keyword(model: Any) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hf_reference_logits(model: Any, prompt: torch.Tensor, new_tokens: torch.Tensor) -> torch.Tensor:
    """Logits [n, batch, vocab] of the Hugging Face model run with its own KV cache: the prompt
    [batch, L] in one call, then ``new_tokens`` [batch, n] one at a time (teacher forcing), each
    call fed ``past_key_values``; row i predicts the token after the prompt and i new tokens.
    ``prompt`` and ``new_tokens``: integer token ids on the model's device, of as many rows, with
    at least one new token (ConfigError naming the argument otherwise)."""
    from transformers import DynamicCache

    _check_reference_args(model, prompt, new_tokens)
    cache = DynamicCache()
    keyword = _cache_keyword(model)
    out = []
    with torch.no_grad():
        logits = model(prompt, use_cache=True, **{keyword: cache}).logits
        out.append(logits[:, -1].clone())
        for i in range(new_tokens.shape[1] - 1):
            logits = model(new_tokens[:, i:i + 1], use_cache=True, **{keyword: cache}).logits
            out.append(logits[:, -1].clone())
    return torch.stack(out)

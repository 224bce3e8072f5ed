"""The two architectures of the reference decoder: specs and presets, the Hugging Face model built
from a spec with random weights under a fixed seed, the weights taken from it, and the Hugging
Face reference run (its own KV cache, one token at a time) that the decoder is checked against.

torch and transformers are imported here, never by ``import inferctx``.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..planning import ModelShape

__all__ = ["ModelSpec", "PRESETS", "model_spec", "build_hf_model", "Weights", "LayerWeights",
           "hf_reference_logits", "TORCH_DTYPES"]

ARCHS = ("gpt2", "llama")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16"}


def dtype_name(dtype: object) -> str:
    """'float32', 'float16' or 'bfloat16' from a name, an alias or a torch dtype."""
    for name, t in TORCH_DTYPES.items():
        if dtype is t:
            return name
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
        if name in TORCH_DTYPES:
            return name
    raise ConfigError(f"dtype: got {dtype!r}; valid: float32, float16, bfloat16", argument="dtype")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of one of the two architectures.

    ``arch`` 'gpt2': multi-head attention, learned positions, LayerNorm, gelu_new, LM head tied to
    the token embedding. ``arch`` 'llama': grouped-query attention (``num_kv_heads`` may be below
    ``num_heads``), RoPE, RMSNorm, SwiGLU, an untied LM head.
    """

    arch: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    intermediate: int
    max_positions: int
    head_dim: int = 0  # 0: hidden // num_heads

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"arch: got {self.arch!r}; valid: {', '.join(ARCHS)}", argument="arch")
        for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "vocab_size", "intermediate",
                     "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: got {value!r}; it must be a positive integer", argument=name)
        if self.head_dim == 0:
            if self.hidden % self.num_heads:
                raise ConfigError(f"hidden: {self.hidden} is not divisible by num_heads={self.num_heads}",
                                  argument="hidden")
            object.__setattr__(self, "head_dim", self.hidden // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads: got {self.num_kv_heads}; it must divide num_heads="
                              f"{self.num_heads}", argument="num_kv_heads")
        if self.arch == "gpt2":
            if self.num_kv_heads != self.num_heads:
                raise ConfigError(f"num_kv_heads: GPT-2 has multi-head attention, so num_kv_heads must be "
                                  f"num_heads={self.num_heads}; got {self.num_kv_heads}", argument="num_kv_heads")
            if self.head_dim * self.num_heads != self.hidden:
                raise ConfigError("head_dim: GPT-2's head size is hidden / num_heads", argument="head_dim")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim: got {self.head_dim}; it must be even", argument="head_dim")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def model_shape(self) -> ModelShape:
        """The shape the workspace is planned for."""
        head = None if self.head_dim * self.num_heads == self.hidden else self.head_dim
        return ModelShape(self.num_layers, self.num_heads, self.hidden, num_kv_heads=self.num_kv_heads,
                          head_dim=head)

    def describe(self) -> str:
        kv = "" if self.num_kv_heads == self.num_heads else f" ({self.num_kv_heads} KV)"
        return (f"{self.arch}: {self.num_layers} layers, {self.num_heads} heads{kv} of {self.head_dim}, "
                f"hidden {self.hidden}, intermediate {self.intermediate}, vocab {self.vocab_size}")

    def hf_config(self) -> Any:
        """The Hugging Face config of this spec (eager attention, the reference's)."""
        import transformers

        special = self.vocab_size - 1  # bos/eos inside the vocabulary; generation never stops on it here
        if self.arch == "gpt2":
            return transformers.GPT2Config(
                n_layer=self.num_layers, n_head=self.num_heads, n_embd=self.hidden, n_inner=self.intermediate,
                vocab_size=self.vocab_size, n_positions=self.max_positions, activation_function="gelu_new",
                bos_token_id=special, eos_token_id=special, attn_implementation="eager")
        return transformers.LlamaConfig(
            num_hidden_layers=self.num_layers, hidden_size=self.hidden, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate,
            vocab_size=self.vocab_size, max_position_embeddings=self.max_positions, bos_token_id=special,
            eos_token_id=special, tie_word_embeddings=False, attn_implementation="eager")

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        """The spec of a Hugging Face GPT2Config or LlamaConfig; ConfigError for what the reference
        decoder does not implement."""
        kind = getattr(config, "model_type", None)
        if kind == "gpt2":
            unsupported = [name for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                                             "add_cross_attention") if getattr(config, name, False)]
            if unsupported or getattr(config, "activation_function", "gelu_new") != "gelu_new":
                raise ConfigError(f"model: GPT-2 options {unsupported or ['activation_function']} are not "
                                  f"implemented by the reference decoder", argument="model")
            if not getattr(config, "scale_attn_weights", True):
                raise ConfigError("model: GPT-2 without scale_attn_weights is not implemented", argument="model")
            inner = config.n_inner if config.n_inner is not None else 4 * config.n_embd
            return cls("gpt2", config.n_layer, config.n_embd, config.n_head, config.n_head, config.vocab_size,
                       inner, config.n_positions)
        if kind == "llama":
            rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
            rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
            if rope_type != "default" or getattr(config, "hidden_act", "silu") != "silu" or \
                    getattr(config, "pretraining_tp", 1) != 1:
                raise ConfigError("model: only Llama with default RoPE, silu and pretraining_tp=1 is "
                                  "implemented by the reference decoder", argument="model")
            head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            return cls("llama", config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                       config.num_key_value_heads, config.vocab_size, config.intermediate_size,
                       config.max_position_embeddings, head_dim=head)
        raise ConfigError(f"model: model_type {kind!r} is not one of the reference decoder's "
                          f"architectures (gpt2, llama)", argument="model")


PRESETS: dict[str, ModelSpec] = {
    # GPT-2 small (124M): the real model's shape
    "gpt2-small": ModelSpec("gpt2", 12, 768, 12, 12, 50257, 3072, 1024),
    "gpt2-tiny": ModelSpec("gpt2", 2, 128, 4, 4, 512, 512, 256),
    # A small Llama-architecture model with grouped-query attention (4 query heads per KV head)
    "llama-small": ModelSpec("llama", 8, 1024, 16, 4, 32000, 2816, 2048),
    "llama-tiny": ModelSpec("llama", 2, 256, 8, 2, 512, 688, 512),
}
ALIASES = {"gpt2": "gpt2-small", "llama": "llama-small"}
_OVERRIDES = ("num_layers", "hidden", "num_heads", "num_kv_heads", "vocab_size", "intermediate",
              "max_positions", "head_dim")


def model_spec(name: str, **overrides: Any) -> ModelSpec:
    """A preset ('gpt2-small', 'gpt2-tiny', 'llama-small', 'llama-tiny'; 'gpt2' and 'llama' name
    the small ones) with fields changed, e.g. ``model_spec('llama', num_layers=2)``. Changing
    ``hidden`` or ``num_heads`` of a preset derives ``head_dim`` again (and, for GPT-2, the
    intermediate size is 4 x hidden unless given)."""
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        raise ConfigError(f"model: got {name!r}; valid: {', '.join([*ALIASES, *PRESETS])}", argument="model")
    unknown = sorted(set(overrides) - set(_OVERRIDES))
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a field of the model; valid: {', '.join(_OVERRIDES)}",
                          argument=unknown[0])
    given = {k: v for k, v in overrides.items() if v is not None}
    base = PRESETS[key]
    fields = dataclasses.asdict(base)
    if ("hidden" in given or "num_heads" in given) and "head_dim" not in given:
        fields["head_dim"] = 0
    if base.arch == "gpt2":
        if "num_heads" in given and "num_kv_heads" not in given:
            fields["num_kv_heads"] = given["num_heads"]
        if "hidden" in given and "intermediate" not in given:
            fields["intermediate"] = 4 * given["hidden"]
    fields.update(given)
    return ModelSpec(**fields)


def build_hf_model(spec: ModelSpec, seed: int = 0) -> Any:
    """The Hugging Face model of ``spec`` (GPT2LMHeadModel or LlamaForCausalLM) in float32 on the
    CPU, its weights drawn by the model's own initialisation under ``torch.manual_seed(seed)``
    (the caller's RNG state is kept). Nothing is downloaded."""
    import transformers

    config = spec.hf_config()
    cls = transformers.GPT2LMHeadModel if spec.arch == "gpt2" else transformers.LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.eval()
    for flag in ("eos_token_id", "bos_token_id"):  # generation runs its full length
        setattr(model.generation_config, flag, None)
    model.generation_config.pad_token_id = 0
    return model


@dataclass
class LayerWeights:
    """One layer's weights in the layout the decoder multiplies with.

    ``qkv``: GPT-2's c_attn weight [hidden, 3 * hidden] (used as is), or Llama's q, k and v
    weights stacked [(heads + 2 * kv_heads) * head_dim, hidden] (used transposed); likewise
    ``up`` is GPT-2's c_fc [hidden, intermediate] or Llama's gate and up stacked
    [2 * intermediate, hidden]; ``trans`` says which.
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
        sd = {k: v.detach() for k, v in model.state_dict().items()}

        def get(key: str) -> torch.Tensor:
            return sd[key].to(device=device, dtype=dtype).contiguous()

        def opt(key: str) -> torch.Tensor | None:
            return get(key) if key in sd else None

        def cat(*keys: str) -> torch.Tensor:
            return torch.cat([sd[k] for k in keys], dim=0).to(device=device, dtype=dtype).contiguous()

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
        inv_freq = model.model.rotary_emb.inv_freq.detach().to(device=device, dtype=torch.float32)
        return cls(embed, None, layers, get("model.norm.weight"), None, head, inv_freq, trans=True)


def _tied(model: Any) -> bool:
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    return out is not None and inp is not None and out.weight.data_ptr() == inp.weight.data_ptr()


def _cache_keyword(model: Any) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def hf_reference_logits(model: Any, prompt: torch.Tensor, new_tokens: torch.Tensor) -> torch.Tensor:
    """Logits [n, batch, vocab] of the Hugging Face model run with its own KV cache: the prompt
    [batch, L] in one call, then ``new_tokens`` [batch, n] one at a time (teacher forcing), each
    call fed ``past_key_values``; row i predicts the token after the prompt and i new tokens."""
    from transformers import DynamicCache

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

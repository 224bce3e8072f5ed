"""The reference decoder's model specs and presets (no torch: the CLI checks them before importing it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..dtypes import dtype_name as _dtype_name
from ..errors import ConfigError
from ..planning import ModelShape

__all__ = ["ModelSpec", "PRESETS", "ALIASES", "model_spec", "dtype_name", "DTYPES"]

DTYPES = ("float32", "float16", "bfloat16")
ARCHS = ("gpt2", "llama")


def dtype_name(dtype: object) -> str:
    """'float32', 'float16' or 'bfloat16' from a name, an alias or a NumPy / torch dtype: the
    package's one alias table (inferctx.dtypes), which takes exactly these three."""
    return _dtype_name(dtype, "dtype")


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
        if self.arch == "llama" and self.head_dim % 2:  # RoPE turns pairs of dimensions
            raise ConfigError(f"head_dim: got {self.head_dim}; Llama's RoPE needs it even", argument="head_dim")

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
        import importlib

        transformers: Any = importlib.import_module("transformers")
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
    key = ALIASES.get(name, name) if isinstance(name, str) else None  # [] or {}: unhashable
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

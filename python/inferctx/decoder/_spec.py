"""The reference decoder's model specs and presets (no torch: the CLI checks them before importing it)."""

from __future__ import annotations

import dataclasses
import numbers
import operator
from dataclasses import dataclass
from typing import Any

from .._plan import _as_bool
from .._plan_args import INT64_MAX, _is_flag
from ..dtypes import dtype_name as _dtype_name
from ..errors import ConfigError, _brief
from ..planning import ModelShape

__all__ = ["ModelSpec", "PRESETS", "ALIASES", "model_spec", "dtype_name", "DTYPES"]

DTYPES = ("float32", "float16", "bfloat16")
ARCHS = ("gpt2", "llama")


# A flag argument: True or False (a numpy.bool_ too), as everywhere in the package; 1, None and
# strings ("no" is not False) are a ConfigError naming the argument.
_flag = _as_bool


def _index(value: object) -> int | None:
    """`value` as a Python int where it is an integer (an int, a NumPy integer: anything with
    __index__), None where it is not (a float, a string, None, a bool or numpy.bool_: a flag is
    not a count)."""
    if value is None or _is_flag(value):  # bools of every kind: Python's, NumPy's, a bool tensor
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _positive(value: object, name: str) -> int:
    """A count: an integer in [1, 2**63) (a NumPy integer too; bools and floats refused)."""
    n = _index(value)
    if n is None or n < 1:
        raise ConfigError(f"{name}: got {_brief(value)}; it must be a positive integer", argument=name)
    if n > INT64_MAX:
        raise ConfigError(f"{name}: got {_brief(n)}; it must be a positive integer below 2**63", argument=name)
    return n


def _real(value: object) -> float | None:
    """`value` as a float where it is a real number (a NumPy float too), else None (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except (OverflowError, ValueError, TypeError):
        return None


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
        if not isinstance(self.arch, str) or self.arch not in ARCHS:
            raise ConfigError(f"arch: got {_brief(self.arch)}; valid: {', '.join(ARCHS)}", argument="arch")
        for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "vocab_size", "intermediate",
                     "max_positions"):
            object.__setattr__(self, name, _positive(getattr(self, name), name))  # NumPy integers as ints
        head = _index(self.head_dim)
        if head is None or not 0 <= head <= INT64_MAX:
            raise ConfigError(f"head_dim: got {_brief(self.head_dim)}; it must be a positive integer below "
                              f"2**63 (or 0 for hidden / num_heads)", argument="head_dim")
        object.__setattr__(self, "head_dim", head)
        if self.head_dim == 0:
            if self.hidden % self.num_heads:
                raise ConfigError(f"hidden: {_brief(self.hidden)} is not divisible by num_heads="
                                  f"{_brief(self.num_heads)}", argument="hidden")
            object.__setattr__(self, "head_dim", self.hidden // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_kv_heads: got {_brief(self.num_kv_heads)}; it must divide num_heads="
                              f"{_brief(self.num_heads)}", argument="num_kv_heads")
        if self.arch == "gpt2":
            if self.num_kv_heads != self.num_heads:
                raise ConfigError(f"num_kv_heads: GPT-2 has multi-head attention, so num_kv_heads must be "
                                  f"num_heads={_brief(self.num_heads)}; got {_brief(self.num_kv_heads)}",
                                  argument="num_kv_heads")
            if self.head_dim * self.num_heads != self.hidden:
                raise ConfigError("head_dim: GPT-2's head size is hidden / num_heads", argument="head_dim")
        if self.arch == "llama" and self.head_dim % 2:  # RoPE turns pairs of dimensions
            raise ConfigError(f"head_dim: got {_brief(self.head_dim)}; Llama's RoPE needs it even",
                              argument="head_dim")

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_params(self) -> int:
        """The parameter count of the Hugging Face model ``build_hf_model`` makes of this spec
        (GPT-2: its LM head is the token embedding; Llama: an LM head of its own, no biases)."""
        h, n, V, I = self.hidden, self.num_layers, self.vocab_size, self.intermediate
        if self.arch == "gpt2":  # LayerNorms (weight, bias), c_attn, c_proj, c_fc, c_proj with biases
            layer = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * I + I) + (I * h + h)
            return V * h + self.max_positions * h + n * layer + 2 * h
        H, KV = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h + h * (H + 2 * KV) + H * h + h + 2 * h * I + I * h  # RMSNorms, q k v o, gate up down
        return 2 * V * h + n * layer + h

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
        raise ConfigError(f"model: got {_brief(name)}; valid: {', '.join([*ALIASES, *PRESETS])}", argument="model")
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
        hidden = _index(given.get("hidden"))
        if hidden is not None and "intermediate" not in given:  # a hidden that is no integer: its own error
            if 4 * hidden > INT64_MAX and hidden <= INT64_MAX:
                raise ConfigError(f"hidden: got {_brief(hidden)}; 4 x hidden (GPT-2's MLP size where intermediate "
                                  f"is not given) must be below 2**63: give a smaller hidden, or intermediate",
                                  argument="hidden")
            fields["intermediate"] = 4 * hidden
    fields.update(given)
    return ModelSpec(**fields)


# The planner's names of the model's sizes (its ConfigErrors name them) -> ModelSpec's
_SHAPE_FIELDS = {"num_layers": "num_layers", "num_heads": "num_heads", "hidden_dim": "hidden", "head_dim": "head_dim"}


def _overflows(spec: ModelSpec, batch_size: int, prompt_len: int, tokens: int, dtype: str) -> bool:
    """Whether the workspace of `tokens` tokens per row passes 64 bits (no memory figure involved)."""
    from ..errors import WorkspaceOOMError
    from ..planning import plan_workspace

    try:
        plan_workspace(spec.model_shape(), batch_size=batch_size, prompt_len=prompt_len, max_out_tokens=tokens,
                       min_out_tokens=tokens, dtype=dtype, free_bytes=INT64_MAX, total_bytes=INT64_MAX)
    except ConfigError:
        return True
    except WorkspaceOOMError:
        return False
    return False


def _decoder_terms(exc: ConfigError, spec: ModelSpec, batch_size: int, prompt_len: int, max_new_tokens: int,
                   dtype: str) -> ConfigError:
    """The planner's refusal of a decoder's plan in the decoder's terms. The decoder plans
    max_out_tokens = min_out_tokens = prompt_len + max_new_tokens: the planner's errors that name
    those (or a size of the model) are worded with the keywords the decoder has; `exc` itself
    for any other."""
    total = prompt_len + max_new_tokens
    if exc.argument in _SHAPE_FIELDS:
        field = _SHAPE_FIELDS[exc.argument]
        if "overflow" not in str(exc):
            return exc
        return ConfigError(f"model: the model's {field}={_brief(getattr(spec, field))} makes the workspace's byte "
                           f"count overflow 64 bits (batch_size={batch_size}, prompt_len + max_new_tokens = "
                           f"{_brief(total)} tokens); reduce {field}", argument="model")
    if exc.argument == "batch_size" and "overflow" in str(exc):  # its detail names max_out_tokens
        return ConfigError(f"batch_size: batch_size={_brief(batch_size)} makes the workspace's byte count overflow "
                           f"64 bits (prompt_len + max_new_tokens = {_brief(total)} tokens); reduce batch_size",
                           argument="batch_size")
    if exc.argument not in ("max_out_tokens", "min_out_tokens"):
        return exc
    if _overflows(spec, batch_size, prompt_len, prompt_len + 1, dtype):
        return ConfigError(f"prompt_len: prompt_len={_brief(prompt_len)} makes the workspace's byte count overflow "
                           f"64 bits (batch_size={batch_size}), with any max_new_tokens; reduce prompt_len",
                           argument="prompt_len")
    if total > INT64_MAX:
        return ConfigError(f"max_new_tokens: prompt_len + max_new_tokens = {_brief(total)} tokens; it must be "
                           f"below 2**63", argument="max_new_tokens")
    return ConfigError(f"max_new_tokens: prompt_len + max_new_tokens = {total} tokens make the workspace's byte "
                       f"count overflow 64 bits (batch_size={batch_size}); reduce max_new_tokens",
                       argument="max_new_tokens")


def _check_request(spec: ModelSpec, batch_size: int, prompt_len: int, max_new_tokens: int, dtype: str) -> None:
    """The decoder's request checked as far as it can be without a device or its memory: the
    token count fits int64 and the workspace's byte count 64 bits (ConfigError in the decoder's
    terms). Arithmetic only: nothing is allocated."""
    from ..errors import WorkspaceOOMError
    from ..planning import plan_workspace

    total = prompt_len + max_new_tokens
    try:  # a total past int64 is the planner's ConfigError on max_out_tokens, worded below
        plan_workspace(spec.model_shape(), batch_size=batch_size, prompt_len=prompt_len, max_out_tokens=total,
                       min_out_tokens=total, dtype=dtype, free_bytes=INT64_MAX, total_bytes=INT64_MAX)
    except ConfigError as exc:
        worded = _decoder_terms(exc, spec, batch_size, prompt_len, max_new_tokens, dtype)
        if worded is exc:
            raise
        raise worded from None
    except WorkspaceOOMError:
        pass  # more than 2**63 bytes: no device holds it, which the context's own plan says


def _check_positions(spec: ModelSpec, prompt_len: int, max_new_tokens: int) -> None:
    """GPT-2's learned positions end at n_positions (``max_positions``): the positions a generation
    feeds must fit them. The prompt feeds prompt_len, each new token but the last one more (the
    last is not fed back), as in Hugging Face's ``generate``. ConfigError naming prompt_len where
    the prompt alone passes the positions, max_new_tokens (and the most that fits) otherwise.
    Llama has no such bound."""
    if spec.arch != "gpt2":
        return
    limit = spec.max_positions
    fed = prompt_len + max_new_tokens - 1
    if fed <= limit:
        return
    if prompt_len > limit:
        raise ConfigError(f"prompt_len: got {prompt_len}; GPT-2's n_positions={limit} must hold the prompt: "
                          f"prompt_len <= {limit}", argument="prompt_len")
    raise ConfigError(f"max_new_tokens: prompt_len + max_new_tokens - 1 = {fed} positions fed (the last new token "
                      f"is not fed back) pass GPT-2's n_positions={limit}; max_new_tokens <= "
                      f"{limit - prompt_len + 1} fits", argument="max_new_tokens")

"""ModelShape: the attention shape of a transformer, as the planner takes it."""

from __future__ import annotations

from typing import Any

from . import _plan, dtypes
from ._plan_args import _as_int, _as_opt_int
from .errors import ConfigError, _brief


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

    _FIELDS = ("num_layers", "num_heads", "hidden_dim", "num_kv_heads", "head_dim", "num_params")
    # _defaulted: the fields worked out from others (num_kv_heads, head_dim) rather than given,
    # which replace() and pickling work out again rather than carry.
    __slots__ = _FIELDS + ("_defaulted",)
    num_layers: int
    num_heads: int
    hidden_dim: int
    num_kv_heads: int
    head_dim: int
    num_params: int | None
    _defaulted: frozenset[str]

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
        if heads % kv:  # the planner's check, where the shape is made (it was met only when planning)
            raise ConfigError(f"num_kv_heads: num_heads={heads} is not divisible by num_kv_heads={kv}; each KV "
                              f"head must serve a whole group of query heads", argument="num_kv_heads")
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
        object.__setattr__(self, "_defaulted", frozenset(
            name for name, given in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim))
            if given is None))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ModelShape is immutable: make a new one instead of setting {name}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"ModelShape is immutable: make a new one instead of deleting {name}")

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

    def _arguments(self) -> dict[str, Any]:
        """The constructor's arguments: None for the fields it worked out itself."""
        return {name: None if name in self._defaulted else value
                for name, value in zip(self._FIELDS, self._key())}

    def __reduce__(self) -> tuple[Any, ...]:
        return (ModelShape, tuple(self._arguments().values()))

    def replace(self, **changes: Any) -> ModelShape:
        """A copy with some fields changed, e.g. ``shape.replace(num_kv_heads=8)``. Fields that
        were not given but worked out (num_kv_heads = num_heads, head_dim = hidden_dim /
        num_heads) are worked out again from the changed ones."""
        fields = self._arguments()
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
        from .presets import _model_info

        return _model_info(shape, "shape").shape
    raise ConfigError(f"shape: got {_brief(shape)}; pass an inferctx.ModelShape or a preset name "
                      f"such as 'llama-2-7b'", argument="shape")


# Users see it, its repr and its pickles as inferctx.planning.ModelShape, the module that exports it.
ModelShape.__module__ = "inferctx.planning"

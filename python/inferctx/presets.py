"""Built-in presets: model shapes and parameter counts from their published configs, GPU memory sizes."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._plan_args import _is_flag
from .errors import ConfigError, _brief

if TYPE_CHECKING:
    from .planning import ModelShape

__all__ = ["MODEL_PRESETS", "GPU_PRESETS", "ModelPreset", "GpuPreset", "model_preset", "model_info",
           "gpu_preset", "CUDA_OVERHEAD_BYTES"]


@dataclass(frozen=True)
class ModelPreset:
    """A model's published figures: its attention shape, what its weights are made of, and its
    parameter count (what the weights' bytes are worked out from)."""

    name: str
    num_layers: int
    num_heads: int
    hidden_dim: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int  # of one expert's MLP
    tied_embeddings: bool   # the output projection shares the input embedding's matrix
    num_params: int         # every weight of the model, embeddings included
    source: str             # the config the figures come from
    num_experts: int = 1    # mixture-of-experts MLPs per layer (all resident in memory)

    @property
    def shape(self) -> ModelShape:
        """The ModelShape the planner takes, with the parameter count for the weights."""
        from .planning import ModelShape

        return ModelShape(self.num_layers, self.num_heads, self.hidden_dim, self.num_kv_heads,
                          head_dim=self.head_dim, num_params=self.num_params)


def _m(name: str, layers: int, heads: int, hidden: int, kv: int, head: int, vocab: int, inter: int,
       tied: bool, params: int, source: str, experts: int = 1) -> ModelPreset:
    return ModelPreset(name, layers, heads, hidden, kv, head, vocab, inter, tied, params, source, experts)


# Figures from each model's published config.json (num_hidden_layers / n_layer,
# num_attention_heads / n_head, hidden_size / n_embd, num_key_value_heads / multi_query,
# head_dim, vocab_size, intermediate_size / ffn_dim, tie_word_embeddings) and the parameter
# count of its released weights (the sum of the checkpoint's tensor sizes, as the Hugging Face
# model page reports it; for GPT-J the figure its model card gives, 2,498,560 more than its
# config's tensors add up to). tests/python/test_presets.py re-derives every count from the
# figures, layer by layer.
_MODEL_LIST = [
    _m("llama-2-7b", 32, 32, 4096, 32, 128, 32000, 11008, False, 6_738_415_616, "meta-llama/Llama-2-7b-hf"),
    _m("llama-2-13b", 40, 40, 5120, 40, 128, 32000, 13824, False, 13_015_864_320, "meta-llama/Llama-2-13b-hf"),
    _m("llama-2-70b", 80, 64, 8192, 8, 128, 32000, 28672, False, 68_976_648_192, "meta-llama/Llama-2-70b-hf"),
    _m("llama-3-8b", 32, 32, 4096, 8, 128, 128256, 14336, False, 8_030_261_248, "meta-llama/Meta-Llama-3-8B"),
    _m("llama-3-70b", 80, 64, 8192, 8, 128, 128256, 28672, False, 70_553_706_496, "meta-llama/Meta-Llama-3-70B"),
    _m("llama-3.1-405b", 126, 128, 16384, 8, 128, 128256, 53248, False, 405_853_388_800,
       "meta-llama/Llama-3.1-405B"),
    _m("mistral-7b", 32, 32, 4096, 8, 128, 32000, 14336, False, 7_241_732_096, "mistralai/Mistral-7B-v0.1"),
    _m("mixtral-8x7b", 32, 32, 4096, 8, 128, 32000, 14336, False, 46_702_792_704,
       "mistralai/Mixtral-8x7B-v0.1", experts=8),
    _m("qwen2-7b", 28, 28, 3584, 4, 128, 152064, 18944, False, 7_615_616_512, "Qwen/Qwen2-7B"),
    _m("qwen2-72b", 80, 64, 8192, 8, 128, 152064, 29568, False, 72_706_203_648, "Qwen/Qwen2-72B"),
    _m("falcon-7b", 32, 71, 4544, 1, 64, 65024, 18176, True, 6_921_720_704, "tiiuae/falcon-7b (multi_query)"),
    _m("falcon-40b", 60, 128, 8192, 8, 64, 65024, 32768, True, 41_303_293_952, "tiiuae/falcon-40b"),
    _m("gemma-2b", 18, 8, 2048, 1, 256, 256000, 16384, True, 2_506_172_416, "google/gemma-2b"),
    _m("gemma-7b", 28, 16, 3072, 16, 256, 256000, 24576, True, 8_537_680_896, "google/gemma-7b"),
    _m("gemma-2-9b", 42, 16, 3584, 8, 256, 256000, 14336, True, 9_241_705_984, "google/gemma-2-9b"),
    _m("gemma-2-27b", 46, 32, 4608, 16, 128, 256000, 36864, True, 27_227_128_320, "google/gemma-2-27b"),
    _m("phi-3-mini", 32, 32, 3072, 32, 96, 32064, 8192, False, 3_821_079_552, "microsoft/Phi-3-mini-4k-instruct"),
    _m("gpt-j-6b", 28, 16, 4096, 16, 256, 50400, 16384, False, 6_053_381_344, "EleutherAI/gpt-j-6b"),
    _m("opt-30b", 48, 56, 7168, 56, 128, 50272, 28672, True, 29_974_540_288, "facebook/opt-30b"),
    _m("opt-66b", 64, 72, 9216, 72, 128, 50272, 36864, True, 65_719_701_504, "facebook/opt-66b"),
    _m("bloom-176b", 70, 112, 14336, 112, 128, 250880, 57344, True, 176_247_271_424, "bigscience/bloom"),
]
_MODELS = {m.name: m for m in _MODEL_LIST}

# Memory the CUDA driver and a context take before a workspace can be planned, measured on an
# idle NVIDIA H200 (driver 580.159.04, CUDA 13.0): nvidia-smi's total is 143771 MiB, and the
# free memory inferctx's gen_workspace reads once its context, cuBLAS handle and 32 MiB cuBLAS
# workspace exist is 149,450,522,624 bytes (142527.6 MiB): 1243.4 MiB, 1244 MiB rounded up.
# Of it, 614.5 MiB the driver reserves (cudaMemGetInfo's total is 143156.5 MiB), 526.8 MiB a
# bare context, 68.0 MiB cuBLAS's handle, 32 MiB its workspace, 1.9 MiB inferctx's streams,
# events and pool. Used for every GPU preset; on a real device gen_workspace and
# plan_workspace(device=) read free memory instead.
CUDA_OVERHEAD_MIB = 1244
CUDA_OVERHEAD_BYTES = CUDA_OVERHEAD_MIB << 20


# The most MiB whose byte count fits int64_t, the planner's byte counts.
_MAX_TOTAL_MIB = ((1 << 63) - 1) >> 20


@dataclass(frozen=True)
class GpuPreset:
    """A GPU's memory: nvidia-smi's total (MiB) and what is free for planning on it.

    ``name`` and ``description`` are strings, ``total_mib`` a positive integer (a NumPy integer is
    taken as its int; bool and floats are refused). Planning against one needs ``total_mib`` above
    CUDA_OVERHEAD_MIB.
    """

    name: str
    description: str
    total_mib: int

    def __post_init__(self) -> None:
        for field in ("name", "description"):
            value = getattr(self, field)
            if not isinstance(value, str):
                raise ConfigError(f"{field}: got {_brief(value)} ({type(value).__name__}); it must be a string",
                                  argument=field)
        mib: object = self.total_mib
        if _is_flag(mib) or not hasattr(type(mib), "__index__"):
            raise ConfigError(f"total_mib: got {_brief(mib)} ({type(mib).__name__}); it must be a whole number "
                              f"of MiB", argument="total_mib")
        total = operator.index(mib)  # type: ignore[arg-type]
        if not 1 <= total <= _MAX_TOTAL_MIB:
            raise ConfigError(f"total_mib: got {_brief(total)}; it must be a number of MiB in [1, "
                              f"{_MAX_TOTAL_MIB:,}] (its byte count below 2**63)", argument="total_mib")
        object.__setattr__(self, "total_mib", total)  # a NumPy integer as the int it stands for

    @property
    def total_bytes(self) -> int:
        return self.total_mib << 20

    @property
    def free_bytes(self) -> int:
        """Total less CUDA_OVERHEAD_BYTES: what a process sees free before loading its weights."""
        return self.total_bytes - CUDA_OVERHEAD_BYTES


_GPUS = {
    "a100-40gb": GpuPreset("a100-40gb", "NVIDIA A100-SXM4-40GB", 40960),
    "a100-80gb": GpuPreset("a100-80gb", "NVIDIA A100-SXM4-80GB", 81920),
    "h100-80gb": GpuPreset("h100-80gb", "NVIDIA H100 80GB HBM3", 81559),
    "h200": GpuPreset("h200", "NVIDIA H200 (141 GB HBM3e)", 143771),
    "l40s": GpuPreset("l40s", "NVIDIA L40S (48 GB)", 46068),
    "rtx-4090": GpuPreset("rtx-4090", "NVIDIA GeForce RTX 4090 (24 GB)", 24564),
}

MODEL_PRESETS = tuple(_MODELS)
GPU_PRESETS = tuple(_GPUS)


def _key(name: object) -> str | None:
    return name.strip().lower().replace("_", "-") if isinstance(name, str) else None


def _lookup(table: dict[str, Any], name: object, kind: str, argument: str) -> Any:
    key = _key(name)
    if key not in table:
        if not isinstance(name, str):  # a preset is named by a string: say what came instead
            raise ConfigError(f"{argument}: unknown {kind} preset: got {_brief(name)} ({type(name).__name__}), "
                              f"not a name; valid: {', '.join(table)}", argument=argument)
        raise ConfigError(f"{argument}: unknown {kind} preset {_brief(name)}; valid: {', '.join(table)}",
                          argument=argument)
    return table[key]


def _model_info(name: object, argument: str) -> ModelPreset:
    """A model preset by name; an unknown one is a ConfigError naming `argument`, the caller's
    keyword (or the command's flag) that gave the name."""
    entry: ModelPreset = _lookup(_MODELS, name, "model", argument)
    return entry


def _gpu_preset(name: object, argument: str) -> GpuPreset:
    """A GPU preset by name; an unknown one is a ConfigError naming `argument`."""
    entry: GpuPreset = _lookup(_GPUS, name, "GPU", argument)
    return entry


def model_info(name: str) -> ModelPreset:
    """Every published figure of a model preset (case-insensitive, e.g. 'llama-2-70b')."""
    return _model_info(name, "name")


def model_preset(name: str) -> ModelShape:
    """The ModelShape of a model preset (case-insensitive, e.g. 'llama-2-70b')."""
    return model_info(name).shape


def model_source(name: str) -> str:
    """The config a model preset's figures come from."""
    return model_info(name).source


def gpu_preset(name: str) -> GpuPreset:
    """A GPU memory preset (case-insensitive, e.g. 'h100-80gb', 'h200')."""
    return _gpu_preset(name, "name")

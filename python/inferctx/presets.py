"""Built-in presets: model shapes from their published configs and GPU memory sizes."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["MODEL_PRESETS", "GPU_PRESETS", "GpuPreset", "model_preset", "gpu_preset"]


@dataclass(frozen=True)
class _ModelEntry:
    num_layers: int
    num_heads: int
    hidden_dim: int
    num_kv_heads: int
    source: str  # the config the figures come from


# Figures from each model's published config.json (num_hidden_layers / n_layer,
# num_attention_heads / n_head, hidden_size / n_embd, num_key_value_heads / multi_query).
_MODELS = {
    "llama-2-7b": _ModelEntry(32, 32, 4096, 32, "meta-llama/Llama-2-7b-hf"),
    "llama-2-13b": _ModelEntry(40, 40, 5120, 40, "meta-llama/Llama-2-13b-hf"),
    "llama-2-70b": _ModelEntry(80, 64, 8192, 8, "meta-llama/Llama-2-70b-hf"),
    "llama-3-8b": _ModelEntry(32, 32, 4096, 8, "meta-llama/Meta-Llama-3-8B"),
    "llama-3-70b": _ModelEntry(80, 64, 8192, 8, "meta-llama/Meta-Llama-3-70B"),
    "llama-3.1-405b": _ModelEntry(126, 128, 16384, 8, "meta-llama/Llama-3.1-405B"),
    "mistral-7b": _ModelEntry(32, 32, 4096, 8, "mistralai/Mistral-7B-v0.1"),
    "mixtral-8x7b": _ModelEntry(32, 32, 4096, 8, "mistralai/Mixtral-8x7B-v0.1"),
    "qwen2-7b": _ModelEntry(28, 28, 3584, 4, "Qwen/Qwen2-7B"),
    "qwen2-72b": _ModelEntry(80, 64, 8192, 8, "Qwen/Qwen2-72B"),
    "falcon-7b": _ModelEntry(32, 71, 4544, 1, "tiiuae/falcon-7b (multi_query)"),
    "falcon-40b": _ModelEntry(60, 128, 8192, 8, "tiiuae/falcon-40b"),
    "gemma-2b": _ModelEntry(18, 8, 2048, 1, "google/gemma-2b"),
    "phi-3-mini": _ModelEntry(32, 32, 3072, 32, "microsoft/Phi-3-mini-4k-instruct"),
    "gpt-j-6b": _ModelEntry(28, 16, 4096, 16, "EleutherAI/gpt-j-6b"),
    "opt-30b": _ModelEntry(48, 56, 7168, 56, "facebook/opt-30b"),
    "opt-66b": _ModelEntry(64, 72, 9216, 72, "facebook/opt-66b"),
    "bloom-176b": _ModelEntry(70, 112, 14336, 112, "bigscience/bloom"),
}


@dataclass(frozen=True)
class GpuPreset:
    """A GPU's memory as the driver reports it (nvidia-smi's total, in MiB)."""

    name: str
    description: str
    total_mib: int

    @property
    def total_bytes(self) -> int:
        return self.total_mib * 1024 * 1024

    @property
    def free_bytes(self) -> int:
        # A device with nothing else on it; the planner's reserve covers the CUDA context.
        return self.total_bytes


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


def _lookup(table: dict, name, kind: str, argument: str):
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else None
    if key not in table:
        raise ConfigError(f"{argument}: unknown {kind} preset {name!r}; valid: {', '.join(table)}",
                          argument=argument)
    return table[key]


def model_preset(name: str):
    """The ModelShape of a model preset (case-insensitive, e.g. 'llama-2-70b')."""
    from .planning import ModelShape

    e = _lookup(_MODELS, name, "model", "preset")
    return ModelShape(e.num_layers, e.num_heads, e.hidden_dim, e.num_kv_heads)


def model_source(name: str) -> str:
    return _lookup(_MODELS, name, "model", "preset").source


def gpu_preset(name: str) -> GpuPreset:
    """A GPU memory preset (case-insensitive, e.g. 'h100-80gb', 'h200')."""
    return _lookup(_GPUS, name, "GPU", "gpu")

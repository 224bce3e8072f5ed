"""Presets against the figures their published configs and drivers give."""

import pytest

import inferctx
from inferctx import ConfigError, ModelShape
from inferctx.presets import gpu_preset, model_preset

# (layers, heads, hidden, kv heads) from each model's config.json
PUBLISHED = {
    "llama-2-7b": (32, 32, 4096, 32),
    "llama-2-13b": (40, 40, 5120, 40),
    "llama-2-70b": (80, 64, 8192, 8),
    "llama-3-8b": (32, 32, 4096, 8),
    "llama-3-70b": (80, 64, 8192, 8),
    "mistral-7b": (32, 32, 4096, 8),
    "qwen2-7b": (28, 28, 3584, 4),
    "falcon-7b": (32, 71, 4544, 1),
    "opt-66b": (64, 72, 9216, 72),
    "bloom-176b": (70, 112, 14336, 112),
}

# nvidia-smi's total memory in MiB
GPUS = {"a100-40gb": 40960, "a100-80gb": 81920, "h100-80gb": 81559, "h200": 143771, "l40s": 46068,
        "rtx-4090": 24564}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_presets(name):
    s = model_preset(name)
    assert (s.num_layers, s.num_heads, s.hidden_dim, s.num_kv_heads) == PUBLISHED[name]


def test_at_least_ten_models_with_gqa_and_mqa():
    shapes = [model_preset(n) for n in inferctx.MODEL_PRESETS]
    assert len(shapes) >= 10
    assert any(1 < s.num_kv_heads < s.num_heads for s in shapes)  # GQA
    assert any(s.num_kv_heads == 1 for s in shapes)                # MQA


@pytest.mark.parametrize("name,mib", sorted(GPUS.items()))
def test_gpu_presets(name, mib):
    assert gpu_preset(name).total_bytes == mib * 1024 * 1024


def test_names_case_insensitive_and_underscores():
    assert model_preset("LLaMA-2-70B") == ModelShape.from_preset("llama_2_70b")
    assert gpu_preset("H100-80GB").name == "h100-80gb"


def test_unknown_gpu():
    with pytest.raises(ConfigError) as info:
        gpu_preset("tpu-v5")
    assert "h200" in str(info.value) and info.value.argument == "gpu"


def test_every_preset_plans_on_h200():
    g = gpu_preset("h200")
    for name in inferctx.MODEL_PRESETS:
        p = inferctx.plan_workspace(name, batch_size=1, prompt_len=1, max_out_tokens=256,
                                    free_bytes=g.free_bytes, total_bytes=g.total_bytes)
        assert p.max_tokens == 256

"""Presets against the figures their published configs and drivers give, and every preset's
parameter count re-derived by hand from those figures, tensor by tensor."""

import pytest

import inferctx
from inferctx import ConfigError, ModelShape
from inferctx.presets import CUDA_OVERHEAD_BYTES, gpu_preset, model_info, model_preset

# (layers, heads, hidden, kv heads, head size) from each model's config.json
PUBLISHED = {
    "llama-2-7b": (32, 32, 4096, 32, 128),
    "llama-2-13b": (40, 40, 5120, 40, 128),
    "llama-2-70b": (80, 64, 8192, 8, 128),
    "llama-3-8b": (32, 32, 4096, 8, 128),
    "llama-3-70b": (80, 64, 8192, 8, 128),
    "mistral-7b": (32, 32, 4096, 8, 128),
    "qwen2-7b": (28, 28, 3584, 4, 128),
    "falcon-7b": (32, 71, 4544, 1, 64),
    "gemma-7b": (28, 16, 3072, 16, 256),     # 16 x 256 = 4096 != hidden 3072
    "gemma-2-9b": (42, 16, 3584, 8, 256),
    "gemma-2-27b": (46, 32, 4608, 16, 128),
    "opt-66b": (64, 72, 9216, 72, 128),
    "bloom-176b": (70, 112, 14336, 112, 128),
}

# Parameter counts as the model pages give them (Hugging Face's "params" figure, 3 significant
# digits, or the model card's exact count where it states one), and the tolerance the derived
# count must meet against them.
PUBLISHED_PARAMS = {
    "llama-2-7b": 6.74e9, "llama-2-13b": 13.0e9, "llama-2-70b": 69.0e9, "llama-3-8b": 8.03e9,
    "llama-3-70b": 70.6e9, "llama-3.1-405b": 406e9, "mistral-7b": 7.24e9, "mixtral-8x7b": 46.7e9,
    "qwen2-7b": 7.62e9, "qwen2-72b": 72.7e9, "falcon-7b": 6.92e9, "falcon-40b": 41.3e9,
    "gemma-2b": 2.51e9, "gemma-7b": 8.54e9, "gemma-2-9b": 9.24e9, "gemma-2-27b": 27.2e9,
    "phi-3-mini": 3.82e9, "gpt-j-6b": 6_053_381_344, "opt-30b": 30e9, "opt-66b": 66e9,
    "bloom-176b": 176_247_271_424,
}
PUBLISHED_TOLERANCE = 0.005  # 3 significant digits, and OPT's "66B" for 65.72 billion


def llama_like(m, *, qkv_bias=False, norms_per_layer=2):
    """Llama, Mistral, Mixtral, Qwen2, Gemma, Phi-3: RMSNorm (weight only), gated MLP of three
    matrices per expert, no biases but Qwen2's q/k/v."""
    h, q, kv = m.hidden_dim, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if qkv_bias else 0)
    mlp = m.num_experts * 3 * h * m.intermediate_size + (h * m.num_experts if m.num_experts > 1 else 0)
    layer = attn + mlp + norms_per_layer * h
    embeddings = m.vocab_size * h * (1 if m.tied_embeddings else 2)
    return m.num_layers * layer + embeddings + h  # + the final norm


def falcon(m, *, layernorms_per_layer):
    """Falcon: fused query/key/value (multi-query or grouped), parallel attention and MLP of
    two matrices, no biases but LayerNorm's, tied embeddings."""
    h = m.hidden_dim
    qkv = h * (m.num_heads * m.head_dim + 2 * m.num_kv_heads * m.head_dim)
    layer = qkv + h * h + 2 * h * m.intermediate_size + layernorms_per_layer * 2 * h
    return m.num_layers * layer + m.vocab_size * h + 2 * h


def gpt_j(m):
    """GPT-J: q/k/v/o without bias, MLP with biases, one LayerNorm, untied lm_head with bias."""
    h, f = m.hidden_dim, m.intermediate_size
    layer = 4 * h * h + (h * f + f) + (f * h + h) + 2 * h
    return m.num_layers * layer + m.vocab_size * h + 2 * h + (h * m.vocab_size + m.vocab_size)


def opt(m):
    """OPT: biases everywhere, two LayerNorms per layer, learned positions (2048 + 2), tied."""
    h, f = m.hidden_dim, m.intermediate_size
    layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    return m.num_layers * layer + m.vocab_size * h + 2050 * h + 2 * h


def bloom(m):
    """BLOOM: fused q/k/v, biases everywhere, two LayerNorms per layer, an embedding
    LayerNorm, tied embeddings (ALiBi: no position table)."""
    h, f = m.hidden_dim, m.intermediate_size
    layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    return m.num_layers * layer + m.vocab_size * h + 2 * h + 2 * h


DERIVE = {
    "llama-2-7b": llama_like, "llama-2-13b": llama_like, "llama-2-70b": llama_like,
    "llama-3-8b": llama_like, "llama-3-70b": llama_like, "llama-3.1-405b": llama_like,
    "mistral-7b": llama_like, "mixtral-8x7b": llama_like,
    "qwen2-7b": lambda m: llama_like(m, qkv_bias=True), "qwen2-72b": lambda m: llama_like(m, qkv_bias=True),
    "falcon-7b": lambda m: falcon(m, layernorms_per_layer=1),
    "falcon-40b": lambda m: falcon(m, layernorms_per_layer=2),
    "gemma-2b": llama_like, "gemma-7b": llama_like,
    "gemma-2-9b": lambda m: llama_like(m, norms_per_layer=4),
    "gemma-2-27b": lambda m: llama_like(m, norms_per_layer=4),
    "phi-3-mini": llama_like, "gpt-j-6b": gpt_j, "opt-30b": opt, "opt-66b": opt, "bloom-176b": bloom,
}

# nvidia-smi's total memory in MiB
GPUS = {"a100-40gb": 40960, "a100-80gb": 81920, "h100-80gb": 81559, "h200": 143771, "l40s": 46068,
        "rtx-4090": 24564}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_presets(name):
    s = model_preset(name)
    assert (s.num_layers, s.num_heads, s.hidden_dim, s.num_kv_heads, s.head_dim) == PUBLISHED[name]


def test_every_preset_has_a_derivation_and_a_published_count():
    assert set(DERIVE) == set(inferctx.MODEL_PRESETS) == set(PUBLISHED_PARAMS)


@pytest.mark.parametrize("name", sorted(DERIVE))
def test_parameter_count_by_hand(name):
    m = model_info(name)
    derived = DERIVE[name](m)
    # Derived from the config figures; the checkpoints of GPT-J count 0.04% more than its
    # tensors' formula gives (6,053,381,344 on the card), every other preset matches exactly.
    if name == "gpt-j-6b":
        assert abs(derived - m.num_params) <= 0.0005 * m.num_params, (derived, m.num_params)
    else:
        assert derived == m.num_params, (derived, m.num_params)
    published = PUBLISHED_PARAMS[name]
    assert abs(m.num_params - published) <= PUBLISHED_TOLERANCE * published, (m.num_params, published)


def test_exact_parameter_counts_of_the_llama_2_family():
    # 7B: 32 x (4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096) + 2 x 32000 x 4096 + 4096
    assert model_info("llama-2-7b").num_params == 32 * 202_383_360 + 262_144_000 + 4096 == 6_738_415_616
    assert model_info("bloom-176b").num_params == 176_247_271_424


@pytest.mark.parametrize("name", sorted(DERIVE))
@pytest.mark.parametrize("dtype,size", [("float16", 2), ("bf16", 2), ("float32", 4)])
def test_weights_bytes_are_params_times_element_size(name, dtype, size):
    shape = model_preset(name)
    n = model_info(name).num_params
    assert shape.num_params == n
    assert shape.weights_bytes(dtype) == n * size
    for mp in (2, 8):
        assert shape.weights_bytes(dtype, mp) == -(-n * size // mp)  # an even split, rounded up


def test_llama_2_7b_weights_by_hand():
    # 6,738,415,616 parameters x 2 bytes = 13,476,831,232 bytes = 12.55 GiB
    assert model_preset("llama-2-7b").weights_bytes("fp16") == 13_476_831_232
    assert model_preset("llama-2-70b").weights_bytes("bf16", 8) == 68_976_648_192 * 2 // 8


def test_at_least_ten_models_with_gqa_mqa_and_odd_head_sizes():
    shapes = [model_preset(n) for n in inferctx.MODEL_PRESETS]
    assert len(shapes) >= 10
    assert any(1 < s.num_kv_heads < s.num_heads for s in shapes)  # GQA
    assert any(s.num_kv_heads == 1 for s in shapes)                # MQA
    assert any(s.num_heads * s.head_dim != s.hidden_dim for s in shapes)  # Gemma


@pytest.mark.parametrize("name,mib", sorted(GPUS.items()))
def test_gpu_presets(name, mib):
    g = gpu_preset(name)
    assert g.total_bytes == mib * 1024 * 1024
    # H200 measurement: nvidia-smi's 143771 MiB total, 149,450,522,624 bytes free as
    # gen_workspace reads it: 143771 - 142527.6 = 1243.4 MiB, rounded up.
    assert CUDA_OVERHEAD_BYTES == 1244 * 1024 * 1024
    assert g.free_bytes == (mib - 1244) * 1024 * 1024


def test_names_case_insensitive_and_underscores():
    assert model_preset("LLaMA-2-70B") == ModelShape.from_preset("llama_2_70b")
    assert gpu_preset("H100-80GB").name == "h100-80gb"


def test_unknown_gpu():
    with pytest.raises(ConfigError) as info:
        gpu_preset("tpu-v5")
    assert "h200" in str(info.value) and info.value.argument == "name"  # gpu_preset's keyword


def test_unknown_name_is_clipped_in_the_message():
    with pytest.raises(ConfigError) as info:
        model_preset("x" * 1_000_000)
    assert len(str(info.value)) < 1000 and "1,000,000 characters" in str(info.value)
    with pytest.raises(ConfigError) as info:
        model_preset(42)  # not a string
    assert info.value.argument == "name"  # model_preset's keyword


def test_every_preset_plans_on_h200_with_its_weights():
    too_big = []
    for name in inferctx.MODEL_PRESETS:
        shape = model_preset(name)
        weights = shape.weights_bytes("float16")
        if weights >= gpu_preset("h200").free_bytes:
            with pytest.raises(inferctx.WorkspaceOOMError) as info:
                inferctx.plan_workspace(name, batch_size=1, prompt_len=1, max_out_tokens=256, gpu="h200")
            # free: 143771 - 1244 = 142527 MiB = 139.19 GiB
            assert "the weights (" in str(info.value) and ") exceed free memory 139.19 GiB" in str(info.value)
            too_big.append(name)
            continue
        p = inferctx.plan_workspace(name, batch_size=1, prompt_len=1, max_out_tokens=256, gpu="h200")
        assert p.max_tokens == 256 and p.weights_bytes == weights
        assert p.planned_free_bytes == gpu_preset("h200").free_bytes - weights
    # In fp16 only Llama-3.1-405B (811.7 GB) and BLOOM-176B (352.5 GB) are larger than the H200's
    # 139.19 GiB = 149,450,391,552 B free; Qwen2-72B's 145.4 GB and Llama-3-70B's 141.1 GB fit.
    assert sorted(too_big) == ["bloom-176b", "llama-3.1-405b"]


@pytest.mark.parametrize("call", [
    lambda: model_preset("nope"), lambda: model_preset(name="nope"), lambda: model_info("nope"),
    lambda: inferctx.presets.model_source("nope"), lambda: gpu_preset("nope"), lambda: gpu_preset(name=42),
])
def test_unknown_names_name_the_keyword(call):
    # model_preset, model_info, model_source and gpu_preset take the name as `name`
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.argument == "name" and str(info.value).startswith("name: unknown ")


@pytest.mark.parametrize("args,argument,message", [
    (("mine", "x", 1.5), "total_mib", "total_mib: got 1.5 (float); it must be a whole number of MiB"),
    (("mine", "x", True), "total_mib", "total_mib: got True (bool); it must be a whole number of MiB"),
    (("mine", "x", "80"), "total_mib", "total_mib: got '80' (str); it must be a whole number of MiB"),
    (("mine", "x", 0), "total_mib", "total_mib: got 0; it must be a number of MiB in [1, 8,796,093,022,207] "
                                    "(its byte count below 2**63)"),
    (("mine", "x", 2**43), "total_mib", "total_mib: got 8796093022208; it must be a number of MiB in "
                                        "[1, 8,796,093,022,207] (its byte count below 2**63)"),
    ((None, "x", 80), "name", "name: got None (NoneType); it must be a string"),
    (("mine", 7, 80), "description", "description: got 7 (int); it must be a string"),
])
def test_a_gpu_preset_checks_its_fields(args, argument, message):
    from inferctx.presets import GpuPreset

    with pytest.raises(ConfigError) as info:
        GpuPreset(*args)
    assert info.value.argument == argument and str(info.value) == message


def test_a_gpu_preset_takes_a_numpy_integer_as_its_int():
    np = pytest.importorskip("numpy")
    from inferctx.presets import GpuPreset

    g = GpuPreset("mine", "x", np.int64(40960))
    assert type(g.total_mib) is int and g == GpuPreset("mine", "x", 40960)
    assert g.free_bytes == gpu_preset("a100-40gb").free_bytes == (40960 - 1244) << 20
    largest = GpuPreset("mine", "x", ((1 << 63) - 1) >> 20)
    assert largest.total_bytes < 1 << 63


@pytest.mark.parametrize("mib", [1, 1000, 1244])
def test_a_gpu_preset_without_memory_past_the_cuda_overhead_names_gpu(mib):
    # Not free_bytes (a figure the caller never gave): the preset, by its keyword.
    from inferctx.presets import GpuPreset

    with pytest.raises(ConfigError) as info:
        inferctx.plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=8,
                                gpu=GpuPreset("mine", "x", mib))
    assert info.value.argument == "gpu"
    assert str(info.value) == (f"gpu: GPU preset 'mine' has total_mib={mib}, not more than the 1244 MiB the CUDA "
                               f"driver, context and cuBLAS take (presets.CUDA_OVERHEAD_MIB): no memory is left "
                               f"to plan against")


def test_a_custom_gpu_preset_plans_like_a_built_in_one():
    from inferctx.presets import GpuPreset

    kw = dict(batch_size=1, prompt_len=1, max_out_tokens=8)
    mine = inferctx.plan_workspace("llama-2-7b", gpu=GpuPreset("mine", "x", 143771), **kw)
    h200 = inferctx.plan_workspace("llama-2-7b", gpu="h200", **kw)
    assert mine.to_dict()["plan"] == h200.to_dict()["plan"] and mine.memory_source.startswith("GPU preset mine")
    # 1245 MiB: 1 MiB free, far below the weights: the planner's own reason, not an argument error
    with pytest.raises(inferctx.WorkspaceOOMError):
        inferctx.plan_workspace("llama-2-7b", gpu=GpuPreset("mine", "x", 1245), **kw)


def test_a_boolean_tensor_is_not_a_gpu_presets_mib():
    torch = pytest.importorskip("torch")
    from inferctx.presets import GpuPreset

    with pytest.raises(ConfigError) as info:
        GpuPreset("mine", "x", torch.tensor(True))
    assert info.value.argument == "total_mib" and "it must be a whole number of MiB" in str(info.value)
    assert GpuPreset("mine", "x", torch.tensor(2000)).total_mib == 2000

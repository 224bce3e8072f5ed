"""The Python planner: byte counts worked out by hand, coercion, errors, properties."""

from __future__ import annotations

import fractions
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import inferctx
from inferctx import ConfigError, ModelShape, NoCudaDeviceError, WorkspaceOOMError, plan_workspace
from inferctx.planning import _request_fields

GIB = 1 << 30
MIB = 1 << 20
H100 = dict(free_bytes=81559 * MIB, total_bytes=81559 * MIB)


def test_llama2_7b_on_h100_by_hand():
    p = plan_workspace("llama-2-7b", batch_size=8, prompt_len=1, max_out_tokens=4096, **H100)
    # activations 10*32*128*8 elements per token, fp16, 4096 tokens
    assert p.activations_bytes == 10 * 32 * 128 * 8 * 4096 * 2 == 2_684_354_560
    # one K tensor: [8, 32, 4096, 128] fp16
    assert p.kv_tensor_bytes == 8 * 32 * 4096 * 128 * 2 == 268_435_456
    # scores: batch * heads * max_out_tokens per token
    assert p.attention_scores_bytes == 8 * 32 * 4096 * 4096 * 2
    assert p.workspace_bytes == 2_684_354_560 + 64 * 268_435_456 + 8_589_934_592 == 28_454_158_336
    assert p.max_tokens == 4096 and p.bound_by == "max_out_tokens"
    assert p.budget_bytes == 81559 * MIB - 500 * MIB and p.budget_limit == "reserve"
    assert p.kv_shape == (8, 32, 4096, 128)
    assert len(p.regions) == 1 + 64 + 1


def test_deepspeed_policy_matches_deepspeed_example():
    shape = ModelShape(32, 32, 4096)
    kw = dict(batch_size=8, prompt_len=1, max_out_tokens=2048, policy="deepspeed", total_bytes=80 * GIB)
    p = plan_workspace(shape, free_bytes=75 * GIB, **kw)
    assert (p.max_tokens, p.workspace_bytes) == (2048, 12_079_595_520)
    assert plan_workspace(shape, free_bytes=8 * GIB, **kw).max_tokens == 1367


def test_gqa_exact_vs_deepspeed():
    # Llama-3-70B: 8 KV heads of 64; the exact policy's cache is 8x smaller per token.
    kw = dict(batch_size=4, prompt_len=128, max_out_tokens=8192, free_bytes=141 * GIB, total_bytes=141 * GIB)
    exact = plan_workspace("llama-3-70b", **kw)
    ds = plan_workspace("llama-3-70b", policy="deepspeed", **kw)
    # Both hold all 8192 tokens. Exact: 10x64x128x4x2 + 160 x 4x8x128x2 + 4x64x8192x2 = 6,160,384 B
    # per token, 8192 of them well inside 141 GiB - 500 MiB. DeepSpeed: act 327,680 + temp
    # 2,097,152 + cache 5,242,880 = 7,667,712 elements per token; (141 GiB - 2,097,152 - 500 MiB)
    # / 2 / 7,667,712 = 9838 tokens, more than 8192.
    assert exact.max_tokens == ds.max_tokens == 8192
    assert exact.kv_tensor_bytes == 4 * 8 * 8192 * 128 * 2 == 67_108_864
    assert ds.kv_tensor_bytes == 4 * 64 * 8192 * 128 * 2 == 8 * exact.kv_tensor_bytes


def test_mqa_falcon_head_padding():
    p = plan_workspace("falcon-7b", batch_size=1, prompt_len=1, max_out_tokens=2048, **H100)
    assert p.head_dim == 64 and p.head_dim_padded == 64 and p.kv_heads_per_rank == 1
    assert p.kv_tensor_bytes == 1 * 1 * 2048 * 64 * 2


def test_phi3_head_96_pads_to_128():
    p = plan_workspace("phi-3-mini", batch_size=1, prompt_len=1, max_out_tokens=1024, **H100)
    assert (p.head_dim, p.head_dim_padded) == (96, 128)


def test_mp_plan_identical_on_every_rank():
    kw = dict(batch_size=2, prompt_len=64, max_out_tokens=4096, mp_size=2, **H100)
    plans = [plan_workspace("llama-2-13b", rank=r, **kw) for r in range(2)]
    assert plans[0].workspace_bytes == plans[1].workspace_bytes
    # 40 heads / 2 ranks: K = [2, 20, 4096, 128] fp16
    assert plans[0].kv_tensor_bytes == 2 * 20 * 4096 * 128 * 2
    assert plans[0].attention_scores_bytes == 2 * 20 * 4096 * 4096 * 2


def test_memory_bound_plan_is_maximal():
    kw = dict(batch_size=64, prompt_len=1, max_out_tokens=32768, free_bytes=24 * GIB, total_bytes=24 * GIB)
    p = plan_workspace("llama-2-7b", **kw)
    assert p.bound_by == "memory"
    # Per token: activations 10x32x128x64x2 = 5,242,880, K and V 64 x 64x32x128x2 = 33,554,432,
    # scores 64x32x32768x2 = 134,217,728: 173,015,040 B (all multiples of 256). Budget
    # 24 GiB - 500 MiB = 25,245,515,776 B holds 145 tokens (25,087,180,800 B); 146 need 25,260,195,840.
    assert p.max_tokens == 145 and p.workspace_bytes == 145 * 173_015_040 == 25_087_180_800
    assert p.budget_bytes == 25_245_515_776 < 146 * 173_015_040
    fields = _request_fields("llama-2-7b", **kw)
    from inferctx import _core

    assert _core._workspace_bytes_for(fields, p.max_tokens) == p.workspace_bytes <= p.budget_bytes
    assert _core._workspace_bytes_for(fields, p.max_tokens + 1) > p.budget_bytes


def test_oom_states_figures_and_what_fits():
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace("llama-2-70b", batch_size=64, prompt_len=4096, max_out_tokens=8192,
                       free_bytes=80 * GIB, total_bytes=80 * GIB)
    e = info.value
    assert e.free_bytes == 80 * GIB and e.budget_bytes == 80 * GIB - 500 * MIB
    assert e.requested_bytes > e.budget_bytes
    # Llama-2-70B per token and sequence: activations 10x64x128x2 = 163,840, K and V
    # 160 x 8x128x2 = 327,680, scores 64x8192x2 = 1,048,576: 1,540,096 B; x 4096 prompt tokens =
    # 6,308,233,216 B a sequence. 64 need 403,726,925,824 B; the budget 80 GiB - 500 MiB =
    # 85,375,057,920 B holds 13 (82,007,031,808 B), not 14 (88,315,265,024 B).
    assert e.requested_bytes == 64 * 6_308_233_216 == 403_726_925_824
    assert e.max_batch_size == 13
    msg = str(e)
    assert "prompt_len=4096" in msg and "budget" in msg and f"batch_size <= {e.max_batch_size}" in msg
    # the suggestion really fits, one more does not
    ok = dict(prompt_len=4096, max_out_tokens=8192, free_bytes=80 * GIB, total_bytes=80 * GIB)
    plan_workspace("llama-2-70b", batch_size=e.max_batch_size, **ok)
    with pytest.raises(WorkspaceOOMError):
        plan_workspace("llama-2-70b", batch_size=e.max_batch_size + 1, **ok)
    clone = pickle.loads(pickle.dumps(e))
    assert type(clone) is WorkspaceOOMError and clone.max_batch_size == e.max_batch_size
    assert str(clone) == msg


def test_oom_max_out_tokens_suggestion_fits():
    kw = dict(batch_size=1, prompt_len=100, min_out_tokens=100, free_bytes=3 * GIB, total_bytes=3 * GIB)
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace("llama-2-7b", max_out_tokens=1_000_000, **kw)
    m = info.value.max_out_tokens
    # The 100 tokens that must fit: activations 10x32x128x100x2 = 8,192,000 and K, V
    # 64 x 32x100x128x2 = 52,428,800, plus scores 32 x m x 100 x 2 = 6400 m (all multiples of
    # 256). Budget 3 GiB - 500 MiB = 2,696,937,472: m <= 2,636,316,672 / 6400 = 411,924.48.
    assert info.value.requested_bytes == 60_620_800 + 6400 * 1_000_000 == 6_460_620_800
    assert m == 411_924
    plan_workspace("llama-2-7b", max_out_tokens=m, **kw)
    with pytest.raises(WorkspaceOOMError):
        plan_workspace("llama-2-7b", max_out_tokens=m + 1, **kw)


BASE = dict(batch_size=1, prompt_len=1, max_out_tokens=128, free_bytes=8 * GIB, total_bytes=8 * GIB)


@pytest.mark.parametrize("override,argument", [
    (dict(batch_size=0), "batch_size"),
    (dict(batch_size=-3), "batch_size"),
    (dict(prompt_len=0), "prompt_len"),
    (dict(max_out_tokens=0), "max_out_tokens"),
    (dict(min_out_tokens=0), "min_out_tokens"),
    (dict(min_out_tokens=129), "min_out_tokens"),
    (dict(prompt_len=129), "prompt_len"),
    (dict(mp_size=0), "mp_size"),
    (dict(mp_size=3), "mp_size"),
    (dict(rank=1), "rank"),
    (dict(mp_size=2, rank=-1), "rank"),
    (dict(dtype="int8"), "dtype"),
    (dict(dtype="float64"), "dtype"),
    (dict(policy="greedy"), "policy"),
    (dict(free_bytes=-1), "free_bytes"),
    (dict(free_bytes=9 * GIB), "free_bytes"),
    (dict(total_bytes=0, free_bytes=0), "total_bytes"),
    (dict(memory_fraction=0.0), "memory_fraction"),
    (dict(memory_fraction=1.01), "memory_fraction"),
    (dict(memory_fraction=float("nan")), "memory_fraction"),
    (dict(memory_limit_bytes=0), "memory_limit_bytes"),
    (dict(reserve_bytes=-5), "reserve_bytes"),
    (dict(batch_size=2.5), "batch_size"),
    (dict(batch_size=True), "batch_size"),
    (dict(external_cache=1), "external_cache"),
    (dict(batch_size=1 << 40, max_out_tokens=1 << 40), "batch_size"),
    (dict(batch_size=1 << 60), "batch_size"),
    (dict(batch_size=10**20), "batch_size"),
    (dict(max_out_tokens=2**63), "max_out_tokens"),
    (dict(free_bytes=2**64), "free_bytes"),
    (dict(memory_fraction=2**1024), "memory_fraction"),
    (dict(memory_fraction=float("inf")), "memory_fraction"),
    (dict(memory_fraction="0.5"), "memory_fraction"),
    (dict(weights_bytes=-1), "weights_bytes"),
    (dict(weights_bytes="all"), "weights_bytes"),
    (dict(weights_bytes=1.5), "weights_bytes"),
    (dict(gpu="h200"), "gpu"),               # with free_bytes/total_bytes
    (dict(device=0), "device"),              # with free_bytes/total_bytes
])
def test_invalid_requests_name_the_argument(override, argument):
    kw = {**BASE, **override}
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-2-7b", **kw)
    assert info.value.argument == argument
    assert argument in str(info.value)


@pytest.mark.parametrize("shape,argument", [
    (lambda: ModelShape(0, 32, 4096), "num_layers"),
    (lambda: ModelShape(32, -1, 4096), "num_heads"),
    (lambda: ModelShape(32, 32, 0), "hidden_dim"),
    (lambda: ModelShape(32, 32, 4096, 0), "num_kv_heads"),
    (lambda: ModelShape(32, 32, 4096.0), "hidden_dim"),
])
def test_invalid_shapes(shape, argument):
    with pytest.raises(ConfigError) as info:
        shape()
    assert info.value.argument == argument


def test_hidden_not_divisible_by_heads_needs_head_dim():
    with pytest.raises(ConfigError) as info:
        ModelShape(32, 32, 4100)  # 4100 / 32 is not whole
    assert info.value.argument == "hidden_dim" and "head_dim" in str(info.value)
    assert ModelShape(32, 32, 4100, head_dim=128).head_dim == 128


def test_memory_fraction_takes_the_real_scalars_that_the_integer_arguments_take():
    # A 0-d torch tensor was taken as batch_size but refused as memory_fraction, with a message
    # that said the value must be in (0, 1] (it was); Decimal too.
    import decimal

    np = pytest.importorskip("numpy")
    base = dict(batch_size=1, prompt_len=1, max_out_tokens=8, free_bytes=8 * GIB, total_bytes=8 * GIB)
    scalars = [0.5, decimal.Decimal("0.5"), np.float32(0.5), np.array(0.5), fractions.Fraction(1, 2)]
    for value in scalars:
        assert plan_workspace("llama-2-7b", memory_fraction=value, **base).budget_bytes == 4 * GIB, value
    not_numbers = [("0.5", "str"), (True, "bool"), (np.array([0.5]), "ndarray"), (np.array(True), "ndarray")]
    for value, kind in not_numbers:
        with pytest.raises(ConfigError) as info:
            plan_workspace("llama-2-7b", memory_fraction=value, **base)
        assert info.value.argument == "memory_fraction"
        assert str(info.value).endswith(f", of type {kind}; it must be a real number (a float, an int, a NumPy "
                                        f"scalar or a 0-d tensor) in (0, 1], a fraction of free memory"), value
    for value in (decimal.Decimal("1.5"), decimal.Decimal("NaN"), np.array(0.0)):
        with pytest.raises(ConfigError) as info:
            plan_workspace("llama-2-7b", memory_fraction=value, **base)
        assert str(info.value).endswith("; it must be a number in (0, 1], a fraction of free memory")


def test_memory_fraction_takes_a_0_d_torch_tensor_as_batch_size_does():
    torch = pytest.importorskip("torch")
    base = dict(prompt_len=1, max_out_tokens=8, free_bytes=8 * GIB, total_bytes=8 * GIB)
    plan = plan_workspace("llama-2-7b", batch_size=torch.tensor(2), memory_fraction=torch.tensor(0.5), **base)
    assert (plan.batch_size, plan.budget_bytes) == (2, 4 * GIB)
    for value, shown in ((torch.tensor([0.5]), "tensor([0.5000])"), (torch.tensor(True), "tensor(True)")):
        with pytest.raises(ConfigError) as info:
            plan_workspace("llama-2-7b", batch_size=1, memory_fraction=value, **base)
        assert str(info.value) == (f"memory_fraction: got {shown}, of type Tensor; it must be a real number (a "
                                   f"float, an int, a NumPy scalar or a 0-d tensor) in (0, 1], a fraction of free "
                                   f"memory")


def test_kv_heads_that_do_not_divide_the_heads_are_refused_where_the_shape_is_made():
    # As hidden_dim that the heads do not split is: the shape was made, and refused by the planner
    # only, away from the line that made it.
    message = ("num_kv_heads: num_heads=32 is not divisible by num_kv_heads=5; each KV head must serve a whole "
               "group of query heads")
    for make in (lambda: ModelShape(32, 32, 4096, 5), lambda: ModelShape(32, 32, 4096).replace(num_kv_heads=5),
                 lambda: ModelShape(32, 8, 4096, num_kv_heads=16)):
        with pytest.raises(ConfigError) as info:
            make()
        assert info.value.argument == "num_kv_heads"
    assert str(info.value) == message.replace("=32", "=8").replace("=5", "=16")
    with pytest.raises(ConfigError) as info:
        ModelShape(32, 32, 4096, 5)
    assert str(info.value) == message
    assert ModelShape(32, 32, 4096, 8).num_kv_heads == 8


def test_kv_heads_not_divisible_by_mp():
    with pytest.raises(ConfigError) as info:
        plan_workspace("falcon-7b", **{**BASE, "mp_size": 71})  # 71 heads divide, 1 KV head does not
    assert info.value.argument == "mp_size" and "num_kv_heads=1" in str(info.value)


def test_deepspeed_policy_needs_no_kv_heads_dividing_mp():
    # DeepSpeed's GenWorkSpace sizes the cache by num_heads / mp_size; it has no KV heads. So an
    # mp_size that splits the heads but not the KV heads is the deepspeed policy's to take:
    # Llama-3-70B (64 heads, 8 KV) on 16 ranks, Falcon-7B (71 heads, 1 KV) on 71.
    p = plan_workspace("llama-3-70b", **{**BASE, "mp_size": 16, "policy": "deepspeed"})
    assert p.kv_heads_per_rank == 64 // 16
    assert p.kv_tensor_bytes == 1 * 4 * p.max_tokens * 128 * 2  # batch 1, 4 heads, head 128, fp16
    assert plan_workspace("falcon-7b", **{**BASE, "mp_size": 71,
                                          "policy": "deepspeed"}).kv_heads_per_rank == 1
    # The exact policy splits KV heads: it still refuses.
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-3-70b", **{**BASE, "mp_size": 16})
    assert info.value.argument == "mp_size" and "num_kv_heads=8" in str(info.value)


def test_model_shape_replace_works_out_again_what_was_not_given():
    s = ModelShape(32, 32, 4096)
    assert (s.head_dim, s.num_kv_heads) == (128, 32)
    # head_dim and num_kv_heads were worked out, so they follow the changed fields.
    assert s.replace(hidden_dim=8192) == ModelShape(32, 32, 8192)
    assert s.replace(hidden_dim=8192).head_dim == 256
    assert s.replace(num_heads=64).num_kv_heads == 64 and s.replace(num_heads=64).head_dim == 64
    # Given ones are kept.
    g = ModelShape(32, 32, 4096, num_kv_heads=8, head_dim=128)
    assert g.replace(hidden_dim=8192).head_dim == 128
    assert g.replace(num_heads=64).num_kv_heads == 8
    # A pickle carries the difference: what was worked out is worked out again after it.
    back = pickle.loads(pickle.dumps(s))
    assert back == s and back.replace(hidden_dim=8192).head_dim == 256
    assert pickle.loads(pickle.dumps(g)).replace(hidden_dim=8192).head_dim == 128
    # The planner sees the new head size: 8192 / 32 = 256 per head, twice the KV cache per token.
    kw = dict(BASE, max_out_tokens=1024, free_bytes=80 * GIB, total_bytes=80 * GIB)
    assert (plan_workspace(s.replace(hidden_dim=8192), **kw).kv_tensor_bytes
            == plan_workspace(ModelShape(32, 32, 8192), **kw).kv_tensor_bytes
            == 1 * 32 * 1024 * 256 * 2)


def test_deepspeed_policy_refuses_exact_only_knobs():
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-2-7b", policy="deepspeed", reserve_bytes=0, **BASE)
    assert info.value.argument == "reserve_bytes"


def test_unknown_preset():
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-9-1t", **BASE)
    assert "llama-2-7b" in str(info.value) and info.value.argument == "shape"  # the keyword that named it


def test_dtypes_accept_strings_numpy_and_torch_like():
    np = pytest.importorskip("numpy")

    class FakeTorchDtype:  # what torch.bfloat16 looks like, without importing torch
        __module__ = "torch"

        def __str__(self):
            return "torch.bfloat16"

    FakeTorchDtype.__module__ = "torch"
    expected = [("fp16", "float16", 2), ("float16", "float16", 2), ("half", "float16", 2),
                (np.float16, "float16", 2), (np.dtype("float16"), "float16", 2), ("bf16", "bfloat16", 2),
                ("BFloat16", "bfloat16", 2), (FakeTorchDtype(), "bfloat16", 2), ("fp32", "float32", 4),
                (np.float32, "float32", 4)]
    for d, name, size in expected:
        p = plan_workspace("llama-2-7b", dtype=d, **BASE)
        assert (p.dtype, p.elem_size) == (name, size), d
        # 10 x 32 heads x 128 x 1 sequence x 128 tokens x the element size
        assert p.activations_bytes == 10 * 32 * 128 * 128 * size, d


def test_to_dict_and_str():
    p = plan_workspace("mistral-7b", batch_size=2, prompt_len=10, max_out_tokens=1024, **H100)
    d = p.to_dict()
    assert d["plan"]["max_tokens"] == 1024 and d["request"]["dtype"] == "float16"
    assert d["request"]["num_kv_heads"] == 8
    assert d["plan"]["regions"][0] == {"name": "activations", "offset": 0, "size": p.activations_bytes}
    assert [r["name"] for r in d["plan"]["regions"]] == ["activations", "kv_cache", "attention_scores"]
    assert d["plan"]["regions"][1]["size"] == 32 * 2 * p.kv_tensor_bytes == p.kv_cache_bytes
    assert d["sources"] == {"memory": "given", "weights": "none", "memory_from": "given", "gpu_preset": None,
                            "device": None, "weights_from": "none"} and d["request"]["weights_bytes"] == 0
    text = str(p)
    assert "max tokens 1024" in text and "bound by max_out_tokens" in text and "kv_cache" in text


def test_external_cache_has_no_kv_regions():
    p = plan_workspace("llama-2-7b", external_cache=True, **BASE)
    assert p.kv_cache_bytes == 0 and [r.name for r in p.regions] == ["activations", "attention_scores"]


def test_memory_figures_come_from_the_device_or_are_required():
    from conftest import gpu_available

    kw = dict(batch_size=1, prompt_len=1, max_out_tokens=16)
    if gpu_available()[0]:
        p = plan_workspace("llama-2-7b", **kw)
        assert 0 < p.free_bytes <= p.total_bytes
    else:
        with pytest.raises(NoCudaDeviceError) as info:
            plan_workspace("llama-2-7b", **kw)
        assert "free_bytes" in str(info.value) and "without a GPU" in str(info.value)


@pytest.mark.parametrize("given,message", [
    (dict(free_bytes=8 * GIB), "total_bytes was not given (only free_bytes), so it was to be read from the device: "
                               "pass total_bytes= as well (or gpu=, a GPU preset, instead of free_bytes=) to plan "
                               "without a GPU."),
    (dict(total_bytes=8 * GIB), "free_bytes was not given (only total_bytes), so it was to be read from the device: "
                                "pass free_bytes= as well (or gpu=, a GPU preset, instead of total_bytes=) to plan "
                                "without a GPU."),
    (dict(), "free_bytes and total_bytes were not given, so they were to be read from the device: pass both "
             "(or gpu=, a GPU preset) to plan without a GPU."),
])
def test_no_device_says_which_memory_figure_is_missing(monkeypatch, given, message):
    from inferctx import planning

    def no_device(device):
        raise NoCudaDeviceError("no usable CUDA device or driver. Planning works without one.",
                                call="cudaGetDeviceCount", code=100, name="cudaErrorNoDevice", device=None)

    monkeypatch.setattr(planning, "_device_memory", no_device)
    with pytest.raises(NoCudaDeviceError) as info:
        plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=16, **given)
    assert info.value.message == "no usable CUDA device or driver. Planning works without one. " + message
    assert (info.value.call, info.value.name) == ("cudaGetDeviceCount", "cudaErrorNoDevice")


@pytest.mark.parametrize("given,argument,message", [
    (dict(weights_bytes=-1), "weights_bytes", "weights_bytes: got -1; it must be a byte count >= 0"),
    (dict(gpu="h200", weights_bytes=-5), "weights_bytes", "weights_bytes: got -5; it must be a byte count >= 0"),
    (dict(free_bytes=-1), "free_bytes", "free_bytes: got -1; it must be in [0, total_bytes]"),
    (dict(total_bytes=0), "total_bytes", "total_bytes: got 0; it must be a positive byte count"),
    (dict(total_bytes=-3, free_bytes=1), "total_bytes", "total_bytes: got -3; it must be a positive byte count"),
    (dict(free_bytes=-1, total_bytes=10 ** 10), "free_bytes",
     "free_bytes: got -1; it must be in [0, total_bytes=10000000000]"),
    (dict(free_bytes=10 ** 11, total_bytes=10 ** 10), "free_bytes",
     "free_bytes: got 100000000000; it must be in [0, total_bytes=10000000000]"),
])
@pytest.mark.parametrize("call", ["plan_workspace", "max_batch_size", "max_out_tokens_for"])
def test_a_wrong_memory_figure_is_named_before_a_device_is_read(monkeypatch, given, argument, message, call):
    # The figures given are checked first, whether or not the other is to be read from a device:
    # a ConfigError naming the figure, the planner's words, and no device read (which would say
    # "no CUDA device" on a machine without one).
    from inferctx import planning

    def read(device):
        raise AssertionError("the device was read")

    monkeypatch.setattr(planning, "_device_memory", read)
    kwargs = dict(batch_size=1, prompt_len=1, max_out_tokens=16, **given)
    kwargs.pop({"max_batch_size": "batch_size", "max_out_tokens_for": "max_out_tokens"}.get(call, ""), None)
    with pytest.raises(ConfigError) as info:
        getattr(planning, call)("llama-2-7b", **kwargs)
    assert (info.value.argument, str(info.value)) == (argument, message)


def test_no_device_message_has_one_full_stop_between_sentences():
    from conftest import gpu_available

    if gpu_available()[0]:
        pytest.skip("a GPU is present: the device is read")
    with pytest.raises(NoCudaDeviceError) as info:
        plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=16, free_bytes=8 * GIB)
    text = info.value.message
    assert ".;" not in text and ". total_bytes was not given (only free_bytes)" in text


def test_no_device_message_has_one_full_stop_between_sentences_where_a_gpu_is_hidden():
    """The same, from the device query itself, on any machine: with no device visible
    (CUDA_VISIBLE_DEVICES empty) the runtime's own error is what the message starts from."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, inferctx\n"
            "try:\n"
            "    inferctx.plan_workspace('llama-2-7b', batch_size=1, prompt_len=1, max_out_tokens=16,\n"
            "                            free_bytes=8 << 30)\n"
            "except inferctx.NoCudaDeviceError as e:\n"
            "    print(json.dumps([e.message, e.name, e.call]))\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    text, name, call = json.loads(done.stdout.strip().splitlines()[-1])
    assert call == "cudaGetDeviceCount" and name in ("cudaErrorNoDevice", "cudaErrorInsufficientDriver")
    assert text.startswith(f"{name}: ") and ".;" not in text and ". ." not in text
    assert text.endswith("no usable CUDA device or driver. Planning (plan_workspace with gpu=, a GPU preset, or "
                         "free_bytes= and total_bytes=; `inferctx plan --gpu PRESET` or `--free-gb ... --total-gb "
                         "...`) works without one. total_bytes was not given (only free_bytes), so it "
                         "was to be read from the device: pass total_bytes= as well (or gpu=, a GPU preset, "
                         "instead of free_bytes=) to plan without a GPU.")


@pytest.mark.parametrize("weights", ["foo", "AUTO", 1.5, True, b"auto", [1]])
def test_invalid_weights_bytes_lists_the_valid_values(weights):
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-2-7b", weights_bytes=weights, **BASE)
    assert info.value.argument == "weights_bytes"
    assert info.value.message == (f"weights_bytes: got {weights!r} ({type(weights).__name__}); valid: a byte count "
                                  f"(an integer >= 0), 'auto' (from the model's num_params) or None")


def test_memory_figures_are_documented_by_where_they_come_from():
    doc = plan_workspace.__doc__
    assert "Omitted (with ``gpu``)" not in doc
    assert ("With ``gpu`` they come from the GPU preset\n        (give neither); otherwise each one omitted is "
            "read from ``device`` now, which needs a GPU.") in doc


def test_the_searches_answer_0_where_nothing_fits_as_their_docstrings_say():
    # max_batch_size / max_out_tokens_for answer 0 (no WorkspaceOOMError); only plan_workspace's
    # docstring promises that error, and it raises it.
    small = dict(free_bytes=1 << 30, total_bytes=1 << 30)
    max_batch_size, max_out_tokens_for = inferctx.max_batch_size, inferctx.max_out_tokens_for
    assert max_batch_size("llama-2-7b", max_out_tokens=4096, **small) == 0
    assert max_out_tokens_for("llama-2-7b", batch_size=8, free_bytes=1 << 20, total_bytes=1 << 30) == 0
    for search in (max_batch_size, max_out_tokens_for):
        assert "WorkspaceOOMError\n" not in search.__doc__ and "(never WorkspaceOOMError)" in search.__doc__
    assert "    WorkspaceOOMError\n        The request does not fit" in plan_workspace.__doc__
    with pytest.raises(WorkspaceOOMError):
        plan_workspace("llama-2-7b", batch_size=8, prompt_len=4096, max_out_tokens=4096, **small)


def test_a_plan_keeps_the_shape_it_was_given():
    p = plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=16, gpu="h200")
    assert p.shape == ModelShape.from_preset("llama-2-7b") and p.shape.num_params == 6_738_415_616
    assert p.shape.weights_bytes() == 6_738_415_616 * 2 == p.weights_bytes
    shape = ModelShape(28, 16, 3072, num_kv_heads=16, head_dim=256, num_params=8_537_680_896)
    p = plan_workspace(shape, **BASE)
    assert p.shape == shape and p.shape.weights_bytes("fp32", 2) == 8_537_680_896 * 4 // 2
    assert pickle.loads(pickle.dumps(p)).shape == shape


def test_argument_errors_come_before_the_device_is_read():
    # No memory figures: the device would be read, but the bad mp_size is reported first.
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=16, mp_size=3)
    assert info.value.argument == "mp_size"
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-2-7b", batch_size=10**30, prompt_len=1, max_out_tokens=16)
    assert info.value.argument == "batch_size" and "2**63" in str(info.value)


# --- property: any accepted exact plan is aligned, disjoint, inside, within budget, maximal --

shapes = st.builds(
    lambda layers, kv, group, head, mp: ModelShape(layers, kv * group * mp, kv * group * mp * head, kv * mp),
    st.integers(1, 8), st.integers(1, 4), st.integers(1, 4), st.sampled_from([24, 32, 48, 64, 80, 128, 160]),
    st.sampled_from([1, 2]),
)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, batch=st.integers(1, 8), max_out=st.integers(1, 3000), dtype=st.sampled_from(["fp16", "fp32"]),
       free=st.integers(600 * MIB, 4 * GIB), fraction=st.one_of(st.none(), st.floats(0.05, 1.0)),
       external=st.booleans())
def test_exact_plans_are_sound_and_maximal(shape, batch, max_out, dtype, free, fraction, external):
    mp = 2 if shape.num_kv_heads % 2 == 0 and shape.num_heads % 2 == 0 else 1
    kw = dict(batch_size=batch, prompt_len=1, max_out_tokens=max_out, dtype=dtype, mp_size=mp,
              external_cache=external, free_bytes=free, total_bytes=4 * GIB, memory_fraction=fraction)
    try:
        p = plan_workspace(shape, **kw)
    except WorkspaceOOMError as e:
        # Refused only where that is so: the fewest tokens the request needs do not fit its budget.
        from inferctx import _core

        fields = _request_fields(shape, **kw)
        need = max(fields["min_out_tokens"], fields["prompt_len"])
        assert e.requested_bytes == _core._workspace_bytes_for(fields, need) > e.budget_bytes, (
            e.requested_bytes, e.budget_bytes)
        return
    spans = sorted((r.offset, r.offset + r.size) for r in p.regions)
    for start, end in spans:
        assert start % 256 == 0 and end - start >= 0 and (end - start) % 256 == 0
        assert end <= p.workspace_bytes
    for (_, e1), (s2, _) in zip(spans, spans[1:]):
        assert e1 <= s2
    assert p.workspace_bytes <= p.budget_bytes
    if p.bound_by != "max_out_tokens":
        from inferctx import _core

        fields = _request_fields(shape, **kw)
        assert _core._workspace_bytes_for(fields, p.max_tokens + 1) > p.budget_bytes
    else:
        assert p.max_tokens == max_out


def test_version_and_exports():
    import re
    from importlib import metadata
    from pathlib import Path

    from inferctx import errors, planning

    # The version the package reports is the project's (pyproject.toml) and the installed one's.
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    (version,) = re.findall(r'^version = "([^"]+)"$', pyproject, re.M)
    assert inferctx.__version__ == version == metadata.version("inferctx")
    for name, module in (("ModelShape", planning), ("plan_workspace", planning), ("WorkspacePlan", planning),
                         ("ConfigError", errors), ("WorkspaceOOMError", errors)):
        assert name in inferctx.__all__
        assert getattr(inferctx, name) is getattr(module, name)


def test_numbers_of_any_numeric_type_are_accepted():
    np = pytest.importorskip("numpy")
    from fractions import Fraction

    base = dict(prompt_len=1, max_out_tokens=4096, **H100)
    ref = plan_workspace("llama-2-7b", batch_size=8, memory_fraction=0.5, **base)
    assert ref.budget_bytes == 81559 * MIB // 2 and ref.budget_limit == "memory_fraction"
    for fraction in (np.float32(0.5), np.float64(0.5), Fraction(1, 2), 0.5):
        p = plan_workspace("llama-2-7b", batch_size=np.int64(8), memory_fraction=fraction, **base)
        assert p == ref
    assert plan_workspace("llama-2-7b", batch_size=8, memory_fraction=1, **base).budget_limit == "reserve"


def test_weights_bytes_cut_free_memory():
    # 40 GiB free with 13,476,831,232 bytes of weights still to load: 40 GiB - 12.55 GiB planned
    p = plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=16, free_bytes=40 * GIB,
                       total_bytes=80 * GIB, weights_bytes="auto")
    assert p.weights_bytes == 13_476_831_232 and p.planned_free_bytes == 40 * GIB - 13_476_831_232
    assert p.budget_bytes == p.planned_free_bytes - 500 * MIB
    assert "12.55 GiB still to load (6,738,415,616 parameters x 2 B)" in str(p)
    given = plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=16, free_bytes=40 * GIB,
                           total_bytes=80 * GIB, weights_bytes=GIB)
    assert given.planned_free_bytes == 39 * GIB and given.weights_source == "given"
    none = plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=16, free_bytes=40 * GIB,
                          total_bytes=80 * GIB)
    assert none.weights_bytes == 0 and "none counted" in str(none)


def test_gpu_preset_in_python():
    p = plan_workspace("llama-2-7b", batch_size=8, prompt_len=1, max_out_tokens=4096, gpu="h100-80gb")
    assert p.free_bytes == (81559 - 1244) * MIB and p.total_bytes == 81559 * MIB
    assert p.weights_bytes == 13_476_831_232 and p.workspace_bytes == 28_454_158_336
    with pytest.raises(ConfigError) as info:  # an explicit shape has no parameter count
        plan_workspace(ModelShape(32, 32, 4096), batch_size=1, prompt_len=1, max_out_tokens=16, gpu="h200")
    assert info.value.argument == "weights_bytes"
    p = plan_workspace(ModelShape(32, 32, 4096), batch_size=1, prompt_len=1, max_out_tokens=16, gpu="h200",
                       weights_bytes=0)
    assert p.planned_free_bytes == (143771 - 1244) * MIB


def test_max_batch_size_and_max_out_tokens_for():
    kw = dict(prompt_len=1, free_bytes=24 * GIB, total_bytes=24 * GIB)
    b = inferctx.max_batch_size("llama-2-7b", max_out_tokens=2048, **kw)
    # each sequence of 2048 tokens: 10x32x128x2048x2 + 64 x 32x2048x128x2 + 32x2048x2048x2 = 1.41 GiB
    per_sequence = 10 * 32 * 128 * 2048 * 2 + 64 * 32 * 2048 * 128 * 2 + 32 * 2048 * 2048 * 2
    assert b == (24 * GIB - 500 * MIB) // per_sequence == 16
    m = inferctx.max_out_tokens_for("llama-2-7b", batch_size=16, **kw)
    # 16 sequences of t tokens, every one of max_out_tokens = t held: (1,310,720 + 8,388,608) t
    # + 16x32x t x t x 2 = 9,699,328 t + 1024 t^2 <= 25,245,515,776, i.e. t^2 + 9472 t <=
    # 24,653,824: t = 2125 (24,643,625); 2126 gives 24,657,348.
    assert m == 2125
    assert plan_workspace("llama-2-7b", batch_size=16, max_out_tokens=m, **kw).max_tokens == m
    # With max_out_tokens 2126 the scores take 16x32x2126x2 = 2,177,024 B a token: 11,876,352 B in
    # all, and 25,245,515,776 / 11,876,352 = 2125.7 tokens fit.
    assert plan_workspace("llama-2-7b", batch_size=16, max_out_tokens=m + 1, **kw).max_tokens == 2125
    # Llama-2-70B (8 KV heads): 10x64x128x2048x2 + 160 x 8x2048x128x2 + 64x2048x2048x2 = 1,543,503,872 B
    assert inferctx.max_batch_size("llama-2-70b", max_out_tokens=2048, **kw) == \
        (24 * GIB - 500 * MIB) // 1_543_503_872 == 16
    # Llama-3.1-405B: 2.81 GB per sequence of 2048 tokens does not fit in 2 GiB less the reserve
    assert inferctx.max_batch_size("llama-3.1-405b", max_out_tokens=2048, prompt_len=1, free_bytes=2 * GIB,
                                   total_bytes=2 * GIB) == 0


def test_regions_are_a_sequence_computed_on_access():
    p = plan_workspace("llama-2-7b", batch_size=8, prompt_len=1, max_out_tokens=4096, **H100)
    r = p.regions
    assert len(r) == 66 and r[0] == ("activations", 0, 2_684_354_560)
    # layer 31's V: kv_cache_offset + 31 x 2 x 256 MiB + 256 MiB
    assert r[-2] == ("kv_cache[31].value", 2_684_354_560 + 31 * 2 * 268_435_456 + 268_435_456, 268_435_456)
    assert r[1:3] == (("kv_cache[0].key", 2_684_354_560, 268_435_456),
                      ("kv_cache[0].value", 2_684_354_560 + 268_435_456, 268_435_456))
    assert r == tuple(r) and r == list(r) and r != tuple(r)[:-1]
    with pytest.raises(IndexError):
        r[66]
    with pytest.raises(TypeError):
        r["0"]


def test_overflow_names_the_shape_argument_that_overflows():
    kw = dict(batch_size=1, prompt_len=1, max_out_tokens=1, free_bytes=GIB, total_bytes=GIB)
    for shape, argument in ((ModelShape(1, 1, 2**62), "hidden_dim"),
                            (ModelShape(1, 1, 64, head_dim=2**62), "head_dim"),
                            (ModelShape(2**61, 1, 64), "num_layers"),
                            (ModelShape(1, 2**60, 2**60), "num_heads")):
        with pytest.raises(ConfigError) as info:
            plan_workspace(shape, **kw)
        assert info.value.argument == argument and f"reduce {argument}" in str(info.value)
    assert plan_workspace("llama-2-7b", **{**kw, "max_out_tokens": 4}).to_dict()["request"]["head_dim"] == 128


def test_weights_above_free_memory_say_which_mp_size_splits_them():
    kw = dict(batch_size=1, prompt_len=1, max_out_tokens=16, gpu="rtx-4090")  # 22.77 GiB free
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace("llama-2-70b", **kw)
    # 68,976,648,192 x 2 B: / 4 = 32.12 GiB does not fit, / 8 = 17,244,162,048 B = 16.06 GiB does
    assert str(info.value).endswith("; mp_size=8 would put 16.06 GiB of weights on each GPU")
    assert info.value.max_batch_size is None and info.value.max_out_tokens is None
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace("llama-3.1-405b", **kw)
    # 8 KV heads allow mp 8 at most: 405,853,388,800 x 2 / 8 = 94.50 GiB
    assert str(info.value).endswith("even mp_size=8 (the most that divides num_heads=128 and num_kv_heads=8) "
                                    "leaves 94.50 GiB of weights on each GPU")
    assert pickle.loads(pickle.dumps(info.value)).message == info.value.message


def test_weights_that_take_exactly_all_free_memory_get_the_mp_size_advice():
    # llama-2-7b: 6,738,415,616 parameters x 2 B = 13,476,831,232 B of weights, and exactly that
    # much free: nothing is left for the workspace, and a split leaves half of it.
    weights = 6_738_415_616 * 2
    kw = dict(batch_size=1, prompt_len=1, max_out_tokens=16, free_bytes=weights, total_bytes=2 * weights,
              weights_bytes="auto")
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace("llama-2-7b", **kw)
    # / 2 = 6,738,415,616 B = 6.28 GiB
    assert str(info.value).endswith("; mp_size=2 would put 6.28 GiB of weights on each GPU"), str(info.value)
    # One byte more free: the weights no longer take it all, and the advice is not given.
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace("llama-2-7b", **{**kw, "free_bytes": weights + 1})
    assert "mp_size=" not in str(info.value), str(info.value)


def test_weights_given_in_bytes_get_no_mp_size_advice():
    # weights_bytes given is per GPU already: neither mp_size nor dtype changes it.
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=2048,
                       free_bytes=20 << 30, total_bytes=20 << 30, weights_bytes=30 << 30, mp_size=8)
    assert "mp_size" not in str(info.value) and "dtype" not in str(info.value)
    assert str(info.value).endswith("the weights (30.00 GiB) exceed free memory 20.00 GiB; needs "
                                    "160.00 KiB for 1 token, free 20.00 GiB of 20.00 GiB, 0 B after the "
                                    "weights (30.00 GiB), budget 0 B (reserve)")


def test_weights_no_larger_mp_size_can_split_say_so():
    # Falcon-7B: 71 heads and 1 KV head, so mp_size 1 is the most; float32 weights
    # (7,217,189,760 x 4 B = 26.89 GiB) do not fit an RTX 4090's 22.77 GiB.
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace("falcon-7b", batch_size=1, prompt_len=1, max_out_tokens=16, gpu="rtx-4090",
                       dtype="float32")
    text = str(info.value)
    assert "larger mp_size" not in text.replace("no larger mp_size", "")
    assert text.endswith("no larger mp_size divides num_heads=71 and num_kv_heads=1: it would take a "
                         "device with more memory, or weights in a smaller dtype")


def test_mp_size_hint_for_a_huge_prime_head_count_is_quick():
    import time

    shape = ModelShape(1, 1_000_000_007, 1_000_000_007, num_params=10**15)
    start = time.perf_counter()
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace(shape, batch_size=1, prompt_len=1, max_out_tokens=1, gpu="h100-80gb")
    assert time.perf_counter() - start < 2.0
    # Its only divisors are 1 and itself: 2e15 B / 1,000,000,007 is about 1.86 MiB a GPU.
    assert "mp_size=1000000007 would put" in str(info.value)


def test_a_memory_limit_that_stops_the_plan_is_named_in_the_advice():
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace("llama-2-7b", **{**BASE, "memory_limit_bytes": 100_000})
    assert "within the memory_limit_bytes asked for: raise it" in str(info.value)
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace("llama-2-7b", **{**BASE, "memory_fraction": 1e-9})
    assert "within the memory_fraction of free memory asked for: raise it" in str(info.value)


def test_a_reserve_that_leaves_nothing_is_named_in_the_advice():
    # 70 GiB kept free of 8 GiB: the budget is 0 whatever the request, so the advice is to lower
    # the reserve (or free memory), not a smaller dtype or an external cache, which cannot help.
    with pytest.raises(WorkspaceOOMError) as info:
        plan_workspace("llama-2-7b", **{**BASE, "reserve_bytes": 70 * GIB})
    message = str(info.value)
    assert "budget 0 B (reserve)" in message
    assert message.endswith("; nothing fits beside the reserve_bytes asked for: lower it, or free memory")


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"),
                                     (640 << 20, "640.00 MiB"), (3 << 29, "1.50 GiB"),
                                     (5 << 41, "10.00 TiB"), (-(400 << 20), "-400.00 MiB")])
def test_human_bytes_is_the_one_formatter(n, text):
    from inferctx import _plan
    from inferctx.planning import human_bytes

    # the plan table, the CLI and the C++ messages all print sizes through the C++ formatter
    assert human_bytes(n) == text == _plan._human_bytes(n)


def test_numpy_booleans_are_flags_and_other_values_are_not():
    np = pytest.importorskip("numpy")
    from inferctx import _plan

    assert _plan._as_bool(np.True_, "external_cache") is True
    assert _plan._as_bool(np.bool_(False), "external_cache") is False
    for bad in (1, 0, None, "True", np.int8(1)):
        with pytest.raises(inferctx.ConfigError) as e:
            _plan._as_bool(bad, "external_cache")
        assert e.value.argument == "external_cache"
    plan = inferctx.plan_workspace("llama-2-7b", batch_size=1, prompt_len=8, max_out_tokens=64,
                                   gpu="h100-80gb", external_cache=np.True_)
    assert plan.external_cache is True


def _granular_plan(shape, tokens, free, granularity):
    """plan_workspace of a context's gen_workspace: `tokens` for every row, its mapping's
    granularity."""
    from inferctx import _plan
    from inferctx.planning import _resolve

    fields, _ = _resolve(shape, batch_size=8, prompt_len=16, max_out_tokens=tokens, min_out_tokens=tokens,
                         dtype="float16", mp_size=1, rank=0, external_cache=False, policy="exact",
                         free_bytes=free, total_bytes=free, gpu=None, weights_bytes=None, reserve_bytes=None,
                         memory_limit_bytes=None, memory_fraction=None, device=None)
    fields["allocation_granularity"] = granularity
    return _plan._plan(fields)


def test_the_most_tokens_a_context_holds_count_its_mapping_granularity():
    """What the decoder offers when a plan is too long: the context rounds its workspace up to
    whole 2 MiB mappings, so the most tokens that fit can be fewer than plan_workspace's, and the
    figure must be the context's (it fits there; one more does not)."""
    from inferctx.planning import _context_max_out_tokens

    shape = ModelShape(4, 8, 512, num_kv_heads=2)
    granule = 2 << 20
    fewer = 0
    for free in range(700 << 20, 760 << 20, 3 << 20):
        plain = _context_max_out_tokens(shape, batch_size=8, prompt_len=16, dtype="float16", free_bytes=free,
                                        total_bytes=free, allocation_granularity=0)
        most = _context_max_out_tokens(shape, batch_size=8, prompt_len=16, dtype="float16", free_bytes=free,
                                       total_bytes=free, allocation_granularity=granule)
        assert 16 <= most <= plain
        fewer += most < plain
        plan = _granular_plan(shape, most, free, granule)
        assert plan["workspace_bytes"] % granule == 0 and plan["max_tokens"] == most
        with pytest.raises(WorkspaceOOMError):
            _granular_plan(shape, most + 1, free, granule)
    assert fewer > 0  # the granularity made a difference at some of these sizes


def test_a_model_shape_cannot_be_deleted_from():
    # `del` is refused as assignment is: the shape, its hash and a plan of it stay as they were.
    s = ModelShape(2, 4, 64)
    key = hash(s)
    with pytest.raises(AttributeError, match=r"^ModelShape is immutable: make a new one instead of deleting "
                                             r"num_kv_heads$"):
        del s.num_kv_heads
    assert s.num_kv_heads == 4 and hash(s) == key and s == ModelShape(2, 4, 64)
    preset = inferctx.model_preset("llama-2-7b")
    with pytest.raises(AttributeError, match="ModelShape is immutable"):
        del preset.num_params
    assert plan_workspace(preset, gpu="h200", **{k: BASE[k] for k in ("batch_size", "prompt_len",
                                                                      "max_out_tokens")}).weights_bytes > 0


@pytest.mark.parametrize("device,shown", [
    (2**31, "2147483648"),           # the first past a C int, which the CUDA runtime takes
    (99_999_999_999, "99999999999"),
    (2**63 - 1, "9223372036854775807"),
    (2**63, "9223372036854775808"),
    (-1, "-1"),
    (-(2**63) - 1, "-9223372036854775809"),
])
def test_a_device_ordinal_past_a_c_int_is_a_config_error(device, shown):
    # Checked before any device is read, for each entry point.
    request = dict(prompt_len=1, min_out_tokens=1, device=device)
    for call in (lambda: plan_workspace("llama-2-7b", batch_size=1, max_out_tokens=8, **request),
                 lambda: inferctx.max_batch_size("llama-2-7b", max_out_tokens=8, **request),
                 lambda: inferctx.max_out_tokens_for("llama-2-7b", batch_size=1, **request)):
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == "device"
        bound = ">= 0" if device < 0 else "below 2**31 (the CUDA runtime's int)"  # it said ">= 0" of 2**31
        assert str(info.value) == f"device: got {shown}; it must be a device ordinal {bound}"
    from inferctx import planning

    with pytest.raises(ConfigError) as info:
        planning._device_memory(device)
    assert info.value.argument == "device"


def test_a_numpy_device_ordinal_past_a_c_int_is_a_config_error():
    np = pytest.importorskip("numpy")
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=8, device=np.int64(2**31))
    assert info.value.argument == "device"
    assert str(info.value) == "device: got 2147483648; it must be a device ordinal below 2**31 (the CUDA runtime's int)"


def test_human_bytes_takes_integers_only():
    from inferctx.planning import human_bytes

    np = pytest.importorskip("numpy")
    for value in (1.9, 5.0, np.float64(5.0), True, False, "1", None):
        with pytest.raises(TypeError, match=r"^human_bytes: n must be an integer byte count, got "):
            human_bytes(value)
    assert human_bytes(np.int64(1536)) == human_bytes(1536) == "1.50 KiB"
    assert human_bytes(np.uint64(2**64 - 1)) == "16777216.00 TiB"


def test_human_bytes_formats_counts_outside_int64():
    from inferctx.planning import human_bytes

    # The C++ formatter's own figures at the ends of int64, and the same wording past them.
    assert human_bytes(2**63 - 1) == human_bytes(2**63) == "8388608.00 TiB"
    assert human_bytes(-(2**63)) == human_bytes(-(2**63) - 1) == "-8388608.00 TiB"
    assert human_bytes(2**64) == "16777216.00 TiB" and human_bytes(3 * 2**70) == "3221225472.00 TiB"
    for value in (2**1024, -(2**1024), 10**5000):
        with pytest.raises(ConfigError) as info:
            human_bytes(value)
        assert info.value.argument == "n" and str(info.value).endswith(
            "; a byte count must be below 2**1024 in magnitude")
        assert len(str(info.value)) < 200


def test_an_unknown_preset_given_as_the_model_names_shape():
    # The keyword that carried the name: `shape` for the planner's entry points.
    for call in (lambda: plan_workspace("nope", gpu="h200", **{k: BASE[k] for k in ("batch_size", "prompt_len",
                                                                                    "max_out_tokens")}),
                 lambda: inferctx.max_batch_size("nope", max_out_tokens=8, **H100),
                 lambda: inferctx.max_out_tokens_for(shape="nope", batch_size=1, **H100)):
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == "shape"
        assert str(info.value).startswith("shape: unknown model preset 'nope'; valid: llama-2-7b, ")
    with pytest.raises(ConfigError) as info:
        ModelShape.from_preset(name="nope")
    assert info.value.argument == "name" and str(info.value).startswith("name: unknown model preset 'nope'; ")
    with pytest.raises(ConfigError) as info:  # gpu= still names gpu
        plan_workspace("llama-2-7b", gpu="nope", batch_size=1, prompt_len=1, max_out_tokens=8)
    assert info.value.argument == "gpu" and str(info.value).startswith("gpu: unknown GPU preset 'nope'; ")


@pytest.mark.parametrize("bad, shown", [(10 ** 5000, "an integer of 16610 bits (int)"), (3, "3 (int)"),
                                        (b"h200", "b'h200' (bytes)")], ids=["huge", "int", "bytes"])
def test_a_preset_name_that_is_no_string_is_named_as_what_came(bad, shown):
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-2-7b", gpu=bad, batch_size=1, prompt_len=1, max_out_tokens=8)
    assert info.value.argument == "gpu"
    assert str(info.value).startswith(f"gpu: unknown GPU preset: got {shown}, not a name; valid: a100-40gb, ")


def test_integers_below_int64_say_the_lower_bound():
    kw = dict(prompt_len=1, max_out_tokens=8, gpu="h200")
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-2-7b", batch_size=-(2**63) - 1, **kw)
    assert info.value.argument == "batch_size"
    assert str(info.value) == ("batch_size: got -9223372036854775809; it must be >= -2**63 = "
                               "-9,223,372,036,854,775,808")
    with pytest.raises(ConfigError) as info:
        ModelShape(-(10**5000), 1, 1)  # past Python's digit limit: described by its size
    assert str(info.value) == ("num_layers: got an integer of 16610 bits; it must be >= -2**63 = "
                               "-9,223,372,036,854,775,808")
    # an argument with its own minimum says that one
    with pytest.raises(ConfigError) as info:
        ModelShape(2, 4, 64, num_params=-(2**64))
    assert str(info.value) == "num_params: got -18446744073709551616; it must be >= 0"
    # above int64, as before
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-2-7b", batch_size=2**63, **kw)
    assert str(info.value) == "batch_size: got 9223372036854775808; it must be below 2**63 = 9,223,372,036,854,775,808"


def test_a_workspace_plan_is_not_made_directly():
    for args in (({}, {}), ()):
        with pytest.raises(TypeError) as info:
            inferctx.WorkspacePlan(*args)
        assert str(info.value) == ("WorkspacePlan is not made directly: plans come from inferctx.plan_workspace(...) "
                                   "or an InferenceContext's gen_workspace(...)")
    # the package's own plans are made, compared, copied and pickled as before
    p = plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=8, gpu="h200")
    assert isinstance(p, inferctx.WorkspacePlan) and p.max_tokens == 8
    assert pickle.loads(pickle.dumps(p)) == p and pickle.loads(pickle.dumps(p)).regions == p.regions
    import copy

    assert copy.deepcopy(p) == p and str(copy.copy(p)) == str(p)


def test_a_region_index_past_pythons_digit_limit_is_an_index_error():
    # An index out of range is an IndexError, as for any sequence, even one too long to print
    # (str() of a 5001-digit integer raises ValueError).
    regions = plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=8, gpu="h200").regions
    for index in (10**5000, -(10**5000)):
        with pytest.raises(IndexError) as info:
            regions[index]
        assert str(info.value) == "region index an integer of 16610 bits out of range for 66 regions"
    import numpy as np

    with pytest.raises(IndexError) as info:
        regions[np.int64(66)]
    assert str(info.value) == "region index 66 out of range for 66 regions"


def test_a_boolean_tensor_is_not_a_count():
    # torch.tensor(True) indexes as 1, as True does; a flag is not a count, whatever holds it.
    torch = pytest.importorskip("torch")
    kw = dict(batch_size=1, prompt_len=1, max_out_tokens=8, gpu="h200")
    for argument, value in (("batch_size", torch.tensor(True)), ("max_out_tokens", torch.tensor([True])),
                            ("weights_bytes", torch.tensor(False)), ("mp_size", torch.tensor(True))):
        with pytest.raises(ConfigError) as info:
            plan_workspace("llama-2-7b", **{**kw, argument: value})
        assert info.value.argument == argument
        message = str(info.value)
        assert message.startswith(f"{argument}: got tensor(") and "a boolean; it must be an integer" in message
    with pytest.raises(ConfigError) as info:
        ModelShape(torch.tensor(True), 32, 4096)
    assert info.value.argument == "num_layers"
    with pytest.raises(TypeError):
        inferctx.planning.human_bytes(torch.tensor(True))
    # integer tensors are counts, as before
    assert plan_workspace("llama-2-7b", **{**kw, "batch_size": torch.tensor(3)}).batch_size == 3
    assert inferctx.planning.human_bytes(torch.tensor(1536)) == "1.50 KiB"


@pytest.mark.parametrize("given,read", [
    (dict(free_bytes=4 * GIB), dict(total_bytes=8 * GIB)),
    (dict(total_bytes=7 * GIB), dict(free_bytes=6 * GIB)),
])
def test_a_memory_figure_omitted_is_read_from_the_device_named(monkeypatch, given, read):
    # The docstring: "each one omitted is read from ``device`` now"; with both given, device= is refused.
    from inferctx import planning

    devices = []

    def memory(device):
        devices.append(device)
        return 6 * GIB, 8 * GIB

    monkeypatch.setattr(planning, "_device_memory", memory)
    p = plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=16, device=1, **given)
    assert devices == [1]
    assert {**given, **read} == dict(free_bytes=p.free_bytes, total_bytes=p.total_bytes)
    with pytest.raises(ConfigError) as info:
        plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=16, device=1,
                       free_bytes=4 * GIB, total_bytes=8 * GIB)
    assert info.value.argument == "device" and devices == [1]


def test_a_gpu_preset_and_a_device_together_are_refused():
    # gpu= plans against a preset; device= would read a real card: one source of memory, not two.
    with pytest.raises(ConfigError) as e:
        plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=64, gpu="h100-80gb", device=0)
    assert e.value.argument == "gpu" and "not both" in str(e.value)


def test_a_gpu_preset_with_a_shape_without_num_params_asks_for_weights_bytes():
    with pytest.raises(ConfigError) as e:
        plan_workspace(ModelShape(32, 32, 4096), batch_size=1, prompt_len=1, max_out_tokens=64, gpu="h100-80gb")
    assert e.value.argument == "weights_bytes"
    # the user gave no 'auto': the message says why the weights are needed and what to pass
    assert "whole memory" in str(e.value) and "0 if they live elsewhere" in str(e.value)
    assert "'auto'" not in str(e.value)


def test_weights_source_names_the_mp_split():
    kw = dict(batch_size=1, prompt_len=1, max_out_tokens=64, gpu="h100-80gb")
    p = plan_workspace("llama-2-7b", mp_size=2, **kw)
    assert p.weights_bytes == 6_738_415_616 * 2 // 2
    assert p.weights_source == "6,738,415,616 parameters x 2 B / mp 2"
    assert plan_workspace("llama-2-7b", **kw).weights_source == "6,738,415,616 parameters x 2 B"


def test_kv_shape_counts_kv_heads_not_query_heads():
    # Llama-3-70B: 64 query heads, 8 KV heads; over mp 2, 32 and 4 a rank.
    p = plan_workspace("llama-3-70b", batch_size=4, prompt_len=1, max_out_tokens=8192, mp_size=2,
                       free_bytes=141 * GIB, total_bytes=141 * GIB)
    assert (p.heads_per_rank, p.kv_heads_per_rank) == (32, 4)
    assert p.kv_shape == (4, 4, 8192, 128)
    b, h, t, d = p.kv_shape
    assert p.kv_tensor_bytes == b * h * t * d * 2 == 33_554_432
    assert "each K or V [4, 4, 8192, 128] float16" in str(p)


def test_to_dict_request_keeps_the_models_head_dim_where_the_plan_sizes_with_another():
    # Gemma-7B: 16 heads of 256, hidden 3072; the deepspeed policy sizes with 3072 / 16 = 192.
    p = plan_workspace("gemma-7b", batch_size=1, prompt_len=1, max_out_tokens=64, policy="deepspeed",
                       free_bytes=40 * GIB, total_bytes=40 * GIB)
    d = p.to_dict()
    assert p.head_dim == d["plan"]["head_dim"] == 192
    assert d["request"]["head_dim"] == 256 == p.shape.head_dim


def test_deepspeed_temp_term_is_cut_from_the_memory_left_after_the_weights():
    # 24 GiB free less 4 GiB of weights: 20 GiB planned against, and the same temp term as with
    # 20 GiB free and no weights, 64 x 32 x 100,000 = 204,800,000 bytes (195.31 MiB).
    p = plan_workspace("llama-2-7b", batch_size=64, prompt_len=1, max_out_tokens=100_000, policy="deepspeed",
                       free_bytes=24 * GIB, total_bytes=24 * GIB, weights_bytes=4 * GIB)
    assert p.planned_free_bytes == 20 * GIB
    assert p.budget_bytes == 20 * GIB - 500 * MIB - 204_800_000
    assert "budget 19.32 GiB (free - reserve 500.00 MiB - DeepSpeed's temp term 195.31 MiB)" in str(p)


def test_str_says_mha_or_the_kv_heads():
    mha = plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=64, **H100)
    gqa = plan_workspace("llama-3-70b", batch_size=1, prompt_len=1, max_out_tokens=64, **H100)
    assert "32 layers, 32 heads (MHA), hidden 4096" in str(mha)
    assert "80 layers, 64 heads (8 KV), hidden 8192" in str(gqa)


def test_plans_of_different_requests_are_not_equal_even_with_the_same_layout():
    kw = dict(batch_size=2, prompt_len=64, max_out_tokens=4096, mp_size=2, **H100)
    r0, r1 = (plan_workspace("llama-2-13b", rank=r, **kw) for r in range(2))
    assert r0.to_dict()["plan"] == r1.to_dict()["plan"]  # the same layout on every rank
    assert r0 != r1 and r0 == plan_workspace("llama-2-13b", rank=0, **kw)


@pytest.mark.parametrize("head_dim", [0, -1])
def test_a_head_dim_below_one_is_refused_not_taken_as_the_default(head_dim):
    with pytest.raises(ConfigError) as info:
        ModelShape(32, 32, 4096, head_dim=head_dim)
    assert info.value.argument == "head_dim" and f"got {head_dim}" in str(info.value)


def test_num_params_may_be_zero_but_not_negative():
    shape = ModelShape(32, 32, 4096, num_params=0)
    assert shape.num_params == 0 and shape.weights_bytes() == 0
    with pytest.raises(ConfigError) as info:
        ModelShape(32, 32, 4096, num_params=-1)
    assert info.value.argument == "num_params" and ">= 0" in str(info.value)

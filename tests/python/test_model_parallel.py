"""Model parallel: the per-rank workspace plan (CPU, worked by hand) and
examples/model_parallel.py (NCCL all-reduce on the comm stream) on one and on two GPUs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferctx import ConfigError, ModelShape, plan_workspace
from inferctx.planning import _request_fields

GIB = 1 << 30
MIB = 1 << 20
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "model_parallel.py"

# 2 layers, 12 heads of 48 (hidden 576), 6 KV heads (GQA); batch 3, prompt 7, up to 45 tokens,
# fp16, on a 16 GiB device with all of it free (budget 16 GiB - 500 MiB: bound by max_out_tokens).
SHAPE = ModelShape(num_layers=2, num_heads=12, hidden_dim=576, num_kv_heads=6)
REQUEST = dict(batch_size=3, prompt_len=7, max_out_tokens=45, dtype="float16",
               free_bytes=16 * GIB, total_bytes=16 * GIB)


def _answer(plan):
    """What a plan decided, without the request (which differs between ranks in `rank` only)."""
    return plan.to_dict()["plan"]


# ---------------------------------------------------------------------------------------
# The per-rank plan (CPU)


def test_mp2_plan_by_hand():
    # head = 576 / 12 = 48, padded to head_eff = 64; mp 2: 12 / 2 = 6 heads and 6 / 2 = 3 KV
    # heads per rank. Exact policy, every region rounded up to a multiple of 256 bytes.
    p = plan_workspace(SHAPE, mp_size=2, rank=1, **REQUEST)
    assert (p.head_dim, p.head_dim_padded) == (48, 64)
    assert (p.heads_per_rank, p.kv_heads_per_rank) == (6, 3)
    assert p.max_tokens == 45 and p.bound_by == "max_out_tokens"
    assert p.reserve_bytes == 500 * MIB and p.budget_bytes == 16 * GIB - 500 * MIB
    # activations, per token 10 * heads * head_eff * batch = 10 * 12 * 64 * 3 = 23_040 elements
    # (all heads: not divided by mp); * 45 tokens * 2 bytes = 2_073_600 = 8100 * 256, aligned.
    assert p.activations_bytes == 10 * 12 * 64 * 3 * 45 * 2 == 2_073_600
    # KV cache, per token 2 * layers * batch * kv_heads * head_eff / mp = 2 * 2 * 3 * 6 * 64 / 2
    # = 2304 elements, as 2 layers x (K, V), each K or V [3, 3, 45, 64] fp16:
    # 3 * 3 * 45 * 64 * 2 = 51_840 bytes = 202.5 * 256 -> 203 * 256 = 51_968.
    assert p.kv_shape == (3, 3, 45, 64)
    assert 3 * 3 * 45 * 64 * 2 == 51_840 and p.kv_tensor_bytes == 203 * 256 == 51_968
    assert p.kv_cache_bytes == 2 * 2 * 51_968 == 207_872
    # attention scores, per token batch * heads / mp * max_out_tokens = 3 * 6 * 45 = 810
    # elements; * 45 tokens * 2 bytes = 72_900 = 284.77 * 256 -> 285 * 256 = 72_960.
    assert 3 * 6 * 45 * 45 * 2 == 72_900 and p.attention_scores_bytes == 285 * 256 == 72_960
    # one allocation: 2_073_600 + 207_872 + 72_960
    assert p.workspace_bytes == 2_354_432
    assert [tuple(r) for r in p.regions] == [
        ("activations", 0, 2_073_600),
        ("kv_cache[0].key", 2_073_600, 51_968),
        ("kv_cache[0].value", 2_125_568, 51_968),
        ("kv_cache[1].key", 2_177_536, 51_968),
        ("kv_cache[1].value", 2_229_504, 51_968),
        ("attention_scores", 2_281_472, 72_960),
    ]
    assert all(r.offset % 256 == 0 and r.size % 256 == 0 for r in p.regions)


def test_mp_splits_kv_and_scores_not_activations():
    # mp 1: K [3, 6, 45, 64] = 103_680 = 405 * 256 bytes; scores 3 * 12 * 45 * 45 * 2 = 145_800
    # -> 570 * 256 = 145_920. mp 3: K [3, 2, 45, 64] = 34_560 = 135 * 256; scores
    # 3 * 4 * 45 * 45 * 2 = 48_600 -> 190 * 256 = 48_640. Activations stay 2_073_600.
    one = plan_workspace(SHAPE, mp_size=1, rank=0, **REQUEST)
    three = plan_workspace(SHAPE, mp_size=3, rank=2, **REQUEST)
    assert (one.kv_tensor_bytes, one.attention_scores_bytes) == (103_680, 145_920)
    assert (three.kv_tensor_bytes, three.attention_scores_bytes) == (34_560, 48_640)
    assert (three.heads_per_rank, three.kv_heads_per_rank) == (4, 2)
    assert one.activations_bytes == three.activations_bytes == 2_073_600
    assert one.workspace_bytes == 2_073_600 + 4 * 103_680 + 145_920 == 2_634_240
    assert three.workspace_bytes == 2_073_600 + 4 * 34_560 + 48_640 == 2_260_480


@pytest.mark.parametrize("mp_size", [1, 2, 3, 6])
def test_plan_identical_on_every_rank(mp_size):
    plans = [plan_workspace(SHAPE, mp_size=mp_size, rank=r, **REQUEST) for r in range(mp_size)]
    assert [p.rank for p in plans] == list(range(mp_size))
    for p in plans[1:]:
        assert _answer(p) == _answer(plans[0])
        assert p.regions == plans[0].regions


def test_memory_bound_plan_identical_on_every_rank():
    # A 1 MB cap: fewer than 45 tokens fit; every rank must stop at the same count, the
    # largest whose aligned layout fits the cap.
    kw = {**REQUEST, "memory_limit_bytes": 1_000_000}
    plans = [plan_workspace(SHAPE, mp_size=2, rank=r, **kw) for r in range(2)]
    p = plans[0]
    assert p.bound_by == "memory" and p.budget_limit == "memory_limit"
    # t tokens: activations 10 * 12 * 64 * 3 * t * 2 = 46_080 t (a multiple of 256), 4 K/V of
    # 3 * 3 * t * 64 * 2 = 1152 t and scores 3 * 6 * 45 * t * 2 = 1620 t, each rounded up to 256.
    # t = 19: 875_520 + 4 * 22_016 + 30_976 = 994_560 <= 1_000_000; t = 20: 921_600 + 4 * 23_040
    # + 32_512 = 1_046_272 does not fit.
    assert p.max_tokens == 19 and p.workspace_bytes == 875_520 + 4 * 22_016 + 30_976 == 994_560
    assert _answer(plans[1]) == _answer(p)
    from inferctx import _core

    fields = _request_fields(SHAPE, mp_size=2, rank=1, **kw)
    assert _core._workspace_bytes_for(fields, p.max_tokens) == p.workspace_bytes <= 1_000_000
    assert _core._workspace_bytes_for(fields, p.max_tokens + 1) > 1_000_000


@pytest.mark.parametrize("mp_size, rank, argument, words", [
    (2, 2, "rank", "[0, 2)"),           # rank past the last
    (2, -1, "rank", "[0, 2)"),
    (1, 1, "rank", "[0, 1)"),
    (0, 0, "mp_size", "positive"),
    (-2, 0, "mp_size", "positive"),
    (5, 0, "mp_size", "num_heads=12"),  # 12 heads do not split over 5 ranks
    (4, 0, "mp_size", "num_kv_heads=6"),  # 12 heads do, 6 KV heads do not
    (2, True, "rank", "integer"),
    (2, 1.0, "rank", "integer"),
    ("2", 0, "mp_size", "integer"),
])
def test_invalid_rank_or_mp_size(mp_size, rank, argument, words):
    with pytest.raises(ConfigError) as info:
        plan_workspace(SHAPE, mp_size=mp_size, rank=rank, **REQUEST)
    assert info.value.argument == argument
    assert str(info.value).startswith(argument) and words in str(info.value)


# ---------------------------------------------------------------------------------------
# The example's host-side helpers (CPU: the module imports no torch until it runs)


def _example_module():
    spec = importlib.util.spec_from_file_location("model_parallel_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_turns_off_multicast_and_splits_heads():
    mp = _example_module()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1"
    assert [mp.shard_bounds(64, 128, 2, r) for r in range(2)] == [(0, 4096), (4096, 8192)]
    assert mp.shard_bounds(12, 48, 1, 0) == (0, 576)
    with pytest.raises(ValueError, match=r"^heads=12 must be divisible by the world size 5$"):
        mp.shard_bounds(12, 48, 5, 0)
    args = mp.parse_args(["--dtype", "fp16", "--heads", "8", "--head-dim", "32"])
    assert (args.dtype, args.out_features, args.world_size) == ("float16", 256, None)


def test_example_analysis_of_a_timeline():
    mp = _example_module()
    # Step 0's all-reduce (1.0-2.0) overlaps step 1's compute (1.1-2.5) for 0.9 ms; step 1's
    # (2.5-3.0) overlaps step 2's compute (2.6-3.6) for 0.4 ms.
    timeline = [
        {"compute": [0.0, 1.0], "allreduce": [1.0, 2.0], "use": [2.5, 2.55]},
        {"compute": [1.1, 2.5], "allreduce": [2.5, 3.0], "use": [3.6, 3.65]},
        {"compute": [2.6, 3.6], "allreduce": [3.6, 4.0], "use": [4.0, 4.05]},
    ]
    a = mp.analyse(timeline)
    assert a["ordered"] and a["violations"] == []
    assert a["overlap_ms"] == pytest.approx([0.9, 0.4])
    assert a["overlap_steps"] == 2 and a["overlap_observed"]
    # An all-reduce that starts before its GEMM ends, and a use before its all-reduce ends.
    bad = [dict(s) for s in timeline]
    bad[1] = {"compute": [1.1, 2.5], "allreduce": [2.0, 3.0], "use": [2.9, 3.0]}
    a = mp.analyse(bad)
    assert not a["ordered"]
    assert any("step 1 all-reduce starts before its compute ends" in v for v in a["violations"])
    assert any("step 1 use starts before its all-reduce ends" in v for v in a["violations"])
    # Serialised streams: no overlap.
    serial = [{"compute": [0.0, 1.0], "allreduce": [1.0, 2.0], "use": [2.0, 2.1]},
              {"compute": [2.1, 3.0], "allreduce": [3.0, 4.0], "use": [4.0, 4.1]}]
    a = mp.analyse(serial)
    assert a["ordered"] and a["overlap_ms"] == [0.0] and not a["overlap_observed"]


def _example_on_a_faked_machine(monkeypatch, gpus, nccl):
    """The example's module, with `gpus` CUDA devices and NCCL (or not) made to appear to torch
    and no torchrun variables set."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    return _example_module()


@pytest.mark.parametrize("env, argv, words", [
    ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, [], "torchrun's WORLD_SIZE='0' is not an integer >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "x", "LOCAL_RANK": "0"}, [], "torchrun's WORLD_SIZE='x' is not an integer >= 1"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, [], "torchrun's RANK=2 is not below its WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3"}, [], "torchrun's LOCAL_RANK=3 needs 4 GPU(s); 2 visible"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ["--world-size", "1"],
     "--world-size 1 differs from torchrun's WORLD_SIZE=2"),
    ({}, ["--world-size", "3"], "--world-size 3 needs 3 GPU(s); 2 visible"),
    ({}, ["--heads", "3"], "--heads 3 is not divisible by the world size 2 (every visible GPU, the default; "
                           "pass --world-size)"),
    ({}, ["--nccl-missing"], "this torch has no NCCL"),
])
def test_example_usage_errors_are_one_line_and_exit_2(monkeypatch, capsys, env, argv, words):
    # On the CPU, with two GPUs and NCCL made to appear: every check before a process group starts.
    mp = _example_on_a_faked_machine(monkeypatch, gpus=2, nccl="--nccl-missing" not in argv)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(mp, "_run", lambda *a: pytest.fail("ran past the checks"))
    assert mp.main([a for a in argv if a != "--nccl-missing"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(words) and err.count("\n") == 1 and err.endswith("\n"), err


@pytest.mark.parametrize("raised, words", [
    ("oom", "rank 0: WorkspaceOOMError: the workspace does not fit"),
    ("runtime", "rank 0: RuntimeError: MASTER_ADDR expected"),
    ("spawned", "a spawned rank failed: torch.OutOfMemoryError: CUDA out of memory"),
])
def test_example_a_rank_that_cannot_run_is_one_line_and_exit_3(monkeypatch, capsys, raised, words):
    torch = pytest.importorskip("torch")
    import torch.multiprocessing

    import inferctx

    mp = _example_on_a_faked_machine(monkeypatch, gpus=1, nccl=True)
    errors = {
        "oom": inferctx.WorkspaceOOMError("the workspace does not fit"),
        "runtime": RuntimeError("Error initializing torch.distributed\nMASTER_ADDR expected"),
        "spawned": torch.multiprocessing.ProcessRaisedException(
            "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
            "  File \"x.py\", line 1\ntorch.OutOfMemoryError: CUDA out of memory\n", 1, 1234),
    }

    def run(*args):
        raise errors[raised]

    monkeypatch.setattr(mp, "_run", run)
    assert mp.main(["--world-size", "1"]) == 3
    assert capsys.readouterr().err == words + "\n"


def test_example_summary_of_one_step_does_not_ask_for_overlap():
    mp = _example_module()
    rank = {"rank": 0, "world_size": 2, "device": 0, "gpu": "GPU", "shard": [0, 32], "dtype": "bfloat16",
            "tokens": 8, "in_features": 64, "out_features": 64,
            "plan": {"heads_per_rank": 1, "kv_heads_per_rank": 1, "mp_size": 2, "rank": 0, "max_tokens": 8,
                     "workspace_bytes": 1},
            "timeline": [{"step": 0, "compute": [0.0, 1.0], "allreduce": [1.0, 2.0], "use": [2.0, 2.1]}],
            "overlap_ms": [], "overlap_steps": 0, "overlap_total_ms": 0.0, "allreduce_total_ms": 1.0,
            "total_ms": 2.1, "max_abs_err": 0.0, "atol": 0.03, "rtol": 0.02, "matches_reference": True,
            "ordered": True, "violations": [], "overlap_observed": False}
    doc = {"world_size": 2, "ok": True, "overlap_observed": False, "ranks": [rank, dict(rank, rank=1)]}
    last = mp._summary(doc).splitlines()[-1]
    assert last == "overall: OK"


# ---------------------------------------------------------------------------------------
# The example on GPUs (a subprocess: NCCL and its process group stay out of this process)

SMALL = ["--steps", "6", "--batch", "2", "--seq", "512", "--heads", "16", "--head-dim", "128",
         "--json"]


def _run_example(world: int, *extra: str, timeout: int = 300) -> dict:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--world-size", str(world), *SMALL, *extra],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=EXAMPLE.parents[1])
    assert proc.returncode in (0, 1), f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON on stdout\n{proc.stdout}\n{proc.stderr}"
    doc = json.loads(lines[-1])
    # The exit status is the verdict the document states: 0 when ok, 1 otherwise.
    assert proc.returncode == (0 if doc["ok"] else 1), f"exit {proc.returncode}, ok {doc['ok']}\n{proc.stderr}"
    assert doc["world_size"] == world and len(doc["ranks"]) == world
    return doc


def _check_order(rank: dict, eps: float = 2e-3) -> None:
    """The events came back in the order the syncs impose (checked here, not taken from the
    example's own verdict)."""
    steps = rank["timeline"]
    assert len(steps) == 6
    for t, s in enumerate(steps):
        c, a, u = s["compute"], s["allreduce"], s["use"]
        assert 0 <= c[0] <= c[1] + eps and a[0] <= a[1] + eps and u[0] <= u[1] + eps
        # sync_comp: the all-reduce of step t starts after, and so ends after, its GEMM.
        assert c[1] <= a[0] + eps, (t, s)
        assert c[1] <= a[1] + eps, (t, s)
        # sync_comm: step t's output is used after its all-reduce.
        assert a[1] <= u[0] + eps, (t, s)
        if t:
            assert steps[t - 1]["compute"][1] <= c[0] + eps
            assert steps[t - 1]["allreduce"][1] <= a[0] + eps
    assert rank["total_ms"] + eps >= max(s["use"][1] for s in steps)


@pytest.mark.gpu
@pytest.mark.parametrize("spawn", [False, True], ids=["in-process", "spawned"])
def test_example_one_gpu(spawn):
    pytest.importorskip("torch")
    doc = _run_example(1, *(["--spawn"] if spawn else []))
    (rank,) = doc["ranks"]
    assert doc["ok"], rank
    assert rank["matches_reference"], (rank["max_abs_err"], rank["atol"], rank["rtol"])
    assert rank["ordered"], rank["violations"]
    _check_order(rank)
    assert rank["plan"]["mp_size"] == 1 and rank["plan"]["heads_per_rank"] == 16
    assert rank["shard"] == [0, 16 * 128]


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_example_two_gpus():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for 2 NCCL ranks; {torch.cuda.device_count()} visible")
    doc = _run_example(2)
    assert doc["ok"], [(r["rank"], r["max_abs_err"], r["violations"]) for r in doc["ranks"]]
    assert doc["plans_identical"]
    for rank in doc["ranks"]:
        assert rank["matches_reference"], (rank["rank"], rank["max_abs_err"])
        _check_order(rank)
        assert rank["plan"]["mp_size"] == 2 and rank["plan"]["heads_per_rank"] == 8
        assert rank["shard"] == [rank["rank"] * 1024, (rank["rank"] + 1) * 1024]
        # The all-reduce of some step t overlapped the compute of step t+1 on every rank.
        assert rank["overlap_observed"], (rank["rank"], rank["overlap_ms"], rank["timeline"])
    assert doc["overlap_observed"]

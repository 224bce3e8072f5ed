"""Generated cases over plan_workspace, ModelShape, the presets and the CLI (2,000 each).

Every input gives a plan or a documented error (ConfigError naming an argument,
WorkspaceOOMError), never another exception; plans equal a reference worked out here from
DESIGN.md's per-token formulas, independently of the planner; the exact policy is monotone.
"""

from __future__ import annotations

import contextlib
import io
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import inferctx
from inferctx import ConfigError, ModelShape, WorkspaceOOMError, plan_workspace
from inferctx.cli import main
from inferctx.presets import gpu_preset, model_info

MIB, GIB = 1 << 20, 1 << 30
INT64_MAX = (1 << 63) - 1
ELEM = {"float16": 2, "bfloat16": 2, "float32": 4}
CASES = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the reference ------------------------------------------------------------------------------

def padded(head):
    return head if head > 128 else 32 if head <= 32 else 64 if head <= 64 else 128


def align(n):
    return -(-n // 256) * 256


def layout_bytes(r, tokens):
    """Workspace bytes for `tokens` tokens: DESIGN.md's per-token terms, laid out as the design says."""
    s, exact = r["shape"], r["policy"] == "exact"
    head = s.head_dim if exact else s.hidden_dim // s.num_heads
    eff, elem, mp, batch = padded(head), ELEM[r["dtype"]], r["mp_size"], r["batch_size"]
    kv_heads = s.num_kv_heads if exact else s.num_heads
    act = 10 * s.num_heads * eff * batch * tokens * elem
    kv = batch * (kv_heads // mp) * tokens * eff * elem
    scores = batch * (s.num_heads // mp) * r["max_out_tokens"] * tokens * elem
    if exact:
        act, kv, scores = align(act), align(kv), align(scores)
    return act + (0 if r["external_cache"] else s.num_layers * 2 * kv) + scores


def default_reserve(free):
    # 100 MiB up to 1 GiB free, 500 MiB from 1 GiB + 400 MiB, the budget flat (924 MiB) between
    return 100 * MIB if free <= GIB else min(500 * MIB, free - 924 * MIB)


def reference(r):
    """(max_tokens, workspace_bytes, budget) or None when the request does not fit."""
    s, elem = r["shape"], ELEM[r["dtype"]]
    need = max(r["prompt_len"], r["min_out_tokens"])
    avail = r["free_bytes"] - r["weights_bytes"]
    if avail < 0:
        return None
    if r["policy"] == "deepspeed":
        eff = padded(s.hidden_dim // s.num_heads)
        b, mp = r["batch_size"], r["mp_size"]
        act = 10 * s.num_heads * eff * b
        temp = b * (s.num_heads // mp) * r["max_out_tokens"]
        cache = s.num_layers * b * (s.num_heads * eff // mp) * 2
        minimal = temp + (500 * MIB if avail > GIB else 100 * MIB)  # elements + bytes, as DeepSpeed
        if avail < minimal:
            return None
        tokens = min(r["max_out_tokens"], (avail - minimal) // elem // (act + temp + cache))
        budget = avail - minimal
    else:
        reserve = default_reserve(avail) if r["reserve_bytes"] is None else r["reserve_bytes"]
        budget = max(0, avail - reserve)
        if r["memory_limit_bytes"] is not None:
            budget = min(budget, r["memory_limit_bytes"])
        if r["memory_fraction"] is not None:
            budget = min(budget, min(avail, math.floor(r["memory_fraction"] * float(avail))))
        lo, hi = 0, r["max_out_tokens"]  # largest t with layout_bytes(t) <= budget
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if layout_bytes(r, mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        tokens = lo
    if tokens < need:
        return None
    return tokens, layout_bytes(r, tokens), budget


# -- strategies ---------------------------------------------------------------------------------

@st.composite
def shapes(draw):
    mp = draw(st.sampled_from([1, 1, 2, 4]))
    kv = mp * draw(st.integers(1, 4))
    heads = kv * draw(st.integers(1, 8))
    explicit = draw(st.booleans())
    head = draw(st.sampled_from([16, 24, 32, 40, 64, 80, 96, 112, 128, 160, 192, 256]))
    hidden = draw(st.integers(64, 8192)) if explicit else heads * head
    shape = ModelShape(draw(st.integers(1, 96)), heads, hidden, kv, head_dim=head if explicit else None)
    return shape, mp


@st.composite
def requests(draw, policy=None):
    shape, mp = draw(shapes())
    max_out = draw(st.one_of(st.integers(1, 64), st.integers(1, 4096), st.integers(1, 20000)))
    small = lambda: draw(st.one_of(st.just(1), st.integers(1, min(max_out, 32)), st.integers(1, max_out)))  # noqa: E731
    total = draw(st.one_of(st.integers(1, 96 * GIB), st.integers(8 * GIB, 96 * GIB)))
    near_ramp = st.integers(min(total, GIB - 64 * MIB), min(total, GIB + 512 * MIB))  # the default reserve's ramp
    free = draw(st.one_of(st.just(total), st.integers(total // 2, total), st.integers(0, total), near_ramp))
    pol = policy or draw(st.sampled_from(["exact", "exact", "deepspeed"]))
    exact = pol == "exact"
    opt = lambda s: draw(st.one_of(st.none(), s)) if exact else None  # noqa: E731
    return dict(
        shape=shape, batch_size=draw(st.one_of(st.integers(1, 8), st.integers(1, 64))), max_out_tokens=max_out,
        prompt_len=small(), min_out_tokens=small(),
        dtype=draw(st.sampled_from(sorted(ELEM))), mp_size=mp, rank=draw(st.integers(0, mp - 1)),
        external_cache=draw(st.booleans()), policy=pol, free_bytes=free, total_bytes=total,
        weights_bytes=draw(st.one_of(st.just(0), st.integers(0, free // 2), st.integers(0, free + GIB))),
        reserve_bytes=opt(st.integers(0, 2 * GIB)), memory_limit_bytes=opt(st.integers(1, 64 * GIB)),
        memory_fraction=opt(st.floats(1e-6, 1.0)),
    )


def tokens_of(r):
    try:
        return plan_workspace(**r).max_tokens
    except WorkspaceOOMError:
        return 0


# -- plan_workspace -------------------------------------------------------------------------------

@CASES
@given(r=requests())
def test_plans_equal_the_reference(r):
    expected = reference(r)
    try:
        p = plan_workspace(**r)
    except WorkspaceOOMError as e:
        assert expected is None, f"planner: does not fit ({e}); reference: {expected}"
        assert e.free_bytes == r["free_bytes"] and e.budget_bytes >= 0
        return
    assert expected is not None, f"planner: {p!r}; reference: does not fit"
    tokens, nbytes, budget = expected
    assert (p.max_tokens, p.workspace_bytes, p.budget_bytes) == (tokens, nbytes, budget)
    assert p.planned_free_bytes == r["free_bytes"] - r["weights_bytes"]
    assert p.bound_by == ("max_out_tokens" if tokens == r["max_out_tokens"] else "memory")
    if r["policy"] == "exact":
        assert p.workspace_bytes <= p.budget_bytes
    # the regions tile the workspace in order; kv_cache(l) K then V
    regions = list(p.regions)
    assert len(regions) == 2 + (0 if r["external_cache"] else 2 * r["shape"].num_layers)
    assert regions[0].offset == 0 and regions[-1].name == "attention_scores"
    for a, b in zip(regions, regions[1:]):
        assert a.offset + a.size == b.offset
    assert regions[-1].offset + regions[-1].size == p.attention_scores_offset + p.attention_scores_bytes


@CASES
@given(r=requests(policy="exact"), data=st.data())
def test_exact_policy_is_monotone(r, data):
    base = tokens_of(r)
    free2 = data.draw(st.integers(r["free_bytes"], r["total_bytes"]), label="more free")
    assert tokens_of({**r, "free_bytes": free2}) >= base
    assert tokens_of({**r, "batch_size": r["batch_size"] + data.draw(st.integers(1, 64))}) <= base
    assert tokens_of({**r, "weights_bytes": r["weights_bytes"] + data.draw(st.integers(0, 4 * GIB))}) <= base
    if r["memory_limit_bytes"] is not None:
        more = r["memory_limit_bytes"] + data.draw(st.integers(0, 8 * GIB))
        assert tokens_of({**r, "memory_limit_bytes": more}) >= base
        assert tokens_of({**r, "memory_limit_bytes": None}) >= base
    if r["memory_fraction"] is not None:
        more = data.draw(st.floats(r["memory_fraction"], 1.0))
        assert tokens_of({**r, "memory_fraction": more}) >= base
    if r["reserve_bytes"] is not None:
        less = data.draw(st.integers(0, r["reserve_bytes"]))
        assert tokens_of({**r, "reserve_bytes": less}) >= base


def test_the_reserve_step_is_gone():
    # 1 GiB free gave 138 tokens and 1 GiB + 1 byte 78 before; now both give the same.
    kw = dict(batch_size=1, prompt_len=1, max_out_tokens=100_000, total_bytes=2 * GIB)
    # Budget 1 GiB - 100 MiB = 968,884,224 B on both sides now (before: 568,884,225 B above 1 GiB).
    for free in (GIB, GIB + 1):
        r = {"shape": model_info("llama-2-7b").shape, **kw, "free_bytes": free, "min_out_tokens": 1,
             "dtype": "float16", "mp_size": 1, "rank": 0, "external_cache": False, "policy": "exact",
             "weights_bytes": 0, "reserve_bytes": None, "memory_limit_bytes": None, "memory_fraction": None}
        assert reference(r)[0] == tokens_of(r) == 138
    # the deepspeed policy keeps DeepSpeed's step: 137 tokens, then 77
    ds = {**kw, "shape": "llama-2-7b", "policy": "deepspeed"}
    assert (tokens_of({**ds, "free_bytes": GIB}), tokens_of({**ds, "free_bytes": GIB + 1})) == (137, 77)


@CASES
@given(free=st.one_of(st.integers(0, INT64_MAX), st.integers(GIB - 4 * MIB, GIB + 404 * MIB)))
def test_default_reserve_is_the_ramp(free):
    from inferctx import _plan

    assert _plan._default_reserve(free) == default_reserve(free)
    assert free - default_reserve(free) <= (free + 1) - default_reserve(free + 1)  # the budget never falls
    if free < INT64_MAX:  # ... with the planner's own reserve too, not only this file's reference
        assert free - _plan._default_reserve(free) <= (free + 1) - _plan._default_reserve(free + 1)


def test_largest_figures_do_not_wrap():
    p = plan_workspace("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=16, free_bytes=INT64_MAX,
                       total_bytes=INT64_MAX, memory_fraction=1.0)
    assert p.budget_bytes == INT64_MAX - 500 * MIB and p.max_tokens == 16
    # 2^40 layers of one head of 128: no per-layer storage, so this plans at once
    p = plan_workspace(ModelShape(2**40, 1, 128), batch_size=1, prompt_len=1, max_out_tokens=8,
                       free_bytes=INT64_MAX, total_bytes=INT64_MAX)
    assert len(p.regions) == 2 + 2 * 2**40 and p.regions[-2].name == f"kv_cache[{2**40 - 1}].value"
    # all 8 tokens fit; one K or V: batch 1 x 1 head x 8 tokens x 128 x 2 B = 2048 B, 2^41 of them
    assert p.max_tokens == 8 and p.kv_tensor_bytes == 1 * 1 * 8 * 128 * 2 == 2048
    assert p.kv_cache_bytes == 2**40 * 2 * 2048 == 2**52


WILD_INT = st.one_of(st.integers(-3, 5000), st.integers(-(2**70), 2**70), st.sampled_from([2**63 - 1, 2**63, -(2**63)]))
WILD = st.one_of(
    WILD_INT, st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.just(2**1024), st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
    st.builds(np.float32, st.floats(0, 1, width=32)), st.just([1]),
)
DOCUMENTED = (ConfigError, WorkspaceOOMError)
KEYWORDS = {"batch_size", "prompt_len", "max_out_tokens", "min_out_tokens", "dtype", "mp_size", "rank",
            "external_cache", "policy", "free_bytes", "total_bytes", "gpu", "weights_bytes", "reserve_bytes",
            "memory_limit_bytes", "memory_fraction", "device", "shape", "preset", "num_layers", "num_heads",
            "hidden_dim", "num_kv_heads", "head_dim", "num_params"}


@CASES
@given(layers=WILD_INT, heads=WILD, hidden=WILD_INT, kv=st.one_of(st.none(), WILD), head=st.one_of(st.none(), WILD),
       kwargs=st.fixed_dictionaries({}, optional={
           k: WILD for k in ("batch_size", "prompt_len", "max_out_tokens", "min_out_tokens", "mp_size", "rank",
                             "reserve_bytes", "memory_limit_bytes", "memory_fraction", "weights_bytes",
                             "free_bytes", "total_bytes", "dtype", "policy", "external_cache")}))
def test_any_input_plans_or_raises_a_documented_error(layers, heads, hidden, kv, head, kwargs):
    kw = {"batch_size": 1, "prompt_len": 1, "max_out_tokens": 64, **kwargs}
    if kw.get("free_bytes") is None or kw.get("total_bytes") is None:  # no device read here
        kw.update(free_bytes=kw.get("free_bytes") if kw.get("free_bytes") is not None else 8 * GIB,
                  total_bytes=kw.get("total_bytes") if kw.get("total_bytes") is not None else 8 * GIB)
    try:
        shape = ModelShape(layers, heads, hidden, kv, head_dim=head)
        p = plan_workspace(shape, **kw)
    except DOCUMENTED as e:
        assert len(str(e)) < 2000
        if isinstance(e, ConfigError):
            assert e.argument in KEYWORDS and e.argument in str(e)
        return
    assert 1 <= p.max_tokens <= p.max_out_tokens and p.workspace_bytes > 0


# -- ModelShape -----------------------------------------------------------------------------------

@CASES
@given(layers=WILD, heads=WILD, hidden=WILD, kv=st.one_of(st.none(), WILD), head=st.one_of(st.none(), WILD),
       params=st.one_of(st.none(), WILD))
def test_model_shape_is_valid_or_a_config_error(layers, heads, hidden, kv, head, params):
    try:
        s = ModelShape(layers, heads, hidden, kv, head_dim=head, num_params=params)
    except ConfigError as e:
        assert e.argument in {"num_layers", "num_heads", "hidden_dim", "num_kv_heads", "head_dim", "num_params"}
        assert len(str(e)) < 1000
        return
    assert min(s.num_layers, s.num_heads, s.hidden_dim, s.num_kv_heads, s.head_dim) >= 1
    assert max(s.num_layers, s.num_heads, s.hidden_dim, s.num_kv_heads, s.head_dim) <= INT64_MAX
    assert s.num_kv_heads == (s.num_heads if kv is None else int(kv))
    if head is None:
        assert s.head_dim * s.num_heads == s.hidden_dim
    else:
        assert s.head_dim == int(head)
    assert s == ModelShape(s.num_layers, s.num_heads, s.hidden_dim, s.num_kv_heads, head_dim=s.head_dim,
                           num_params=s.num_params)


# -- presets --------------------------------------------------------------------------------------

def variants(name):
    return st.sampled_from([name, name.upper(), name.replace("-", "_"), f"  {name} "])


@CASES
@given(model=st.sampled_from(inferctx.MODEL_PRESETS).flatmap(variants),
       gpu=st.sampled_from(inferctx.GPU_PRESETS).flatmap(variants), dtype=st.sampled_from(sorted(ELEM)),
       mp=st.sampled_from([1, 2, 4, 8, 3]), batch=st.integers(1, 32), max_out=st.integers(1, 8192))
def test_presets_plan_against_total_less_overhead_and_weights(model, gpu, dtype, mp, batch, max_out):
    info, g = model_info(model), gpu_preset(gpu)
    weights = -(-info.num_params * ELEM[dtype] // mp)  # by hand: an even split, rounded up
    kw = dict(batch_size=batch, prompt_len=1, max_out_tokens=max_out, dtype=dtype, mp_size=mp, gpu=gpu)
    if info.num_heads % mp or info.num_kv_heads % mp:
        with pytest.raises(ConfigError) as e:
            plan_workspace(model, **kw)
        assert e.value.argument == "mp_size"
        return
    r = dict(shape=info.shape, batch_size=batch, prompt_len=1, max_out_tokens=max_out, min_out_tokens=1,
             dtype=dtype, mp_size=mp, rank=0, external_cache=False, policy="exact",
             free_bytes=g.total_bytes - 1244 * MIB, total_bytes=g.total_bytes, weights_bytes=weights,
             reserve_bytes=None, memory_limit_bytes=None, memory_fraction=None)
    expected = reference(r)
    try:
        p = plan_workspace(model, **kw)
    except WorkspaceOOMError:
        assert expected is None
        return
    assert expected is not None and p.max_tokens == expected[0] and p.workspace_bytes == expected[1]
    assert p.weights_bytes == weights and p.free_bytes == g.total_bytes - 1244 * MIB


@CASES
@given(name=st.one_of(st.text(max_size=40), st.text(min_size=200, max_size=3000), st.integers(), st.none()),
       kind=st.sampled_from(["model", "gpu"]))
def test_unknown_presets_are_config_errors(name, kind):
    known = inferctx.MODEL_PRESETS if kind == "model" else inferctx.GPU_PRESETS
    assume(not (isinstance(name, str) and name.strip().lower().replace("_", "-") in known))
    with pytest.raises(ConfigError) as e:
        (inferctx.model_preset if kind == "model" else inferctx.gpu_preset)(name)
    assert e.value.argument == "name" and len(str(e.value)) < 1000  # their keyword


# -- the CLI --------------------------------------------------------------------------------------

FLAG_VALUE = st.one_of(
    st.integers(-5, 70000).map(str), st.sampled_from(["0", "1", "2**63", str(2**63), str(10**30), "1e300", "inf",
                                                      "-inf", "nan", "1e999", "0.5", "-1", "x", "", " 7 ", "1_0"]),
    st.text(max_size=6), st.text(min_size=100, max_size=400),
)
FLAGS = ["--batch", "--prompt-len", "--max-tokens", "--min-tokens", "--mp-size", "--rank", "--layers", "--heads",
         "--hidden", "--kv-heads", "--head-dim", "--free-gb", "--total-gb", "--reserve-gb", "--memory-limit-gb",
         "--memory-fraction", "--weights-gb", "--dtype", "--policy", "--preset", "--gpu", "--weights"]
SWITCHES = ["--json", "--external-cache", "--max-batch", "--most-tokens"]


@st.composite
def command_lines(draw):
    argv = ["plan"]
    if draw(st.booleans()):
        argv += ["--preset", draw(st.sampled_from([*inferctx.MODEL_PRESETS, "nope"]))]
    if draw(st.booleans()):
        argv += ["--gpu", draw(st.sampled_from([*inferctx.GPU_PRESETS, "nope"]))]
    for flag in draw(st.lists(st.sampled_from(FLAGS), max_size=6)):
        argv += [flag, draw(FLAG_VALUE)]
    argv += draw(st.lists(st.sampled_from(SWITCHES), max_size=2, unique=True))
    if draw(st.integers(0, 9)) == 0:
        argv += ["--sweep-batch", draw(st.sampled_from(["0", "3", "5000", "x", "-2"]))]
    if draw(st.integers(0, 19)) == 0:
        argv += ["--device", draw(st.sampled_from(["0", "-1", "x"]))]
    return argv


@CASES
@given(argv=command_lines())
def test_the_cli_never_tracebacks(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code in (0, 2), (argv, code)
    if code == 2:
        text = err.getvalue()
        assert text.startswith("inferctx: ") and text.count("\n") == 1, (argv, text)
        assert "Traceback" not in text and len(text) < 2000, (argv, text)
        assert "free_bytes=" not in text and "_bytes:" not in text, (argv, text)  # flags, not keywords
    else:
        assert out.getvalue() and not err.getvalue()

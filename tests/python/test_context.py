"""InferenceContext: one per device, the workspace and its regions, tokens, Philox state,
release/retake, and the checks on every argument."""

from __future__ import annotations

import gc
import logging
import pickle
import subprocess
import sys
import threading

import pytest
from conftest import gpu_available
from gpu_context import (ACTIVATIONS_BYTES, KV_SHAPE, KV_TENSOR_BYTES, REQUEST, SCORES_BYTES,
                         SHAPE, WORKSPACE_BYTES, ctx, plan_small)  # noqa: F401 (fixture)

from inferctx import (ConfigError, NoCudaDeviceError, TokenLimitError, WorkspaceInUseError,
                      WorkspaceOOMError, WorkspaceStateError, plan_workspace)
from inferctx import _core
from inferctx.context import InferenceContext

MIB = 1 << 20


def granules(ctx, nbytes):
    """What the exact policy plans for `nbytes` of layout: whole granules under CUDA virtual
    memory (ctx.addresses_stable), the bytes themselves under the cudaMalloc fallback."""
    g = ctx.allocation_granularity
    return -(-nbytes // g) * g if g > 1 else nbytes


# -- without a GPU ----------------------------------------------------------------------------

def test_instance_without_a_gpu_says_planning_works():
    if gpu_available()[0]:
        assert InferenceContext.instance() is InferenceContext.instance()
        return
    with pytest.raises(NoCudaDeviceError) as info:
        InferenceContext.instance()
    text = str(info.value)
    assert "Planning" in text and "without" in text
    assert info.value.name and info.value.call
    clone = pickle.loads(pickle.dumps(info.value))
    assert type(clone) is NoCudaDeviceError and str(clone) == text and clone.call == info.value.call


def test_context_is_not_constructed_directly():
    with pytest.raises(TypeError, match=r"instance\("):
        InferenceContext()


@pytest.mark.parametrize("device", [True, 1.0, "0", -1, 2**31])
def test_instance_rejects_bad_device_before_touching_cuda(device):
    with pytest.raises(ConfigError) as info:
        InferenceContext.instance(device)
    assert info.value.argument == "device" and repr(device) in str(info.value)
    if isinstance(device, int) and not isinstance(device, bool):
        assert str(info.value).endswith("it must be the ordinal of a visible device (0, 1, ...), or None "
                                        "for the current device")


@pytest.mark.gpu
def test_instance_past_the_device_count_says_the_valid_range_in_pythons_terms():
    # The C++ layer's message offered -1 for the current device, which Python refuses.
    count = _core._device_count()
    with pytest.raises(ConfigError) as info:
        InferenceContext.instance(count)
    assert info.value.argument == "device"
    assert str(info.value) == (f"device: got {count}; valid: 0..{count - 1} ({count} visible "
                               f"device{'s' if count != 1 else ''}), or None for the current device")


# -- one context per device -------------------------------------------------------------------

@pytest.mark.gpu
def test_gen_workspace_reads_a_mutable_argument_again(ctx):  # noqa: F811
    """A 0-d NumPy array indexes as an int: written in place between two calls, the same object
    holds another batch size, which the second call must plan for (not the first call's)."""
    import numpy

    from gpu_context import plan_small

    batch = numpy.array(1)
    first = plan_small(ctx, batch_size=batch)
    batch[()] = 2
    second = plan_small(ctx, batch_size=batch)
    assert (first.batch_size, second.batch_size) == (1, 2)
    assert ctx.plan.batch_size == 2
    plan_small(ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("when", ["after the compiled call", "while the plan is described"])
def test_ctrl_c_on_the_way_back_from_gen_workspace_leaves_the_new_plan_adopted(ctx, monkeypatch, when):  # noqa: F811
    """Ctrl-C during gen_workspace's compiled call (seconds, for a large mapping or kept contents
    copied back) is raised at the first Python instruction after it, with the new plan already in
    force in C++. Simulated at that instruction, and at one later, before the plan is adopted:
    ctx.plan and the views' layout must be the new plan's, as max_token_length and the
    allocation are. Before, they stayed the old plan's until the next gen_workspace."""
    from inferctx.planning import WorkspacePlan

    if when == "after the compiled call":
        real = InferenceContext._gen_workspace

        def interrupted(self, args, fields):
            made = real(self, args, fields)
            if made is not None and not isinstance(made, WorkspacePlan):
                raise KeyboardInterrupt
            return made
        monkeypatch.setattr(InferenceContext, "_gen_workspace", interrupted)
    else:
        real = InferenceContext._plan_of
        calls = []

        def interrupted(self, made, shape):  # the first time only: the interrupt comes once
            calls.append(made)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return real(self, made, shape)
        monkeypatch.setattr(InferenceContext, "_plan_of", interrupted)
    before = ctx.plan
    with pytest.raises(KeyboardInterrupt):
        plan_small(ctx, max_out_tokens=128)
    monkeypatch.undo()
    after = ctx.plan
    assert after is not before and after.max_tokens == ctx.max_token_length != before.max_tokens
    k, _ = ctx.kv_cache(0)
    assert k.shape == (KV_SHAPE[0], KV_SHAPE[1], ctx.max_token_length, KV_SHAPE[3])
    assert ctx.workspace.nbytes == after.workspace_bytes == ctx.workspace_bytes
    again = plan_small(ctx, max_out_tokens=128)
    assert again.max_tokens == after.max_tokens and ctx.plan is again
    plan_small(ctx)


@pytest.mark.gpu
def test_one_context_per_device():
    current = _core._current_device()
    ctx0 = InferenceContext.instance()
    assert ctx0 is InferenceContext.instance(current) and ctx0.device == current
    assert ctx0.multiprocessor_count > 0 and ctx0.compute_capability >= (7, 0)
    assert isinstance(ctx0.cublas_handle, int) and ctx0.cublas_handle != 0


@pytest.mark.gpu
def test_instance_rejects_device_not_visible():
    n = _core._device_count()
    with pytest.raises(ConfigError) as info:
        InferenceContext.instance(n)
    assert info.value.argument == "device" and str(n) in str(info.value)


@pytest.mark.gpu
def test_instance_from_many_threads_gives_one_object():
    got = []
    threads = [threading.Thread(target=lambda: got.append(InferenceContext.instance()))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(c is got[0] for c in got)


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_each_device_has_its_own_context():
    if _core._device_count() < 2:
        pytest.skip("needs two GPUs")
    a, b = InferenceContext.instance(0), InferenceContext.instance(1)
    assert a is not b and (a.device, b.device) == (0, 1)
    assert a.stream.handle != b.stream.handle


# -- gen_workspace and the plan ---------------------------------------------------------------

@pytest.mark.gpu
def test_gen_workspace_numbers_by_hand(ctx):
    p = ctx.plan
    assert (p.max_tokens, p.bound_by) == (64, "max_out_tokens")
    assert p.activations_bytes == ACTIVATIONS_BYTES == 1_310_720
    assert p.kv_tensor_bytes == KV_TENSOR_BYTES == 32_768
    assert p.attention_scores_bytes == SCORES_BYTES == 131_072
    assert WORKSPACE_BYTES == 1_703_936
    assert p.workspace_bytes == ctx.workspace_bytes == granules(ctx, WORKSPACE_BYTES)
    assert p.attention_scores_offset + p.attention_scores_bytes == WORKSPACE_BYTES
    assert ctx.max_token_length == 64 and p.kv_shape == KV_SHAPE
    # The memory figures are measured, and planning them again gives the same answer (offline,
    # without the granule, which only the context knows).
    free, total = _core._memory_info(ctx.device)
    assert p.total_bytes == total and 0 < p.free_bytes <= total
    again = plan_workspace(SHAPE, **REQUEST, free_bytes=p.free_bytes, total_bytes=p.total_bytes)
    assert (again.max_tokens, again.regions, again.workspace_bytes) == (
        p.max_tokens, p.regions, WORKSPACE_BYTES)
    if not ctx.addresses_stable:
        assert again == p


@pytest.mark.gpu
def test_gen_workspace_reuses_a_fitting_allocation(ctx):
    ptr = ctx.workspace.ptr
    smaller = plan_small(ctx, batch_size=1)
    assert smaller.workspace_bytes <= granules(ctx, WORKSPACE_BYTES)
    assert smaller.max_tokens == 64 and smaller.activations_bytes < ACTIVATIONS_BYTES
    assert ctx.workspace.ptr == ptr and ctx.plan is smaller
    same = plan_small(ctx, batch_size=1)
    assert same == smaller and ctx.workspace.ptr == ptr


@pytest.mark.gpu
def test_gen_workspace_that_cannot_fit_keeps_the_previous_plan(ctx):
    before = ctx.plan
    k, _ = ctx.kv_cache(0)
    ptr = k.ptr
    del k
    with pytest.raises(WorkspaceOOMError) as info:
        plan_small(ctx, batch_size=1 << 20, prompt_len=4096, max_out_tokens=8192)
    assert info.value.requested_bytes > info.value.budget_bytes
    assert ctx.plan is before and ctx.max_token_length == 64
    assert ctx.kv_cache(0)[0].ptr == ptr


@pytest.mark.gpu
def test_view_accessors_wait_for_a_gen_workspace_between_its_plan_and_its_layout(ctx, monkeypatch):
    # gen_workspace puts the new plan and allocation in force, then its layout for the views. A
    # view asked for in between must not pair the old layout with the new allocation: the
    # accessors wait. The window is widened here by a slow step between the two halves.
    from inferctx.planning import WorkspacePlan

    inside, go_on = threading.Event(), threading.Event()
    original = WorkspacePlan._from_result.__func__

    def slow_from_result(cls, *args, **kwargs):
        inside.set()  # the new plan and allocation are in force; the layout is not yet
        go_on.wait(10)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(WorkspacePlan, "_from_result", classmethod(slow_from_result))
    grown = threading.Thread(target=plan_small, args=(ctx,), kwargs=dict(max_out_tokens=128))
    grown.start()
    assert inside.wait(10)
    seen = {}

    def ask():
        k, _ = ctx.kv_cache(0)
        seen.update(kv=k.shape, activations=ctx.activations.nbytes, workspace=ctx.workspace.nbytes)

    reader = threading.Thread(target=ask)
    reader.start()
    reader.join(0.5)
    assert reader.is_alive()  # waiting for the layout, not answering with the old one
    go_on.set()
    grown.join(10)
    reader.join(10)
    assert seen["kv"] == (2, 2, 128, 64)  # the new plan's, with its allocation
    assert seen["activations"] == 2 * ACTIVATIONS_BYTES and seen["workspace"] == ctx.plan.workspace_bytes
    monkeypatch.undo()
    plan_small(ctx)


@pytest.mark.gpu
def test_concurrent_gen_workspace_calls_leave_one_plan_in_force(ctx):
    """Two threads plan different requests at once (64 and 128 tokens), 100 times: after each
    pair the plan and layout the view accessors use are those of the plan the C++ context holds
    (its max_token_length), and asking again for that plan keeps it."""
    import threading

    wanted = (64, 128)
    barrier = threading.Barrier(len(wanted))
    errors = []

    def plan(tokens):
        try:
            barrier.wait(timeout=60)
            plan_small(ctx, max_out_tokens=tokens)
        except BaseException as exc:  # reported below
            errors.append(exc)

    seen = set()
    for _ in range(100):
        threads = [threading.Thread(target=plan, args=(t,)) for t in wanted]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        tokens = ctx.max_token_length  # the C++ context's plan
        assert tokens in wanted
        seen.add(tokens)
        assert ctx.plan.max_tokens == tokens
        assert ctx.kv_cache(0)[0].shape == (2, 2, tokens, 64)
        again = plan_small(ctx, max_out_tokens=tokens)  # the plan in force stands
        assert again.max_tokens == ctx.plan.max_tokens == ctx.max_token_length == tokens
    assert seen  # which one ends last is up to the threads
    plan_small(ctx)


@pytest.mark.gpu
def test_gen_workspace_plan_keeps_the_model_with_its_parameter_count(ctx):
    from inferctx import ModelShape

    model = ModelShape(4, 8, 512, num_kv_heads=2, num_params=123_456_789)
    p = ctx.gen_workspace(model, batch_size=2, prompt_len=16, max_out_tokens=64, dtype="float16")
    assert p.shape == model and p.shape.num_params == 123_456_789
    assert p.shape.weights_bytes() == 2 * 123_456_789  # fp16
    plan_small(ctx)


@pytest.mark.gpu
def test_gen_workspace_logs_the_plan_on_rank_0_only(ctx, caplog):
    with caplog.at_level(logging.INFO, logger="inferctx"):
        plan_small(ctx, batch_size=3)
        plan_small(ctx, batch_size=3)  # the same plan: not logged again
    records = [r for r in caplog.records if r.name == "inferctx"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "workspace" in records[0].getMessage() and "cuda:" in records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="inferctx"):
        plan_small(ctx, mp_size=2, rank=1)
    assert not [r for r in caplog.records if r.name == "inferctx"]


@pytest.mark.gpu
@pytest.mark.parametrize("argument,value", [
    ("batch_size", True), ("batch_size", 0), ("prompt_len", 1.5), ("max_out_tokens", None),
    ("dtype", "int4"), ("policy", "fast"), ("mp_size", 3), ("external_cache", 1),
    ("memory_fraction", 0.0), ("reserve_bytes", -1),
])
def test_gen_workspace_names_the_bad_argument(ctx, argument, value):
    before = ctx.plan
    with pytest.raises(ConfigError) as info:
        plan_small(ctx, **{argument: value})
    assert info.value.argument == argument
    assert ctx.plan is before


@pytest.mark.gpu
def test_gen_workspace_takes_no_memory_figures(ctx):
    with pytest.raises(TypeError, match="unexpected keyword argument 'free_bytes'"):
        plan_small(ctx, free_bytes=1 << 30)
    with pytest.raises(ConfigError) as info:
        ctx.gen_workspace("no-such-model", **REQUEST)
    # the keyword that named the model, as plan_workspace names it
    assert info.value.argument == "shape" and "unknown model preset 'no-such-model'" in str(info.value)


# -- regions and the KV cache -------------------------------------------------------------------

@pytest.mark.gpu
def test_kv_cache_views_sit_where_the_plan_says(ctx):
    p = ctx.plan
    ws = ctx.workspace
    n = granules(ctx, WORKSPACE_BYTES)
    assert (ws.dtype, ws.shape, ws.nbytes) == ("uint8", (n,), n)
    for layer in range(SHAPE.num_layers):
        k, v = ctx.kv_cache(layer)
        assert k.shape == v.shape == KV_SHAPE and k.dtype == v.dtype == "float16"
        assert k.ptr == ws.ptr + ACTIVATIONS_BYTES + layer * 2 * KV_TENSOR_BYTES
        assert v.ptr == k.ptr + KV_TENSOR_BYTES
        assert k.nbytes == KV_TENSOR_BYTES and k.offset == p.kv_cache_offset + layer * p.kv_layer_stride
        assert k.strides == (2 * 64 * 64, 64 * 64, 64, 1) and k.device == ctx.device
    act, scores = ctx.activations, ctx.attention_scores
    assert act.ptr == ws.ptr and act.nbytes == ACTIVATIONS_BYTES and act.dtype == "float16"
    assert scores.ptr == ws.ptr + ACTIVATIONS_BYTES + 8 * KV_TENSOR_BYTES
    assert scores.nbytes == SCORES_BYTES and scores.shape == (SCORES_BYTES // 2,)


@pytest.mark.gpu
def test_kv_cache_follows_dtype_and_gqa(ctx):
    plan_small(ctx, dtype="bfloat16")
    k, _ = ctx.kv_cache(3)
    assert k.dtype == "bfloat16" and k.shape == KV_SHAPE
    plan_small(ctx, dtype="float32", mp_size=2)
    k, _ = ctx.kv_cache(0)
    assert k.dtype == "float32" and k.shape == (2, 1, 64, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [-1, 4, 1 << 40, True, 1.0, "0", None])
def test_kv_cache_rejects_bad_layers(ctx, layer):
    with pytest.raises(ConfigError) as info:
        ctx.kv_cache(layer)
    assert info.value.argument == "layer"


@pytest.mark.gpu
def test_kv_cache_of_an_external_cache_plan(ctx):
    plan_small(ctx, external_cache=True)
    with pytest.raises(WorkspaceStateError, match="external_cache"):
        ctx.kv_cache(0)
    assert ctx.workspace_bytes == granules(ctx, ACTIVATIONS_BYTES + SCORES_BYTES)


# -- tokens -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_tokens_advance_to_the_limit_and_no_further(ctx):
    ctx.reset_tokens(0)
    for _ in range(63):
        ctx.advance_tokens()
    ctx.advance_tokens(1)
    assert ctx.current_tokens == 64 == ctx.max_token_length
    with pytest.raises(TokenLimitError) as info:
        ctx.advance_tokens()
    assert (info.value.current, info.value.requested, info.value.limit) == (64, 1, 64)
    assert ctx.current_tokens == 64
    ctx.reset_tokens()
    assert ctx.current_tokens == 1
    with pytest.raises(TokenLimitError):
        ctx.advance_tokens(64)


@pytest.mark.gpu
@pytest.mark.parametrize("method,argument,value", [
    ("advance_tokens", "n", 0), ("advance_tokens", "n", -3), ("advance_tokens", "n", True),
    ("advance_tokens", "n", 1.0), ("advance_tokens", "n", "1"),
    ("reset_tokens", "initial", -1), ("reset_tokens", "initial", 65),
    ("reset_tokens", "initial", False), ("reset_tokens", "initial", None),
])
def test_token_methods_name_the_bad_argument(ctx, method, argument, value):
    with pytest.raises(ConfigError) as info:
        getattr(ctx, method)(value)
    assert info.value.argument == argument


# -- Philox state -----------------------------------------------------------------------------

@pytest.mark.gpu
def test_increment_offset_rounds_up_to_multiples_of_4(ctx):
    ctx.set_seed(42)
    assert ctx.rng_state == (42, 0)
    assert ctx.increment_offset(5) == (42, 0)
    assert ctx.increment_offset(4) == (42, 8)
    assert ctx.increment_offset(0) == (42, 12)
    assert ctx.rng_state == (42, 12)
    ctx.set_seed((1 << 64) - 1)
    assert ctx.increment_offset(1) == ((1 << 64) - 1, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("method,argument,value", [
    ("increment_offset", "increment", -1), ("increment_offset", "increment", True),
    ("increment_offset", "increment", 1 << 64), ("increment_offset", "increment", 4.0),
    ("set_seed", "seed", -1), ("set_seed", "seed", None), ("set_seed", "seed", "7"),
])
def test_philox_methods_name_the_bad_argument(ctx, method, argument, value):
    ctx.set_seed(1)
    with pytest.raises(ConfigError) as info:
        getattr(ctx, method)(value)
    assert info.value.argument == argument
    assert ctx.rng_state == (1, 0)


@pytest.mark.gpu
def test_increment_offset_from_16_threads_gives_disjoint_ranges(ctx):
    ctx.set_seed(7)
    per_thread, threads = 10_000, 16
    results = [None] * threads

    def work(i):
        inc = i % 7 + 1  # 1..7: rounded up to 4 or 8
        results[i] = [(ctx.increment_offset(inc), inc) for _ in range(per_thread)]

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    ranges = sorted((offset, offset + (inc + 3) // 4 * 4)
                    for calls in results for (seed, offset), inc in calls if seed == 7)
    assert len(ranges) == per_thread * threads
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert start >= end
    total = sum((i % 7 + 1 + 3) // 4 * 4 for i in range(threads)) * per_thread
    assert ranges[-1][1] == total == ctx.rng_state[1]


# -- release / retake and lifetimes -------------------------------------------------------------

@pytest.mark.gpu
def test_release_with_views_alive(ctx):
    """Under CUDA virtual memory views are no obstacle and stay valid; under the cudaMalloc
    fallback they raise WorkspaceInUseError unless force=True detaches the allocation."""
    gc.collect()
    # Views that other tests of this process still hold (under compute-sanitizer's initcheck,
    # after test_streams.py and test_interop.py, 4 were): this test counts its own beside them,
    # as test_interop's release test does.
    others = ctx.views_alive
    k, v = ctx.kv_cache(1)
    address = k.ptr
    assert ctx.views_alive == others + 2
    if ctx.addresses_stable:
        ctx.release_workspace()
        assert ctx.released and ctx.views_alive == others + 2 and ctx.held_bytes == 0
    else:
        with pytest.raises(WorkspaceInUseError) as info:
            ctx.release_workspace()
        assert info.value.views_alive == others + 2 and not ctx.released
        assert "force=True" in str(info.value)
        ctx.release_workspace(force=True)
        assert ctx.released and ctx.views_alive == 0
    with pytest.raises(WorkspaceStateError, match="retake_workspace"):
        ctx.kv_cache(0)
    with pytest.raises(WorkspaceStateError):
        ctx.workspace
    assert ctx.plan.max_tokens == 64  # the plan is kept
    assert "released" in repr(ctx)
    assert ctx.retake_workspace() is True and not ctx.released
    again, _ = ctx.kv_cache(1)
    assert again.shape == k.shape
    assert (again.ptr == address) == ctx.addresses_stable
    del k, v


@pytest.mark.gpu
def test_detached_memory_is_freed_by_the_last_view(ctx):
    if ctx.addresses_stable:
        pytest.skip("the cudaMalloc fallback's behaviour (test_release.py runs it with "
                    "INFERCTX_DISABLE_VMM=1): under virtual memory nothing is detached")
    big = plan_small(ctx, batch_size=64, max_out_tokens=512)  # ~0.9 GiB
    gc.collect()
    k, _ = ctx.kv_cache(0)
    before = _core._memory_info(ctx.device)[0]
    ctx.release_workspace(force=True)
    assert _core._memory_info(ctx.device)[0] <= before + 2 * MIB  # still held by k
    del k, _
    gc.collect()
    freed = _core._memory_info(ctx.device)[0] - before
    assert freed >= big.workspace_bytes - 2 * MIB


@pytest.mark.gpu
def test_release_under_virtual_memory_frees_the_memory_with_views_alive(ctx):
    if not ctx.addresses_stable:
        pytest.skip("needs CUDA virtual memory (addresses_stable)")
    big = plan_small(ctx, batch_size=64, max_out_tokens=512)  # ~0.9 GiB
    gc.collect()
    k, _ = ctx.kv_cache(0)
    held = ctx.held_bytes
    assert held >= big.workspace_bytes
    before = _core._memory_info(ctx.device)[0]
    ctx.release_workspace(force=True)  # force changes nothing here
    assert _core._memory_info(ctx.device)[0] - before >= held - 2 * MIB
    assert ctx.views_alive >= 1
    ctx.retake_workspace()
    assert ctx.kv_cache(0)[0].ptr == k.ptr and ctx.held_bytes == held


@pytest.mark.gpu
@pytest.mark.parametrize("force", [1, "yes", None])
def test_release_force_must_be_a_bool(ctx, force):
    with pytest.raises(ConfigError) as info:
        ctx.release_workspace(force)
    assert info.value.argument == "force" and not ctx.released
    with pytest.raises(ConfigError) as info:
        ctx.release_workspace(keep_contents=force)
    assert info.value.argument == "keep_contents" and not ctx.released


@pytest.mark.gpu
def test_1000_release_retake_cycles_leak_nothing(ctx):
    plan_small(ctx, batch_size=16)
    gc.collect()
    ctx.release_workspace()  # the allocation may be a larger one reused; now it is the plan's
    assert ctx.retake_workspace()
    free_before = _core._memory_info(ctx.device)[0]
    for _ in range(1000):
        ctx.release_workspace()
        assert ctx.retake_workspace()
    free_after = _core._memory_info(ctx.device)[0]
    assert abs(free_after - free_before) <= 2 * MIB


@pytest.mark.gpu
def test_a_fresh_context_has_no_workspace():
    # A plan cannot be dropped, so a new process shows the state before gen_workspace.
    script = (
        "from inferctx import WorkspaceStateError, TokenLimitError\n"
        "from inferctx.context import InferenceContext\n"
        "c = InferenceContext.instance()\n"
        "assert c.workspace_bytes == 0 and c.max_token_length == 0 and c.views_alive == 0\n"
        "for get in (lambda: c.plan, lambda: c.workspace, lambda: c.kv_cache(0)):\n"
        "    try:\n"
        "        get()\n"
        "    except WorkspaceStateError as e:\n"
        "        assert 'gen_workspace' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('no WorkspaceStateError')\n"
        "try:\n"
        "    c.advance_tokens()\n"
        "except TokenLimitError as e:\n"
        "    assert 'gen_workspace' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no TokenLimitError')\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# -- streams ----------------------------------------------------------------------------------

def _current_stream_handle(device):
    """What ctx.stream follows without use_stream: torch's current stream once torch is imported,
    else CuPy's, else the context's own (None)."""
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        return torch.cuda.current_stream(device).cuda_stream or 1  # torch's default is 0: legacy
    if "cupy" in sys.modules:
        return sys.modules["cupy"].cuda.get_current_stream().ptr or 1
    return None


@pytest.mark.gpu
def test_streams_of_the_context(ctx):
    s, c, own = ctx.stream, ctx.comm_stream, ctx.own_stream
    assert own.handle not in (0, 1, 2) and not own.owned and own.device == ctx.device
    assert s.handle == (_current_stream_handle(ctx.device) or own.handle)
    assert s.__cuda_stream__() == (0, s.handle)
    assert c.handle not in (0, 1, 2, own.handle) and not s.owned
    assert ctx.stream is s  # cached while it is the compute stream
    ctx.sync_comp()
    ctx.sync_comm()
    s.synchronize()
    c.synchronize()


@pytest.mark.gpu
def test_use_stream_adopts_and_returns(ctx):
    from inferctx.context import Stream

    own = ctx.stream.handle
    mine = Stream()
    ctx.use_stream(mine)
    assert ctx.stream.handle == mine.handle
    ctx.sync_comp()
    ctx.use_stream(mine.handle)  # a bare handle
    assert ctx.stream.handle == mine.handle
    ctx.use_stream(0)  # the legacy default stream, by name
    assert ctx.stream.handle == 1
    ctx.use_stream(None)
    assert ctx.stream.handle == own


@pytest.mark.gpu
@pytest.mark.parametrize("stream", [True, "s", 1.5, -1, object()])
def test_use_stream_names_the_bad_argument(ctx, stream):
    own = ctx.stream.handle
    with pytest.raises(ConfigError) as info:
        ctx.use_stream(stream)
    assert info.value.argument == "stream" and ctx.stream.handle == own


@pytest.mark.gpu
def test_use_stream_of_torch_and_cupy(ctx):
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    ctx.use_stream(s)
    assert ctx.stream.handle == s.cuda_stream
    cupy = pytest.importorskip("cupy")
    cs = cupy.cuda.Stream(non_blocking=True)
    ctx.use_stream(cs)
    assert ctx.stream.handle == cs.ptr
    ctx.use_stream(None)

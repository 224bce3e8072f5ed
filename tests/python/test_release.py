"""release_workspace / retake_workspace: addresses kept under CUDA virtual memory (views, torch,
CuPy and JAX arrays, CUDA graphs), contents kept through pinned host memory, ordering after
pending work, what a released workspace refuses, out of memory at retake, and the cudaMalloc
fallback (INFERCTX_DISABLE_VMM=1), whose tests run in a child pytest of their own."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gpu_context import KV_SHAPE, ctx, live_views_report, plan_small  # noqa: F401 (fixture)

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX is imported

from inferctx import WorkspaceInUseError, WorkspaceOOMError, WorkspaceStateError  # noqa: E402
from inferctx import _core  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
SLACK = 4 * MIB  # the driver's own bookkeeping may move free memory by a little
FALLBACK = os.environ.get("INFERCTX_DISABLE_VMM", "") not in ("", "0")


def free_bytes(ctx):
    return _core._memory_info(ctx.device)[0]


def hog(torch, ctx, leave):
    """torch tensors holding the device's free memory until about `leave` bytes are left (in
    blocks of 1 GiB, then smaller ones down to 2 MiB), so that an allocation larger than that
    must fail."""
    blocks = []
    device = f"cuda:{ctx.device}"
    for chunk in (GIB, 256 * MIB, 64 * MIB, 16 * MIB, 2 * MIB):
        while free_bytes(ctx) > leave + chunk:
            try:
                blocks.append(torch.empty(chunk, dtype=torch.uint8, device=device))
            except RuntimeError:  # torch's allocator rounds up: the next size down
                break
    return blocks


def overwrite_free_memory(torch, ctx):
    """While a workspace is released: nearly all free device memory taken, written with a pattern
    (0xA5) and given back, so that memory the release freed holds other bytes at the retake (a
    keep_contents retake that copied nothing back cannot show the old ones)."""
    blocks = hog(torch, ctx, 256 * MIB)
    for b in blocks:
        b.fill_(0xA5)
    torch.cuda.synchronize()
    del blocks
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _give_back_torch_cache():
    """Memory a test took through torch goes back to the device afterwards: torch's caching
    allocator would keep it, and a child process (or a later plan) would find none."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def stable_only(ctx):
    if not ctx.addresses_stable:
        pytest.skip("needs CUDA virtual memory (addresses_stable); this run is the cudaMalloc fallback")


def fallback_only(ctx):
    if ctx.addresses_stable:
        pytest.skip("the cudaMalloc fallback's behaviour; test_cudamalloc_fallback_suite runs it")


def fresh_plan(ctx, **overrides):
    """The small plan (with `overrides`) mapped afresh: released first with no view alive, so the
    workspace holds exactly the plan's bytes."""
    gc.collect()
    if ctx.views_alive:
        # Under virtual memory the release below would not refuse, and the plan after it would map
        # the whole earlier workspace back for them: say which views an earlier test left alive.
        raise AssertionError(f"{ctx.views_alive} view(s) of the workspace alive before a fresh plan\n"
                             f"{live_views_report()}")
    try:
        ctx.release_workspace()
    except WorkspaceInUseError as refused:  # (the fallback's refusal, should one appear meanwhile)
        raise AssertionError(f"{refused}\n{live_views_report()}") from refused
    plan = plan_small(ctx, **overrides)
    assert ctx.held_bytes == plan.workspace_bytes
    return plan


@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    yield torch
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()


# -- which path is in force -------------------------------------------------------------------

@pytest.mark.gpu
def test_addresses_stable_says_which_path_is_in_force(ctx):
    g = ctx.allocation_granularity
    if FALLBACK:
        assert not ctx.addresses_stable and g == 0
    else:
        major, _ = ctx.compute_capability
        if major >= 7:  # every CUDA 13 Linux driver has virtual memory management from Volta on
            assert ctx.addresses_stable
    if ctx.addresses_stable:
        assert g >= 64 * 1024 and g & (g - 1) == 0
        assert ctx.workspace_bytes % g == 0  # the exact policy counts whole granules
        assert ctx.plan.attention_scores_offset + ctx.plan.attention_scores_bytes <= ctx.workspace_bytes


# -- addresses across cycles ------------------------------------------------------------------

@pytest.mark.gpu
def test_100_cycles_keep_the_workspace_and_torch_cupy_jax_views_at_their_addresses(ctx, torch):
    stable_only(ctx)
    cupy = pytest.importorskip("cupy")
    jax = pytest.importorskip("jax")

    plan = fresh_plan(ctx, batch_size=64, max_out_tokens=1024, dtype="float32")  # ~3.5 GiB
    held = ctx.held_bytes
    assert held >= GIB
    ws = ctx.workspace
    k0, v0 = ctx.kv_cache(0)
    k1, _ = ctx.kv_cache(1)
    k2, _ = ctx.kv_cache(2)
    t = torch.from_dlpack(k0)
    c = cupy.from_dlpack(v0)
    c_cai = cupy.asarray(k1)  # through __cuda_array_interface__
    j = jax.dlpack.from_dlpack(k2)
    pointers = (ws.ptr, k0.ptr, v0.ptr, k1.ptr, k2.ptr)
    assert (t.data_ptr(), c.data.ptr, c_cai.data.ptr, j.unsafe_buffer_pointer()) == pointers[1:]
    for i in range(100):
        before = free_bytes(ctx)
        ctx.release_workspace()
        released = free_bytes(ctx)
        assert released - before >= held - SLACK, (i, released - before)
        assert ctx.released and ctx.held_bytes == 0 and ctx.views_alive >= 5
        ctx.retake_workspace()
        assert released - free_bytes(ctx) >= held - SLACK, i
        assert ctx.held_bytes == held and not ctx.released
        assert (ctx.workspace.ptr, ctx.kv_cache(0)[0].ptr, ctx.kv_cache(0)[1].ptr,
                ctx.kv_cache(1)[0].ptr, ctx.kv_cache(2)[0].ptr) == pointers
        assert (t.data_ptr(), c.data.ptr, c_cai.data.ptr, j.unsafe_buffer_pointer()) == pointers[1:]
        # The old arrays reach the new memory: what one writes, the others read.
        t.fill_(float(i))
        torch.cuda.synchronize()
        c.fill(float(i + 1))
        cupy.cuda.get_current_stream().synchronize()
        assert float(t.double().mean()) == float(i)
        assert float(torch.from_dlpack(v0).double().mean()) == float(i + 1)
        torch.from_dlpack(k2).fill_(2.0)
        torch.cuda.synchronize()
        # JAX's array read through its own device-to-host copy. (A jax.numpy reduction here
        # would do, but under compute-sanitizer JAX keeps the frames of a jax.numpy call's
        # callers alive, with their locals: this test's views, seen by the next test as alive.)
        assert np.all(np.asarray(j) == 2.0)
        c_cai.fill(float(i))  # CuPy through the CUDA array interface writes there too
        cupy.cuda.get_current_stream().synchronize()
        assert float(torch.from_dlpack(k1).double().mean()) == float(i)
    assert plan.workspace_bytes <= held and k2.size > 0


@pytest.mark.gpu
def test_release_returns_the_memory_and_retake_takes_it_on_either_path(ctx, torch):
    plan = fresh_plan(ctx, batch_size=32, max_out_tokens=1024)
    held = ctx.held_bytes
    address = ctx.workspace.ptr
    before = free_bytes(ctx)
    ctx.release_workspace()
    assert free_bytes(ctx) - before >= held - SLACK
    assert ctx.held_bytes == 0 and ctx.released and ctx.plan is plan
    ctx.retake_workspace()
    assert before - SLACK <= free_bytes(ctx) <= before + SLACK
    assert ctx.held_bytes == (held if ctx.addresses_stable else plan.workspace_bytes)
    if ctx.addresses_stable:
        assert ctx.workspace.ptr == address


# -- what a released workspace refuses --------------------------------------------------------

@pytest.mark.gpu
def test_while_released_views_refuse_exports_and_kernels_refuse_its_addresses(ctx, torch):
    stable_only(ctx)
    import inferctx
    from inferctx.context import PinnedBuffer

    fresh_plan(ctx)
    k, _ = ctx.kv_cache(0)
    sub = k.view("uint8", (16,), offset=256)
    t = torch.from_dlpack(k)  # made before the release
    elsewhere = torch.ones(1024, dtype=torch.float16, device=f"cuda:{ctx.device}")
    ctx.release_workspace()
    for export in (lambda: k.__dlpack__(), lambda: k.__cuda_array_interface__,
                   lambda: sub.__dlpack__(stream=-1), lambda: torch.from_dlpack(k),
                   lambda: k.copy_to_host(PinnedBuffer(k.nbytes)),
                   lambda: k.copy_from_host(PinnedBuffer(k.nbytes)),
                   lambda: inferctx.dropout(k, 0.5), lambda: inferctx.dropout(t, 0.5),
                   lambda: inferctx.dropout(elsewhere, 0.5, out=t.flatten()[:1024])):
        with pytest.raises(WorkspaceStateError, match="retake_workspace"):
            export()
    with pytest.raises(WorkspaceStateError, match="retake_workspace"):
        ctx.kv_cache(0)
    with pytest.raises(WorkspaceStateError, match="retake_workspace"):
        ctx.workspace
    assert k.view("uint8").nbytes == k.nbytes  # a sub-view touches nothing
    y, _ = inferctx.dropout(elsewhere, 0.5)  # memory outside the workspace is not affected
    torch.cuda.synchronize()
    assert y.shape == elsewhere.shape
    ctx.retake_workspace()
    t.fill_(1.0)
    y, _ = inferctx.dropout(k, 0.5)
    y = torch.from_dlpack(y)
    torch.cuda.synchronize()
    assert torch.from_dlpack(k).data_ptr() == t.data_ptr() == k.ptr
    assert set(torch.unique(y.float()).tolist()) <= {0.0, 2.0}


class _Interface:
    """A bare __cuda_array_interface__ (version 3, no stream) with the given fields."""

    def __init__(self, ptr, typestr, shape, strides):
        self.__cuda_array_interface__ = {"data": (ptr, False), "typestr": typestr, "shape": shape,
                                         "strides": strides, "version": 3}


@pytest.mark.gpu
def test_while_released_an_operand_whose_strides_reach_into_the_workspace_is_refused(ctx, torch):
    """An operand that starts outside the released workspace but whose strides place an element
    inside it (either way: the stride is negative where the workspace lies below) is refused as
    one that starts there, before anything is launched; with the same start and one element
    (nothing inside the workspace) it is taken."""
    stable_only(ctx)
    import inferctx

    fresh_plan(ctx)
    k, _ = ctx.kv_cache(0)
    inside = k.ptr + 256
    elsewhere = torch.zeros(1024, dtype=torch.uint8, device=f"cuda:{ctx.device}")
    start = elsewhere.data_ptr()
    ctx.release_workspace()
    try:
        reaching = _Interface(start, "|u1", (2,), (inside - start,))
        for call in (lambda: _core._as_cuda_array(reaching),
                     lambda: inferctx.dropout(reaching, 0.5)):
            with pytest.raises(WorkspaceStateError, match="a kernel operand"):
                call()
        # Two dimensions, the reaching one last, and float32 items (strides in bytes, 4 each).
        step = (inside - start) // 4 * 4
        reaching_2d = _Interface(start, "<f4", (1, 2), (8, step))
        assert start + step >= k.ptr and start + step < k.ptr + k.nbytes
        with pytest.raises(WorkspaceStateError, match="a kernel operand"):
            _core._as_cuda_array(reaching_2d)
        alone = _core._as_cuda_array(_Interface(start, "|u1", (1,), (inside - start,)))
        assert alone.ptr == start and alone.size == 1
    finally:
        ctx.retake_workspace()
    assert _core._as_cuda_array(reaching).ptr == start  # held again: taken


# -- contents ---------------------------------------------------------------------------------

@pytest.mark.gpu
def test_keep_contents_gives_a_4_gib_workspace_back_byte_for_byte(ctx, torch):
    # batch 512: about 38 MiB a token, so the 4 GiB limit holds a little over 100 tokens.
    plan = fresh_plan(ctx, batch_size=512, max_out_tokens=4096, memory_limit_bytes=4 * GIB)
    assert 4 * GIB - 64 * MIB <= plan.workspace_bytes <= 4 * GIB
    nbytes = ctx.held_bytes
    t = torch.from_dlpack(ctx.workspace)
    assert t.numel() == nbytes
    t.random_(0, 256, generator=torch.Generator(device=t.device).manual_seed(14))
    reference = t.clone()
    address = t.data_ptr()
    if not ctx.addresses_stable:
        del t  # the cudaMalloc path frees the memory: no view may be alive
        gc.collect()
    before = free_bytes(ctx)
    ctx.release_workspace(keep_contents=True)
    # (pinning the host copy of several GiB takes a few MiB of device memory for its mappings)
    assert free_bytes(ctx) - before >= nbytes - 4 * SLACK
    assert ctx.host_copy_bytes >= nbytes
    overwrite_free_memory(torch, ctx)
    ctx.retake_workspace()
    back = torch.from_dlpack(ctx.workspace)
    if ctx.addresses_stable:
        assert back.data_ptr() == address
    assert torch.equal(back[:reference.numel()], reference)
    # Again, reusing the host copy; then a plain release frees it.
    back.bitwise_not_()
    reference.bitwise_not_()
    del back
    gc.collect()
    ctx.release_workspace(keep_contents=True)
    overwrite_free_memory(torch, ctx)
    ctx.retake_workspace()
    assert torch.equal(torch.from_dlpack(ctx.workspace)[:reference.numel()], reference)
    gc.collect()
    ctx.release_workspace()
    assert ctx.host_copy_bytes == 0
    ctx.retake_workspace()
    t = reference = None  # no view alive: the small plan maps afresh (a live view keeps the range whole)
    fresh_plan(ctx)  # back to the small workspace


@pytest.mark.gpu
def test_a_kv_cache_survives_a_release_in_the_middle_of_a_generation(ctx, torch):
    fresh_plan(ctx)
    ctx.reset_tokens(0)
    k, v = ctx.kv_cache(3)
    torch.from_dlpack(k).copy_(torch.arange(k.size, device=f"cuda:{ctx.device}").reshape(KV_SHAPE))
    torch.from_dlpack(v).fill_(-3.0)
    ctx.advance_tokens(17)
    expected_k, expected_v = torch.from_dlpack(k).clone(), torch.from_dlpack(v).clone()
    if not ctx.addresses_stable:
        del k, v
        gc.collect()
    ctx.release_workspace(keep_contents=True)
    assert ctx.current_tokens == 17  # the generation's state is the caller's and stays
    overwrite_free_memory(torch, ctx)
    ctx.retake_workspace()
    k, v = ctx.kv_cache(3)
    assert torch.equal(torch.from_dlpack(k), expected_k)
    assert torch.equal(torch.from_dlpack(v), expected_v)
    ctx.advance_tokens(1)


@pytest.mark.gpu
def test_the_contents_epoch_moves_exactly_when_the_contents_are_given_up(ctx, torch):
    fresh_plan(ctx)
    e = ctx._contents_epoch
    ctx.release_workspace(keep_contents=True)  # kept: the same contents come back
    assert ctx._contents_epoch == e and ctx.host_copy_bytes >= ctx.workspace_bytes
    ctx.retake_workspace()
    assert ctx._contents_epoch == e
    # Released with its contents kept, then released without them: the host copy goes (it may be
    # most of the host's memory), and with it the contents.
    ctx.release_workspace(keep_contents=True)
    ctx.release_workspace()
    assert ctx.host_copy_bytes == 0 and ctx._contents_epoch == e + 1
    ctx.retake_workspace()
    ctx.release_workspace()  # given up again
    assert ctx._contents_epoch == e + 2
    ctx.release_workspace()  # already released, nothing kept: nothing more to give up
    assert ctx._contents_epoch == e + 2
    ctx.retake_workspace()
    assert ctx._contents_epoch == e + 2


@pytest.mark.gpu
def test_release_waits_for_a_kernel_pending_on_another_stream(ctx, torch):
    fresh_plan(ctx, batch_size=64, max_out_tokens=1024)
    t = torch.from_dlpack(ctx.workspace)
    t.zero_()
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device=t.device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(400_000_000)  # a few hundred ms of GPU time, then the writes
        t.fill_(7)
    # No synchronisation here: the release must order itself after the side stream's work.
    if ctx.addresses_stable:
        ctx.release_workspace(keep_contents=True)
    else:
        with pytest.raises(WorkspaceInUseError):
            ctx.release_workspace(keep_contents=True)
        ctx.release_workspace(force=True, keep_contents=True)  # t keeps the old allocation
    assert side.query()
    ctx.retake_workspace()
    back = torch.from_dlpack(ctx.workspace)
    assert bool((back == 7).all())
    if ctx.addresses_stable:
        assert back.data_ptr() == t.data_ptr()


# -- CUDA graphs ------------------------------------------------------------------------------

@pytest.mark.gpu
def test_a_graph_captured_before_release_writes_the_kv_cache_after_retake(ctx, torch):
    stable_only(ctx)
    fresh_plan(ctx)
    device = f"cuda:{ctx.device}"
    k, v = ctx.kv_cache(1)
    tk, tv = torch.from_dlpack(k), torch.from_dlpack(v)
    step = torch.zeros(KV_SHAPE, dtype=torch.float16, device=device)  # outside the workspace
    out = torch.zeros(KV_SHAPE, dtype=torch.float16, device=device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch asks before a capture
        tk.copy_(step)
        out.copy_(tv * 2)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.copy_(step)       # writes into the KV cache
        out.copy_(tv * 2)    # reads from it
    for value, keep in ((1.0, False), (2.0, True), (3.0, False), (4.0, True)):
        tv.fill_(value)
        torch.cuda.synchronize()
        ctx.release_workspace(keep_contents=keep)
        ctx.retake_workspace()
        if not keep:
            tv.fill_(value)  # the new memory holds anything
        step.fill_(value + 10)
        graph.replay()
        torch.cuda.synchronize()
        assert bool((tk == value + 10).all()), value
        assert bool((out == 2 * value).all()), value
    del graph


# -- growing ----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_a_larger_plan_grows_the_workspace_in_place_under_live_views(ctx, torch):
    stable_only(ctx)
    fresh_plan(ctx)
    k, _ = ctx.kv_cache(0)
    t = torch.from_dlpack(k)
    t.fill_(5.0)
    address = ctx.workspace.ptr
    big = plan_small(ctx, batch_size=64, max_out_tokens=2048)
    assert big.workspace_bytes > 100 * MIB and ctx.held_bytes == big.workspace_bytes
    assert ctx.workspace.ptr == address and k.ptr == t.data_ptr()
    assert bool((t == 5.0).all())  # grown around it: the old bytes did not move
    torch.from_dlpack(ctx.workspace)[-1] = 3  # and the new tail is there
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_a_plan_that_cannot_be_had_keeps_the_workspace_its_address_and_contents(ctx, torch):
    fresh_plan(ctx)
    before = ctx.plan
    t = torch.from_dlpack(ctx.workspace)
    t.fill_(0x5A)
    address = t.data_ptr()
    taken = hog(torch, ctx, 256 * MIB)
    try:
        with pytest.raises(WorkspaceOOMError):  # 4096 tokens must fit: about 18 GiB
            plan_small(ctx, batch_size=64, max_out_tokens=4096, min_out_tokens=4096)
        assert ctx.plan is before and not ctx.released
        assert ctx.workspace.ptr == address
        assert bool((t == 0x5A).all())
    finally:
        del taken
        torch.cuda.empty_cache()


# -- out of memory at retake ------------------------------------------------------------------

@pytest.mark.gpu
def test_retake_without_memory_raises_and_leaves_the_context_released_and_consistent(ctx, torch):
    fresh_plan(ctx, batch_size=64, max_out_tokens=1024)
    held = ctx.held_bytes
    plan = ctx.plan
    t = torch.from_dlpack(ctx.workspace)
    t.fill_(0x3C)
    reference = t.clone()
    k, v = ctx.kv_cache(0)
    if not ctx.addresses_stable:
        del t, k, v  # the fallback frees the memory: no view may be alive
        gc.collect()
    ctx.release_workspace(keep_contents=True)
    taken = hog(torch, ctx, 64 * MIB)
    for b in taken:  # the memory the release freed holds other bytes now
        b.fill_(0x5A)
    try:
        assert free_bytes(ctx) < held
        with pytest.raises(WorkspaceOOMError) as info:
            ctx.retake_workspace()
        e = info.value
        assert e.requested_bytes == (held if ctx.addresses_stable else plan.workspace_bytes)
        assert e.free_bytes < e.requested_bytes and e.total_bytes >= e.free_bytes
        assert "stays released" in str(e) and "retake_workspace" in str(e)
        assert ctx.released and ctx.held_bytes == 0 and ctx.plan is plan
        assert ctx.host_copy_bytes >= held
        with pytest.raises(WorkspaceStateError):
            ctx.workspace
        if ctx.addresses_stable:
            with pytest.raises(WorkspaceStateError):
                k.__dlpack__()
            assert ctx.views_alive >= 2
    finally:
        del taken
        torch.cuda.empty_cache()
    assert ctx.retake_workspace() is True
    back = torch.from_dlpack(ctx.workspace)
    assert torch.equal(back, reference)
    if ctx.addresses_stable:
        assert back.data_ptr() == t.data_ptr() and k.__dlpack__() is not None


@pytest.mark.gpu
def test_a_smaller_plan_that_views_of_the_released_workspace_hold_back_says_to_drop_them(ctx, torch):
    """Released with views alive, the workspace comes back whole before a new plan uses it. When
    that fails, no smaller request can help: the error says why (the views), what to do (drop
    them, then plan again), and not "ask for less"; it asked for a smaller batch_size while the
    new plan was far within its budget."""
    stable_only(ctx)
    big = fresh_plan(ctx, batch_size=64, max_out_tokens=1024)
    held = ctx.held_bytes
    k, v = ctx.kv_cache(0)
    ctx.release_workspace()
    taken = hog(torch, ctx, held // 2)
    try:
        with pytest.raises(WorkspaceOOMError) as info:
            plan_small(ctx)  # a few MiB: within the free memory measured
        e = info.value
        message = str(e)
        assert e.requested_bytes == held and e.requested_bytes > e.budget_bytes
        assert "the released workspace comes back whole" in message
        # k and v, and no other (fresh_plan found none): the count worked out, not read back
        assert ctx.views_alive == 2 and "2 view(s) of it are alive" in message
        assert "drop those views" in message and "Ask for less" not in message
        assert ctx.released and ctx.plan is big
    finally:
        del taken
        torch.cuda.empty_cache()
    del k, v
    gc.collect()
    plan = plan_small(ctx)  # with the views gone, only the plan's bytes are mapped
    assert not ctx.released and ctx.held_bytes == plan.workspace_bytes


@pytest.mark.gpu
def test_a_workspace_past_8_gib_is_mapped_in_parallel_parts_and_a_failed_retake_keeps_none(ctx, torch):
    stable_only(ctx)
    # batch 512: about 38 MiB a token, so the 12 GiB limit holds a little over 300 tokens; from 8 GiB
    # on, a mapping is made of 4 parts created and mapped by 4 threads at once.
    fresh_plan(ctx, batch_size=512, max_out_tokens=4096, memory_limit_bytes=12 * GIB)
    held = ctx.held_bytes
    assert held >= 8 * GIB
    t = torch.from_dlpack(ctx.workspace)
    t.fill_(0x5A)  # every byte of every part is mapped and writable
    assert bool((t == 0x5A).all())
    address = t.data_ptr()
    before = free_bytes(ctx)
    ctx.release_workspace()  # the parts unmapped and released by as many threads
    assert free_bytes(ctx) - before >= held - SLACK and ctx.held_bytes == 0
    ctx.retake_workspace()  # parts again, at the same addresses
    t.fill_(0x33)
    assert bool((t[-MIB:] == 0x33).all()) and t.data_ptr() == address
    ctx.release_workspace()
    taken = hog(torch, ctx, held // 2)  # some parts can be had, not all
    try:
        before = free_bytes(ctx)
        with pytest.raises(WorkspaceOOMError):
            ctx.retake_workspace()
        assert ctx.released and ctx.held_bytes == 0
        assert abs(free_bytes(ctx) - before) <= SLACK  # the parts that were had went back
    finally:
        del taken
        torch.cuda.empty_cache()
    assert ctx.retake_workspace() is True
    t.fill_(0x11)
    assert bool((t[:MIB] == 0x11).all()) and bool((t[-MIB:] == 0x11).all())
    del t
    fresh_plan(ctx)  # back to the small workspace


# -- the cudaMalloc fallback ------------------------------------------------------------------

@pytest.mark.gpu
def test_cudamalloc_fallback_release_with_views_raises_unless_forced(ctx, torch):
    fallback_only(ctx)
    fresh_plan(ctx)
    k, v = ctx.kv_cache(0)
    del v
    old = k.ptr
    with pytest.raises(WorkspaceInUseError) as info:
        ctx.release_workspace()
    assert info.value.views_alive == 1 and not ctx.released
    ctx.release_workspace(force=True)
    assert ctx.released and ctx.views_alive == 0
    torch.from_dlpack(k).fill_(1.0)  # detached: k keeps its memory, still usable
    ctx.retake_workspace()
    assert ctx.kv_cache(0)[0].ptr != old


@pytest.mark.gpu
def test_disable_vmm_gives_the_cudamalloc_fallback_logged_once():
    script = textwrap.dedent("""
        import logging
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record)
        logging.getLogger("inferctx").addHandler(Keep())
        logging.getLogger("inferctx").setLevel(logging.INFO)
        from inferctx.context import InferenceContext
        c = InferenceContext.instance()
        assert InferenceContext.instance() is c
        assert not c.addresses_stable and c.allocation_granularity == 0
        said = [r.getMessage() for r in records if "cudaMalloc" in r.getMessage()]
        assert len(said) == 1 and "INFERCTX_DISABLE_VMM=1" in said[0], said
        print("fallback ok")
    """)
    env = {**os.environ, "INFERCTX_DISABLE_VMM": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "fallback ok" in done.stdout


@pytest.mark.gpu
def test_cudamalloc_fallback_suite():
    """This file and the release cases of test_context.py again, in a child pytest with
    INFERCTX_DISABLE_VMM=1 (a context chooses its path once, when it is made)."""
    if FALLBACK:
        pytest.skip("this is the child run already")
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "INFERCTX_DISABLE_VMM": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
         os.path.join(here, "test_release.py"), os.path.join(here, "test_context.py"),
         "-k", "release or retake or workspace or kv_cache or detached"],
        env=env, cwd=os.path.dirname(os.path.dirname(here)), capture_output=True, text=True,
        timeout=1200)
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " failed" not in done.stdout, tail
    # The fallback's own free-memory case, which skips under virtual memory, ran and passed here.
    assert "PASSED tests/python/test_context.py::test_detached_memory_is_freed_by_the_last_view" in done.stdout, tail


# -- the README's section ---------------------------------------------------------------------

@pytest.mark.gpu
def test_the_readme_release_example_runs_as_written(tmp_path):
    pytest.importorskip("torch")
    if FALLBACK:
        pytest.skip("the README example shows CUDA virtual memory: views alive through a release")
    import re

    readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    text = open(readme, encoding="utf-8").read()
    start = text.index("## Release and retake\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start:end], re.S)
    assert len(blocks) == 1
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", blocks[0]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.gpu
def test_python_threads_go_on_while_a_release_copies_the_workspace(ctx):
    """A keep_contents release of 4.8 GiB holds the context's lock while it copies to the host.
    A thread that asks ctx.released meanwhile waits for that lock without the GIL, so the other
    Python threads go on (before, they stopped until the copy was done)."""
    from inferctx import ModelShape

    ctx.gen_workspace(ModelShape(num_layers=64, num_heads=8, hidden_dim=512, num_kv_heads=8),
                      batch_size=32, prompt_len=16, max_out_tokens=1024, dtype="float16")
    assert ctx.workspace_bytes == int(4.8125 * (1 << 30))
    try:
        _threads_go_on_during_release(ctx)
    finally:  # the next tests start from a held workspace of the usual plan, without the host copy
        if ctx.released:
            ctx.retake_workspace()
        ctx.release_workspace()
        ctx.retake_workspace()
        plan_small(ctx)


def _threads_go_on_during_release(ctx):
    import threading
    import time

    torch = pytest.importorskip("torch")
    # Written first: the release copies every byte, and initcheck (pysanitize) would report each
    # never-written one.
    torch.from_dlpack(ctx.workspace).view(torch.uint8).fill_(0)
    started = threading.Event()
    answers = []

    def release():
        started.set()
        ctx.release_workspace(keep_contents=True)

    def ask():
        answers.append(ctx.released)  # waits for the release's lock

    releaser = threading.Thread(target=release)
    asker = threading.Thread(target=ask)
    releaser.start()
    started.wait()
    time.sleep(0.05)  # the release has taken the lock: it pins 4.8 GiB and copies into it
    asker.start()
    # This thread's turns while the asker waits for the lock and the release runs: with the asker
    # holding the GIL while it waits, this thread would have none until the release was done.
    turns = 0
    deadline = time.monotonic() + 60
    while releaser.is_alive() and time.monotonic() < deadline:
        if asker.is_alive() and not answers:
            turns += 1
    releaser.join(timeout=120)
    asker.join(timeout=120)
    assert not releaser.is_alive() and not asker.is_alive(), "the release or ctx.released did not return"
    assert answers == [True], answers  # asked while the release held the lock: answered after it
    assert turns >= 100, turns



def test_the_live_views_report_names_the_tensors_over_a_view_and_what_holds_them(monkeypatch):
    # What fresh_plan and the fuzz fixture print when views outlive their test: each view with the
    # types holding it, what holds those (a few steps back), and the tensors over its memory
    # with theirs, a frame by its function's name (a finished test's frame that a stored
    # exception keeps). Shown on the CPU with a stand-in view
    # over a CPU tensor's memory.
    torch = pytest.importorskip("torch")
    import inferctx
    from gpu_context import live_views_report

    class View:
        def __init__(self, ptr, nbytes):
            self.ptr, self.nbytes = ptr, nbytes

        def __repr__(self):
            return f"<view at {self.ptr:#x}>"

    def a_test_that_raised():
        kept = torch.arange(16, dtype=torch.float32)
        views.append(View(kept.data_ptr(), kept.nbytes))
        raise RuntimeError("its frame, and kept with it, live on in the traceback")

    monkeypatch.setattr(inferctx, "DeviceView", View, raising=False)
    views = [View(1 << 40, 64)]
    try:
        a_test_that_raised()
    except RuntimeError as exc:
        stored = exc
    # A list that only a reference no Python object shows keeps alive (as C code's would).
    unseen = [View(1 << 41, 8)]
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(unseen))
    address = id(unseen)
    del unseen
    try:
        report = live_views_report(device_type="cpu")
    finally:
        ctypes.pythonapi.Py_DecRef(ctypes.cast(address, ctypes.py_object))
    lines = report.splitlines()
    assert lines[0] == "3 DeviceView(s) alive", report
    assert "  <view at 0x20000000000> held by list" in lines, report
    assert "    list held by nothing seen (and 1 unseen reference(s))" in lines, report
    assert "<view at 0x10000000000> held by list" in report
    tensor_lines = [line for line in lines if line.startswith("    tensor (16,)")]
    assert len(tensor_lines) == 1 and "frame of a_test_that_raised" in tensor_lines[0], report
    # Back from the list that holds the views: the closure's cell, the function and the frame
    # that hold it, and the stored exception's traceback that keeps that frame.
    assert "    list held by cell" in lines, report
    # (the unseen reference: the running test's own local)
    assert "      cell held by frame of a_test_that_raised, tuple (and 1 unseen reference(s))" in lines, report
    assert ("        frame of a_test_that_raised held by traceback of a_test_that_raised" in lines), report
    # ... the traceback's chain, and at its head the stored exception
    assert ("            traceback of test_the_live_views_report_names_the_tensors_over_a_view_and_"
            "what_holds_them held by RuntimeError" in lines), report
    assert stored.__traceback__ is not None

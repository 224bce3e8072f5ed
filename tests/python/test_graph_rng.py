"""Dropout captured into CUDA graphs (torch.cuda.graph, a CuPy graph, a raw stream capture):
fresh masks at every replay with no host call of inferctx between replays, each equal bit for bit
to the NumPy Philox reference (philox_reference.py) at the state the design gives replay r of
call site k (cuda/include/inferctx/philox.hpp, docs/graphs.md):

    element i  ->  curand_init(seed, k * 2**36 + i // 4, 2**63 + 4 * r)

where k is the site number the capture took (graph_rng_state()["sites"] before it) and r the
replays of that site since its capture or the last set_seed. Eager calls keep
curand_init(seed, i // 4, offset) with offsets below 2**63, so no graph draw can repeat one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import time

import numpy as np
import pytest

import inferctx
import philox_reference as ref
from gpu_context import settled_live_sites
from inferctx import _core
from inferctx.errors import ConfigError

pytestmark = pytest.mark.gpu

GRAPH_OFFSET_BASE = 2**63
SITE_SHIFT = 36


@pytest.fixture
def ctx(torch):
    context = inferctx.InferenceContext.instance(torch.cuda.current_device())
    context.use_stream(None)
    yield context
    torch.cuda.synchronize()
    context.use_stream(None)


def graph_keep(seed: int, site: int, replay: int, p: float, n: int) -> np.ndarray:
    """The reference keep decisions of replay `replay` of site `site`."""
    blocks = -(-n // 4)
    sub = np.arange(blocks, dtype=np.uint64) + np.uint64(site << SITE_SHIFT)
    u = ref.curand_uniform4(seed, sub, GRAPH_OFFSET_BASE + 4 * replay).reshape(-1)[:n]
    return u > np.float32(p)


def graph_words(seed: int, site: int, replay: int, p: float, n: int) -> np.ndarray:
    return ref.pack_bits(graph_keep(seed, site, replay, p, n))


def eager_words(seed: int, offset: int, p: float, n: int) -> np.ndarray:
    return ref.pack_bits(ref.dropout_keep(seed, offset, p, n))


def host_words(torch, t) -> np.ndarray:
    """int32 / uint32 mask words (any leading shape) on the host as uint32."""
    return t.view(torch.int32).cpu().numpy().view(np.uint32)


def set_seed_settled(torch, ctx, seed):
    """set_seed with the device idle on both sides: the graphs' header is rewritten in order on
    the context's compute stream, which need not be the stream the replays run on."""
    torch.cuda.synchronize()
    ctx.set_seed(seed)
    torch.cuda.synchronize()


def assert_all_distinct(rows: np.ndarray):
    keys = {r.tobytes() for r in rows}
    assert len(keys) == rows.shape[0], f"{rows.shape[0] - len(keys)} repeated masks"


# -- torch.cuda.graph ---------------------------------------------------------------------------

@pytest.mark.parametrize("with_gemm", [True, False], ids=["gemm+dropout", "dropout"])
def test_1000_replays_of_a_captured_gemm_dropout_step(torch, ctx, with_gemm):
    m = k = 64
    n = m * k
    words = n // 32
    p = 0.25
    a = torch.randn(m, k, device="cuda")
    b = torch.randn(k, k, device="cuda")
    c = torch.randn(m, k, device="cuda")
    y = torch.empty_like(c)
    mask = torch.empty(words, dtype=torch.int32, device="cuda")
    set_seed_settled(torch, ctx, 2024)

    def step():
        if with_gemm:
            inferctx.gemm(a, b, out=c)
        inferctx.dropout(c, p, out=y, mask_out=mask)

    # Eager draws before the capture (warm-up on a side stream, as torch's capture docs advise).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    eager_before = []
    with torch.cuda.stream(side):
        for _ in range(3):
            offset = ctx.rng_state[1]
            step()
            eager_before.append((offset, mask.clone()))
    torch.cuda.current_stream().wait_stream(side)

    site = _core.graph_rng_state(ctx)["sites"]
    offset_before_capture = ctx.rng_state[1]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    state = _core.graph_rng_state(ctx)
    assert state["sites"] == site + 1
    assert state["live_sites"] >= 1
    assert ctx.rng_state[1] == offset_before_capture  # a capture takes no eager offset

    replays = 1000
    masks = torch.empty(replays, words, dtype=torch.int32, device="cuda")
    for r in range(replays):
        g.replay()
        masks[r].copy_(mask)
    last_y, last_c = y.clone(), c.clone()
    offset_after = ctx.rng_state[1]
    inferctx.dropout(c, p, out=y, mask_out=mask)
    eager_after = (offset_after, mask.clone())
    torch.cuda.synchronize()

    got = host_words(torch, masks)
    want = np.stack([graph_words(2024, site, r, p, n) for r in range(replays)])
    bad = np.flatnonzero((got != want).any(axis=1))
    assert bad.size == 0, f"{bad.size} replays differ from the reference, first {bad[:5].tolist()}"
    eager = [(o, host_words(torch, t)) for o, t in eager_before + [eager_after]]
    for o, w in eager:
        assert o < GRAPH_OFFSET_BASE
        np.testing.assert_array_equal(w, eager_words(2024, o, p, n))
    assert_all_distinct(np.concatenate([got, np.stack([w for _, w in eager])]))
    # y of the last replay: c * scale where kept, +0 elsewhere, bit for bit.
    keep = graph_keep(2024, site, replays - 1, p, n)
    want_y = ref.dropout_float32(last_c.cpu().numpy().reshape(-1), keep, p)
    np.testing.assert_array_equal(last_y.cpu().numpy().reshape(-1).view(np.uint32),
                                  want_y.view(np.uint32))


def test_two_graphs_interleaved_do_not_overlap_and_repeat_after_set_seed(torch, ctx):
    n = 8192
    words = n // 32
    p = 0.5
    x = torch.ones(n, device="cuda", dtype=torch.float16)
    ya, yb = torch.empty_like(x), torch.empty_like(x)
    ma = torch.empty(words, dtype=torch.int32, device="cuda")
    mb = torch.empty_like(ma)
    graphs = {}
    sites = {}
    for name, y, mk in (("A", ya, ma), ("B", yb, mb)):
        sites[name] = _core.graph_rng_state(ctx)["sites"]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            inferctx.dropout(x, p, out=y, mask_out=mk)
        graphs[name] = (g, mk)
    assert sites["B"] == sites["A"] + 1
    order = "ABBABAAABBAB"

    def run():
        set_seed_settled(torch, ctx, 77)
        out = torch.empty(len(order), words, dtype=torch.int32, device="cuda")
        for i, name in enumerate(order):
            g, mk = graphs[name]
            g.replay()
            out[i].copy_(mk)
        torch.cuda.synchronize()
        return host_words(torch, out)

    first, second = run(), run()
    counts = {"A": 0, "B": 0}
    for i, name in enumerate(order):
        np.testing.assert_array_equal(first[i], graph_words(77, sites[name], counts[name], p, n),
                                      err_msg=f"step {i} (graph {name})")
        counts[name] += 1
    assert_all_distinct(first)
    np.testing.assert_array_equal(first, second)  # the same sequence from the same seed
    assert _core.graph_rng_state(ctx)["offset"] == 0  # no eager draw since set_seed


def test_explicit_seed_and_offset_stay_fixed_under_capture(torch, ctx):
    n = 1024
    x = torch.ones(n, device="cuda")
    y = torch.empty_like(x)
    mk = torch.empty(n // 32, dtype=torch.int32, device="cuda")
    sites = _core.graph_rng_state(ctx)["sites"]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        inferctx.dropout(x, 0.5, out=y, mask_out=mk, seed=5, offset=40)
    assert _core.graph_rng_state(ctx)["sites"] == sites  # no call site taken
    want = eager_words(5, 40, 0.5, n)
    assert want.any()  # distinguishable from the zeros the mask is cleared to below
    rows = []
    for _ in range(3):
        mk.zero_()  # each replay must write the mask again
        g.replay()
        rows.append(host_words(torch, mk))
    for row in rows:
        np.testing.assert_array_equal(row, want)


def test_set_seed_restarts_a_graph_at_replay_0(torch, ctx):
    n = 2048
    x = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    mk = torch.empty(n // 32, dtype=torch.int32, device="cuda")
    site = _core.graph_rng_state(ctx)["sites"]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        inferctx.dropout(x, 0.1, out=y, mask_out=mk)
    set_seed_settled(torch, ctx, 1)
    epoch = _core.graph_rng_state(ctx)["epoch"]
    for r in range(3):
        g.replay()
        np.testing.assert_array_equal(host_words(torch, mk), graph_words(1, site, r, 0.1, n))
    set_seed_settled(torch, ctx, 2)
    assert _core.graph_rng_state(ctx)["epoch"] == epoch + 1
    g.replay()
    np.testing.assert_array_equal(host_words(torch, mk), graph_words(2, site, 0, 0.1, n))


def _capture_one_dropout(torch, ctx, n=1024):
    """A CUDA graph of one dropout of n ones into buffers made before the capture, the live call
    sites counted before it, and those buffers (kept alive with the graph, which writes them)."""
    x = torch.ones(n, device="cuda")
    y = torch.empty_like(x)
    mk = torch.empty(n // 32, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    live = settled_live_sites(ctx)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        inferctx.dropout(x, 0.5, out=y, mask_out=mk)
    return g, live, (x, y, mk)


def test_a_destroyed_graph_releases_its_site(torch, ctx):
    g, live, _buffers = _capture_one_dropout(torch, ctx)
    g.replay()
    torch.cuda.synchronize()
    assert _core.graph_rng_state(ctx)["live_sites"] == live + 1
    del g
    sanitized = bool(os.environ.get("INFERCTX_SANITIZE"))
    deadline = time.monotonic() + (30 if sanitized else 10)
    while _core.graph_rng_state(ctx)["live_sites"] != live and time.monotonic() < deadline:
        # User-object destructors run on a shared CUDA thread, at no set time; a synchronising
        # call gives the driver its chance to run them.
        torch.cuda.synchronize()
        time.sleep(0.01)
    if sanitized and _core.graph_rng_state(ctx)["live_sites"] != live:
        # Under compute-sanitizer (memcheck and racecheck, 2026-12-05) the driver had not run
        # the destructor after 120 s; when it runs is CUDA's, not ours. The plain run checks it.
        pytest.skip("the sanitizer holds back the destroyed graph's user-object destructor")
    assert _core.graph_rng_state(ctx)["live_sites"] == live


# -- CuPy ---------------------------------------------------------------------------------------

def test_cupy_graph_draws_fresh_masks(ctx):
    cp = pytest.importorskip("cupy")
    n = 5000  # whole tiles and a scalar tail
    words = -(-n // 32)
    p = 0.4
    x = cp.ones(n, dtype=cp.float32)
    y = cp.empty_like(x)
    mk = cp.empty(words, dtype=cp.uint32)
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    ctx.set_seed(31)
    cp.cuda.Device().synchronize()
    site = _core.graph_rng_state(ctx)["sites"]
    with s:
        s.begin_capture()
        inferctx.dropout(x, p, out=y, mask_out=mk)
        graph = s.end_capture()
    replays = 50
    out = cp.empty((replays, words), dtype=cp.uint32)
    with s:
        for r in range(replays):
            graph.launch(stream=s)
            out[r] = mk
    s.synchronize()
    got = cp.asnumpy(out)
    for r in range(replays):
        np.testing.assert_array_equal(got[r], graph_words(31, site, r, p, n), err_msg=f"replay {r}")
    assert_all_distinct(got)


# -- a raw stream capture (cudaStreamBeginCapture / cudaGraphLaunch through the runtime) --------

def _load_cudart():
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    for root in sys.path:
        names += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcudart.so*")))
        names += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    names += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        if hasattr(lib, "cudaStreamBeginCapture") and hasattr(lib, "cudaGraphInstantiate"):
            return lib
    return None


class RawGraph:
    """cudaStreamBeginCapture ... cudaStreamEndCapture, cudaGraphInstantiate, cudaGraphLaunch."""

    def __init__(self, cudart, stream: int):
        self.rt, self.stream = cudart, ctypes.c_void_p(stream)
        self.graph, self.exec = ctypes.c_void_p(), ctypes.c_void_p()

    def check(self, rc, call):
        assert rc == 0, f"{call} returned cudaError {rc}"

    def begin(self, mode=0):  # cudaStreamCaptureModeGlobal
        self.check(self.rt.cudaStreamBeginCapture(self.stream, ctypes.c_int(mode)), "cudaStreamBeginCapture")

    def end(self):
        self.check(self.rt.cudaStreamEndCapture(self.stream, ctypes.byref(self.graph)), "cudaStreamEndCapture")
        self.check(self.rt.cudaGraphInstantiate(ctypes.byref(self.exec), self.graph, ctypes.c_ulonglong(0)),
                   "cudaGraphInstantiate")

    def launch(self):
        self.check(self.rt.cudaGraphLaunch(self.exec, self.stream), "cudaGraphLaunch")

    def destroy(self):
        if self.exec:
            self.rt.cudaGraphExecDestroy(self.exec)
        if self.graph:
            self.rt.cudaGraphDestroy(self.graph)
        self.exec, self.graph = ctypes.c_void_p(), ctypes.c_void_p()


@pytest.fixture
def cudart():
    lib = _load_cudart()
    if lib is None:
        pytest.skip("no libcudart to call cudaStreamBeginCapture through")
    return lib


@pytest.mark.parametrize("given", [None, "handle", "torch stream"])
def test_raw_stream_capture_draws_fresh_masks(torch, ctx, cudart, given):
    n = 3000
    words = -(-n // 32)
    p = 0.7
    x = torch.ones(n, device="cuda")
    y = torch.empty_like(x)
    mk = torch.empty(words, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    set_seed_settled(torch, ctx, 99)
    site = _core.graph_rng_state(ctx)["sites"]
    raw = RawGraph(cudart, s.cuda_stream)
    with torch.cuda.stream(s):  # the kernel runs on torch's current stream: the capturing one
        raw.begin()
        assert _core._stream_capturing(s.cuda_stream, ctx.device)
        stream = {None: None, "handle": s.cuda_stream, "torch stream": s}[given]
        inferctx.dropout(x, p, out=y, mask_out=mk, stream=stream)  # its device asked under capture
        assert _core._stream_capturing(s.cuda_stream, ctx.device)
        raw.end()
    try:
        out = torch.empty(20, words, dtype=torch.int32, device="cuda")
        with torch.cuda.stream(s):
            for r in range(20):
                raw.launch()
                out[r].copy_(mk)
        s.synchronize()
        got = host_words(torch, out)
        for r in range(20):
            np.testing.assert_array_equal(got[r], graph_words(99, site, r, p, n), err_msg=f"replay {r}")
        assert_all_distinct(got)
    finally:
        raw.destroy()


def test_set_seed_while_the_context_stream_captures_is_refused(torch, ctx, cudart):
    n = 1024
    x = torch.ones(n, device="cuda")
    y = torch.empty_like(x)
    mk = torch.empty(n // 32, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # the graphs' device state exists from here on
        inferctx.dropout(x, 0.5, out=y, mask_out=mk)
    set_seed_settled(torch, ctx, 4)
    before = _core.graph_rng_state(ctx)
    ctx.use_stream(s)
    raw = RawGraph(cudart, s.cuda_stream)
    raw.begin()
    try:
        with pytest.raises(ConfigError) as info:
            ctx.set_seed(5)
        assert info.value.argument == "stream"
        assert "capturing" in str(info.value)
    finally:
        raw.end()
        raw.destroy()
        ctx.use_stream(None)
    after = _core.graph_rng_state(ctx)
    assert (after["seed"], after["epoch"]) == (before["seed"], before["epoch"])


@pytest.mark.multi_gpu
def test_capture_on_a_stream_of_another_device_is_refused(torch, cudart):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two devices")
    ctx0 = inferctx.InferenceContext.instance(0)
    x = torch.ones(1024, device="cuda:0")
    y = torch.empty_like(x)
    mk = torch.empty(32, dtype=torch.int32, device="cuda:0")
    with torch.cuda.device(1):
        s1 = torch.cuda.Stream()
    raw = RawGraph(cudart, s1.cuda_stream)
    with torch.cuda.device(1):
        raw.begin()
    try:
        for stream in (s1.cuda_stream, s1):  # a bare handle (its CUDA context) and torch's object
            with pytest.raises(ConfigError) as info:
                inferctx.dropout(x, 0.5, out=y, mask_out=mk, ctx=ctx0, stream=stream)
            assert info.value.argument == "stream"
    finally:
        with torch.cuda.device(1):
            rc = cudart.cudaStreamEndCapture(raw.stream, ctypes.byref(raw.graph))
            assert rc == 0  # the refusal asked without ending the capture
            raw.destroy()


# -- host-side facts ----------------------------------------------------------------------------

def test_graph_rng_state_reports_the_eager_and_graph_state(torch, ctx):
    before = _core.graph_rng_state(ctx)
    set_seed_settled(torch, ctx, 12)
    ctx.increment_offset(8)
    s = _core.graph_rng_state(ctx)
    # set_seed: the seed, the offset back to 0 (then 8), one epoch more; no call site taken.
    assert (s["seed"], s["offset"], s["epoch"], s["sites"]) == (12, 8, before["epoch"] + 1, before["sites"])
    assert s["slots"] >= s["live_sites"]
    assert ctx.rng_state == (12, 8)
    # No argument: the current device's context, the same state.
    default = _core.graph_rng_state()
    assert (default["seed"], default["offset"], default["epoch"], default["sites"]) == (12, 8, s["epoch"], s["sites"])
    # A capture takes the next call site and holds it live; the eager state stays as it was.
    g, live, _buffers = _capture_one_dropout(torch, ctx)
    c = _core.graph_rng_state(ctx)
    assert (c["seed"], c["offset"], c["epoch"], c["sites"]) == (12, 8, s["epoch"], s["sites"] + 1)
    assert c["live_sites"] == live + 1 and c["slots"] >= c["live_sites"]
    assert ctx.rng_state == (12, 8)
    del g
    with pytest.raises(ConfigError) as info:
        _core.graph_rng_state("ctx")
    assert info.value.argument == "ctx" and "got str" in str(info.value)
    assert not _core._stream_capturing(torch.cuda.current_stream().cuda_stream, ctx.device)

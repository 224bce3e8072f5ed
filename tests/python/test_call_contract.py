"""The call contract of the kernels (dropout, apply_mask, gemm, bmm), as users call them.

Default arguments first: no use_stream, no out=, no synchronize between a call and the caller's
read of its result. Ordering bugs hide behind fast GPUs, so every ordering trial puts a long
sleep kernel on the caller's stream first, has the producer write the input after it, calls
inferctx, and reads the output on the caller's current stream right after: if any of the three
were not ordered, the read would see stale or unwritten data. Results must be exact (integer
data whose products are exact in every dtype; dropout with a fixed Philox state).
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import inferctx
import philox_reference as ref
from inferctx.errors import ConfigError

pytestmark = pytest.mark.gpu

# Under compute-sanitizer (tools/gpu-suite pysanitize sets INFERCTX_SANITIZE) every CUDA call of
# the host takes a millisecond or more, so a sleep sized for the bare host ends before the call it
# must outlast: the sleeps are 50 times longer there, and the ordering trials fewer (20 of them,
# each still checked to have found the caller's stream busy).
SANITIZED = bool(os.environ.get("INFERCTX_SANITIZE"))
_SLOWER = 50 if SANITIZED else 1
TRIALS = 20 if SANITIZED else 200
SLEEP_CYCLES = 200_000 * _SLOWER  # about 0.1 ms at the H200's clock: far longer than a launch
# Each ordering trial's sleep: about 1 ms, longer than a trial takes on the host, so the caller's
# stream is still busy (its queue grows from trial to trial) when the inferctx call is made; the
# trials check that it is (_still_busy), or they would test nothing.
TRIAL_SLEEP_CYCLES = 2_000_000 * _SLOWER
# The single long sleeps below (0.05-0.25 s), which must outlast a few calls and a gc.collect
# (under memcheck, a 2 s sleep did not outlast the pool-reuse test's calls).
_LONG = 50 if SANITIZED else 1


def _trial_sleep(torch, trial):
    """An ordering trial's sleep on the caller's stream. The first is ten times longer: the queue
    it starts must outlast a hiccup of the host (a trial 0 once found the stream idle in a
    whole-suite run), and each later trial adds more to it than it takes on the host."""
    torch.cuda._sleep(TRIAL_SLEEP_CYCLES * (10 if trial == 0 else 1))


def _still_busy(torch, trial):
    assert not torch.cuda.current_stream().query(), (
        f"trial {trial}: the caller's stream was idle when the call was made, so its ordering "
        f"went untested; make TRIAL_SLEEP_CYCLES longer")


@pytest.fixture
def cupy(torch):
    return pytest.importorskip("cupy")


@pytest.fixture
def ctx(torch):
    context = inferctx.InferenceContext.instance(0)
    context.use_stream(None)
    yield context
    context.use_stream(None)
    torch.cuda.synchronize()


def _ints(torch, shape, seed, dtype, low=-2, high=3):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(low, high, shape, generator=g, device="cuda").to(dtype)


# ---- the five cases of the issue that were wrong 5 times in 5 ------------------------------------

def test_gemm_out_then_torch_read_is_ordered(torch):
    n = 2048
    a = torch.empty((n, n), device="cuda", dtype=torch.float16)
    b = _ints(torch, (n, n), 1, torch.float16, -1, 2)
    c = torch.empty((n, n), device="cuda", dtype=torch.float16)
    for trial in range(5):
        torch.cuda._sleep(SLEEP_CYCLES)
        a.copy_(_ints(torch, (n, n), 100 + trial, torch.float16, -1, 2))  # the producer
        inferctx.gemm(a, b, out=c)
        got = c.float()  # the caller's read, no synchronize
        want = a.float() @ b.float()  # exact: |sums| <= 2048, integers
        assert torch.equal(got, want), trial


def test_dropout_out_then_torch_read_is_ordered(torch):
    x = torch.empty(1 << 22, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    for trial in range(5):
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(float(trial + 1))
        inferctx.dropout(x, 0.0, out=y, mask=None)
        assert bool((y == trial + 1).all()), trial


# ---- ordering, 200 trials per entry point and caller ---------------------------------------------

CALLS = ["gemm", "gemm_out", "bmm", "bmm_out", "dropout", "dropout_out", "apply_mask",
         "apply_mask_out"]


def _to_torch(torch, r):
    """A result as a torch tensor on the GPU (the same memory), read on torch's current stream."""
    return r if isinstance(r, torch.Tensor) else torch.from_dlpack(r)


class Case:
    """One entry point on fixed-size operands held as torch tensors (`a`, `b`, `out`), passed to
    inferctx in the caller's array type by `make` (identity, CuPy, or the DeviceView that backs
    the tensor): `produce(trial)` writes the input on the caller's current stream, `call()` runs
    inferctx as a user would, `want()` is the exact result for the input now in `a`."""

    def __init__(self, torch, name, make=None, alloc=None):
        self.torch = torch
        self.name = name
        self.make = make or (lambda t: t)
        # DeviceView results (and dropout's masks) kept until the trials end: a pool block that
        # must be freed after a device-wide synchronisation (used on a stream the pool cannot
        # order by an event) would drain the caller's stream in mid-trial.
        self.held = []
        t = torch
        alloc = alloc or (lambda shape, dtype: t.empty(shape, device="cuda", dtype=dtype))

        def filled(shape, seed, dtype):
            x = alloc(shape, dtype)
            x.copy_(_ints(t, shape, seed, dtype))
            return x

        if name.startswith("gemm"):
            self.a = alloc((128, 96), t.float16)
            self.b = filled((96, 64), 7, t.float16)
            self.out = alloc((128, 64), t.float16)
        elif name.startswith("bmm"):
            self.a = alloc((4, 64, 32), t.float16)
            self.b = filled((4, 32, 48), 8, t.float16)
            self.out = alloc((4, 64, 48), t.float16)
        else:
            self.a = filled((1 << 16,), 9, t.float32)
            self.out = alloc((1 << 16,), t.float32)
            if name.startswith("apply_mask"):
                _, self.mask = inferctx.dropout(self.make(self.a), 0.5, seed=5, offset=8)
                t.cuda.synchronize()
                words = _to_torch(t, self.mask).view(t.int32).cpu().numpy().view(np.uint32)
                bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.a.numel()]
                self.keep = t.from_numpy(bits.astype(np.bool_)).cuda()

    def produce(self, trial):
        self.a.copy_(_ints(self.torch, tuple(self.a.shape), 1000 + trial, self.a.dtype))

    def call(self, **kw):
        mk = self.make
        a = mk(self.a)
        out = mk(self.out) if self.name.endswith("_out") else None
        if self.name.startswith("gemm"):
            return self._hold(inferctx.gemm(a, mk(self.b), out=out, **kw))
        if self.name.startswith("bmm"):
            return self._hold(inferctx.bmm(a, mk(self.b), out=out, **kw))
        if self.name.startswith("dropout"):
            y, mask = inferctx.dropout(a, 0.5, out=out, seed=3, offset=4, **kw)
            self._hold(mask)
            return self._hold(y)
        return self._hold(inferctx.apply_mask(a, self.mask, 0.5, out=out, **kw))

    def _hold(self, r):
        if isinstance(r, inferctx.DeviceView):
            self.held.append(r)
        return r

    def read(self, r):
        """The caller's read, on its current stream, right after the call."""
        return _to_torch(self.torch, r).float().clone()

    def want(self):
        t = self.torch
        a = self.a.float()
        if self.name.startswith(("gemm", "bmm")):
            return a @ self.b.float()  # exact: small integers
        if self.name.startswith("dropout"):  # the independent reference's mask at (3, 4)
            keep = t.from_numpy(ref.dropout_keep(3, 4, 0.5, a.numel()).reshape(tuple(a.shape))).to(a.device)
            return t.where(keep, a * 2.0, t.zeros_like(a))
        return t.where(self.keep, a * 2.0, t.zeros_like(a))


def _run_trials(torch, case, **kw):
    """TRIALS times: sleep on the caller's stream, produce, call, read; then check every read."""
    # One untimed call first: a first call (a kernel's first launch, a GEMM's algorithm choice)
    # may take longer on the host than a trial's sleep, or wait for the GPU.
    case.read(case.call(**kw))
    torch.cuda.synchronize()
    reads = []
    inputs = []
    for trial in range(TRIALS):
        _trial_sleep(torch, trial)
        case.produce(trial)
        r = case.call(**kw)
        _still_busy(torch, trial)
        reads.append(case.read(r))
        inputs.append(case.a.clone())
    torch.cuda.synchronize()
    case.held.clear()
    for trial, (got, a) in enumerate(zip(reads, inputs)):
        case.a.copy_(a)
        assert torch.equal(got, case.want()), (case.name, trial)


@pytest.mark.parametrize("name", CALLS)
def test_torch_caller_default_context(torch, ctx, name):
    _run_trials(torch, Case(torch, name))


@pytest.mark.parametrize("name", CALLS)
def test_torch_caller_on_a_side_stream(torch, ctx, name):
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):  # the caller's current stream is now `side`
        _run_trials(torch, Case(torch, name))


@pytest.mark.parametrize("name", CALLS)
def test_torch_caller_after_use_stream_other(torch, ctx, name):
    other = inferctx.Stream()
    ctx.use_stream(other)  # serves operands of no package; torch operands keep torch's stream
    _run_trials(torch, Case(torch, name))


@pytest.mark.parametrize("name", CALLS)
def test_torch_caller_with_stream_argument(torch, ctx, name):
    work = torch.cuda.Stream()
    _run_trials(torch, Case(torch, name), stream=work)


@pytest.mark.parametrize("name", CALLS)
def test_cupy_caller_default_stream(torch, cupy, ctx, name):
    _run_trials(torch, Case(torch, name, make=cupy.from_dlpack))


@pytest.mark.parametrize("name", ["gemm", "gemm_out", "dropout", "apply_mask"])
def test_cupy_caller_on_its_own_stream(torch, cupy, ctx, name):
    cs = cupy.cuda.Stream(non_blocking=True)
    torch.cuda.synchronize()
    with cs, torch.cuda.stream(torch.cuda.ExternalStream(cs.ptr)):  # both current: `cs`
        _run_trials(torch, Case(torch, name, make=cupy.from_dlpack))


@pytest.mark.parametrize("name", ["gemm", "dropout_out", "apply_mask"])
def test_cupy_caller_with_stream_argument(torch, cupy, ctx, name):
    _run_trials(torch, Case(torch, name, make=cupy.from_dlpack),
                stream=cupy.cuda.Stream(non_blocking=True))


@pytest.mark.parametrize("name", ["gemm", "gemm_out", "bmm", "dropout", "dropout_out",
                                  "apply_mask"])
def test_deviceview_caller_after_use_stream_other(torch, ctx, name):
    # Operands of no package run on ctx.stream (here an adopted stream, on which the caller
    # works) and their results are DeviceViews, read after a DLPack export.
    other = inferctx.Stream()
    ctx.use_stream(other)
    backing = {}

    def alloc(shape, dtype):
        view = inferctx._core._empty(0, shape, str(dtype).rpartition(".")[2])
        t = torch.from_dlpack(view)
        backing[t.data_ptr()] = view
        return t

    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.ExternalStream(other.handle)):
        case = Case(torch, name, make=lambda t: backing[t.data_ptr()], alloc=alloc)
        r = case.call()
        assert isinstance(r, inferctx.DeviceView)
        _run_trials(torch, case)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("caller", ["torch", "cupy"])
def test_plain_dropout_result_and_bit_mask_read_right_after_the_call(torch, ctx, caller, dtype):
    # dropout(x, p) exactly as users call it: no seed, no out=, no mask_out=, no synchronize. The
    # Philox state is the context's (read before each call; the call takes increment_offset(4)),
    # and both results, y and the bit mask, are read on the caller's current stream right after
    # the call, then checked against the NumPy Philox reference.
    n = (1 << 16) + 37  # whole 1024-element tiles and a scalar tail
    tdt = getattr(torch, dtype)
    x = torch.empty(n, device="cuda", dtype=tdt)
    if caller == "cupy":
        cp = pytest.importorskip("cupy")
        operand = cp.from_dlpack(x)  # the same memory; CuPy's current stream is the legacy one

        def read(r):
            return r.copy()  # on CuPy's current stream

        def to_numpy(r):
            return cp.asnumpy(r)
    else:
        operand = x

        def read(r):
            return r.clone()  # on torch's current stream

        def to_numpy(r):
            return r.cpu().numpy()
    x.copy_(_ints(torch, (n,), 1999, tdt))  # the producer's first launch: not timed either
    torch.cuda.synchronize()
    inferctx.dropout(operand, 0.5)  # the first call of the path; not timed, not checked
    reads = []
    for trial in range(TRIALS):
        state = ctx.rng_state
        _trial_sleep(torch, trial)
        x.copy_(_ints(torch, (n,), 2000 + trial, tdt))  # the producer, after the sleep
        y, mask = inferctx.dropout(operand, 0.5)
        _still_busy(torch, trial)
        reads.append((state, read(y), read(mask), x.clone()))
    torch.cuda.synchronize()
    for trial, (state, y, mask, x0) in enumerate(reads):
        keep = ref.dropout_keep(state[0], state[1], 0.5, n)
        words = to_numpy(mask).view(np.uint32)
        assert words.shape == ((n + 31) // 32,), (trial, words.shape)
        assert np.array_equal(ref.unpack_bits(words, n), keep), ("mask", trial)
        want = ref.dropout_float32(x0.float().cpu().numpy(), keep, 0.5)  # small integers: exact
        assert np.array_equal(to_numpy(y).astype(np.float32), want), ("y", trial)


def test_kernel_then_sync_comp_then_comm_stream_read(torch, ctx):
    comm = torch.cuda.ExternalStream(ctx.comm_stream.handle)
    x = torch.empty(1 << 20, device="cuda", dtype=torch.float16)
    x.fill_(1.0)
    inferctx.dropout(x, 0.0, mask=None)  # the first call of the path; not timed, not checked
    torch.cuda.synchronize()
    seen = []
    for trial in range(TRIALS):
        _trial_sleep(torch, trial)
        x.fill_(float(trial % 7 + 1))
        y, _ = inferctx.dropout(x, 0.0, mask=None)  # on torch's current stream
        ctx.sync_comp()  # no use_stream: ctx.stream is torch's current stream
        _still_busy(torch, trial)
        y.record_stream(comm)  # torch's rule for a tensor used on another stream
        with torch.cuda.stream(comm):
            seen.append(y.sum(dtype=torch.float32))
        torch.cuda.current_stream().wait_stream(comm)
    torch.cuda.synchronize()
    for trial, s in enumerate(seen):
        assert s.item() == float((trial % 7 + 1) * (1 << 20)), trial


def test_cupy_kernel_then_sync_comp_then_comm_stream_read_with_torch_imported(torch, cupy, ctx):
    # torch is imported, so ctx.stream is torch's current stream (the legacy one here); the CuPy
    # caller works on a non-blocking stream of its own, where its kernels run. sync_comp must
    # order the comm stream after that stream too, and sync_comm that stream after comm.
    cs = cupy.cuda.Stream(non_blocking=True)
    # CuPy 14 wraps a stream of the CUDA stream protocol with Stream.from_external (its
    # ExternalStream is deprecated there); earlier CuPy has ExternalStream only.
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    comm = (from_external(ctx.comm_stream) if from_external is not None
            else cupy.cuda.ExternalStream(ctx.comm_stream.handle))
    n = 1 << 18
    seen, back, alive = [], [], []
    torch.cuda.synchronize()
    with cs:
        x = cupy.empty(n, dtype=cupy.float32)
        # One untimed round first: CuPy compiles its kernels (fill, sum) on first use, far
        # longer than a trial's sleep.
        x.fill(1.0)
        inferctx.dropout(x, 0.0, mask=None)[0].sum()
        cs.synchronize()
        for trial in range(TRIALS):
            with torch.cuda.stream(torch.cuda.ExternalStream(cs.ptr)):
                torch.cuda._sleep(TRIAL_SLEEP_CYCLES)  # on `cs`, before the producer
            x.fill(float(trial % 7 + 1))
            y, _ = inferctx.dropout(x, 0.0, mask=None)  # on `cs`: CuPy's current stream
            ctx.sync_comp()
            assert not cs.done, f"trial {trial}: `cs` was idle at the call; ordering untested"
            with comm:
                seen.append(y.sum())  # on the comm stream
                z = cupy.empty(n, dtype=cupy.float32)
                with torch.cuda.stream(torch.cuda.ExternalStream(comm.ptr)):
                    torch.cuda._sleep(TRIAL_SLEEP_CYCLES)
                z.fill(float(trial % 5 + 1))  # written on comm late
            ctx.sync_comm()
            assert not comm.done, f"trial {trial}: comm was idle at sync_comm; ordering untested"
            back.append(z.sum())  # on `cs`, after the comm stream's fill
            alive.append((y, z))  # not freed while the other stream may still read them
    cs.synchronize()
    comm.synchronize()
    for trial, (s, b) in enumerate(zip(seen, back)):
        assert float(s) == float((trial % 7 + 1) * n), ("sync_comp", trial)
        assert float(b) == float((trial % 5 + 1) * n), ("sync_comm", trial)


def test_a_call_joining_an_outside_stream_under_capture_is_captured_and_replays_right(torch, ctx):
    # ctx.stream is an adopted stream; a torch caller captures a GEMM into a DeviceView out=, so
    # the call joins ctx.stream (outside the capture) with torch's capturing stream. No edge may
    # cross a capture's boundary: the joins are left out there, and the capture stays valid.
    engine = inferctx.Stream()
    ctx.use_stream(engine)
    a = _ints(torch, (64, 48), 1, torch.float32)
    b = _ints(torch, (48, 32), 2, torch.float32)
    out = inferctx._core._empty(0, (64, 32), "float32")
    inferctx.gemm(a, b, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    engine.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        r = inferctx.gemm(a, b, out=out)
    assert r is out
    for seed in range(3, 8):
        torch.cuda._sleep(SLEEP_CYCLES)  # the producer's stream busy, then it writes a
        a.copy_(_ints(torch, (64, 48), seed, torch.float32))
        g.replay()
        # read at once on the caller's stream, as a user would: no synchronize
        assert torch.equal(torch.from_dlpack(out), a @ b), seed  # small integers: exact


def test_a_call_with_a_stream_argument_under_capture_is_captured_and_replays_right(torch, ctx):
    # stream= names a stream outside the capture: it joins the capture for the call (CUDA's fork
    # pattern) and is joined back, so the kernel is in the graph and runs at every replay.
    side = torch.cuda.Stream()
    a = _ints(torch, (64, 48), 1, torch.float32)
    b = _ints(torch, (48, 32), 2, torch.float32)
    inferctx.gemm(a, b, stream=side)  # warm-up: the side stream's cuBLAS workspace
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c = inferctx.gemm(a, b, stream=side)
    for seed in range(3, 8):
        torch.cuda._sleep(SLEEP_CYCLES)  # the producer's stream busy, then it writes a
        a.copy_(_ints(torch, (64, 48), seed, torch.float32))
        g.replay()
        assert torch.equal(c, a @ b), seed  # read at once, no synchronize; small integers: exact


def test_a_call_refused_after_pulling_its_stream_into_a_capture_joins_it_back(torch, ctx):
    # stream= outside the capture joins it when the call begins; an argument refused after that
    # (a wrong out= shape) must join it back, or the capture could not end (unjoined work).
    side = torch.cuda.Stream()
    x = _ints(torch, (4096,), 3, torch.float32)
    a = _ints(torch, (64, 48), 1, torch.float32)
    b = _ints(torch, (48, 32), 2, torch.float32)
    inferctx.gemm(a, b, stream=side)  # warm-up: the side stream's cuBLAS workspace
    torch.cuda.synchronize()
    wrong = torch.empty(7, device=x.device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2
        with pytest.raises(ConfigError) as refused:
            inferctx.dropout(x, 0.5, out=wrong, stream=side)
        assert refused.value.argument == "out"
        with pytest.raises(ConfigError) as refused:
            inferctx.apply_mask(x, torch.zeros(128, dtype=torch.int32, device=x.device), 0.5,
                                out=wrong, stream=side)
        assert refused.value.argument == "out"
        with pytest.raises(ConfigError) as refused:
            inferctx.gemm(a, b, out=wrong, stream=side)
        assert refused.value.argument == "out"
        z = y + 1
    for seed in range(3, 6):
        x.copy_(_ints(torch, (4096,), seed, torch.float32))
        g.replay()
        assert torch.equal(z, x * 2 + 1), seed


def test_a_default_stream_argument_under_capture_is_refused_naming_stream(torch, ctx):
    # The legacy default stream cannot join a capture: a clear error, nothing launched, and the
    # capture goes on.
    x = _ints(torch, (4096,), 3, torch.float32)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2
        for stream in (0, torch.cuda.default_stream(x.device), inferctx.Stream(0)):
            with pytest.raises(ConfigError, match="cannot join the CUDA graph capture") as refused:
                inferctx.dropout(x, 0.0, stream=stream)
            assert refused.value.argument == "stream"
        z = y + 1
    g.replay()
    assert torch.equal(z, x * 2 + 1)


def test_a_cupy_operand_on_its_null_stream_in_a_torch_capture_is_refused_with_a_remedy(torch, ctx):
    # No stream= given: the call runs on its first operand's package's current stream, CuPy's
    # null stream here, which cannot join torch's capture. The error names stream= as the
    # remedy (it said "or no stream=", which the caller had done already), and the capture goes
    # on.
    cp = pytest.importorskip("cupy")
    x = cp.arange(4096, dtype=cp.float32)
    y = torch.empty(4096, device=f"cuda:{ctx.device}")
    t = _ints(torch, (4096,), 3, torch.float32)
    gc.collect()  # no pool result of an earlier test let go during the capture
    cp.cuda.Device().synchronize()
    torch.cuda.synchronize()
    refused = []
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        u = t * 2
        try:
            inferctx.dropout(x, 0.0, out=y)
            refused.append("launched")
        except ConfigError as exc:
            refused.append(exc)
        v = u + 1
    assert len(refused) == 1 and isinstance(refused[0], ConfigError), refused
    message = str(refused[0])
    assert refused[0].argument == "stream"
    assert "cannot join the CUDA graph capture" in message and "pass stream= the capturing stream" in message
    assert "no stream=" not in message
    g.replay()
    assert torch.equal(v, t * 2 + 1)


def test_a_default_stream_argument_under_a_blocking_streams_capture_is_refused(ctx):
    # A capture on a blocking stream (CuPy's Stream() is one): CUDA will not say whether the
    # legacy stream captures then, and work queued on it would end the capture in error
    # (cudaErrorStreamCaptureImplicit). The call refuses it as under any capture: a clear error,
    # nothing launched, and the capture goes on.
    cp = pytest.importorskip("cupy")
    with cp.cuda.Device(ctx.device):
        x = cp.arange(4096, dtype=cp.float32)
        s = cp.cuda.Stream()  # blocking: non_blocking=False
        legacy = inferctx.Stream(0, device=ctx.device)
        want = x * 2 + 1  # CuPy's kernels loaded before the capture
        gc.collect()  # no pool result of an earlier test let go during the capture
        cp.cuda.Device().synchronize()
        refused = []
        with s:
            s.begin_capture()
            try:
                y = x * 2
                for stream in (0, legacy):
                    try:
                        inferctx.dropout(x, 0.0, stream=stream)
                        refused.append("launched")
                    except ConfigError as exc:
                        refused.append((exc.argument, "cannot join the CUDA graph capture" in str(exc)))
                z = y + 1
            finally:
                graph = s.end_capture()  # raises where the capture was ended in error
            graph.launch(stream=s)
        s.synchronize()
        assert refused == [("stream", True), ("stream", True)]
        assert bool((z == want).all())


def test_the_legacy_stream_waiting_for_a_capturing_stream_is_refused_and_the_capture_goes_on(torch, ctx):
    # Stream.wait is how a stream joins a capture (CUDA's fork), which the legacy default stream
    # cannot: the wait failed in CUDA and ended the capture. It is refused first, as a call's
    # stream= is, for the capturing stream given as an object or as a bare handle.
    x = _ints(torch, (4096,), 3, torch.float32)
    legacy, torch_default = inferctx.Stream(0), inferctx.Stream(torch.cuda.default_stream())
    gc.collect()  # no pool result of an earlier test let go during the capture
    torch.cuda.synchronize()
    refused = []
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        capturing = torch.cuda.current_stream()
        y = x * 2
        for waiting, other in ((legacy, capturing), (torch_default, capturing.cuda_stream)):
            try:
                waiting.wait(other)
                refused.append("waited")
            except ConfigError as exc:
                refused.append((exc.argument, "cannot join" in str(exc)))
        z = y + 1
    assert refused == [("other", True), ("other", True)]
    g.replay()
    assert torch.equal(z, x * 2 + 1)


def test_stream_wait_on_a_bare_handle_of_a_capturing_stream_forks_the_capture(torch, ctx):
    # Stream.wait(handle) is how a side stream joins a capture. Asking CUDA for the device of
    # the capturing handle (cudaStreamGetDevice) would end the capture in error: the device is
    # found another way, by Stream.wait and by inferctx.Stream(handle) alike.
    side = inferctx.Stream()
    x = _ints(torch, (4096,), 3, torch.float32)
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        capturing = torch.cuda.current_stream()
        x.add_(1)
        side.wait(capturing.cuda_stream)  # an int: no device named
        # Wrapping the capturing handle finds its device the same way.
        assert inferctx.Stream(capturing.cuda_stream).device == x.device.index
        with torch.cuda.stream(torch.cuda.ExternalStream(side.handle)):
            y.copy_(x)  # captured on the side stream, after the add
        capturing.wait_stream(torch.cuda.ExternalStream(side.handle))  # joined back
    start = x.clone()
    g.replay()
    assert torch.equal(y, start + 1)


def test_deviceview_results_under_capture_are_refused_and_the_capture_goes_on(torch, ctx):
    # DeviceView operands give DeviceView results from inferctx's pool, which takes no memory
    # while the stream captures a CUDA graph (the block would belong to the graph, and letting
    # a mask go there would synchronise the device, which ends the capture). Each call without
    # its outputs is refused before anything is allocated or launched, naming the keyword; the
    # same calls with out= made before the capture are captured and replay right.
    n = 4096
    x = inferctx._core._empty(0, (n,), "float32")
    a = inferctx._core._empty(0, (64, 48), "float32")
    b = inferctx._core._empty(0, (48, 32), "float32")
    y = inferctx._core._empty(0, (n,), "float32")
    bits = inferctx._core._empty(0, (n // 32,), "uint32")
    c = inferctx._core._empty(0, (64, 32), "float32")
    g_out = inferctx._core._empty(0, (n,), "float32")
    tx, ta, tb = torch.from_dlpack(x), torch.from_dlpack(a), torch.from_dlpack(b)
    tx.copy_(_ints(torch, (n,), 3, torch.float32))
    ta.copy_(_ints(torch, (64, 48), 1, torch.float32))
    tb.copy_(_ints(torch, (48, 32), 2, torch.float32))
    inferctx.gemm(a, b, out=c)  # warm-up outside the capture: the stream's cuBLAS workspace
    torch.cuda.synchronize()
    allocations = ctx.memory_pool.allocations
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for call, argument, hint in (
                (lambda: inferctx.dropout(x, 0.5), "out", "pass out= and mask_out= (or mask=None)"),
                (lambda: inferctx.dropout(x, 0.5, out=y), "mask_out", "pass mask_out= (or mask=None)"),
                (lambda: inferctx.dropout(x, 0.5, mask=None), "out", "pass out=, made"),
                (lambda: inferctx.apply_mask(x, bits, 0.5), "out", "pass out=, made"),
                (lambda: inferctx.gemm(a, b), "out", "pass out=, made"),
                (lambda: inferctx.bmm(a.view("float32", (1, 64, 48)), b.view("float32", (1, 48, 32))), "out",
                 "pass out=, made")):
            with pytest.raises(ConfigError, match="takes no memory while the stream") as refused:
                call()
            assert refused.value.argument == argument
            assert hint in str(refused.value)
        inferctx.dropout(x, 0.5, out=y, mask_out=bits)
        inferctx.apply_mask(x, bits, 0.5, out=g_out)
        inferctx.gemm(a, b, out=c)
    assert ctx.memory_pool.allocations == allocations  # nothing was allocated
    ty, tc, tg = torch.from_dlpack(y), torch.from_dlpack(c), torch.from_dlpack(g_out)
    for seed in range(4, 7):
        tx.copy_(_ints(torch, (n,), seed, torch.float32))
        ta.copy_(_ints(torch, (64, 48), seed, torch.float32))
        g.replay()
        assert torch.equal(tc, ta @ tb), seed  # small integers: exact
        kept = ty != 0
        # Not vacuous: about 2 in 5 are kept non-zero values (4 in 5 inputs are non-zero, p = 0.5);
        # a replay that wrote nothing would leave y and g_out equal and all zero.
        assert n // 4 < int(kept.sum()) < n // 2, (seed, int(kept.sum()))
        assert torch.equal(ty[kept], tx[kept] * 2), seed  # p = 0.5: kept values doubled
        assert torch.equal(tg, ty), seed  # the same mask applied to the same values


HOST_CALLBACK_SCRIPT = """
import threading
import cupy
import torch
import inferctx

ctx = inferctx.InferenceContext.instance(0)
v = inferctx._core._empty(0, (1 << 20,), "float32")
seen = cupy.asarray(v)  # a __cuda_array_interface__ export: a consumer inferctx cannot know
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    torch.cuda._sleep(400_000_000)  # ~0.2 s of work queued before the callback
ran = threading.Event()
cupy.cuda.ExternalStream(side.cuda_stream).launch_host_func(lambda _: ran.set(), None)  # needs the GIL
# The last view goes: its block waits for the whole device, the callback included, which runs
# Python code. Waiting with the GIL held would never end.
del seen, v
assert ran.is_set()
print("ok")
"""


PER_THREAD_STREAM_SCRIPT = """
import importlib, json, os, tempfile, threading
import cupy
import inferctx

gm = importlib.import_module("inferctx.gemm")
assert cupy.cuda.get_current_stream().ptr == 2  # CuPy's current stream: the per-thread default
# inferctx's few-row kernel, chosen by a cache file: it adds its partial sums in the workspace.
a0 = cupy.random.rand(8, 4096, dtype=cupy.float32)
b = cupy.random.rand(4096, 4096, dtype=cupy.float32)
inferctx.gemm(a0, b)
entries = gm.gemm_cache_entries(tuned_only=False)
assert len(entries) == 1
entries[0].update(backend="gemv", algo=[])
path = os.path.join(tempfile.mkdtemp(), "gemm.json")
with open(path, "w") as f:
    json.dump({"format": "inferctx-gemm-cache", "version": 1, "entries": entries}, f)
gm.clear_gemm_cache()
assert gm.load_gemm_cache(path) == 1
a = [cupy.random.rand(8, 4096, dtype=cupy.float32) for _ in range(4)]
alone = [inferctx.gemm(x, b) for x in a]  # one thread: the reference bits
cupy.cuda.Device().synchronize()
wrong = [0] * 4

def work(i):
    for _ in range(200):
        c = inferctx.gemm(a[i], b)  # on this thread's per-thread default stream
        wrong[i] += not bool(cupy.array_equal(c, alone[i]))

threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert gm.gemm_cache_entries(tuned_only=False)[0]["backend"] == "gemv"
assert wrong == [0, 0, 0, 0], wrong
print("ok")
"""


def test_gemms_of_threads_on_the_per_thread_default_stream_keep_their_bits(cupy):
    # CuPy's per-thread default stream is one handle for each thread's own stream: four threads'
    # few-row products at once, each equal bit for bit to its result made alone.
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUPY_CUDA_PER_THREAD_DEFAULT_STREAM": "1"}
    run = subprocess.run([sys.executable, "-c", PER_THREAD_STREAM_SCRIPT], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.split()[-1:] == ["ok"], (run.stdout, run.stderr[-3000:])


def test_a_view_let_go_waits_for_the_device_without_the_gil(cupy):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", HOST_CALLBACK_SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.split()[-1:] == ["ok"], (run.stdout, run.stderr[-3000:])


IMPORT_AFTER_WORK_SCRIPT = """
import os
import sys
import types
import torch

_LONG = 50 if os.environ.get("INFERCTX_SANITIZE") else 1  # as in the test file

# What the script uses of torch, used once first, so that no lazy import of torch's adds a module
# later (inferctx looks for torch and CuPy again only when the number of modules changed).
with torch.cuda.stream(torch.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)):
    torch.cuda._sleep(1000)
torch.from_dlpack(torch.ones(4, device="cuda")).fill_(1.0).sum()
torch.cuda.synchronize()

# inferctx first looks while sys.modules["torch"] is a stand-in without torch's types, so it
# finds no torch until the number of modules changes: as if torch were imported only then.
real = sys.modules["torch"]
sys.modules["torch"] = types.ModuleType("torch")
import inferctx
from inferctx import _core

ctx = inferctx.InferenceContext.instance(0)
own = ctx.own_stream.handle
assert ctx.stream.handle == own
n = 1 << 22
x = _core._empty(0, (n,), "float32")
sys.modules["torch"] = real  # the same number of modules: inferctx does not look again
with torch.cuda.stream(torch.cuda.ExternalStream(own)):
    torch.cuda._sleep(100_000_000 * _LONG)  # ~50 ms on the context's own stream, before the work
    torch.from_dlpack(x).fill_(1.0)
y = x
for _ in range(8):
    y, _ = inferctx.dropout(y, 0.5, mask=None)  # on the own stream
assert ctx.stream.handle == own, "inferctx saw torch too early: the test proves nothing"
sys.modules["_inferctx_test_trigger"] = types.ModuleType("_inferctx_test_trigger")  # "import torch"
early = torch.from_dlpack(y).sum()  # read on torch's current stream right away
assert ctx.stream.handle != own
torch.cuda.synchronize()
late = torch.from_dlpack(y).sum()
assert float(early) == float(late) and float(late) > 0, (float(early), float(late))
print("ok")
"""


def test_work_queued_before_torch_is_imported_comes_before_torchs_stream():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", IMPORT_AFTER_WORK_SCRIPT], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split()[-1:] == ["ok"], (run.stdout, run.stderr[-3000:])


CUPY_THEN_TORCH_SCRIPT = """
import os
import sys
import types
import torch
import cupy

_LONG = 50 if os.environ.get("INFERCTX_SANITIZE") else 1  # as in the test file

# What the script uses of torch and CuPy, used once first, so that no lazy import adds a module
# later (inferctx looks for torch and CuPy again only when the number of modules changed).
with torch.cuda.stream(torch.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)):
    torch.cuda._sleep(1000)
torch.from_dlpack(torch.ones(4, device="cuda")).fill_(1.0).sum()
side = cupy.cuda.Stream(non_blocking=True)  # the legacy stream torch reads on does not wait for it
with side:
    cupy.ones(4, dtype=cupy.float32).sum()
torch.cuda.synchronize()
side.synchronize()

# inferctx first looks while sys.modules["torch"] is a stand-in without torch's types: it finds
# CuPy only, and ctx.stream follows CuPy's current stream until the number of modules changes.
real = sys.modules["torch"]
sys.modules["torch"] = types.ModuleType("torch")
import inferctx
from inferctx import _core

ctx = inferctx.InferenceContext.instance(0)
n = 1 << 22
with side:
    assert ctx.stream.handle == side.ptr, (ctx.stream.handle, side.ptr)
    x = _core._empty(0, (n,), "float32")
    sys.modules["torch"] = real  # the same number of modules: inferctx does not look again
    with torch.cuda.stream(torch.cuda.ExternalStream(side.ptr)):
        torch.cuda._sleep(100_000_000 * _LONG)  # ~50 ms on CuPy's current stream, before the work
        torch.from_dlpack(x).fill_(1.0)
    y = x
    for _ in range(8):
        y, _ = inferctx.dropout(y, 0.5, mask=None)  # on ctx.stream: CuPy's current stream
    assert ctx.stream.handle == side.ptr, "inferctx saw torch too early: the test proves nothing"
    sys.modules["_inferctx_test_trigger"] = types.ModuleType("_inferctx_test_trigger")  # "import torch"
    early = torch.from_dlpack(y).sum()  # read on torch's current stream right away
    assert ctx.stream.handle != side.ptr
    torch.cuda.synchronize()
    side.synchronize()
    late = torch.from_dlpack(y).sum()
assert float(early) == float(late) and float(late) > 0, (float(early), float(late))
print("ok")
"""


def test_work_queued_on_cupys_stream_before_torch_is_imported_comes_before_torchs_stream(cupy):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", CUPY_THEN_TORCH_SCRIPT], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.split()[-1:] == ["ok"], (run.stdout, run.stderr[-3000:])


# ---- result types ----------------------------------------------------------------------------

def test_torch_in_torch_out(torch, ctx):
    x = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    y, bits = inferctx.dropout(x, 0.3)
    assert isinstance(y, torch.Tensor) and y.device == x.device and y.dtype == x.dtype
    assert y.shape == x.shape and y.is_contiguous()
    assert isinstance(bits, torch.Tensor) and bits.dtype == torch.int32 and bits.shape == (32,)
    _, byte_mask = inferctx.dropout(x, 0.3, mask="bytes")
    assert byte_mask.dtype == torch.uint8 and byte_mask.shape == x.shape
    g = inferctx.apply_mask(x, bits, 0.3)
    assert isinstance(g, torch.Tensor) and g.dtype == x.dtype
    a = torch.randn(8, 16, device="cuda", dtype=torch.float16)
    b = torch.randn(16, 4, device="cuda", dtype=torch.float16)
    c = inferctx.gemm(a, b)
    assert isinstance(c, torch.Tensor) and c.shape == (8, 4) and c.dtype == torch.float16
    # out= is returned as given: the same tensor, the same memory.
    buf = torch.empty(8, 4, device="cuda", dtype=torch.float16)
    assert inferctx.gemm(a, b, out=buf) is buf
    y_buf = torch.empty_like(x)
    y2, m2 = inferctx.dropout(x, 0.3, out=y_buf, mask_out=bits)
    assert y2 is y_buf and m2 is bits
    bb = inferctx.bmm(a[None], b[None])
    assert isinstance(bb, torch.Tensor) and bb.shape == (1, 8, 4)


def test_torch_results_come_from_torchs_allocator(torch, ctx):
    x = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y, mask = inferctx.dropout(x, 0.5)
    # y (4 MiB) and the mask (128 KiB) are torch allocations.
    assert torch.cuda.memory_allocated() - before >= y.numel() * 4 + mask.numel() * 4
    del y, mask
    assert torch.cuda.memory_allocated() == before


def test_operands_that_require_grad_give_results_without_autograd_history(torch, ctx):
    # Inference kernels (README): weights left as nn.Parameters work as they are, and no result
    # carries autograd history, whichever path (general or compiled) takes the call.
    w = torch.nn.Parameter(_ints(torch, (16, 8), 3, torch.float16))
    for _ in range(2):  # the first call of a layout takes the general path, later ones the other
        torch.cuda._sleep(SLEEP_CYCLES)  # the producer's a comes late; the read follows at once
        a = _ints(torch, (4, 16), 4, torch.float16).requires_grad_()
        want = a.detach() @ w.detach()  # exact: small integers
        c = inferctx.gemm(a, w)
        assert c.requires_grad is False and c.grad_fn is None
        assert torch.equal(c, want)
    out = torch.zeros(4, 8, device="cuda", dtype=torch.float16, requires_grad=True)
    for _ in range(2):
        assert inferctx.gemm(a, w, out=out) is out
        assert torch.equal(out.detach(), want)
    y, bits = inferctx.dropout(a, 0.0)  # p = 0 copies x bit for bit
    assert y.requires_grad is False and bits.requires_grad is False
    assert torch.equal(y, a.detach())


def test_cupy_in_cupy_out(torch, cupy, ctx):
    x = cupy.random.standard_normal(1000, dtype=cupy.float32)
    y, bits = inferctx.dropout(x, 0.3)
    assert isinstance(y, cupy.ndarray) and y.dtype == cupy.float32 and y.shape == x.shape
    assert isinstance(bits, cupy.ndarray) and bits.dtype == cupy.uint32 and bits.shape == (32,)
    a = cupy.ones((8, 16), dtype=cupy.float16)
    b = cupy.ones((16, 4), dtype=cupy.float16)
    c = inferctx.gemm(a, b)
    assert isinstance(c, cupy.ndarray) and c.shape == (8, 4)
    assert bool((c == 16).all())
    out = cupy.empty((8, 4), dtype=cupy.float16)
    assert inferctx.gemm(a, b, out=out) is out


def test_deviceview_in_deviceview_out(torch, ctx):
    x = inferctx._core._empty(0, (4096,), "float16")
    torch.from_dlpack(x).normal_()
    y, bits = inferctx.dropout(x, 0.25)
    assert isinstance(y, inferctx.DeviceView) and isinstance(bits, inferctx.DeviceView)
    assert y.dtype == "float16" and bits.dtype == "uint32" and bits.shape == (128,)
    # A DLPack round trip gives the same memory.
    assert torch.from_dlpack(y).data_ptr() == y.ptr


def test_mixed_packages_take_the_first_operands(torch, cupy, ctx):
    # torch a, CuPy b: torch decides the stream and the result type; CuPy's stream is joined.
    a = torch.ones(8, 16, device="cuda", dtype=torch.float16)
    b = cupy.ones((16, 4), dtype=cupy.float16)
    c = inferctx.gemm(a, b)
    assert isinstance(c, torch.Tensor) and bool((c == 16).all())
    c2 = inferctx.gemm(cupy.asarray(a), torch.as_tensor(b, device="cuda"))
    assert isinstance(c2, cupy.ndarray) and bool((c2 == 16).all())
    # CuPy on its own stream with torch out=: the product runs on torch's stream and CuPy's
    # current stream waits for it before reading.
    cs = cupy.cuda.Stream(non_blocking=True)
    out = torch.empty(8, 4, device="cuda", dtype=torch.float16)
    with cs:
        torch.cuda._sleep(SLEEP_CYCLES)
        inferctx.gemm(a, b, out=out)
        seen = cupy.asarray(out).sum()
    cs.synchronize()
    assert float(seen) == 16 * 32


def test_dropout_with_mixed_arrays_takes_the_first_of_a_package(torch, cupy, ctx):
    # Of x, out and mask_out, the first array of a package decides: a DeviceView x with a torch
    # out gives a torch mask made on torch's stream; a CuPy x with a torch out, a CuPy mask.
    x = inferctx._core._empty(0, (4096,), "float16")
    out = torch.empty(4096, device="cuda", dtype=torch.float16)
    # The input is written behind a long sleep on the caller's stream, and the output read there at
    # once, with no synchronize: only a kernel ordered on that stream gives the right values.
    torch.cuda._sleep(TRIAL_SLEEP_CYCLES)
    torch.from_dlpack(x).fill_(2.0)
    y, bits = inferctx.dropout(x, 0.5, out=out)
    read = out.clone()
    assert not torch.cuda.current_stream().query(), "the caller's stream was idle: ordering untested"
    assert y is out
    assert isinstance(bits, torch.Tensor) and bits.dtype == torch.int32 and bits.shape == (128,)
    kept = ref.unpack_bits(bits.cpu().numpy().view(np.uint32), 4096)
    assert 1000 < kept.sum() < 3096
    assert np.array_equal(read.cpu().numpy(), np.where(kept, 4.0, 0.0).astype(np.float16))
    assert np.array_equal(out.cpu().numpy(), np.where(kept, 4.0, 0.0).astype(np.float16))
    xc = cupy.full((4096,), 2.0, dtype=cupy.float16)
    y, bits = inferctx.dropout(xc, 0.5, out=out)
    assert y is out and isinstance(bits, cupy.ndarray) and bits.dtype == cupy.uint32
    kept = ref.unpack_bits(cupy.asnumpy(bits), 4096)
    assert 1000 < kept.sum() < 3096
    assert np.array_equal(out.cpu().numpy(), np.where(kept, 4.0, 0.0).astype(np.float16))


# ---- the pool --------------------------------------------------------------------------------

def test_plain_calls_on_deviceviews_keep_the_pool_bounded_and_trim_returns_it(torch, ctx):
    gc.collect()
    torch.cuda.synchronize()
    pool = ctx.memory_pool
    pool.trim()
    used_before, blocks_before = pool.used_bytes, pool.allocations
    free_before = torch.cuda.mem_get_info(0)[0]
    x = inferctx._core._empty(0, (1 << 20,), "float16")  # 2 MiB
    torch.from_dlpack(x).normal_()
    for _ in range(10_000):
        y, mask = inferctx.dropout(x, 0.1)
        del y, mask
    # y (2 MiB) and the mask (128 KiB) come back to the pool every call: a few blocks at most.
    assert pool.reserved_bytes - used_before <= 32 << 20, pool.stats()
    assert pool.allocations == blocks_before + 1  # x
    del x
    gc.collect()
    pool.trim()
    assert pool.used_bytes == used_before and pool.allocations == blocks_before, pool.stats()
    assert pool.reserved_bytes - used_before < 2 << 20, pool.stats()
    free_after = torch.cuda.mem_get_info(0)[0]
    assert abs(free_after - free_before) <= 2 << 20, (free_before, free_after)


def test_a_result_made_on_an_inferctx_stream_is_let_go_without_waiting_for_the_device(torch, ctx):
    # A DeviceView result made on an inferctx.Stream, which the pool orders by an event while the
    # stream exists, is freed in that stream's order when dropped: work elsewhere on the device
    # (a sleep on a stream the call never saw) is not waited for.
    pool = ctx.memory_pool
    s = inferctx.Stream()
    x = inferctx._core._empty(0, (1 << 18,), "float32")
    torch.from_dlpack(x).fill_(1.0)
    y, _ = inferctx.dropout(x, 0.0, mask=None, stream=s)
    torch.cuda.synchronize()
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(500_000_000 * _LONG)  # about 250 ms
    before = pool.allocations
    del y
    gc.collect()
    assert pool.allocations == before - 1  # the block was let go (its free queued)
    assert not busy.query(), "letting the result go waited for the whole device"
    torch.cuda.synchronize()
    # And once the stream is gone, a result that used it is freed after the device is done.
    y, _ = inferctx.dropout(x, 0.0, mask=None, stream=s)
    del s
    gc.collect()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(100_000_000 * _LONG)
    del y
    gc.collect()
    assert busy.query(), "a result used on a destroyed stream was freed without a device synchronisation"


def test_pool_block_is_not_reused_while_a_consumer_stream_reads_it(torch, ctx):
    # A DeviceView result exported to a side stream that is still busy, then dropped: its block
    # must not be handed out again before the side stream is done with it. The side stream is
    # the context's comm stream, whose uses the pool orders by an event: a use on a stream it
    # does not know (a torch.cuda.Stream) is freed after a device-wide synchronisation, which
    # would wait for the side stream here.
    pool = ctx.memory_pool
    side = torch.cuda.ExternalStream(ctx.comm_stream.handle)
    # Garbage of earlier tests first: a block among it with a use the pool cannot order by an
    # event would be freed after a device-wide synchronisation, which would wait out the sleep.
    gc.collect()
    x = inferctx._core._empty(0, (1 << 18,), "float32")
    torch.from_dlpack(x).fill_(1.0)
    y, _ = inferctx.dropout(x, 0.0, mask=None)
    y_ptr = y.ptr
    with torch.cuda.stream(side):
        torch.cuda._sleep(400_000_000 * _LONG)  # about 200 ms: far past gc.collect and the calls below
        t = torch.from_dlpack(y)  # consumer: the side stream (noted in the export)
        total = t.sum()
    del t, y
    gc.collect()
    z, _ = inferctx.dropout(x, 0.0, mask=None)  # may take y's block: only after `side`
    torch.from_dlpack(z).fill_(5.0)
    # The side stream was still reading when z was made and written, or this tested nothing.
    assert not side.query(), "the side stream finished before z was made; make its sleep longer"
    torch.cuda.synchronize()
    assert total.item() == float(1 << 18)  # the side stream read y's values, not z's 5.0
    del z, y_ptr, pool


# ---- dropout's scale, rounded once ----------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1 / 3])
def test_dropout_equals_torchs_x_times_mask_times_scale(torch, ctx, dtype, p):
    t = getattr(torch, dtype)
    x = (torch.randn(1 << 16, device="cuda") * 4).to(t)
    y, mask = inferctx.dropout(x, p, mask="bytes")
    want = x * mask * (1 / (1 - p))
    assert want.dtype == x.dtype
    bits = torch.int16 if dtype != "float32" else torch.int32
    kept = mask.bool()
    assert bool(kept.any()) and bool((~kept).any())
    # Kept: the same bits as torch's; dropped: +0 (torch's x * 0 is -0 for negative x).
    assert torch.equal(y[kept].view(bits), want[kept].view(bits))
    assert bool((y[~kept].view(bits) == 0).all())


# ---- bad stream= ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["fast", 1.5, True, object(), -3])
def test_stream_that_is_not_a_stream_is_refused_before_launch(torch, ctx, bad):
    x = torch.ones(100, device="cuda")
    y = torch.full_like(x, 7.0)
    state = ctx.rng_state
    with pytest.raises(ConfigError) as info:
        inferctx.dropout(x, 0.5, out=y, stream=bad)
    assert info.value.argument == "stream" and "stream" in str(info.value)
    with pytest.raises(ConfigError) as info:
        inferctx.gemm(x.view(10, 10), x.view(10, 10), stream=bad)
    assert info.value.argument == "stream"
    assert ctx.rng_state == state  # nothing drew from the Philox state
    torch.cuda.synchronize()
    assert bool((y == 7.0).all())  # nothing was launched


class _CountingStream:
    """A __cuda_stream__ producer that counts how often it is asked."""

    def __init__(self, handle):
        self.handle = handle
        self.asked = 0

    def __cuda_stream__(self):
        self.asked += 1
        return (0, self.handle)


class _Bare:
    """A tensor seen only through its CUDA array interface (no package: a DeviceView result)."""

    def __init__(self, t):
        self.t = t
        self.__cuda_array_interface__ = t.__cuda_array_interface__


def test_a_stream_argument_is_asked_for_its_handle_once_per_call(torch, ctx):
    # Its __cuda_stream__ may do work (a library's stream wrapper); each kernel call reads the
    # handle once, the general gemm path included (torch operands with stream= take it).
    side = torch.cuda.Stream()
    s = _CountingStream(side.cuda_stream)
    a = _ints(torch, (16, 8), 1, torch.float32)
    b = _ints(torch, (8, 4), 2, torch.float32)
    want = (a.double() @ b.double()).float()
    x = torch.ones(256, device="cuda")
    calls = [
        lambda: inferctx.gemm(a, b, stream=s),
        lambda: inferctx.bmm(a[None], b[None], stream=s)[0],
        lambda: inferctx.gemm(_Bare(a), _Bare(b), stream=s),
        lambda: inferctx.dropout(x, 0.0, stream=s)[0],
    ]
    for i, call in enumerate(calls):
        before = s.asked
        got = call()
        assert s.asked == before + 1, (i, s.asked - before)
        torch.cuda.current_stream().synchronize()
        if i < 3:
            got = torch.from_dlpack(got) if not isinstance(got, torch.Tensor) else got
            assert torch.equal(got, want), i
        else:
            assert bool((got == 1).all())


def test_destroyed_stream_is_refused(torch, ctx):
    s = inferctx.Stream()
    handle = s.handle
    del s
    gc.collect()
    x = torch.ones(100, device="cuda")
    with pytest.raises(ConfigError) as info:
        inferctx.dropout(x, 0.5, stream=handle)
    # CUDA cannot be asked about a destroyed handle (it reads freed memory); inferctx knows the
    # handles its own Streams destroyed.
    assert info.value.argument == "stream" and "destroyed" in str(info.value)
    # Nor is an event recorded on it or made to wait on it.
    event = inferctx.Event()
    for method in (event.record, event.wait):
        with pytest.raises(ConfigError) as info:
            method(handle)
        assert info.value.argument == "stream" and "destroyed" in str(info.value), method
    # The next valid call works: no CUDA error was left pending.
    y, _ = inferctx.dropout(x, 0.0)
    assert bool((y == 1).all())


@pytest.mark.multi_gpu
def test_stream_of_another_device_is_refused(torch, ctx):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    other = inferctx.Stream(device=1)
    x = torch.ones(100, device="cuda:0")
    with pytest.raises(ConfigError) as info:
        inferctx.dropout(x, 0.5, stream=other)
    assert info.value.argument == "stream" and "cuda:1" in str(info.value)
    # Device 1's default stream is the legacy handle, which names no device by itself: the
    # object says which.
    before = ctx.rng_state
    for default_of_1 in (torch.cuda.default_stream(1), inferctx.Stream(torch.cuda.default_stream(1))):
        with pytest.raises(ConfigError) as info:
            inferctx.dropout(x, 0.5, stream=default_of_1)
        assert info.value.argument == "stream" and "cuda:1" in str(info.value)
        with pytest.raises(ConfigError) as info:
            inferctx.gemm(torch.ones(4, 4, device="cuda:0"), torch.ones(4, 4, device="cuda:0"),
                          stream=default_of_1)
        assert info.value.argument == "stream" and "cuda:1" in str(info.value)
    assert ctx.rng_state == before  # nothing was launched
    assert inferctx.Stream(torch.cuda.default_stream(1)).device == 1
    # Operands on cuda:1 with the context of cuda:0: ctx is what is wrong, for every kernel.
    x1 = torch.ones(64, device="cuda:1")
    for call in (lambda: inferctx.dropout(x1, 0.5, ctx=ctx),
                 lambda: inferctx.dropout(x1, 0.5, ctx=ctx, stream=torch.cuda.Stream(1)),
                 lambda: inferctx.apply_mask(x1, torch.ones(2, dtype=torch.int32, device="cuda:1"), 0.5,
                                             ctx=ctx),
                 lambda: inferctx.gemm(x1.view(8, 8), x1.view(8, 8), ctx=ctx)):
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == "ctx" and "cuda:1" in str(info.value), info.value


# ---- the compiled torch paths give what the general path gives ------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_plain_torch_dropout_equals_the_general_path_at_the_same_philox_state(torch, ctx, dtype):
    x = torch.randn(5000, device="cuda", dtype=getattr(torch, dtype))
    inferctx.dropout(x, 0.25)  # the context exists and torch is known: the compiled path is taken
    seed, offset = ctx.rng_state
    y, bits = inferctx.dropout(x, 0.25)
    assert ctx.rng_state == (seed, offset + 4)  # it took increment_offset(4), as the general path
    # seed= / offset= go the general way; the same state gives the same bits.
    y2, bits2 = inferctx.dropout(x, 0.25, seed=seed, offset=offset)
    assert torch.equal(bits, bits2) and torch.equal(y.view(torch.int16 if dtype != "float32" else torch.int32),
                                                    y2.view(torch.int16 if dtype != "float32" else torch.int32))
    assert bits.dtype == torch.int32 and bits.shape == (-(-5000 // 32),) and y.shape == x.shape
    # Both paths against the independent NumPy Philox reference at that state, not only each other.
    keep = ref.dropout_keep(seed, offset, 0.25, 5000)
    assert np.array_equal(ref.unpack_bits(bits.cpu().numpy().view(np.uint32), 5000), keep)
    # What the compiled path leaves to the general one still gets the general path's answers.
    with pytest.raises(ConfigError) as info:
        inferctx.dropout(x[::2], 0.25)
    assert info.value.argument == "x"
    with pytest.raises(ConfigError) as info:
        inferctx.dropout(x, 1.5)
    assert info.value.argument == "p"
    e, e_bits = inferctx.dropout(x[:0], 0.25)
    assert e.shape == (0,) and e_bits.shape == (0,)


def test_plain_torch_gemm_refuses_beta_without_out_after_the_signature_is_known(torch, ctx):
    a = torch.randn(8, 16, device="cuda", dtype=torch.float16)
    b = torch.randn(16, 4, device="cuda", dtype=torch.float16)
    c = inferctx.gemm(a, b)
    c2 = inferctx.gemm(a, b)  # the compiled path: the same bits as torch.matmul's cuBLAS call
    assert torch.equal(c, c2)
    assert torch.equal(c2, a @ b)
    with pytest.raises(ConfigError) as info:
        inferctx.gemm(a, b, beta=0.5)
    assert info.value.argument == "beta"
    with pytest.raises(ConfigError) as info:
        inferctx.bmm(a[None], b[None], beta=1.0)
    assert info.value.argument == "beta"


def test_bmm_into_its_inputs_own_buffer_as_a_user_calls_it(torch, ctx):
    """bmm(a, b, out=buf[1::2]) with a = buf[0::2]: torch tensors as they come, the default
    context, no use_stream, no synchronize between the call and the read. The caller's stream
    is held by a sleep, the input is written behind it, and the read follows the call at once;
    TRIALS times, each read exact (small integers, so any order of sums is exact)."""
    batch, n = 4, 64
    buf = torch.zeros((2 * batch, n, n), dtype=torch.float16, device="cuda")
    b = _ints(torch, (batch, n, n), 7, torch.float16)
    # A first round of everything a trial runs, outside the trials: the algorithm choice, and
    # each kernel's first launch (which a sanitizer makes long enough to outlast a trial's sleep).
    buf[0::2].copy_(_ints(torch, (batch, n, n), 99, torch.float16))
    inferctx.bmm(buf[0::2], b, out=buf[1::2])
    buf[1::2].clone(), buf[0::2].clone()
    torch.cuda.synchronize()
    reads, inputs = [], []
    for trial in range(TRIALS):
        _trial_sleep(torch, trial)
        buf[0::2].copy_(_ints(torch, (batch, n, n), 100 + trial, torch.float16))  # produced on the caller's stream
        inferctx.bmm(buf[0::2], b, out=buf[1::2])
        _still_busy(torch, trial)
        reads.append(buf[1::2].clone())  # read on the caller's stream, straight after the call
        inputs.append(buf[0::2].clone())
    torch.cuda.synchronize()
    for trial, (got, a) in enumerate(zip(reads, inputs)):
        want = (a.double() @ b.double()).to(torch.float16)
        assert torch.equal(got, want), trial
        assert torch.equal(a, _ints(torch, (batch, n, n), 100 + trial, torch.float16)), trial  # a not written

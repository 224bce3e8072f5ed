"""Stream and Event: owned and borrowed streams, the stream objects of other libraries, and
ordering by events."""

from __future__ import annotations

import gc
import weakref

import pytest
from gpu_context import ctx  # noqa: F401 (fixture)

import inferctx
from inferctx import ConfigError
from inferctx.context import Event, PinnedBuffer, Stream


class CudaStreamProtocol:
    """Anything with __cuda_stream__ (a method, as the protocol says)."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class CudaStreamProperty:
    """Early cuda.core made __cuda_stream__ a property."""

    def __init__(self, handle):
        self.__cuda_stream__ = (0, handle)


def _imitation(module, name):
    """An object of a class `name` of `module` with CuPy's .ptr and .device_id: what CuPy's
    memory pointers and events look like to a reader of attributes."""
    cls = type(name, (), {"ptr": 0x7F00_0000_1000, "device_id": 0})
    cls.__module__ = module
    return cls()


@pytest.mark.parametrize("source", [
    "stream", True, -1, 1 << 64, 2.0, object(), CudaStreamProtocol("h"), CudaStreamProtocol(-5),
    CudaStreamProperty(None),
    # A .ptr is a stream handle on CuPy's streams only: CuPy's memory pointers and events (and
    # inferctx's own views and buffers) have one too, an address or an event, which CUDA must
    # never be asked about as a stream.
    _imitation("cupy.cuda.memory", "MemoryPointer"), _imitation("cupy.cuda.stream", "Event"),
    _imitation("inferctx._core", "DeviceView"), _imitation("mylib", "Stream"),
])
def test_bad_sources_are_refused_before_any_cuda_call(source):
    with pytest.raises(ConfigError) as info:
        Stream(source)
    assert info.value.argument == "source"


def test_help_shows_the_keyword_only_arguments_where_they_are():
    # Cython's embedded signature put the marker last, "Stream(source=None, device=None, *)",
    # which says device may be positional; it may not.
    import inspect

    assert Stream.__doc__.startswith("Stream(source=None, *, device=None)\n")
    assert Event.__doc__.startswith("Event(device=None, *, timing=False)\n")
    assert "device=None, *)" not in Stream.__doc__ and "timing=False, *)" not in Event.__doc__
    assert str(inspect.signature(Stream.wait)) == "(self, other)"


def test_event_timing_must_be_a_bool():
    with pytest.raises(ConfigError) as info:
        Event(timing=1)
    assert info.value.argument == "timing"


@pytest.mark.gpu
def test_owned_stream():
    s = Stream()
    assert s.owned and s.handle > 2 and s.__cuda_stream__() == (0, s.handle)
    s.synchronize()
    assert repr(s).endswith("owned>")
    t = Stream(s)  # borrowed: the same handle
    assert not t.owned and t == s and hash(t) == hash(s) and t.device == s.device


@pytest.mark.gpu
def test_borrowed_handles():
    s = Stream()
    assert Stream(s.handle).handle == s.handle
    assert Stream(0).handle == 1  # 0 is the legacy default stream, named explicitly
    assert Stream(2).handle == 2
    src = CudaStreamProtocol(s.handle)
    wrapped = Stream(src)
    assert wrapped.handle == s.handle and Stream(CudaStreamProperty(s.handle)).handle == s.handle
    ref = weakref.ref(src)
    del src
    gc.collect()
    assert ref() is not None  # kept alive by the Stream that borrows it
    del wrapped
    gc.collect()
    assert ref() is None


@pytest.mark.gpu
def test_events():
    s = Stream()
    start, end = Event(timing=True), Event(timing=True)
    start.record(s)
    end.record(s)
    end.synchronize()
    assert start.query() and end.query()
    assert end.elapsed_ms(start) >= 0.0
    plain = Event()
    assert not plain.timing and plain.handle != 0 and plain.record(s) is plain
    plain.wait(Stream())
    with pytest.raises(ConfigError) as info:
        plain.elapsed_ms(start)
    assert info.value.argument == "timing"
    with pytest.raises(ConfigError) as info:
        end.elapsed_ms(0.5)
    assert info.value.argument == "start"
    with pytest.raises(ConfigError) as info:
        plain.record("s")
    assert info.value.argument == "stream"
    e = s.record()
    assert isinstance(e, Event)
    e.synchronize()


@pytest.mark.gpu
def test_torch_and_cupy_streams():
    torch = pytest.importorskip("torch")
    ts = torch.cuda.Stream()
    s = Stream(ts)
    assert s.handle == ts.cuda_stream and s.device == ts.device_index
    cur = torch.cuda.current_stream()
    assert Stream(cur).handle == (cur.cuda_stream or 1)
    # torch accepts ours back
    ext = torch.cuda.ExternalStream(Stream().handle)
    assert ext.cuda_stream != 0
    cupy = pytest.importorskip("cupy")
    cs = cupy.cuda.Stream(non_blocking=True)
    assert Stream(cs).handle == cs.ptr


@pytest.mark.gpu
def test_objects_with_a_ptr_that_are_no_stream_are_refused(ctx):
    cupy = pytest.importorskip("cupy")
    event = cupy.cuda.Event()
    memory = cupy.zeros(4).data
    for bad in (event, memory, ctx.workspace, PinnedBuffer(16)):
        with pytest.raises(ConfigError) as info:
            Stream(bad)
        assert info.value.argument == "source"
        with pytest.raises(ConfigError) as info:
            ctx.use_stream(bad)
        assert info.value.argument == "stream"
        with pytest.raises(ConfigError) as info:
            Stream().wait(bad)
    # CuPy's streams, and subclasses of them, are still taken by their .ptr. (`base` is kept:
    # CuPy destroys a Stream's stream with the object, and ExternalStream does not keep it.)
    base = cupy.cuda.Stream(non_blocking=True)
    external = cupy.cuda.ExternalStream(base.ptr)
    assert Stream(external).handle == external.ptr == base.ptr


@pytest.mark.gpu
def test_init_twice_is_refused_and_the_stream_lives_on(torch):
    s = Stream()
    handle = s.handle
    ctx = inferctx.InferenceContext.instance()
    ctx.use_stream(s)
    try:
        with pytest.raises(TypeError, match="twice"):
            s.__init__()
        with pytest.raises(TypeError, match="twice"):
            s.__init__(torch.cuda.Stream())
        assert s.handle == handle
        x = torch.arange(64, dtype=torch.float32, device="cuda")
        y, _ = inferctx.dropout(x, 0.0, stream=s)  # the stream exists: no CUDA error
        assert torch.equal(y, x)
    finally:
        ctx.use_stream(None)


@pytest.mark.gpu
def test_a_live_stream_at_the_address_of_a_destroyed_one_is_taken(torch):
    """CUDA may give a new stream the address of one destroyed before: a stream object of
    another library there is live and must be taken; only a bare int at a destroyed inferctx
    Stream's address is refused (CUDA cannot be asked about it)."""
    cupy = pytest.importorskip("cupy")
    ctx = inferctx.InferenceContext.instance()
    x = torch.arange(64, dtype=torch.float32, device="cuda")
    for _ in range(200):
        s = Stream()
        gone = s.handle
        del s
        gc.collect()
        raw = cupy.cuda.runtime.streamCreateWithFlags(1)  # non-blocking
        if raw == gone:
            break
        cupy.cuda.runtime.streamDestroy(raw)
    else:
        pytest.skip("CUDA gave no new stream the address of a destroyed one in 200 tries")
    try:
        live = cupy.cuda.ExternalStream(raw)
        assert Stream(live).handle == raw
        y, _ = inferctx.dropout(x, 0.0, stream=live)
        assert torch.equal(y, x)
        ctx.use_stream(live)
        ctx.use_stream(None)
        # The bare handle is still refused: inferctx cannot tell it from the destroyed stream.
        with pytest.raises(ConfigError, match="destroyed") as info:
            inferctx.dropout(x, 0.0, stream=raw)
        assert info.value.argument == "stream"
    finally:
        torch.cuda.synchronize()
        cupy.cuda.runtime.streamDestroy(raw)


CUPY_CURRENT_STREAM_SCRIPT = """
import gc, sys
import cupy
import inferctx
assert "torch" not in sys.modules  # ctx.stream follows CuPy's current stream
ctx = inferctx.InferenceContext.instance()
s = cupy.cuda.Stream(non_blocking=True)
handle = s.ptr
with s:
    st = ctx.stream
assert st.handle == handle, (st.handle, handle)
assert any(o is s for o in gc.get_referents(st)), "ctx.stream does not hold CuPy's stream"
del s
gc.collect()
x = cupy.arange(1 << 20, dtype=cupy.float32)
ctx.use_stream(st)  # a stream that still exists: no error
y, _ = inferctx.dropout(x, 0.0, stream=st)
st.synchronize()
assert bool((y == x).all())
ctx.use_stream(None)
print("ok")
"""


@pytest.mark.gpu
def test_ctx_stream_following_cupy_keeps_cupys_stream_alive():
    """A borrowed stream keeps its source alive: ctx.stream, when it is CuPy's current stream,
    holds CuPy's stream object (CuPy destroys the stream with it). In a child without torch."""
    pytest.importorskip("cupy")
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", CUPY_CURRENT_STREAM_SCRIPT], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split()[-1:] == ["ok"], (run.stdout, run.stderr[-3000:])


@pytest.mark.gpu
def test_wait_orders_two_streams():
    torch = pytest.importorskip("torch")
    first, second = Stream(), Stream()
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.ExternalStream(first.handle)):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time before the write
        x.fill_(1.0)
    second.wait(first)
    with torch.cuda.stream(torch.cuda.ExternalStream(second.handle)):
        y = x.clone()
    second.synchronize()
    assert float(y.min()) == 1.0


def _two_gpus_torch():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    return torch


def _ones_written_late_on_cuda1(torch, stream):
    """A tensor of cuda:1 that `stream` (a torch stream of cuda:1) fills with ones after ~50 ms
    of GPU time."""
    x1 = torch.zeros(1 << 20, device="cuda:1")
    torch.cuda.synchronize(1)
    with torch.cuda.device(1), torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)
        x1.fill_(1.0)
    return x1


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_wait_for_a_stream_of_another_device():
    torch = _two_gpus_torch()
    # The event goes on the other device's stream, so it is made on that device; before, it was
    # made on the waiting stream's and recording it failed.
    ours = Stream(device=1)
    for other, as_torch in ((ours, torch.cuda.ExternalStream(ours.handle, device="cuda:1")),
                            (torch.cuda.Stream(1),) * 2, (torch.cuda.default_stream(1),) * 2):
        waiting = Stream(device=0)
        x1 = _ones_written_late_on_cuda1(torch, as_torch)
        waiting.wait(other)
        # torch runs a peer copy on the source device's current stream, after that stream's work
        # and the destination's current stream's: a fresh stream on cuda:1 leaves the waiting
        # stream as the copy's only order after the write.
        with torch.cuda.stream(torch.cuda.Stream(1)), \
                torch.cuda.stream(torch.cuda.ExternalStream(waiting.handle, device="cuda:0")):
            y = x1.to("cuda:0", non_blocking=True)
        waiting.synchronize()
        assert float(y.min()) == 1.0, other


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_a_default_stream_waits_for_a_stream_of_another_device():
    torch = _two_gpus_torch()
    # The legacy handle names the current device's default stream: the wait is made with the
    # waiting stream's device current, not the event's (before, cuda:1's default stream waited).
    other = torch.cuda.Stream(1)
    waiting = Stream(torch.cuda.default_stream(0))
    assert waiting.device == 0
    x1 = _ones_written_late_on_cuda1(torch, other)
    with torch.cuda.device(1):  # the current device is the other one
        waiting.wait(other)
    with torch.cuda.stream(torch.cuda.Stream(1)), torch.cuda.stream(torch.cuda.default_stream(0)):
        y = x1.to("cuda:0", non_blocking=True)  # ordered after the write only through `waiting`
    torch.cuda.synchronize(0)
    assert float(y.min()) == 1.0


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_an_event_is_not_recorded_on_a_default_stream_of_another_device():
    torch = _two_gpus_torch()
    event = Event(0)
    with pytest.raises(ConfigError, match="make the Event with device=1") as refused:
        event.record(torch.cuda.default_stream(1))  # the legacy handle: cuda:0's stream, were it taken
    assert refused.value.argument == "stream"
    assert event.record(torch.cuda.default_stream(0)) is event


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_a_default_stream_object_of_another_device_is_refused_for_device():
    torch = _two_gpus_torch()
    # torch.cuda.default_stream(1) is the legacy handle, which names no device by itself, but the
    # object says cuda:1: wrapping it for device=0 would make a Stream of cuda:0's default stream
    # that holds cuda:1's. A bare handle 0 names no device and is each device's.
    with pytest.raises(ConfigError, match="the source is a stream of cuda:1; pass device=1") as refused:
        Stream(torch.cuda.default_stream(1), device=0)
    assert refused.value.argument == "device"
    assert Stream(torch.cuda.default_stream(1), device=1).device == 1
    assert Stream(0, device=1).device == 1

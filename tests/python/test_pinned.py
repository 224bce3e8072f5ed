"""PinnedBuffer: NumPy views it without a copy (buffer protocol and DLPack), and asynchronous
copies to and from DeviceViews."""

from __future__ import annotations

import gc
import sys

import dlpack_ctypes as dlpack
import pytest
from dlpack_ctypes import capsule_name, read
from gpu_context import KV_SHAPE, ctx, pinned_of  # noqa: F401 (fixture)

import inferctx
from inferctx import ConfigError
from inferctx.context import PinnedBuffer, Stream

np = pytest.importorskip("numpy")


@pytest.mark.parametrize("nbytes", [-1, True, 1.5, "8", None, np.True_])
def test_size_is_checked_before_any_cuda_call(nbytes):
    with pytest.raises(ConfigError) as info:
        PinnedBuffer(nbytes)
    assert info.value.argument == "nbytes"


@pytest.mark.parametrize("max_version", [("a", 0), (1, "0"), (True, 0), (1.0, 0), [1, 0], (1,)])
def test_a_max_version_that_is_no_pair_of_ints_is_named(max_version):
    """The DLPack spec's error for it is TypeError; it names max_version and what is valid."""
    with pytest.raises(TypeError, match=r"max_version: got .*; the DLPack spec passes None or a "
                                        r"\(major, minor\) tuple of ints"):
        PinnedBuffer(0).__dlpack__(max_version=max_version)


def test_empty_buffer_exports_on_any_machine():
    # Zero bytes need no page-locked allocation, so the export paths run without a GPU too.
    buf = PinnedBuffer(0)
    base = sys.getrefcount(buf)
    capsule = buf.__dlpack__(max_version=(1, 0))
    assert capsule_name(capsule) == "dltensor_versioned" and sys.getrefcount(buf) == base + 1
    managed, t, shape, strides = read(capsule)
    assert (managed.version.major, managed.version.minor, managed.flags) == (1, 0, 0)
    assert (t.device.device_type, t.device.device_id, t.ndim) == (3, 0, 1)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (1, 8, 1)
    assert shape == [0] and strides == [1] and t.byte_offset == 0
    del capsule, managed, t
    assert sys.getrefcount(buf) == base
    capsule = buf.__dlpack__(max_version=(1, 0), copy=True)
    managed, _, _, _ = read(capsule)
    assert managed.flags == dlpack.IS_COPIED and sys.getrefcount(buf) == base
    del capsule, managed
    assert capsule_name(buf.__dlpack__()) == "dltensor"
    assert np.from_dlpack(buf).shape == (0,) and np.from_dlpack(buf, device="cpu").shape == (0,)
    assert memoryview(buf).nbytes == 0 and np.frombuffer(buf, dtype=np.uint8).shape == (0,)
    gc.collect()
    assert sys.getrefcount(buf) == base
    with pytest.raises(ConfigError) as info:
        buf.__dlpack__(copy=1)
    assert info.value.argument == "copy"
    with pytest.raises(TypeError):
        buf.__dlpack__(max_version=1)


@pytest.mark.gpu
def test_numpy_views_it_without_a_copy():
    buf = PinnedBuffer(4096)
    assert (len(buf), buf.nbytes) == (4096, 4096) and buf.ptr != 0
    a = np.frombuffer(buf, dtype=np.float32)
    assert a.ctypes.data == buf.ptr and a.shape == (1024,) and a.flags.writeable
    a[:] = 3.5
    b = np.asarray(buf)
    assert b.ctypes.data == buf.ptr and b.dtype == np.uint8 and b.shape == (4096,)
    assert np.frombuffer(memoryview(buf), dtype=np.float32)[7] == 3.5
    assert repr(buf).startswith("<inferctx.PinnedBuffer 4096 bytes")


@pytest.mark.gpu
def test_arrays_keep_the_buffer_alive():
    a = np.frombuffer(PinnedBuffer(1 << 20), dtype=np.int64)
    gc.collect()
    a[:] = 11  # still page-locked memory of the (unreferenced) buffer
    assert int(a.sum()) == 11 * (1 << 17)


@pytest.mark.gpu
def test_from_dlpack_without_a_copy():
    buf = PinnedBuffer(256)
    assert buf.__dlpack_device__() == (3, 0)
    a = np.from_dlpack(buf)
    assert a.ctypes.data == buf.ptr and a.dtype == np.uint8 and a.shape == (256,)
    a[:] = 5
    c = np.from_dlpack(buf, device="cpu")  # asks for kDLCPU: the same memory
    assert c.ctypes.data == buf.ptr and int(c[255]) == 5
    d = np.from_dlpack(buf, copy=True)
    assert d.ctypes.data != buf.ptr and int(d.sum()) == 5 * 256


@pytest.mark.gpu
def test_dlpack_devices():
    buf = PinnedBuffer(64)
    capsule = buf.__dlpack__(max_version=(1, 0))  # alive while its struct is read
    _, t, shape, strides = read(capsule)
    assert (t.device.device_type, t.device.device_id, t.data) == (3, 0, buf.ptr)
    assert shape == [64] and strides == [1] and (t.dtype.code, t.dtype.bits) == (1, 8)
    capsule = buf.__dlpack__(dl_device=(1, 0))
    _, t, _, _ = read(capsule)
    assert t.device.device_type == 1 and t.data == buf.ptr
    assert capsule_name(buf.__dlpack__()) == "dltensor"
    for device in ((2, 0), (1, 1), (7, 0)):
        with pytest.raises(BufferError):
            buf.__dlpack__(dl_device=device)


@pytest.mark.gpu
def test_a_copy_to_host_on_another_stream_is_done_before_later_writes_on_ctx_stream(ctx, torch):
    """copy_to_host(stream=s) held back on `s` by a sleep kernel, then a kernel on ctx.stream
    writing into the same view: the copy must get the bytes from before the write."""
    k, v = ctx.kv_cache(0)
    values = np.random.default_rng(1).standard_normal(k.size).astype(np.float16)
    src = PinnedBuffer(k.nbytes)
    np.frombuffer(src, dtype=np.float16)[:] = values
    k.copy_from_host(src)
    zeros = PinnedBuffer(v.nbytes)
    np.frombuffer(zeros, dtype=np.uint8)[:] = 0
    v.copy_from_host(zeros)
    side = torch.cuda.Stream()
    dst = PinnedBuffer(k.nbytes)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: the copy waits behind it
    k.copy_to_host(dst, stream=side)
    inferctx.dropout(v, 0.0, out=k)  # ctx.stream (DeviceView operands): k becomes v's zeros
    dst.synchronize()
    assert np.array_equal(np.frombuffer(dst, dtype=np.float16), values)
    # And the write did land after the copy.
    after = PinnedBuffer(k.nbytes)
    k.copy_to_host(after)
    assert not np.frombuffer(after, dtype=np.float16).any()


@pytest.mark.gpu
def test_synchronize_waits_for_the_copies_queued_on_two_torch_streams(ctx, torch):
    """Two copies out of the GPU into one buffer as users queue them, each on the torch stream
    current at the call (ctx.stream follows it), neither ordered with the other: the first
    behind a long sleep on s1, the second, of a small view, on s2. buf.synchronize() and a read
    must wait for both; the buffer's one event was recorded again on s2 and so covered the
    second copy only, and synchronize() returned with the first still queued."""
    k, _ = ctx.kv_cache(0)
    values = np.random.default_rng(8).standard_normal(k.size).astype(np.float16)
    k.copy_from_host(pinned_of(values))
    ctx.stream.synchronize()
    small = k.view("float16", (64,))  # k's first 128 bytes: both copies write the same values there
    buf = PinnedBuffer(k.nbytes)
    np.frombuffer(buf, dtype=np.uint8)[:] = 0
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(400_000_000)  # about 200 ms
        k.copy_to_host(buf)
    with torch.cuda.stream(s2):
        small.copy_to_host(buf)
    buf.synchronize()
    assert s1.query(), "buf.synchronize() returned with the first copy still queued"
    assert np.array_equal(np.frombuffer(buf, dtype=np.float16), values)


@pytest.mark.gpu
def test_a_wait_that_ends_while_a_later_copy_runs_leaves_that_copy_waited_for(ctx, torch):
    """One thread waits for a buffer's copies while this one queues a later copy into it (on
    another stream, behind a longer sleep): the wait ends with the later copy still running, and
    a read through the buffer protocol must still wait for that one."""
    import threading
    import time

    k, v = ctx.kv_cache(0)
    rng = np.random.default_rng(3)
    first = rng.standard_normal(k.size).astype(np.float16)
    second = (first + np.float16(1)).astype(np.float16)  # differs from first everywhere
    for view, values in ((k, first), (v, second)):
        src = PinnedBuffer(view.nbytes)
        np.frombuffer(src, dtype=np.float16)[:] = values
        view.copy_from_host(src)
    dst = PinnedBuffer(k.nbytes)
    np.frombuffer(dst, dtype=np.uint8)[:] = 0
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(100_000_000)  # about 50 ms
    k.copy_to_host(dst, stream=s1)  # the first copy: k's values
    waiter = threading.Thread(target=dst.synchronize)
    waiter.start()
    time.sleep(0.01)  # the waiter is in its wait, which covers the first copy only
    with torch.cuda.stream(s2):
        torch.cuda._sleep(600_000_000)  # about 300 ms
    v.copy_to_host(dst, stream=s2)  # the later copy: v's values, into the same buffer
    waiter.join()
    assert not s2.query(), "the waiter's wait covered the later copy too: the test proves nothing"
    got = np.frombuffer(dst, dtype=np.float16).copy()  # must wait for the later copy
    assert np.array_equal(got, second)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("use_stream", [False, True])
def test_async_round_trip(ctx, use_stream):
    k, v = ctx.kv_cache(0)
    stream = Stream() if use_stream else None
    src = PinnedBuffer(k.nbytes)
    values = np.random.default_rng(0).standard_normal(k.size).astype(np.float16)
    np.frombuffer(src, dtype=np.float16)[:] = values
    k.copy_from_host(src, stream)
    dst = PinnedBuffer(k.nbytes)
    k.copy_to_host(dst, stream)
    dst.synchronize()
    assert np.array_equal(np.frombuffer(dst, dtype=np.float16), values)
    # Reading through the buffer protocol waits for the copy queued into it: new values, into a
    # buffer that holds other ones, so an unwaited read would see the old.
    others = (values + np.float16(1)).astype(np.float16)
    np.frombuffer(src, dtype=np.float16)[:] = others
    v.copy_from_host(src)
    np.frombuffer(dst, dtype=np.float16)[:] = np.float16(np.nan)
    v.copy_to_host(dst)
    assert np.array_equal(np.frombuffer(dst, dtype=np.float16).reshape(KV_SHAPE),
                          others.reshape(KV_SHAPE))


@pytest.mark.gpu
def test_large_copy_then_numpy_read_waits():
    from inferctx._core import _empty

    n = 64 << 20
    view = _empty(None, (n,), "uint8")
    src = PinnedBuffer(n)
    np.frombuffer(src, dtype=np.uint8)[:] = 0x5A
    view.copy_from_host(src)
    dst = PinnedBuffer(n)
    view.copy_to_host(dst)
    assert int(np.frombuffer(dst, dtype=np.uint8).min()) == 0x5A  # no synchronize() needed


@pytest.mark.gpu
def test_copy_arguments(ctx):
    k, _ = ctx.kv_cache(0)
    for pinned in (PinnedBuffer(k.nbytes - 1), bytearray(k.nbytes), None):
        with pytest.raises(ConfigError) as info:
            k.copy_to_host(pinned)
        assert info.value.argument == "pinned"
        with pytest.raises(ConfigError) as info:
            k.copy_from_host(pinned)
        assert info.value.argument == "pinned"
    with pytest.raises(ConfigError) as info:
        k.copy_to_host(PinnedBuffer(k.nbytes), stream="fast")
    assert info.value.argument == "stream"


def _captured(torch, op, engine=None):
    """`op()` captured into a new torch CUDA graph (torch's default, the global capture mode, in
    which a host wait made during the capture would end it in error). `engine`, when given, is
    made to join the capture before `op` and joined back after (CUDA's fork pattern), as a user
    whose ctx.stream is `engine` does. Returns the graph."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        capturing = torch.cuda.current_stream()
        if engine is not None:
            engine.wait_stream(capturing)
        op(capturing)
        if engine is not None:
            capturing.wait_stream(engine)
    return g


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["default", "stream=", "ctx.stream"])
def test_a_copy_to_host_captured_in_a_graph_is_made_at_each_replay(ctx, torch, how):
    """view.copy_to_host(buf) in a torch CUDA-graph capture: as users call it (no stream=, no
    use_stream: ctx.stream is torch's current stream, the capturing one), on the capturing
    stream passed as ``stream=``, or on an adopted ctx.stream made to join the capture. The
    capture queues no copy, so
    buf.synchronize() and a NumPy read right after it have nothing to wait for (and an event
    recorded in the capture could not be waited for by the host at all: cudaErrorCapturedEvent).
    Each replay copies the view's bytes of that moment, read once the replay is waited for."""
    k, _ = ctx.kv_cache(0)
    rng = np.random.default_rng(5)
    first = rng.standard_normal(k.size).astype(np.float16)
    second = (first + np.float16(1)).astype(np.float16)  # differs from first everywhere
    k.copy_from_host(pinned_of(first))
    buf = PinnedBuffer(k.nbytes)
    np.frombuffer(buf, dtype=np.uint8)[:] = 0
    ctx.stream.synchronize()
    engine = torch.cuda.Stream()
    if how == "ctx.stream":
        ctx.use_stream(engine)
        g = _captured(torch, lambda capturing: k.copy_to_host(buf), engine)
        ctx.use_stream(None)
    elif how == "stream=":
        g = _captured(torch, lambda capturing: k.copy_to_host(buf, stream=capturing))
    else:
        g = _captured(torch, lambda capturing: k.copy_to_host(buf))
    buf.synchronize()
    assert not np.frombuffer(buf, dtype=np.uint8).any(), "a copy was made by the capture itself"
    for values in (first, second):
        k.copy_from_host(pinned_of(values))
        ctx.stream.synchronize()
        g.replay()
        torch.cuda.current_stream().synchronize()
        assert np.array_equal(np.frombuffer(buf, dtype=np.float16), values)
    # Outside a capture, copies are tracked as before: a read waits for one behind a sleep.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # about 50 ms
    k.copy_from_host(pinned_of(first))
    k.copy_to_host(buf, stream=side)
    assert np.array_equal(np.frombuffer(buf, dtype=np.float16), first)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["default", "stream=", "stream=side"])
def test_a_captured_copy_from_a_buffer_with_a_copy_pending_leaves_the_capture_going(ctx, torch, how):
    """copy_from_host in a torch capture (the global capture mode, torch's default) of a buffer
    whose copy, queued before the capture, was never waited for. The call made a host wait for
    that copy first, which CUDA refuses in such a capture (cudaErrorStreamCaptureUnsupported) and
    which ends it; in a capture it makes none (the copy is made at the replays, which such a wait
    would not order), so the capture ends. The graph's replay copies the buffer's bytes into the
    view. With ``stream=side`` (a stream not capturing, which the call makes join the capture),
    the wait was made before the side stream joined, so it was made in the capture all the same."""
    k, v = ctx.kv_cache(0)
    values = np.random.default_rng(6).standard_normal(k.size).astype(np.float16)
    k.copy_from_host(pinned_of(values))
    src = PinnedBuffer(k.nbytes)
    k.copy_to_host(src)  # never waited for
    zeros = PinnedBuffer(v.nbytes)
    np.frombuffer(zeros, dtype=np.uint8)[:] = 0
    v.copy_from_host(zeros)
    ctx.stream.synchronize()
    side = torch.cuda.Stream()
    if how == "stream=":
        g = _captured(torch, lambda capturing: v.copy_from_host(src, stream=capturing))
    elif how == "stream=side":
        g = _captured(torch, lambda capturing: v.copy_from_host(src, stream=side))
    else:  # as users call it: ctx.stream is torch's current stream, the capturing one
        g = _captured(torch, lambda capturing: v.copy_from_host(src))
    out = PinnedBuffer(v.nbytes)
    v.copy_to_host(out)
    assert not np.frombuffer(out, dtype=np.uint8).any(), "a copy was made by the capture itself"
    g.replay()
    torch.cuda.current_stream().synchronize()
    v.copy_to_host(out)
    assert np.array_equal(np.frombuffer(out, dtype=np.float16), values)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["default", "ctx.stream"])
def test_a_cpu_export_while_ctx_stream_captures_is_refused_and_the_capture_goes_on(ctx, torch, how):
    """np.from_dlpack(view, device="cpu") copies the view to the host on ctx.stream (torch's
    current stream as users leave it, or an adopted stream made to join the capture); while
    ctx.stream captures a CUDA graph that copy would be made only at a replay, so the export is
    refused (BufferError, saying so) before anything is queued, and the capture goes on: the
    torch work captured after the refusal replays right."""
    k, _ = ctx.kv_cache(0)
    x = torch.zeros(16, device=f"cuda:{ctx.device}")
    engine = torch.cuda.Stream()
    refused = []

    def op(capturing):
        with pytest.raises(BufferError, match="capturing a CUDA graph") as info:
            np.from_dlpack(k, device="cpu")
        refused.append(str(info.value))
        x.add_(1)

    if how == "default":
        g = _captured(torch, op)
    else:
        ctx.use_stream(engine)
        try:
            g = _captured(torch, op, engine)
        finally:
            ctx.use_stream(None)
    assert "copy_to_host" in refused[0], refused
    g.replay()
    g.replay()
    assert torch.equal(x, torch.full_like(x, 2.0))
    assert np.from_dlpack(k, device="cpu").shape == k.shape  # outside the capture: exported

"""DeviceView: typed sub-views, the DLPack capsule as a C consumer reads it, the CUDA array
interface, host copies, and the refusal of the buffer protocol."""

from __future__ import annotations

import ctypes
import gc

import pytest
from dlpack_ctypes import IS_COPIED, capsule_name, read
from gpu_context import (KV_SHAPE, KV_TENSOR_BYTES, WORKSPACE_BYTES, ctx,  # noqa: F401
                         pinned_of, plan_small)

from inferctx import ConfigError
from inferctx import _core
from inferctx._core import DeviceView, _empty
from inferctx.context import PinnedBuffer

np = pytest.importorskip("numpy")


def test_views_are_not_constructed_directly():
    with pytest.raises(TypeError, match="InferenceContext"):
        DeviceView()


# Each class of _core, made with T.__new__(T) (no constructor run), then every attribute read and
# every method called with no arguments. Made by __new__ alone, DeviceView, InferenceContext and
# MemoryPool had no C++ object behind them and crashed the process on first use; now __new__
# refuses them, and whatever the others give is an exception or a value. In a child process, so
# that a crash is a failed test and the attribute it died on is known.
NEW_OBJECTS_SCRIPT = """
import sys
import inferctx
from inferctx import _core, _plan
from inferctx.context import InferenceContext

classes = [InferenceContext] + [
    t for module in (_core, _plan) for t in vars(module).values()
    if isinstance(t, type) and not issubclass(t, BaseException) and t.__module__.startswith("inferctx")]
for cls in sorted(set(classes), key=lambda t: (t.__module__, t.__name__)):
    try:
        obj = cls.__new__(cls)
    except TypeError:
        print("refused", cls.__name__, flush=True)
        continue
    for name in sorted(dir(cls)):
        if name in ("__class__", "__init__", "__new__", "__init_subclass__", "__subclasshook__",
                    "__del__", "__dealloc__"):
            continue
        print("try", cls.__name__, name, flush=True)
        try:
            value = getattr(obj, name)
            if callable(value):
                value()
        except BaseException:
            pass
print("done", flush=True)
"""


def test_objects_made_by_new_alone_are_refused_or_safe():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", NEW_OBJECTS_SCRIPT], capture_output=True,
                         text=True, timeout=300)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and lines[-1:] == ["done"], (run.returncode, lines[-1:], run.stderr[-2000:])
    refused = {line.split()[1] for line in lines if line.startswith("refused ")}
    assert {"DeviceView", "InferenceContext", "MemoryPool"} <= refused, refused


def test_a_stream_made_by_new_alone_is_refused_where_a_stream_is_taken():
    """Its handle is 0, which the handle lookup returned with no exception set: Cython then
    raised nothing (CPython 3.11: SystemError) or crashed (3.12). Checked before anything else,
    so on any machine."""
    from inferctx.context import Stream

    empty = Stream.__new__(Stream)
    with pytest.raises(ConfigError, match="holds no handle") as refused:
        _core._as_cuda_array(object(), "x", stream=empty)
    assert refused.value.argument == "stream"


def fill(view, values):
    """Writes a NumPy array's bytes into `view` (through page-locked memory)."""
    buf = pinned_of(values)
    view.copy_from_host(buf)
    buf.synchronize()


def host(view, dtype):
    """The view's bytes as a NumPy array of `dtype` (a synchronous copy)."""
    buf = PinnedBuffer(view.nbytes)
    view.copy_to_host(buf)
    return np.frombuffer(buf, dtype=dtype).copy()


# -- description and sub-views ----------------------------------------------------------------

@pytest.mark.gpu
def test_description(ctx):
    k, _ = ctx.kv_cache(2)
    assert (k.ndim, k.size, k.itemsize, len(k)) == (4, 2 * 2 * 64 * 64, 2, 2)
    assert k.nbytes == KV_TENSOR_BYTES and k.context is ctx
    assert repr(k).startswith("<inferctx.DeviceView float16[2, 2, 64, 64] on cuda:")
    assert k.__dlpack_device__() == (2, ctx.device)


@pytest.mark.gpu
def test_typed_sub_views(ctx):
    ws = ctx.workspace
    v = ws.view("float32", (4, 8), offset=256)
    assert (v.ptr, v.shape, v.nbytes, v.strides, v.dtype) == (ws.ptr + 256, (4, 8), 128, (8, 1), "float32")
    assert v.offset == 256 and v.view("uint8").nbytes == 128 and v.view("uint8").ptr == v.ptr
    # The plan's bytes, rounded up to whole granules of the allocation (CUDA virtual memory).
    granule = ctx.allocation_granularity
    total = ws.nbytes
    assert total == -(-WORKSPACE_BYTES // granule) * granule and total == ctx.workspace_bytes
    assert ws.view("float16").shape == (total // 2,)
    assert ws.view(np.int32, (-1, 4), offset=16).shape == ((total - 16) // 16, 4)
    assert ws.view("bf16", 3).shape == (3,) and ws.view("bf16", 3).dtype == "bfloat16"
    assert ws.view("uint8", (0,), offset=total).nbytes == 0


@pytest.mark.gpu
@pytest.mark.parametrize("args,argument", [
    (("float32", (1,), 2), "offset"),               # misaligned
    (("uint8", (1,), -1), "offset"),
    (("uint8", (1,), "end+1"), "offset"),
    (("uint8", ("end+1",)), "shape"),  # past the end
    (("uint8", (-1, -1)), "shape"),
    (("uint8", (0, -1)), "shape"),
    (("uint8", ("a",)), "shape"),
    (("uint8", (2, -3)), "shape"),
    (("uint8", (True,)), "shape"),
    (("complex64", (1,)), "dtype"),
    ((3, (1,)), "dtype"),
    (("uint8", (1,), 1.0), "offset"),
])
def test_sub_view_arguments(ctx, args, argument):
    end = ctx.workspace.nbytes
    args = tuple(end + 1 if a == "end+1" else tuple(end + 1 if x == "end+1" else x for x in a)
                 if isinstance(a, tuple) else a for a in args)
    with pytest.raises(ConfigError) as info:
        ctx.workspace.view(*args)
    assert info.value.argument == argument


@pytest.mark.gpu
def test_empty_allocates_exactly(ctx):
    e = _empty(None, (3, 5), "int32")
    assert (e.shape, e.dtype, e.nbytes, e.offset, e.device) == ((3, 5), "int32", 60, 0, ctx.device)
    with pytest.raises(ConfigError) as info:
        _empty(None, (3, -1), "int32")
    assert info.value.argument == "shape"


# -- DLPack as a C consumer reads it ----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,code", [("float16", 2), ("bfloat16", 4), ("float32", 2)])
def test_versioned_capsule_layout(ctx, dtype, code):
    plan_small(ctx, dtype=dtype)
    k, _ = ctx.kv_cache(1)
    capsule = k.__dlpack__(stream=-1, max_version=(1, 2))
    assert capsule_name(capsule) == "dltensor_versioned"
    managed, t, shape, strides = read(capsule)
    assert (managed.version.major, managed.version.minor, managed.flags) == (1, 0, 0)
    assert t.data == k.ptr and t.byte_offset == 0
    assert (t.device.device_type, t.device.device_id) == (2, ctx.device)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (code, 8 * k.itemsize, 1)
    assert shape == list(KV_SHAPE) and strides == [2 * 64 * 64, 64 * 64, 64, 1]
    assert managed.deleter and managed.manager_ctx


@pytest.mark.gpu
def test_legacy_capsule_layout(ctx):
    k, _ = ctx.kv_cache(0)
    for kwargs in ({}, {"max_version": None}, {"max_version": (0, 8)}):
        capsule = k.__dlpack__(stream=-1, **kwargs)
        assert capsule_name(capsule) == "dltensor"
        managed, t, shape, strides = read(capsule)
        assert t.data == k.ptr and shape == list(KV_SHAPE) and strides == list(k.strides)
        assert (t.dtype.code, t.dtype.bits) == (2, 16) and managed.deleter


@pytest.mark.gpu
def test_capsule_keeps_the_memory_alive(ctx):
    k, v = ctx.kv_cache(0)
    capsule = k.__dlpack__(max_version=(1, 0))
    ptr = k.ptr
    del k, v
    gc.collect()
    assert ctx.views_alive == 1  # the capsule's view
    _, t, _, _ = read(capsule)
    assert t.data == ptr
    del capsule, t
    gc.collect()
    assert ctx.views_alive == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs,error,argument", [
    (dict(stream=0), ConfigError, "stream"),
    (dict(stream=-2), ConfigError, "stream"),
    (dict(stream="1"), ConfigError, "stream"),
    (dict(stream=True), ConfigError, "stream"),
    (dict(copy="no"), ConfigError, "copy"),
    (dict(max_version="1.0"), TypeError, None),
    (dict(dl_device=(4, 0)), BufferError, None),
    (dict(dl_device=(2, 99)), BufferError, None),
    (dict(dl_device="cpu"), BufferError, None),
    (dict(dl_device=(1, 0), copy=False), BufferError, None),
])
def test_dlpack_arguments(ctx, kwargs, error, argument):
    k, v = ctx.kv_cache(0)
    gc.collect()
    before = ctx.views_alive  # k and v themselves
    with pytest.raises(error) as info:
        k.__dlpack__(**kwargs)
    if argument:
        assert info.value.argument == argument
    gc.collect()
    assert ctx.views_alive == before  # nothing leaked by the failed export
    del k, v
    gc.collect()
    assert ctx.views_alive == 0


@pytest.mark.gpu
def test_dlpack_streams_accepted(ctx):
    k, _ = ctx.kv_cache(0)
    from inferctx.context import Stream

    other = Stream()
    for stream in (None, 1, 2, -1, other.handle, ctx.stream.handle):
        assert capsule_name(k.__dlpack__(stream=stream)) == "dltensor"
    other.synchronize()


@pytest.mark.gpu
def test_host_copy_through_numpy(ctx):
    k, _ = ctx.kv_cache(3)
    values = np.arange(k.size, dtype=np.float16).reshape(KV_SHAPE)
    fill(k, values)
    got = np.from_dlpack(k, device="cpu")
    assert got.shape == KV_SHAPE and got.dtype == np.float16
    assert np.array_equal(got, values)
    got[0, 0, 0, 0] = 99  # a copy: the view is unchanged
    assert host(k, np.float16)[0] == values.ravel()[0]
    assert np.array_equal(np.from_dlpack(k, device="cpu", copy=True), values)
    with pytest.raises(BufferError):
        np.from_dlpack(k, device="cpu", copy=False)
    with pytest.raises((BufferError, RuntimeError)):
        np.from_dlpack(k)  # NumPy cannot take CUDA memory, and asks for no device


@pytest.mark.gpu
def test_host_copy_capsule_is_flagged_copied(ctx):
    k, _ = ctx.kv_cache(0)
    # Written first: the copy reads every byte of k (compute-sanitizer's initcheck reported the
    # copy of a never-written kv_cache), and its bytes are then k's.
    values = (np.arange(k.size, dtype=np.float16) % 2048).reshape(KV_SHAPE)
    fill(k, values)
    capsule = k.__dlpack__(dl_device=(1, 0), max_version=(1, 0))
    managed, t, shape, _ = read(capsule)
    assert managed.flags & IS_COPIED and (t.device.device_type, t.device.device_id) == (1, 0)
    assert t.data != k.ptr and shape == list(KV_SHAPE)
    assert ctypes.string_at(t.data + t.byte_offset, k.nbytes) == values.tobytes()


@pytest.mark.gpu
def test_device_copy_on_request(ctx):
    k, v = ctx.kv_cache(0)
    fill(k, np.ones(KV_SHAPE, dtype=np.float16))  # the copy reads every byte: written ones, for initcheck
    capsule = k.__dlpack__(copy=True, max_version=(1, 0))
    managed, t, shape, strides = read(capsule)
    assert managed.flags & IS_COPIED and t.device.device_type == 2 and t.data != k.ptr
    assert shape == list(KV_SHAPE) and strides == list(k.strides)
    assert ctx.views_alive == 2  # k and v: the copy has an allocation of its own


# -- the CUDA array interface -------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_array_interface(ctx):
    k, _ = ctx.kv_cache(1)
    assert k.__cuda_array_interface__ == {
        "shape": KV_SHAPE, "typestr": "<f2", "data": (k.ptr, False), "version": 3,
        "strides": None, "stream": ctx.stream.handle,
    }
    assert ctx.workspace.view("uint8", (0,)).__cuda_array_interface__["data"] == (0, False)
    plan_small(ctx, dtype="bfloat16")
    with pytest.raises(TypeError, match="DLPack"):
        ctx.kv_cache(0)[0].__cuda_array_interface__
    # ... and an AttributeError too: hasattr answers False (Numba's is_cuda_array, CuPy's and
    # JAX's first check), so that they take DLPack instead of failing.
    bf16 = ctx.kv_cache(0)[0]
    assert not hasattr(bf16, "__cuda_array_interface__")
    try:
        from numba import cuda as numba_cuda
    except ImportError:
        numba_cuda = None
    if numba_cuda is not None:
        assert not numba_cuda.is_cuda_array(bf16)
    del bf16
    plan_small(ctx)


# -- host access is refused, with directions --------------------------------------------------

@pytest.mark.gpu
def test_buffer_protocol_refused_with_directions(ctx):
    k, _ = ctx.kv_cache(0)
    with pytest.raises(BufferError, match="from_dlpack"):
        memoryview(k)
    with pytest.raises(TypeError, match="copy_to_host"):
        np.asarray(k)
    with pytest.raises((BufferError, TypeError), match="from_dlpack"):
        np.frombuffer(k, dtype=np.uint8)

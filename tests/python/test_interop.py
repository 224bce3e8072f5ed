"""Zero-copy exchange with PyTorch, CuPy and JAX (DLPack and the CUDA array interface), the
stream handshakes, lifetimes, and what the kernels take (CudaArray)."""

from __future__ import annotations

import ctypes
import gc
import os
import pickle

import dlpack_ctypes as dlpack
import pytest
from gpu_context import KV_SHAPE, ctx, pinned_of, plan_small  # noqa: F401 (fixture)

from inferctx import ConfigError, WorkspaceInUseError
from inferctx import _core
from inferctx.context import Stream

# JAX takes most of the GPU's memory on its first use unless told not to.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

np = pytest.importorskip("numpy")


# -- without a GPU: what is not CUDA memory is refused by name ------------------------------

def test_numpy_array_is_refused_naming_the_argument():
    with pytest.raises(ConfigError) as info:
        _core._as_cuda_array(np.zeros(3), "x")
    e = info.value
    assert e.argument == "x" and "numpy.ndarray" in str(e) and "CPU" in str(e)
    assert str(e).startswith("x must be a CUDA array (DLPack or __cuda_array_interface__)")
    clone = pickle.loads(pickle.dumps(e))
    assert type(clone) is ConfigError and clone.argument == "x" and str(clone) == str(e)


def test_objects_without_a_protocol_are_refused():
    with pytest.raises(ConfigError, match="a list with neither") as info:
        _core._as_cuda_array([1.0, 2.0], "weights")
    assert info.value.argument == "weights"


def test_pinned_host_dlpack_is_refused():
    class Pinned:
        def __dlpack_device__(self):
            return (3, 0)

        def __dlpack__(self, **kwargs):
            raise AssertionError("not to be called for host memory")

    with pytest.raises(ConfigError, match="kDLCUDAHost") as info:
        _core._as_cuda_array(Pinned(), "y")
    assert info.value.argument == "y"


def test_argument_name_must_be_a_str():
    with pytest.raises(ConfigError) as info:
        _core._as_cuda_array(np.zeros(3), 3)
    assert info.value.argument == "argument"


class CtypesProducer:
    """A DLPack producer written with ctypes that claims CUDA memory (the pointer is never
    dereferenced), to check on any machine how a capsule is read, consumed and released."""

    _capsule_new = ctypes.pythonapi.PyCapsule_New
    _capsule_new.restype = ctypes.py_object
    _capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    _deleter_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    def __init__(self, versioned, with_strides):
        self.versioned = versioned
        self.shape = (ctypes.c_int64 * 2)(3, 4)
        self.strides = (ctypes.c_int64 * 2)(1, 3)  # column-major
        self.deleted = []
        self.deleter = self._deleter_type(self.deleted.append)
        self.managed = (dlpack.DLManagedTensorVersioned if versioned else dlpack.DLManagedTensor)()
        if versioned:
            self.managed.version.major, self.managed.version.minor = 1, 3
            self.managed.flags = dlpack.READ_ONLY
        t = self.managed.dl_tensor
        t.data, t.byte_offset, t.ndim = 0x7F0000001000, 64, 2
        t.device.device_type, t.device.device_id = 2, 0
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 4, 16, 1  # bfloat16
        t.shape = self.shape
        t.strides = self.strides if with_strides else None
        self.managed.deleter = ctypes.cast(self.deleter, ctypes.c_void_p).value
        self.calls = []

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None, max_version=None):
        self.calls.append((stream, max_version))
        name = b"dltensor_versioned" if self.versioned else b"dltensor"
        self.capsule = self._capsule_new(ctypes.addressof(self.managed), name, None)
        return self.capsule


@pytest.mark.parametrize("versioned,with_strides", [(True, True), (False, False)])
def test_dlpack_import_reads_consumes_and_releases(versioned, with_strides):
    producer = CtypesProducer(versioned, with_strides)
    a = _core._as_cuda_array(producer, "x")  # no stream: nothing touches CUDA
    assert producer.calls == [(-1, (1, 0))]
    assert dlpack.capsule_name(producer.capsule) == (
        "used_dltensor_versioned" if versioned else "used_dltensor")
    assert (a.ptr, a.shape, a.dtype, a.itemsize, a.device) == (0x7F0000001040, (3, 4), "bfloat16", 2, 0)
    assert a.strides == ((1, 3) if with_strides else (4, 1))
    assert a.contiguous is not with_strides and a.read_only is versioned and a.nbytes == 24
    assert producer.deleted == []
    del a
    gc.collect()
    assert producer.deleted == [ctypes.addressof(producer.managed)]


@pytest.mark.parametrize("shape,nbytes", [((2**62 + 1, 4), None), ((2**61, 2), None), ((2**62, 1), None),
                                          ((-3, 4), None), ((2**62 + 1, 0), 0), ((2**61, 1), 2**62),
                                          ((0, 2**62), None), ((0, 2**61), 0)])
def test_dlpack_shape_whose_bytes_pass_int64_is_refused(shape, nbytes):
    """bfloat16 items: (2**62 + 1) * 4 wraps to 4 elements in int64; 2**61 * 2 elements are 2**63
    bytes. A zero size makes the sizes before it harmless (their strides are 0); 2**62 bytes still
    count, and so do the sizes after a 0: (0, 2**62) has a first stride of 2**63 bytes."""
    producer = CtypesProducer(True, False)
    producer.shape[0], producer.shape[1] = shape
    if nbytes is None:
        with pytest.raises(ConfigError) as info:
            _core._as_cuda_array(producer, "w")
        assert info.value.argument == "w" and str(shape).replace(" ", "") in str(info.value).replace(" ", "")
    else:
        assert _core._as_cuda_array(producer, "w").nbytes == nbytes


def test_cuda_array_interface_shape_whose_bytes_pass_int64_is_refused():
    class Liar:  # a null pointer: refused for its shape before anything asks CUDA about it
        __cuda_array_interface__ = {"shape": (2**62 + 1, 4), "typestr": "<f4", "data": (0, False),
                                    "version": 3}

    with pytest.raises(ConfigError, match=r"more than 2\*\*63 - 1 bytes") as info:
        _core._as_cuda_array(Liar(), "x")
    assert info.value.argument == "x"


@pytest.mark.parametrize("stream_value", [0, -1, 2**64, 2**70, True, 1.0, "1"])
def test_cuda_array_interface_stream_outside_the_interface_is_named_before_any_device(stream_value):
    """A producer 'stream' the interface does not allow is named, as ConfigError on the
    argument, before anything asks CUDA about the pointer (so on any machine)."""
    class Producer:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                    "version": 3, "stream": stream_value}

    with pytest.raises(ConfigError, match=r"'stream' is .*; the interface allows None, 1, 2 or a "
                                          r"stream handle \(an int in \[3, 2\*\*64\)\)") as info:
        _core._as_cuda_array(Producer(), "x", 7)
    assert info.value.argument == "x"


@pytest.mark.parametrize("version", ["3", 3.0, None, True])
def test_cuda_array_interface_version_that_is_no_int_is_named_before_any_device(version):
    class Producer:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False),
                                    "version": version}

    with pytest.raises(ConfigError, match=r"'version' is .*, not an int") as info:
        _core._as_cuda_array(Producer(), "x")
    assert info.value.argument == "x"


@pytest.mark.parametrize("typestr", [">f4", ">f2", ">i4"])
def test_cuda_array_interface_big_endian_items_of_more_than_a_byte_are_refused(typestr):
    class Producer:
        __cuda_array_interface__ = {"shape": (4,), "typestr": typestr, "data": (0, False), "version": 3}

    with pytest.raises(ConfigError, match="is not one inferctx handles") as info:
        _core._as_cuda_array(Producer(), "x")
    assert info.value.argument == "x"


def test_a_typestr_refusal_lists_the_typestrs_there_are_and_sends_bfloat16_to_dlpack():
    class Producer:  # ml_dtypes' bfloat16 has the typestr '<V2': the interface has none for it
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<V2", "data": (0, False), "version": 3}

    with pytest.raises(ConfigError) as info:
        _core._as_cuda_array(Producer(), "x")
    message = str(info.value)
    listed = message[message.index("(little-endian ") + len("(little-endian "):message.index(";")]
    assert "bfloat16" not in listed.split(", ") and {"float32", "float16", "uint8"} <= set(listed.split(", "))
    assert message.endswith("; bfloat16 has no typestr: pass it by DLPack)")


@pytest.mark.parametrize("argument, remedy", [
    ("grad", "Put it on the GPU first, e.g. torch.as_tensor(grad, device='cuda') or cupy.asarray(grad)"),
    ("mask", "Put it on the GPU first, e.g. torch.as_tensor(mask, device='cuda') or cupy.asarray(mask)"),
    ("out", "Pass a CUDA array, or no out= for a new result"),
    ("mask_out", "Pass a CUDA array, or no mask_out= for a new result")])
def test_a_host_array_is_told_the_remedy_in_its_own_keywords_terms(argument, remedy):
    # The remedy named x whatever the argument, and told an output to move to the GPU, which
    # makes a copy that the call would write instead.
    with pytest.raises(ConfigError) as info:
        _core._as_cuda_array(np.zeros(3), argument)
    assert info.value.argument == argument and str(info.value).endswith(remedy), str(info.value)


@pytest.mark.parametrize("mask", [["bits"], {}, {"bits": 2}, 2, b"bits"])
def test_dropout_mask_that_is_no_mask_name_is_refused_naming_mask(mask):
    """Checked before the operand is read, so on any machine; a list or dict is unhashable and
    once made a TypeError of the lookup."""
    import inferctx

    with pytest.raises(ConfigError) as info:
        inferctx.dropout(CtypesProducer(True, False), 0.5, mask=mask)
    assert info.value.argument == "mask" and "'bits' (default), 'bytes' or None" in str(info.value)


def _kernel_calls():
    import inferctx

    return {
        "dropout": lambda x, **kw: inferctx.dropout(x, 0.5, **kw),
        "apply_mask": lambda x, **kw: inferctx.apply_mask(x, x, 0.5, **kw),
        "gemm": lambda x, **kw: inferctx.gemm(x, x, **kw),
        "bmm": lambda x, **kw: inferctx.bmm(x, x, **kw),
    }


@pytest.mark.parametrize("kernel", ["dropout", "apply_mask", "gemm", "bmm"])
@pytest.mark.parametrize("keyword,value", [("ctx", "cuda:0"), ("ctx", 0), ("stream", object()),
                                           ("stream", -1), ("stream", 2**64), ("stream", True),
                                           ("stream", 1 << 20000)],
                         ids=["ctx-str", "ctx-int", "stream-object", "stream-negative",
                              "stream-2**64", "stream-bool", "stream-20001-bits"])
def test_arguments_a_kernel_can_check_without_a_device_are_named_before_one(kernel, keyword, value):
    """A ctx that is no InferenceContext, or a stream= that is no stream, is the caller's error
    whatever the operands are: it is named before their device is looked up, so on a machine
    without a GPU it is a ConfigError on that keyword, not NoCudaDeviceError."""
    x = CtypesProducer(True, False)  # says it is CUDA memory of device 0
    with pytest.raises(ConfigError) as info:
        _kernel_calls()[kernel](x, **{keyword: value})
    assert info.value.argument == keyword
    assert x.calls == []  # the operand was not imported


@pytest.mark.parametrize("seed,offset,argument", [(-1, 0, "seed"), (0, 2**64, "offset"),
                                                  (1.5, 0, "seed"), (0, "4", "offset"),
                                                  (True, 0, "seed"), (0, None, "offset")])
def test_dropout_seed_and_offset_are_named_before_any_device(seed, offset, argument):
    import inferctx

    x = CtypesProducer(True, False)
    with pytest.raises(ConfigError) as info:
        inferctx.dropout(x, 0.5, seed=seed, offset=offset)
    assert info.value.argument == argument
    assert x.calls == []


def test_integers_too_long_to_print_are_described_by_their_size():
    """str() of an int past 4300 digits raises ValueError; a message naming one must not."""
    import inferctx

    huge = 1 << 20000  # 20001 bits, 6021 digits
    x = CtypesProducer(True, False)
    checks = [
        ("p", lambda: inferctx.dropout(x, huge)),
        ("seed", lambda: inferctx.dropout(x, 0.5, seed=huge, offset=0)),
        ("offset", lambda: inferctx.dropout(x, 0.5, seed=0, offset=-huge)),
        ("stream", lambda: inferctx.dropout(x, 0.5, stream=huge)),
        ("device", lambda: inferctx.InferenceContext.instance(huge)),
    ]
    for argument, call in checks:
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == argument
        assert "an integer of 20001 bits" in str(info.value), str(info.value)


@pytest.mark.parametrize("device", [(2, 1 << 31), (1 << 31, 0), (2, -(1 << 31) - 1), (2, 1 << 20000)],
                         ids=["id-2**31", "type-2**31", "id-below-int32", "id-20001-bits"])
def test_a_dlpack_device_outside_32_bits_is_named(device):
    """DLDevice holds two int32_t: a __dlpack_device__ past that range is no device, named as
    ConfigError on the argument (it was an OverflowError from the conversion to C int)."""
    class Producer:
        def __dlpack_device__(self):
            return device

        def __dlpack__(self, **kwargs):
            raise AssertionError("not to be called for a device that does not exist")

    with pytest.raises(ConfigError, match=r"tuple of two 32-bit ints") as info:
        _core._as_cuda_array(Producer(), "x")
    assert info.value.argument == "x"
    import inferctx

    with pytest.raises(ConfigError, match=r"tuple of two 32-bit ints") as info:
        inferctx.gemm(Producer(), Producer())
    assert info.value.argument == "a"


# -- DeviceView as a CudaArray ----------------------------------------------------------------

@pytest.mark.gpu
def test_device_view_fast_path(ctx):
    k, _ = ctx.kv_cache(0)
    a = _core._as_cuda_array(k, "x", ctx.stream)
    assert (a.ptr, a.shape, a.dtype, a.itemsize, a.device) == (k.ptr, KV_SHAPE, "float16", 2, ctx.device)
    assert a.strides == k.strides and a.contiguous and not a.read_only
    assert a.owner is k and a.nbytes == k.nbytes and a.size == k.size and a.ndim == 4


@pytest.mark.gpu
def test_cuda_array_interface_only_objects(ctx):
    cupy = pytest.importorskip("cupy")
    base = cupy.arange(24, dtype=cupy.int32).reshape(4, 6)
    strided = base[:, ::2]

    class OnlyCAI:
        def __init__(self, arr):
            self.arr = arr
            self.__cuda_array_interface__ = arr.__cuda_array_interface__

    a = _core._as_cuda_array(OnlyCAI(strided), "x", ctx.stream)
    assert a.ptr == strided.data.ptr and a.shape == (4, 3) and a.dtype == "int32"
    assert a.strides == (6, 2) and not a.contiguous and a.device == ctx.device
    host_memory = np.zeros(4)
    host_only = OnlyCAI(base)
    host_only.__cuda_array_interface__ = dict(base.__cuda_array_interface__,
                                              data=(host_memory.ctypes.data, False))
    with pytest.raises(ConfigError, match="not device memory"):
        _core._as_cuda_array(host_only, "x")


@pytest.mark.gpu
def test_cuda_array_interface_byte_order_and_strides_that_address_nothing(ctx):
    """One-byte items read the same in either byte order, so '>u1' and '>b1' are taken; a
    stride on a dimension of size 1, or of an empty array, addresses no element, so one that is
    not a multiple of the item size is taken there (and refused where it steps between items)."""
    torch = pytest.importorskip("torch")

    class Producer:
        def __init__(self, tensor, **changes):
            self.tensor = tensor  # keeps the memory alive
            self.__cuda_array_interface__ = dict(tensor.__cuda_array_interface__, **changes)

    for dtype, typestr, name in ((torch.uint8, ">u1", "uint8"), (torch.int8, ">i1", "int8"),
                                 (torch.bool, ">b1", "bool")):
        t = torch.zeros(6, dtype=dtype, device="cuda:0")
        a = _core._as_cuda_array(Producer(t, typestr=typestr), "x")
        assert (a.ptr, a.shape, a.dtype) == (t.data_ptr(), (6,), name)
    t = torch.zeros((3, 4), dtype=torch.float32, device="cuda:0")
    row = t[1:2]  # (1, 4)
    a = _core._as_cuda_array(Producer(row, strides=(6, 4)), "x")  # 6 bytes on the size-1 dimension
    assert (a.ptr, a.shape, a.strides[1], a.contiguous) == (row.data_ptr(), (1, 4), 1, True)
    empty = t[:0]
    a = _core._as_cuda_array(Producer(empty, strides=(6, 2)), "x")
    assert a.shape == (0, 4) and a.size == 0
    with pytest.raises(ConfigError, match=r"strides \(6, 4\) \(bytes\) are not multiples of the "
                                          r"4-byte items") as info:
        _core._as_cuda_array(Producer(t[:2], strides=(6, 4)), "x")
    assert info.value.argument == "x"


class TorchMemoryProducer:
    """A DLPack producer (ctypes) over a torch tensor's memory, as a library exports its own
    arrays; its deleter records what had been written through the pointer when it ran."""

    def __init__(self, torch, tensor):
        self.tensor = tensor
        self.shape = (ctypes.c_int64 * 1)(tensor.numel())
        self.seen_at_release = []

        def deleter(_):
            torch.cuda.synchronize()  # the work queued by then, done
            self.seen_at_release.append(tensor.clone())

        self.deleter = CtypesProducer._deleter_type(deleter)
        self.managed = dlpack.DLManagedTensor()
        t = self.managed.dl_tensor
        t.data, t.byte_offset, t.ndim = tensor.data_ptr(), 0, 1
        t.device.device_type, t.device.device_id = 2, tensor.device.index
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, 32, 1  # float32
        t.shape, t.strides = self.shape, None
        self.managed.deleter = ctypes.cast(self.deleter, ctypes.c_void_p).value

    def __dlpack_device__(self):
        return (2, self.tensor.device.index)

    def __dlpack__(self, stream=None, max_version=None):
        self.capsule = CtypesProducer._capsule_new(ctypes.addressof(self.managed), b"dltensor", None)
        return self.capsule


@pytest.mark.gpu
def test_an_out_given_through_dlpack_is_held_until_its_kernel_is_queued(torch):
    # The deleter says the consumer is done with the memory: a producer may free it then. So it
    # must come after dropout's and apply_mask's kernels are queued on the out= pointer, not when
    # the pointer has been read.
    import inferctx

    n = 4096
    x = torch.full((n,), 3.0, device="cuda")
    bits = torch.empty(n // 32, dtype=torch.int32, device="cuda")
    for call in (lambda out: inferctx.dropout(x, 0.5, out=out, mask_out=bits),
                 lambda out: inferctx.apply_mask(x, bits, 0.5, out=out)):
        y = torch.full((n,), float("nan"), device="cuda")  # nothing written yet
        producer = TorchMemoryProducer(torch, y)
        torch.cuda.synchronize()
        call(producer)
        gc.collect()
        assert len(producer.seen_at_release) == 1
        seen = producer.seen_at_release[0]
        assert not torch.isnan(seen).any()  # written by the kernel before the memory was let go
        assert bool(((seen == 0) | (seen == 6.0)).all())  # dropped, or 3 / (1 - 0.5)


# -- PyTorch ----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_torch_round_trip_same_memory(ctx):
    torch = pytest.importorskip("torch")
    k, _ = ctx.kv_cache(1)
    t = torch.from_dlpack(k)
    assert t.data_ptr() == k.ptr and tuple(t.shape) == KV_SHAPE and t.dtype == torch.float16
    assert t.stride() == k.strides and t.device.index == ctx.device
    t.fill_(3.0)  # written by torch, read by us once torch's stream is done
    torch.cuda.current_stream().synchronize()
    assert np.all(np.from_dlpack(k, device="cpu") == 3.0)
    values = np.arange(k.size, dtype=np.float16).reshape(KV_SHAPE)
    buf = pinned_of(values)
    k.copy_from_host(buf)  # written by us (compute stream), read by torch (its stream)
    t2 = torch.from_dlpack(k)  # the export makes torch's stream wait for the copy
    assert t2.data_ptr() == t.data_ptr()
    assert torch.equal(t2.cpu(), torch.from_numpy(values))


@pytest.mark.gpu
def test_torch_bfloat16_and_dtypes(ctx):
    torch = pytest.importorskip("torch")
    plan_small(ctx, dtype="bfloat16")
    k, _ = ctx.kv_cache(0)
    assert torch.from_dlpack(k).dtype == torch.bfloat16
    for dtype, name in ((torch.float32, "float32"), (torch.uint8, "uint8"),
                        (torch.int32, "int32"), (torch.bfloat16, "bfloat16")):
        x = torch.ones(5, 7, dtype=dtype, device="cuda")
        a = _core._as_cuda_array(x, "x", ctx.stream)
        assert (a.ptr, a.shape, a.dtype, a.strides) == (x.data_ptr(), (5, 7), name, (7, 1))
        view = ctx.workspace.view(dtype, (5, 7))
        assert view.dtype == name


@pytest.mark.gpu
def test_torch_tensors_to_cuda_array(ctx):
    torch = pytest.importorskip("torch")
    x = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    a = _core._as_cuda_array(x.t(), "x", ctx.stream)
    assert a.ptr == x.data_ptr() and a.shape == (4, 3) and a.strides == (1, 4)
    assert not a.contiguous and not a.read_only and a.owner is not None
    b = _core._as_cuda_array(x[1:], "x", ctx.stream)
    assert b.ptr == x.data_ptr() + 16 and b.contiguous
    del x, a, b
    gc.collect()  # the consumed capsules' deleters ran without error
    with pytest.raises(ConfigError, match="torch.Tensor on the CPU") as info:
        _core._as_cuda_array(torch.zeros(3), "bias", ctx.stream)
    assert info.value.argument == "bias"


@pytest.mark.gpu
def test_torch_consumer_stream_is_honoured(ctx):
    torch = pytest.importorskip("torch")
    k, _ = ctx.kv_cache(0)
    t = torch.from_dlpack(k)
    t.zero_()
    torch.cuda.synchronize()
    # ctx.stream follows torch's current stream unless pinned; pinned, it is the producer of
    # every export, also inside the consumer's `with torch.cuda.stream(side)` below.
    compute = torch.cuda.Stream()
    ctx.use_stream(compute)
    with torch.cuda.stream(compute):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time, then the write
        t.fill_(5.0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        seen = torch.from_dlpack(k).clone()  # __dlpack__(stream=side): side waits for compute
    side.synchronize()
    assert float(seen.min()) == 5.0


@pytest.mark.gpu
def test_torch_tensor_outlives_release_and_the_context(ctx):
    torch = pytest.importorskip("torch")
    plan_small(ctx, batch_size=8)
    gc.collect()
    # Views other tests of this process still hold (under CUDA virtual memory the allocation,
    # and with it their count, outlives a plan): this test counts its own beside them.
    others = ctx.views_alive
    k, v = ctx.kv_cache(0)
    t = torch.from_dlpack(k)
    del k, v
    gc.collect()
    if ctx.addresses_stable:
        # CUDA virtual memory: a release with views alive keeps their addresses; after the
        # retake t is the workspace again.
        ctx.release_workspace()
        assert ctx.released and ctx.views_alive == others + 1  # and the view inside t's capsule
        assert ctx.retake_workspace()
        k, _ = ctx.kv_cache(0)
        assert k.ptr == t.data_ptr()
        t.fill_(3.0)
        torch.cuda.synchronize()
        assert float(torch.from_dlpack(k).float().sum()) == 3.0 * t.numel()
        return
    with pytest.raises(WorkspaceInUseError) as info:
        ctx.release_workspace()
    assert info.value.views_alive == others + 1  # and the view inside t's capsule
    ctx.release_workspace(force=True)
    assert ctx.views_alive == 0 and ctx.released
    assert ctx.retake_workspace()  # a new allocation: the old one lives on in t
    fresh, _ = ctx.kv_cache(0)
    assert not (fresh.ptr <= t.data_ptr() < fresh.ptr + fresh.nbytes)
    torch.from_dlpack(fresh).zero_()
    t.fill_(7.0)
    torch.cuda.synchronize()
    assert float(t.float().sum()) == 7.0 * t.numel()
    assert float(torch.from_dlpack(fresh).float().abs().sum()) == 0.0


# -- CuPy -------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cupy_dlpack_and_cai_same_memory(ctx):
    cupy = pytest.importorskip("cupy")
    k, _ = ctx.kv_cache(2)
    a = cupy.from_dlpack(k)
    assert a.data.ptr == k.ptr and a.shape == KV_SHAPE and a.dtype == cupy.float16
    b = cupy.asarray(k)  # through __cuda_array_interface__
    assert b.data.ptr == k.ptr and b.shape == KV_SHAPE
    a.fill(2.0)
    cupy.cuda.get_current_stream().synchronize()
    assert np.all(np.from_dlpack(k, device="cpu") == 2.0)
    values = np.full(KV_SHAPE, 4.0, dtype=np.float16)
    k.copy_from_host(pinned_of(values))
    assert bool((cupy.from_dlpack(k) == 4.0).all())
    c = _core._as_cuda_array(b, "x", ctx.stream)
    assert c.ptr == k.ptr and c.shape == KV_SHAPE and c.dtype == "float16"


@pytest.mark.gpu
def test_cupy_cannot_take_bfloat16_by_cai(ctx):
    cupy = pytest.importorskip("cupy")
    plan_small(ctx, dtype="bfloat16")
    k, _ = ctx.kv_cache(0)
    # The interface's refusal is an AttributeError too, so CuPy falls back to the buffer
    # protocol, whose TypeError names the DLPack routes (cupy.from_dlpack among them).
    with pytest.raises(TypeError, match="(?i)dlpack"):
        cupy.asarray(k)


@pytest.mark.gpu
def test_a_bfloat16_result_in_cupy_is_refused_naming_out(ctx):
    """A call whose results are CuPy arrays (its first array-library operand is CuPy's) on
    bfloat16 operands: CuPy has no bfloat16, and cupy.empty's bare TypeError came through. A
    ConfigError names out= now, and nothing is left pending: the call with out= works."""
    import inferctx
    cupy = pytest.importorskip("cupy")
    x = ctx.activations.view("bfloat16", (4096,))
    words = cupy.zeros(128, dtype=cupy.uint32)  # 4096 bits, none kept
    for call in (lambda: inferctx.dropout(x, 0.5, mask_out=words),
                 lambda: inferctx.apply_mask(x, words, 0.5)):
        with pytest.raises(ConfigError, match="CuPy has no bfloat16; pass out= a torch tensor or a "
                                              "DeviceView") as refused:
            call()
        assert refused.value.argument == "out"
    y = ctx.activations.view("bfloat16", (4096,), offset=8192)
    y.view("uint16").copy_from_host(pinned_of(np.full(4096, 0x3F80, dtype=np.uint16)))  # 1.0
    inferctx.apply_mask(x, words, 0.5, out=y)
    assert not cupy.asarray(y.view("uint16")).any()  # CuPy's stream: the call's, no synchronize


# -- JAX --------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_jax_round_trip(ctx):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    plan_small(ctx, dtype="float32")
    k, _ = ctx.kv_cache(0)
    values = np.arange(k.size, dtype=np.float32).reshape(KV_SHAPE)
    k.copy_from_host(pinned_of(values))
    j = jax.dlpack.from_dlpack(k)
    assert j.unsafe_buffer_pointer() == k.ptr and j.shape == KV_SHAPE and j.dtype == jnp.float32
    assert np.array_equal(np.asarray(j), values)
    # Under compute-sanitizer a jax.numpy call keeps its callers' frames alive (JAX's doing):
    # the workspace's view and its JAX array go before one, or later tests would see them alive.
    del j, k
    x = jnp.arange(16, dtype=jnp.float32).reshape(4, 4) + 1
    a = _core._as_cuda_array(x, "x", ctx.stream)
    assert a.ptr == x.unsafe_buffer_pointer() and a.shape == (4, 4) and a.dtype == "float32"


@pytest.mark.gpu
def test_dlpack_import_stream_argument(ctx):
    """The stream the kernel runs on is what __dlpack__ receives."""
    received = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __dlpack_device__(self):
            return self.inner.__dlpack_device__()

        def __dlpack__(self, stream=None, max_version=None, **kwargs):
            received.append((stream, max_version))
            return self.inner.__dlpack__(stream=stream, max_version=max_version, **kwargs)

    k, _ = ctx.kv_cache(0)
    s = Stream()
    a = _core._as_cuda_array(Spy(k), "x", s)
    assert received == [(s.handle, (1, 0))] and a.ptr == k.ptr
    assert type(a.owner).__name__ == "_DLPackImport"
    _core._as_cuda_array(Spy(k), "x")
    assert received[-1] == (-1, (1, 0))  # no stream: the producer does not synchronise
    del a
    gc.collect()
    s.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2**63,), (2**64 + 1, 1), (2**62, 4), (3, 2**63 - 1), (0, 2**62, 4)])
def test_new_view_of_a_shape_past_int64_is_refused_naming_shape(ctx, shape):
    """A size past int64 itself, and sizes whose float32 bytes pass it (2**62 * 4 * 4 bytes,
    3 * (2**63 - 1) elements), or whose strides would (no bytes, but a first stride of 2**64
    bytes): ConfigError, not OverflowError, and nothing allocated; the same from view()."""
    before = ctx.memory_pool.allocations
    with pytest.raises(ConfigError) as info:
        _core._empty(ctx.device, shape, "float32")
    assert info.value.argument == "shape"
    assert ctx.memory_pool.allocations == before
    with pytest.raises(ConfigError) as info:
        ctx.workspace.view("float32", shape)
    assert info.value.argument == "shape"

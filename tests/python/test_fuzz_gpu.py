"""Generated hostile inputs over the GPU surface (issue 16, "Fuzzing the GPU surface").

Entry points: the InferenceContext methods, DeviceView and its DLPack / CUDA-array-interface
exports, PinnedBuffer, dropout, apply_mask, gemm, bmm and autotune_gemm. Inputs: wrong types,
negative / zero / huge numbers, NaN and inf, mismatched dtypes, devices and shapes,
non-contiguous, overlapping, zero-sized and misaligned operands, and objects whose protocols
raise or lie.

The contract checked for every case: the call returns a correct result (values checked against
torch / NumPy), or raises an error the entry point documents (the inferctx errors; BufferError
and TypeError only where the code documents them, see ALLOWED below; an exception that a
hostile object's own protocol raised may pass through unchanged), never anything else; after
the case a valid call succeeds (no CUDA error left pending); at the end of each test the free
device memory and the context's pool are back within a few MiB of the start.

Cases per test: INFERCTX_FUZZ_EXAMPLES (default 200; the issue's figure is 10000 on the H200), and
for autotune_gemm a tenth of that unless INFERCTX_FUZZ_SLOW_EXAMPLES says otherwise.
Runs are reproducible (derandomize). The first part runs on any machine (what is refused before
a device is read, and NoCudaDeviceError where one would be); the rest is marked ``gpu``.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import inferctx
import philox_reference as ref
from dlpack_ctypes import IS_COPIED, capsule_name, read
from gpu_context import SHAPE, ctx, live_views_report, plan_small, settled_free_memory  # noqa: F401 (fixture)
from inferctx import (ConfigError, CudaError, NoCudaDeviceError, TokenLimitError, WorkspaceOOMError,
                      WorkspaceStateError)

gm = importlib.import_module("inferctx.gemm")

EXAMPLES = int(os.environ.get("INFERCTX_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# The slow entry point (every valid case times cuBLASLt candidates) gets a tenth, unless
# INFERCTX_FUZZ_SLOW_EXAMPLES asks for a count of its own.
SLOW_EXAMPLES = int(os.environ.get("INFERCTX_FUZZ_SLOW_EXAMPLES", max(10, EXAMPLES // 10)))
FUZZ_SLOW = settings(FUZZ, max_examples=SLOW_EXAMPLES)

MIB = 1 << 20
LEAK_TOLERANCE = 4 * MIB  # a VMM granule (2 MiB) of rounding on either measurement

KERNEL_DTYPES = ("float32", "float16", "bfloat16")


class ProducerError(Exception):
    """What the hostile objects' own protocols raise; it may reach the caller unchanged (inferctx
    cannot know better than the producer what went wrong in it)."""


def from_producer(exc):
    """exc, marked as raised by a hostile object's own protocol (any type may pass through)."""
    exc.from_producer = True
    return exc


# What each entry point documents (README "Bad arguments raise inferctx.ConfigError naming the
# keyword"; the docstrings in pyx/ and python/inferctx/):
#   kernels: ConfigError; WorkspaceStateError for operands in a released workspace
#     (release_workspace's docstring); NoCudaDeviceError where a device is needed and none is.
#   DeviceView.__dlpack__: ConfigError (stream, copy), BufferError (dl_device / copy, the DLPack
#     specification's error, named in the docstring), TypeError for a max_version that is not a
#     (major, minor) tuple (the specification's argument type; test_views checks it),
#     WorkspaceStateError while released.
#   DeviceView.__cuda_array_interface__: TypeError for bfloat16 only (no typestr exists),
#     WorkspaceStateError while released.
#   PinnedBuffer(n): ConfigError; CudaError when page-locked memory cannot be had.
#   context methods: ConfigError, TokenLimitError (advance_tokens), WorkspaceStateError /
#     WorkspaceInUseError (no plan, released, views alive under the cudaMalloc fallback),
#     WorkspaceOOMError (gen_workspace, retake_workspace).
KERNEL_ERRORS = (ConfigError, WorkspaceStateError, NoCudaDeviceError)
DLPACK_ERRORS = (ConfigError, BufferError, WorkspaceStateError)
CONTEXT_ERRORS = (ConfigError, TokenLimitError, WorkspaceStateError, WorkspaceOOMError)


class Raised:
    """The outcome of a call that raised an allowed error."""

    def __init__(self, exc):
        self.exc = exc

    def __repr__(self):
        return f"Raised({type(self.exc).__name__}: {str(self.exc)[:200]})"


def attempt(fn, allowed, *, producer_ok=False):
    """fn()'s result, or Raised(exc) for an allowed exception; anything else fails the case."""
    try:
        return fn()
    except allowed as exc:
        if isinstance(exc, ConfigError):
            assert isinstance(exc.argument, str) and exc.argument, f"ConfigError without argument: {exc}"
            assert str(exc), "empty message"
        return Raised(exc)
    except Exception as exc:  # noqa: BLE001 - the contract is exactly this
        if producer_ok and getattr(exc, "from_producer", False):
            return Raised(exc)
        raise AssertionError(f"undocumented {type(exc).__name__} from the call: {exc!r}") from exc


def passed_through_from_producer(torch, context, out, dlpack_operand, stream):
    """Whether `out` is an error a DLPack producer raised itself, which reaches the caller
    unchanged (README); the one such case a well-behaved operand gives is torch's __dlpack__
    refusing the consumer stream 2 (CUDA's per-thread default stream) with BufferError. When
    it is, the context must still work."""
    if not (isinstance(out, Raised) and getattr(out.exc, "from_producer", False)):
        return False
    assert dlpack_operand and isinstance(out.exc, BufferError) and type(stream) is int and stream == 2, out
    healthy(torch, context)
    return True


# -- hostile objects ---------------------------------------------------------------------------

class CAI:
    """An object with only __cuda_array_interface__ (a property that may raise)."""

    def __init__(self, interface, keep=None):
        self._interface = interface
        self._keep = keep  # the memory the interface points at, kept alive

    @property
    def __cuda_array_interface__(self):
        if isinstance(self._interface, BaseException):
            raise from_producer(self._interface)
        return self._interface


class DLPackOnly:
    """An object with __dlpack__ (and __dlpack_device__ when `device` is given)."""

    def __init__(self, produce, device=None):
        self._produce = produce
        if device is not None:
            self._device = device
            self.__dlpack_device__ = self._dlpack_device

    def _dlpack_device(self):
        if isinstance(self._device, BaseException):
            raise from_producer(self._device)
        return self._device

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        if isinstance(self._produce, BaseException):
            raise from_producer(self._produce)
        try:
            return self._produce(stream=stream, max_version=max_version)
        except Exception as exc:  # the producer behind the wrapper refused (torch: stream 2)
            raise from_producer(exc)


def used_capsule():
    """A DLPack capsule that was consumed already (named used_dltensor)."""
    cap = inferctx.PinnedBuffer(0).__dlpack__()
    np.from_dlpack(type("Wrap", (), {"__dlpack__": lambda self, **k: cap,
                                    "__dlpack_device__": lambda self: (1, 0)})())
    return cap


# ================================================================================================
# Part 1: any machine (CI without a GPU). What is refused before a device is read raises
# ConfigError everywhere; what needs a device raises NoCudaDeviceError without one.
# ================================================================================================

HOST_THINGS = st.sampled_from([
    ("numpy f32", lambda: np.ones((3, 4), np.float32)),
    ("numpy f16 0-size", lambda: np.ones((0, 4), np.float16)),
    ("numpy f64 0-d", lambda: np.float64(1.0)),
    ("numpy transposed", lambda: np.ones((4, 3), np.float32).T),
    ("list", lambda: [1.0, 2.0]),
    ("None", lambda: None),
    ("int", lambda: 7),
    ("str", lambda: "x"),
    ("bytes", lambda: b"\x00" * 16),
    ("object", object),
    ("host DLPack only", lambda: DLPackOnly(lambda stream, max_version: np.ones(4, np.float32).__dlpack__())),
    ("DLPack device CPU", lambda: DLPackOnly(ProducerError("must not be called"), device=(1, 0))),
    ("DLPack device pinned", lambda: DLPackOnly(ProducerError("must not be called"), device=(3, 0))),
    ("DLPack device 9", lambda: DLPackOnly(ProducerError("must not be called"), device=(9, 0))),
    ("non-capsule, no device", lambda: DLPackOnly(lambda stream, max_version: 5)),
    ("used capsule, no device", lambda: DLPackOnly(lambda stream, max_version: used_capsule())),
    ("interface not a dict", lambda: CAI([("shape", (4,))])),
    ("interface with a mask", lambda: CAI({"shape": (4,), "typestr": "<f4", "data": (8, False),
                                           "version": 3, "mask": object()})),
    ("interface typestr >f4", lambda: CAI({"shape": (4,), "typestr": ">f4", "data": (8, False),
                                           "version": 3})),
    ("interface typestr <c8", lambda: CAI({"shape": (4,), "typestr": "<c8", "data": (8, False),
                                           "version": 3})),
    ("interface strides 3 bytes", lambda: CAI({"shape": (4,), "typestr": "<f4", "data": (8, False),
                                               "version": 3, "strides": (3,)})),
    ("interface raises AttributeError", lambda: CAI(AttributeError("no interface after all"))),
    ("pinned buffer", lambda: inferctx.PinnedBuffer(0)),
])

BAD_P = st.one_of(st.floats(max_value=-1e-300), st.floats(min_value=1.0000001),
                  st.just(float("nan")), st.just(float("inf")), st.just(float("-inf")),
                  st.sampled_from(["0.5", None, True, False, b"x", [0.5], object(), 1j]),
                  st.integers(min_value=2, max_value=10**300), st.integers(max_value=-1))
ANY_P = st.one_of(BAD_P, st.floats(0.0, 1.0), st.sampled_from([0, 1, np.float32(0.3), np.float64(0.9)]))
BAD_FLAG = st.sampled_from([1, 0, None, "True", 2.0, np.int8(1)])
ANY_FLAG = st.one_of(st.booleans(), BAD_FLAG)
ANY_SCALAR = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([1, 0, True, "1", None, 1j, np.float16(2)]))


@pytest.mark.parametrize("entry", ["dropout", "apply_mask", "gemm", "bmm"])
@FUZZ
@given(data=st.data())
def test_any_machine_non_cuda_operands_are_config_errors(entry, data):
    """Operands that are no CUDA memory (host arrays, lists, protocols pointing at the host or
    detectably lying) are refused by name, whatever the other arguments, before any device is
    read: ConfigError on every machine."""
    label, make = data.draw(HOST_THINGS, label="operand")
    second = data.draw(HOST_THINGS, label="second operand")[1]
    names = {"dropout": ("x", "out", "mask_out", "p", "mask", "seed", "offset"),
             "apply_mask": ("grad", "mask", "out", "p"),
             "gemm": ("a", "b", "out", "trans_a", "trans_b", "alpha", "beta", "tf32"),
             "bmm": ("a", "b", "out", "trans_a", "trans_b", "alpha", "beta", "tf32")}[entry]
    if entry == "dropout":
        kw = data.draw(st.fixed_dictionaries({}, optional={
            "mask": st.sampled_from(["bits", "bytes", None, "words", 2, b"bits"]),
            "seed": st.one_of(st.integers(-5, 2**65), st.none()),
            "offset": st.one_of(st.integers(-5, 2**65), st.none())}), label="kwargs")
        p = data.draw(ANY_P, label="p")
        fn = lambda: inferctx.dropout(make(), p, **kw)  # noqa: E731
    elif entry == "apply_mask":
        p = data.draw(ANY_P, label="p")
        fn = lambda: inferctx.apply_mask(make(), second(), p)  # noqa: E731
    else:
        kw = data.draw(st.fixed_dictionaries({}, optional={
            "trans_a": ANY_FLAG, "trans_b": ANY_FLAG, "tf32": ANY_FLAG,
            "alpha": ANY_SCALAR, "beta": ANY_SCALAR}), label="kwargs")
        first_is_a = data.draw(st.booleans(), label="hostile operand is a")
        a, b = (make(), second()) if first_is_a else (second(), make())
        fn = lambda: getattr(inferctx, entry)(a, b, **kw)  # noqa: E731
    out = attempt(fn, (ConfigError,))
    assert isinstance(out, Raised), f"{entry} on {label} returned {out!r}"
    assert out.exc.argument in names, out


CAI_NEEDS_A_DEVICE = st.sampled_from([
    # Well-formed interfaces whose pointer must be asked of CUDA: not device memory (8, a host
    # array), or null with elements (refused by the kernels).
    ("pointer 8", {"shape": (4,), "typestr": "<f4", "data": (8, False), "version": 3}),
    ("pointer 8, 2-D", {"shape": (2, 2), "typestr": "<f2", "data": (8, True), "version": 2}),
    ("host pointer", "host"),
    ("null pointer with elements", {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}),
    ("pointer 8, stream 1", {"shape": (4,), "typestr": "<f4", "data": (8, False), "version": 3,
                             "stream": 1}),
    ("pointer 8, bad stream", {"shape": (4,), "typestr": "<f4", "data": (8, False), "version": 3,
                               "stream": -3}),
])


@pytest.mark.parametrize("entry", ["dropout", "apply_mask", "gemm"])
@FUZZ
@given(case=CAI_NEEDS_A_DEVICE, p=st.floats(0.0, 1.0))
def test_any_machine_lying_interfaces_are_documented_errors(entry, case, p):
    """A __cuda_array_interface__ with a pointer that is not device memory: ConfigError with a
    GPU, NoCudaDeviceError without one; never a result."""
    label, interface = case
    keep = None
    if interface == "host":
        keep = np.zeros(16, np.float32)
        interface = {"shape": (4,), "typestr": "<f4", "data": (keep.ctypes.data, False), "version": 3}
    x = CAI(interface, keep)
    if entry == "dropout":
        fn = lambda: inferctx.dropout(x, p)  # noqa: E731
    elif entry == "apply_mask":
        fn = lambda: inferctx.apply_mask(x, x, p)  # noqa: E731
    else:
        fn = lambda: inferctx.gemm(x, x)  # noqa: E731
    out = attempt(fn, (ConfigError, NoCudaDeviceError))
    assert isinstance(out, Raised), f"{entry} on {label} returned {out!r}"


@FUZZ
@given(nbytes=st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63),
                        st.sampled_from([True, False, 1.5, "8", None, b"8", [8], 8.0, np.float64(8)])))
def test_any_machine_pinned_buffer_sizes_are_checked_first(nbytes):
    out = attempt(lambda: inferctx.PinnedBuffer(nbytes), (ConfigError,))
    assert isinstance(out, Raised) and out.exc.argument == "nbytes", out


DL_STREAM = st.one_of(st.none(), st.integers(-3, 2),  # 3 would be a bogus handle
                       st.sampled_from(["1", 1.0, True, 2**64, -2**70]))
MAX_VERSION = st.one_of(st.none(), st.tuples(st.integers(-1, 3), st.integers(0, 5)),
                        st.sampled_from([(1,), (1, 0, 0), "1.0", 1, [1, 0], ("a", 0), (True, 0)]))
DL_DEVICE = st.one_of(st.none(), st.tuples(st.integers(-1, 14), st.integers(-1, 3)),
                      st.sampled_from([(1, 0), (3, 0), (2, 0), "cpu", (1,), (True, 0), (1, False)]))
COPY = st.sampled_from([None, True, False, 1, 0, "yes"])


@FUZZ
@given(stream=DL_STREAM, max_version=MAX_VERSION, dl_device=DL_DEVICE, copy=COPY)
def test_any_machine_empty_pinned_buffer_dlpack_export(stream, max_version, dl_device, copy):
    """PinnedBuffer(0) needs no page-locked allocation: its DLPack export runs on any machine.
    A capsule whose fields say what the arguments asked for, or a documented error."""
    buf = inferctx.PinnedBuffer(0)
    before = sys.getrefcount(buf)
    out = attempt(lambda: buf.__dlpack__(stream=stream, max_version=max_version,
                                         dl_device=dl_device, copy=copy),
                  (ConfigError, BufferError, TypeError))
    if isinstance(out, Raised):
        if isinstance(out.exc, TypeError):  # only max_version documents it
            assert not (max_version is None or (isinstance(max_version, tuple) and len(max_version) == 2
                                                and all(isinstance(v, int) and not isinstance(v, bool)
                                                        for v in max_version))), out
            assert "max_version" in str(out.exc), out
        if isinstance(out.exc, ConfigError):
            assert out.exc.argument == "copy", out
        assert sys.getrefcount(buf) == before
        return
    versioned = max_version is not None and max_version[0] >= 1
    assert capsule_name(out) == ("dltensor_versioned" if versioned else "dltensor")
    managed, t, shape, strides = read(out)
    assert (t.ndim, shape, strides, t.byte_offset) == (1, [0], [1], 0)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (1, 8, 1)
    want_type = 3 if dl_device is None else int(dl_device[0])
    assert (t.device.device_type, t.device.device_id) == (want_type, 0)
    assert want_type in (1, 3)
    if versioned:
        assert managed.flags == (IS_COPIED if copy is True else 0)
    del managed, t, out
    gc.collect()
    assert sys.getrefcount(buf) == before


@FUZZ
@given(device=st.one_of(st.integers(max_value=-1), st.integers(min_value=2**31),
                        st.sampled_from(["0", 0.0, True, b"0", [0], 1j])))
def test_any_machine_context_of_a_bad_device_is_a_config_error(device):
    out = attempt(lambda: inferctx.InferenceContext.instance(device), (ConfigError,))
    assert isinstance(out, Raised) and out.exc.argument == "device", out


@FUZZ
@given(data=st.data())
def test_any_machine_autotune_arguments_are_checked_before_the_device(data):
    """autotune_gemm with at least one invalid argument: ConfigError naming it, before any
    context is made (so on any machine)."""
    good = {"shapes": [(8, 8, 8)], "dtype": "float16", "trans_a": False, "trans_b": False,
            "tf32": False, "progress": False, "force": False, "max_algorithms": 2, "warmup": 0,
            "repeats": 1}
    bad = {"shapes": st.sampled_from([[(0, 1, 1)], [(1, 2)], [(1, 2, 3, 4, 5)], [("a", 2, 3)], None, "888",
                                      [(1.5, 2, 3)], [(True, 2, 3)], [(2, -1, 3)], 7, [None]]),
           "dtype": st.sampled_from(["int8", None, object(), "float64", 3, "float"]),
           "trans_a": BAD_FLAG, "trans_b": BAD_FLAG, "tf32": BAD_FLAG, "progress": BAD_FLAG,
           "force": BAD_FLAG,
           "max_algorithms": st.one_of(st.integers(max_value=0), st.sampled_from([1.5, "2", True, None])),
           "warmup": st.one_of(st.integers(max_value=-1), st.sampled_from([1.5, "2", False])),
           "repeats": st.one_of(st.integers(max_value=0), st.sampled_from([1.5, "2", True]))}
    wrong = data.draw(st.lists(st.sampled_from(sorted(bad)), min_size=1, max_size=3, unique=True),
                      label="invalid arguments")
    kwargs = dict(good)
    for name in wrong:
        kwargs[name] = data.draw(bad[name], label=name)
    if "dtype" in wrong and kwargs["dtype"] == "float":
        wrong.remove("dtype")  # an alias of float32: valid
    if not wrong:
        return
    shapes = kwargs.pop("shapes")
    dtype = kwargs.pop("dtype")
    out = attempt(lambda: inferctx.autotune_gemm(shapes, dtype, **kwargs), (ConfigError,))
    assert isinstance(out, Raised) and out.exc.argument in wrong, out


# -- hostile fields that once escaped as KeyError / TypeError / ValueError / OverflowError ---------
#
# Each is one exact call that raised an undocumented exception before the interface's fields,
# __dlpack_device__'s answer and p were checked; now each is a ConfigError naming the argument
# (or NoCudaDeviceError where the check needs a device that is not there).

_GOOD = {"shape": (4,), "typestr": "<f4", "data": (8, False), "version": 3}


def _without(key):
    return {k: v for k, v in _GOOD.items() if k != key}


# (label, call, what it raises: ConfigError, or BufferError for a DLPack export's arguments)
HOSTILE_FIELDS = [
    ("p=10**400", lambda: inferctx.dropout(object(), 10**400), ConfigError),
    ("apply_mask p=-10**400", lambda: inferctx.apply_mask(object(), object(), -10**400), ConfigError),
    ("interface without typestr", lambda: inferctx.dropout(CAI(_without("typestr")), 0.5), ConfigError),
    ("interface without shape", lambda: inferctx.dropout(CAI(_without("shape")), 0.5), ConfigError),
    ("interface without data", lambda: inferctx.dropout(CAI(_without("data")), 0.5), ConfigError),
    ("interface typestr 5", lambda: inferctx.dropout(CAI(dict(_GOOD, typestr=5)), 0.5), ConfigError),
    ("interface shape 'ab'", lambda: inferctx.dropout(CAI(dict(_GOOD, shape="ab")), 0.5), ConfigError),
    ("interface shape None", lambda: inferctx.dropout(CAI(dict(_GOOD, shape=None)), 0.5), ConfigError),
    ("interface data 8", lambda: inferctx.dropout(CAI(dict(_GOOD, data=8)), 0.5), ConfigError),
    ("interface data (8,)", lambda: inferctx.dropout(CAI(dict(_GOOD, data=(8,))), 0.5), ConfigError),
    ("interface pointer -8", lambda: inferctx.dropout(CAI(dict(_GOOD, data=(-8, False))), 0.5), ConfigError),
    ("interface pointer 2**70", lambda: inferctx.dropout(CAI(dict(_GOOD, data=(2**70, False))), 0.5),
     ConfigError),
    ("interface strides ('a',)", lambda: inferctx.dropout(CAI(dict(_GOOD, strides=("a",))), 0.5), ConfigError),
    ("gemm: interface without typestr", lambda: inferctx.gemm(CAI(_without("typestr")), CAI(_GOOD)), ConfigError),
    ("__dlpack_device__ returns None", lambda: inferctx.dropout(_dlpack_device_none(), 0.5), ConfigError),
    ("__dlpack_device__ returns (2,)", lambda: inferctx.dropout(DLPackOnly(lambda **k: 5, device=(2,)), 0.5),
     ConfigError),
    ("__dlpack_device__ returns ('a', 0)",
     lambda: inferctx.dropout(DLPackOnly(lambda **k: 5, device=("a", 0)), 0.5), ConfigError),
    ("gemm: __dlpack_device__ returns (2,)",
     lambda: inferctx.gemm(DLPackOnly(lambda **k: 5, device=(2,)), DLPackOnly(lambda **k: 5, device=(2,))),
     ConfigError),
    ("PinnedBuffer.__dlpack__(dl_device=('a', 0))",
     lambda: inferctx.PinnedBuffer(0).__dlpack__(dl_device=("a", 0)), BufferError),
]


def _dlpack_device_none():
    obj = DLPackOnly(lambda **k: 5, device=(2, 0))
    obj._device = None  # __dlpack_device__() returns None
    return obj


def _hostile_argument(label):
    """The argument a HOSTILE_FIELDS case's ConfigError names: p for the probabilities, a for
    gemm's first operand, x for dropout's operand."""
    if " p=" in f" {label}":
        return "p"
    return "a" if label.startswith("gemm:") else "x"


@pytest.mark.parametrize("call, expected, argument", [pytest.param(call, raises, _hostile_argument(label), id=label)
                                                     for label, call, raises in HOSTILE_FIELDS])
def test_any_machine_hostile_fields_are_documented_errors(call, expected, argument):
    with pytest.raises((expected, NoCudaDeviceError)) as info:
        call()
    if isinstance(info.value, ConfigError):
        # names the argument the hostile field came in
        assert info.value.argument == argument, (info.value.argument, argument, info.value)


# ================================================================================================
# Part 2: on the GPU
# ================================================================================================

def _torch_dtype(torch, name):
    return getattr(torch, name)


def _mem_figures(torch, context):
    free = settled_free_memory(context)
    return free, context.held_bytes, context.memory_pool.stats()


def collect():
    """A full garbage collection that stays cheap over 10,000 cases: what survives it is frozen
    out of later collections (the ``gpu`` fixture unfreezes it at the end). Hypothesis keeps
    every case's choices in live objects, so without this each collection scans all earlier
    cases' and a suite's time grows with the square of its cases. Counts such as
    ``views_alive`` still see a frozen object; only the cycle collector passes over it."""
    gc.collect()
    gc.freeze()


def healthy(torch, context):
    """A valid call succeeds and its result is right: no CUDA error was left pending."""
    torch.cuda.synchronize()
    x = torch.ones(64, device=f"cuda:{context.device}")
    y, mask = inferctx.dropout(x, 0.5, seed=1, offset=0)
    keep = ref.dropout_keep(1, 0, 0.5, 64)
    torch.cuda.synchronize()
    assert np.array_equal(y.cpu().numpy(), np.where(keep, np.float32(2.0), np.float32(0.0)))


def restore(context):
    """The fixture's state again: no adopted stream, workspace held, token 0."""
    context.use_stream(None)
    if context.released:
        context.retake_workspace()
    context.reset_tokens(0)


class Streams:
    """Stream-like arguments: valid ones (made once, so the pool's per-stream cuBLAS workspaces
    are bounded) and ones that are no stream."""

    def __init__(self, torch, context):
        self.side = inferctx.Stream(device=context.device)
        self.torch_side = torch.cuda.Stream(device=context.device)
        self.valid = [None, 0, 1, 2, self.side, self.torch_side, self.side.handle]
        self.invalid = ["fast", 1.5, True, object(), -3, 2**64, [1]]

    def bad(self, stream):
        """True for the stream-likes that are no stream (by identity: 1 == True)."""
        return any(stream is s for s in self.invalid)

    def strategy(self):
        return st.one_of(st.sampled_from(self.valid), st.sampled_from(self.invalid))


@pytest.fixture
def gpu(torch, ctx):
    """(torch, ctx, streams) with warm-up done; at the end, no leak and the state restored."""
    streams = Streams(torch, ctx)
    state = ctx.rng_state
    x = torch.ones(4, 4, device=f"cuda:{ctx.device}")
    for s in streams.valid:  # each stream's first GEMM takes its cuBLAS workspace for good
        inferctx.gemm(x, x, stream=s)
        inferctx.gemm(inferctx._core._empty(ctx.device, (4, 4)), inferctx._core._empty(ctx.device, (4, 4)),
                      stream=s)
        inferctx.dropout(x, 0.5, stream=s)
    torch.matmul(x, x)
    del x
    before = _mem_figures(torch, ctx)
    # What is alive now (torch's modules, hypothesis's) is frozen out of the collector, and
    # collect() freezes what survives each case, so that a collection scans only what the case
    # in hand made, not every object torch and hypothesis made (such a full collection took
    # most of a case's time).
    gc.freeze()
    try:
        yield torch, ctx, streams
    finally:
        gc.unfreeze()
    restore(ctx)
    ctx.set_seed(state[0])
    plan_small(ctx)
    after = _mem_figures(torch, ctx)
    free_b, held_b, pool_b = before
    free_a, held_a, pool_a = after
    # Memory the workspace holds is the plan's (kept when a later plan is smaller): not a leak.
    lost = (free_b - free_a) - (held_a - held_b)
    # (str messages: pytest prints them whole, where it would shorten a tuple's repr)
    assert lost <= LEAK_TOLERANCE, f"{before}\n{after}\n{live_views_report()}"
    assert pool_a["used_bytes"] <= pool_b["used_bytes"] and pool_a["allocations"] <= pool_b["allocations"], \
        f"{pool_b}\n{pool_a}\n{live_views_report()}"
    assert pool_a["reserved_bytes"] <= pool_b["reserved_bytes"] + LEAK_TOLERANCE, (pool_b, pool_a)
    healthy(torch, ctx)


# -- operands ----------------------------------------------------------------------------------

LAYOUTS = ("contiguous", "contiguous", "contiguous", "transposed", "strided", "offset", "expanded", "cpu")


def operand_spec(dtypes, max_ndim=3, max_dim=24, min_ndim=0):
    return st.fixed_dictionaries({
        "dtype": st.sampled_from(dtypes),
        "shape": st.lists(st.integers(0, max_dim) | st.sampled_from([1, 1, 2]), min_size=min_ndim,
                          max_size=max_ndim).map(tuple),
        "layout": st.sampled_from(LAYOUTS),
        "shift": st.integers(1, 7),
        "seed": st.integers(0, 2**31),
    })


def make(torch, spec, device):
    """A torch tensor of spec's dtype, shape and layout."""
    shape, dtype = tuple(spec["shape"]), _torch_dtype(torch, spec["dtype"])
    g = torch.Generator(device="cpu").manual_seed(spec["seed"])
    layout = spec["layout"]

    def values(s):
        n = math.prod(s)
        if dtype.is_floating_point:
            v = torch.randn(n, generator=g) * 3
        elif dtype == torch.bool:
            v = torch.randint(0, 2, (n,), generator=g)
        else:
            v = torch.randint(0, 100, (n,), generator=g)
        return v.to(dtype).reshape(s)

    if layout == "cpu":
        return values(shape)
    if layout == "transposed" and len(shape) >= 2:
        swapped = shape[:-2] + (shape[-1], shape[-2])
        return values(swapped).to(device).transpose(-1, -2)
    if layout == "strided" and len(shape) >= 1:
        wide = shape[:-1] + (2 * shape[-1],)
        return values(wide).to(device)[..., ::2]
    if layout == "offset":
        n = math.prod(shape)
        flat = values((n + spec["shift"],)).to(device)
        return flat[spec["shift"]:].reshape(shape)  # element aligned, not 16-byte aligned
    if layout == "expanded" and len(shape) >= 1:
        return values((1,) + shape[1:]).to(device).expand(shape)  # stride 0
    return values(shape).to(device)


def as_kind(torch, t, kind, context):
    """The tensor t as another kind of operand: a DeviceView copy, a bare
    __cuda_array_interface__ or DLPack object on the same memory."""
    if kind == "torch" or t.device.type != "cuda":
        return t
    if kind == "view":
        if not t.is_contiguous():
            return t
        v = inferctx._core._empty(context.device, tuple(t.shape), str(t.dtype).rpartition(".")[2])
        torch.from_dlpack(v).copy_(t)
        return v
    if kind == "interface":
        if t.dtype == torch.bfloat16:
            return t
        torch.cuda.synchronize()  # the interface below names no stream
        typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.float64: "<f8", torch.int32: "<i4",
                   torch.uint8: "|u1", torch.int8: "|i1", torch.bool: "|b1", torch.int64: "<i8"}[t.dtype]
        return CAI({"shape": tuple(t.shape), "typestr": typestr, "data": (t.data_ptr(), False),
                    "strides": tuple(s * t.element_size() for s in t.stride()), "version": 2}, keep=t)
    return DLPackOnly(lambda stream, max_version: t.__dlpack__(stream=stream), device=(2, t.get_device()))


def to_torch(torch, obj):
    if isinstance(obj, CAI):  # torch takes DLPack only: the tensor behind the interface
        return obj._keep
    return obj if isinstance(obj, torch.Tensor) else torch.from_dlpack(obj)


def snapshot(torch, t):
    return t.detach().clone() if isinstance(t, torch.Tensor) else None


# -- dropout and apply_mask --------------------------------------------------------------------

P_VALUES = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 1.0, 0.5, 1e-7, 1 - 1e-7, 5e-324, -0.0]),
                     BAD_P, st.sampled_from([0, 1, np.float32(0.25)]))


def _valid_p(p):
    if isinstance(p, bool) or not isinstance(p, (int, float, np.floating)):
        return False
    try:
        v = float(p)
    except OverflowError:
        return False
    return 0.0 <= v <= 1.0


def _keep_of(torch, mask, n):
    m = to_torch(torch, mask)
    if m.dtype in (torch.int32, torch.uint32):
        return ref.unpack_bits(m.view(torch.int32).cpu().numpy().view(np.uint32), n)
    return m.reshape(-1).cpu().numpy().astype(bool)


def _check_dropout_values(torch, x0, y, keep, p):
    """y equals x * float32(1 / (1 - p)) where kept and +0 elsewhere, bit for bit; p = 1 gives +0
    everywhere (the documented "1 gives zeros"), whatever a mask given to apply_mask keeps."""
    x32 = x0.float().cpu().numpy().reshape(-1)
    if float(p) == 1.0:
        keep = np.zeros(x32.shape, dtype=bool)
    want = torch.from_numpy(ref.dropout_float32(x32, keep, float(p))).to(x0.dtype)
    got = to_torch(torch, y).reshape(-1).cpu()
    bits = torch.int32 if x0.dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits)), "dropout values differ from x * scale"


@pytest.mark.gpu
@FUZZ
@given(data=st.data())
def test_gpu_dropout(gpu, data):
    torch, context, streams = gpu
    dev = f"cuda:{context.device}"
    spec = data.draw(operand_spec(KERNEL_DTYPES * 3 + ("float64", "int32", "uint8", "bool")), label="x")
    x = make(torch, spec, dev)
    kind = data.draw(st.sampled_from(["torch", "torch", "view", "interface", "dlpack"]), label="kind")
    p = data.draw(P_VALUES, label="p")
    mask_mode = data.draw(st.sampled_from(["bits", "bits", "bytes", None, "words", 1, "BITS"]), label="mask")
    out_how = data.draw(st.sampled_from([None, None, "fresh", "x itself", "wrong shape", "wrong dtype",
                                         "strided", "cpu"]), label="out")
    mask_out_how = data.draw(st.sampled_from([None, None, "right", "short", "wrong dtype"]), label="mask_out")
    rng = data.draw(st.sampled_from(["context", "context", "explicit", "seed only", "odd offset",
                                     "negative", "2**64"]), label="philox")
    stream = data.draw(streams.strategy(), label="stream") if data.draw(st.booleans()) else None
    ctx_arg = data.draw(st.sampled_from([None, None, context, "ctx", 0]), label="ctx")

    x0 = snapshot(torch, x)
    xo = as_kind(torch, x, kind, context)
    n = x.numel()
    kw = {"mask": mask_mode}
    if out_how == "fresh":
        kw["out"] = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out_how == "x itself":
        kw["out"] = xo
    elif out_how == "wrong shape":
        kw["out"] = torch.empty(n + 1, dtype=x.dtype, device=dev)
    elif out_how == "wrong dtype":
        kw["out"] = torch.empty(x.shape, dtype=torch.float64 if x.dtype != torch.float64 else torch.float32,
                                device=dev)
    elif out_how == "strided":
        kw["out"] = torch.empty(tuple(x.shape) + (2,), dtype=x.dtype, device=dev)[..., 0]
    elif out_how == "cpu":
        kw["out"] = torch.empty(x.shape, dtype=x.dtype)
    words = (n + 31) // 32
    if mask_out_how == "right":
        kw["mask_out"] = (torch.empty(words, dtype=torch.int32, device=dev) if mask_mode != "bytes"
                          else torch.empty(n, dtype=torch.uint8, device=dev))
    elif mask_out_how == "short":
        kw["mask_out"] = torch.empty(max(words - 1, 0), dtype=torch.int32, device=dev)
    elif mask_out_how == "wrong dtype":
        kw["mask_out"] = torch.empty(max(words, 1), dtype=torch.float32, device=dev)
    seed, offset = context.rng_state
    if rng == "explicit":
        seed, offset = data.draw(st.integers(0, 2**64 - 1)), 4 * data.draw(st.integers(0, 2**61))
        kw.update(seed=seed, offset=offset)
    elif rng == "seed only":
        kw["seed"] = 3
    elif rng == "odd offset":
        kw.update(seed=3, offset=6)
    elif rng == "negative":
        kw.update(seed=-1, offset=0)
    elif rng == "2**64":
        kw.update(seed=2**64, offset=0)
    if stream is not None:
        kw["stream"] = stream
    if ctx_arg is not None:
        kw["ctx"] = ctx_arg

    out = attempt(lambda: inferctx.dropout(xo, p, **kw), KERNEL_ERRORS, producer_ok=True)
    # Carve-out: torch's own __dlpack__ refuses stream 2 (CUDA's per-thread default stream) with
    # BufferError, which reaches the caller unchanged (README); the only refusal of a valid draw.
    if passed_through_from_producer(torch, context, out, kind == "dlpack", stream):
        return
    must_fail = (not _valid_p(p) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16)
                 or x.device.type != "cuda" or (not x.is_contiguous() and n > 1)
                 or not (mask_mode is None or mask_mode in ("bits", "bytes") and type(mask_mode) is str)
                 or rng in ("seed only", "odd offset", "negative", "2**64")
                 or any(ctx_arg is c for c in ("ctx", 0)) or streams.bad(stream)
                 or out_how in ("wrong shape", "wrong dtype", "cpu") or out_how == "strided" and n > 1
                 or mask_out_how == "short" and n > 0 or mask_out_how == "wrong dtype"
                 or mask_out_how is not None and mask_mode is None)
    if must_fail:
        assert isinstance(out, Raised), f"expected a documented error, got {out!r}"
    # Every other draw is valid by construction: x a CUDA float32/float16/bfloat16 array that is
    # contiguous (or of at most one element), p in [0, 1], mask "bits", "bytes" or None, out None,
    # x itself or a fresh contiguous array (a strided one of at most one element), mask_out None
    # or the right size and dtype for the mask, the context's Philox state or an explicit one
    # with an offset that is a multiple of 4, ctx None or the context, a stream of the device.
    # Besides must_fail, one draw is invalid: a "short" mask_out (0 int32 words when n == 0) given
    # for a bytes mask, which must be uint8 (_mask_arg refuses it, naming mask_out).
    must_succeed = not must_fail and not (mask_out_how == "short" and mask_mode == "bytes")
    if must_succeed:
        draw = {"x": spec, "kind": kind, "p": p, "mask": mask_mode, "out": out_how, "mask_out": mask_out_how,
                "philox": rng, "stream": stream, "ctx": ctx_arg}
        assert not isinstance(out, Raised), f"a valid dropout was refused: {draw} -> {out!r}"
    if not isinstance(out, Raised):
        y, mask = out
        if "out" in kw:
            assert y is kw["out"]
        if "mask_out" in kw:
            assert mask is kw["mask_out"]
        yt = to_torch(torch, y)
        assert tuple(yt.shape) == tuple(x.shape) and yt.dtype == x.dtype
        keep = ref.dropout_keep(seed, offset, float(p), n)
        if mask_mode is None:
            assert mask is None
        else:
            assert np.array_equal(_keep_of(torch, mask, n), keep), "mask differs from the Philox reference"
            if mask_mode == "bytes" and "mask_out" not in kw:  # a given mask_out keeps its own shape
                assert tuple(to_torch(torch, mask).shape) == tuple(x.shape)
        torch.cuda.synchronize()
        _check_dropout_values(torch, x0, y, keep, p)
    healthy(torch, context)


@pytest.mark.gpu
@FUZZ
@given(data=st.data())
def test_gpu_apply_mask(gpu, data):
    torch, context, streams = gpu
    dev = f"cuda:{context.device}"
    spec = data.draw(operand_spec(KERNEL_DTYPES * 3 + ("float64", "int8")), label="grad")
    grad = make(torch, spec, dev)
    kind = data.draw(st.sampled_from(["torch", "torch", "view", "interface", "dlpack"]), label="kind")
    n = grad.numel()
    p = data.draw(P_VALUES, label="p")
    mask_how = data.draw(st.sampled_from(["bits", "bytes", "bool", "int8", "uint32", "other n", "float",
                                          "cpu", "strided", "2-D bits"]), label="mask")
    out_how = data.draw(st.sampled_from([None, None, "fresh", "grad itself", "wrong dtype", "cpu"]), label="out")
    stream = data.draw(streams.strategy(), label="stream") if data.draw(st.booleans()) else None
    g = np.random.default_rng(spec["seed"])
    keep = g.random(n) < 0.5
    words = torch.from_numpy(ref.pack_bits(keep).view(np.int32)).to(dev)
    if mask_how == "bits":
        mask = words
    elif mask_how == "uint32":
        mask = words.view(torch.uint32) if hasattr(torch, "uint32") else words
    elif mask_how == "2-D bits":
        mask = words.reshape(1, -1)
    elif mask_how in ("bytes", "bool", "int8"):
        dt = {"bytes": torch.uint8, "bool": torch.bool, "int8": torch.int8}[mask_how]
        mask = torch.from_numpy(keep.astype(np.uint8)).to(dev).to(dt)
    elif mask_how == "other n":
        mask = torch.zeros(n + 33, dtype=torch.uint8, device=dev)
    elif mask_how == "float":
        mask = torch.ones(n, dtype=torch.float32, device=dev)
    elif mask_how == "cpu":
        mask = torch.from_numpy(keep.astype(np.uint8))
    else:
        mask = torch.from_numpy(np.repeat(keep.astype(np.uint8), 2)).to(dev)[::2]
    kw = {}
    if out_how == "fresh":
        kw["out"] = torch.empty(grad.shape, dtype=grad.dtype, device=dev)
    elif out_how == "grad itself":
        kw["out"] = None  # set below, once grad has its kind
    elif out_how == "wrong dtype":
        kw["out"] = torch.empty(grad.shape, dtype=torch.float64, device=dev)
    elif out_how == "cpu":
        kw["out"] = torch.empty(grad.shape, dtype=grad.dtype)
    if stream is not None:
        kw["stream"] = stream
    g0 = snapshot(torch, grad)
    go = as_kind(torch, grad, kind, context)
    if out_how == "grad itself":
        kw["out"] = go
    out = attempt(lambda: inferctx.apply_mask(go, mask, p, **kw), KERNEL_ERRORS, producer_ok=True)
    # Carve-out: torch's own __dlpack__ refuses stream 2 (as in test_gpu_dropout).
    if passed_through_from_producer(torch, context, out, kind == "dlpack", stream):
        return
    must_fail = (not _valid_p(p) or grad.dtype not in (torch.float32, torch.float16, torch.bfloat16)
                 or grad.device.type != "cuda" or mask_how in ("float", "cpu") or streams.bad(stream)
                 or (not grad.is_contiguous() and n > 1) or mask_how == "strided" and n > 1
                 or (mask_how == "other n") or out_how in ("wrong dtype", "cpu"))
    if must_fail:
        assert isinstance(out, Raised), f"expected a documented error, got {out!r}"
    # Every other draw is valid by construction: grad a contiguous CUDA float32/float16/bfloat16
    # array, p in [0, 1], a contiguous CUDA mask of n bytes (uint8, bool, int8) or ceil(n / 32)
    # words (int32, uint32, 1-D or 2-D), out None, grad itself or a fresh array like grad, and a
    # stream of the device.
    must_succeed = not must_fail
    if must_succeed:
        draw = {"grad": spec, "kind": kind, "p": p, "mask": mask_how, "out": out_how, "stream": stream}
        assert not isinstance(out, Raised), f"a valid apply_mask was refused: {draw} -> {out!r}"
    if not isinstance(out, Raised):
        if out_how is not None:
            assert out is kw["out"]
        res = to_torch(torch, out)
        assert tuple(res.shape) == tuple(grad.shape) and res.dtype == grad.dtype
        torch.cuda.synchronize()
        _check_dropout_values(torch, g0, out, keep, p)
    healthy(torch, context)


@pytest.mark.gpu
@FUZZ
@given(data=st.data())
def test_gpu_partially_overlapping_out(gpu, data):
    """out overlapping x (or grad) at a shift of some elements: refused, or the result of reading
    all of x before writing (what NumPy and torch give)."""
    torch, context, _ = gpu
    dtype = data.draw(st.sampled_from(KERNEL_DTYPES))
    n = data.draw(st.integers(1, 5000))
    shift = data.draw(st.integers(1, 40))
    entry = data.draw(st.sampled_from(["dropout", "apply_mask"]))
    p = data.draw(st.floats(0.0, 1.0))
    buf = (torch.randn(n + shift, device=f"cuda:{context.device}") * 3).to(_torch_dtype(torch, dtype))
    forward = data.draw(st.booleans())
    x, o = (buf[:n], buf[shift:]) if forward else (buf[shift:], buf[:n])
    x0 = x.clone()
    keep = np.random.default_rng(n).random(n) < 0.5
    if entry == "dropout":
        seed, offset = 5, 4 * shift
        out = attempt(lambda: inferctx.dropout(x, p, out=o, seed=seed, offset=offset), KERNEL_ERRORS)
        keep = ref.dropout_keep(seed, offset, p, n)
    else:
        mask = torch.from_numpy(ref.pack_bits(keep).view(np.int32)).to(x.device)
        out = attempt(lambda: inferctx.apply_mask(x, mask, p, out=o), KERNEL_ERRORS)
    # buf[:n] and buf[shift:] share no element when shift >= n: out is a separate array then,
    # and every other argument is valid by construction (a partial overlap may be refused).
    if shift >= n:
        assert not isinstance(out, Raised), \
            f"{entry} with out apart from x was refused: {dtype} n={n} shift={shift} p={p} -> {out!r}"
    if not isinstance(out, Raised):
        torch.cuda.synchronize()
        _check_dropout_values(torch, x0, o, keep, p)
    healthy(torch, context)


# -- gemm and bmm --------------------------------------------------------------------------------

def _gemm_bound(dtype, tf32):
    if dtype == "float32":
        return 1e-3 if tf32 else 1e-5
    return 1e-2


def _stored_row_major(r, c, sr, sc):
    """Whether an r x c matrix with strides (sr, sc) (elements) is stored row-major: the elements
    of a row adjacent and the rows at least c apart (nothing is asked of sizes 0, nor of a
    dimension of size 1)."""
    if r == 0 or c == 0:
        return True
    return (c == 1 or sc == 1) and (r == 1 or sr >= c)


def _gemm_readable(t):
    """Whether gemm / bmm read the tensor's matrices in place by the rule their docstrings and
    refusals state: "one of its last two dimensions must have stride 1 and the other a stride
    at least its length" (row- or column-major), with a batch stride >= 0."""
    if t.dim() < 2 or (t.dim() == 3 and t.stride(0) < 0):
        return False
    r, c = t.shape[-2:]
    sr, sc = t.stride()[-2:]
    return _stored_row_major(r, c, sr, sc) or _stored_row_major(c, r, sc, sr)


@pytest.mark.gpu
@FUZZ
@given(data=st.data())
def test_gpu_gemm_and_bmm(gpu, data):
    torch, context, streams = gpu
    dev = f"cuda:{context.device}"
    entry = data.draw(st.sampled_from(["gemm", "bmm"]), label="entry")
    ndim = 2 if entry == "gemm" else 3
    dtype = data.draw(st.sampled_from(KERNEL_DTYPES), label="dtype")
    b_dtype = data.draw(st.sampled_from([dtype] * 6 + ["float32", "float64", "int32"]), label="b dtype")
    m, n, k = (data.draw(st.integers(0, 40) | st.sampled_from([1, 1, 0, 33]), label=d) for d in "mnk")
    batch = data.draw(st.integers(0, 4), label="batch")
    b_batch = data.draw(st.sampled_from([batch, batch, 1, batch + 1]), label="b batch")
    trans_a = data.draw(st.booleans() | BAD_FLAG, label="trans_a")
    trans_b = data.draw(st.booleans() | BAD_FLAG, label="trans_b")
    tf32 = data.draw(st.sampled_from([False, False, True, 1]), label="tf32")
    a_dim = data.draw(st.sampled_from([ndim] * 8 + [ndim - 1, ndim + 1]), label="a ndim")
    alpha = data.draw(st.sampled_from([1.0, 1.0, 0.5, -2.0, 0.0, 3, float("nan"), float("inf"), True, "1"]),
                      label="alpha")
    beta = data.draw(st.sampled_from([0.0, 0.0, 1.0, -0.5, 2, float("nan")]), label="beta")
    la = data.draw(st.sampled_from(LAYOUTS), label="a layout")
    lb = data.draw(st.sampled_from(LAYOUTS), label="b layout")
    kinds = data.draw(st.tuples(*[st.sampled_from(["torch", "torch", "view", "interface", "dlpack"])] * 3),
                      label="kinds")
    out_how = data.draw(st.sampled_from([None, None, "fresh", "column-major", "padded", "alias a",
                                         "alias b", "wrong shape", "wrong dtype", "expanded", "cpu"]),
                        label="out")
    stream = data.draw(streams.strategy(), label="stream") if data.draw(st.booleans()) else None
    ctx_arg = data.draw(st.sampled_from([None, None, context, "ctx"]), label="ctx")
    seed = data.draw(st.integers(0, 2**31), label="seed")

    ta = trans_a if isinstance(trans_a, bool) else False
    tb = trans_b if isinstance(trans_b, bool) else False
    a_shape = ((k, m) if ta else (m, k))
    b_shape = ((n, k) if tb else (k, n))
    if ndim == 3:
        a_shape, b_shape = (batch,) + a_shape, (b_batch,) + b_shape
    if a_dim != ndim:
        a_shape = a_shape[1:] if a_dim < ndim else (1,) + a_shape
    spec = lambda shape, dt, layout, s: {"dtype": dt, "shape": shape, "layout": layout,  # noqa: E731
                                         "shift": 1 + s % 7, "seed": s}
    a = make(torch, spec(a_shape, dtype, la, seed), dev)
    b = make(torch, spec(b_shape, b_dtype, lb, seed + 1), dev)
    # A batch of 1 broadcasts against the other batch, 0 included (torch.matmul's rule: (0, m, k)
    # with (1, k, n) gives (0, m, n)).
    out_shape = (m, n) if ndim == 2 else (b_batch if batch == 1 else batch, m, n)
    c0 = None
    kw = {"trans_a": trans_a, "trans_b": trans_b, "alpha": alpha, "beta": beta, "tf32": tf32}
    td = _torch_dtype(torch, dtype)
    if out_how is not None:
        if out_how == "fresh":
            c = torch.randn(out_shape, device=dev).to(td)
        elif out_how == "column-major":
            c = torch.randn(out_shape[:-2] + (n, m), device=dev).to(td).transpose(-1, -2)
        elif out_how == "padded":
            c = torch.randn(out_shape[:-1] + (n + 3,), device=dev).to(td)[..., :n]
        elif out_how == "alias a":
            c = a
        elif out_how == "alias b":
            c = b
        elif out_how == "wrong shape":
            c = torch.empty(out_shape[:-1] + (n + 1,), dtype=td, device=dev)
        elif out_how == "wrong dtype":
            c = torch.empty(out_shape, dtype=torch.float64, device=dev)
        elif out_how == "expanded":
            c = torch.zeros(out_shape[:-2] + (1, n), dtype=td, device=dev).expand(out_shape)
        else:
            c = torch.empty(out_shape, dtype=td)
        c0 = snapshot(torch, c)
        kw["out"] = c
    if stream is not None:
        kw["stream"] = stream
    if ctx_arg is not None:
        kw["ctx"] = ctx_arg
    a0, b0 = snapshot(torch, a), snapshot(torch, b)
    ao, bo = as_kind(torch, a, kinds[0], context), as_kind(torch, b, kinds[1], context)
    if "out" in kw and kw["out"] is a:
        kw["out"] = ao
    elif "out" in kw and kw["out"] is b:
        kw["out"] = bo
    elif "out" in kw:
        kw["out"] = as_kind(torch, kw["out"], kinds[2], context)
    fn = getattr(inferctx, entry)
    out = attempt(lambda: fn(ao, bo, **kw), KERNEL_ERRORS, producer_ok=True)
    # Carve-out: torch's own __dlpack__ refuses stream 2 (as in test_gpu_dropout).
    if passed_through_from_producer(torch, context, out, "dlpack" in kinds, stream):
        return
    must_fail = (b_dtype != dtype or a_dim != ndim or not isinstance(trans_a, bool)
                 or not isinstance(trans_b, bool) or "cpu" in (la, lb, out_how)
                 or out_how in ("wrong shape", "wrong dtype") or ctx_arg is not None and ctx_arg is not context
                 or streams.bad(stream) or isinstance(alpha, (bool, str))
                 or (beta != 0 and out_how is None) or (tf32 is not True and tf32 is not False)
                 or ndim == 3 and b_batch not in (batch, 1) and batch != 1)
    if must_fail:
        assert isinstance(out, Raised), f"expected a documented error, got {out!r}"
    # Valid by construction, besides not must_fail: alpha and beta finite (NaN and inf are
    # refused: the product scales by them in float32), a and b each readable in place (the
    # "strided" and "expanded" layouts are not, unless their sizes make the odd stride not
    # matter), and out None or an array of its own of the right shape and dtype that is
    # readable in place ("fresh", "column-major", "padded"; "expanded" where it is readable,
    # i.e. m <= 1 or n == 0). "alias a" / "alias b" share an input's memory (refused) or
    # have another shape, so they are never required.
    must_succeed = (not must_fail and math.isfinite(float(alpha)) and math.isfinite(float(beta))
                    and _gemm_readable(a) and _gemm_readable(b)
                    and (out_how in (None, "fresh", "column-major", "padded")
                         or out_how == "expanded" and _gemm_readable(c)))
    if must_succeed:
        draw = {"entry": entry, "dtype": dtype, "mnk": (m, n, k), "batch": (batch, b_batch),
                "trans": (trans_a, trans_b), "tf32": tf32, "alpha": alpha, "beta": beta,
                "layouts": (la, lb), "shapes": (tuple(a.shape), tuple(b.shape)),
                "strides": (a.stride(), b.stride()), "kinds": kinds, "out": out_how, "stream": stream,
                "ctx": ctx_arg}
        assert not isinstance(out, Raised), f"a valid {entry} was refused: {draw} -> {out!r}"
    if isinstance(out, Raised):
        healthy(torch, context)
        return
    if "out" in kw:
        assert out is kw["out"]
    res = to_torch(torch, out)
    assert tuple(res.shape) == out_shape and res.dtype == td
    torch.cuda.synchronize()
    op_a = a0.double().transpose(-1, -2) if ta else a0.double()
    op_b = b0.double().transpose(-1, -2) if tb else b0.double()
    want = float(alpha) * torch.matmul(op_a, op_b)
    if c0 is not None and float(beta) != 0.0:
        want = want + float(beta) * c0.double()
    if math.isfinite(float(alpha)) and math.isfinite(float(beta)) and res.numel():
        got = res.double()
        err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err < _gemm_bound(dtype, tf32 is True) or (got - want).abs().max().item() < 1e-6, err
    healthy(torch, context)


# -- hostile operands on the GPU -----------------------------------------------------------------

def _hostile(torch, how, t):
    """An object standing for tensor t (4096 float32 elements on the GPU) whose protocol raises
    or lies in a way inferctx can detect; None for the cases that are t's own memory, honestly
    described (a correct result is then due)."""
    itf = {"shape": tuple(t.shape), "typestr": "<f4", "data": (t.data_ptr(), False), "version": 3,
           "stream": None}
    if how == "interface raises":
        return CAI(ProducerError("the interface is broken"), t)
    if how == "interface raises TypeError":
        return CAI(TypeError("a property that raises TypeError"), t)  # marked when raised
    if how == "pointer 8":
        return CAI(dict(itf, data=(8, False)), t)
    if how == "host pointer":
        host = np.zeros(t.numel(), np.float32)
        return CAI(dict(itf, data=(host.ctypes.data, False)), (t, host))
    if how == "typestr <i8":
        return CAI(dict(itf, typestr="<i8", shape=(t.numel() // 2,)), t)
    if how == "typestr bad":
        return CAI(dict(itf, typestr="<x4"), t)
    if how == "strides not items":
        return CAI(dict(itf, strides=(6,)), t)
    if how == "negative shape":
        return CAI(dict(itf, shape=(-4, -1024)), t)
    if how == "negative 1-D shape":
        return CAI(dict(itf, shape=(-1,)), t)
    if how == "read-only":
        return CAI(dict(itf, data=(t.data_ptr(), True)), t)
    if how == "stream 0":
        return CAI(dict(itf, stream=0), t)
    if how == "stream 2":
        return CAI(dict(itf, stream=2), t)
    if how == "stream True":
        return CAI(dict(itf, stream=True), t)
    if how == "stream str":
        return CAI(dict(itf, stream="1"), t)
    if how == "masked":
        return CAI(dict(itf, mask=t), t)
    if how == "honest interface":
        return CAI(itf, t)
    if how == "dlpack raises":
        return DLPackOnly(ProducerError("no capsule today"), device=(2, t.get_device()))
    if how == "dlpack non-capsule":
        return DLPackOnly(lambda stream, max_version: 12345, device=(2, t.get_device()))
    if how == "dlpack None":
        return DLPackOnly(lambda stream, max_version: None, device=(2, t.get_device()))
    if how == "dlpack used capsule":
        return DLPackOnly(lambda stream, max_version: used_capsule(), device=(2, t.get_device()))
    if how == "dlpack host capsule":
        return DLPackOnly(lambda stream, max_version: np.ones(4096, np.float32).__dlpack__(),
                          device=(2, t.get_device()))
    if how == "dlpack device says CPU":
        return DLPackOnly(lambda stream, max_version: t.__dlpack__(stream=stream), device=(1, 0))
    if how == "dlpack device 63":
        return DLPackOnly(lambda stream, max_version: t.__dlpack__(stream=stream), device=(2, 63))
    if how == "dlpack device raises":
        return DLPackOnly(lambda stream, max_version: t.__dlpack__(stream=stream),
                          device=ProducerError("which device?"))
    if how == "honest dlpack":
        return DLPackOnly(lambda stream, max_version: t.__dlpack__(stream=stream), device=(2, t.get_device()))
    if how == "honest dlpack without device":
        return DLPackOnly(lambda stream, max_version: t.__dlpack__(stream=stream))
    raise AssertionError(how)


HOSTILE = ["interface raises", "interface raises TypeError", "pointer 8", "host pointer", "typestr <i8",
           "typestr bad", "strides not items", "negative shape", "negative 1-D shape", "read-only",
           "stream 0", "stream 2", "stream True", "stream str", "masked", "honest interface",
           "dlpack raises", "dlpack non-capsule", "dlpack None", "dlpack used capsule",
           "dlpack host capsule", "dlpack device says CPU", "dlpack device 63", "dlpack device raises",
           "honest dlpack", "honest dlpack without device"]
HONEST = {"honest interface", "honest dlpack", "honest dlpack without device", "stream 2"}


@pytest.mark.gpu
@FUZZ
@given(how=st.sampled_from(HOSTILE), role=st.sampled_from(["x", "out", "grad", "a", "b", "c"]),
       p=st.floats(0.0, 1.0), seed=st.integers(0, 2**31))
def test_gpu_hostile_operands(gpu, how, role, p, seed):
    """One operand whose protocol raises or lies (detectably: a real allocation of 4096 float32
    stands behind every pointer that is on the device), the others valid torch tensors."""
    torch, context, _ = gpu
    dev = f"cuda:{context.device}"
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = (torch.randn(4096, generator=g) * 3).to(dev)
    torch.cuda.synchronize()
    x = (torch.randn(4096, generator=g) * 3).to(dev)
    if role in ("a", "b", "c"):
        t, x = t.reshape(64, 64), x.reshape(64, 64)
    hostile = _hostile(torch, how, t)
    honest = how in HONEST
    if role in ("x", "out"):
        x_arg = hostile if role == "x" else x
        kw = {"seed": 9, "offset": 4 * seed}
        if role == "out":
            kw["out"] = hostile
        x0 = (t if role == "x" else x).clone()
        out = attempt(lambda: inferctx.dropout(x_arg, p, **kw), KERNEL_ERRORS, producer_ok=True)
        if honest and not isinstance(out, Raised):
            torch.cuda.synchronize()
            y = t if role == "out" else to_torch(torch, out[0])
            _check_dropout_values(torch, x0, y, ref.dropout_keep(9, 4 * seed, p, 4096), p)
        if how == "read-only" and role == "out":
            assert isinstance(out, Raised), "a read-only out was written"
    elif role == "grad":
        keep = np.random.default_rng(seed).random(4096) < 0.5
        mask = torch.from_numpy(ref.pack_bits(keep).view(np.int32)).to(dev)
        g0 = t.clone()
        out = attempt(lambda: inferctx.apply_mask(hostile, mask, p), KERNEL_ERRORS, producer_ok=True)
        if honest and not isinstance(out, Raised):
            torch.cuda.synchronize()
            _check_dropout_values(torch, g0, out, keep, p)
    else:
        args = {"a": (hostile, x, None), "b": (x, hostile, None), "c": (x, x, hostile)}[role]
        kw = {} if args[2] is None else {"out": args[2]}
        a0 = t.double() if role == "a" else x.double()
        b0 = t.double() if role == "b" else x.double()
        out = attempt(lambda: inferctx.gemm(args[0], args[1], **kw), KERNEL_ERRORS, producer_ok=True)
        if honest and not isinstance(out, Raised):
            torch.cuda.synchronize()
            want = a0 @ b0
            got = (t if role == "c" else to_torch(torch, out)).double()
            assert ((got - want).norm() / want.norm()).item() < 1e-5
    if how in ("pointer 8", "host pointer", "typestr bad", "strides not items", "masked", "dlpack raises",
               "dlpack non-capsule", "dlpack None", "dlpack used capsule", "dlpack host capsule",
               "dlpack device says CPU", "interface raises", "interface raises TypeError", "stream True",
               "stream str"):
        assert isinstance(out, Raised), f"{how} as {role} gave {out!r}"
    # Every HONEST case (t's own memory, honestly described; "stream 2" names a real stream for
    # the producer's pending work) is a valid call: it must succeed. Carve-out: "honest dlpack
    # without device" has no __dlpack_device__, which DLPack's Python protocol asks of every
    # producer; gemm reads the device before importing (gemm.py's _device_hint) and refuses such
    # an operand with ConfigError naming it, where dropout and apply_mask import it to learn the
    # device. For gemm it may be refused that way, and only that way.
    no_device_for_gemm = how == "honest dlpack without device" and role in ("a", "b", "c")
    if honest and not no_device_for_gemm:
        assert not isinstance(out, Raised), f"honest {how} as {role} (p={p}, seed={seed}) was refused: {out!r}"
    if no_device_for_gemm and isinstance(out, Raised):
        assert isinstance(out.exc, ConfigError) and out.exc.argument == {"a": "a", "b": "b", "c": "out"}[role], \
            f"{how} as {role}: {out!r}"
    healthy(torch, context)


MISALIGNED_SCRIPT = r"""
import json, sys, torch, inferctx
from inferctx import ConfigError, WorkspaceStateError

class CAI:
    def __init__(self, d, keep): self.d, self.keep = d, keep
    @property
    def __cuda_array_interface__(self): return self.d

TYPESTR = {torch.float32: "<f4", torch.float16: "<f2"}
def view(buf, offset, shape, dtype):
    return CAI({"shape": shape, "typestr": TYPESTR[dtype], "data": (buf.data_ptr() + offset, False),
                "version": 2}, buf)

for dtype in (torch.float32, torch.float16):
    size = torch.tensor([], dtype=dtype).element_size()
    for offset in range(1, 17):
        buf = torch.zeros(64 * 64 * 4 + 64, dtype=torch.uint8, device="cuda")
        for entry in ("dropout", "apply_mask", "gemm", "bmm"):
            torch.cuda.synchronize()
            try:
                if entry == "dropout":
                    inferctx.dropout(view(buf, offset, (1000,), dtype), 0.5)
                elif entry == "apply_mask":
                    m = torch.ones(1000, dtype=torch.uint8, device="cuda")
                    inferctx.apply_mask(view(buf, offset, (1000,), dtype), m, 0.5)
                elif entry == "gemm":
                    inferctx.gemm(view(buf, offset, (32, 32), dtype), view(buf, offset, (32, 32), dtype))
                else:
                    inferctx.bmm(view(buf, offset, (2, 16, 16), dtype), view(buf, offset, (2, 16, 16), dtype))
                what = "result"
            except ConfigError as e:
                what = "ConfigError"
            except Exception as e:
                what = f"{type(e).__name__}: {e}"
            try:
                torch.cuda.synchronize()
                y, _ = inferctx.dropout(torch.ones(64, device="cuda"), 0.0)
                torch.cuda.synchronize()
                ok = bool((y == 1).all())
            except Exception as e:
                ok = f"{type(e).__name__}: {e}"
            print(json.dumps({"dtype": str(dtype), "offset": offset, "entry": entry, "outcome": what,
                              "then": ok, "aligned": offset % size == 0}), flush=True)
            if ok is not True:
                sys.exit(3)
"""


@pytest.mark.gpu
def test_gpu_misaligned_operands_in_a_child_process(torch):
    """Operands at every byte offset 1..16 from an allocation (a bare __cuda_array_interface__,
    which can point anywhere): a result where the address is element-aligned, ConfigError where
    it is not, and never a fault. A child process runs them, since a misaligned access is a
    sticky error that would end every later test in this one."""
    child = subprocess.run([sys.executable, "-c", MISALIGNED_SCRIPT], capture_output=True, text=True,
                           timeout=300)
    lines = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    # An element-aligned operand is valid (the buffer is large enough for every shape at every
    # offset): a result is due, a ConfigError there is a false refusal.
    bad = [r for r in lines if r["then"] is not True or r["outcome"] not in ("result", "ConfigError")
           or (r["outcome"] == "result" and not r["aligned"])
           or (r["aligned"] and r["outcome"] != "result")]
    assert child.returncode == 0 and not bad, (child.returncode, bad, child.stderr[-3000:])
    assert len(lines) == 2 * 16 * 4


# -- the context's methods -----------------------------------------------------------------------

WILD_INT = st.one_of(st.integers(-3, 70), st.integers(-2**64, 2**64 + 5),
                     st.sampled_from([True, False, 1.0, "1", None, np.int64(2), np.uint8(3)]))
DTYPES_FOR_VIEWS = st.sampled_from(["float32", "float16", "bfloat16", "uint8", "int64", "bool", "bf16",
                                    "complex64", 3, None, "float"])


@pytest.mark.gpu
@FUZZ
@given(ops=st.lists(st.tuples(st.sampled_from(
    ["kv_cache", "activations", "attention_scores", "workspace", "increment_offset", "advance_tokens",
     "reset_tokens", "set_seed", "use_stream", "release", "retake", "view", "sync", "export"]),
    WILD_INT, WILD_INT, DTYPES_FOR_VIEWS, st.integers(0, 1000)), min_size=1, max_size=8))
def test_gpu_context_methods(gpu, ops):
    """Sequences of the context's methods with wild arguments, against a model of its state."""
    torch, context, streams = gpu
    plan = context.plan
    layers = SHAPE.num_layers
    limit = context.max_token_length
    tokens = context.current_tokens
    seed, offset = context.rng_state
    released = context.released
    ws_ptr, ws_bytes = context.workspace.ptr, context.workspace_bytes
    views = []
    for op, u, v, dt, pick in ops:
        if op == "kv_cache":
            out = attempt(lambda: context.kv_cache(u), CONTEXT_ERRORS)
            ok_layer = type(u) is int and 0 <= u < layers or isinstance(u, np.integer) and 0 <= u < layers
            if released or not ok_layer:
                assert isinstance(out, Raised), out
            if not isinstance(out, Raised):
                k, val = out
                assert k.shape == val.shape
                assert k.shape[0] == plan.batch_size and k.shape[2] == plan.max_tokens
                assert ws_ptr <= k.ptr < val.ptr < ws_ptr + ws_bytes and k.dtype == "float16"
                views += [k, val]
        elif op in ("activations", "attention_scores", "workspace"):
            out = attempt(lambda: getattr(context, op), CONTEXT_ERRORS)
            if released:
                assert isinstance(out, Raised), out
            else:
                assert not isinstance(out, Raised), out
                assert ws_ptr <= out.ptr and out.ptr + out.nbytes <= ws_ptr + ws_bytes
                views.append(out)
        elif op == "increment_offset":
            out = attempt(lambda: context.increment_offset(u), CONTEXT_ERRORS)
            valid = (type(u) is int or isinstance(u, np.integer)) and 0 <= int(u) < 2**64
            step = (int(u) + 3) // 4 * 4 if valid else None
            if not valid or step > 2**63 - offset:
                assert isinstance(out, Raised) and isinstance(out.exc, ConfigError), out
            else:
                assert out == (seed, offset), (out, seed, offset)
                offset += step
        elif op == "advance_tokens":
            out = attempt(lambda: context.advance_tokens(u), CONTEXT_ERRORS)
            valid = type(u) is int or isinstance(u, np.integer)
            if valid and 1 <= int(u) <= limit - tokens:
                assert out is None, out
                tokens += int(u)
            else:
                assert isinstance(out, Raised), out
                if valid and int(u) > limit - tokens and -2**63 <= int(u) < 2**63:
                    assert isinstance(out.exc, TokenLimitError)
        elif op == "reset_tokens":
            out = attempt(lambda: context.reset_tokens(u), CONTEXT_ERRORS)
            valid = (type(u) is int or isinstance(u, np.integer)) and 0 <= int(u) <= limit
            if valid:
                assert out is None, out
                tokens = int(u)
            else:
                assert isinstance(out, Raised), out
        elif op == "set_seed":
            out = attempt(lambda: context.set_seed(u), CONTEXT_ERRORS)
            if (type(u) is int or isinstance(u, np.integer)) and 0 <= int(u) < 2**64:
                assert out is None, out
                seed, offset = int(u), 0
            else:
                assert isinstance(out, Raised), out
        elif op == "use_stream":
            choice = (streams.valid + streams.invalid)[pick % (len(streams.valid) + len(streams.invalid))]
            out = attempt(lambda: context.use_stream(choice), CONTEXT_ERRORS)
            if streams.bad(choice):
                assert isinstance(out, Raised), out
            else:
                assert out is None, out
        elif op == "release":
            force = u if isinstance(u, bool) else False
            keep = v if any(v is w for w in (True, False, None, 1)) else False
            out = attempt(lambda: context.release_workspace(force, keep_contents=keep), CONTEXT_ERRORS)
            if not isinstance(keep, bool):
                assert isinstance(out, Raised) and isinstance(out.exc, ConfigError), out
            elif not isinstance(out, Raised):
                assert context.released
            # force is a bool by construction. Under virtual memory neither views alive nor an
            # earlier release stops a release (release_workspace's docstring: views are no
            # obstacle; nothing to do when no workspace is held). Under the cudaMalloc fallback
            # views alive refuse it (WorkspaceInUseError), so nothing is required there.
            if isinstance(keep, bool) and context.addresses_stable:
                assert not isinstance(out, Raised), \
                    f"release_workspace({force}, keep_contents={keep}) refused (released={released}): {out!r}"
            released = context.released
        elif op == "retake":
            out = attempt(context.retake_workspace, CONTEXT_ERRORS)
            # The fixture's plan is in force: a released workspace is taken back (the memory it
            # gave up is free again), a held one needs nothing.
            assert not isinstance(out, Raised), f"retake_workspace refused (released={released}): {out!r}"
            if not isinstance(out, Raised):
                assert out is True
            released = context.released
            assert not released or isinstance(out, Raised)
        elif op == "view" and views:
            base = views[pick % len(views)]
            out = attempt(lambda: base.view(dt, u if not isinstance(u, int) or u < 10**6 else (u,),
                                            v if isinstance(v, int) and abs(v) < 10**7 else v),
                          CONTEXT_ERRORS)
            if not isinstance(out, Raised):
                assert base.ptr <= out.ptr and out.ptr + out.nbytes <= base.ptr + base.nbytes
                views.append(out)
        elif op == "sync":
            assert attempt(context.sync_comp, CONTEXT_ERRORS) is None
            assert attempt(context.sync_comm, CONTEXT_ERRORS) is None
        elif op == "export" and views:
            view = views[pick % len(views)]
            out = attempt(lambda: torch.from_dlpack(view), DLPACK_ERRORS)
            if released and context.addresses_stable:
                assert isinstance(out, Raised), out
            elif not released:  # a view of the held workspace (or, under the fallback, of a detached one)
                assert not isinstance(out, Raised), \
                    f"export of {view!r} refused while the workspace is held: {out!r}"
            if not isinstance(out, Raised):
                assert out.data_ptr() == view.ptr or view.nbytes == 0
                del out
        assert context.current_tokens == tokens
        assert context.rng_state == (seed, offset)
        assert context.released == released
    del views
    collect()
    restore(context)
    healthy(torch, context)


# -- gen_workspace -------------------------------------------------------------------------------

@pytest.mark.gpu
@FUZZ
@given(data=st.data())
def test_gpu_gen_workspace_odd_arguments(gpu, data):
    """gen_workspace with odd arguments against the device: a plan whose views match it, or a
    documented error with the previous plan and its workspace still in force and usable."""
    torch, context, _ = gpu
    heads = data.draw(st.sampled_from([1, 2, 4, 8]), label="heads")
    head = data.draw(st.sampled_from([16, 32, 64, 80, 128]), label="head_dim")
    layers = data.draw(st.integers(1, 6), label="layers")
    kv = data.draw(st.sampled_from([heads, 1, max(1, heads // 2)]), label="kv heads")
    shape = inferctx.ModelShape(layers, heads, heads * head, num_kv_heads=kv)
    odd = st.one_of(st.integers(-2, 0), st.sampled_from([2**40, 2**63 - 1, 2**64, True, 1.5, "4", None]))
    kwargs = {
        "batch_size": data.draw(st.integers(1, 8) | odd, label="batch"),
        "prompt_len": data.draw(st.integers(0, 64) | odd, label="prompt"),
        "max_out_tokens": data.draw(st.integers(1, 512) | odd, label="max_out"),
        "min_out_tokens": data.draw(st.integers(1, 64) | odd, label="min_out"),
        "dtype": data.draw(st.sampled_from(["float16", "bf16", "float32", "int8", None]), label="dtype"),
        "memory_limit_bytes": data.draw(st.one_of(st.integers(1, 256 * MIB), st.sampled_from([0, -1, 2**70])),
                                        label="limit"),
        "external_cache": data.draw(st.sampled_from([False, False, True, 1]), label="external"),
    }
    if data.draw(st.booleans(), label="fraction"):
        kwargs["memory_fraction"] = data.draw(st.sampled_from([0.5, 0.0, 1.0, 1.5, float("nan"), -0.1]))
    # The arguments whose value is odd (outside the valid range of its plain strategy, or a value
    # the planner refuses on its own: prompt_len 0, since it must be >= 1), and those two that
    # the planner refuses against max_out_tokens (min_out_tokens or prompt_len above it). The
    # model shape is valid by construction (kv heads divide heads, hidden = heads x head_dim).
    def plain_int(name, low, high):
        value = kwargs[name]
        return type(value) is int and low <= value <= high

    odd_args = {name for name, plain in (
        ("batch_size", plain_int("batch_size", 1, 8)),
        ("prompt_len", plain_int("prompt_len", 1, 64)),
        ("max_out_tokens", plain_int("max_out_tokens", 1, 512)),
        ("min_out_tokens", plain_int("min_out_tokens", 1, 64)),
        ("dtype", kwargs["dtype"] in ("float16", "bf16", "float32")),
        ("memory_limit_bytes", plain_int("memory_limit_bytes", 1, 256 * MIB)),
        ("external_cache", type(kwargs["external_cache"]) is bool),
        ("memory_fraction", kwargs.get("memory_fraction", 0.5) in (0.5, 1.0)),
    ) if not plain}
    max_out = kwargs["max_out_tokens"]
    for name in ("min_out_tokens", "prompt_len"):
        if type(kwargs[name]) is int and type(max_out) is int and kwargs[name] > max_out:
            odd_args.add(name)
    before_plan, before_bytes = context.plan, context.workspace_bytes
    out = attempt(lambda: context.gen_workspace(shape, **kwargs), CONTEXT_ERRORS + (CudaError,))
    if isinstance(out, Raised):
        assert not isinstance(out.exc, CudaError), out  # listed only to report it as such
        if isinstance(out.exc, ConfigError):  # it names what was wrong: one of the odd arguments
            assert out.exc.argument in odd_args, \
                f"ConfigError names {out.exc.argument!r}; the odd arguments: {sorted(odd_args)}; {out!r}"
        assert context.plan is before_plan and context.workspace_bytes == before_bytes
        assert not context.released
    else:
        assert context.plan is out and context.workspace_bytes == out.workspace_bytes
        assert context.max_token_length == out.max_tokens
        assert out.workspace_bytes <= max(kwargs["memory_limit_bytes"], 0) + context.allocation_granularity
    ws = context.workspace
    plan = context.plan
    assert ws.nbytes == context.workspace_bytes
    if not plan.external_cache:
        k, v = context.kv_cache(0)
        assert k.shape[0] == plan.batch_size and k.shape[2] == plan.max_tokens
        assert ws.ptr <= k.ptr and v.ptr + v.nbytes <= ws.ptr + ws.nbytes
        tk = torch.from_dlpack(k)
        tk.fill_(1.0)
        y, _ = inferctx.dropout(k, 0.0)
        torch.cuda.synchronize()
        assert bool((torch.from_dlpack(y) == 1).all())
        del k, v, tk, y
    del ws
    if data.draw(st.booleans(), label="back to the small plan"):
        plan_small(context)
    healthy(torch, context)


# -- DeviceView exports --------------------------------------------------------------------------

@pytest.mark.gpu
@FUZZ
@given(data=st.data())
def test_gpu_device_view_exports(gpu, data):
    torch, context, streams = gpu
    source = data.draw(st.sampled_from(["kv", "activations", "scores", "pool", "sub-view", "empty"]),
                       label="view")
    if source == "kv":
        view = context.kv_cache(data.draw(st.integers(0, SHAPE.num_layers - 1)))[data.draw(st.integers(0, 1))]
    elif source == "activations":
        view = context.activations
    elif source == "scores":
        view = context.attention_scores
    elif source == "pool":
        view = inferctx._core._empty(context.device, tuple(data.draw(st.lists(st.integers(0, 9), max_size=3))),
                                     data.draw(st.sampled_from(["float32", "bfloat16", "int8", "bool"])))
    elif source == "sub-view":
        dt = data.draw(st.sampled_from(["float32", "float16", "bfloat16", "uint8", "int64"]))
        size = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1, "int64": 8}[dt]
        view = context.workspace.view(dt, (data.draw(st.integers(0, 64)),), offset=size * data.draw(st.integers(0, 100)))
    else:
        view = context.workspace.view("uint8", (0,))
    stream = data.draw(st.one_of(DL_STREAM, st.sampled_from([streams.side.handle, context.stream.handle])),
                       label="stream")
    max_version = data.draw(MAX_VERSION, label="max_version")
    dl_device = data.draw(st.one_of(DL_DEVICE, st.just((2, context.device)), st.just((2, context.device + 1))),
                          label="dl_device")
    copy = data.draw(COPY, label="copy")
    torch.from_dlpack(view).reshape(-1).view(torch.uint8).copy_(
        torch.arange(view.nbytes, device=f"cuda:{context.device}").to(torch.uint8)) if view.nbytes else None
    torch.cuda.synchronize()
    want = torch.arange(view.nbytes).to(torch.uint8)
    collect()  # views of earlier examples that only a collection frees are not this one's
    alive = context.views_alive
    out = attempt(lambda: view.__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device,
                                          copy=copy), DLPACK_ERRORS + (TypeError,))
    if stream is None and max_version is None and dl_device is None and copy is None:
        # Every argument at its default (a legacy capsule of the view itself, ordered on the
        # legacy default stream), on a held workspace: always valid.
        assert not isinstance(out, Raised), f"__dlpack__() of a {source} view {view!r} was refused: {out!r}"
    if isinstance(out, Raised) and isinstance(out.exc, TypeError):
        assert not (max_version is None or (isinstance(max_version, tuple) and len(max_version) == 2
                                            and all(isinstance(v, int) and not isinstance(v, bool)
                                                    for v in max_version))), out
        assert "max_version" in str(out.exc), out
    if not isinstance(out, Raised):
        versioned = max_version is not None and max_version[0] >= 1
        assert capsule_name(out) == ("dltensor_versioned" if versioned else "dltensor")
        managed, t, shape, strides = read(out)
        assert shape == list(view.shape) and strides == list(view.strides) and t.byte_offset == 0
        to_host = dl_device is not None and int(dl_device[0]) in (1, 3)
        copied = to_host or copy is True
        if versioned:
            assert bool(managed.flags & IS_COPIED) == copied
        if not copied:
            assert t.data == (view.ptr or None) and (t.device.device_type, t.device.device_id) == (2, view.device)
        if to_host:
            torch.cuda.synchronize()
            got = (ctypes.c_uint8 * view.nbytes).from_address(t.data) if view.nbytes else []
            assert bytes(got) == bytes(want.numpy()), "host copy differs"
        del managed, t, out
    itf = attempt(lambda: view.__cuda_array_interface__, (TypeError, WorkspaceStateError))
    if view.dtype == "bfloat16":
        assert isinstance(itf, Raised) and isinstance(itf.exc, TypeError), itf
    else:
        assert not isinstance(itf, Raised), itf
        assert itf["shape"] == view.shape and itf["data"] == (view.ptr if view.size else 0, False)
        assert itf["version"] == 3 and itf["strides"] is None
    assert view.__dlpack_device__() == (2, context.device)
    got = torch.from_dlpack(view).reshape(-1).view(torch.uint8).cpu() if view.nbytes else want
    assert torch.equal(got, want)
    collect()
    assert context.views_alive == alive
    healthy(torch, context)


# -- pinned buffers ------------------------------------------------------------------------------

@pytest.mark.gpu
@FUZZ
@given(nbytes=st.one_of(st.integers(0, 1 << 16), st.integers(2**45, 2**62), st.integers(max_value=-1),
                        st.sampled_from([True, 1.5, "8", None])),
       view_bytes=st.integers(0, 4096), stream=st.sampled_from([None, None, 1, "x", -3, True]),
       direction=st.sampled_from(["to", "from", "both"]), pinned_kind=st.sampled_from(["pinned", "pinned",
                                                                                        "bytearray", "numpy"]))
def test_gpu_pinned_buffers(gpu, nbytes, view_bytes, stream, direction, pinned_kind):
    torch, context, _ = gpu
    buf = attempt(lambda: inferctx.PinnedBuffer(nbytes), (ConfigError, CudaError))
    valid = type(nbytes) is int and 0 <= nbytes
    if not valid:
        assert isinstance(buf, Raised) and isinstance(buf.exc, ConfigError), buf
    if isinstance(buf, Raised):
        assert valid or isinstance(buf.exc, ConfigError)
        if valid:
            assert nbytes >= 2**45, buf  # only what the host cannot pin may fail
        healthy(torch, context)
        return
    assert len(buf) == buf.nbytes == nbytes
    host = np.frombuffer(buf, dtype=np.uint8)
    host[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
    view = inferctx._core._empty(context.device, (view_bytes,), "uint8")
    target = {"pinned": buf, "bytearray": bytearray(nbytes), "numpy": host}[pinned_kind]
    # A stream handle is an int and never a bool (True == 1, but stream=True is refused).
    stream_ok = stream is None or (type(stream) is int and stream == 1)
    if direction in ("from", "both"):
        out = attempt(lambda: view.copy_from_host(target, stream=stream), KERNEL_ERRORS)
        ok = pinned_kind == "pinned" and nbytes >= view_bytes and stream_ok
        assert isinstance(out, Raised) != ok, out
        if ok:
            buf.synchronize()
            torch.cuda.synchronize()
            assert bytes(torch.from_dlpack(view).cpu().numpy()) == bytes(host[:view_bytes])
    if direction in ("to", "both"):
        host[:] = 0
        torch.from_dlpack(view).fill_(7) if view_bytes else None
        torch.cuda.synchronize()
        out = attempt(lambda: view.copy_to_host(target, stream=stream), KERNEL_ERRORS)
        ok = pinned_kind == "pinned" and nbytes >= view_bytes and stream_ok
        assert isinstance(out, Raised) != ok, out
        if ok:
            buf.synchronize()
            assert (np.frombuffer(buf, dtype=np.uint8)[:view_bytes] == 7).all()
    healthy(torch, context)


# -- autotune_gemm -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.usefixtures("_clean_gemm_cache")
@FUZZ_SLOW
@given(data=st.data())
def test_gpu_autotune_gemm(gpu, data, tmp_path_factory):
    """autotune_gemm with valid and invalid arguments; a tuned problem's gemm matches torch."""
    torch, context, _ = gpu
    shapes = data.draw(st.one_of(
        st.lists(st.sampled_from([(8, 8, 8), (1, 16, 8), (2, 8, 16, 8), (3, 5, 7)]), min_size=1, max_size=2),
        st.sampled_from([[(0, 1, 1)], [(1, 2)], [("a", 2, 3)], None, [], (4, 4, 4)])), label="shapes")
    dtype = data.draw(st.sampled_from(["float16", "bfloat16", "float32", "fp16", torch.float16, "int8", None]),
                      label="dtype")
    trans_a, trans_b = data.draw(st.booleans(), label="trans_a"), data.draw(st.booleans(), label="trans_b")
    max_algorithms = data.draw(st.sampled_from([1, 2, 0, 257, -1, 1.5]), label="max_algorithms")
    repeats = data.draw(st.sampled_from([1, 1, 0]), label="repeats")
    cache = data.draw(st.sampled_from([None, None, "file", "bad file"]), label="cache_file")
    path = None
    if cache is not None:
        path = tmp_path_factory.mktemp("gemm") / "cache.json"
        if cache == "bad file":
            path.write_text("{not json")
    out = attempt(lambda: inferctx.autotune_gemm(shapes, dtype, trans_a=trans_a, trans_b=trans_b,
                                                 max_algorithms=max_algorithms, warmup=0, repeats=repeats,
                                                 progress=False, cache_file=path, ctx=context),
                  (ConfigError, CudaError, WorkspaceStateError))
    # Valid by construction: a non-empty list of the valid shapes (or the one shape (4, 4, 4)
    # given bare, one problem, as the checks below read it), a dtype name or alias or the torch
    # dtype of one, max_algorithms 1 or 2, repeats 1, and no cache file or a new one. The other choices are
    # invalid: shapes [(0, 1, 1)], [(1, 2)], [("a", 2, 3)] or None; dtype "int8" or None;
    # max_algorithms 0, 257, -1 or 1.5; repeats 0; a cache file that is not JSON. Left out either
    # way: shapes [] (nothing to tune; the docstring neither allows nor refuses it).
    valid_shapes = ((isinstance(shapes, list) and len(shapes) > 0
                     and all(s in ((8, 8, 8), (1, 16, 8), (2, 8, 16, 8), (3, 5, 7)) for s in shapes))
                    or shapes == (4, 4, 4))
    valid_dtype = (dtype is torch.float16
                   or isinstance(dtype, str) and dtype in ("float16", "bfloat16", "float32", "fp16"))
    valid = (valid_shapes and valid_dtype and type(max_algorithms) is int and max_algorithms in (1, 2)
             and repeats == 1 and cache in (None, "file"))
    if shapes != []:
        draw = {"shapes": shapes, "dtype": dtype, "trans": (trans_a, trans_b), "max_algorithms": max_algorithms,
                "repeats": repeats, "cache_file": cache}
        assert isinstance(out, Raised) != valid, f"valid={valid}: {draw} -> {out!r}"
    if isinstance(out, Raised):
        assert not isinstance(out.exc, CudaError), out  # a CUDA failure from arguments is a finding
        healthy(torch, context)
        return
    assert isinstance(max_algorithms, int) and max_algorithms >= 1 and repeats == 1
    assert cache != "bad file"
    dims = [s if len(s) == 4 else (1,) + tuple(s) for s in ([shapes] if isinstance(shapes, tuple) else shapes)]
    assert [r["shape"] for r in out] == dims
    td = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32}.get(dtype, torch.float16) if not isinstance(dtype, torch.dtype) else dtype
    for r in out:
        assert r["backend"] in ("cublasLt", "cublas", "gemv") and (r["skipped"] or r["tuned_ms"] > 0)
        batch, m, n, k = r["shape"]
        a = torch.randn((batch, k, m) if trans_a else (batch, m, k), device=f"cuda:{context.device}").to(td)
        b = torch.randn((batch, n, k) if trans_b else (batch, k, n), device=f"cuda:{context.device}").to(td)
        got = inferctx.bmm(a, b, trans_a=trans_a, trans_b=trans_b)
        want = torch.matmul(a.double().transpose(1, 2) if trans_a else a.double(),
                            b.double().transpose(1, 2) if trans_b else b.double())
        torch.cuda.synchronize()
        err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err < _gemm_bound("float32" if td == torch.float32 else "float16", False)
    if cache == "file":
        assert json.loads(path.read_text())["format"] == "inferctx-gemm-cache"
    healthy(torch, context)


@pytest.fixture
def _clean_gemm_cache():
    gm.clear_gemm_cache()
    yield
    gm.clear_gemm_cache()

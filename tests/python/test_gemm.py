"""inferctx.gemm / bmm / autotune_gemm and the GEMM cache file.

Two halves. Without a GPU, the Python layer (operand layouts, transposed views, column-major
out, broadcasting, argument errors, the cache file, the progress bar) runs against a stand-in
for the compiled functions that computes GemmProblem's meaning with NumPy on host memory.
With a GPU (``gpu`` marker), everything runs for real against float64 references with torch.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import types

import numpy as np
import pytest

from inferctx.errors import ConfigError

# The module, not the function the package exports under the same name.
gm = importlib.import_module("inferctx.gemm")

# ---------------------------------------------------------------------------------------
# A stand-in for inferctx._core: host NumPy arrays posing as CUDA arrays.


class HostArray:
    """A NumPy array that claims to be CUDA memory (device 0) for the stand-in core."""

    def __init__(self, array):
        self.array = array

    def __dlpack_device__(self):
        return (2, 0)

    @property
    def shape(self):
        return self.array.shape


def _matrix_at(ptr, dtype, rows, cols, ld):
    """The rows x cols row-major matrix with leading dimension ld at address ptr."""
    itemsize = np.dtype(dtype).itemsize
    nbytes = ((rows - 1) * ld + cols) * itemsize
    buffer = (ctypes.c_char * nbytes).from_address(ptr)
    return np.ndarray((rows, cols), dtype=dtype, buffer=buffer, strides=(ld * itemsize, itemsize))


class FakeCore:
    """Records calls and computes inferctx::gemm's documented meaning on host memory."""

    NUMPY = {0: np.float32, 1: np.float16}

    def __init__(self, device=0, stream=7):
        self.calls = []
        self.tunes = []
        self.cache = []  # entries as _gemm_cache_export gives them
        self.imported = None
        self.begun = 0
        self.finished = 0
        self.context = types.SimpleNamespace(device=device,
                                             stream=types.SimpleNamespace(handle=stream))
        core = self

        class InferenceContext:
            @staticmethod
            def instance(device=None):
                return core.context

        self.InferenceContext = InferenceContext
        self.keep = []

    @staticmethod
    def _dlpack_device_of(obj, dlpack_device, argument):
        """The real check of __dlpack_device__'s answer (host code, needs no device)."""
        from inferctx import _core
        return _core._dlpack_device_of(obj, dlpack_device, argument)

    def _begin(self, operands, ctx=None, stream=None, first="a"):
        """The call contract's stand-in: the context's stream, host results."""
        core = self
        context = self.context if ctx is None else ctx
        self.begun += 1

        class Call:
            kernel = context.stream.handle if stream is None else stream

            def __init__(self):
                self.ctx = context

            def import_array(self, obj, argument):
                return core._as_cuda_array(obj, argument)

            def new_result(self, dtype, shape):
                array = np.full(shape, np.nan, dtype=np.dtype(dtype))
                view = HostArray(array)
                core.keep.append(view)
                return view

            def done(self):
                core.finished += 1

        return Call()

    def _as_cuda_array(self, obj, argument):
        if not isinstance(obj, HostArray):
            raise ConfigError(f"{argument}: not an array", argument=argument)
        a = obj.array
        return types.SimpleNamespace(
            ptr=a.ctypes.data, shape=a.shape, strides=tuple(s // a.itemsize for s in a.strides),
            dtype=a.dtype.name, device=0, owner=obj, read_only=not a.flags.writeable)

    def _address_of(self, result):
        return result.array.ctypes.data

    def _gemm(self, ctx, stream, a_ptr, b_ptr, c_ptr, dtype, trans_a, trans_b, m, n, k, batch, lda,
              ldb, ldc, stride_a, stride_b, stride_c, alpha, beta, tf32):
        assert ctx is self.context and stream == self.context.stream.handle
        for flag in (trans_a, trans_b, tf32):
            assert flag is True or flag is False
        self.calls.append(dict(dtype=dtype, trans_a=trans_a, trans_b=trans_b, m=m, n=n, k=k,
                               batch=batch, lda=lda, ldb=ldb, ldc=ldc, stride_a=stride_a,
                               stride_b=stride_b, stride_c=stride_c, alpha=alpha, beta=beta))
        a_rows, a_cols = (k, m) if trans_a else (m, k)
        b_rows, b_cols = (n, k) if trans_b else (k, n)
        # What validate_gemm enforces.
        assert lda >= max(1, a_cols) and ldb >= max(1, b_cols) and ldc >= max(1, n)
        if m == 0 or n == 0 or batch == 0:
            return
        t = self.NUMPY[dtype]
        size = np.dtype(t).itemsize
        for i in range(batch):
            c = _matrix_at(c_ptr + i * stride_c * size, t, m, n, ldc)
            if k == 0:
                product = np.zeros((m, n))
            else:
                a = _matrix_at(a_ptr + i * stride_a * size, t, a_rows, a_cols, lda).astype(np.float64)
                b = _matrix_at(b_ptr + i * stride_b * size, t, b_rows, b_cols, ldb).astype(np.float64)
                product = (a.T if trans_a else a) @ (b.T if trans_b else b)
            value = alpha * product + (beta * c.astype(np.float64) if beta != 0.0 else 0.0)
            c[...] = value.astype(t)

    def _gemm_tune(self, ctx, dtype, trans_a, trans_b, m, n, k, batch, lda, ldb, ldc, stride_a,
                   stride_b, stride_c, tf32, max_algorithms, warmup, repeats):
        problem = dict(dtype=dtype, trans_a=trans_a, trans_b=trans_b, m=m, n=n, k=k, batch=batch,
                       lda=lda, ldb=ldb, ldc=ldc, stride_a=stride_a, stride_b=stride_b,
                       stride_c=stride_c, tf32=tf32)
        self.tunes.append((problem, max_algorithms, warmup, repeats))
        self.cache.append(dict(device=ctx.device, device_name="Fake GPU", cublas_version=130100,
                               problem=problem, align_a=256, align_b=256, align_c=256, backend=0,
                               algo=[1, 2, 3, 4, 5, 6, 7, 2**64 - 1], time_ms=0.5))
        return dict(backend=0, algo_index=2, algo=[1] * 8, algo_id=21, tile_id=3, stages_id=4,
                    splitk=1, default_ms=0.75, best_ms=0.5, candidates=9, valid=8,
                    rotated_sets=4)

    def _gemm_cache_export(self, tuned_only):
        return list(self.cache)

    def _gemm_cache_import(self, entries):
        self.imported = entries
        return len(entries)

    def _gemm_cache_clear(self):
        self.cache.clear()


@pytest.fixture
def core(monkeypatch):
    fake = FakeCore()
    monkeypatch.setattr(gm, "_core", fake)
    monkeypatch.setattr(gm, "_contexts", {})
    return fake


def _random(shape, dtype, rng):
    return rng.uniform(-1, 1, size=shape).astype(dtype)


def _stored(array, how):
    """`array`'s values laid out as asked: C-contiguous, as a transposed view of a contiguous
    array, or as a slice of a wider array (padded rows)."""
    if how == "contiguous":
        return np.ascontiguousarray(array)
    if how == "transposed":
        return np.ascontiguousarray(np.swapaxes(array, -1, -2)).swapaxes(-1, -2)
    wide = np.full(array.shape[:-1] + (array.shape[-1] + 3,), np.nan, dtype=array.dtype)
    wide[..., : array.shape[-1]] = array
    return wide[..., : array.shape[-1]]


def _relative_error(got, ref):
    got = np.asarray(got, dtype=np.float64)
    norm = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / (norm if norm > 0 else 1.0))


# ---------------------------------------------------------------------------------------
# The Python layer against the stand-in (no GPU)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("a_how", ["contiguous", "transposed", "padded"])
@pytest.mark.parametrize("b_how", ["contiguous", "transposed", "padded"])
@pytest.mark.parametrize("out_how", [None, "contiguous", "transposed", "padded"])
def test_layouts_give_numpys_product(core, dtype, trans_a, trans_b, a_how, b_how, out_how):
    rng = np.random.default_rng()
    m, n, k = 5, 7, 3
    a = _random((k, m) if trans_a else (m, k), dtype, rng)
    b = _random((n, k) if trans_b else (k, n), dtype, rng)
    ref = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    out = None
    if out_how is not None:
        out = _stored(np.full((m, n), np.nan, dtype=dtype), out_how)
    result = gm.gemm(HostArray(_stored(a, a_how)), HostArray(_stored(b, b_how)),
                     out=None if out is None else HostArray(out), trans_a=trans_a, trans_b=trans_b)
    got = result.array
    assert got.shape == (m, n)
    if out is not None:
        assert got is out
        if out_how == "padded":
            assert np.isnan(out.base[:, n:]).all()  # the gap after each row is untouched
    assert _relative_error(got, ref) < (2e-3 if dtype == np.float16 else 1e-6)
    assert len(core.calls) == 1
    assert core.begun == core.finished == 1  # the caller's streams were joined after the call


def test_alpha_beta_accumulate_into_out(core):
    rng = np.random.default_rng()
    a, b = _random((4, 6), np.float32, rng), _random((6, 5), np.float32, rng)
    c0 = _random((4, 5), np.float32, rng)
    out = c0.copy()
    gm.gemm(HostArray(a), HostArray(b), out=HostArray(out), alpha=0.5, beta=-1.5)
    ref = 0.5 * a.astype(np.float64) @ b + -1.5 * c0
    assert _relative_error(out, ref) < 1e-6


def test_bmm_batches_broadcasts_and_interleaved_out(core):
    rng = np.random.default_rng()
    batch, m, n, k = 4, 3, 5, 6
    a = _random((batch, m, k), np.float32, rng)
    b = _random((1, n, k), np.float32, rng)  # one b for every a, transposed
    out = np.full((m, batch, n), np.nan, np.float32).transpose(1, 0, 2)  # interleaved rows
    gm.bmm(HostArray(_stored(a, "padded")), HostArray(b), out=HostArray(out), trans_b=True)
    ref = a.astype(np.float64) @ np.swapaxes(b, 1, 2).astype(np.float64)
    assert _relative_error(out, ref) < 1e-6
    call = core.calls[-1]
    assert call["batch"] == batch and call["stride_b"] == 0 and call["stride_c"] == n
    # A column-major 3-D a (each matrix a transposed view) and a new result.
    a_t = _stored(a, "transposed")
    result = gm.bmm(HostArray(a_t), HostArray(np.ascontiguousarray(np.swapaxes(b, 1, 2))))
    assert result.array.shape == (batch, m, n)
    assert _relative_error(result.array, ref) < 1e-6


def test_zero_sizes(core):
    rng = np.random.default_rng()
    a, b = np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32)
    result = gm.gemm(HostArray(a), HostArray(b))
    assert result.array.shape == (3, 4) and (result.array == 0).all()
    result = gm.gemm(HostArray(np.zeros((0, 5), np.float32)), HostArray(_random((5, 4), np.float32, rng)))
    assert result.array.shape == (0, 4)


def test_contiguous_call_matches_the_autotuned_problem(core):
    """A contiguous (m, k) @ (k, n) reaches _core._gemm as the packed problem autotune_gemm tunes."""
    rng = np.random.default_rng()
    gm.gemm(HostArray(_random((8, 16), np.float16, rng)), HostArray(_random((16, 32), np.float16, rng)))
    call = core.calls[-1]
    packed = gm._packed(1, 8, 32, 16, 1, False, False, False)
    for field in ("m", "n", "k", "batch", "lda", "ldb", "ldc", "trans_a", "trans_b"):
        assert call[field] == packed[field], field
    # A weight used as w.T (torch's Linear) is the packed trans_b problem.
    w = _random((32, 16), np.float16, rng)
    gm.gemm(HostArray(_random((8, 16), np.float16, rng)), HostArray(w.T))
    call = core.calls[-1]
    packed = gm._packed(1, 8, 32, 16, 1, False, True, False)
    for field in ("m", "n", "k", "lda", "ldb", "ldc", "trans_a", "trans_b"):
        assert call[field] == packed[field], field


def test_side_by_side_out_in_one_buffer_is_allowed(core):
    rng = np.random.default_rng()
    buffer = np.zeros((6, 12), np.float32)
    buffer[:, :4] = _random((6, 4), np.float32, rng)
    a = buffer[:, :4]
    b = _random((4, 8), np.float32, rng)
    gm.gemm(HostArray(a), HostArray(b), out=HostArray(buffer[:, 4:]))
    assert _relative_error(buffer[:, 4:], a.astype(np.float64) @ b) < 1e-6


@pytest.mark.parametrize("case", [
    "k_mismatch", "dtype_mismatch", "unsupported_dtype", "one_d", "bmm_two_d", "gemm_three_d",
    "batch_mismatch", "out_shape", "out_dtype", "out_is_a", "strided_inner", "beta_without_out",
    "host_array", "not_an_array", "trans_not_bool", "alpha_complex",
    "ctx_other_device", "read_only_out",
])
def test_errors_name_the_argument(core, case):
    rng = np.random.default_rng()
    f32 = lambda *shape: HostArray(_random(shape, np.float32, rng))  # noqa: E731
    call, argument, words = {
        "k_mismatch": (lambda: gm.gemm(f32(4, 5), f32(6, 7)), "b", ["(4, 5)", "(6, 7)"]),
        "dtype_mismatch": (lambda: gm.gemm(f32(4, 5), HostArray(_random((5, 7), np.float16, rng))),
                           "b", ["float32", "float16", "(4, 5)", "(5, 7)"]),
        "unsupported_dtype": (lambda: gm.gemm(HostArray(np.ones((4, 5))), f32(5, 2)), "a",
                              ["float64"]),
        "one_d": (lambda: gm.gemm(f32(4), f32(4, 2)), "a", ["2-D", "(4,)"]),
        "bmm_two_d": (lambda: gm.bmm(f32(4, 5), f32(5, 2)), "a", ["3-D"]),
        "gemm_three_d": (lambda: gm.gemm(f32(2, 4, 5), f32(2, 5, 2)), "a", ["bmm"]),
        "batch_mismatch": (lambda: gm.bmm(f32(2, 4, 5), f32(3, 5, 2)), "b", ["(2, 4, 5)", "(3, 5, 2)"]),
        "out_shape": (lambda: gm.gemm(f32(4, 5), f32(5, 2), out=f32(4, 3)), "out", ["(4, 2)", "(4, 3)"]),
        "out_dtype": (lambda: gm.gemm(f32(4, 5), f32(5, 2),
                                      out=HostArray(np.zeros((4, 2), np.float16))), "out", ["float16"]),
        "out_is_a": (None, "out", ["shares memory"]),
        "strided_inner": (lambda: gm.gemm(HostArray(_random((4, 10), np.float32, rng)[:, ::2]),
                                          f32(5, 2)), "a", ["stride", "(4, 5)"]),
        "beta_without_out": (lambda: gm.gemm(f32(4, 5), f32(5, 2), beta=1.0), "beta", ["out="]),
        "host_array": (lambda: gm.gemm(np.ones((4, 5), np.float32), f32(5, 2)), "a", ["host"]),
        "not_an_array": (lambda: gm.gemm([[1.0]], f32(1, 2)), "a", ["list", "DLPack"]),
        "trans_not_bool": (lambda: gm.gemm(f32(4, 5), f32(5, 2), trans_a="yes"), "trans_a", ["'yes'"]),
        "alpha_complex": (lambda: gm.gemm(f32(4, 5), f32(5, 2), alpha=1j), "alpha", ["1j"]),
        "ctx_other_device": (lambda: gm.gemm(f32(4, 5), f32(5, 2), ctx=types.SimpleNamespace(
            device=1, stream=core.context.stream)), "ctx", ["cuda:0", "cuda:1"]),
        "read_only_out": (None, "out", ["read-only"]),
    }[case]
    if case == "out_is_a":
        square = f32(4, 4)
        call = lambda: gm.gemm(square, f32(4, 4), out=square)  # noqa: E731
    if case == "read_only_out":
        frozen = np.zeros((4, 2), np.float32)
        frozen.flags.writeable = False
        call = lambda: gm.gemm(f32(4, 5), f32(5, 2), out=HostArray(frozen))  # noqa: E731
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.argument == argument
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert not core.calls  # nothing was queued


def test_layout_helper():
    # (batch, batch_stride, rows, cols, ld, flipped)
    assert gm._layout((4, 5), (5, 1)) == (1, 0, 4, 5, 5, False)
    assert gm._layout((4, 5), (8, 1)) == (1, 0, 4, 5, 8, False)
    assert gm._layout((4, 5), (1, 4)) == (1, 0, 5, 4, 4, True)
    assert gm._layout((4, 1), (1, 1)) == (1, 0, 4, 1, 1, False)
    assert gm._layout((1, 5), (1, 1)) == (1, 0, 1, 5, 5, False)
    assert gm._layout((3, 4, 5), (20, 5, 1)) == (3, 20, 4, 5, 5, False)
    assert gm._layout((3, 4, 5), (0, 5, 1)) == (3, 0, 4, 5, 5, False)
    assert gm._layout((4, 5), (10, 2)) is None
    assert gm._layout((4, 5), (0, 1)) is None  # broadcast rows
    assert gm._layout((3, 4, 5), (-20, 5, 1)) is None


# ---------------------------------------------------------------------------------------
# Autotuning, the cache file and the progress bar (stand-in core)


def test_autotune_calls_the_tuner_with_packed_problems(core, capsys):
    results = gm.autotune_gemm([(1, 4096, 4096), (256, 128, 2048, 128)], "bf16", trans_b=True,
                               max_algorithms=16, warmup=2, repeats=5)
    assert [p for p, *_ in core.tunes] == [
        gm._packed(2, 1, 4096, 4096, 1, False, True, False),
        gm._packed(2, 128, 2048, 128, 256, False, True, False),
    ]
    assert core.tunes[0][1:] == (16, 2, 5)
    assert results[0]["shape"] == (1, 1, 4096, 4096) and results[1]["shape"] == (256, 128, 2048, 128)
    r = results[0]
    assert (r["dtype"], r["backend"], r["tuned_ms"], r["default_ms"]) == ("bfloat16", "cublasLt", 0.5, 0.75)
    assert r["speedup"] == pytest.approx(1.5) and r["skipped"] is False
    err = capsys.readouterr().err
    assert "autotune_gemm [" in err and "2/2" in err and "bf16 1x4096x4096 NT" in err
    # Tuned problems are not tuned again unless forced.
    again = gm.autotune_gemm([(1, 4096, 4096)], "bfloat16", trans_b=True, progress=False)
    assert again[0]["skipped"] is True and len(core.tunes) == 2
    assert capsys.readouterr().err == ""
    gm.autotune_gemm([(1, 4096, 4096)], "bfloat16", trans_b=True, progress=False, force=True)
    assert len(core.tunes) == 3


@pytest.mark.parametrize("shapes", [[(0, 4, 4)], [(4, 4)], [(1, 2, 3, 4, 5)], [("a", 2, 3)],
                                    "1x2x3", 7, [(True, 2, 3)]])
def test_autotune_rejects_bad_shapes(core, shapes):
    with pytest.raises(ConfigError) as info:
        gm.autotune_gemm(shapes, "bf16", progress=False)
    assert info.value.argument == "shapes"


def test_autotune_rejects_bad_options(core):
    for kwargs, argument in [({"max_algorithms": 0}, "max_algorithms"), ({"repeats": 0}, "repeats"),
                             ({"warmup": -1}, "warmup"), ({"trans_a": 1}, "trans_a")]:
        with pytest.raises(ConfigError) as info:
            gm.autotune_gemm([(4, 4, 4)], "bf16", progress=False, **kwargs)
        assert info.value.argument == argument
    with pytest.raises(ConfigError) as info:
        gm.autotune_gemm([(4, 4, 4)], "int8", progress=False)
    assert info.value.argument == "dtype"


def test_cache_file_round_trip_and_merge(core, tmp_path):
    gm.autotune_gemm([(8, 16, 32), (2, 8, 16, 32)], "float16", progress=False)
    path = tmp_path / "gemm.json"
    assert gm.save_gemm_cache(path) == 2
    document = json.loads(path.read_text())
    assert document["format"] == "inferctx-gemm-cache" and document["version"] == 1
    entry = document["entries"][0]
    assert entry["dtype"] == "float16" and entry["backend"] == "cublasLt"
    assert entry["algo"][-1] == "0xffffffffffffffff" and entry["align"] == [256, 256, 256]
    assert (entry["m"], entry["n"], entry["k"], entry["lda"], entry["ldb"], entry["ldc"]) == (
        8, 16, 32, 32, 16, 16)
    # Loading hands _core the same entries it exported.
    assert gm.load_gemm_cache(path) == 2
    assert core.imported == core.cache
    # Another machine's entry in the file survives a save from this one.
    foreign = dict(entry, device_name="Other GPU")
    document["entries"].append(foreign)
    path.write_text(json.dumps(document))
    core.cache.pop()
    assert gm.save_gemm_cache(path) == 3
    names = [e["device_name"] for e in json.loads(path.read_text())["entries"]]
    assert names.count("Other GPU") == 1 and names.count("Fake GPU") == 2
    # autotune_gemm(cache_file=...) loads first and saves after.
    core.cache.clear()
    gm.autotune_gemm([(4, 4, 4)], "fp32", progress=False, cache_file=path)
    assert core.imported is not None and len(json.loads(path.read_text())["entries"]) >= 3


@pytest.mark.parametrize("content, words", [
    ("not json", ["not JSON"]),
    ('{"format": "something else", "entries": []}', ["not an inferctx GEMM cache"]),
    ('{"format": "inferctx-gemm-cache", "version": 99, "entries": []}', ["version 99"]),
    ('{"format": "inferctx-gemm-cache", "version": 1, "entries": [1]}', ["entry 0"]),
])
def test_malformed_cache_files(core, tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        gm.load_gemm_cache(path)
    assert info.value.argument == "path"
    for word in words:
        assert word in str(info.value)


def test_malformed_entries(core, tmp_path):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]
    for field, value, word in [("dtype", "int8", "dtype"), ("algo", ["0xZZ"], "algo word"),
                               ("algo", [str(2**64)], "algo word"), ("backend", "magic", "backend"),
                               ("align", [256, 256], "align"), ("m", 1.5, "m is 1.5"),
                               ("trans_a", "no", "trans_a"), ("device_name", 3, "device_name")]:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1,
                                    "entries": [dict(good, **{field: value})]}))
        with pytest.raises(ConfigError) as info:
            gm.load_gemm_cache(path)
        assert info.value.argument == "path" and word in str(info.value), str(info.value)


def test_progress_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    bar = gm._Progress(2, True, stream)
    bar.start("bf16 1x2x3")
    bar.done("bf16 1x2x3", {"tuned_ms": 0.01, "speedup": 1.25})
    bar.start("bf16 4x5x6")
    bar.done("bf16 4x5x6", {"skipped": True})
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n")
    assert "[############............] 1/2" in text and "10.0 us (1.25x)" in text
    assert "[########################] 2/2" in text and "cached" in text


# ---------------------------------------------------------------------------------------
# On a GPU, with torch


def _torch():
    return pytest.importorskip("torch")


@pytest.fixture(params=["own stream", "torch stream"])
def ctx(request):
    """The device-0 context on its own stream (operands ordered by the DLPack handshake), or
    on torch's current stream (the fast path)."""
    torch = _torch()
    from inferctx import _core

    context = _core.InferenceContext.instance(0)
    if request.param == "torch stream":
        context.use_stream(torch.cuda.current_stream(0))
    yield context
    context.use_stream(None)


_TORCH_DTYPES = ["float32", "float16", "bfloat16"]


def _bound(dtype, tf32=False):
    if dtype == "float32":
        return 1e-3 if tf32 else 1e-5
    return 1e-2


def _as_torch(result):
    torch = _torch()
    return result if isinstance(result, torch.Tensor) else torch.from_dlpack(result)


def _check(result, ref, bound, ctx):
    ctx.stream.synchronize()
    got = _as_torch(result).double()
    err = ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()
    assert err < bound, err  # NaN fails too


def _rand(shape, dtype):
    torch = _torch()
    return torch.empty(shape, dtype=getattr(torch, dtype), device="cuda:0").uniform_(-1, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _TORCH_DTYPES)
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_gpu_gemm_matches_float64(ctx, dtype, trans_a, trans_b):
    m, n, k = 37, 53, 71
    a = _rand((k, m) if trans_a else (m, k), dtype)
    b = _rand((n, k) if trans_b else (k, n), dtype)
    result = gm.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
    torch = _torch()
    assert isinstance(result, torch.Tensor) and result.device == a.device  # torch in, torch out
    assert tuple(result.shape) == (m, n) and result.dtype == a.dtype and result.is_contiguous()
    ref = (a.T if trans_a else a).double() @ (b.T if trans_b else b).double()
    _check(result, ref, _bound(dtype), ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _TORCH_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 7, 4097), (7, 4097, 1), (4097, 7, 9), (1, 4097, 7)])
def test_gpu_odd_sizes(ctx, dtype, shape):
    m, n, k = shape
    a, b = _rand((m, k), dtype), _rand((k, n), dtype)
    _check(gm.gemm(a, b), a.double() @ b.double(), _bound(dtype), ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _TORCH_DTYPES)
def test_gpu_views_out_and_accumulation(ctx, dtype):
    torch = _torch()
    m, n, k = 33, 17, 65
    a, b = _rand((m, k), dtype), _rand((k, n), dtype)
    ref = a.double() @ b.double()
    # Transposed views are read in place.
    a_t = _rand((k, m), dtype)
    _check(gm.gemm(a_t.T, b), a_t.T.double() @ b.double(), _bound(dtype), ctx)
    _check(gm.gemm(a, b.T.contiguous().T), ref, _bound(dtype), ctx)
    # out= with padded rows: the gap keeps its NaN; out is returned.
    big = torch.full((m, n + 5), float("nan"), dtype=a.dtype, device=a.device)
    out = big[:, :n]
    assert gm.gemm(a, b, out=out) is out
    _check(out, ref, _bound(dtype), ctx)
    assert torch.isnan(big[:, n:]).all()
    # Column-major out.
    out_t = torch.empty((n, m), dtype=a.dtype, device=a.device).T
    gm.gemm(a, b, out=out_t)
    _check(out_t, ref, _bound(dtype), ctx)
    # alpha and beta accumulate into out.
    c0 = _rand((m, n), dtype)
    c = c0.clone()
    ctx.stream.synchronize()
    torch.cuda.synchronize()
    gm.gemm(a, b, out=c, alpha=0.75, beta=-1.25)
    _check(c, 0.75 * ref - 1.25 * c0.double(), _bound(dtype), ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _TORCH_DTYPES)
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_gpu_bmm(ctx, dtype, trans_a, trans_b):
    torch = _torch()
    batch, m, n, k = 5, 19, 23, 29
    a = _rand((batch, k + 3, m + 2), dtype)[:, :k, :m] if trans_a else _rand((batch, m, k + 4), dtype)[:, :, :k]
    b = _rand((batch, n, k), dtype) if trans_b else _rand((batch, k, n), dtype)
    op_a = a.transpose(1, 2) if trans_a else a
    op_b = b.transpose(1, 2) if trans_b else b
    ref = op_a.double() @ op_b.double()
    _check(gm.bmm(a, b, trans_a=trans_a, trans_b=trans_b), ref, _bound(dtype), ctx)
    # One b for the whole batch, and out as a (batch, m, n) view of an (m, batch, n) array.
    b1 = b[:1]
    out = torch.empty((m, batch, n), dtype=a.dtype, device=a.device).permute(1, 0, 2)
    gm.bmm(a, b1, trans_a=trans_a, trans_b=trans_b, out=out)
    op_b1 = b1.transpose(1, 2) if trans_b else b1
    _check(out, op_a.double() @ op_b1.double(), _bound(dtype), ctx)


@pytest.mark.gpu
def test_gpu_k_zero_and_empty(ctx):
    torch = _torch()
    a = torch.empty((5, 0), dtype=torch.bfloat16, device="cuda:0")
    b = torch.empty((0, 7), dtype=torch.bfloat16, device="cuda:0")
    result = _as_torch(gm.gemm(a, b))
    ctx.stream.synchronize()
    assert result.shape == (5, 7) and (result == 0).all()
    c = torch.full((5, 7), 2.0, dtype=torch.bfloat16, device="cuda:0")
    torch.cuda.synchronize()
    gm.gemm(a, b, out=c, beta=0.5)
    ctx.stream.synchronize()
    assert (c == 1.0).all()
    empty = _as_torch(gm.gemm(torch.empty((0, 4), dtype=torch.float16, device="cuda:0"),
                              _rand((4, 3), "float16")))
    assert empty.shape == (0, 3)


@pytest.mark.gpu
def test_gpu_fp32_without_and_with_tf32(ctx):
    a, b = _rand((64, 4096), "float32"), _rand((4096, 64), "float32")
    ref = a.double() @ b.double()
    _check(gm.gemm(a, b), ref, 1e-5, ctx)
    _check(gm.gemm(a, b, tf32=True), ref, 1e-3, ctx)


@pytest.mark.gpu
def test_gpu_cupy_operands():
    cupy = pytest.importorskip("cupy")
    with cupy.cuda.Device(0):
        a = cupy.random.uniform(-1, 1, (31, 47)).astype(cupy.float32)
        b = cupy.random.uniform(-1, 1, (47, 9)).astype(cupy.float32)
        result = gm.gemm(a, b)
        from inferctx import _core

        _core.InferenceContext.instance(0).stream.synchronize()
        got = cupy.from_dlpack(result).astype(cupy.float64)
        ref = a.astype(cupy.float64) @ b.astype(cupy.float64)
        assert float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref)) < 1e-5


@pytest.mark.gpu
def test_gpu_autotune_then_gemm_and_cache_file(ctx, tmp_path, capsys):
    torch = _torch()
    gm.clear_gemm_cache()
    a, b = _rand((64, 512), "bfloat16"), _rand((512, 256), "bfloat16")
    q, kk = _rand((4, 32, 16), "float16"), _rand((4, 64, 16), "float16")
    untuned = _as_torch(gm.gemm(a, b)).clone()
    untuned_qk = _as_torch(gm.bmm(q, kk, trans_b=True)).clone()
    ctx.stream.synchronize()
    results = gm.autotune_gemm([(64, 256, 512)], "bfloat16", max_algorithms=8, repeats=3)
    results += gm.autotune_gemm([(4, 32, 64, 16)], torch.float16, trans_b=True, max_algorithms=8,
                                repeats=3)
    assert "autotune_gemm [" in capsys.readouterr().err
    for r in results:
        assert r["skipped"] is False and r["tuned_ms"] > 0 and r["valid"] >= 1
        assert r["backend"] in ("cublasLt", "cublas")
        assert r["default_ms"] is None or r["tuned_ms"] <= r["default_ms"]
    entries = gm.gemm_cache_entries()
    assert len(entries) == 2
    # Tuned results equal untuned ones (and the float64 reference).
    tuned = gm.gemm(a, b)
    _check(tuned, untuned.double(), 1e-2, ctx)
    _check(tuned, a.double() @ b.double(), 1e-2, ctx)
    _check(gm.bmm(q, kk, trans_b=True), untuned_qk.double(), 1e-2, ctx)
    # The cache file round trip.
    path = tmp_path / "gemm.json"
    assert gm.save_gemm_cache(path) == 2
    gm.clear_gemm_cache()
    assert gm.gemm_cache_entries() == []
    assert gm.load_gemm_cache(path) == 2
    key = lambda e: json.dumps(e, sort_keys=True)  # noqa: E731
    assert sorted(map(key, gm.gemm_cache_entries())) == sorted(map(key, entries))
    _check(gm.gemm(a, b), a.double() @ b.double(), 1e-2, ctx)  # the loaded entry, checked on use
    again = gm.autotune_gemm([(64, 256, 512)], "bfloat16", cache_file=path, progress=False)
    assert again[0]["skipped"] is True
    gm.clear_gemm_cache()


@pytest.mark.gpu
def test_gpu_errors(ctx):
    torch = _torch()
    a, b = _rand((4, 5), "float32"), _rand((6, 7), "float32")
    with pytest.raises(ConfigError) as info:
        gm.gemm(a, b)
    assert info.value.argument == "b" and "(4, 5)" in str(info.value) and "(6, 7)" in str(info.value)
    with pytest.raises(ConfigError) as info:
        gm.gemm(a, _rand((5, 7), "bfloat16"))
    assert "bfloat16" in str(info.value) and "float32" in str(info.value)
    with pytest.raises(ConfigError) as info:
        gm.gemm(a, torch.ones((5, 7)))  # host tensor
    assert info.value.argument == "b"
    with pytest.raises(ConfigError) as info:
        gm.gemm(a, _rand((5, 7), "float32"), beta=0.5)
    assert info.value.argument == "beta"
    with pytest.raises(ConfigError) as info:
        gm.gemm(a, _rand((5, 7), "float32"), out=_rand((4, 6), "float32"))
    assert info.value.argument == "out" and "(4, 7)" in str(info.value)
    square = _rand((4, 4), "float32")
    with pytest.raises(ConfigError) as info:
        gm.gemm(square, _rand((4, 4), "float32"), out=square)
    assert info.value.argument == "out"
    with pytest.raises(ConfigError) as info:
        gm.gemm(_rand((4, 10), "float32")[:, ::2], _rand((5, 7), "float32"))
    assert info.value.argument == "a"
    with pytest.raises(ConfigError):
        gm.gemm(_rand((4, 5), "float64"), _rand((5, 7), "float64"))


@pytest.mark.gpu
def test_gpu_device_mismatch():
    torch = _torch()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from inferctx import _core

    a = torch.ones((4, 5), device="cuda:0")
    b = torch.ones((5, 3), device="cuda:1")
    with pytest.raises(ConfigError) as info:
        gm.gemm(a, b)
    assert "cuda:0" in str(info.value) and "cuda:1" in str(info.value)
    with pytest.raises(ConfigError) as info:
        gm.gemm(a, torch.ones((5, 3), device="cuda:0"), ctx=_core.InferenceContext.instance(1))
    assert info.value.argument == "ctx"


def test_module_exports():
    assert set(gm.__all__) == {"gemm", "bmm", "autotune_gemm", "save_gemm_cache",
                               "load_gemm_cache", "clear_gemm_cache", "gemm_cache_entries"}
    assert all(callable(getattr(gm, name)) for name in gm.__all__)
    assert gm._scalar(2, "alpha") == 2.0 and type(gm._scalar(2, "alpha")) is float

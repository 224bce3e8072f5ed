"""inferctx.gemm / bmm / autotune_gemm and the GEMM cache file.

Two halves. Without a GPU: the layout the C++ layer works out for operands' shapes and strides
(``_core._gemm_layout``, host code: nothing is launched) against values worked out by hand
(test_gemm_layout.py runs those layouts on a host emulator of cuBLAS against NumPy's product),
its refusals, the argument checks of the Python API, and autotune_gemm's bookkeeping and cache
file with a stand-in for the GPU timing alone. With a GPU (``gpu`` marker), everything runs for
real against float64 references with torch.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import stat
import threading
import types

import numpy as np
import pytest

from inferctx import _core
from inferctx.errors import ConfigError

# The module, not the function the package exports under the same name.
gm = importlib.import_module("inferctx.gemm")

# ---------------------------------------------------------------------------------------
# The layout of a call (C++ gemm_layout, on the host)

FIELDS = ("m", "n", "k", "lda", "ldb", "ldc", "batch", "stride_a", "stride_b", "stride_c",
          "trans_a", "trans_b", "swap")


def layout(ndim, a, b, out=None, trans_a=False, trans_b=False, dtype="float32", addresses=None):
    """The problem C++ builds for operands given as (shape, strides) in elements."""
    spec = lambda x: None if x is None else (dtype,) + tuple(x)  # noqa: E731
    return _core._gemm_layout(ndim, trans_a, trans_b, spec(a), spec(b), spec(out), addresses)


def fields(d):
    return tuple(d[f] for f in FIELDS)


F, T = False, True


# m, n, k = 5, 7, 3: a is (5, 3) and b (3, 7) unless a trans flag stores them the other way.
@pytest.mark.parametrize("case, expected", [
    # contiguous: lda = k, ldb = ldc = n, a new result's stride_c = m * n
    (dict(a=((5, 3), (3, 1)), b=((3, 7), (7, 1))), (5, 7, 3, 3, 7, 7, 1, 0, 0, 35, F, F, F)),
    # a as a transposed view of a contiguous (3, 5): read in place as trans_a with lda 5 ...
    (dict(a=((5, 3), (1, 5)), b=((3, 7), (7, 1))), (5, 7, 3, 5, 7, 7, 1, 0, 0, 35, T, F, F)),
    # ... which is what trans_a of that (3, 5) array gives
    (dict(a=((3, 5), (5, 1)), b=((3, 7), (7, 1)), trans_a=T), (5, 7, 3, 5, 7, 7, 1, 0, 0, 35, T, F, F)),
    # padded rows of a: lda is the row pitch
    (dict(a=((5, 3), (6, 1)), b=((3, 7), (7, 1))), (5, 7, 3, 6, 7, 7, 1, 0, 0, 35, F, F, F)),
    # trans_b of a contiguous (7, 3) b (torch's Linear weight): ldb = k
    (dict(a=((5, 3), (3, 1)), b=((7, 3), (3, 1)), trans_b=T), (5, 7, 3, 3, 3, 7, 1, 0, 0, 35, F, T, F)),
    # trans_b of a transposed view: the stored matrix is op(b) itself
    (dict(a=((5, 3), (3, 1)), b=((7, 3), (1, 7)), trans_b=T), (5, 7, 3, 3, 7, 7, 1, 0, 0, 35, F, F, F)),
    # padded out: ldc 10, no batch stride
    (dict(a=((5, 3), (3, 1)), b=((3, 7), (7, 1)), out=((5, 7), (10, 1))), (5, 7, 3, 3, 7, 10, 1, 0, 0, 0, F, F, F)),
    # column-major out: out^T = b^T a^T, a 7 x 5 problem with the operands swapped
    (dict(a=((5, 3), (3, 1)), b=((3, 7), (7, 1)), out=((5, 7), (1, 5))), (7, 5, 3, 7, 3, 5, 1, 0, 0, 0, T, T, T)),
    # one row whose elements are 2 apart is read as a 5 x 1 column with ld 2
    (dict(a=((1, 5), (10, 2)), b=((5, 7), (7, 1))), (1, 7, 5, 2, 7, 7, 1, 0, 0, 7, T, F, F)),
    # (4, 1) and (1, 5) with unit strides everywhere
    (dict(a=((4, 1), (1, 1)), b=((1, 5), (1, 1))), (4, 5, 1, 1, 5, 5, 1, 0, 0, 20, F, F, F)),
    # k = 0: lda 1 (one matrix of no columns), ldb = n
    (dict(a=((3, 0), (0, 1)), b=((0, 4), (4, 1))), (3, 4, 0, 1, 4, 4, 1, 0, 0, 12, F, F, F)),
])
def test_gemm_layouts(case, expected):
    got = layout(2, **case)
    assert fields(got) == expected
    m, n = expected[:2]
    assert got["out_shape"] == ((n, m) if got["swap"] else (m, n))
    assert got["dtype"] == 0 and got["tf32"] is False


def test_bmm_layouts():
    # a (4, 3, 6) with rows padded to 9 (batch stride 27); one b (1, 5, 6) for the whole batch,
    # with trans_b; out (4, 3, 5) as a view of an (3, 4, 5) array: strides (5, 20, 1).
    got = layout(3, ((4, 3, 6), (27, 9, 1)), ((1, 5, 6), (30, 6, 1)), ((4, 3, 5), (5, 20, 1)),
                 trans_b=True)
    assert fields(got) == (3, 5, 6, 9, 6, 20, 4, 27, 0, 5, F, T, F)
    # Each matrix of a a transposed view (strides (18, 1, 3)), b broadcast, a new result.
    got = layout(3, ((4, 3, 6), (18, 1, 3)), ((1, 6, 5), (30, 5, 1)))
    assert fields(got) == (3, 5, 6, 3, 5, 5, 4, 18, 0, 15, T, F, F) and got["out_shape"] == (4, 3, 5)
    # A batch stride of 0 in a (a broadcast view) reads one matrix for every b.
    got = layout(3, ((3, 4, 5), (0, 5, 1)), ((3, 5, 2), (10, 2, 1)))
    assert fields(got) == (4, 2, 5, 5, 2, 2, 3, 0, 10, 8, F, F, F)
    # A batch of 1 broadcast against an empty batch gives an empty batch, either way round.
    got = layout(3, ((1, 4, 8), (32, 8, 1)), ((0, 8, 16), (128, 16, 1)))
    assert got["batch"] == 0 and got["out_shape"] == (0, 4, 16)
    got = layout(3, ((0, 4, 8), (32, 8, 1)), ((1, 8, 16), (128, 16, 1)))
    assert got["batch"] == 0 and got["out_shape"] == (0, 4, 16)
    with pytest.raises(ConfigError, match="have batch sizes 2 and 3; they must be equal"):
        layout(3, ((2, 4, 8), (32, 8, 1)), ((3, 8, 16), (128, 16, 1)))


def test_contiguous_call_is_the_autotuned_problem():
    """A contiguous (m, k) @ (k, n) runs the packed problem autotune_gemm tunes (the cache key)."""
    for trans_b, b in ((False, ((16, 32), (32, 1))), (True, ((32, 16), (16, 1)))):
        got = layout(2, ((8, 16), (16, 1)), b, trans_b=trans_b, dtype="float16")
        packed = _core._gemm_packed_problem(1, 8, 32, 16, 1, False, trans_b, False)
        for field in ("m", "n", "k", "batch", "lda", "ldb", "ldc", "trans_a", "trans_b", "dtype"):
            assert got[field] == packed[field], field
    assert _core._gemm_packed_problem(2, 128, 2048, 64, 4, False, True, True) == {
        "dtype": 2, "trans_a": False, "trans_b": True, "m": 128, "n": 2048, "k": 64, "batch": 4,
        "lda": 64, "ldb": 64, "ldc": 2048, "stride_a": 8192, "stride_b": 131072,
        "stride_c": 262144, "tf32": False}  # tf32 only for float32


def test_side_by_side_out_in_one_buffer_is_allowed():
    # a is columns [0, 4) and out columns [4, 12) of a (6, 12) float32 buffer at 0x1000.
    a, b, out = ((6, 4), (12, 1)), ((4, 8), (8, 1)), ((6, 8), (12, 1))
    layout(2, a, b, out, addresses=(0x1000, 0x9000, 0x1000 + 4 * 4))
    with pytest.raises(ConfigError) as info:  # out from column 3 takes a's last column
        layout(2, a, b, out, addresses=(0x1000, 0x9000, 0x1000 + 3 * 4))
    assert info.value.argument == "out" and "shares memory with a" in str(info.value)


def _spec(dtype, shape, strides=None):
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return (dtype, shape, strides)


@pytest.mark.parametrize("case, argument, words", [
    ((2, _spec("float32", (4, 5)), _spec("float32", (6, 7))), "b", ["(4, 5)", "(6, 7)", "5 columns"]),
    ((2, _spec("float32", (4, 5)), _spec("float16", (5, 7))), "b", ["float32", "float16", "(4, 5)", "(5, 7)"]),
    ((2, _spec("float64", (4, 5)), _spec("float32", (5, 2))), "a", ["float64"]),
    ((2, _spec("float32", (4,)), _spec("float32", (4, 2))), "a", ["2-D", "(4,)"]),
    ((3, _spec("float32", (4, 5)), _spec("float32", (5, 2))), "a", ["3-D"]),
    ((2, _spec("float32", (2, 4, 5)), _spec("float32", (2, 5, 2))), "a", ["use bmm for batches"]),
    ((3, _spec("float32", (2, 4, 5)), _spec("float32", (3, 5, 2))), "b", ["(2, 4, 5)", "(3, 5, 2)"]),
    ((2, _spec("float32", (4, 5)), _spec("float32", (5, 2)), _spec("float32", (4, 3))), "out",
     ["(4, 2)", "(4, 3)"]),
    ((2, _spec("float32", (4, 5)), _spec("float32", (5, 2)), _spec("float16", (4, 2))), "out", ["float16"]),
    ((2, _spec("float32", (4, 5), (10, 2)), _spec("float32", (5, 2))), "a",
     ["stride", "(4, 5)", "(10, 2)", ".contiguous()"]),
    ((2, _spec("float32", (4, 5), (0, 1)), _spec("float32", (5, 2))), "a", ["(0, 1)"]),  # broadcast rows
    ((3, _spec("float32", (3, 4, 5), (-20, 5, 1)), _spec("float32", (3, 5, 2))), "a", ["(-20, 5, 1)"]),
    ((2, _spec("float32", (4, 2)), _spec("float32", (2, 2)), _spec("float32", (4, 2), (2, 0))), "out",
     ["strides"]),
    ((3, _spec("float32", (3, 4, 5)), _spec("float32", (3, 5, 2)), _spec("float32", (3, 4, 2), (0, 2, 1))),
     "out", ["overlap"]),  # one matrix written three times
])
def test_layout_refusals_name_the_argument(case, argument, words):
    ndim, a, b, *out = case
    with pytest.raises(ConfigError) as info:
        _core._gemm_layout(ndim, False, False, a, b, out[0] if out else None)
    assert info.value.argument == argument
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("call, argument, kind", [
    (lambda: gm.gemm([1, 2], [3, 4]), "a", "list"), (lambda: gm.gemm(object(), 3), "a", "object"),
    (lambda: gm.bmm(None, None), "a", "NoneType"),
])
def test_an_operand_that_is_no_array_is_named_by_its_type(call, argument, kind):
    # Before any device is looked up: the same words with or without a GPU.
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.argument == argument
    assert f"{argument} is of type {kind}; " in str(info.value) and "takes CUDA arrays" in str(info.value)


def test_address_refusals():
    square = ((4, 4), (4, 1))  # 64 bytes of float32
    with pytest.raises(ConfigError) as info:
        layout(2, square, square, square, addresses=(0x1000, 0x2000, 0x1000))
    assert info.value.argument == "out" and "shares memory with a" in str(info.value)
    layout(2, square, square, square, addresses=(0x1000, 0x2000, 0x1040))  # just past a
    with pytest.raises(ConfigError) as info:
        layout(2, square, square, square, addresses=(0x1000, 0x2002, 0x4000))
    assert info.value.argument == "b" and "0x2002" in str(info.value) and "4-byte" in str(info.value)
    with pytest.raises(ConfigError) as info:
        layout(2, square, square, square, dtype="bfloat16", addresses=(0x1000, 0x2000, 0x3001))
    assert info.value.argument == "out" and "2-byte" in str(info.value)


# ---------------------------------------------------------------------------------------
# The Python API's own checks (before anything needs a device)


class ClaimsCuda:
    """An object whose __dlpack_device__ says CUDA device 0 (it is never imported)."""

    def __dlpack_device__(self):
        return (2, 0)


@pytest.mark.parametrize("case", ["beta_without_out", "host_array", "not_an_array", "trans_not_bool",
                                  "alpha_complex", "ctx_other_device", "bmm_tf32_not_bool",
                                  "alpha_past_float32", "alpha_huge_int", "beta_nan", "alpha_inf"])
def test_argument_errors_name_the_argument(case):
    x = ClaimsCuda()
    call, argument, words = {
        "beta_without_out": (lambda: gm.gemm(x, x, beta=1.0), "beta", ["out="]),
        "host_array": (lambda: gm.gemm(np.ones((4, 5), np.float32), x), "a", ["host"]),
        "not_an_array": (lambda: gm.gemm([[1.0]], x), "a", ["list", "DLPack"]),
        "trans_not_bool": (lambda: gm.gemm(x, x, trans_a="yes"), "trans_a", ["'yes'"]),
        "alpha_complex": (lambda: gm.gemm(x, x, alpha=1j), "alpha", ["1j"]),
        "ctx_other_device": (lambda: gm.gemm(x, x, ctx=types.SimpleNamespace(device=1)), "ctx",
                             ["cuda:0", "cuda:1"]),
        "bmm_tf32_not_bool": (lambda: gm.bmm(x, x, tf32="no"), "tf32", ["'no'"]),
        # The product scales in float32: 1e39 would become inf there, silently.
        "alpha_past_float32": (lambda: gm.gemm(x, x, alpha=1e39), "alpha", ["1e+39", "float32"]),
        "alpha_huge_int": (lambda: gm.gemm(x, x, alpha=10**400), "alpha", ["float32"]),
        "beta_nan": (lambda: gm.gemm(x, x, out=x, beta=float("nan")), "beta", ["nan"]),
        "alpha_inf": (lambda: gm.gemm(x, x, alpha=float("-inf")), "alpha", ["-inf"]),
    }[case]
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.argument == argument
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ---------------------------------------------------------------------------------------
# Autotuning, the cache file and the progress bar (a stand-in for the GPU timing)


from gemm_tuner_stub import tuner  # noqa: E402,F401 (fixture)


def test_autotune_calls_the_tuner_with_packed_problems(tuner, capsys):
    results = gm.autotune_gemm([(1, 4096, 4096), (256, 128, 2048, 128)], "bf16", trans_b=True,
                               max_algorithms=16, warmup=2, repeats=5)
    assert tuner.tunes == [(2, False, True, 1, 4096, 4096, 1, False, 16, 2, 5),
                           (2, False, True, 128, 2048, 128, 256, False, 16, 2, 5)]
    assert results[0]["shape"] == (1, 1, 4096, 4096) and results[1]["shape"] == (256, 128, 2048, 128)
    r = results[0]
    assert (r["dtype"], r["backend"], r["tuned_ms"], r["default_ms"]) == ("bfloat16", "cublasLt", 0.5, 0.75)
    assert r["speedup"] == pytest.approx(1.5) and r["skipped"] is False
    err = capsys.readouterr().err
    assert "autotune_gemm [" in err and "2/2" in err and "bf16 1x4096x4096 NT" in err
    # Tuned problems are not tuned again unless forced.
    again = gm.autotune_gemm([(1, 4096, 4096)], "bfloat16", trans_b=True, progress=False)
    assert again[0]["skipped"] is True and len(tuner.tunes) == 2
    assert capsys.readouterr().err == ""
    gm.autotune_gemm([(1, 4096, 4096)], "bfloat16", trans_b=True, progress=False, force=True)
    assert len(tuner.tunes) == 3


def test_batched_problems_whose_strides_lower_the_alignment_are_not_tuned_again(tuner):
    # (32, 1, 1000, 128) fp16 with trans_b, packed: c's matrices are 1 x 1000, 2,000 bytes apart,
    # so every one after the first is 16-byte aligned (2000 = 16 x 125): the tuner records
    # align_c 16. a's are 128 elements (256 bytes) apart and b's 128,000 (256,000 bytes): 256.
    tuner.aligns[(32, 1, 1000, 128)] = (256, 256, 16)
    first = gm.autotune_gemm([(32, 1, 1000, 128)], "float16", trans_b=True, progress=False)
    assert first[0]["skipped"] is False and len(tuner.tunes) == 1
    again = gm.autotune_gemm([(32, 1, 1000, 128)], "float16", trans_b=True, progress=False)
    assert again[0]["skipped"] is True and len(tuner.tunes) == 1
    # An entry of the same problem at other alignments (a call on offset memory, say) is not
    # the packed problem's tuning: that one is still tuned.
    tuner.aligns[(4, 8, 8, 8)] = (16, 256, 256)
    gm.autotune_gemm([(4, 8, 8, 8)], "float16", progress=False)
    assert gm.autotune_gemm([(4, 8, 8, 8)], "float16", progress=False)[0]["skipped"] is False
    assert len(tuner.tunes) == 3


def test_a_failure_midway_keeps_the_tunings_made_before_it_in_the_file(tuner, tmp_path):
    path = tmp_path / "gemm.json"
    tuner.fail_on = (1, 16, 32, 64)
    with pytest.raises(MemoryError):
        gm.autotune_gemm([(8, 16, 32), (16, 32, 64), (32, 64, 128)], "float16", progress=False,
                         cache_file=path)
    assert len(tuner.tunes) == 2  # the third shape was not tried
    entries = json.loads(path.read_text())["entries"]
    assert [(e["m"], e["n"], e["k"]) for e in entries] == [(8, 16, 32)]
    # Nothing tuned, nothing written: a failure on the first shape leaves no file.
    other = tmp_path / "other.json"
    tuner.fail_on = (1, 8, 8, 8)
    with pytest.raises(MemoryError):
        gm.autotune_gemm([(8, 8, 8)], "float16", progress=False, cache_file=other)
    assert not other.exists()


@pytest.mark.parametrize("shapes", [[(0, 4, 4)], [(4, 4)], [(1, 2, 3, 4, 5)], [("a", 2, 3)],
                                    "1x2x3", 7, [(True, 2, 3)], [(2**70, 1, 1)], [(1, 2**63, 1)]])
def test_autotune_rejects_bad_shapes(tuner, shapes):
    with pytest.raises(ConfigError) as info:
        gm.autotune_gemm(shapes, "bf16", progress=False)
    assert info.value.argument == "shapes"


@pytest.mark.parametrize("shape, why", [
    ((2**31, 8, 8, 8), "batch: got 2147483648; at most 2147483647 matrices per call"),
    ((2**31, 2**31, 2**31), "lda: got 2147483648 for 2147483648 rows"),
    ((8, 8, 2**62), "m: the matrices of 8 x 8 x 4611686018427387904 have more than 2^63 elements"),
])
def test_autotune_names_a_shape_too_large_for_one_call_before_the_device_or_any_tuning(
        tuner, monkeypatch, shape, why):
    # The device is not looked up: a machine without a GPU gets the shape's error, not
    # NoCudaDeviceError; and the good shape before it is not tuned.
    def no_device():
        raise AssertionError("the device was looked up before the shapes were checked")
    monkeypatch.setattr(gm, "_context_of_current_device", no_device)
    with pytest.raises(ConfigError) as info:
        gm.autotune_gemm([(8, 8, 8), shape], "float16", progress=False)
    assert info.value.argument == "shapes"
    assert str(info.value).startswith(f"shapes: {shape} cannot be one GEMM call ({why}")
    assert str(info.value).endswith("; tune shapes a gemm or bmm call can take")
    assert tuner.tunes == []


def test_autotune_rejects_bad_options(tuner):
    for kwargs, argument in [({"max_algorithms": 0}, "max_algorithms"), ({"repeats": 0}, "repeats"),
                             ({"warmup": -1}, "warmup"), ({"trans_a": 1}, "trans_a"),
                             ({"max_algorithms": 2**31}, "max_algorithms"), ({"repeats": 2**31}, "repeats"),
                             ({"max_algorithms": 257}, "max_algorithms"),
                             ({"warmup": 2**31}, "warmup")]:
        with pytest.raises(ConfigError) as info:
            gm.autotune_gemm([(4, 4, 4)], "bf16", progress=False, **kwargs)
        assert info.value.argument == argument
    with pytest.raises(ConfigError) as info:
        gm.autotune_gemm([(4, 4, 4)], "int8", progress=False)
    assert info.value.argument == "dtype"
    # cuBLASLt's heuristic is asked for 1..256 candidates: the bounds themselves are taken.
    assert tuner.tunes == []
    gm.autotune_gemm([(4, 4, 4)], "bf16", progress=False, max_algorithms=256)
    gm.autotune_gemm([(8, 8, 8)], "bf16", progress=False, max_algorithms=1)
    assert [t[8] for t in tuner.tunes] == [256, 1]


def test_the_few_row_kernel_is_named_gemv_in_results_and_the_cache_file(tuner, tmp_path):
    # backend 2 is inferctx's own kernel: "gemv" in autotune_gemm's results and in the file, and
    # 2 again when the file is loaded; it has no cuBLASLt words.
    def tune_to_gemv(ctx, dtype, trans_a, trans_b, m, n, k, batch, tf32, *rest):
        problem = _core._gemm_packed_problem(dtype, m, n, k, batch, trans_a, trans_b, tf32)
        tuner.cache.append(dict(device=ctx.device, device_name="Fake GPU", cublas_version=130100,
                                problem=problem, align_a=256, align_b=256, align_c=256, backend=2,
                                algo=[], time_ms=0.25))
        return dict(backend=2, algo_index=9, algo=[], algo_id=-1, tile_id=-1, stages_id=-1,
                    splitk=-1, default_ms=0.5, best_ms=0.25, candidates=10, valid=10,
                    rotated_sets=4)

    gm._core._gemm_tune = tune_to_gemv  # the fixture's monkeypatch restores the tuner
    [r] = gm.autotune_gemm([(1, 4096, 4096)], "bf16", progress=False)
    assert (r["backend"], r["algo_index"], r["speedup"]) == ("gemv", 9, 2.0)
    path = tmp_path / "gemm.json"
    assert gm.save_gemm_cache(path) == 1
    [entry] = json.loads(path.read_text())["entries"]
    assert (entry["backend"], entry["algo"], entry["m"]) == ("gemv", [], 1)
    assert gm.load_gemm_cache(path) == 1
    assert tuner.imported[0]["backend"] == 2 and tuner.imported[0]["algo"] == []
    # Tuned again from the file: skipped, and still named.
    [again] = gm.autotune_gemm([(1, 4096, 4096)], "bf16", progress=False)
    assert again["skipped"] is True and again["backend"] == "gemv"


def test_cache_file_round_trip_and_merge(tuner, tmp_path):
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
    assert tuner.imported == tuner.cache
    # Another machine's entry in the file survives a save from this one.
    foreign = dict(entry, device_name="Other GPU")
    document["entries"].append(foreign)
    path.write_text(json.dumps(document))
    tuner.cache.pop()
    assert gm.save_gemm_cache(path) == 3
    names = [e["device_name"] for e in json.loads(path.read_text())["entries"]]
    assert names.count("Other GPU") == 1 and names.count("Fake GPU") == 2
    # autotune_gemm(cache_file=...) loads first and saves after.
    tuner.cache.clear()
    gm.autotune_gemm([(4, 4, 4)], "fp32", progress=False, cache_file=path)
    assert tuner.imported is not None and len(json.loads(path.read_text())["entries"]) >= 3


@pytest.mark.parametrize("content, words", [
    ("not json", ["not JSON"]),
    ('{"format": "something else", "entries": []}', ["not an inferctx GEMM cache"]),
    ('{"format": "inferctx-gemm-cache", "version": 99, "entries": []}', ["version 99"]),
    ('{"format": "inferctx-gemm-cache", "version": 1, "entries": [1]}', ["entry 0"]),
])
def test_malformed_cache_files(tuner, tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        gm.load_gemm_cache(path)
    assert info.value.argument == "path"
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("content, words", [
    (b'{"format": "inferctx-gemm-cache", "version": 1, "entries": [], "note": "\xff"}', ["UnicodeDecodeError"]),
    (b'{"format": "inferctx-gemm-cache", "version": 1, "entries": [' + b"9" * 5000 + b"]}", ["ValueError"]),
    (b"[" * 100_000 + b"]" * 100_000, ["RecursionError"]),
])
def test_cache_files_python_cannot_read_are_config_errors(tuner, tmp_path, content, words):
    # Not UTF-8, an integer past Python's digit limit, arrays nested past its stack: each a
    # ConfigError naming the file, not the bare Python error.
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        gm.load_gemm_cache(path)
    assert info.value.argument == "path" and str(path) in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_autotune_names_its_cache_file_keyword_in_the_files_errors(tuner, tmp_path):
    # autotune_gemm has no `path`: a bad file it was given is its `cache_file`.
    path = tmp_path / "bad.json"
    path.write_text('{"format": "something else", "entries": []}')
    with pytest.raises(ConfigError) as info:
        gm.autotune_gemm([(8, 16, 32)], "float16", progress=False, cache_file=path)
    assert info.value.argument == "cache_file"
    assert str(info.value).startswith(f"cache_file: {path} is not an inferctx GEMM cache")
    assert path.read_text() == '{"format": "something else", "entries": []}'  # nothing tuned or written


def test_save_with_merge_checks_the_entries_it_keeps(tuner, tmp_path):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]
    for bad in ([1, 2], [{"hello": "world"}], [dict(good, align=[[1]])], [dict(good, device_name="\ud800")]):
        path = tmp_path / "kept.json"
        text = json.dumps({"format": "inferctx-gemm-cache", "version": 1, "entries": bad})
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            gm.save_gemm_cache(path)
        assert info.value.argument == "path" and "entry 0" in str(info.value) and "merge=False" in str(info.value)
        assert path.read_text() == text  # left as it was
        assert gm.save_gemm_cache(path, merge=False) == 1  # replaced on request
        assert gm.load_gemm_cache(path) == 1
    with pytest.raises(ConfigError) as missing:  # as autotune_gemm's cache_file (test_gemm_cache_files.py)
        gm.save_gemm_cache(tmp_path / "no-such-folder" / "gemm.json")
    assert missing.value.argument == "path" and str(missing.value).startswith(
        f"path: {tmp_path / 'no-such-folder' / 'gemm.json'} cannot be made")  # the user's path


def test_save_with_merge_refuses_kept_entries_that_only_the_compiled_checks_refuse(tuner, tmp_path):
    # Entries Python's reading takes but load_gemm_cache's compiled checks refuse (lda 3 for a row
    # of 32 elements, an alignment of 0, a cuBLASLt entry without its 8 algorithm words): merged
    # back, they would make the whole file, new tunings included, one load refuses. The save
    # refuses instead, naming the entry as load does, and leaves the file as it was.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]
    for bad, message in ((dict(good, m=32, lda=3), "entry 1: lda: "),
                         (dict(good, align=[0, 256, 256]), "entry 1: align_a: got 0; an alignment is a power of two "
                                                           "from 1 to 256"),
                         (dict(good, algo=[]), "entry 1: algo: got 0 words; a cuBLASLt algorithm has 8")):
        path = tmp_path / "kept.json"
        text = json.dumps({"format": "inferctx-gemm-cache", "version": 1,
                           "entries": [dict(good, device_name="Other GPU"), dict(bad, device_name="Other GPU")]})
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            gm.save_gemm_cache(path)
        assert info.value.argument == "path"
        assert str(info.value).startswith(f"path: {path} has an invalid {message}"), str(info.value)
        assert str(info.value).endswith("; merge=True keeps the file's entries: mend or remove the file, or pass "
                                        "merge=False to replace it")
        assert path.read_text() == text


def test_save_with_merge_keeps_one_entry_per_cache_key(tuner, tmp_path):
    # A file entry the cache keys as one of this process's (booleans left out, tf32 on float16,
    # which the cache ignores, strides of an unbatched problem) is that problem's stale tuning:
    # written after the fresh one it would replace it when loaded. Only the fresh one is kept;
    # an entry for another problem stays.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    fresh = gm.gemm_cache_entries()[0]
    stale = dict(fresh, algo=["0x2"] * 8)
    omitted = {k: v for k, v in stale.items() if k not in ("trans_a", "trans_b", "tf32")}
    other = dict(fresh, m=16, ldc=16)
    for old in (omitted, dict(stale, tf32=True), dict(stale, stride_a=999, stride_b=7, stride_c=5)):
        path = tmp_path / "gemm.json"
        path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1, "entries": [old, other]}))
        assert gm.save_gemm_cache(path) == 2
        assert json.loads(path.read_text())["entries"] == [fresh, other]


def test_save_with_merge_waits_for_another_save_into_the_same_file(tuner, tmp_path):
    # Two processes merging into one file (machines sharing it) each read, merge and replace: a
    # save that read the file before the other's replacement would write it back without the
    # other's entries. The merge takes an exclusive flock on the file's folder; held here, as
    # another process's save would hold it, the save waits, then reads what was written meanwhile.
    import fcntl
    import os
    import threading

    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    mine = gm.gemm_cache_entries()[0]
    theirs = dict(mine, m=16, ldc=16)
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1, "entries": []}))
    folder = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(folder, fcntl.LOCK_EX)
    done = []
    saver = threading.Thread(target=lambda: done.append(gm.save_gemm_cache(path)))
    try:
        saver.start()
        saver.join(0.5)
        assert saver.is_alive() and not done  # waiting for the lock
        path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1, "entries": [theirs]}))
    finally:
        os.close(folder)  # the lock goes with it
    saver.join(10)
    assert done == [2] and json.loads(path.read_text())["entries"] == [mine, theirs]
    # merge=False replaces the file whatever it holds, so it takes no lock.
    folder = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(folder, fcntl.LOCK_EX)
    try:
        assert gm.save_gemm_cache(path, merge=False) == 1
    finally:
        os.close(folder)
    with pytest.raises(ConfigError) as info:
        gm.save_gemm_cache(path, merge="yes")
    assert info.value.argument == "merge"


def test_save_keeps_the_files_permissions_and_its_link(tuner, tmp_path):
    # A cache file on shared storage is read by others: saving keeps its mode (0o644 here), a new
    # file is made as open() makes one (0o666 less the umask, not tempfile's 0o600), and a link
    # to it stays a link, the file it names replaced.
    import os
    import stat

    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    old_umask = os.umask(0o022)
    try:
        new = tmp_path / "new.json"
        assert gm.save_gemm_cache(new) == 1
        assert stat.S_IMODE(new.stat().st_mode) == 0o644
        shared = tmp_path / "shared.json"
        shared.write_text('{"format": "inferctx-gemm-cache", "version": 1, "entries": []}')
        shared.chmod(0o664)
        assert gm.save_gemm_cache(shared) == 1
        assert stat.S_IMODE(shared.stat().st_mode) == 0o664
        link = tmp_path / "link.json"
        link.symlink_to(shared)
        shared.chmod(0o640)
        assert gm.save_gemm_cache(link, merge=False) == 1
        assert link.is_symlink() and os.readlink(link) == str(shared)
        assert stat.S_IMODE(shared.stat().st_mode) == 0o640
        assert gm.load_gemm_cache(link) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "new.json", "shared.json"]
    finally:
        os.umask(old_umask)


_COMPILED_IMPORT = _core._gemm_cache_import  # the tuner fixture stands in for it


def test_an_entry_the_compiled_checks_refuse_is_named_by_its_index(tuner, tmp_path, monkeypatch):
    # An alignment of 100 is a number Python's reading takes; the compiled checks (a power of two
    # up to 256) refuse it, before anything is imported and before any device is asked about.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1,
                                "entries": [good, dict(good, align=[256, 256, 100])]}))
    monkeypatch.setattr(gm._core, "_gemm_cache_import", _COMPILED_IMPORT)
    with pytest.raises(ConfigError) as info:
        gm.load_gemm_cache(path)
    assert info.value.argument == "path"
    assert str(info.value).startswith(f"path: {path} has an invalid entry 1: align_c: got 100; ")


def test_malformed_entries(tuner, tmp_path):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]
    for field, value, word in [("dtype", "int8", "dtype"), ("algo", ["0xZZ"], "algo word"),
                               ("algo", [str(2**64)], "algo word"), ("backend", "magic", "backend"),
                               ("align", [256, 256], "align"), ("m", 1.5, "m is 1.5"),
                               ("trans_a", "no", "trans_a"), ("device_name", 3, "device_name"),
                               ("dtype", ["float16"], "dtype"), ("backend", {"cublas": 1}, "backend"),
                               # past what the compiled entry holds: no OverflowError
                               ("align", [256, 256, 99_999_999_999], "align"), ("m", 2**70, "m is"),
                               ("lda", 2**63, "lda is"), ("cublas_version", 2**64, "cublas_version is"),
                               ("device", 2**40, "device is"), ("time_ms", 10**400, "time_ms is"),
                               ("device_name", "\ud800", "must be text")]:  # a lone surrogate
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1,
                                    "entries": [dict(good, **{field: value})]}))
        with pytest.raises(ConfigError) as info:
            gm.load_gemm_cache(path)
        assert info.value.argument == "path" and word in str(info.value), str(info.value)


def _within(seconds, call):
    """call() on a thread: what it returns (or raises), failing the test if it still runs after
    `seconds` (blocked on a FIFO, say; the thread is a daemon, left behind)."""
    box = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - raised again on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _unblock(fifo):
    """Opens a FIFO for writing and closes it: a reader blocked in its open (a test that failed)
    goes on and reads nothing."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader waiting
        pass


def _private_null(folder):
    """A character device like /dev/null (1, 3) made in `folder`, or None where this process may
    not make one (not root, no CAP_MKNOD)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    node = folder / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except OSError:
        return None
    return node


def test_cache_files_that_are_not_regular_files_are_refused_without_blocking(tuner, tmp_path):
    # A FIFO blocks an open for reading until a writer comes, and its read until the writer
    # goes; a device such as /dev/zero never ends. load (and save's merge, which reads the file
    # first) refuse them at once, as they refuse a directory.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    null = _private_null(tmp_path)
    try:
        for call in (lambda: gm.load_gemm_cache(fifo), lambda: gm.save_gemm_cache(fifo)):
            with pytest.raises(ConfigError) as info:
                _within(5, call)
            assert info.value.argument == "path"
            assert str(info.value).startswith(f"path: {fifo} is a FIFO, not a regular file; "), str(info.value)
            assert stat.S_ISFIFO(fifo.stat().st_mode)
    finally:
        _unblock(fifo)
    with pytest.raises(ConfigError) as info:
        gm.load_gemm_cache(tmp_path)
    assert info.value.argument == "path" and "is a directory, not a regular file" in str(info.value)
    if null is not None:  # a private copy of /dev/null: stat'ed, never opened
        with pytest.raises(ConfigError) as info:
            _within(5, lambda: gm.load_gemm_cache(null))
        assert "is a character device, not a regular file" in str(info.value)
    # A regular file far larger than any cache (sparse: no disk used) is refused unread.
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate((64 << 20) + 1)
    with pytest.raises(ConfigError) as info:
        gm.load_gemm_cache(big)
    assert info.value.argument == "path" and "more than 64 MiB" in str(info.value)
    with pytest.raises(FileNotFoundError):  # a missing file stays the OSError it always was
        gm.load_gemm_cache(tmp_path / "missing.json")


def test_save_leaves_a_fifo_or_device_node_it_is_given(tuner, tmp_path):
    # merge=False replaces the file without reading it: a FIFO or a device node (a link to one
    # too) would be swapped for a regular file. It is refused instead, and nothing is written.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(fifo)
    nodes = [(fifo, stat.S_ISFIFO, "a FIFO"), (link, stat.S_ISFIFO, "a FIFO")]
    null = _private_null(tmp_path)
    if null is not None:
        nodes.append((null, stat.S_ISCHR, "a character device"))
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        for node, is_kind, kind in nodes:
            for merge in (False, True):
                with pytest.raises(ConfigError) as info:
                    _within(5, lambda: gm.save_gemm_cache(node, merge=merge))
                assert info.value.argument == "path"
                assert str(info.value).startswith(f"path: {node} is {kind}, not a regular file; "), str(info.value)
                assert is_kind(os.stat(node).st_mode)
        folder = tmp_path / "folder"
        folder.mkdir()
        with pytest.raises(ConfigError) as info:
            gm.save_gemm_cache(folder, merge=False)
        assert "is a directory, not a regular file" in str(info.value)
    finally:
        _unblock(fifo)
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == sorted(before + ["folder"])
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("path, words", [
    ("a\x00b", "path: got 'a\\x00b', which holds a NUL character"),
    ("", "path: got ''; give a file name"),
    (b"", "path: got ''; give a file name"),
    (5, "path: got 5 (int); give a file name"),
    (True, "path: got True (bool); give a file name"),
    (3.5, "path: got 3.5 (float); give a file name"),
    (["gemm.json"], "path: got ['gemm.json'] (list); give a file name"),
    (object(), "(object); give a file name"),
])
def test_cache_paths_no_file_can_have(tuner, tmp_path, monkeypatch, path, words):
    # Each a ConfigError naming `path`, before anything is read or written: "" is no name for
    # the current folder (realpath('') is the cwd: a save wrote beside it, into its parent),
    # an int no file descriptor.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    calls = [lambda: gm.load_gemm_cache(path), lambda: gm.save_gemm_cache(path),
             lambda: gm.save_gemm_cache(path, merge=False)]
    for call in calls:
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == "path"
        assert words in str(info.value), str(info.value)
        assert "JSON" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd"] and list(cwd.iterdir()) == []


def test_cache_paths_as_bytes_and_path_likes(tuner, tmp_path):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    assert gm.save_gemm_cache(os.fsencode(tmp_path / "a.json")) == 1
    assert gm.load_gemm_cache(os.fsencode(tmp_path / "a.json")) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_autotune_checks_its_cache_file_before_the_device(tuner, tmp_path, monkeypatch):
    # Without a GPU the device lookup fails: a bad cache_file must be named before it, as such.
    # The file's entries are read and checked (Python's and the compiled checks) first; they go
    # into the cache only once there is a context.
    from inferctx.errors import NoCudaDeviceError

    def no_device():
        raise NoCudaDeviceError("no CUDA device (a stand-in)")

    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]

    def file(name, content):
        path = tmp_path / name
        path.write_text(content if isinstance(content, str) else json.dumps(
            {"format": "inferctx-gemm-cache", "version": 1, "entries": content}))
        return path

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(gm, "_context_of_current_device", no_device)
    cases = [(5, "cache_file: got 5 (int); give a file name"), (True, "cache_file: got True (bool)"),
             (1, "cache_file: got 1 (int)"), (3.5, "cache_file: got 3.5 (float)"),
             (["x"], "cache_file: got ['x'] (list)"), (object(), "(object); give a file name"),
             ("\x00", "holds a NUL character"), ("", "cache_file: got ''; give a file name"),
             (tmp_path, "is a directory, not a regular file"), (fifo, "is a FIFO, not a regular file"),
             (file("bad.json", "{not json"), "is not JSON"),
             (file("nan.json", [dict(good, time_ms=float("nan"))]), "entry 0: time_ms is nan"),
             (file("align.json", [good, dict(good, align=[256, 256, 100])]), "has an invalid entry 1: align_c")]
    try:
        for cache_file, words in cases:
            with pytest.raises(ConfigError) as info:
                _within(5, lambda: gm.autotune_gemm([(8, 16, 32)], "float16", progress=False,
                                                    cache_file=cache_file))
            assert info.value.argument == "cache_file", (cache_file, str(info.value))
            assert str(info.value).startswith("cache_file: ") and words in str(info.value), str(info.value)
    finally:
        _unblock(fifo)
    # A good file: read before the device, imported after it.
    path = file("good.json", [good])
    order = []
    monkeypatch.setattr(gm, "_context_of_current_device",
                        lambda: order.append("device") or types.SimpleNamespace(device=0))
    imported = gm._core._gemm_cache_import
    monkeypatch.setattr(gm._core, "_gemm_cache_import", lambda e: order.append("import") or imported(e))
    [r] = gm.autotune_gemm([(8, 16, 32)], "float16", progress=False, cache_file=str(path))
    assert order == ["device", "import"] and r["skipped"] is True
    assert tuner.imported[0]["problem"] == tuner.cache[0]["problem"]


def test_cache_entry_times_are_finite_milliseconds(tuner, tmp_path):
    # time_ms is the median tune_gemm measured (>= 0), or -1 for an entry never timed (what the
    # cache holds for a heuristic one, and an absent field's value). NaN, Infinity (1e400 reads
    # as Infinity) and other negative times are refused: a save would write them back as
    # NaN / Infinity, which strict JSON readers refuse.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]
    path = tmp_path / "gemm.json"

    def write(entry):
        text = json.dumps({"format": "inferctx-gemm-cache", "version": 1, "entries": [entry]})
        path.write_text(text)
        return text

    for value, shown in [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"),
                         (-0.5, "-0.5"), (-2, "-2"), (-1.5, "-1.5")]:
        text = write(dict(good, time_ms=value))
        for call in (lambda: gm.load_gemm_cache(path), lambda: gm.save_gemm_cache(path)):
            with pytest.raises(ConfigError) as info:
                call()
            assert info.value.argument == "path"
            assert f"entry 0: time_ms is {shown}; it must be a finite number of milliseconds >= 0, or -1 " \
                   f"for an entry never timed" in str(info.value), str(info.value)
        assert path.read_text() == text  # the merge left it as it was
    path.write_text(write(dict(good, time_ms=0)).replace('"time_ms": 0', '"time_ms": 1e400'))
    with pytest.raises(ConfigError) as info:
        gm.load_gemm_cache(path)
    assert "time_ms is inf" in str(info.value)
    for value in (0, 0.0, -1, -1.0, 2.5, 10**6):
        write(dict(good, time_ms=value))
        assert gm.load_gemm_cache(path) == 1 and tuner.imported[0]["time_ms"] == float(value)
    write({k: v for k, v in good.items() if k != "time_ms"})
    assert gm.load_gemm_cache(path) == 1 and tuner.imported[0]["time_ms"] == -1.0
    # What the package writes for an entry never timed loads back, and is strict JSON.
    tuner.cache[0] = dict(tuner.cache[0], time_ms=-1.0)
    assert gm.save_gemm_cache(path, merge=False) == 1 and gm.load_gemm_cache(path) == 1
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))


def test_cache_entry_messages_clip_what_they_show(tuner, tmp_path):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]
    path = tmp_path / "gemm.json"
    for field, value, words in [("time_ms", 10**400, "time_ms is an integer of 1329 bits"),
                                ("device_name", list(range(1000)), "device_name is [0, 1, 2,"),
                                ("dtype", "x" * 5000, "(5,000 characters)"),
                                ("m", 10**1000, "m is an integer of 3322 bits"),
                                ("algo", ["0x" + "f" * 5000], "algo word '0xfff"),
                                ("align", [1] * 2000, "align is [1, 1,")]:
        path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1,
                                    "entries": [dict(good, **{field: value})]}))
        with pytest.raises(ConfigError) as info:
            gm.load_gemm_cache(path)
        assert words in str(info.value) and len(str(info.value)) < 400 + len(str(path)), str(info.value)


@pytest.mark.parametrize("word, value", [("0x00000000000000ff", 0xFF), ("0xffffffffffffffff", 2**64 - 1),
                                         ("0xFF", 0xFF), ("0XaB", 0xAB), ("ff", 0xFF), ("0x2", 2),
                                         ("0x" + "0" * 20 + "1", 1)])
def test_algo_words_in_hex(tuner, tmp_path, word, value):
    # As the package writes them ('0x' and 16 lowercase digits), and the other plain hex forms
    # int(w, 16) took before.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1,
                                "entries": [dict(good, algo=[word] * 8)]}))
    assert gm.load_gemm_cache(path) == 1 and tuner.imported[0]["algo"] == [value] * 8


@pytest.mark.parametrize("word", [" 0x1 ", "0x1 ", "0x1_0", "1_0", "\u0663", "0x\u0663", "\uff11", "+0x1", "-1",
                                  "0x", "", "0x1\n", "0x10000000000000000"])
def test_algo_words_not_in_hex_are_refused(tuner, tmp_path, word):
    # int(w, 16) takes spaces around the digits, underscores between them, a sign and non-ASCII
    # digits (Arabic-Indic, fullwidth): none is a word the package writes.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1,
                                "entries": [dict(good, algo=["0x1"] * 7 + [word])]}))
    with pytest.raises(ConfigError) as info:
        gm.load_gemm_cache(path)
    assert info.value.argument == "path"
    assert f"entry 0: algo word {word!r} is not a 64-bit hex string" in str(info.value), str(info.value)


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
@pytest.mark.parametrize("dtype", _TORCH_DTYPES)
def test_gpu_bmm_into_an_inputs_own_buffer(ctx, dtype):
    """bmm's out in the same buffer as its input, the elements apart: the odd matrices of a
    batch whose even ones are a, and the right-hand columns of rows whose left ones are a."""
    torch = _torch()
    batch, n = 4, 24
    buffer = _rand((2 * batch, n, n), dtype)
    a, b = buffer[0::2], _rand((batch, n, n), dtype)
    ref, kept = a.double() @ b.double(), buffer[0::2].clone()
    gm.bmm(a, b, out=buffer[1::2])
    _check(buffer[1::2], ref, _bound(dtype), ctx)
    assert torch.equal(buffer[0::2], kept)  # a is read, not written
    rows = _rand((batch, n, 2 * n), dtype)
    a, kept = rows[..., :n], rows[..., :n].clone()
    ref = a.double() @ b.double()
    gm.bmm(a, b, out=rows[..., n:])
    _check(rows[..., n:], ref, _bound(dtype), ctx)
    assert torch.equal(rows[..., :n], kept)
    with pytest.raises(ConfigError) as info:  # out one column into a: elements shared
        gm.bmm(a, b, out=rows[..., n - 1:2 * n - 1])
    assert info.value.argument == "out" and "shares memory with a" in str(info.value)


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
@pytest.mark.parametrize("shapes", [((3, 4), (4, 5)), ((0, 4), (4, 3)), ((3, 4), (4, 0)),
                                    ((5, 0), (0, 7)), ((2, 3, 4), (2, 4, 5)),
                                    ((1, 3, 4), (2, 4, 5)), ((2, 0, 4), (2, 4, 5))])
def test_gpu_new_results_are_laid_out_as_torch_matmuls(shapes):
    """A result without out=, from the general path (the signature's first call) and from the
    torch fast path (the next ones, whose allocator differs): a plain torch.Tensor on the
    operands' device with torch.matmul's shape, strides, dtype and bits."""
    torch = _torch()
    shape_a, shape_b = shapes
    a, b = _rand(shape_a, "bfloat16"), _rand(shape_b, "bfloat16")
    call = gm.gemm if len(shape_a) == 2 else gm.bmm
    want = torch.matmul(a, b)
    for _ in range(3):
        got = call(a, b)
        assert type(got) is torch.Tensor and not got.requires_grad
        assert (got.shape, got.stride(), got.dtype, got.device) == (
            want.shape, want.stride(), want.dtype, want.device)
        assert torch.equal(got, want)
    # A subclass of torch.Tensor keeps making its result through its own new_empty.
    class Marked(torch.Tensor):
        pass

    for _ in range(2):
        got = call(a.as_subclass(Marked), b)
        assert type(got) is Marked and torch.equal(got.as_subclass(torch.Tensor), want)


@pytest.mark.gpu
def test_gpu_the_fast_path_tells_apart_operands_of_the_same_element_counts(ctx):
    """The torch fast path finds a known signature by the operands' element counts and torch's
    tensor guards: each variant below has the counts of the first call and a layout of its own
    (or none: the general path's error). Every product must be torch's, with and without out=,
    each variant run twice (its second call on the fast path)."""
    import gc
    import weakref

    torch = _torch()
    a = _rand((64, 32), "float32")
    b = _rand((32, 16), "float32")
    b_cols = _rand((16, 32), "float32").t()  # (32, 16), column-major
    variants = [
        ("plain", a, b),
        ("b column-major", a, b_cols),
        ("a column-major", _rand((32, 64), "float32").t(), b),
        ("a as (32, 64) with b (64, 8)", _rand((32, 64), "float32"), _rand((64, 8), "float32")),
        ("half", a.half(), b.half()),
        ("bfloat16", a.bfloat16(), b.bfloat16()),
        ("a with padded rows", _rand((64, 40), "float32")[:, :32], b),
        ("requires_grad", a.clone().requires_grad_(), b),
    ]
    for _ in range(2):
        for name, x, y in variants:
            want = (x.detach().double() @ y.double()).to(x.dtype)
            bound = 1e-5 if x.dtype == torch.float32 else 1e-2
            got = gm.gemm(x, y)
            torch.testing.assert_close(got, want, rtol=bound, atol=bound * 32, msg=name)
            out = torch.empty_like(want)
            assert gm.gemm(x, y, out=out) is out
            torch.testing.assert_close(out, want, rtol=bound, atol=bound * 32, msg=name)
            out_cols = torch.empty_like(want.t()).t()  # the same counts, column-major
            assert gm.gemm(x, y, out=out_cols) is out_cols
            torch.testing.assert_close(out_cols, want, rtol=bound, atol=bound * 32, msg=name)
        with torch.inference_mode():
            xi, yi = a.clone(), b.clone()  # inference tensors: other dispatch keys
            torch.testing.assert_close(gm.gemm(xi, yi), (a.double() @ b.double()).float())
        # Mixed dtypes of the same counts: the general path's error, on every call.
        with pytest.raises(ConfigError) as info:
            gm.gemm(a, b.half())
        assert info.value.argument == "b"
    # What the fast path keeps for a signature holds no operand: their memory goes back.
    x = _rand((64, 32), "float32")
    kept = weakref.ref(x)
    for _ in range(3):
        gm.gemm(x, b)
    del x
    gc.collect()
    assert kept() is None


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
def test_gpu_torch_tensors_with_the_negative_bit_are_refused(ctx):
    """z.conj().imag is a view whose memory holds the negation of its values (torch's negative
    bit): read through its pointer, a product would have the wrong sign. Refused by name, on the
    general path and on the torch fast path (whose layout a plain tensor made first)."""
    import inferctx

    torch = _torch()
    a = torch.randn(8, 64, device="cuda")
    b = torch.randn(64, 1, dtype=torch.complex64, device="cuda").conj().imag
    assert b.is_neg() and b.stride() == (2, 2)
    with pytest.raises(ConfigError, match="resolve_neg") as info:
        gm.gemm(a, b)
    assert info.value.argument == "b"
    # The same layout from a plain tensor: strides (2, 2) too, and the fast path learns it.
    plain = torch.randn(64, 1, 2, device="cuda")[:, :, 0]
    assert plain.stride() == (2, 2) and not plain.is_neg()
    torch.testing.assert_close(gm.gemm(a, plain), a @ plain)
    with pytest.raises(ConfigError) as info:
        gm.gemm(a, b)
    assert info.value.argument == "b"
    # alpha past float32's range, on the fast path too (the layout is known): refused, not inf.
    with pytest.raises(ConfigError) as info:
        gm.gemm(a, plain, alpha=1e39)
    assert info.value.argument == "alpha"
    out = torch.zeros(8, 1, 2, dtype=torch.complex64, device="cuda").conj().imag[:, :, 0]
    assert out.is_neg()
    with pytest.raises(ConfigError) as info:
        gm.gemm(a, plain, out=out)
    assert info.value.argument == "out"
    # Resolved, it is an ordinary tensor: torch's product, sign and all.
    torch.testing.assert_close(gm.gemm(a, b.resolve_neg()), a @ b)
    # Dropout's fast path takes contiguous tensors; a one-element negated view is one.
    x = torch.randn(1, dtype=torch.complex64, device="cuda").conj().imag
    assert x.is_neg() and x.is_contiguous()
    with pytest.raises(ConfigError) as info:
        inferctx.dropout(x, 0.5)
    assert info.value.argument == "x"


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
        assert r["backend"] in ("cublasLt", "cublas")  # neither problem is one for "gemv"
        assert r["default_ms"] is None or r["tuned_ms"] <= r["default_ms"]
        # cuBLASLt only when at least 1% faster than cublasGemmEx; else cublasGemmEx stays
        assert r["algo_index"] == 0 or r["tuned_ms"] <= 0.99 * r["default_ms"], r
        assert r["default_ms"] is not None  # cublasGemmEx, what gemm runs untuned, was timed
        assert (r["algo_index"] == 0) == (r["backend"] == "cublas"), r  # and is candidate 0
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


_BOUNDS = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


def _load_as_gemv(tmp_path):
    """The one untuned entry in the cache, made a "gemv" entry through a cache file and loaded back."""
    entries = gm.gemm_cache_entries(tuned_only=False)
    assert len(entries) == 1 and entries[0]["backend"] == "cublas"
    entries[0].update(backend="gemv", algo=[])
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1, "entries": entries}))
    gm.clear_gemm_cache()
    assert gm.load_gemm_cache(path) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _TORCH_DTYPES)
@pytest.mark.parametrize("m", [1, 5, 8])
def test_gpu_few_row_kernel_chosen_by_a_cache_file(ctx, tmp_path, dtype, m):
    # inferctx's own kernel for decoding shapes ("gemv"), as a cache file chooses it: n = 264 is a
    # whole column tile and part of one, k = 520 two whole k chunks and part of a third.
    torch = _torch()
    a, b = _rand((m, 520), dtype), _rand((520, 264), dtype)
    gm.clear_gemm_cache()
    gm.gemm(a, b)  # untuned (cublasGemmEx): puts the problem, with its alignments, in the cache
    _load_as_gemv(tmp_path)
    got = gm.gemm(a, b)
    _check(got, a.double() @ b.double(), _BOUNDS[dtype], ctx)
    # Checked on first use and kept: the kernel takes this problem.
    assert [e["backend"] for e in gm.gemm_cache_entries()] == ["gemv"]
    # The chunks' partial sums are added in a fixed order: the same bits on every call.
    assert torch.equal(_as_torch(got), _as_torch(gm.gemm(a, b)))
    # alpha, beta and out= (the same problem and alignments, so the same entry).
    c = _rand((m, 264), dtype)
    c0 = c.double()
    assert gm.gemm(a, b, out=c, alpha=-0.5, beta=0.25) is c
    _check(c, -0.5 * (a.double() @ b.double()) + 0.25 * c0, _BOUNDS[dtype], ctx)
    # beta = 0 does not read out: NaN there does not survive.
    c.fill_(float("nan"))
    gm.gemm(a, b, out=c, alpha=2.0)
    _check(c, 2.0 * (a.double() @ b.double()), _BOUNDS[dtype], ctx)
    assert [e["backend"] for e in gm.gemm_cache_entries()] == ["gemv"]
    gm.clear_gemm_cache()


@pytest.mark.gpu
def test_gpu_few_row_kernel_as_a_user_calls_it(tmp_path):
    # The kernel a cache file chose, called as users call gemm: torch tensors, default arguments,
    # no use_stream, no synchronize. A sleep kernel holds torch's current stream, the producer
    # then writes `a`, and the result is read on that stream right after each call.
    torch = _torch()
    a, b = _rand((8, 1024), "bfloat16"), _rand((1024, 2048), "bfloat16")
    gm.clear_gemm_cache()
    gm.gemm(a, b)
    _load_as_gemv(tmp_path)
    torch.cuda.synchronize()
    reads, inputs = [], []
    for trial in range(20):
        torch.cuda._sleep(20_000_000)
        a.copy_(torch.full((8, 1024), float(trial % 5 + 1) / 8, dtype=torch.bfloat16, device="cuda"))
        c = gm.gemm(a, b)
        reads.append(c.clone())  # on torch's current stream, right after the call
        inputs.append(a.clone())
    torch.cuda.synchronize()
    assert [e["backend"] for e in gm.gemm_cache_entries()] == ["gemv"]
    for trial, (got, a0) in enumerate(zip(reads, inputs)):
        want = a0.double() @ b.double()
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, (trial, err)
    gm.clear_gemm_cache()


@pytest.mark.gpu
def test_gpu_few_row_kernel_entry_for_a_problem_it_cannot_take_gives_way_to_cublas(ctx, tmp_path):
    torch = _torch()
    for a, b, trans_b in ((_rand((9, 256), "bfloat16"), _rand((256, 512), "bfloat16"), False),  # 9 rows
                          (_rand((4, 256), "bfloat16"), _rand((512, 256), "bfloat16"), True)):  # b^T
        gm.clear_gemm_cache()
        untuned = _as_torch(gm.gemm(a, b, trans_b=trans_b)).clone()
        _load_as_gemv(tmp_path)
        got = _as_torch(gm.gemm(a, b, trans_b=trans_b))
        assert gm.gemm_cache_entries() == []  # replaced by the untuned choice on first use
        assert torch.equal(got, untuned)  # cublasGemmEx again: the untuned call's bits
    gm.clear_gemm_cache()


@pytest.mark.gpu
def test_gpu_autotune_of_a_decoding_shape_tries_the_few_row_kernel(ctx):
    # With one cuBLASLt candidate asked for, a problem the kernel takes has three candidates
    # (cublasGemmEx, cuBLASLt's, inferctx's) and one it does not take (b transposed) two; every
    # one matched cublasGemmEx's result.
    gm.clear_gemm_cache()
    [r] = gm.autotune_gemm([(4, 2048, 1024)], "bfloat16", max_algorithms=1, repeats=3, progress=False)
    assert (r["candidates"], r["valid"]) == (3, 3), r
    assert r["backend"] != "gemv" or r["algo_index"] == 2, r
    [t] = gm.autotune_gemm([(4, 2048, 1024)], "bfloat16", trans_b=True, max_algorithms=1, repeats=3,
                           progress=False)
    assert (t["candidates"], t["valid"]) == (2, 2), t
    a, b = _rand((4, 1024), "bfloat16"), _rand((1024, 2048), "bfloat16")
    _check(gm.gemm(a, b), a.double() @ b.double(), 1e-2, ctx)
    gm.clear_gemm_cache()


class _ReadOnly:
    """A tensor's __cuda_array_interface__ with its read-only flag set."""

    def __init__(self, tensor):
        self.tensor = tensor

    @property
    def __cuda_array_interface__(self):
        interface = dict(self.tensor.__cuda_array_interface__)
        interface["data"] = (interface["data"][0], True)
        return interface


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
    with pytest.raises(ConfigError) as info:  # out through an interface that says read-only
        gm.gemm(a, _rand((5, 7), "float32"), out=_ReadOnly(_rand((4, 7), "float32")))
    assert info.value.argument == "out" and "read-only" in str(info.value)
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
    # float32's largest finite value is taken, as are its negative and a NumPy float.
    assert gm._scalar(3.4028234663852886e38, "alpha") == 3.4028234663852886e38
    assert gm._scalar(-3.4028234663852886e38, "beta") == -3.4028234663852886e38
    # The bound the message names is itself taken; 3.4028235e38, just above it, is not.
    with pytest.raises(ConfigError) as info:
        gm._scalar(3.4028235e38, "alpha")
    bound = str(info.value).split("at most ")[1].split(" ")[0]
    assert gm._scalar(float(bound), "alpha") == float(bound)
    assert gm._scalar(np.float32(0.5), "alpha") == 0.5


# ---------------------------------------------------------------------------------------
# Values a message cannot show whole, names that open no file, and odd cache documents


class _NoRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


def test_argument_messages_show_values_their_repr_cannot(tuner):
    # An integer past Python's 4300-digit str limit, or an object whose __repr__ raises, is shown
    # as _brief shows it: the ConfigError naming the argument, not the repr's own error.
    x = ClaimsCuda()
    huge = 10**5000
    for call, argument, words in [
            (lambda: gm.gemm(x, x, alpha=_NoRepr()), "alpha", "alpha: got <_NoRepr object>; it must be a real number"),
            (lambda: gm.bmm(x, x, beta=_NoRepr()), "beta", "beta: got <_NoRepr object>; it must be a real number"),
            (lambda: gm.gemm(x, x, ctx=_NoRepr()), "ctx", "ctx: got <_NoRepr object>; it must be an inferctx"),
            (lambda: gm.autotune_gemm([(huge, 1, 1)], "bf16", progress=False), "shapes", "each shape is (m, n, k)"),
            (lambda: gm.autotune_gemm((huge, 1, 1), "bf16", progress=False), "shapes", "each shape is (m, n, k)"),
            (lambda: gm.autotune_gemm([_NoRepr()], "bf16", progress=False), "shapes", "got <_NoRepr object>"),
            (lambda: gm.autotune_gemm(_NoRepr(), "bf16", progress=False), "shapes", "got <_NoRepr object>"),
            (lambda: gm.autotune_gemm([(4, 4, 4)], "bf16", progress=False, max_algorithms=huge), "max_algorithms",
             "max_algorithms: got an integer of 16610 bits; it must be an integer in [1, 256]"),
            (lambda: gm.autotune_gemm([(4, 4, 4)], "bf16", progress=False, warmup=-huge), "warmup",
             "warmup: got an integer of 16610 bits"),
            (lambda: gm.autotune_gemm([(4, 4, 4)], "bf16", progress=False, repeats=huge), "repeats",
             "repeats: got an integer of 16610 bits"),
            (lambda: gm.autotune_gemm([(4, 4, 4)], "bf16", progress=False, ctx=_NoRepr()), "ctx",
             "ctx: got <_NoRepr object>")]:
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == argument and words in str(info.value), str(info.value)
    assert tuner.tunes == []
    # A long value is clipped.
    for call, argument in [(lambda: gm.gemm(x, x, alpha=[0] * 100_000), "alpha"),
                           (lambda: gm.gemm(x, x, ctx=[0] * 100_000), "ctx"),
                           (lambda: gm.autotune_gemm([[0] * 100_000], "bf16", progress=False), "shapes")]:
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == argument and len(str(info.value)) < 400, str(info.value)[:500]


def test_a_ctx_whose_device_is_no_cuda_ordinal_is_no_context():
    # A context's device is an ordinal in [0, 2**31); 10**5000 could not even be printed in the
    # device-mismatch message.
    x = ClaimsCuda()
    for device in (10**5000, 2**31, -1):
        with pytest.raises(ConfigError) as info:
            gm.gemm(x, x, ctx=types.SimpleNamespace(device=device))
        assert info.value.argument == "ctx"
        assert "it must be an inferctx.InferenceContext" in str(info.value), str(info.value)


def test_shape_items_are_read_no_further_than_a_shape(tuner):
    # A shape has 3 or 4 dimensions: an item is not read whole to find it has more.
    for shapes in ([range(1, 10**18)], [(4, 4, 4), iter(range(1, 10**18))]):
        with pytest.raises(ConfigError) as info:
            _within(10, lambda: gm.autotune_gemm(shapes, "bf16", progress=False))
        assert info.value.argument == "shapes" and "each shape is (m, n, k)" in str(info.value)
    assert tuner.tunes == []


def test_autotune_without_stderr_draws_no_bar(tuner, monkeypatch):
    # sys.stderr is None under pythonw and in some services: the progress bar has nowhere to go.
    monkeypatch.setattr("sys.stderr", None)
    [r] = gm.autotune_gemm([(8, 16, 32)], "float16")
    assert r["skipped"] is False and len(tuner.tunes) == 1


def test_cache_paths_with_a_lone_surrogate(tuner, tmp_path, monkeypatch):
    # No file name can hold "\ud800" (it is no UTF-8): named as such before anything is tuned.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    monkeypatch.chdir(tmp_path)
    for call, argument in [(lambda: gm.load_gemm_cache("a\ud800.json"), "path"),
                           (lambda: gm.save_gemm_cache("a\ud800.json"), "path"),
                           (lambda: gm.save_gemm_cache("a\ud800.json", merge=False), "path"),
                           (lambda: gm.autotune_gemm([(4, 4, 4)], "bf16", progress=False,
                                                     cache_file="a\ud800.json"), "cache_file")]:
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == argument
        assert f"{argument}: got 'a\\ud800.json', which holds '\\ud800': no file name can" in str(info.value), \
            str(info.value)
    assert len(tuner.tunes) == 1 and list(tmp_path.iterdir()) == []


def test_names_that_open_no_file_never_replace_one(tuner, tmp_path, monkeypatch):
    # "gemm.json/" (a folder's name), "gemm.json/." and "missing/../gemm.json" open no file, yet
    # resolve to gemm.json: a save merged nothing and replaced it, losing its entries. Each is
    # refused before anything is read, tuned or written; "new/" makes no file "new".
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]
    monkeypatch.chdir(tmp_path)
    text = json.dumps({"format": "inferctx-gemm-cache", "version": 1,
                       "entries": [dict(good, device_name="Other GPU")]})
    (tmp_path / "gemm.json").write_text(text)
    for name, words in [("gemm.json/", "which names a folder, not a file"),
                        ("gemm.json/.", "which names a folder, not a file"),
                        ("new/", "which names a folder, not a file"),
                        ("missing/../gemm.json", "which names no file the system can open")]:
        for call, argument in [(lambda: gm.save_gemm_cache(name), "path"),
                               (lambda: gm.save_gemm_cache(name, merge=False), "path"),
                               (lambda: gm.load_gemm_cache(name), "path"),
                               (lambda: gm.autotune_gemm([(4, 4, 4)], "bf16", progress=False,
                                                         cache_file=name), "cache_file")]:
            with pytest.raises(ConfigError) as info:
                call()
            assert info.value.argument == argument and words in str(info.value), str(info.value)
        assert (tmp_path / "gemm.json").read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemm.json"] and len(tuner.tunes) == 1
    assert gm.save_gemm_cache("gemm.json") == 2  # its own name merges


@pytest.mark.parametrize("version", ["true", "1.0", "1e0"])
def test_cache_file_version_is_the_integer_1(tuner, tmp_path, version):
    # As an entry's integers refuse true and 1.0: the version is the JSON integer 1.
    path = tmp_path / "gemm.json"
    text = '{"format": "inferctx-gemm-cache", "version": %s, "entries": []}' % version
    path.write_text(text)
    for call in (lambda: gm.load_gemm_cache(path), lambda: gm.save_gemm_cache(path)):
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == "path"
        assert "has cache format version" in str(info.value) and "reads version 1" in str(info.value)
    assert path.read_text() == text

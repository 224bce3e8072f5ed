"""The GEMM layout C++ works out, run on the host against NumPy's product.

For each call, the operands are NumPy arrays laid out as a caller may hand them to gemm / bmm
(contiguous, transposed views, padded rows, batches and broadcasting, out beside an input in
one buffer, zero sizes). ``_core._gemm_layout`` works out the problem from their shapes and
strides (and checks their addresses); an emulator of cuBLAS's column-major strided-batched
GEMM, written here from cuBLAS's definition, runs that problem on the arrays' memory as
inferctx::gemm hands it to cuBLAS; the result must be NumPy's matmul of the logical operands.
Every value is a small integer (or half of one), so every product is exact: equality is
asserted, and out's elements that the product must not write hold NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

from inferctx import _core

F, T = False, True

# ---------------------------------------------------------------------------------------
# cuBLAS on the host


def _indices(start, rows, cols, ld, size, what):
    """The positions of a rows x cols column-major matrix, with leading dimension ld, whose
    first element is at `start` in a buffer of `size` elements; fails where one is outside."""
    idx = start + np.arange(rows)[:, None] + np.arange(cols)[None, :] * ld
    if idx.size:
        assert idx.min() >= 0 and idx.max() < size, f"{what} reaches outside its operand's memory"
    return idx


def cublas_gemm_strided_batched(transa, transb, m, n, k, alpha, A, lda, stride_a, B, ldb,
                                stride_b, beta, C, ldc, stride_c, batch):
    """cublasGemmStridedBatchedEx (cublasGemmEx for batch 1) as cuBLAS defines it, on host
    buffers. For i in [0, batch): C_i = alpha * op(A_i) @ op(B_i) + beta * C_i, where op(A_i) is
    m x k, op(B_i) k x n and C_i m x n; A_i is stored column-major from A[i * stride_a] with
    leading dimension lda, as m x k, or as k x m when transa (op = transpose); likewise B_i
    (k x n, or n x k when transb) and C_i. A, B and C are 1-D arrays of elements; A and B are
    read in float64 and C written in place. C is not read when beta is 0; m, n or batch 0 do
    nothing, and k = 0 gives C = beta * C."""
    a_rows, a_cols = (k, m) if transa else (m, k)
    b_rows, b_cols = (n, k) if transb else (k, n)
    assert lda >= max(1, a_rows) and ldb >= max(1, b_rows) and ldc >= max(1, m), "invalid ld"
    if m == 0 or n == 0 or batch == 0:
        return
    for i in range(batch):
        a = A[_indices(i * stride_a, a_rows, a_cols, lda, A.size, "A")].astype(np.float64)
        b = B[_indices(i * stride_b, b_rows, b_cols, ldb, B.size, "B")].astype(np.float64)
        c = _indices(i * stride_c, m, n, ldc, C.size, "C")
        value = alpha * ((a.T if transa else a) @ (b.T if transb else b))
        if beta != 0.0:
            value = value + beta * C[c].astype(np.float64)
        C[c] = value


def elements(x):
    """x's memory from its first element to its last, as a 1-D array of its elements (a view:
    writing it writes x's memory, the gaps between x's rows and matrices included)."""
    if x.size == 0:
        return np.empty(0, x.dtype)
    assert all(s >= 0 and s % x.itemsize == 0 for s in x.strides)
    extent = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.strides)) // x.itemsize
    return np.lib.stride_tricks.as_strided(x, shape=(extent,), strides=(x.itemsize,))


def run_problem(problem, a, b, c, alpha=1.0, beta=0.0):
    """A GemmProblem run as inferctx::gemm runs it (cuda/src/gemm.cpp): with the layout's swap,
    b's memory goes in as A and a's as B; the problem is row-major, and a row-major matrix is
    the column-major storage of its transpose, so C = op(A) op(B) is run as the column-major
    C^T = op(B)^T op(A)^T: B first, with n and m exchanged."""
    A, B, C = elements(a), elements(b), elements(c)
    if problem.get("swap", False):
        A, B = B, A
    p = problem
    cublas_gemm_strided_batched(p["trans_b"], p["trans_a"], p["n"], p["m"], p["k"], alpha,
                                B, p["ldb"], p["stride_b"], A, p["lda"], p["stride_a"], beta,
                                C, p["ldc"], p["stride_c"], p["batch"])


def _spec(x):
    return (x.dtype.name, x.shape, tuple(s // x.itemsize for s in x.strides))


def host_gemm(ndim, a, b, out=None, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """gemm (ndim 2) or bmm (ndim 3) of NumPy arrays: the layout C++ works out for them, with
    their addresses checked, run by the emulator. Returns out, or a new result laid out as
    inferctx allocates one (dense, row-major), NaN before the product."""
    spec_out = None if out is None else _spec(out)
    problem = _core._gemm_layout(ndim, trans_a, trans_b, _spec(a), _spec(b), spec_out)
    c = np.full(problem["out_shape"], np.nan, a.dtype) if out is None else out
    checked = _core._gemm_layout(ndim, trans_a, trans_b, _spec(a), _spec(b), spec_out,
                                 addresses=(a.ctypes.data, b.ctypes.data, c.ctypes.data))
    assert checked == problem
    run_problem(problem, a, b, c, alpha, beta)
    return c


# ---------------------------------------------------------------------------------------
# Operands


def _integers(shape, dtype, rng):
    return rng.integers(-4, 5, size=shape).astype(dtype)


def _stored(array, how):
    """`array`'s values laid out as asked: C-contiguous, as a transposed view of a contiguous
    array, as a slice of a wider array (padded rows, the padding NaN), or, for a batch, as the
    even matrices of twice as many (a batch stride larger than a matrix)."""
    if how == "contiguous":
        return np.ascontiguousarray(array)
    if how == "transposed":
        return np.ascontiguousarray(np.swapaxes(array, -1, -2)).swapaxes(-1, -2)
    if how == "padded":
        wide = np.full(array.shape[:-1] + (array.shape[-1] + 3,), np.nan, dtype=array.dtype)
        wide[..., : array.shape[-1]] = array
        return wide[..., : array.shape[-1]]
    assert how == "spaced" and array.ndim == 3
    spaced = np.full((2 * array.shape[0],) + array.shape[1:], np.nan, dtype=array.dtype)
    spaced[::2] = array
    return spaced[::2]


def _op(x, trans):
    return np.swapaxes(x, -1, -2) if trans else x


def _product(a, b, trans_a=False, trans_b=False):
    """NumPy's matmul of op(a) and op(b), in float64."""
    return np.matmul(_op(a, trans_a).astype(np.float64), _op(b, trans_b).astype(np.float64))


def _assert_equal(got, ref):
    assert got.shape == ref.shape
    np.testing.assert_array_equal(got.astype(np.float64), ref)


# ---------------------------------------------------------------------------------------
# gemm


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("a_how", ["contiguous", "transposed", "padded"])
@pytest.mark.parametrize("b_how", ["contiguous", "transposed", "padded"])
@pytest.mark.parametrize("out_how", [None, "contiguous", "transposed", "padded"])
def test_layouts_give_numpys_product(dtype, trans_a, trans_b, a_how, b_how, out_how):
    rng = np.random.default_rng(0)
    m, n, k = 5, 7, 3
    a = _integers((k, m) if trans_a else (m, k), dtype, rng)
    b = _integers((n, k) if trans_b else (k, n), dtype, rng)
    out = None if out_how is None else _stored(np.full((m, n), np.nan, dtype), out_how)
    got = host_gemm(2, _stored(a, a_how), _stored(b, b_how), out, trans_a, trans_b)
    if out is not None:
        assert got is out
    if out_how == "padded":
        assert np.isnan(out.base[:, n:]).all()  # the gap after each row is untouched
    _assert_equal(got, _product(a, b, trans_a, trans_b))


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("out_how", ["contiguous", "transposed", "padded"])
def test_alpha_beta_accumulate_into_out(trans_a, trans_b, out_how):
    rng = np.random.default_rng(1)
    a = _integers((6, 4) if trans_a else (4, 6), np.float32, rng)
    b = _integers((5, 6) if trans_b else (6, 5), np.float32, rng)
    c0 = _integers((4, 5), np.float32, rng)
    ref = 0.5 * _product(a, b, trans_a, trans_b) - 1.5 * c0
    out = _stored(c0.copy(), out_how)
    host_gemm(2, a, b, out, trans_a, trans_b, alpha=0.5, beta=-1.5)
    _assert_equal(out, ref)


@pytest.mark.parametrize("trans_a, trans_b", [(F, F), (T, T)])
@pytest.mark.parametrize("side", ["out right of a", "out left of a", "out right of b"])
def test_side_by_side_out_in_one_buffer_runs(side, trans_a, trans_b):
    """out and an input in the same rows of one buffer: the product reads the input's columns
    and writes only out's."""
    rng = np.random.default_rng(2)
    # (buffer's shape, the input's rows and columns in it, out's columns)
    shape, rows, cols, out_cols = {
        "out right of a": ((6, 12), slice(0, 6), slice(0, 4), slice(4, 12)),
        "out left of a": ((6, 12), slice(0, 6), slice(8, 12), slice(0, 8)),
        "out right of b": ((6, 16), slice(0, 4), slice(0, 8), slice(8, 16)),
    }[side]
    buffer = np.full(shape, np.nan, np.float32)
    if side == "out right of b":
        buffer[rows, cols] = _integers((4, 8), np.float32, rng)
        op_a, op_b = _integers((6, 4), np.float32, rng), buffer[rows, cols]
    else:
        buffer[rows, cols] = _integers((6, 4), np.float32, rng)
        op_a, op_b = buffer[rows, cols], _integers((4, 8), np.float32, rng)
    out = buffer[:, out_cols]
    ref = _product(op_a, op_b)
    before = buffer.copy()
    # With both trans flags, the same operands as transposed views.
    a, b = (op_a.T, op_b.T) if trans_a else (op_a, op_b)
    host_gemm(2, a, b, out, trans_a, trans_b)
    _assert_equal(out, ref)
    rest = np.ones(shape, bool)
    rest[:, out_cols] = False
    np.testing.assert_array_equal(buffer[rest], before[rest])  # the input, and NaN elsewhere


@pytest.mark.parametrize("side", ["out right of a", "out left of b", "out interleaved with a",
                                  "out interleaved with b", "out beside a broadcast b"])
def test_bmm_out_in_one_buffer_with_an_input_runs(side):
    """bmm with out and an input in one buffer, their elements apart: side by side in the same
    rows of each matrix, or alternate matrices of one batch. The product reads the input and
    writes only out's elements."""
    rng = np.random.default_rng(7)
    batch, n, k = 3, 5, 6
    m = k if side == "out left of b" else 4
    if side == "out left of b":  # b is (k, n) and out (m, n) = (k, n): rows of 2n, out | b
        buffer, place_in, place_out = np.full((batch, k, 2 * n), np.nan, np.float32), np.s_[..., n:], np.s_[..., :n]
    elif side.startswith("out interleaved"):  # even matrices the input, odd ones out
        m = k = n
        buffer, place_in, place_out = np.full((2 * batch, n, n), np.nan, np.float32), np.s_[0::2], np.s_[1::2]
    else:  # rows of k + n: a | out
        buffer, place_in, place_out = np.full((batch, m, k + n), np.nan, np.float32), np.s_[..., :k], np.s_[..., k:]
    buffer[place_in] = _integers(buffer[place_in].shape, np.float32, rng)
    if side in ("out left of b", "out interleaved with b"):
        a, b = _integers((batch, m, k), np.float32, rng), buffer[place_in]
    else:
        a, b = buffer[place_in], _integers((1 if "broadcast" in side else batch, k, n), np.float32, rng)
    out = buffer[place_out]
    ref = _product(a, b)
    before = buffer.copy()
    host_gemm(3, a, b, out)
    _assert_equal(out, ref)
    rest = np.ones(buffer.shape, bool)
    rest[place_out] = False
    np.testing.assert_array_equal(buffer[rest], before[rest])  # the input, and NaN elsewhere


@pytest.mark.parametrize("case", ["k = 0", "k = 0 into out", "k = 0 into column-major out",
                                  "m = 0", "n = 0", "bmm of batch 0", "bmm k = 0"])
def test_zero_sizes(case):
    f32 = lambda *shape: np.ones(shape, np.float32)  # noqa: E731
    if case == "k = 0":  # a new result is all zeros (the NaN it held is not read)
        _assert_equal(host_gemm(2, f32(3, 0), f32(0, 4)), np.zeros((3, 4)))
    elif case.startswith("k = 0 into"):  # C = beta * C
        out = _stored(np.full((5, 7), 2.0, np.float32),
                      "transposed" if "column-major" in case else "contiguous")
        host_gemm(2, f32(5, 0), f32(0, 7), out, beta=0.5)
        _assert_equal(out, np.ones((5, 7)))
    elif case == "m = 0":
        assert host_gemm(2, f32(0, 5), f32(5, 4)).shape == (0, 4)
    elif case == "n = 0":
        assert host_gemm(2, f32(3, 5), f32(5, 0)).shape == (3, 0)
    elif case == "bmm of batch 0":  # with the strides torch gives (NumPy's are all 0 here)
        empty = lambda shape: np.lib.stride_tricks.as_strided(  # noqa: E731
            np.empty(0, np.float32), shape, (4 * shape[1] * shape[2], 4 * shape[2], 4))
        assert host_gemm(3, empty((0, 3, 5)), empty((0, 5, 4))).shape == (0, 3, 4)
    else:
        _assert_equal(host_gemm(3, f32(2, 3, 0), f32(1, 0, 4)), np.zeros((2, 3, 4)))


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_contiguous_call_matches_the_autotuned_problem(trans_a, trans_b, batch):
    """The packed problem autotune_gemm tunes for a shape (the cache key) is the problem of a
    contiguous call of it, and computes its product."""
    rng = np.random.default_rng(3)
    m, n, k = 8, 32, 16
    a = _integers((batch,) + ((k, m) if trans_a else (m, k)), np.float16, rng)
    b = _integers((batch,) + ((n, k) if trans_b else (k, n)), np.float16, rng)
    ndim = 3 if batch > 1 else 2
    if ndim == 2:
        a, b = a[0], b[0]
    ref = _product(a, b, trans_a, trans_b)
    _assert_equal(host_gemm(ndim, a, b, None, trans_a, trans_b), ref)
    got = _core._gemm_layout(ndim, trans_a, trans_b, _spec(a), _spec(b))
    packed = _core._gemm_packed_problem(1, m, n, k, batch, trans_a, trans_b, False)
    for field in ("m", "n", "k", "batch", "lda", "ldb", "ldc", "trans_a", "trans_b", "dtype"):
        assert got[field] == packed[field], field
    c = np.full(ref.shape, np.nan, np.float16)
    run_problem(packed, a, b, c)
    _assert_equal(c, ref)


# ---------------------------------------------------------------------------------------
# bmm


def _batched(x, how, batch):
    """A (batch, r, c) operand from the matrices of x: laid out by _stored, or as one matrix
    for the whole batch ("one": a batch of 1, which broadcasts; "repeated": a view of it with
    batch stride 0)."""
    if how == "one":
        return x[:1].copy()
    if how == "repeated":
        return np.broadcast_to(x[:1], (batch,) + x.shape[1:])
    return _stored(x, how)


def _batched_out(shape, how):
    """A NaN-filled (batch, m, n) out laid out as asked; "interleaved": a view of an
    (m, batch, n) array, the batch's rows taking turns."""
    if how is None:
        return None
    batch, m, n = shape
    if how == "interleaved":
        return np.full((m, batch, n), np.nan, np.float32).transpose(1, 0, 2)
    return _stored(np.full(shape, np.nan, np.float32), how)


BATCH_HOWS = ["contiguous", "transposed", "padded", "one", "repeated"]


@pytest.mark.parametrize("trans_a, trans_b", [(F, T), (T, F)])
@pytest.mark.parametrize("a_how", BATCH_HOWS)
@pytest.mark.parametrize("b_how", BATCH_HOWS)
@pytest.mark.parametrize("out_how", [None, "contiguous", "transposed", "interleaved"])
def test_bmm_batches_broadcasts_and_interleaved_out(a_how, b_how, out_how, trans_a, trans_b):
    rng = np.random.default_rng(4)
    batch, m, n, k = 4, 3, 5, 6
    a = _batched(_integers((batch,) + ((k, m) if trans_a else (m, k)), np.float32, rng), a_how, batch)
    b = _batched(_integers((batch,) + ((n, k) if trans_b else (k, n)), np.float32, rng), b_how, batch)
    ref = _product(a, b, trans_a, trans_b)  # broadcasts a batch of 1 as bmm does
    out = _batched_out(ref.shape, out_how)
    got = host_gemm(3, a, b, out, trans_a, trans_b)
    if out is not None:
        assert got is out
    _assert_equal(got, ref)


@pytest.mark.parametrize("case", ["spaced a and b", "padded out", "spaced out"])
def test_bmm_batch_strides_past_the_matrix(case):
    """Batch strides larger than a matrix (every other matrix of a larger batch): the gaps are
    neither read nor written."""
    rng = np.random.default_rng(5)
    batch, m, n, k = 3, 4, 2, 5
    a, b = _integers((batch, m, k), np.float32, rng), _integers((batch, k, n), np.float32, rng)
    ref = _product(a, b)
    if case == "spaced a and b":
        _assert_equal(host_gemm(3, _stored(a, "spaced"), _stored(b, "spaced")), ref)
        return
    out = _stored(np.full(ref.shape, np.nan, np.float32), case.split()[0])
    host_gemm(3, a, b, out)
    _assert_equal(out, ref)
    base = out.base
    written = np.zeros(base.shape, bool)
    written[(slice(None, None, 2),) if case == "spaced out" else (Ellipsis, slice(0, n))] = True
    assert np.isnan(base[~written]).all()

"""GEMM with NumPy / PyTorch row-major semantics on a context's cuBLAS handle and stream.

``gemm(a, b)`` computes ``alpha * op(a) @ op(b) + beta * out`` and ``bmm`` its strided batch,
through cuBLASLt with fp32 accumulation; ``autotune_gemm`` times cuBLASLt's candidate
algorithms for given shapes and caches the fastest correct one per problem, and
``save_gemm_cache`` / ``load_gemm_cache`` keep those choices in a JSON file.

Operands are any CUDA arrays that export DLPack or ``__cuda_array_interface__`` (torch, CuPy,
JAX, Numba, inferctx.DeviceView), 2-D (``gemm``) or 3-D (``bmm``), with unit stride along one
of their last two dimensions: a transposed view is read in place, as cuBLAS reads it.

The call contract (as for every inferctx kernel): the product runs on the current stream of the
operands' package (torch's ``current_stream``, CuPy's current stream; the first operand of a
package decides when they are mixed), or ``ctx.stream`` for operands of no package; ``stream=``
overrides. The result comes back in that package (a torch tensor from torch's caching
allocator, a CuPy array, or a DeviceView from the context's pool) and is complete before any
later work on the caller's current stream. All-torch calls on torch's current stream take a
fast path that reads the tensors directly.

What this module needs from the compiled ``inferctx._core``; ``ctx`` is an InferenceContext,
each call releases the GIL around the C++ one and C++ errors become inferctx.errors exceptions:

``_core._begin(operands, ctx, stream) -> call``
    The call contract for ``operands`` (a, b, out): ``call.ctx``, ``call.kernel`` (the stream
    handle the product runs on), ``call.import_array(obj, argument) -> CudaArray``,
    ``call.new_result(dtype, shape)`` and ``call.done()`` (the caller's streams wait for it).
``_core._gemm(ctx, stream, a_ptr, b_ptr, c_ptr, dtype, trans_a, trans_b, m, n, k, batch, lda,
ldb, ldc, stride_a, stride_b, stride_c, alpha, beta, tf32) -> None``
    ``inferctx::gemm(ctx.cublas(), stream, problem, a, b, c, alpha, beta)`` with the
    GemmProblem fields of the same names (cuda/include/inferctx/gemm.hpp); the stream handle,
    pointers and sizes are ints, dtype the DType code, trans_* and tf32 bools, alpha and beta
    floats.
``_core._gemm_tune(ctx, dtype, trans_a, trans_b, m, n, k, batch, lda, ldb, ldc, stride_a,
stride_b, stride_c, tf32, max_algorithms, warmup, repeats) -> dict``
    ``inferctx::tune_gemm`` on the context's handle, on ``ctx.stream``; the dict has the fields of
    GemmTuneResult (backend, algo_index, algo, algo_id, tile_id, stages_id, splitk,
    default_ms, best_ms, candidates, valid, rotated_sets).
``_core._gemm_cache_export(tuned_only) -> list[dict]`` and
``_core._gemm_cache_import(entries) -> int``
    GemmCacheEntry as a dict: device, device_name (str), cublas_version, problem (a dict of
    the GemmProblem fields: dtype, trans_a, trans_b, m, n, k, batch, lda, ldb, ldc,
    stride_a, stride_b, stride_c, tf32), align_a, align_b, align_c, backend, algo (list of
    ints: 8, or none for backend 1), time_ms. Import returns how many entries it took.
``_core._gemm_cache_clear() -> None``
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

from . import _core
from .dtypes import ITEMSIZE, NAMES, dtype_code
from .errors import ConfigError

__all__ = [
    "gemm",
    "bmm",
    "autotune_gemm",
    "save_gemm_cache",
    "load_gemm_cache",
    "clear_gemm_cache",
    "gemm_cache_entries",
]

_log = logging.getLogger("inferctx")

_CODES = {name: code for code, name in NAMES.items()}  # dtype name -> inferctx::DType code
_BACKENDS = {0: "cublasLt", 1: "cublas"}
_BACKEND_CODES = {v: k for k, v in _BACKENDS.items()}
_SHORT = {0: "fp32", 1: "fp16", 2: "bf16"}
# DLPack device types (dlpack.h)
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13
_DL_PLACES = {1: "host", 3: "pinned host", 2: "CUDA device", 13: "CUDA managed"}
# torch is never imported here; once the caller has imported it, its tensors of a problem seen
# before take this compiled path (NotImplemented where the general one must decide).
_torch_gemm = _core._torch_gemm

# Contexts by device ordinal (one per device for the life of the process).
_contexts: dict = {}


# ---------------------------------------------------------------------------------------
# Public API


def gemm(a: Any, b: Any, *, out: Any = None, trans_a: bool = False, trans_b: bool = False,
         alpha: float = 1.0, beta: float = 0.0, ctx: Any = None, tf32: bool = False,
         stream: Any = None) -> Any:
    """``alpha * op(a) @ op(b) + beta * out`` for 2-D CUDA arrays, as NumPy / PyTorch define it.

    Parameters
    ----------
    a, b
        2-D CUDA arrays of the same dtype (float32, float16 or bfloat16) on one device:
        ``a`` is (m, k), or (k, m) with ``trans_a``; ``b`` is (k, n), or (n, k) with ``trans_b``.
        Either may be a transposed view (unit stride along its first dimension).
    out
        (m, n) array of the same dtype to write into (row- or column-major); a new
        DeviceView when None.
    trans_a, trans_b
        Use the transpose of ``a`` / ``b``.
    alpha, beta
        Scale factors (fp32). ``beta`` other than 0 needs ``out``, whose values it scales.
    ctx
        The InferenceContext whose cuBLAS handle runs the product; by default the one of the
        operands' device.
    tf32
        float32 only: allow TF32 tensor cores (relative error near 3e-4 instead of near 1e-6).
    stream
        Run on this stream (of the operands' device) instead of the caller's current stream;
        the caller's current stream still waits for the result.

    Returns
    -------
    ``out``, or a new array in the operands' package: a torch tensor for torch operands, a CuPy
    array for CuPy ones, an inferctx.DeviceView otherwise. Accumulation is fp32 for every
    dtype. The product runs on the caller's current stream (see the module's call contract)
    and is complete before any later work there; m, n or k may be 0 (k = 0 gives
    ``beta * out``, zeros for a new result). Untuned, it makes the cuBLAS call torch.matmul
    makes (``cublasGemmEx``), so it gives torch's bits at torch's speed; ``autotune_gemm``
    may find a faster cuBLASLt algorithm.
    """
    if stream is None:  # torch tensors of a problem seen before: compiled, in one call
        done = _torch_gemm(2, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32)
        if done is not NotImplemented:
            return done
    return _product("gemm", 2, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32, stream)


def bmm(a: Any, b: Any, *, out: Any = None, trans_a: bool = False, trans_b: bool = False,
        alpha: float = 1.0, beta: float = 0.0, ctx: Any = None, tf32: bool = False,
        stream: Any = None) -> Any:
    """Batched ``gemm`` of 3-D CUDA arrays: ``out[i] = alpha * op(a[i]) @ op(b[i]) + beta * out[i]``.

    ``a`` is (batch, m, k) (or (batch, k, m) with ``trans_a``), ``b`` is (batch, k, n) (or
    (batch, n, k) with ``trans_b``); a batch size of 1 in one operand is broadcast over the
    other's. Any batch stride works, so a (batch, m, n) view of an (m, batch, n) array does
    too. Returns ``out`` or a new (batch, m, n) array in the operands' package. Other arguments,
    and the call contract, as in ``gemm``.
    """
    if stream is None:  # torch tensors of a problem seen before: compiled, in one call
        done = _torch_gemm(3, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32)
        if done is not NotImplemented:
            return done
    return _product("bmm", 3, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32, stream)


def autotune_gemm(shapes: Any, dtype: Any, *, trans_a: bool = False, trans_b: bool = False,
                  tf32: bool = False, ctx: Any = None, cache_file: Any = None,
                  progress: bool = True, force: bool = False, max_algorithms: int = 32,
                  warmup: int = 3, repeats: int = 7) -> List[Dict[str, Any]]:
    """Times cuBLASLt's candidate algorithms for each shape and keeps the fastest correct one.

    Parameters
    ----------
    shapes
        Problems as ``(m, n, k)`` or ``(batch, m, n, k)`` tuples: ``op(a)`` is m x k, ``op(b)``
        k x n. Each is tuned for densely packed operands (what a contiguous tensor, or its
        transpose with the matching ``trans_*``, has); later ``gemm`` / ``bmm`` calls with that
        problem on 256-byte aligned memory use the result.
    dtype
        'float32', 'float16', 'bfloat16' (or a NumPy / torch dtype).
    trans_a, trans_b, tf32
        As in ``gemm``.
    ctx
        The context to tune on (the current device's by default).
    cache_file
        A JSON file: loaded first when it exists (problems already in it are not tuned again
        unless ``force``), and written (merged) afterwards.
    progress
        Draw a progress bar on stderr.
    force
        Tune problems the cache already has.
    max_algorithms, warmup, repeats
        Candidates asked of cuBLASLt's heuristic (1..256), untimed runs and timed batches per
        candidate.

    Returns
    -------
    One dict per shape: shape, dtype, trans_a, trans_b, tf32, default_ms (cuBLASLt's first
    choice), tuned_ms, speedup, backend ('cublasLt' or 'cublas', the path PyTorch takes),
    algo_index (0: the heuristic's first choice; -1: cuBLAS), candidates, valid, skipped
    (True when the cache already had it).
    """
    code = dtype_code(dtype)
    flags = {name: _flag(value, name) for name, value in
             (("trans_a", trans_a), ("trans_b", trans_b), ("tf32", tf32), ("progress", progress),
              ("force", force))}
    problems = _tune_shapes(shapes)
    for name, value, low in (("max_algorithms", max_algorithms, 1), ("warmup", warmup, 0),
                             ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ConfigError(f"{name}: got {value!r}; it must be an integer >= {low}",
                              argument=name)
    if ctx is None:
        ctx = _context_of_current_device()
    device = _context_device(ctx)
    if cache_file is not None and os.path.exists(cache_file):
        load_gemm_cache(cache_file)
    known = {} if flags["force"] else _tuned_problems(device)

    results = []
    bar = _Progress(len(problems), flags["progress"])
    try:
        for batch, m, n, k in problems:
            p = _packed(code, m, n, k, batch, flags["trans_a"], flags["trans_b"], flags["tf32"])
            label = (f"{_SHORT[code]} {m}x{n}x{k}" + (f" x{batch}" if batch > 1 else "")
                     + ("" if not (flags["trans_a"] or flags["trans_b"]) else
                        f" {'T' if flags['trans_a'] else 'N'}{'T' if flags['trans_b'] else 'N'}"))
            bar.start(label)
            record = {"shape": (batch, m, n, k), "dtype": NAMES[code],
                      "trans_a": flags["trans_a"], "trans_b": flags["trans_b"],
                      "tf32": bool(flags["tf32"] and code == 0)}
            key = _problem_key(p)
            if key in known:
                entry = known[key]
                record.update(default_ms=None, tuned_ms=entry["time_ms"], speedup=None,
                              backend=_BACKENDS.get(entry["backend"], "cublasLt"), algo_index=None,
                              candidates=0, valid=0, skipped=True)
            else:
                r = _core._gemm_tune(ctx, code, p["trans_a"], p["trans_b"], m, n, k, batch,
                                     p["lda"], p["ldb"], p["ldc"], p["stride_a"], p["stride_b"],
                                     p["stride_c"], p["tf32"], int(max_algorithms), int(warmup),
                                     int(repeats))
                default_ms = r["default_ms"] if r["default_ms"] > 0 else None
                record.update(default_ms=default_ms, tuned_ms=r["best_ms"],
                              speedup=(default_ms / r["best_ms"]) if default_ms else None,
                              backend=_BACKENDS.get(r["backend"], str(r["backend"])),
                              algo_index=r["algo_index"], candidates=r["candidates"],
                              valid=r["valid"], skipped=False)
            results.append(record)
            bar.done(label, record)
    finally:
        bar.close()
    if cache_file is not None:
        save_gemm_cache(cache_file)
    return results


def save_gemm_cache(path: Any, *, merge: bool = True) -> int:
    """Writes the autotuned GEMM algorithms to a JSON file; returns how many entries it holds.

    With ``merge`` the file's entries for other problems, GPUs or cuBLAS versions are kept, so
    one file can serve several machines. The file is replaced atomically.
    """
    path = os.fspath(path)
    entries = gemm_cache_entries()
    if merge and os.path.exists(path):
        mine = {_identity(e) for e in entries}
        entries += [e for e in _read_cache_file(path) if _identity(e) not in mine]
    document = {"format": _FORMAT, "version": _VERSION, "entries": entries}
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gemm-cache-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(entries)


def load_gemm_cache(path: Any) -> int:
    """Loads autotuned GEMM algorithms from a JSON file; returns how many apply here.

    Entries made on another GPU model, with another cuBLAS version or for a device this
    machine lacks are skipped (a file may hold several machines' entries). A malformed file
    raises ConfigError naming ``path``.
    """
    path = os.fspath(path)
    entries = _read_cache_file(path)
    converted = [_entry_from_json(e, path, i) for i, e in enumerate(entries)]
    try:
        taken = _core._gemm_cache_import(converted)
    except ConfigError as exc:
        raise ConfigError(f"path: {path} has an invalid entry: {exc}", argument="path") from exc
    if taken < len(entries):
        _log.info("load_gemm_cache: %d of %d entries in %s apply to this machine (the others were "
                  "tuned on another GPU, cuBLAS version or device)", taken, len(entries), path)
    return taken


def clear_gemm_cache() -> None:
    """Forgets every cached GEMM algorithm (tuned and heuristic) in this process."""
    _core._gemm_cache_clear()


def gemm_cache_entries(tuned_only: bool = True) -> List[Dict[str, Any]]:
    """The process's cached GEMM algorithms as JSON-ready dicts (the format of the cache file)."""
    return [_entry_to_json(e) for e in _core._gemm_cache_export(_flag(tuned_only, "tuned_only"))]


# ---------------------------------------------------------------------------------------
# The product


def _product(name, ndim, a, b, out, trans_a, trans_b, alpha, beta, ctx, tf32, stream):
    if trans_a is not False and trans_a is not True:
        trans_a = _flag(trans_a, "trans_a")
    if trans_b is not False and trans_b is not True:
        trans_b = _flag(trans_b, "trans_b")
    if tf32 is not False and tf32 is not True:
        tf32 = _flag(tf32, "tf32")
    if type(alpha) is not float:
        alpha = _scalar(alpha, "alpha")
    if type(beta) is not float:
        beta = _scalar(beta, "beta")
    if beta != 0.0 and out is None:
        raise ConfigError(f"{name}: beta={beta} scales the values of out, but there is no out=; "
                          f"pass the array to accumulate into as out=", argument="beta")

    # A first call of a torch signature, or one that needs checks, comes here too: the general
    # path below reads torch tensors directly and stores the problem for the compiled one.
    # Any DLPack / CUDA-array-interface producer, under the call contract.
    device = _device_hint(a, "a", name)
    b_device = _device_hint(b, "b", name)
    if out is not None:
        _device_hint(out, "out", name)
    if ctx is None and device is None and b_device is not None:
        ctx = _contexts.get(b_device) or _context_for(b_device)
    elif ctx is not None and device is not None and device != _context_device(ctx):
        _ctx_device_error(name, device, _context_device(ctx))
    call = _core._begin((a, b, out), ctx, stream)
    va = call.import_array(a, "a")
    vb = call.import_array(b, "b")
    vc = None if out is None else call.import_array(out, "out")
    if vc is not None and vc.read_only:
        raise ConfigError(f"{name}: out ({_type_name(out)}) is read-only; pass a writable array",
                          argument="out")
    key = (ndim, trans_a, trans_b, _CODES.get(va.dtype), va.shape, va.strides,
           _CODES.get(vb.dtype), vb.shape, vb.strides,
           None if vc is None else _CODES.get(vc.dtype), None if vc is None else vc.shape,
           None if vc is None else vc.strides)
    plan = _plans.get(key)
    if plan is None:
        plan = _new_plan(name, key, a, b, out,
                         (va.dtype, vb.dtype, None if vc is None else vc.dtype))
    fresh = out is None
    if fresh:
        if va.device != vb.device:
            _device_error(name, plan[19], va.device, vb.device, va.device)
        out = call.new_result(NAMES[plan[0]], plan[14])
        c_ptr = _core._address_of(out)
    else:
        c_ptr = vc.ptr
    # va / vb / vc keep the memory alive until the product is queued.
    result = _launch(name, plan, call.ctx, call.kernel, va.device, vb.device,
                     va.device if vc is None else vc.device, va.ptr, vb.ptr, out, c_ptr, fresh,
                     alpha, beta, tf32)
    call.done()
    return result


# Problems worked out from (ndim, transposes, dtypes, shapes, strides): what a call needs
# beyond its pointers. Bounded; cleared when full.
_plans: dict = {}
_PLAN_LIMIT = 4096
_core._set_gemm_plans(_plans)  # _torch_gemm reads the same table


def _launch(name, plan, ctx, stream, a_device, b_device, c_device, a_ptr, b_ptr, out, c_ptr,
            fresh, alpha, beta, tf32):
    """Checks devices and memory overlap for one call of a worked-out problem and queues it on
    `stream`; `fresh`: out was made for this call (nothing to overlap)."""
    (code, m, n, k, batch, lda, ldb, ldc, stride_a, stride_b, stride_c, ta, tb, swap, expected,
     span_a, span_b, span_c, spans, shapes) = plan
    if b_device != a_device or c_device != a_device:
        _device_error(name, shapes, a_device, b_device, c_device)
    ctx_device = _context_device(ctx)
    if a_device != ctx_device:
        _ctx_device_error(name, a_device, ctx_device)
    if not fresh and ((a_ptr < c_ptr + span_c and c_ptr < a_ptr + span_a)
                      or (b_ptr < c_ptr + span_c and c_ptr < b_ptr + span_b)):
        _check_no_overlap(name, a_ptr, b_ptr, c_ptr, spans, ITEMSIZE[code])
    size = ITEMSIZE[code]
    if a_ptr % size or b_ptr % size or c_ptr % size:
        _misaligned(name, size, (("a", a_ptr), ("b", b_ptr), ("out", c_ptr)))
    if swap:
        a_ptr, b_ptr = b_ptr, a_ptr
    _core._gemm(ctx, stream, a_ptr, b_ptr, c_ptr, code, ta, tb, m, n, k, batch, lda, ldb, ldc,
                stride_a, stride_b, stride_c, alpha, beta, tf32)
    return out


def _misaligned(name, size, pointers):
    argument, ptr = next((arg, p) for arg, p in pointers if p % size)
    raise ConfigError(f"{name}: {argument} starts at {ptr:#x}, which is not a multiple of its "
                      f"{size}-byte elements; cuBLAS needs element-aligned operands (an array that "
                      f"starts at a byte offset inside another must start at a whole element)",
                      argument=argument)


def _new_plan(name, key, a, b, out, dtypes):
    """Works out the stored-matrix problem of a call (ConfigError for what cannot be run) and
    remembers it under `key`."""
    (ndim, trans_a, trans_b, code, a_shape, a_strides, b_code, b_shape, b_strides, c_code,
     c_shape, c_strides) = key
    if len(a_shape) != ndim or len(b_shape) != ndim:
        bad, shape = ("a", a_shape) if len(a_shape) != ndim else ("b", b_shape)
        raise ConfigError(f"{name}: {bad} must be {ndim}-D ({'(m, k)' if ndim == 2 else '(batch, m, k)'}"
                          f" and so on); got a of shape {_shape(a_shape)} and b of shape "
                          f"{_shape(b_shape)}" + ("; use bmm for batches" if ndim == 2 and
                                                   len(shape) == 3 else ""), argument=bad)
    if code is None or b_code is None or code != b_code:
        _dtype_error(name, a, b, (a_shape, code), (b_shape, b_code), dtypes)

    la = _layout(a_shape, a_strides)
    if la is None:
        _layout_error(name, "a", a_shape, a_strides)
    lb = _layout(b_shape, b_strides)
    if lb is None:
        _layout_error(name, "b", b_shape, b_strides)
    a_batch, stride_a, a_rows, a_cols, lda, a_flip = la
    b_batch, stride_b, b_rows, b_cols, ldb, b_flip = lb
    # Logical op(a) is m x k; the stored matrix is a's transpose when a_flip.
    if a_flip:
        m, k = (a_rows, a_cols) if trans_a else (a_cols, a_rows)
    else:
        m, k = (a_cols, a_rows) if trans_a else (a_rows, a_cols)
    if b_flip:
        kb, n = (b_rows, b_cols) if trans_b else (b_cols, b_rows)
    else:
        kb, n = (b_cols, b_rows) if trans_b else (b_rows, b_cols)
    if kb != k:
        raise ConfigError(
            f"{name}: a of shape {_shape(a_shape)}{' (trans_a)' if trans_a else ''} and b of shape "
            f"{_shape(b_shape)}{' (trans_b)' if trans_b else ''} do not multiply: op(a) has "
            f"{k} columns but op(b) has {kb} rows", argument="b")
    ta = trans_a != a_flip
    tb = trans_b != b_flip
    batch = a_batch if a_batch >= b_batch else b_batch
    if (a_batch != batch and a_batch != 1) or (b_batch != batch and b_batch != 1):
        raise ConfigError(f"{name}: a of shape {_shape(a_shape)} and b of shape {_shape(b_shape)} "
                          f"have batch sizes {a_batch} and {b_batch}; they must be equal (or one "
                          f"of them 1, to broadcast)", argument="b")
    if a_batch == 1:
        stride_a = 0
    if b_batch == 1:
        stride_b = 0
    expected = (m, n) if ndim == 2 else (batch, m, n)
    size = ITEMSIZE[code]
    swap = False
    if c_shape is None:
        ldc = n if n > 0 else 1
        stride_c = m * n
        c_layout = (batch, stride_c, m, n, ldc)
    else:
        if tuple(c_shape) != expected:
            raise ConfigError(f"{name}: out has shape {_shape(c_shape)}, but a of shape "
                              f"{_shape(a_shape)} and b of shape {_shape(b_shape)} give "
                              f"{_shape(expected)}", argument="out")
        if c_code != code:
            _out_dtype_error(name, out, code, (c_shape, c_code), dtypes)
        lc = _layout(c_shape, c_strides)
        if lc is None:
            _layout_error(name, "out", c_shape, c_strides)
        _, stride_c, c_rows, c_cols, ldc, swap = lc
        if batch == 1:
            stride_c = 0
        c_layout = (batch, stride_c, c_rows, c_cols, ldc)
    spans = ((batch if stride_a else 1, stride_a, a_rows, a_cols, lda),
             (batch if stride_b else 1, stride_b, b_rows, b_cols, ldb), c_layout)
    span_a, span_b, span_c = (_span_bytes(*layout, size) for layout in spans)
    if swap:
        # out is column-major: out^T = op(b)^T op(a)^T, written row-major.
        ta, tb = not tb, not ta
        lda, ldb = ldb, lda
        stride_a, stride_b = stride_b, stride_a
        m, n = n, m
    plan = (code, m, n, k, batch, lda, ldb, ldc, stride_a, stride_b, stride_c, ta, tb, swap,
            expected, span_a, span_b, span_c, spans, (a_shape, b_shape, c_shape))
    if len(_plans) >= _PLAN_LIMIT:
        _plans.clear()
    _plans[key] = plan
    return plan


def _span_bytes(batch, stride, rows, cols, ld, size):
    """Bytes from an operand's first element to just past its last (0 when it is empty)."""
    if batch == 0 or rows == 0 or cols == 0:
        return 0
    return ((batch - 1) * stride + (rows - 1) * ld + cols) * size


def _device_error(name, shapes, a_device, b_device, c_device):
    a_shape, b_shape, c_shape = shapes
    if b_device != a_device:
        raise ConfigError(f"{name}: a {_shape(a_shape)} is on cuda:{a_device} but b "
                          f"{_shape(b_shape)} is on cuda:{b_device}; both must be on one device",
                          argument="b")
    raise ConfigError(f"{name}: out {_shape(c_shape)} is on cuda:{c_device} but a and b are on "
                      f"cuda:{a_device}", argument="out")


def _ctx_device_error(name, device, ctx_device):
    raise ConfigError(f"{name}: the operands are on cuda:{device} but ctx is the context of "
                      f"cuda:{ctx_device}; pass ctx=InferenceContext.instance({device}) or leave "
                      f"ctx=None", argument="ctx")


def _layout(shape, strides):
    """(batch, batch_stride, rows, cols, ld, flipped) of a 2-D or 3-D array as stored row-major
    matrices: flipped when its last two dimensions are column-major (its transpose is stored
    row-major). None when neither of the last two dimensions has unit stride."""
    if len(shape) == 3:
        batch, r, c = shape
        sb, sr, sc = strides
        if sb < 0:
            return None
    else:
        r, c = shape
        sr, sc = strides
        batch, sb = 1, 0
    ld = _row_major_ld(r, c, sr, sc)
    if ld is not None:
        return batch, sb, r, c, ld, False
    ld = _row_major_ld(c, r, sc, sr)
    if ld is not None:
        return batch, sb, c, r, ld, True
    return None


def _row_major_ld(r, c, sr, sc):
    """The leading dimension of an r x c matrix with strides (sr, sc) read row-major, or None."""
    if r == 0 or c == 0 or r == 1:
        return c if c > 0 else 1
    if c != 1 and sc != 1:
        return None
    return sr if sr >= c else None


def _check_no_overlap(name, a_ptr, b_ptr, c_ptr, spans, size):
    """ConfigError when out shares memory with an input (the product would read what it writes).

    Called when their spans intersect; they may still be disjoint when, with one leading
    dimension, they take disjoint column ranges of the same rows (out and an input side by side
    in one buffer): seen as positions modulo ld, the input takes [0, cols) and out must fit in
    [cols, ld)."""
    c_batch, _, _, c_cols, ldc = spans[2]
    c_span = _span_bytes(*spans[2], size)
    for operand, ptr, layout in (("a", a_ptr, spans[0]), ("b", b_ptr, spans[1])):
        batch, _, _, cols, ld = layout
        if not (ptr < c_ptr + c_span and c_ptr < ptr + _span_bytes(*layout, size)):
            continue
        if ld == ldc and batch == 1 and c_batch == 1 and (c_ptr - ptr) % size == 0:
            column = ((c_ptr - ptr) // size) % ld
            if cols <= column and column + c_cols <= ld:
                continue
        raise ConfigError(f"{name}: out shares memory with {operand}; the product would overwrite "
                          f"its own input. Write into a separate array", argument="out")


def _dtype_error(name, a, b, a_desc, b_desc, dtypes):
    """a_desc / b_desc: (shape, dtype code or None)."""
    a_name = _dtype_label(a, a_desc[1], dtypes and dtypes[0])
    b_name = _dtype_label(b, b_desc[1], dtypes and dtypes[1])
    shapes = f"a of shape {_shape(a_desc[0])} ({a_name}) and b of shape {_shape(b_desc[0])} ({b_name})"
    if a_desc[1] is None or b_desc[1] is None:
        bad = "a" if a_desc[1] is None else "b"
        raise ConfigError(f"{name}: {shapes}: {bad} has a dtype gemm does not take; valid: "
                          f"float32, float16, bfloat16", argument=bad)
    raise ConfigError(f"{name}: {shapes} have different dtypes; both must be one of float32, "
                      f"float16, bfloat16", argument="b")


def _out_dtype_error(name, out, code, c_desc, dtypes):
    c_name = _dtype_label(out, c_desc[1], dtypes and dtypes[2])
    raise ConfigError(f"{name}: out of shape {_shape(c_desc[0])} is {c_name} but a and b are "
                      f"{NAMES[code]}; out must have their dtype", argument="out")


def _dtype_label(obj, code, given):
    if given:
        return given
    if code is not None:
        return NAMES[code]
    dtype = getattr(obj, "dtype", None)
    return str(dtype).rpartition(".")[2] if dtype is not None else "unknown dtype"


def _layout_error(name, argument, shape, strides):
    raise ConfigError(f"{name}: {argument} of shape {_shape(shape)} has strides "
                      f"{tuple(strides)} (in elements); one of its last two dimensions must have "
                      f"stride 1 and the other a stride at least its length (call .contiguous() "
                      f"first)", argument=argument)


def _shape(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


_flag = _core._as_bool  # True or False (a numpy.bool_ too)


def _scalar(value, argument) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{argument}: got {value!r}; it must be a real number", argument=argument)
    return float(value)


# ---------------------------------------------------------------------------------------
# Devices, contexts and torch


def _context_for(device):
    ctx = _core.InferenceContext.instance(device)
    _contexts[device] = ctx
    return ctx


def _context_of_current_device():
    return _core.InferenceContext.instance()


def _context_device(ctx) -> int:
    device = getattr(ctx, "device", None)
    if isinstance(device, bool) or not isinstance(device, int):
        raise ConfigError(f"ctx: got {ctx!r}; it must be an inferctx.InferenceContext",
                          argument="ctx")
    return device


def _device_hint(obj, argument, name):
    """The CUDA device an array lives on, from __dlpack_device__; None when it only has the CUDA
    array interface. ConfigError for host arrays and for objects that are not arrays."""
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if dlpack_device is not None:
        kind, device = _core._dlpack_device_of(obj, dlpack_device, argument)
        if kind == _DL_CUDA or kind == _DL_CUDA_MANAGED:
            return int(device)
        if not hasattr(obj, "__cuda_array_interface__"):
            place = _DL_PLACES.get(int(kind), f"DLPack device type {int(kind)}")
            raise ConfigError(f"{name}: {argument} ({_type_name(obj)}) is in {place} memory; "
                              f"{name} needs CUDA device memory (copy it to the GPU first)",
                              argument=argument)
    if hasattr(obj, "__cuda_array_interface__"):
        return None
    raise ConfigError(f"{name}: {argument} is a {_type_name(obj)}; {name} takes CUDA arrays that "
                      f"export DLPack or __cuda_array_interface__ (torch, CuPy, JAX, Numba, "
                      f"inferctx.DeviceView)", argument=argument)


def _type_name(obj) -> str:
    cls = type(obj)
    module = cls.__module__
    return cls.__qualname__ if module in (None, "builtins") else f"{module}.{cls.__qualname__}"


# ---------------------------------------------------------------------------------------
# Autotuning helpers and the cache file

_FORMAT = "inferctx-gemm-cache"
_VERSION = 1
_PROBLEM_FIELDS = ("m", "n", "k", "batch", "lda", "ldb", "ldc", "stride_a", "stride_b", "stride_c")


def _tune_shapes(shapes):
    """(batch, m, n, k) tuples of positive ints from (m, n, k) / (batch, m, n, k) items."""
    if isinstance(shapes, (str, bytes)) or not hasattr(shapes, "__iter__"):
        raise ConfigError(f"shapes: got {shapes!r}; it must be a list of (m, n, k) or "
                          f"(batch, m, n, k) tuples", argument="shapes")
    shapes = list(shapes)
    if shapes and all(isinstance(s, numbers.Integral) for s in shapes):
        shapes = [tuple(shapes)]  # one shape given bare
    out = []
    for item in shapes:
        try:
            dims = tuple(item)
        except TypeError:
            dims = None
        if (dims is None or len(dims) not in (3, 4)
                or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1
                       for d in dims)):
            raise ConfigError(f"shapes: got {item!r}; each shape is (m, n, k) or (batch, m, n, k) "
                              f"with integers >= 1", argument="shapes")
        dims = tuple(int(d) for d in dims)
        out.append(dims if len(dims) == 4 else (1,) + dims)
    return out


def _packed(code, m, n, k, batch, trans_a, trans_b, tf32):
    """The GemmProblem of densely packed operands, as the cache keys it (normalized)."""
    one = batch == 1
    return {"dtype": code, "trans_a": trans_a, "trans_b": trans_b, "m": m, "n": n, "k": k,
            "batch": batch, "lda": max(1, m if trans_a else k), "ldb": max(1, k if trans_b else n),
            "ldc": max(1, n), "stride_a": 0 if one else m * k, "stride_b": 0 if one else k * n,
            "stride_c": 0 if one else m * n, "tf32": bool(tf32 and code == 0)}


def _problem_key(p):
    return (p["dtype"], bool(p["trans_a"]), bool(p["trans_b"]), bool(p["tf32"])) + tuple(
        int(p[f]) for f in _PROBLEM_FIELDS)


def _tuned_problems(device):
    """Problems of the in-process cache tuned (or loaded) for `device` on 256-aligned operands."""
    known = {}
    for e in _core._gemm_cache_export(True):
        if e["device"] != device or (e["align_a"], e["align_b"], e["align_c"]) != (256, 256, 256):
            continue
        known[_problem_key(e["problem"])] = e
    return known


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _entry_to_json(e) -> dict:
    """A cache entry from _core._gemm_cache_export as it is written to the file."""
    p = e["problem"]
    return {
        "device": int(e["device"]),
        "device_name": _text(e["device_name"]),
        "cublas_version": int(e["cublas_version"]),
        "dtype": NAMES[int(p["dtype"])],
        "trans_a": bool(p["trans_a"]),
        "trans_b": bool(p["trans_b"]),
        "tf32": bool(p["tf32"]),
        **{f: int(p[f]) for f in _PROBLEM_FIELDS},
        "align": [int(e["align_a"]), int(e["align_b"]), int(e["align_c"])],
        "backend": _BACKENDS.get(int(e["backend"]), str(e["backend"])),
        # Hex strings: 64-bit words do not survive JSON readers that use doubles.
        "algo": [f"0x{int(w) & 0xFFFFFFFFFFFFFFFF:016x}" for w in e["algo"]],
        "time_ms": float(e["time_ms"]),
    }


def _entry_from_json(j, path, index) -> dict:
    """A file entry in the form _core._gemm_cache_import takes; ConfigError('path') if malformed."""
    where = f"{path}: entry {index}"

    def fail(what):
        raise ConfigError(f"path: {where}: {what}", argument="path")

    if not isinstance(j, dict):
        fail(f"got {type(j).__name__}; each entry is a JSON object")

    def integer(field):
        v = j.get(field)
        if isinstance(v, bool) or not isinstance(v, int):
            fail(f"{field} is {v!r}; it must be an integer")
        return v

    def boolean(field):
        v = j.get(field, False)
        if not isinstance(v, bool):
            fail(f"{field} is {v!r}; it must be true or false")
        return v

    dtype = j.get("dtype")
    if dtype not in _CODES:
        fail(f"dtype is {dtype!r}; valid: 'float32', 'float16', 'bfloat16'")
    backend = j.get("backend")
    if backend not in _BACKEND_CODES:
        fail(f"backend is {backend!r}; valid: 'cublasLt', 'cublas'")
    align = j.get("align")
    if (not isinstance(align, list) or len(align) != 3
            or any(isinstance(x, bool) or not isinstance(x, int) for x in align)):
        fail(f"align is {align!r}; it must be a list of three integers")
    algo = j.get("algo")
    if not isinstance(algo, list):
        fail(f"algo is {algo!r}; it must be a list of hex strings")
    words = []
    for w in algo:
        try:
            words.append(int(w, 16) if isinstance(w, str) else None)
        except ValueError:
            words.append(None)
        if words[-1] is None or not 0 <= words[-1] < (1 << 64):
            fail(f"algo word {w!r} is not a 64-bit hex string")
    name = j.get("device_name")
    if not isinstance(name, str):
        fail(f"device_name is {name!r}; it must be a string")
    time_ms = j.get("time_ms", -1.0)
    if isinstance(time_ms, bool) or not isinstance(time_ms, (int, float)):
        fail(f"time_ms is {time_ms!r}; it must be a number")
    problem = {"dtype": _CODES[dtype], "trans_a": boolean("trans_a"),
               "trans_b": boolean("trans_b"), "tf32": boolean("tf32")}
    problem.update({f: integer(f) for f in _PROBLEM_FIELDS})
    return {"device": integer("device"), "device_name": name,
            "cublas_version": integer("cublas_version"), "problem": problem,
            "align_a": align[0], "align_b": align[1], "align_c": align[2],
            "backend": _BACKEND_CODES[backend], "algo": words, "time_ms": float(time_ms)}


def _identity(e) -> tuple:
    """What makes two file entries the same problem on the same machine."""
    return (e.get("device_name"), e.get("cublas_version"), e.get("device"), e.get("dtype"),
            e.get("trans_a"), e.get("trans_b"), e.get("tf32"),
            tuple(e.get(f) for f in _PROBLEM_FIELDS), tuple(e.get("align") or ()))


def _read_cache_file(path) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"path: {path} is not JSON ({exc}); it should be a file written by "
                          f"save_gemm_cache", argument="path") from None
    if (not isinstance(document, dict) or document.get("format") != _FORMAT
            or not isinstance(document.get("entries"), list)):
        raise ConfigError(f"path: {path} is not an inferctx GEMM cache (no \"format\": "
                          f"\"{_FORMAT}\" with an \"entries\" list); it should be a file written "
                          f"by save_gemm_cache", argument="path")
    if document.get("version") != _VERSION:
        raise ConfigError(f"path: {path} has cache format version {document.get('version')!r}; "
                          f"this inferctx reads version {_VERSION}", argument="path")
    return document["entries"]


class _Progress:
    """A one-line progress bar on stderr (one line per item where stderr is not a terminal)."""

    WIDTH = 24

    def __init__(self, total, enabled, stream=None):
        self.total = total
        self.count = 0
        self.enabled = enabled and total > 0
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.began = time.perf_counter()
        self.width = 0

    def _bar(self) -> str:
        filled = self.count * self.WIDTH // self.total
        return f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.count}/{self.total}"

    def _draw(self, text):
        if self.tty:
            pad = max(0, self.width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def start(self, label):
        if self.enabled and self.tty:
            self._draw(f"autotune_gemm {self._bar()} tuning {label} ...")

    def done(self, label, record):
        self.count += 1
        if not self.enabled:
            return
        if record.get("skipped"):
            what = "cached"
        elif record.get("speedup"):
            what = f"{record['tuned_ms'] * 1e3:.1f} us ({record['speedup']:.2f}x)"
        else:
            what = f"{record['tuned_ms'] * 1e3:.1f} us"
        elapsed = time.perf_counter() - self.began
        self._draw(f"autotune_gemm {self._bar()} {label}: {what}, {elapsed:.1f} s")

    def close(self):
        if self.enabled and self.tty and self.width:
            self.stream.write("\n")
            self.stream.flush()

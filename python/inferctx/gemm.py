"""GEMM with NumPy / PyTorch row-major semantics on a context's cuBLAS handle and stream.

``gemm(a, b)`` computes ``alpha * op(a) @ op(b) + beta * out`` and ``bmm`` its strided batch,
with fp32 accumulation, through ``cublasGemmEx`` untuned (torch's call, with torch's bits);
``autotune_gemm`` times cuBLASLt's candidate algorithms (and, for 1 to 8 rows, inferctx's own
few-row kernel) against it for given shapes and caches the fastest correct one per problem, and
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

``_core.gemm`` / ``_core.bmm``
    The public functions (this module's ``gemm`` and ``bmm``): the torch fast path in compiled
    code, every other call handed to ``_product`` here (``_core._set_gemm_general``).
``_core._begin(operands, ctx, stream, first, handle) -> call``
    The call contract for ``operands`` (a, b, out): ``call.ctx``, ``call.kernel`` (the stream
    handle the product runs on), ``call.import_array(obj, argument) -> CudaArray`` and
    ``call.done()`` (the caller's streams wait for it); ``call.given_up()`` in its place when
    the call fails after ``_begin`` (a stream made to join a CUDA-graph capture is joined back).
``_core._gemm(call, ndim, va, vb, vc, out, trans_a, trans_b, alpha, beta, tf32) -> out``
    The product of imported operands (``vc`` None for a new result) on ``call.kernel``:
    ``inferctx::gemm_layout`` works out the problem from their shapes and strides (ConfigError
    naming a, b or out; cuda/src/gemm_layout.cpp), then ``inferctx::gemm`` checks the addresses
    (out sharing an input's memory, misalignment) and queues it. Returns ``out`` or the new result
    in the call's package.
``_core._gemm_packed_problem(dtype, m, n, k, batch, trans_a, trans_b, tf32) -> dict``
    The GemmProblem (as a dict) of densely packed operands, as the algorithm cache keys it.
``_core._gemm_tune(ctx, dtype, trans_a, trans_b, m, n, k, batch, tf32, max_algorithms, warmup,
repeats) -> dict``
    ``inferctx::tune_gemm`` of that packed problem on the context's handle, on ``ctx.stream``;
    the dict has the fields of GemmTuneResult (backend, algo_index, algo, algo_id, tile_id,
    stages_id, splitk, default_ms, best_ms, candidates, valid, rotated_sets).
``_core._gemm_cache_export(tuned_only) -> list[dict]`` and
``_core._gemm_cache_import(entries) -> int``
    GemmCacheEntry as a dict: device, device_name (str), cublas_version, problem (a dict of
    the GemmProblem fields: dtype, trans_a, trans_b, m, n, k, batch, lda, ldb, ldc,
    stride_a, stride_b, stride_c, tf32), align_a, align_b, align_c, backend (0 cublasLt, 1 cublas,
    2 gemv), algo (list of ints: 8 for backend 0, none otherwise), time_ms. Import returns how many entries it took.
``_core._gemm_cache_clear() -> None``
``_core._gemm_cache_keys(entries) -> list``
    The algorithm cache's key of each entry (as _gemm_cache_import takes them), for merges.
``_core._gemm_packed_alignments(batch, stride_a, stride_b, stride_c, itemsize) -> tuple``
    The alignments the cache records for a packed problem's operands.
``_core._check_ctx_stream(ctx, stream) -> int``
    ConfigError for a ctx or stream= of the wrong type, before any device is read; the stream's
    handle (0 for None), which ``_begin`` takes as ``handle``.
``_core._dlpack_device_of(obj, dlpack_device, argument) -> (device_type, device_id)``,
``_core._as_bool(value, argument)`` and ``_core.InferenceContext.instance(device)``
    An operand's ``__dlpack_device__()`` checked, a flag argument, a device's context.
"""

from __future__ import annotations

import contextlib
import json
import logging
import numbers
import os
import secrets
import stat
import threading
from typing import Any, Dict, Iterator, List

from . import _core
from ._gemm_cache import (_BACKENDS, _FORMAT, _VERSION, _cache_path, _entry_from_json, _entry_to_json,
                          _not_regular, _read_cache_file, _refuse_kind)
from ._gemm_tune import _Progress, _problem_key, _tune_shapes
from .dtypes import BFLOAT16, FLOAT16, FLOAT32, ITEMSIZE, NAMES, dtype_code
from .errors import ConfigError, _brief

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

_SHORT = {FLOAT32: "fp32", FLOAT16: "fp16", BFLOAT16: "bf16"}
# DLPack device types (dlpack.h)
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13
_DL_PLACES = {1: "host", 3: "pinned host", 2: "CUDA device", 13: "CUDA managed"}
# torch is never imported here; once the caller has imported it, its tensors of a problem seen
# before take the compiled path of _core.gemm / _core.bmm.


# ---------------------------------------------------------------------------------------
# Public API


# gemm and bmm are compiled (inferctx._core): their all-torch fast path costs no Python frame,
# and they hand every other call to _product below.
gemm = _core.gemm
bmm = _core.bmm


def autotune_gemm(shapes: Any, dtype: Any, *, trans_a: bool = False, trans_b: bool = False,
                  tf32: bool = False, ctx: Any = None, cache_file: Any = None,
                  progress: bool = True, force: bool = False, max_algorithms: int = 32,
                  warmup: int = 3, repeats: int = 7) -> List[Dict[str, Any]]:
    """Times cuBLASLt's candidate algorithms for each shape and keeps the fastest correct one.

    cublasGemmEx, what an untuned ``gemm`` runs (torch.matmul's call and bits), is candidate 0;
    another candidate replaces it only when at least 1% faster, since smaller differences
    between medians are noise. Besides cuBLASLt's algorithms, problems of 1 to 8 rows (decoding:
    ``m <= 8``, no batch, ``b`` not transposed, ``n`` a multiple of 8 for 16-bit types or 4 for
    float32) also try inferctx's own kernel, which reads ``b`` once with 16-byte loads and adds
    its fp32 partial sums in a fixed order (the same bits on every run). It wins mainly in
    float32; in 16-bit types cuBLAS is usually faster and stays (docs/benchmarks.md).

    Parameters
    ----------
    shapes
        Problems as ``(m, n, k)`` or ``(batch, m, n, k)`` tuples: ``op(a)`` is m x k, ``op(b)``
        k x n. Each is tuned for densely packed operands (what a contiguous tensor, or its
        transpose with the matching ``trans_*``, has); later ``gemm`` / ``bmm`` calls with that
        problem on 256-byte aligned memory, on the device tuned on, use the result (the cache
        keys its entries by device: entries tuned on cuda:0 do nothing for calls on cuda:1).
        A shape one call cannot take (a batch past 2**31 - 1, a matrix past 2**63 bytes)
        raises ConfigError naming ``shapes`` before the device is looked up or anything is
        tuned.
    dtype
        'float32', 'float16', 'bfloat16' (or a NumPy / torch dtype).
    trans_a, trans_b, tf32
        As in ``gemm``.
    ctx
        The context to tune on (the current device's by default).
    cache_file
        A JSON file: loaded first when it exists (problems already in it are not tuned again
        unless ``force``), and written (merged) afterwards unless it already holds every tuning
        of the process (then it is left as it is, so a read-only one serves). It is read and
        checked before the device is looked up; a bad one, or a new one whose folder does not
        exist, raises ConfigError naming ``cache_file``.
    progress
        Draw a progress bar on stderr.
    force
        Tune problems the cache already has.
    max_algorithms, warmup, repeats
        Candidates asked of cuBLASLt's heuristic (1..256), untimed runs and timed batches per
        candidate.

    Returns
    -------
    One dict per shape: shape, dtype, trans_a, trans_b, tf32, default_ms (cublasGemmEx: what
    an untuned gemm runs, the call torch.matmul makes), tuned_ms, speedup (default_ms /
    tuned_ms), backend ('cublasLt', 'gemv' for inferctx's kernel, or 'cublas' when cublasGemmEx
    stays: no candidate was at least 1% faster),
    algo_index (0: cublasGemmEx; i >= 1: cuBLASLt's i-th candidate, or the last index for 'gemv'),
    candidates, valid (those
    whose result matched cublasGemmEx's within the dtype's tolerance), skipped (True when the
    cache already had it).
    """
    code = dtype_code(dtype)
    flags = {name: _flag(value, name) for name, value in
             (("trans_a", trans_a), ("trans_b", trans_b), ("tf32", tf32), ("progress", progress),
              ("force", force))}
    problems = _tune_shapes(shapes)
    # max_algorithms: what cuBLASLt's heuristic is asked for (the compiled tuner's 1..256);
    # warmup and repeats: C ints in the compiled tuner.
    for name, value, low, high, valid in (
            ("max_algorithms", max_algorithms, 1, 256, "[1, 256]"),
            ("warmup", warmup, 0, (1 << 31) - 1, "[0, 2**31)"),
            ("repeats", repeats, 1, (1 << 31) - 1, "[1, 2**31)")):
        if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low
                or value > high):
            raise ConfigError(f"{name}: got {_brief(value)}; it must be an integer in {valid}",
                              argument=name)
    # The cache file is read and its entries checked before the device is looked up, so that a
    # bad one is named as such on any machine; they go into the cache once there is a context.
    file_entries = None
    if cache_file is not None:
        with _as_cache_file_error():
            cache_file = _cache_path(cache_file)
            if os.path.exists(cache_file):
                file_entries = _file_entries(cache_file)
                _cache_keys(cache_file, file_entries)
            else:
                _check_new_file_folder(cache_file)
    # Each shape's problem, packed before the device is looked up: a shape too large for one
    # GEMM (a batch past 2**31 - 1, a matrix past 2**63 bytes) is named as such on any machine,
    # and before any shape is tuned.
    packed = []
    for batch, m, n, k in problems:
        try:
            packed.append(_core._gemm_packed_problem(code, m, n, k, batch, flags["trans_a"],
                                                     flags["trans_b"], flags["tf32"]))
        except ConfigError as exc:
            shape = (m, n, k) if batch == 1 else (batch, m, n, k)
            raise ConfigError(f"shapes: {shape} cannot be one GEMM call ({exc}); tune shapes a "
                              f"gemm or bmm call can take", argument="shapes") from None
    if ctx is None:
        ctx = _context_of_current_device()
    device = _context_device(ctx)
    if file_entries is not None:
        with _as_cache_file_error():
            _import_entries(cache_file, file_entries)
    known = {} if flags["force"] else _tuned_problems(device)

    results = []
    bar = _Progress(len(problems), flags["progress"])
    tuned_any = False
    try:
        for (batch, m, n, k), p in zip(problems, packed):
            label = (f"{_SHORT[code]} {m}x{n}x{k}" + (f" x{batch}" if batch > 1 else "")
                     + ("" if not (flags["trans_a"] or flags["trans_b"]) else
                        f" {'T' if flags['trans_a'] else 'N'}{'T' if flags['trans_b'] else 'N'}"))
            bar.start(label)
            record = {"shape": (batch, m, n, k), "dtype": NAMES[code],
                      "trans_a": flags["trans_a"], "trans_b": flags["trans_b"],
                      "tf32": bool(p["tf32"])}  # the packed problem keeps TF32 for float32 only
            key = (_problem_key(p), _packed_alignments(p, ITEMSIZE[code]))
            if key in known:
                entry = known[key]
                record.update(default_ms=None, tuned_ms=entry["time_ms"], speedup=None,
                              backend=_BACKENDS.get(entry["backend"], "cublasLt"), algo_index=None,
                              candidates=0, valid=0, skipped=True)
            else:
                r = _core._gemm_tune(ctx, code, flags["trans_a"], flags["trans_b"], m, n, k, batch,
                                     flags["tf32"], int(max_algorithms), int(warmup), int(repeats))
                tuned_any = True
                default_ms = r["default_ms"] if r["default_ms"] > 0 else None
                record.update(default_ms=default_ms, tuned_ms=r["best_ms"],
                              speedup=(default_ms / r["best_ms"]) if default_ms else None,
                              backend=_BACKENDS.get(r["backend"], str(r["backend"])),
                              algo_index=r["algo_index"], candidates=r["candidates"],
                              valid=r["valid"], skipped=False)
            results.append(record)
            bar.done(label, record)
    except BaseException:
        bar.close()
        # What was tuned before the failure is not lost: it goes to the file, then the error on.
        if cache_file is not None and tuned_any:
            try:
                with _as_cache_file_error():
                    save_gemm_cache(cache_file)
            except Exception as save_error:
                _log.warning("autotune_gemm: the tunings made before the error could not be "
                             "saved to %s: %s", cache_file, save_error)
        raise
    bar.close()
    # A file that already holds every tuning the save would write is left as it is: nothing to
    # add, and it may be on storage this process cannot write (a cache shipped read-only).
    if cache_file is not None and (tuned_any or not _file_holds_all(cache_file)):
        with _as_cache_file_error():
            save_gemm_cache(cache_file)
    return results


def _check_new_file_folder(path: str) -> None:
    """ConfigError('path') when the folder a new cache file would be made in is none (missing, or
    a file): found before tuning, not when the tunings are to be written."""
    folder = os.path.dirname(os.path.realpath(path))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise ConfigError(f"path: {path} cannot be made: its folder {folder} {what}; create the "
                          f"folder first, or give a file name in an existing folder", argument="path")


def _file_holds_all(path: str) -> bool:
    """Whether the file at path holds every tuning of the process as save_gemm_cache would write
    it. Read again (another process may have replaced it meanwhile); False for a file that is
    missing or cannot be read, whose save then makes it or says what is wrong."""
    try:
        file_entries = _file_entries(path)
    except (ConfigError, OSError):
        return False
    key = lambda entry: json.dumps(entry, sort_keys=True)  # noqa: E731
    held = {key(_entry_to_json(e)) for e in file_entries}
    return all(key(e) in held for e in gemm_cache_entries())


@contextlib.contextmanager
def _as_cache_file_error() -> Iterator[None]:
    """autotune_gemm's own keyword in the errors of the cache file it was given: ``cache_file``."""
    try:
        yield
    except ConfigError as exc:
        if exc.argument != "path":
            raise
        # The file was loaded (and its entries checked) before the save: a merge error names
        # save_gemm_cache's own keyword only for a file changed meanwhile.
        raise ConfigError(f"cache_file: {str(exc).removeprefix('path: ')}", argument="cache_file") from None


def save_gemm_cache(path: Any, *, merge: bool = True) -> int:
    """Writes the autotuned GEMM algorithms to a JSON file; returns how many entries it holds.

    With ``merge`` the file's entries for other problems, GPUs or cuBLAS versions are kept, so
    one file can serve several machines; the read, the merge and the replacement hold an
    exclusive lock (``flock``) on the file's folder, so that processes saving into one file take
    turns and none loses another's entries (where the file system has no such locks, the merge
    goes on unlocked). The file is replaced atomically. Only a regular file is: a path naming a
    FIFO, a device or a folder (or a link to one), or one in a folder that does not exist, raises
    ConfigError, and nothing is written.
    """
    path = _cache_path(path)
    merge = _flag(merge, "merge")
    _check_new_file_folder(path)  # as autotune_gemm's cache_file (it was a bare FileNotFoundError)
    exported = _core._gemm_cache_export(True)
    entries = [_entry_to_json(e) for e in exported]
    # A link (to a file on shared storage, say) stays a link: the file it names is replaced.
    target = os.path.realpath(path)
    with _folder_lock(target) if merge else contextlib.nullcontext():
        return _save_entries(path, target, exported, entries, merge)


# The folder descriptors that saves in progress hold (or wait to lock), and what keeps a fork from
# coming between the open of one and its entry here. A flock belongs to the open file description,
# which a forked child shares: left open there, it would keep the folder locked after the parent's
# save, until the child exits (every later save waiting for it, the child's own included). The
# child closes its copies at once; the parent's lock is unaffected.
_lock_fds: set[int] = set()
_lock_fds_guard = threading.Lock()


def _before_fork() -> None:
    _lock_fds_guard.acquire()


def _after_fork_in_parent() -> None:
    _lock_fds_guard.release()


def _after_fork_in_child() -> None:
    for fd in _lock_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _lock_fds.clear()
    _lock_fds_guard.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def _folder_lock(path: str) -> Iterator[None]:
    """An exclusive flock on path's folder, released on leaving (a lock on the file itself would
    be lost with the file it replaces). None where the platform or the file system lacks it."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield
        return
    folder = os.path.dirname(path) or "."
    with _lock_fds_guard:
        try:
            fd = os.open(folder, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # no such folder: the save's own open says so
            fd = -1
        else:
            _lock_fds.add(fd)
    if fd < 0:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # NFS without lock support, say
            _log.info("save_gemm_cache: could not lock %s (%s); merging without a lock", folder, exc)
        yield
    finally:
        with _lock_fds_guard:
            if fd in _lock_fds:  # else closed already: this is a child forked during the save
                _lock_fds.discard(fd)
                os.close(fd)  # and with it the lock


def _save_entries(path: str, target: str, exported: list, entries: list, merge: bool) -> int:
    # Only a regular file is replaced: a FIFO or a device node (/dev/null, say, or a link to
    # one) is left as it is, and nothing is written beside it.
    try:
        kind = _not_regular(os.stat(target).st_mode)
    except OSError:  # none yet (a new file), or a folder the write below names
        kind = ""
    if kind:
        _refuse_kind(path, kind, "save_gemm_cache writes and replaces regular files only: give a file name")
    if merge and os.path.exists(path):
        hint = "; merge=True keeps the file's entries: mend or remove the file, or pass merge=False to replace it"
        try:  # an empty, truncated, newer or foreign file: nothing the merge could keep
            kept = _read_cache_file(path)
        except ConfigError as exc:
            raise ConfigError(f"{exc}{hint}", argument="path") from None
        try:  # written back as they are: each must be an entry load takes, by the same checks
            converted = [_entry_from_json(e, path, i) for i, e in enumerate(kept)]
        except ConfigError as exc:
            raise ConfigError(f"{exc}{hint}", argument="path") from None
        keys = _cache_keys(path, converted, hint)
        # One entry per cache key, this process's: a file entry that the cache would key as one
        # of them (booleans left out, tf32 on a 16-bit type) would replace it when loaded.
        mine = set(_core._gemm_cache_keys(exported))
        entries += [e for e, key in zip(kept, keys) if key not in mine]
    document = {"format": _FORMAT, "version": _VERSION, "entries": entries}
    try:
        fd, tmp = _new_file_beside(target)
    except OSError as exc:  # named by the user's path, not by the temporary file's
        raise type(exc)(exc.errno, exc.strerror, path) from None
    try:
        try:  # the replaced file's permissions, so that a file others read stays readable
            os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
        except FileNotFoundError:
            pass  # a new file: 0o666 less the umask, as the open made it
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(entries)


def _new_file_beside(path: str) -> tuple[int, str]:
    """A new file, open for writing, in path's folder under a name no other file has: made with
    mode 0o666 less the umask, as open() makes a file (tempfile's are 0o600)."""
    directory = os.path.dirname(path)
    while True:
        tmp = os.path.join(directory, f".gemm-cache-{secrets.token_hex(8)}.json")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue


def load_gemm_cache(path: Any) -> int:
    """Loads autotuned GEMM algorithms from a JSON file; returns how many apply here.

    Entries made on another GPU model, with another cuBLAS version or for a device this
    machine lacks are skipped (a file may hold several machines' entries). A malformed file,
    or a path naming anything but a regular file (a FIFO, a device, a folder), raises
    ConfigError naming ``path``.
    """
    path = _cache_path(path)
    return _import_entries(path, _file_entries(path))


def _file_entries(path: str) -> List[Dict[str, Any]]:
    """path's entries, read and checked, in the form _core._gemm_cache_import takes (no device
    needed); ConfigError('path') for a malformed file."""
    return [_entry_from_json(e, path, i) for i, e in enumerate(_read_cache_file(path))]


def _cache_keys(path: str, converted: List[Dict[str, Any]], hint: str = "") -> list:
    """The cache keys of a file's entries, after the compiled checks that _import_entries makes
    (nothing is imported); ConfigError('path') naming the first invalid entry."""
    try:
        return _core._gemm_cache_keys(converted)
    except ConfigError as exc:
        raise ConfigError(f"path: {path} has an invalid {exc}{hint}", argument="path") from None  # "entry i: ..."


def _import_entries(path: str, converted: List[Dict[str, Any]]) -> int:
    try:
        taken = _core._gemm_cache_import(converted)
    except ConfigError as exc:
        raise ConfigError(f"path: {path} has an invalid {exc}", argument="path") from exc  # "entry i: ..."
    if taken < len(converted):
        _log.info("load_gemm_cache: %d of %d entries in %s apply to this machine (the others were "
                  "tuned on another GPU, cuBLAS version or device)", taken, len(converted), path)
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
    alpha = _scalar(alpha, "alpha")
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
    if ctx is not None and device is not None and device != _context_device(ctx):
        _ctx_device_error(name, device, _context_device(ctx))
    handle = _core._check_ctx_stream(ctx, stream)  # named before a device is asked for its context
    if ctx is None and device is None and b_device is not None:
        ctx = _core.InferenceContext.instance(b_device)  # the device's one context
    call = _core._begin((a, b, out), ctx, stream, "a", handle)
    try:
        va = call.import_array(a, "a")
        vb = call.import_array(b, "b")
        vc = None if out is None else call.import_array(out, "out")
        if vc is not None and vc.read_only:
            raise ConfigError(f"{name}: out ({_type_name(out)}) is read-only; pass a writable array",
                              argument="out")
        # va / vb / vc keep the memory alive until the product is queued.
        result = _core._gemm(call, ndim, va, vb, vc, out, trans_a, trans_b, alpha, beta, tf32)
    except BaseException:
        call.given_up()  # a stream made to join a CUDA-graph capture is joined back
        raise
    call.done()
    return result


_core._set_gemm_general(_product)  # where _core.gemm / _core.bmm send what is not their fast path


def _ctx_device_error(name, device, ctx_device):
    raise ConfigError(f"{name}: the operands are on cuda:{device} but ctx is the context of "
                      f"cuda:{ctx_device}; pass ctx=InferenceContext.instance({device}) or leave "
                      f"ctx=None", argument="ctx")


_flag = _core._as_bool  # True or False (a numpy.bool_ too)


_FLOAT32_MAX = 3.4028234663852886e38


def _scalar(value, argument) -> float:
    """alpha or beta: a real number the product can scale by in float32 (finite there)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{argument}: got {_brief(value)}; it must be a real number", argument=argument)
    try:
        x = float(value)
    except OverflowError:
        x = float("inf")
    if not abs(x) <= _FLOAT32_MAX:  # NaN too
        raise ConfigError(f"{argument}: got {_brief(value)}; it must be finite in float32 (at most "
                          f"{_FLOAT32_MAX!r} in magnitude): the product scales by it in float32",
                          argument=argument)
    return x


# ---------------------------------------------------------------------------------------
# Devices, contexts and torch


def _context_of_current_device():
    return _core.InferenceContext.instance()


def _context_device(ctx) -> int:
    device = getattr(ctx, "device", None)
    # A context's device is a CUDA ordinal: another value is no context's (and 10**5000 could not
    # even be shown in the device-mismatch message).
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < (1 << 31):
        raise ConfigError(f"ctx: got {_brief(ctx)}; it must be an inferctx.InferenceContext",
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
    raise ConfigError(f"{name}: {argument} is of type {_type_name(obj)}; {name} takes CUDA arrays that "
                      f"export DLPack or __cuda_array_interface__ (torch, CuPy, JAX, Numba, "
                      f"inferctx.DeviceView)", argument=argument)


def _type_name(obj) -> str:
    cls = type(obj)
    module = cls.__module__
    return cls.__qualname__ if module in (None, "builtins") else f"{module}.{cls.__qualname__}"


def _tuned_problems(device):
    """Problems of the in-process cache tuned (or loaded) for `device`, by (problem key,
    alignments of a, b and c)."""
    known = {}
    for e in _core._gemm_cache_export(True):
        if e["device"] == device:
            known[(_problem_key(e["problem"]), (e["align_a"], e["align_b"], e["align_c"]))] = e
    return known


def _packed_alignments(problem, itemsize):
    """The alignments (bytes) the tuner records for a packed problem (a `_gemm_packed_problem`
    dict), as the algorithm cache keys them."""
    return _core._gemm_packed_alignments(problem["batch"], problem["stride_a"], problem["stride_b"],
                                         problem["stride_c"], itemsize)

"""The GEMM cache file: its format, cache entries as written to it and read back, and reading
it. Internal to inferctx.gemm."""

from __future__ import annotations

import json

from .dtypes import NAMES
from .errors import ConfigError

_CODES = {name: code for code, name in NAMES.items()}  # dtype name -> inferctx::DType code
_BACKENDS = {0: "cublasLt", 1: "cublas", 2: "gemv"}
_BACKEND_CODES = {v: k for k, v in _BACKENDS.items()}

_FORMAT = "inferctx-gemm-cache"
_VERSION = 1
_PROBLEM_FIELDS = ("m", "n", "k", "batch", "lda", "ldb", "ldc", "stride_a", "stride_b", "stride_c")


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

    def integer(field, bits=64):
        v = j.get(field)
        if isinstance(v, bool) or not isinstance(v, int):
            fail(f"{field} is {v!r}; it must be an integer")
        if not -(1 << (bits - 1)) <= v < (1 << (bits - 1)):  # what the C++ entry holds
            fail(f"{field} is {v}; it must be within int{bits}")
        return v

    def boolean(field):
        v = j.get(field, False)
        if not isinstance(v, bool):
            fail(f"{field} is {v!r}; it must be true or false")
        return v

    dtype = j.get("dtype")
    if not isinstance(dtype, str) or dtype not in _CODES:  # a list or dict is no dtype (nor hashable)
        fail(f"dtype is {dtype!r}; valid: 'float32', 'float16', 'bfloat16'")
    backend = j.get("backend")
    if not isinstance(backend, str) or backend not in _BACKEND_CODES:
        fail(f"backend is {backend!r}; valid: 'cublasLt', 'cublas', 'gemv'")
    align = j.get("align")
    if (not isinstance(align, list) or len(align) != 3
            or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < (1 << 31) for x in align)):
        fail(f"align is {align!r}; it must be a list of three integers in [0, 2**31)")
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
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape ("\ud800") is no text
        fail(f"device_name is {name!r}; it must be text (UTF-8)")
    time_ms = j.get("time_ms", -1.0)
    if isinstance(time_ms, bool) or not isinstance(time_ms, (int, float)):
        fail(f"time_ms is {time_ms!r}; it must be a number")
    try:
        time_ms = float(time_ms)
    except OverflowError:  # an integer past a double's range
        fail(f"time_ms is {time_ms}; it must be a number within a double's range")
    problem = {"dtype": _CODES[dtype], "trans_a": boolean("trans_a"),
               "trans_b": boolean("trans_b"), "tf32": boolean("tf32")}
    problem.update({f: integer(f) for f in _PROBLEM_FIELDS})
    return {"device": integer("device", 32), "device_name": name,
            "cublas_version": integer("cublas_version"), "problem": problem,
            "align_a": align[0], "align_b": align[1], "align_c": align[2],
            "backend": _BACKEND_CODES[backend], "algo": words, "time_ms": float(time_ms)}


def _read_cache_file(path) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"path: {path} is not JSON ({exc}); it should be a file written by "
                          f"save_gemm_cache", argument="path") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # Not UTF-8 text, an integer past Python's digit limit, arrays nested past its stack.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"path: {path} is not a JSON file inferctx can read ({type(exc).__name__}: "
                          f"{reason[:200]}); it should be a file written by save_gemm_cache",
                          argument="path") from None
    if (not isinstance(document, dict) or document.get("format") != _FORMAT
            or not isinstance(document.get("entries"), list)):
        raise ConfigError(f"path: {path} is not an inferctx GEMM cache (no \"format\": "
                          f"\"{_FORMAT}\" with an \"entries\" list); it should be a file written "
                          f"by save_gemm_cache", argument="path")
    if document.get("version") != _VERSION:
        raise ConfigError(f"path: {path} has cache format version {document.get('version')!r}; "
                          f"this inferctx reads version {_VERSION}", argument="path")
    return document["entries"]

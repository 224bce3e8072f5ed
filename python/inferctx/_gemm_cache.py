"""The GEMM cache file: its format, cache entries as written to it and read back, and reading
it. Internal to inferctx.gemm."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any, NoReturn

from .dtypes import NAMES
from .errors import ConfigError, _brief

_CODES = {name: code for code, name in NAMES.items()}  # dtype name -> inferctx::DType code
_BACKENDS = {0: "cublasLt", 1: "cublas", 2: "gemv"}
_BACKEND_CODES = {v: k for k, v in _BACKENDS.items()}

_FORMAT = "inferctx-gemm-cache"
_VERSION = 1
_PROBLEM_FIELDS = ("m", "n", "k", "batch", "lda", "ldb", "ldc", "stride_a", "stride_b", "stride_c")
# The most a cache file may hold. An entry is about 700 bytes as save_gemm_cache writes it, so
# this is some 90,000 entries, each a problem tuned on a GPU for a second or more: no real file
# comes near it, and reading stops here rather than taking all memory for a mistaken path.
_MAX_FILE_BYTES = 64 << 20
# An algorithm word as the file holds it: hex digits (ASCII only), with or without 0x. int(w, 16)
# alone would also take spaces around it, underscores between digits and non-ASCII digits.
_HEX_WORD = re.compile(r"(?:0[xX])?([0-9a-fA-F]+)")
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _cache_path(path: Any) -> str:
    """path as a file name (os.fspath, bytes decoded); ConfigError('path') for a value that is
    none: another type (an int is no file descriptor here), an empty name, a NUL character or a
    lone surrogate, a folder's name ('x/', 'x/.'), a name that opens nothing yet resolves to a file."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise ConfigError(f"path: got {_brief(path)} ({type(path).__name__}); give a file name "
                          f"(a str or os.PathLike)", argument="path")
    try:
        name = os.fsdecode(os.fspath(path))
    except TypeError as exc:  # a __fspath__ that returns neither str nor bytes
        raise ConfigError(f"path: got {_brief(path)}, which is no file name ({exc})", argument="path") from None
    if name == "":
        raise ConfigError("path: got ''; give a file name", argument="path")
    if "\x00" in name:
        raise ConfigError(f"path: got {_brief(name)}, which holds a NUL character; no file name can",
                          argument="path")
    try:
        os.fsencode(name)
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") in a str
        raise ConfigError(f"path: got {_brief(name)}, which holds {exc.object[exc.start]!r}: no file name "
                          f"can ({exc.reason}); give a file name", argument="path") from None
    # A save replaces the file the name resolves to (os.path.realpath), having merged what the name
    # itself opens: "gemm.json/" (a folder's name) or "missing/../gemm.json" opens nothing, and
    # gemm.json would be replaced without its entries (and "x/" made a file x).
    if os.path.basename(name) in ("", ".", ".."):
        raise ConfigError(f"path: got {_brief(name)}, which names a folder, not a file; give a file "
                          f"name (as 'gemm.json' or 'folder/gemm.json')", argument="path")
    if not os.path.exists(name):
        resolved = os.path.realpath(name)
        # The file may come into being meanwhile (a save in another thread or process making it):
        # a name that opens it at a second look names it.
        if os.path.exists(resolved) and not os.path.exists(name):
            raise ConfigError(f"path: got {_brief(name)}, which names no file the system can open, yet resolves to "
                              f"the existing {resolved}; give that file's own name", argument="path")
    return name


def _not_regular(mode: int) -> str:
    """What a file of st_mode `mode` is, as messages name it ('' for a regular file)."""
    if stat.S_ISREG(mode):
        return ""
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def _refuse_kind(path: str, kind: str, what: str) -> NoReturn:
    raise ConfigError(f"path: {path} is {kind}, not a regular file; {what}", argument="path")


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

    def fail(what: str) -> NoReturn:
        raise ConfigError(f"path: {where}: {what}", argument="path")

    if not isinstance(j, dict):
        fail(f"got {type(j).__name__}; each entry is a JSON object")

    def integer(field, bits=64):
        v = j.get(field)
        if isinstance(v, bool) or not isinstance(v, int):
            fail(f"{field} is {_brief(v)}; it must be an integer")
        if not -(1 << (bits - 1)) <= v < (1 << (bits - 1)):  # what the C++ entry holds
            fail(f"{field} is {_brief(v)}; it must be within int{bits}")
        return v

    def boolean(field):
        v = j.get(field, False)
        if not isinstance(v, bool):
            fail(f"{field} is {_brief(v)}; it must be true or false")
        return v

    dtype = j.get("dtype")
    if not isinstance(dtype, str) or dtype not in _CODES:  # a list or dict is no dtype (nor hashable)
        fail(f"dtype is {_brief(dtype)}; valid: 'float32', 'float16', 'bfloat16'")
    backend = j.get("backend")
    if not isinstance(backend, str) or backend not in _BACKEND_CODES:
        fail(f"backend is {_brief(backend)}; valid: 'cublasLt', 'cublas', 'gemv'")
    align = j.get("align")
    if (not isinstance(align, list) or len(align) != 3
            or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < (1 << 31) for x in align)):
        fail(f"align is {_brief(align)}; it must be a list of three integers in [0, 2**31)")
    algo = j.get("algo")
    if not isinstance(algo, list):
        fail(f"algo is {_brief(algo)}; it must be a list of hex strings")
    words = []
    for w in algo:
        digits = _HEX_WORD.fullmatch(w) if isinstance(w, str) else None
        if digits is None or len(digits[1].lstrip("0")) > 16:  # past 64 bits (or no hex word)
            fail(f"algo word {_brief(w)} is not a 64-bit hex string (as '0x00000000000000ff')")
        words.append(int(digits[1], 16))
    name = j.get("device_name")
    if not isinstance(name, str):
        fail(f"device_name is {_brief(name)}; it must be a string")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape ("\ud800") is no text
        fail(f"device_name is {_brief(name)}; it must be text (UTF-8)")
    # The median time tune_gemm measured (>= 0), or -1 for an entry never timed: what the cache
    # holds for one (gemm_cache_entries(tuned_only=False) lists such entries), and an absent
    # field's value. NaN and Infinity are no time, and not JSON for strict readers either.
    time_ms = j.get("time_ms", -1.0)
    valid_time = "it must be a finite number of milliseconds >= 0, or -1 for an entry never timed"
    if isinstance(time_ms, bool) or not isinstance(time_ms, (int, float)):
        fail(f"time_ms is {_brief(time_ms)}; {valid_time}")
    try:
        time_ms = float(time_ms)
    except OverflowError:  # an integer past a double's range
        fail(f"time_ms is {_brief(time_ms)}; {valid_time}")
    if not math.isfinite(time_ms) or (time_ms < 0 and time_ms != -1.0):
        fail(f"time_ms is {_brief(j.get('time_ms'))}; {valid_time}")
    problem = {"dtype": _CODES[dtype], "trans_a": boolean("trans_a"),
               "trans_b": boolean("trans_b"), "tf32": boolean("tf32")}
    problem.update({f: integer(f) for f in _PROBLEM_FIELDS})
    return {"device": integer("device", 32), "device_name": name,
            "cublas_version": integer("cublas_version"), "problem": problem,
            "align_a": align[0], "align_b": align[1], "align_c": align[2],
            "backend": _BACKEND_CODES[backend], "algo": words, "time_ms": float(time_ms)}


def _read_regular_file(path: str) -> bytes:
    """The bytes of a regular file of at most _MAX_FILE_BYTES; ConfigError('path') for anything
    else. A FIFO would block the open and the read, a device such as /dev/zero never ends: the
    file is looked at before it is opened (some devices act on an open), opened without blocking
    (for a FIFO swapped in meanwhile) and looked at again through its descriptor."""
    what = "give a file written by save_gemm_cache"
    kind = _not_regular(os.stat(path).st_mode)  # FileNotFoundError and the like, as open() gives
    if kind:
        _refuse_kind(path, kind, what)
    nonblock = getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, os.O_RDONLY | nonblock | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        kind = _not_regular(st.st_mode)
        if kind:
            _refuse_kind(path, kind, what)
        if nonblock:
            os.set_blocking(fd, True)  # a regular file: plain reads from here
        # Not more than the cap, whatever st_size says: the file may grow meanwhile.
        data = b"" if st.st_size > _MAX_FILE_BYTES else f.read(_MAX_FILE_BYTES + 1)
    if st.st_size > _MAX_FILE_BYTES or len(data) > _MAX_FILE_BYTES:
        raise ConfigError(f"path: {path} holds more than {_MAX_FILE_BYTES >> 20} MiB, far more than a GEMM "
                          f"cache; {what}", argument="path")
    return data


def _read_cache_file(path) -> list:
    data = _read_regular_file(path)  # its ConfigError as it is (a ValueError, caught below)
    try:
        document = json.loads(data.decode("utf-8"))
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
    version = document.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version != _VERSION:  # not true, not 1.0
        raise ConfigError(f"path: {path} has cache format version {_brief(version)}; "
                          f"this inferctx reads version {_VERSION} (a JSON integer)", argument="path")
    return document["entries"]

"""What autotune_gemm needs besides the compiled tuner: the shapes it is given, the key of a cache
entry's problem, and the progress bar. Internal to inferctx.gemm."""

from __future__ import annotations

import itertools
import numbers
import sys
import time

from ._gemm_cache import _PROBLEM_FIELDS
from .errors import ConfigError, _brief


def _tune_shapes(shapes):
    """(batch, m, n, k) tuples of positive ints from (m, n, k) / (batch, m, n, k) items."""
    if isinstance(shapes, (str, bytes)) or not hasattr(shapes, "__iter__"):
        raise ConfigError(f"shapes: got {_brief(shapes)}; it must be a list of (m, n, k) or "
                          f"(batch, m, n, k) tuples", argument="shapes")
    shapes = list(shapes)
    if shapes and all(isinstance(s, numbers.Integral) for s in shapes):
        shapes = [tuple(shapes)]  # one shape given bare
    out = []
    for item in shapes:
        try:  # five at most: enough to refuse a longer one (a range(10**18) is not read whole)
            dims = tuple(itertools.islice(item, 5))
        except TypeError:
            dims = None
        if (dims is None or len(dims) not in (3, 4)
                or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or not 1 <= d < 1 << 63
                       for d in dims)):
            raise ConfigError(f"shapes: got {_brief(item)}; each shape is (m, n, k) or (batch, m, n, k) "
                              f"with integers in [1, 2**63)", argument="shapes")
        dims = tuple(int(d) for d in dims)
        out.append(dims if len(dims) == 4 else (1,) + dims)
    return out


def _problem_key(p):
    """A problem dict (as _core gives them) as a hashable key."""
    return (p["dtype"], bool(p["trans_a"]), bool(p["trans_b"]), bool(p["tf32"])) + tuple(
        int(p[f]) for f in _PROBLEM_FIELDS)


class _Progress:
    """A one-line progress bar on stderr (one line per item where stderr is not a terminal)."""

    WIDTH = 24

    def __init__(self, total, enabled, stream=None):
        self.total = total
        self.count = 0
        self.stream = stream if stream is not None else sys.stderr
        # sys.stderr is None where Python runs without one (pythonw, some services): no bar there.
        self.enabled = enabled and total > 0 and self.stream is not None
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

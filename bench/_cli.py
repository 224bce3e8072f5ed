"""Checks of the benchmarks' command lines: a value that would crash a run, hang it, or time a
shortcut instead of the kernel is refused at once, in one line (argparse's error, exit 2)."""

import os


def at_least(ap, flag, values, lowest):
    """Every value of `flag` (one, or a list) at least `lowest`."""
    for v in values if isinstance(values, list) else [values]:
        if v < lowest:
            ap.error(f"{flag} {v}: must be at least {lowest}")


def positive_float(ap, flag, value):
    if value is not None and not value > 0:  # NaN too
        ap.error(f"{flag} {value}: must be a number above 0")


def drop_probability(ap, p):
    """In (0, 1) and not rounding to 0 or 1 in float32: at either end both libraries skip the
    kernel, each its own way (torch returns its input at p = 0), so a ratio would time shortcuts."""
    import struct

    # (pack is reached only for p in (0, 1), which float32 holds; NaN fails the range test)
    if not 0.0 < p < 1.0 or struct.unpack("f", struct.pack("f", p))[0] in (0.0, 1.0):
        ap.error(f"--p {p}: must be in (0, 1) and not round to 0 or 1 in float32")


def json_path(ap, path):
    """The folder of the --json file exists and is writable, checked before the run's minutes."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        ap.error(f"--json {path}: the folder {folder} does not exist or is not writable")

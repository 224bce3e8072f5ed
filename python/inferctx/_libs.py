"""Finds libcublas / libcublasLt before the extension loads.

The extension's RPATH points at the nvidia-cublas wheel beside the package; when the package
is installed elsewhere (``pip install --target``, an editable build) the wheel may live in
another site-packages directory on sys.path. Loading the libraries by full path first lets
the dynamic loader resolve the extension's dependency by soname.
"""

from __future__ import annotations

import ctypes
import os
import sys

_LIBS = ("libcublasLt.so.13", "libcublas.so.13")


def preload() -> None:
    for directory in _candidate_dirs():
        paths = [os.path.join(directory, name) for name in _LIBS]
        if all(os.path.exists(p) for p in paths):
            for p in paths:
                ctypes.CDLL(p)  # RTLD_LOCAL: its symbols must not interpose on others
            return
    # Otherwise the RPATH or the system's loader path must provide them; the import of
    # the extension then says which library is missing.


def _candidate_dirs():
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "..", "nvidia", "cu13", "lib")
    for entry in sys.path:
        if entry:
            yield os.path.join(entry, "nvidia", "cu13", "lib")

"""Finds libcublas / libcublasLt before the GPU module inferctx._core loads.

The extension's RPATH points at the nvidia-cublas wheel beside the package; when the package
is installed elsewhere (``pip install --target``, an editable build) the wheel may live in
another site-packages directory on sys.path. Loading the libraries by full path first lets
the dynamic loader resolve the extension's dependency by soname.

Nothing here runs at ``import inferctx``: planning loads no CUDA library. ``install_hook``
puts a finder on sys.meta_path that preloads the libraries the first time inferctx._core is
imported, whichever module imports it (inferctx.context, inferctx.gemm, or a lazy attribute
of the package). The same finder imports inferctx.context right after inferctx._core, so that
the public InferenceContext (which adds the Python layer to the compiled class) is the class
of every context, whichever module made the first.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec

_LIBS = ("libcublasLt.so.13", "libcublas.so.13")
_CORE = "inferctx._core"
_CONTEXT = "inferctx.context"
_done = False
_lock = threading.Lock()
_unloadable: list[str] = []  # why each pair of libraries found but not loadable was passed over


def preload() -> None:
    """Loads cuBLAS from the first directory that has both libraries (once per process)."""
    global _done
    with _lock:
        if _done:
            return
        _done = True
        for directory in _candidate_dirs():
            paths = [os.path.join(directory, name) for name in _LIBS]
            if all(os.path.exists(p) for p in paths):
                try:
                    for p in paths:
                        ctypes.CDLL(p)  # RTLD_LOCAL: its symbols must not interpose on others
                except OSError as exc:  # a truncated file, another architecture, a folder: try the next
                    _unloadable.append(str(exc))
                    continue
                return
        # Otherwise the RPATH or the system's loader path must provide them; the import of
        # the extension then says which library is missing.


def _candidate_dirs() -> Iterator[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "..", "nvidia", "cu13", "lib")
    for entry in sys.path:
        try:
            entry = os.fsdecode(entry)  # sys.path may hold bytes or path objects too
        except TypeError:
            continue  # nor is anything else an import location
        if entry:
            yield os.path.join(entry, "nvidia", "cu13", "lib")


class _PreloadBeforeCore:
    """A meta-path finder (importlib.abc.MetaPathFinder's protocol; the ABC itself costs 10 ms
    of import) that preloads cuBLAS when inferctx._core is first imported and hands the
    extension's own spec back with a loader that imports inferctx.context after it."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != _CORE:
            return None
        preload()
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenContext(spec.loader)  # type: ignore[assignment]  # Loader's protocol
        return spec


class _ThenContext:
    """The extension's loader, followed by the import of inferctx.context."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        try:
            return self._loader.create_module(spec)
        except ImportError as exc:
            if not any(name.split(".so")[0] in str(exc) for name in _LIBS):
                raise
            from .errors import CudaLibraryError

            # The loader's message names the file; say where it comes from.
            passed_over = "".join(f"; passed over {why}" for why in _unloadable)
            raise CudaLibraryError(f"{exc}{passed_over}: inferctx's GPU module needs cuBLAS 13, which the "
                                   f"nvidia-cublas wheel provides: pip install 'nvidia-cublas>=13,<14' (it is "
                                   f"a dependency of inferctx; an install with --no-deps leaves it out). "
                                   f"Planning (plan_workspace, `inferctx plan --gpu ...` or --free-gb ...) "
                                   f"works without it.", name=exc.name, path=exc.path) from exc

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        # Already in sys.modules when inferctx.context is what imports inferctx._core (in this
        # thread or another): it registers its class once its own import is done.
        if _CONTEXT not in sys.modules:
            import importlib

            importlib.import_module(_CONTEXT)


def install_hook() -> None:
    """Arranges for preload() to run before inferctx._core loads (idempotent)."""
    if not any(isinstance(f, _PreloadBeforeCore) for f in sys.meta_path):
        sys.meta_path.insert(0, _PreloadBeforeCore())

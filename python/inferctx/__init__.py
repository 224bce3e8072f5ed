"""inferctx: one GPU context per device for transformer inference engines.

It plans and owns the inference workspace (activations, KV cache, attention scores), the
cuBLAS handle, the compute and communication streams, the generated-token counter and the
Philox RNG state, with the dropout and GEMM kernels that use them. Planning works without a
GPU; every buffer is reachable from PyTorch, CuPy, JAX and Numba without a copy (NumPy, which
cannot read device memory, through a PinnedBuffer or a host copy).

``import inferctx`` and planning load no CUDA library: the GPU names (InferenceContext,
DeviceView, PinnedBuffer, Stream, Event, dropout, apply_mask, gemm and the rest) load the GPU
module, and cuBLAS with it, on first use.
"""

from __future__ import annotations

# Before the package's other modules: a thread that imports inferctx._core directly (as
# `from inferctx._core import ...`) while this one runs the package's first import finds the
# package in sys.modules at once (the import system does not wait for a package that another
# thread is importing), and must find the finder that loads cuBLAS first on sys.meta_path.
from ._libs import install_hook as _install_hook

_install_hook()

import sys  # noqa: E402
import types  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from . import errors  # noqa: E402
from .errors import *  # noqa: F401,F403,E402  (the exception classes, errors.__all__)
from .planning import (ModelShape, Region, WorkspacePlan, max_batch_size, max_out_tokens_for,  # noqa: F401,E402
                       plan_workspace)
from .presets import GPU_PRESETS, MODEL_PRESETS, gpu_preset, model_info, model_preset  # noqa: F401,E402

__version__ = "0.1.0"

# name -> the module that defines it; imported on first access (module __getattr__, PEP 562).
_GPU_NAMES = {
    "InferenceContext": "context",
    "DeviceView": "context",
    "PinnedBuffer": "context",
    "Stream": "context",
    "Event": "context",
    "dropout": "_core",
    "apply_mask": "_core",
    # gemm.__all__ (tests/python/test_import.py checks that the two lists agree)
    "gemm": "gemm",
    "bmm": "gemm",
    "autotune_gemm": "gemm",
    "save_gemm_cache": "gemm",
    "load_gemm_cache": "gemm",
    "clear_gemm_cache": "gemm",
    "gemm_cache_entries": "gemm",
}

if TYPE_CHECKING:  # what type checkers see: the lazy names, re-exported
    from ._core import apply_mask as apply_mask, dropout as dropout
    from .context import (DeviceView as DeviceView, Event as Event, InferenceContext as InferenceContext,
                          PinnedBuffer as PinnedBuffer, Stream as Stream)
    from .gemm import (autotune_gemm as autotune_gemm, bmm as bmm, clear_gemm_cache as clear_gemm_cache,
                       gemm as gemm, gemm_cache_entries as gemm_cache_entries,
                       load_gemm_cache as load_gemm_cache, save_gemm_cache as save_gemm_cache)


def __getattr__(name: str) -> Any:
    module = _GPU_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'inferctx' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_GPU_NAMES))


class _Package(types.ModuleType):
    """The package's module type: the function gemm stays inferctx.gemm when the submodule
    inferctx.gemm is imported (the import system would set the attribute to the submodule)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}"
                and _GPU_NAMES.get(name) == name and hasattr(value, name)):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "ModelShape",
    "Region",
    "WorkspacePlan",
    "plan_workspace",
    "max_batch_size",
    "max_out_tokens_for",
    "MODEL_PRESETS",
    "GPU_PRESETS",
    "model_preset",
    "model_info",
    "gpu_preset",
    "errors",
    *_GPU_NAMES,
    *errors.__all__,
]

"""inferctx: one GPU context per device for transformer inference engines.

It plans and owns the inference workspace (activations, KV cache, attention scores), the
cuBLAS handle, the compute and communication streams, the generated-token counter and the
Philox RNG state, with the dropout and GEMM kernels that use them. Planning works without a
GPU; every buffer is reachable from PyTorch, CuPy, JAX, Numba and NumPy without a copy.
"""

from ._libs import preload as _preload

_preload()

from . import errors  # noqa: E402
from . import gemm as _gemm_module  # noqa: E402
from .errors import *  # noqa: E402,F401,F403  (the exception classes, errors.__all__)
from .planning import ModelShape, Region, WorkspacePlan, plan_workspace  # noqa: E402
from .presets import GPU_PRESETS, MODEL_PRESETS, gpu_preset, model_preset  # noqa: E402
from .context import DeviceView, Event, InferenceContext, PinnedBuffer, Stream  # noqa: E402
from ._core import apply_mask, dropout  # noqa: E402
from .gemm import *  # noqa: E402,F401,F403  (gemm, bmm, autotune_gemm and the cache, gemm.__all__)

__version__ = "0.1.0"

__all__ = [
    "ModelShape",
    "Region",
    "WorkspacePlan",
    "plan_workspace",
    "MODEL_PRESETS",
    "GPU_PRESETS",
    "model_preset",
    "gpu_preset",
    "InferenceContext",
    "DeviceView",
    "PinnedBuffer",
    "Stream",
    "Event",
    "dropout",
    "apply_mask",
    "errors",
    *_gemm_module.__all__,
    *errors.__all__,
]

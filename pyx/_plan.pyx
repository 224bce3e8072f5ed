# cython: language_level=3, embedsignature=True, binding=True
"""inferctx._plan: the workspace planner, pure host code (links no CUDA library).

``import inferctx`` and planning load only this module; inferctx._core (the GPU side, which
needs cuBLAS) is loaded on first GPU use.
"""

from inferctx import errors as _errors

include "_errors.pxi"
include "_coerce.pxi"
include "_planner_api.pxi"

# cython: language_level=3, embedsignature=True, binding=True
"""inferctx._core: the compiled layer over inferctx_core (planner, context, views, kernels)."""

from inferctx import errors as _errors

include "_errors.pxi"
include "_coerce.pxi"
include "_planner.pxi"
include "_dlpack.pxi"
include "_dtypes.pxi"
include "_args.pxi"
include "_streams.pxi"
include "_views.pxi"
include "_pinned.pxi"
include "_release.pxi"
include "_context.pxi"
include "_context_registry.pxi"
include "_interop.pxi"
include "_pool.pxi"
include "_contract.pxi"
include "_graph_rng.pxi"
include "_kernels.pxi"
include "_gemm.pxi"
include "_decoder_ops.pxi"

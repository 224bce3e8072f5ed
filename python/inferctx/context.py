"""The GPU context and its buffers: InferenceContext, DeviceView, PinnedBuffer, Stream, Event.

The buffers and the context's resources are compiled (``inferctx._core``); this module is
their public home. InferenceContext here adds to the compiled class what belongs to the
Python layer: coercing gen_workspace's arguments, the WorkspacePlan it returns and the log
record that replaces DeepSpeed's printed workspace banner.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from . import _core
from ._core import DeviceView, Event, PinnedBuffer, Stream
from ._model_shape import _as_shape
from .planning import ModelShape, WorkspacePlan, _request_fields, human_bytes

__all__ = ["InferenceContext", "DeviceView", "PinnedBuffer", "Stream", "Event", "logger"]

logger = logging.getLogger("inferctx")


class InferenceContext(_core.InferenceContext):
    """The GPU resources of one device for transformer inference (DeepSpeed's InferenceContext).

    One per device, from ``InferenceContext.instance(device=None)``. It plans and owns the
    workspace (activations, KV cache, attention scores), the cuBLAS handle, the compute and
    communication streams, the generated-token counter and the Philox (seed, offset) state.
    """

    __slots__ = ()

    def gen_workspace(self, shape: ModelShape | str, *, batch_size: int, prompt_len: int,
                      max_out_tokens: int, min_out_tokens: int = 1, dtype: Any = "float16",
                      mp_size: int = 1, rank: int = 0, external_cache: bool = False,
                      policy: Literal["exact", "deepspeed"] = "exact",
                      reserve_bytes: int | None = None, memory_limit_bytes: int | None = None,
                      memory_fraction: float | None = None) -> WorkspacePlan:
        """Plans the workspace against the device's free memory (read now) and allocates it.

        Takes ``plan_workspace``'s arguments except the memory figures, which it measures.
        When ``addresses_stable``, memory the workspace holds counts as free, the workspace is
        kept when large enough and otherwise grown in place (same address: views stay valid),
        and the exact policy's bytes are whole multiples of ``allocation_granularity``. Under the
        cudaMalloc fallback, memory the workspace holds counts as free when no view of it is
        alive, and a larger plan gets a new allocation (made before the old is freed). On any
        failure the previous plan stays in force with its workspace, except under the fallback
        when the new allocation fails beside the old one and no view of the old one is alive:
        the old one is then freed to try, and allocated again at its size (contents lost) if
        the new one still fails, or left to ``retake_workspace`` when that fails too; the error
        says which. Logs the plan (logger
        "inferctx", INFO, rank 0 only) when it changes.

        Returns
        -------
        WorkspacePlan
        """
        args = (shape, batch_size, prompt_len, max_out_tokens, min_out_tokens, dtype, mp_size,
                rank, external_cache, policy, reserve_bytes, memory_limit_bytes, memory_fraction)
        with self._workspace_lock:  # another thread's call cannot come between plan and layout
            try:
                made = self._gen_workspace(args, None)  # None when args are not the last request's
                if made is None:
                    made = self._gen_workspace(args, _request_fields(
                        shape, batch_size=batch_size, prompt_len=prompt_len,
                        max_out_tokens=max_out_tokens, min_out_tokens=min_out_tokens, dtype=dtype,
                        mp_size=mp_size, rank=rank, external_cache=external_cache, policy=policy,
                        free_bytes=0, total_bytes=1, reserve_bytes=reserve_bytes,
                        memory_limit_bytes=memory_limit_bytes, memory_fraction=memory_fraction))
                if isinstance(made, WorkspacePlan):
                    return made  # the plan in force stands
                assert made is not None  # a request was given
                plan = self._plan_of(made, shape)
                changed = self._adopt_plan(plan, made)
            except BaseException:
                # Ctrl-C during the compiled call is raised at the first Python instruction after
                # it, with the new plan already in force in C++: adopted here, or the views'
                # layout and ctx.plan would be the old plan's (None where nothing was put in force).
                unadopted = self._unadopted_plan()
                if unadopted is not None:
                    self._adopt_plan(self._plan_of(unadopted, shape), unadopted)
                raise
        if changed:
            _log_plan(plan, self.device)
        return plan

    def _plan_of(self, made: _core._PlanMade, shape: Any) -> WorkspacePlan:
        # Free memory is read now, with the weights already loaded: none are subtracted again.
        return WorkspacePlan._from_result(
            made.request, made.result,
            {"memory": f"cuda:{self.device}, read now by gen_workspace", "weights": "none"},
            shape=_as_shape(shape))

    def _created(self, fallback_reason: str | None) -> None:
        if fallback_reason is not None:
            _log_workspace_fallback(self.device, fallback_reason)


_core._set_context_class(InferenceContext)


def _log_plan(plan: WorkspacePlan, device: int) -> None:
    """Logs a workspace plan that gen_workspace put in force (on rank 0 only, as DeepSpeed prints)."""
    if plan.rank != 0 or not logger.isEnabledFor(logging.INFO):
        return
    logger.info("cuda:%d: workspace of %s for %d tokens (bound by %s)\n%s", device,
                human_bytes(plan.workspace_bytes), plan.max_tokens, plan.bound_by, plan)


def _log_workspace_fallback(device: int, reason: str) -> None:
    """Logs, once per device (when its context is made), that the workspace is a cudaMalloc
    allocation whose address changes at every retake, and why."""
    level = logging.INFO if reason.startswith("INFERCTX_DISABLE_VMM") else logging.WARNING
    logger.log(level, "cuda:%d: the workspace is a cudaMalloc allocation, not CUDA virtual memory (%s): "
               "release_workspace() frees it and retake_workspace() allocates a new one at another "
               "address, so views must be dropped before a release and CUDA graphs captured again "
               "after it (InferenceContext.addresses_stable is False)", device, reason)

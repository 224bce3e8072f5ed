"""The GPU context and its buffers: InferenceContext, DeviceView, PinnedBuffer, Stream, Event.

The classes are compiled (``inferctx._core``); this module is their public home and holds the
log record that replaces DeepSpeed's printed workspace banner.
"""

from __future__ import annotations

import logging

from ._core import DeviceView, Event, InferenceContext, PinnedBuffer, Stream
from .planning import human_bytes

__all__ = ["InferenceContext", "DeviceView", "PinnedBuffer", "Stream", "Event", "logger"]

logger = logging.getLogger("inferctx")


def _log_plan(plan, device: int) -> None:
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

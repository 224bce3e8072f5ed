"""Shared by the GPU context tests: a small plan whose byte counts are worked out by hand, and a
fixture giving the current device's context with that plan in force."""

from __future__ import annotations

import gc
import sys
import time

import pytest

from inferctx import ModelShape

# 4 layers, 8 heads of 64 (hidden 512), 2 KV heads (GQA); fp16.
SHAPE = ModelShape(num_layers=4, num_heads=8, hidden_dim=512, num_kv_heads=2)
REQUEST = dict(batch_size=2, prompt_len=16, max_out_tokens=64, dtype="float16")

# By hand, per the exact policy (every region 256-byte aligned; these already are):
ACTIVATIONS_BYTES = 10 * 8 * 64 * 2 * 64 * 2  # 10 * heads * head * batch * tokens * fp16 = 1_310_720
KV_SHAPE = (2, 2, 64, 64)  # [batch, kv_heads / mp, max_tokens, head]
KV_TENSOR_BYTES = 2 * 2 * 64 * 64 * 2  # 32_768
SCORES_BYTES = 2 * 8 * 64 * 64 * 2  # batch * heads * max_out_tokens * tokens * fp16 = 131_072
WORKSPACE_BYTES = ACTIVATIONS_BYTES + 4 * 2 * KV_TENSOR_BYTES + SCORES_BYTES  # 1_703_936


def pinned_of(values):
    """A PinnedBuffer holding a NumPy array's bytes."""
    import numpy as np

    from inferctx.context import PinnedBuffer

    buf = PinnedBuffer(values.nbytes)
    np.frombuffer(buf, dtype=values.dtype)[:] = np.ascontiguousarray(values).ravel()
    return buf


def settled_free_memory(ctx):
    """Free device memory once nothing is pending: garbage collected, the context's stream and
    torch (where loaded) synchronised, torch's cached blocks and the pool's unused memory given
    back."""
    import sys

    from inferctx import _core

    gc.collect()
    ctx.stream.synchronize()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # torch's cached blocks are no inferctx memory
    ctx.memory_pool.trim()
    return _core._memory_info(ctx.device)[0]


def _holder_name(obj) -> str:
    """A holder as a leak report names it: a frame by its function, a function by its name, a
    traceback by the function of its frame, anything else by its type."""
    if hasattr(obj, "f_code"):
        return f"frame of {obj.f_code.co_name}"
    if type(obj).__name__ == "function":
        return f"function {obj.__qualname__}"
    if type(obj).__name__ == "traceback":
        return f"traceback of {obj.tb_frame.f_code.co_name}"
    return type(obj).__name__


_VAGUE = ("cell", "list", "dict", "tuple", "frame", "traceback")
_STEPS_BACK = 5


def _is_report_frame(obj) -> bool:
    """A frame of the report's own functions (their locals hold what they look at)."""
    return getattr(obj, "f_code", None) in (_holders_back.__code__, live_views_report.__code__)


def _holders_back(obj, depth: int, skip: set, budget: list) -> list:
    """Lines naming what holds `obj` where its own name says little (_VAGUE: a stored exception
    shows as the traceback that keeps a frame), and so on back, `depth` steps in so far (at most
    _STEPS_BACK); `skip`: ids of the report's own containers; `budget`: [the referrer searches
    the report may still make] (each scans every object, so a report makes a bounded number)."""
    if depth > _STEPS_BACK or type(obj).__name__ not in _VAGUE or budget[0] <= 0:
        return []
    budget[0] -= 1
    found = [r for r in gc.get_referrers(obj) if id(r) not in skip and not _is_report_frame(r)]
    inner = skip | {id(found)}
    # References the collector cannot show: a running function's locals, C code's, or one never
    # given back. All of obj's but those of `found`, of this call's argument and getrefcount's,
    # and of the caller's list.
    unseen = sys.getrefcount(obj) - 3 - len(found)
    names = ", ".join(sorted({_holder_name(r) for r in found})) or "nothing seen"
    if unseen > 0:
        names += f" (and {unseen} unseen reference(s))"
    lines = [f"{'  ' * (depth + 1)}{_holder_name(obj)} held by {names}"]
    for i in range(min(len(found), 3)):  # (by index, as above)
        lines.extend(_holders_back(found[i], depth + 1, inner, budget))
    return lines


def live_views_report(limit: int = 8, device_type: str = "cuda") -> str:
    """The DeviceViews alive and what holds each, for the message of a failed leak or release
    check: a view that only C code holds (a DLPack export, a capsule) shows no Python holder."""
    import inferctx

    gc.collect()
    objects = gc.get_objects()
    views = [o for o in objects if type(o) is inferctx.DeviceView]
    lines = [f"{len(views)} DeviceView(s) alive"]
    torch = sys.modules.get("torch")
    tensors = [o for o in objects if torch is not None and issubclass(type(o), torch.Tensor)
               and o.device.type == device_type]
    del objects
    here = sys._getframe()
    budget = [100]  # searches of the holders' holders, in all
    for v in range(min(len(views), limit)):  # (by index: a slice would hold the views too)
        view = views[v]
        holders = [r for r in gc.get_referrers(view) if r is not views and r is not here]
        names = sorted({_holder_name(r) for r in holders})
        lines.append(f"  {view!r} held by {', '.join(names) or 'no Python object (a DLPack capsule?)'}")
        # Further back, for the holders that say least alone (a closure's cell, a list, a dict,
        # a tuple, a frame kept by a traceback): what holds each of them, a few steps back.
        back = []
        for i in range(min(len(holders), limit)):  # (by index: an iterator would hold the list)
            back.extend(_holders_back(holders[i], 1, {id(holders), id(views), id(here)}, budget))
        lines.extend(back[:30] + ([f"    ... {len(back) - 30} more lines"] if len(back) > 30 else []))
        # A view that only a capsule holds lives as long as the array imported from it: name the
        # torch tensors over its memory and what holds them (a frame names its function).
        for t in tensors:
            if view.ptr <= t.data_ptr() < view.ptr + max(view.nbytes, 1):
                refs = sorted({_holder_name(r) for r in gc.get_referrers(t)
                               if r is not tensors and r is not here})
                lines.append(f"    tensor {tuple(t.shape)} at {t.data_ptr():#x} held by {', '.join(refs) or 'nothing seen'}")
    return "\n".join(lines)


def plan_small(ctx, **overrides):
    """Puts the small plan (with `overrides`) in force on `ctx`."""
    return ctx.gen_workspace(SHAPE, **{**REQUEST, **overrides})


@pytest.fixture
def ctx():
    """The current device's context with the small plan in force, its own stream, token 0."""
    from inferctx.context import InferenceContext

    context = InferenceContext.instance()
    gc.collect()  # views of earlier tests
    context.use_stream(None)
    plan_small(context)
    context.reset_tokens(0)
    yield context
    gc.collect()
    context.use_stream(None)
    context.stream.synchronize()


def settled_live_sites(ctx, quiet_s=0.3, timeout_s=10.0):
    """The graph RNG's live call sites once the count has stopped changing: graphs give their sites
    back asynchronously (user-object destructors run on a CUDA thread)."""
    from inferctx import _core

    gc.collect()
    deadline = time.monotonic() + timeout_s
    last, since = _core.graph_rng_state(ctx)["live_sites"], time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = _core.graph_rng_state(ctx)["live_sites"]
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last

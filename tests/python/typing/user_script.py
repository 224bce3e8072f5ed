"""A user's script: what an engine built on inferctx writes, checked with mypy --strict."""

from __future__ import annotations

import inferctx
from inferctx import ConfigError, ModelShape, Region, WorkspaceOOMError, WorkspacePlan


def plan_for(batch: int) -> WorkspacePlan:
    shape: ModelShape = inferctx.ModelShape.from_preset("llama-3-8b")
    return inferctx.plan_workspace(shape, batch_size=batch, prompt_len=512, max_out_tokens=8192,
                                   dtype="bf16", gpu="h100-80gb")


def answers() -> tuple[int, int, int]:
    gemma = ModelShape(28, 16, 3072, 16, head_dim=256, num_params=8_537_680_896)
    weights: int = gemma.weights_bytes("bf16", mp_size=2)
    b: int = inferctx.max_batch_size("llama-2-7b", max_out_tokens=4096, gpu="h200")
    m: int = inferctx.max_out_tokens_for("llama-2-7b", batch_size=8, free_bytes=40 << 30,
                                         total_bytes=80 << 30, weights_bytes="auto")
    return weights, b, m


def what_fits() -> int | None:
    try:
        inferctx.plan_workspace("llama-2-70b", batch_size=512, prompt_len=512, max_out_tokens=8192,
                                free_bytes=24 << 30, total_bytes=24 << 30, memory_fraction=0.9)
    except WorkspaceOOMError as e:
        requested: int | None = e.requested_bytes
        assert requested is not None
        return e.max_batch_size
    except ConfigError as e:
        argument: str | None = e.argument
        print(argument)
    return None


def layout(plan: WorkspacePlan) -> list[tuple[str, int]]:
    regions: list[Region] = list(plan.regions)
    shape: tuple[int, int, int, int] = plan.kv_shape
    print(shape, plan.weights_bytes, plan.planned_free_bytes, plan.to_dict()["plan"])
    return [(r.name, r.size) for r in regions]


def on_a_gpu() -> None:
    ctx = inferctx.InferenceContext.instance(0)
    plan: WorkspacePlan = ctx.gen_workspace("llama-3-8b", batch_size=8, prompt_len=512, max_out_tokens=8192,
                                            dtype="bf16")
    k, v = ctx.kv_cache(0)
    view: inferctx.DeviceView = k
    tokens: int = ctx.max_token_length
    seed, offset = ctx.increment_offset(4)
    c = inferctx.gemm(k, v, trans_b=True)
    d = inferctx.bmm(c, c)
    inferctx.autotune_gemm([(1, 4096, 4096)], "bf16")
    y, mask = inferctx.dropout(d, 0.1)
    print(plan, view, tokens, seed, offset, y, mask, inferctx.Stream, inferctx.Event, inferctx.PinnedBuffer)
    print(inferctx.save_gemm_cache, inferctx.load_gemm_cache, inferctx.clear_gemm_cache,
          inferctx.gemm_cache_entries, inferctx.apply_mask)

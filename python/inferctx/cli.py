"""The `inferctx` command: `inferctx plan ...` and `inferctx presets`."""

from __future__ import annotations

import argparse
import json
import sys

from . import presets
from .errors import InferCtxError, WorkspaceOOMError
from .planning import ModelShape, human_bytes, plan_workspace

GIB = 1 << 30


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, no usage dump
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="inferctx", description="Plan and inspect inference workspaces.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    sub.required = True

    plan = sub.add_parser("plan", help="plan a workspace (works without a GPU)")
    model = plan.add_argument_group("model (a preset or explicit shape)")
    model.add_argument("--preset", help="model preset, e.g. llama-2-7b (see `inferctx presets`)")
    model.add_argument("--layers", type=int, help="number of layers")
    model.add_argument("--heads", type=int, help="number of attention heads")
    model.add_argument("--hidden", type=int, help="hidden size")
    model.add_argument("--kv-heads", type=int, help="KV heads (GQA/MQA); default: the preset's, or heads")
    mem = plan.add_argument_group("memory (a GPU preset, explicit figures, or the real device)")
    mem.add_argument("--gpu", help="GPU preset, e.g. h100-80gb, h200")
    mem.add_argument("--free-gb", type=float, help="free memory in GiB")
    mem.add_argument("--total-gb", type=float, help="total memory in GiB (default: --free-gb)")
    mem.add_argument("--device", type=int, help="read memory from this CUDA device")
    mem.add_argument("--reserve-gb", type=float, help="memory kept free (exact policy)")
    mem.add_argument("--memory-limit-gb", type=float, help="cap on the workspace budget (exact policy)")
    mem.add_argument("--memory-fraction", type=float, help="cap as a fraction of free memory (exact policy)")
    req = plan.add_argument_group("request")
    req.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    req.add_argument("--prompt-len", type=int, default=1, help="prompt length (default 1)")
    req.add_argument("--max-tokens", type=int, default=2048, help="max_out_tokens, prompt included (default 2048)")
    req.add_argument("--min-tokens", type=int, default=1, help="min_out_tokens (default 1)")
    req.add_argument("--dtype", default="float16", help="float16 (default), bfloat16 or float32")
    req.add_argument("--mp-size", type=int, default=1, help="model-parallel size (default 1)")
    req.add_argument("--rank", type=int, default=0, help="model-parallel rank (default 0)")
    req.add_argument("--external-cache", action="store_true", help="KV cache managed elsewhere")
    req.add_argument("--policy", default="exact", choices=("exact", "deepspeed"), help="sizing policy")
    out = plan.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--sweep-batch", type=int, metavar="N", help="print max tokens for batch 1..N")
    out.add_argument("--plot", metavar="FILE.png", help="with --sweep-batch: draw max tokens against batch")

    ls = sub.add_parser("presets", help="list the built-in model and GPU presets")
    ls.add_argument("--json", action="store_true", help="print as JSON")
    return p


def _gib(value, flag):
    if value is None:
        return None
    if not value > 0:
        raise _UsageError(f"{flag}: got {value}; it must be a positive number of GiB")
    return int(value * GIB)


def _shape(args) -> ModelShape:
    explicit = [args.layers, args.heads, args.hidden]
    if args.preset:
        if any(v is not None for v in explicit):
            raise _UsageError("give either --preset or --layers/--heads/--hidden, not both")
        base = presets.model_preset(args.preset)
        kv = args.kv_heads if args.kv_heads is not None else base.num_kv_heads
        return ModelShape(base.num_layers, base.num_heads, base.hidden_dim, kv)
    if any(v is None for v in explicit):
        raise _UsageError("give --preset NAME, or all of --layers, --heads and --hidden")
    return ModelShape(args.layers, args.heads, args.hidden, args.kv_heads)


def _memory(args) -> dict:
    if args.gpu and (args.free_gb is not None or args.total_gb is not None):
        raise _UsageError("give either --gpu or --free-gb/--total-gb, not both")
    if args.gpu:
        g = presets.gpu_preset(args.gpu)
        return {"free_bytes": g.free_bytes, "total_bytes": g.total_bytes}
    if args.free_gb is not None or args.total_gb is not None:
        if args.free_gb is None:
            raise _UsageError("--total-gb needs --free-gb")
        free = _gib(args.free_gb, "--free-gb")
        total = _gib(args.total_gb, "--total-gb") if args.total_gb is not None else free
        return {"free_bytes": free, "total_bytes": total}
    return {"device": args.device}  # read from the real device


def _plan_kwargs(args) -> dict:
    kw = dict(batch_size=args.batch, prompt_len=args.prompt_len, max_out_tokens=args.max_tokens,
              min_out_tokens=args.min_tokens, dtype=args.dtype, mp_size=args.mp_size, rank=args.rank,
              external_cache=args.external_cache, policy=args.policy,
              reserve_bytes=None if args.reserve_gb is None else int(args.reserve_gb * GIB),
              memory_limit_bytes=_gib(args.memory_limit_gb, "--memory-limit-gb"),
              memory_fraction=args.memory_fraction)
    kw.update(_memory(args))
    return kw


def _sweep(shape, kw, n, as_json, plot):
    if n < 1:
        raise _UsageError(f"--sweep-batch: got {n}; it must be >= 1")
    rows = []
    for b in range(1, n + 1):
        try:
            p = plan_workspace(shape, **{**kw, "batch_size": b})
            rows.append((b, p.max_tokens, p.workspace_bytes, p.bound_by))
        except WorkspaceOOMError:
            rows.append((b, 0, 0, "does not fit"))
    if as_json:
        print(json.dumps([dict(batch_size=b, max_tokens=t, workspace_bytes=w, bound_by=why)
                          for b, t, w, why in rows], indent=2))
    else:
        print(f"{'batch':>6}{'max tokens':>12}{'workspace':>14}  bound by")
        for b, t, w, why in rows:
            print(f"{b:>6}{t:>12}{human_bytes(w):>14}  {why}")
    if plot:
        _plot(rows, plot, kw)


def _plot(rows, path, kw):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise _UsageError("--plot needs matplotlib: pip install 'inferctx[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o")
    ax.set_xlabel("batch size")
    ax.set_ylabel("max tokens")
    ax.set_title(f"max tokens by batch size ({kw['dtype']}, policy {kw['policy']})")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def _cmd_plan(args) -> int:
    shape = _shape(args)
    kw = _plan_kwargs(args)
    if args.plot and not args.sweep_batch:
        raise _UsageError("--plot needs --sweep-batch N")
    if args.sweep_batch:
        _sweep(shape, {k: v for k, v in kw.items() if k != "batch_size"}, args.sweep_batch, args.json,
               args.plot)
        return 0
    p = plan_workspace(shape, **kw)
    print(json.dumps(p.to_dict(), indent=2) if args.json else p)
    return 0


def _cmd_presets(args) -> int:
    models = {n: presets.model_preset(n) for n in presets.MODEL_PRESETS}
    gpus = {n: presets.gpu_preset(n) for n in presets.GPU_PRESETS}
    if args.json:
        print(json.dumps({
            "models": {n: dict(num_layers=s.num_layers, num_heads=s.num_heads, hidden_dim=s.hidden_dim,
                               num_kv_heads=s.num_kv_heads, source=presets.model_source(n))
                       for n, s in models.items()},
            "gpus": {n: dict(total_bytes=g.total_bytes, description=g.description) for n, g in gpus.items()},
        }, indent=2))
        return 0
    print("models:")
    print(f"  {'name':<16}{'layers':>7}{'heads':>7}{'kv':>5}{'hidden':>8}  source")
    for n, s in models.items():
        print(f"  {n:<16}{s.num_layers:>7}{s.num_heads:>7}{s.num_kv_heads:>5}{s.hidden_dim:>8}  "
              f"{presets.model_source(n)}")
    print("gpus:")
    for n, g in gpus.items():
        print(f"  {n:<16}{human_bytes(g.total_bytes):>12}  {g.description}")
    return 0


def main(argv=None) -> int:
    """Entry point of the `inferctx` console script; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
        return _cmd_plan(args) if args.command == "plan" else _cmd_presets(args)
    except _UsageError as exc:
        print(f"inferctx: error: {exc}", file=sys.stderr)
        return 2
    except InferCtxError as exc:
        print(f"inferctx: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2

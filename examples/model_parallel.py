#!/usr/bin/env python3
"""Model parallel with inferctx and torch.distributed (NCCL): a row-parallel linear layer whose
all-reduce runs on the context's communication stream, overlapped with the next step's GEMM.

Each rank owns ``InferenceContext.instance(device)``, planned with ``mp_size=world`` and its
rank, so the attention heads are split across ranks. The layer is the attention output
projection ``y = x @ W`` (x: [batch * seq, heads * head_dim], W: [heads * head_dim, out]);
rank r holds the rows of W that belong to its heads and computes the partial product
``x[:, shard] @ W[shard, :]`` with ``inferctx.gemm`` on the compute stream; the sum of the
partial products over the ranks (an all-reduce) is ``y``.

Every step t (the steps are independent micro-batches) queues, without blocking the host:

    compute stream                          comm stream
    gemm_t -> out[t % 2]
    ctx.sync_comp()  ---------------------> (waits for gemm_t)
    ctx.sync_comm()  <--------------------- all-reduce of step t-1 (queued last step)
    use out[(t-1) % 2]                      all-reduce out[t % 2]  (NCCL, ExternalStream)

so the all-reduce of step t runs while the compute stream does gemm_{t+1}. ``sync_comm`` (the
compute stream waits for the comm stream) is issued for step t only after gemm_{t+1} is
queued: issued straight after the all-reduce, it would hold gemm_{t+1} back until the
all-reduce ends and nothing would overlap. The two output buffers (carved out of the
context's activations region) make this safe: gemm_{t+1} writes the buffer whose all-reduce
(step t-1) the compute stream has already waited for.

CUDA timing events on both streams give each step's compute, all-reduce and use intervals
in milliseconds from one start event; the program checks the stream order (an all-reduce
starts after its GEMM; its result is used after it ends), reports how long the all-reduce
of step t overlaps the compute of step t+1, and compares every step's result with the
single-GPU float32 computation ``x @ W``.

Run (NVLink SHARP / multicast stays off: this module sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 before torch is imported):

    python examples/model_parallel.py --world-size 2          # spawns one process per GPU
    torchrun --nproc-per-node 2 examples/model_parallel.py    # the same, launched by torchrun
    python examples/model_parallel.py --world-size 1          # one GPU: the same streams and
                                                              # order, an all-reduce of one rank

Options: --world-size, --steps, --dtype, --seed, --spawn (spawn a process even for one rank),
--json (one JSON document on stdout), and the shape: --batch, --seq, --heads, --head-dim,
--out-features. Exit status 0 when every rank matches the reference and the stream order holds,
1 otherwise, 2 for a usage error (flags, torchrun's variables, no GPU or no NCCL), 3 when a rank
could not run (out of memory, a workspace that does not fit, a process group that cannot start);
each error is one line on stderr. NCCL is the only backend.
"""

from __future__ import annotations

import os

# Before torch and NCCL load (spawned and torchrun'd ranks inherit them): never NVLink
# multicast (NVLS); it can take a host's GPUs out of service.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
# Result vs the float32 x @ W: outputs are ~N(0, 1) (W is scaled by 1/sqrt(in_features)); each
# rank's partial sum is rounded to the dtype before the all-reduce adds them in the dtype.
TOLERANCE = {"bfloat16": (3e-2, 2e-2), "float16": (5e-3, 5e-3), "float32": (2e-4, 2e-4)}
# Event timestamps have about 0.5 us resolution.
EPS_MS = 2e-3


# ---------------------------------------------------------------------------------------
# Pure helpers (no torch, no GPU): also used by the tests


def shard_bounds(heads: int, head_dim: int, world: int, rank: int) -> tuple[int, int]:
    """Rows of W (columns of x) of `rank`'s heads: heads are split evenly, in rank order."""
    if world < 1 or heads % world:
        raise ValueError(f"heads={heads} must be divisible by the world size {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must be in [0, {world})")
    per_rank = heads // world * head_dim
    return rank * per_rank, (rank + 1) * per_rank


def analyse(timeline: list[dict], eps: float = EPS_MS) -> dict:
    """Order and overlap of a rank's step timeline.

    ``timeline[t]`` has ``compute``, ``allreduce`` and ``use``: [start_ms, end_ms] from the
    common start event (compute on the compute stream, the all-reduce on the comm stream, the
    use of the reduced output on the compute stream after sync_comm).

    Order that the syncs guarantee (a violation is listed): the all-reduce of step t starts
    after its GEMM ends (sync_comp) and so ends after it; the use of step t starts after its
    all-reduce ends (sync_comm); each stream runs its steps in order. Overlap: for each t,
    the length of the intersection of all-reduce t and compute t+1.
    """
    violations = []

    def late(a, b, what):
        if a > b + eps:
            violations.append(f"{what}: {a:.4f} ms > {b:.4f} ms")

    for t, s in enumerate(timeline):
        for key in ("compute", "allreduce", "use"):
            late(s[key][0], s[key][1], f"step {t} {key} starts after it ends")
        late(s["compute"][1], s["allreduce"][0], f"step {t} all-reduce starts before its compute ends")
        late(s["compute"][1], s["allreduce"][1], f"step {t} all-reduce ends before its compute ends")
        late(s["allreduce"][1], s["use"][0], f"step {t} use starts before its all-reduce ends")
        if t:
            p = timeline[t - 1]
            late(p["compute"][1], s["compute"][0], f"step {t} compute starts before step {t - 1}'s ends")
            late(p["allreduce"][1], s["allreduce"][0],
                 f"step {t} all-reduce starts before step {t - 1}'s ends")
    overlaps = []
    for t in range(len(timeline) - 1):
        ar, nxt = timeline[t]["allreduce"], timeline[t + 1]["compute"]
        overlaps.append(max(0.0, min(ar[1], nxt[1]) - max(ar[0], nxt[0])))
    allreduce_ms = sum(s["allreduce"][1] - s["allreduce"][0] for s in timeline[:-1])
    return {
        "ordered": not violations,
        "violations": violations,
        "overlap_ms": overlaps,
        "overlap_steps": sum(o > eps for o in overlaps),
        "overlap_observed": any(o > eps for o in overlaps),
        "overlap_total_ms": sum(overlaps),
        # all-reduce time of the steps that have a next step to overlap with
        "allreduce_total_ms": allreduce_ms,
        "compute_total_ms": sum(s["compute"][1] - s["compute"][0] for s in timeline),
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Row-parallel linear layer over NCCL with inferctx: the all-reduce runs on "
                    "the context's comm stream and overlaps the next step's GEMM.")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (one GPU each); default: torchrun's WORLD_SIZE, else every visible GPU")
    p.add_argument("--steps", type=int, default=8, help="pipelined steps (default 8)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                   help="GEMM and all-reduce dtype (default bfloat16)")
    p.add_argument("--batch", type=int, default=4, help="sequences (default 4)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--heads", type=int, default=64, help="attention heads (default 64)")
    p.add_argument("--head-dim", type=int, default=128, help="head size (default 128)")
    p.add_argument("--out-features", type=int, default=None,
                   help="output features (default heads * head-dim)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--spawn", action="store_true",
                   help="spawn the ranks even for --world-size 1 (the path taken for 2 or more)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the summary")
    args = p.parse_args(argv)
    args.dtype = DTYPES[args.dtype]
    if args.out_features is None:
        args.out_features = args.heads * args.head_dim
    for name in ("steps", "batch", "seq", "heads", "head_dim", "out_features"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.world_size is not None and args.world_size < 1:
        p.error("--world-size must be >= 1")
    if args.out_features > 5 * args.heads * args.head_dim:
        # the two output buffers live in the activations region: 10 * heads * head per token
        p.error(f"--out-features must be <= 5 * heads * head-dim = {5 * args.heads * args.head_dim}")
    return args


# ---------------------------------------------------------------------------------------
# One rank


def _plan_summary(plan) -> dict:
    return {k: getattr(plan, k) for k in (
        "mp_size", "rank", "max_tokens", "workspace_bytes", "heads_per_rank", "kv_heads_per_rank",
        "activations_bytes", "kv_tensor_bytes", "attention_scores_bytes", "bound_by")} | {
        "regions": [list(r) for r in plan.regions]}


def _pipeline(ctx, xs, w, lo, hi, outs, results, dist, torch, inferctx, timed):
    """Queues every step (see the module docstring); returns the events when `timed`."""
    device = ctx.device
    comm = torch.cuda.ExternalStream(ctx.comm_stream.handle, device=torch.device("cuda", device))

    def event():
        return inferctx.Event(device, timing=True) if timed else None

    def record(ev, stream):
        if ev is not None:
            ev.record(stream)

    steps = [{k: event() for k in ("c0", "c1", "a0", "a1", "u0", "u1")} for _ in xs]
    start = event()
    record(start, ctx.stream)

    def use(t):
        ctx.sync_comm()  # compute waits for the comm stream: the all-reduce of step t, queued last
        record(steps[t]["u0"], ctx.stream)
        results[t].copy_(outs[t % 2])  # torch's current stream is ctx.stream
        record(steps[t]["u1"], ctx.stream)

    for t, x in enumerate(xs):
        buf = outs[t % 2]
        record(steps[t]["c0"], ctx.stream)
        inferctx.gemm(x[:, lo:hi], w[lo:hi], out=buf, ctx=ctx)  # partial x @ W of this rank's heads
        record(steps[t]["c1"], ctx.stream)
        ctx.sync_comp()  # the comm stream waits for gemm_t
        if t:
            use(t - 1)  # after gemm_t is queued, so gemm_t overlaps the all-reduce of step t-1
        with torch.cuda.stream(comm):
            record(steps[t]["a0"], ctx.comm_stream)
            dist.all_reduce(buf)  # sum over the ranks: the full x @ W
            record(steps[t]["a1"], ctx.comm_stream)
    use(len(xs) - 1)
    end = event()
    record(end, ctx.stream)
    return start, steps, end


def run_rank(rank: int, world: int, args: argparse.Namespace, init_method: str,
             device: int | None = None) -> dict:
    """Runs the example on one rank (process group included) and returns its report."""
    import torch
    import torch.distributed as dist

    import inferctx

    device = rank if device is None else device
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world)
    try:
        report = _rank_body(rank, world, args, device, torch, dist, inferctx)
        gathered = [None] * world
        dist.all_gather_object(gathered, report)
        return {"rank": report, "ranks": gathered}
    finally:
        dist.destroy_process_group()


def _rank_body(rank, world, args, device, torch, dist, inferctx) -> dict:
    tdtype = getattr(torch, args.dtype)
    tokens = args.batch * args.seq
    in_features = args.heads * args.head_dim
    lo, hi = shard_bounds(args.heads, args.head_dim, world, rank)

    ctx = inferctx.InferenceContext.instance(device)
    shape = inferctx.ModelShape(num_layers=1, num_heads=args.heads, hidden_dim=in_features)
    plan = ctx.gen_workspace(shape, batch_size=args.batch, prompt_len=args.seq,
                             max_out_tokens=args.seq, dtype=args.dtype, mp_size=world, rank=rank)
    if plan.heads_per_rank * args.head_dim != hi - lo:
        raise RuntimeError(f"plan gives {plan.heads_per_rank} heads per rank, the shard has "
                           f"{(hi - lo) // args.head_dim}")
    need = 2 * tokens * args.out_features * plan.elem_size
    if plan.activations_bytes < need:
        raise RuntimeError(f"the activations region ({plan.activations_bytes} bytes) cannot hold two "
                         f"[{tokens}, {args.out_features}] outputs ({need} bytes); lower "
                         f"--out-features (at most 5 * heads * head-dim)")

    compute = torch.cuda.Stream(device=device)
    views = outs = None
    with torch.cuda.stream(compute):
        # torch ops and inferctx.gemm share the compute stream: nothing to order between them.
        ctx.use_stream(torch.cuda.current_stream())
        try:
            # Identical inputs on every rank: generated on rank 0's seed, then broadcast. Each
            # rank keeps the full x and W only to check against the single-GPU result.
            gen = torch.Generator(device=f"cuda:{device}")
            gen.manual_seed(args.seed)
            xs = [torch.randn(tokens, in_features, generator=gen, device=device, dtype=tdtype)
                  for _ in range(args.steps)]
            w = (torch.randn(in_features, args.out_features, generator=gen, device=device,
                             dtype=torch.float32) / math.sqrt(in_features)).to(tdtype)
            for tensor in (*xs, w):
                dist.broadcast(tensor, src=0)
            # The double-buffered partial outputs live in the context's activations region.
            views = ctx.activations.view(args.dtype, (2, tokens, args.out_features))
            outs = torch.from_dlpack(views)
            results = [torch.empty(tokens, args.out_features, device=device, dtype=tdtype)
                       for _ in range(args.steps)]

            # Warm-up (NCCL communicator, cuBLAS, kernels), untimed.
            _pipeline(ctx, xs[:2], w, lo, hi, outs, results, dist, torch, inferctx, timed=False)
            torch.cuda.synchronize(device)

            start, events, end = _pipeline(ctx, xs, w, lo, hi, outs, results, dist, torch,
                                           inferctx, timed=True)
            end.synchronize()
            torch.cuda.synchronize(device)

            def ms(ev):
                return round(ev.elapsed_ms(start), 4)

            timeline = [{"step": t, "compute": [ms(e["c0"]), ms(e["c1"])],
                         "allreduce": [ms(e["a0"]), ms(e["a1"])], "use": [ms(e["u0"]), ms(e["u1"])]}
                        for t, e in enumerate(events)]
            total_ms = round(end.elapsed_ms(start), 4)

            # The single-GPU computation in float32 (no TF32), step by step.
            torch.backends.cuda.matmul.allow_tf32 = False
            atol, rtol = TOLERANCE[args.dtype]
            max_err, ok = 0.0, True
            wf = w.float()
            for x, y in zip(xs, results):
                ref = x.float() @ wf
                err = (y.float() - ref).abs()
                excess = (err - (atol + rtol * ref.abs())).max().item()
                max_err = max(max_err, torch.nan_to_num(err, nan=math.inf).max().item())  # NaN: inf
                ok = ok and excess <= 0
            torch.cuda.synchronize(device)
        finally:
            del outs, views
            ctx.use_stream(None)

    report = {
        "rank": rank, "world_size": world, "device": device,
        "gpu": torch.cuda.get_device_name(device),
        "dtype": args.dtype, "tokens": tokens, "in_features": in_features,
        "out_features": args.out_features, "shard": [lo, hi],
        "plan": _plan_summary(plan), "timeline": timeline, "total_ms": total_ms,
        "matches_reference": ok, "max_abs_err": max_err, "atol": atol, "rtol": rtol,
    }
    report |= analyse(timeline)
    return report


# ---------------------------------------------------------------------------------------
# Launching


def _spawned(rank, world, args, init_method, report_path):
    out = run_rank(rank, world, args, init_method)
    if rank == 0:
        with open(report_path, "w") as f:
            json.dump(out["ranks"], f)


def _summary(doc: dict) -> str:
    ranks = doc["ranks"]
    r0 = ranks[0]
    plan = r0["plan"]
    lines = [
        f"inferctx model parallel: {doc['world_size']} rank(s), {r0['dtype']}, "
        f"x[{r0['tokens']}, {r0['in_features']}] @ W[{r0['in_features']}, {r0['out_features']}], "
        f"row-parallel over heads ({plan['heads_per_rank']} per rank), {len(r0['timeline'])} steps",
    ]
    for r in ranks:
        p = r["plan"]
        lines += [
            f"rank {r['rank']} (cuda:{r['device']}, {r['gpu']}): rows {r['shard'][0]}:{r['shard'][1]} "
            f"of W; plan mp {p['mp_size']} rank {p['rank']}: {p['heads_per_rank']} heads, "
            f"{p['kv_heads_per_rank']} KV heads, max_tokens {p['max_tokens']}, workspace "
            f"{p['workspace_bytes'] / 2**20:.1f} MiB",
            f"  {'step':>4}  {'compute ms':>17}  {'all-reduce ms':>17}  {'use ms':>17}  overlap with next compute",
        ]
        for s, o in zip(r["timeline"], r["overlap_ms"] + [None]):
            c, a, u = s["compute"], s["allreduce"], s["use"]
            lines.append(f"  {s['step']:>4}  {c[0]:>8.3f}-{c[1]:<8.3f}  {a[0]:>8.3f}-{a[1]:<8.3f}  "
                         f"{u[0]:>8.3f}-{u[1]:<8.3f}  " + ("-" if o is None else f"{o:.3f} ms"))
        lines += [
            f"  result vs float32 x @ W: max abs err {r['max_abs_err']:.3g} (atol {r['atol']}, "
            f"rtol {r['rtol']}): {'OK' if r['matches_reference'] else 'MISMATCH'}",
            "  stream order (all-reduce after its GEMM, use after its all-reduce): "
            + ("OK" if r["ordered"] else "VIOLATED: " + "; ".join(r["violations"])),
            f"  all-reduce t overlapping compute t+1: {r['overlap_steps']}/{len(r['overlap_ms'])} "
            f"steps, {r['overlap_total_ms']:.3f} of {r['allreduce_total_ms']:.3f} ms all-reduce; "
            f"total {r['total_ms']:.3f} ms",
        ]
    one_step = all(not r["overlap_ms"] for r in ranks)  # no step t+1 to overlap with
    lines.append(f"overall: {'OK' if doc['ok'] else 'FAILED'}"
                 + ("" if doc["overlap_observed"] or doc["world_size"] == 1 or one_step else
                    " (no overlap observed)"))
    return "\n".join(lines)


def _document(world: int, ranks: list[dict]) -> dict:
    plans = [{k: v for k, v in r["plan"].items() if k != "rank"} for r in ranks]
    return {
        "world_size": world,
        "ok": all(r["matches_reference"] and r["ordered"] for r in ranks),
        "matches_reference": all(r["matches_reference"] for r in ranks),
        "ordered": all(r["ordered"] for r in ranks),
        "overlap_observed": all(r["overlap_observed"] for r in ranks),
        "plans_identical": all(p == plans[0] for p in plans),
        "ranks": ranks,
    }


def _emit(doc: dict, as_json: bool) -> int:
    print(json.dumps(doc) if as_json else _summary(doc), flush=True)
    return 0 if doc["ok"] else 1


class _Usage(Exception):
    """A usage error: one line on stderr, exit status 2."""


def _env_int(name: str, minimum: int) -> int:
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise _Usage(f"torchrun's {name}={text!r} is not an integer >= {minimum}")
    return value


def _setup(args: argparse.Namespace, torch) -> tuple:
    """(torchrun, world, rank, local_rank) after the checks that need no process group."""
    torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    available = torch.cuda.device_count()
    if available == 0:
        raise _Usage("no CUDA device visible: this example needs at least one GPU")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        raise _Usage("this torch has no NCCL (torch.distributed.is_nccl_available() is False); the "
                     "example runs its all-reduce over NCCL only")
    if torchrun:
        world, rank, local = (_env_int("WORLD_SIZE", 1), _env_int("RANK", 0), _env_int("LOCAL_RANK", 0))
        if args.world_size not in (None, world):
            raise _Usage(f"--world-size {args.world_size} differs from torchrun's WORLD_SIZE={world}")
        if rank >= world:
            raise _Usage(f"torchrun's RANK={rank} is not below its WORLD_SIZE={world}")
        if local >= available:
            raise _Usage(f"torchrun's LOCAL_RANK={local} needs {local + 1} GPU(s); {available} visible")
    else:
        world, rank, local = args.world_size or available, 0, 0
        if world > available:
            raise _Usage(f"--world-size {world} needs {world} GPU(s); {available} visible")
    if args.heads % world:
        whence = ("torchrun's WORLD_SIZE" if torchrun else "--world-size" if args.world_size
                  else "every visible GPU, the default; pass --world-size")
        raise _Usage(f"--heads {args.heads} is not divisible by the world size {world} ({whence})")
    return torchrun, world, rank, local


def _run(args: argparse.Namespace, torchrun: bool, world: int, rank: int, local: int) -> int:
    if torchrun:
        out = run_rank(rank, world, args, "env://", device=local)
        doc = _document(world, out["ranks"])
        if rank != 0:
            return 0 if doc["ok"] else 1
        return _emit(doc, args.json)

    init_method = f"tcp://127.0.0.1:{free_port()}"
    if world == 1 and not args.spawn:
        out = run_rank(0, 1, args, init_method)
        return _emit(_document(1, out["ranks"]), args.json)

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "ranks.json")
        mp.spawn(_spawned, args=(world, args, init_method, report_path), nprocs=world, join=True)
        with open(report_path) as f:
            ranks = json.load(f)
    return _emit(_document(world, ranks), args.json)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(f"this example needs torch (with CUDA and NCCL): {exc}", file=sys.stderr)
        return 2
    try:
        torchrun, world, rank, local = _setup(args, torch)
    except _Usage as exc:
        print(exc, file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    import inferctx

    try:
        return _run(args, torchrun, world, rank, local)
    except (inferctx.InferCtxError, RuntimeError, ValueError) as exc:  # torch.OutOfMemoryError too
        # A rank that could not run: out of memory, a workspace that does not fit, a process
        # group that cannot start (torchrun without MASTER_ADDR, a port taken).
        print(f"rank {rank}: {type(exc).__name__}: {_last_line(str(exc))}", file=sys.stderr)
        return 3
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        # A spawned rank failed; its traceback is in the message: its last line says what.
        print(f"a spawned rank failed: {_last_line(str(exc))}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())

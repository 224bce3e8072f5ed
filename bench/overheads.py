"""Overheads of the context's hot paths, from Python, against PyTorch where it has an equivalent.

Measured in one run on one device (medians of per-call times, after warm-up):

* ``advance_tokens()`` (target <= 0.1 us) and ``increment_offset(4)`` (<= 0.2 us): no torch
  equivalent;
* ``sync_comp()`` against torch's ``Event.record(s1)`` + ``s2.wait_event(e)``, the pair it stands
  for (target <= 0.5x torch's time);
* ``torch.from_dlpack(ctx.kv_cache(0)[0])`` (two views made, one exported with the stream
  handshake, imported by torch; target <= 3 us), shown beside ``torch.empty`` of the same size;
* ``gen_workspace`` with the same arguments when the allocation already fits (<= 20 us);
* ``release_workspace()`` + ``retake_workspace()`` of a ~100 GiB workspace (llama-2-70b, batch 64,
  capped at 100 GiB with memory_limit_bytes), beside torch freeing and allocating the same bytes
  (``del``, ``empty_cache()``, ``torch.empty``); no target. Skipped with --skip-100g or when the
  device has less than 110 GiB free.

Times include the Python call and the loop around it (about 0.01-0.02 us per iteration), as a
caller sees them. The table comes last; --json writes the same figures.

    python bench/overheads.py [--device 0] [--repeat 31] [--skip-100g] [--json overheads.json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time

from _cli import at_least, json_path  # bench/, the script's folder

GIB = 1 << 30
SHAPE_SMALL = dict(num_layers=4, num_heads=8, hidden_dim=512, num_kv_heads=2)
# max_out_tokens leaves room for the advance_tokens loops between resets.
REQUEST_SMALL = dict(batch_size=1, prompt_len=16, max_out_tokens=4096, dtype="float16")
REQUEST_100G = dict(batch_size=64, prompt_len=128, max_out_tokens=4096, dtype="float16",
                    memory_limit_bytes=100 * GIB)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=31, help="samples per measurement (median taken)")
    ap.add_argument("--skip-100g", action="store_true", help="skip the 100 GiB release/retake")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    at_least(ap, "--repeat", args.repeat, 1)
    json_path(ap, args.json)
    return args


def per_call_us(loop, number, repeat, setup=None):
    """Median over `repeat` samples of the time per iteration of loop(number), in us."""
    if setup:
        setup()
    loop(min(number, 100))  # warm-up
    samples = []
    for _ in range(repeat):
        if setup:
            setup()
        start = time.perf_counter_ns()
        loop(number)
        samples.append((time.perf_counter_ns() - start) / number / 1e3)
    return statistics.median(samples)


def paired_per_call_us(loops, number, repeat):
    """per_call_us of each loop in `loops` (name -> loop), measured in alternating rounds whose
    order rotates, so that a drift of the host's speed falls on every loop alike."""
    names = list(loops)
    for name in names:
        loops[name](min(number, 100))  # warm-up
    samples = {name: [] for name in names}
    for r in range(repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter_ns()
            loops[name](number)
            samples[name].append((time.perf_counter_ns() - start) / number / 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


class Row:
    def __init__(self, op, ours, torch_us=None, torch_op=None, target=None, limit=None,
                 relative=False):
        self.op, self.ours, self.torch, self.torch_op = op, ours, torch_us, torch_op
        self.ratio = ours / torch_us if torch_us else None
        self.target = target
        if limit is None:
            self.passed = None
        elif relative:
            self.passed = self.ratio is not None and self.ratio <= limit
        else:
            self.passed = ours <= limit

    def as_dict(self):
        return {"op": self.op, "ours_us": self.ours, "torch_us": self.torch,
                "torch_op": self.torch_op, "ratio": self.ratio, "target": self.target,
                "pass": self.passed}


def bench_small(ctx, torch, repeat):
    from inferctx import ModelShape

    shape = ModelShape(**SHAPE_SMALL)
    ctx.gen_workspace(shape, **REQUEST_SMALL)
    rows = []

    advance = ctx.advance_tokens

    def loop_advance(n):
        for _ in range(n):
            advance()

    us = per_call_us(loop_advance, 2000, repeat, setup=lambda: ctx.reset_tokens(0))
    rows.append(Row("advance_tokens()", us, target="<= 0.1 us", limit=0.1))

    increment = ctx.increment_offset

    def loop_increment(n):
        for _ in range(n):
            increment(4)

    us = per_call_us(loop_increment, 10000, repeat)
    rows.append(Row("increment_offset(4)", us, target="<= 0.2 us", limit=0.2))

    sync = ctx.sync_comp

    def loop_sync(n):
        for _ in range(n):
            sync()

    loops = {"ours": loop_sync}
    if torch is not None:
        s1, s2, event = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Event()
        # Bound once, as ours is: the loops differ by the calls, not by attribute lookups (ours is
        # one Python call against torch's two for the same record and wait).
        record, wait = event.record, s2.wait_event

        def loop_torch_pair(n):
            for _ in range(n):
                record(s1)
                wait(event)

        # In turns: the target is a ratio, and the two loops would otherwise see the host at
        # different moments.
        loops["torch"] = loop_torch_pair
    both = paired_per_call_us(loops, 2000, repeat)
    ours, theirs = both["ours"], both.get("torch")
    rows.append(Row("sync_comp()", ours, theirs, "Event.record + Stream.wait_event",
                    "<= 0.5x torch", 0.5, relative=True))
    ctx.stream.synchronize()
    ctx.comm_stream.synchronize()

    if torch is not None:
        kv_cache, from_dlpack = ctx.kv_cache, torch.from_dlpack

        def loop_export(n):
            for _ in range(n):
                from_dlpack(kv_cache(0)[0])

        ours = per_call_us(loop_export, 2000, repeat)
        k = ctx.kv_cache(0)[0]
        size, device = k.shape, torch.device("cuda", ctx.device)
        del k
        empty, fp16 = torch.empty, torch.float16

        def loop_empty(n):
            for _ in range(n):
                empty(size, dtype=fp16, device=device)

        theirs = per_call_us(loop_empty, 2000, repeat)
        rows.append(Row("torch.from_dlpack(kv_cache(0)[0])", ours, theirs, "torch.empty (same size)",
                        "<= 3 us", 3.0))
        torch.cuda.synchronize()

        # Where the time goes: the views alone, and the export alone (stream handshake included).
        def loop_views(n):
            for _ in range(n):
                kv_cache(0)

        rows.append(Row("  of which kv_cache(0)", per_call_us(loop_views, 2000, repeat)))
        consumer = torch.cuda.current_stream().cuda_stream or 1
        k0 = kv_cache(0)[0]
        export = k0.__dlpack__

        def loop_capsule(n):
            for _ in range(n):
                export(stream=consumer)

        rows.append(Row("  of which __dlpack__(stream=torch's)", per_call_us(loop_capsule, 2000, repeat)))
        del k0, export

        # An engine that runs torch and the context on one stream needs no handshake.
        ctx.use_stream(torch.cuda.current_stream())
        try:
            same = per_call_us(loop_export, 2000, repeat)
        finally:
            ctx.use_stream(None)
        rows.append(Row("  same, ctx.use_stream(torch's stream)", same, theirs, "torch.empty (same size)",
                        "<= 3 us", 3.0))
        torch.cuda.synchronize()

    gen = ctx.gen_workspace

    def loop_gen(n):
        for _ in range(n):
            gen(shape, **REQUEST_SMALL)

    us = per_call_us(loop_gen, 200, repeat)
    rows.append(Row("gen_workspace (allocation fits)", us, target="<= 20 us", limit=20.0))
    return rows


def bench_100g(ctx, torch, repeat):
    gc.collect()
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    plan = ctx.gen_workspace("llama-2-70b", **REQUEST_100G)
    print(f"100 GiB case: {plan.workspace_bytes / GIB:.2f} GiB workspace, {plan.max_tokens} tokens "
          f"(bound by {plan.bound_by})", file=sys.stderr)
    release, retake = ctx.release_workspace, ctx.retake_workspace

    def loop_cycle(n):
        for _ in range(n):
            release()
            if not retake():
                raise MemoryError("retake_workspace failed: out of memory")

    samples = max(3, repeat // 6)
    ours = per_call_us(loop_cycle, 1, samples)
    theirs = None
    if torch is not None:
        nbytes = plan.workspace_bytes
        ctx.release_workspace()
        state = {"x": torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", ctx.device))}

        def loop_torch_cycle(n):
            for _ in range(n):
                del state["x"]
                torch.cuda.empty_cache()
                state["x"] = torch.empty(nbytes, dtype=torch.uint8,
                                         device=torch.device("cuda", ctx.device))
            torch.cuda.synchronize()

        theirs = per_call_us(loop_torch_cycle, 1, samples)
        del state["x"]
        torch.cuda.empty_cache()
        ctx.retake_workspace()
    row = Row(f"release + retake ({plan.workspace_bytes / GIB:.0f} GiB)", ours, theirs,
              "del + empty_cache + torch.empty", "-")
    # Back to a small workspace (a fitting allocation would be kept) for what runs next.
    ctx.release_workspace()
    ctx.gen_workspace("llama-2-70b", batch_size=1, prompt_len=16, max_out_tokens=64)
    return [row]


def fmt(value, digits=3):
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if value < 1000 else f"{value:,.0f}"


def print_table(rows):
    header = ("op", "ours us", "torch us", "ratio", "target", "pass", "torch op")
    lines = [(r.op, fmt(r.ours), fmt(r.torch), fmt(r.ratio, 2), r.target or "-",
              {True: "PASS", False: "FAIL", None: "-"}[r.passed], r.torch_op or "-") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    for line in (header, *lines):
        print("  ".join(str(x).ljust(w) if i in (0, 4, 6) else str(x).rjust(w)
                        for i, (x, w) in enumerate(zip(line, widths))).rstrip())


def main(argv=None):
    args = parse_args(argv)
    from inferctx import NoCudaDeviceError, _core
    from inferctx.context import InferenceContext

    try:
        ctx = InferenceContext.instance(args.device)
    except NoCudaDeviceError as exc:
        print(f"bench/overheads.py needs a GPU: {exc}", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        torch = None
        print("torch is not installed: the torch columns stay empty", file=sys.stderr)
    if torch is not None:
        torch.cuda.set_device(args.device)
        torch.cuda.init()

    rows = bench_small(ctx, torch, args.repeat)
    free = _core._memory_info(ctx.device)[0]
    if args.skip_100g:
        print("100 GiB release/retake skipped (--skip-100g)", file=sys.stderr)
    elif free < 110 * GIB:
        print(f"100 GiB release/retake skipped: {free / GIB:.1f} GiB free", file=sys.stderr)
    else:
        rows += bench_100g(ctx, torch, args.repeat)

    gpu = torch.cuda.get_device_name(ctx.device) if torch is not None else f"cuda:{ctx.device}"
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__ if torch is not None else None,
        "command": " ".join(["python", "bench/overheads.py", *(argv if argv is not None else sys.argv[1:])]),
        "repeat": args.repeat,
    }
    print(f"{meta['gpu']}, Python {meta['python']}, torch {meta['torch']}, {meta['date']}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": [r.as_dict() for r in rows]}, f, indent=2)
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

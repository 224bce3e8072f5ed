"""Dropout captured into a CUDA graph: replay time against the eager call and against torch's
graph-safe ``native_dropout`` captured the same way, in one run.

For each input size and dtype, and for graphs of 1 and of 32 dropout calls (a decode step of a
32-layer model draws once per layer), on torch tensors and torch's current stream:

* "ours eager": ``inferctx.dropout(x, p, out=y, mask_out=m)`` called directly (host
  ``increment_offset(4)``, one capture query);
* "ours graph": the same calls captured by ``torch.cuda.graph`` and replayed with
  ``CUDAGraph.replay()``: each call site reads its Philox state from device memory and the last
  of its blocks to do so advances its replay counter (docs/graphs.md);
* "torch eager" / "torch graph": ``torch.ops.aten.native_dropout(x, p, True)`` called directly,
  and captured and replayed the same way (torch reads its seed and offset from tensors it fills
  before each replay); eager torch's results are kept for as many steps as there are buffer sets
  (a graph keeps its own), so that each call writes an output and a mask of its own, rotated as
  ours are.

Every figure is device time per dropout call: each call (or replay) is timed alone between CUDA
events after warm-up, with the stream first held by a sleep kernel so that host launch overhead
does not show; the median of the samples, divided by the calls in the graph. Inputs that fit in
L2 are rotated over several buffer sets (their inputs 3x L2 in all) so that every call reads memory
that is not in L2. Host figures (``ctx.increment_offset(4)``, the capture query, one eager call)
are medians of loops of Python calls.

Before a size is timed, a replay of its first graph is checked (bench/_checks.py): every output is
``x * mask / (1 - p)`` bit for bit under the mask the replay wrote (outputs filled with NaN and
masks with all-ones first), and a second replay draws other masks; a wrong result stops the run
with exit status 1. A size whose rotation needs more than 4096 buffer sets (graphs of one call
of a few tens of KiB, by the device's L2) is skipped, saying so.

    python bench/graph_dropout.py [--p 0.1] [--sizes-kib 64 1024 16384 262144]
                                  [--dtypes float16 float32] [--calls 1 32] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

from _cli import at_least, drop_probability, json_path  # bench/, the script's folder
from _checks import dropout_mismatch, keep_from_bits
from _host_timing import host_us_interleaved

KIB = 1 << 10


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--p", type=float, default=0.1, help="drop probability (default 0.1)")
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 1024, 16384, 262144],
                    help="input sizes in KiB (default 64 KiB .. 256 MiB)")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "float32"],
                    choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--calls", type=int, nargs="+", default=[1, 32], help="dropout calls per graph")
    ap.add_argument("--max-step-mib", type=int, default=2048,
                    help="skip graphs whose inputs exceed this in all (default 2048)")
    ap.add_argument("--iters", type=int, default=0, help="timed replays per variant (default: by size)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    drop_probability(ap, args.p)
    # Below 4 KiB a graph of one call would need more than 38,000 buffer sets (captures) to
    # rotate 3x L2.
    at_least(ap, "--sizes-kib", args.sizes_kib, 4)
    at_least(ap, "--calls", args.calls, 1)
    at_least(ap, "--max-step-mib", args.max_step_mib, 1)
    at_least(ap, "--iters", args.iters, 0)
    at_least(ap, "--warmup", args.warmup, 0)
    json_path(ap, args.json)
    return args


class Timer:
    """Per-call device times between CUDA events, with the queue filled before the GPU starts."""

    def __init__(self, torch):
        self.torch = torch
        self.sleep = getattr(torch.cuda, "_sleep", None)
        self.cycles_per_ms = self._calibrate() if self.sleep else 0.0

    def _calibrate(self) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 5_000_000
        self.sleep(cycles)
        torch.cuda.synchronize()
        start.record()
        self.sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        return cycles / max(start.elapsed_time(end), 1e-3)

    def run(self, fn, iters: int, warmup: int, launches: int = 1, distinct: int = 1) -> list[float]:
        """Per-call times in ms; fn(i) is one call (or replay) on the current stream, queuing
        `launches` kernels or graph launches; fn(0..distinct-1) are all different (each graph of
        a rotation), and each runs once before timing, so no timed replay is a graph's first."""
        torch = self.torch
        for i in range(max(warmup, distinct)):
            fn(i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(3):
            fn(i)
        host_ms = (time.perf_counter() - t0) * 1e3 / 3
        torch.cuda.synchronize()
        # A stream queues about a thousand commands before the host blocks on a launch: past
        # that, the timed calls would run at the host's pace. So the calls are timed in parts of
        # at most 900 commands (the calls' launches and their two events), each behind a hold.
        per_part = max(1, 900 // (launches + 2))
        times: list[float] = []
        for first in range(0, iters, per_part):
            part = range(first, min(iters, first + per_part))
            starts = [torch.cuda.Event(enable_timing=True) for _ in part]
            ends = [torch.cuda.Event(enable_timing=True) for _ in part]
            if self.sleep:
                hold_ms = min(1000.0, 1.5 * len(part) * (host_ms + 0.02) + 1.0)
                self.sleep(int(hold_ms * self.cycles_per_ms))
            for j, i in enumerate(part):
                starts[j].record()
                fn(i)
                ends[j].record()
            torch.cuda.synchronize()
            times += [s.elapsed_time(e) for s, e in zip(starts, ends)]
        return times


def default_iters(nbytes: int) -> int:
    if nbytes <= 16 << 20:
        return 200
    if nbytes <= 256 << 20:
        return 40
    return 10


# The most buffer sets a size may need: each is one capture of ours and one of torch's, and each
# of torch's captures holds a segment of its own private pool (2 MiB or more), so tens of
# thousands (4 KiB, N=1: about 38,000) would fill the device before any timing.
MAX_SETS = 4096


def buffer_sets(torch, nbytes: int, dtype, calls: int) -> int:
    """Buffer sets to rotate so that a graph's inputs are not in L2 when it replays: the inputs of
    all sets together 3x L2 (each set is a graph of its own; the small sizes need hundreds)."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    per_set = nbytes * calls  # the inputs a set's calls read (its outputs and masks come on top)
    return max(1, -(-3 * l2 // max(per_set, 1)))


def capture(torch, fn):
    """A CUDAGraph of fn() after a warm-up on a side stream (torch's advice)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def host_figures(torch, inferctx, ctx, p, loops=20000, reps=15):
    """Host microseconds per call: ctx.increment_offset(4), the capture query the eager path adds,
    and a whole eager dropout on a 4 KiB tensor (GPU kept busy so only issuing is timed)."""
    from inferctx import _core

    handle = torch.cuda.current_stream().cuda_stream
    device = ctx.device

    def per_call(fn, n):
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            samples.append((time.perf_counter_ns() - t0) / n / 1e3)
        return statistics.median(samples)

    empty = per_call(lambda: None, loops)
    inc = per_call(lambda: ctx.increment_offset(4), loops) - empty
    query = per_call(lambda: _core._stream_capturing(handle, device), loops) - empty
    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    m = torch.empty(32, dtype=torch.int32, device="cuda")

    def call():
        inferctx.dropout(x, p, out=y, mask_out=m)

    # Each loop of 500 calls runs behind its own hold of 25 ms of GPU time (50 us a call), so the
    # loop only issues: one hold for all the loops would queue several thousand launches behind it,
    # more than a stream takes before the host blocks, and later loops would run beside an idle GPU.
    eager = host_us_interleaved(torch, {"eager": call}, calls=500, reps=reps, slack_us=50.0)["eager"] - empty
    return {"increment_offset_us": inc, "capture_query_us": query, "eager_dropout_call_us": eager}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import inferctx

    if not torch.cuda.is_available():
        print("graph_dropout.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.cuda.set_device(args.device)
    ctx = inferctx.InferenceContext.instance(args.device)
    ctx.set_seed(0)
    timer = Timer(torch)
    native = torch.ops.aten.native_dropout
    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    rows = []
    for dname in args.dtypes:
        dt = dtypes[dname]
        esize = torch.tensor([], dtype=dt).element_size()
        for kib in args.sizes_kib:
            nbytes = kib * KIB
            n = nbytes // esize
            words = -(-n // 32)
            for calls in args.calls:
                if calls > 1 and nbytes * calls > args.max_step_mib << 20:
                    continue
                sets = buffer_sets(torch, nbytes, dt, calls)
                if sets > MAX_SETS:  # each set is two captures; torch's hold a pool segment each
                    print(f"# {dname} {kib} KiB N={calls}: rotating 3x L2 needs {sets} graph sets "
                          f"(more than {MAX_SETS}); skipped", file=sys.stderr)
                    continue
                # Every set once at least: the calls timed cover more than 3x L2.
                iters = max(args.iters or default_iters(nbytes * calls), sets)
                bufs = []
                for _ in range(sets):
                    xs = [torch.randn(n, device="cuda").to(dt) for _ in range(calls)]
                    ys = [torch.empty_like(x) for x in xs]
                    ms = [torch.empty(words, dtype=torch.int32, device="cuda") for _ in range(calls)]
                    bufs.append((xs, ys, ms))

                def ours(b):
                    xs, ys, ms = b
                    for x, y, m in zip(xs, ys, ms):
                        inferctx.dropout(x, args.p, out=y, mask_out=m)

                def theirs(b):
                    # The results stay alive until the step ends, so that each call writes its own
                    # output and mask, as ours do (out=, mask_out=): a result dropped at once gives
                    # its memory to the next call, whose writes then land on lines still in L2.
                    return [native(x, args.p, True) for x in b[0]]

                ours_graphs = [capture(torch, lambda b=b: ours(b)) for b in bufs]
                torch_graphs = [capture(torch, lambda b=b: theirs(b)) for b in bufs]
                # What is timed, checked first (bench/_checks.py): a replay of the first set's graph
                # writes each y and mask (filled with NaN and all-ones before) as the eager call
                # does, and a second replay draws other masks.
                xs0, ys0, ms0 = bufs[0]
                for y, m in zip(ys0, ms0):
                    y.fill_(float("nan"))
                    m.fill_(-1)
                ours_graphs[0].replay()
                first = [m.clone() for m in ms0]
                for x, y, m in zip(xs0, ys0, ms0):
                    bad = dropout_mismatch(torch, x, y, keep_from_bits(torch, m, n), args.p)
                    if bad:
                        sys.exit(f"graph_dropout.py: {dname} {kib} KiB N={calls}, a replay: {bad}; "
                                 f"nothing is timed")
                ours_graphs[0].replay()
                if any(torch.equal(before, m) for before, m in zip(first, ms0)):
                    sys.exit(f"graph_dropout.py: {dname} {kib} KiB N={calls}: two replays drew the "
                             f"same mask; nothing is timed")
                del xs0, ys0, ms0, first, x, y, m
                # Eager torch's results of the last `sets` steps are kept, so that its writes rotate
                # over as many outputs and masks as ours do (a step's results dropped at once give
                # their blocks to the next step, which would rewrite lines still in L2).
                ring = [None] * sets

                def theirs_kept(i):
                    ring[i % sets] = theirs(bufs[i % sets])  # the new step's blocks, then the old freed

                variants = {
                    "ours eager": lambda i: ours(bufs[i % sets]),
                    "ours graph": lambda i: ours_graphs[i % sets].replay(),
                    "torch eager": theirs_kept,
                    "torch graph": lambda i: torch_graphs[i % sets].replay(),
                }
                # Commands each call queues on the stream: a replay of ours is one graph launch;
                # torch's replay first refills its generator's seed and offset tensors (two fill
                # kernels) and then launches the graph.
                launches = {"ours eager": calls, "ours graph": 1, "torch eager": calls, "torch graph": 3}
                us = {}
                for name, fn in variants.items():
                    samples = timer.run(fn, iters, args.warmup, launches=launches[name], distinct=sets)
                    us[name] = statistics.median(samples) * 1e3 / calls
                row = dict(dtype=dname, input_bytes=nbytes, calls_per_graph=calls, p=args.p,
                           iters=iters, buffer_sets=sets,
                           ours_eager_us=us["ours eager"], ours_graph_us=us["ours graph"],
                           torch_eager_us=us["torch eager"], torch_graph_us=us["torch graph"],
                           graph_vs_eager=us["ours graph"] / us["ours eager"],
                           graph_vs_torch_graph=us["ours graph"] / us["torch graph"])
                rows.append(row)
                del ours_graphs, torch_graphs, bufs, ring
                torch.cuda.synchronize()
    host = host_figures(torch, inferctx, ctx, args.p)

    print(f"# {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}, p = {args.p}; "
          f"device us per dropout call (median), graphs of N calls")
    header = (f"{'dtype':9} {'size':>9} {'N':>3} {'ours eager':>11} {'ours graph':>11} "
              f"{'torch eager':>12} {'torch graph':>12} {'graph/eager':>12} {'ours/torch graph':>17}")
    print(header)
    print("-" * len(header))
    for r in rows:
        size = f"{r['input_bytes'] // KIB} KiB" if r["input_bytes"] < (1 << 20) else \
            f"{r['input_bytes'] >> 20} MiB"
        print(f"{r['dtype']:9} {size:>9} {r['calls_per_graph']:>3} {r['ours_eager_us']:>11.2f} "
              f"{r['ours_graph_us']:>11.2f} {r['torch_eager_us']:>12.2f} {r['torch_graph_us']:>12.2f} "
              f"{r['graph_vs_eager']:>12.3f} {r['graph_vs_torch_graph']:>17.3f}")
    print(f"# host: increment_offset(4) {host['increment_offset_us']:.3f} us, capture query "
          f"{host['capture_query_us']:.3f} us, eager dropout call {host['eager_dropout_call_us']:.2f} us "
          f"(Python calls, loop overhead removed)")
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(args.device), torch=torch.__version__,
                    python=platform.python_version(), inferctx=getattr(inferctx, "__version__", "?"),
                    date=time.strftime("%Y-%m-%d %H:%M:%S"), argv=sys.argv[1:])
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows, host=host), f, indent=2)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

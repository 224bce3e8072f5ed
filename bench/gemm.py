"""inferctx.gemm / bmm against torch.matmul on the same tensors, in one run on one GPU.

Shapes (M x N x K, row-major: a is M x K, b is K x N):
  * square: 8192^3 in bf16 and fp16;
  * decode: M in {1, 8, 32, 128} x (K, N) in {(4096, 4096), (4096, 14336), (8192, 8192)}, bf16;
  * attention: batch*heads = 256, Q K^T (128 x 2048 x 128, b transposed) and P V
    (128 x 128 x 2048), bf16.
For each: device time of torch.matmul(out=), of inferctx untuned (the default: cublasGemmEx,
torch.matmul's own call) and after autotune_gemm, as TFLOP/s (GB/s of weights read for the
memory-bound decode shapes). Targets: default/torch <= 1.02 on every shape; tuned/torch
geometric mean <= 0.99. Then the host time per call, as a user calls it (no out=: the result
comes from torch's caching allocator) and with out=, of gemm and torch.matmul on small shapes.

Method: both libraries run on one torch stream, the caller's current one (inferctx's default
under its call contract); device time from CUDA events around back-to-back calls queued behind a spin
kernel (so launch overhead is not measured as device time), after warm-up, median of
repetitions, the two libraries interleaved (in alternating order, after a warm-up of the
GPU); operands are fresh uniform random values, rotated
among enough copies to exceed L2 for small shapes; the first result of each library (its
output poisoned with NaN before the call) is compared with the other's. Prints a compact
table last; --json writes every figure.

With --host-only, only the host times, with two allocation-only rows beside them: torch's
`Tensor.new_empty` and `torch._C._dynamo.guards._empty_strided_cuda` (what the compiled torch
path makes a plain result with, where torch has it) of the same result, so that the share of the
plain call's host time that is the allocation shows.

    python bench/gemm.py [--json out.json] [--quick] [--no-tune] [--host-only]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import statistics
import sys
import time

import torch

from _cli import json_path  # bench/, the script's folder
from _host_timing import host_us_interleaved, ratio_spread

import inferctx  # noqa: F401  (loads cuBLAS first)
from inferctx import _core

G = importlib.import_module("inferctx.gemm")


# ---------------------------------------------------------------------------------------
# Cases


class Case:
    def __init__(self, group, dtype, m, n, k, batch=1, trans_b=False):
        self.group, self.dtype = group, dtype
        self.m, self.n, self.k, self.batch, self.trans_b = m, n, k, batch, trans_b

    @property
    def name(self):
        shape = f"{self.m}x{self.n}x{self.k}"
        if self.batch > 1:
            shape = f"{self.batch}x" + shape
        return f"{self.group} {shape}" + (" (b^T)" if self.trans_b else "")

    @property
    def flops(self):
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def weight_bytes(self):
        return self.batch * self.k * self.n * torch.finfo(self.torch_dtype).bits // 8

    @property
    def memory_bound(self):
        return self.group == "decode"

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)

    @property
    def tune_shape(self):
        return (self.batch, self.m, self.n, self.k)


def cases():
    out = [Case("square", dt, 8192, 8192, 8192) for dt in ("bfloat16", "float16")]
    for k, n in ((4096, 4096), (4096, 14336), (8192, 8192)):
        for m in (1, 8, 32, 128):
            out.append(Case("decode", "bfloat16", m, n, k))
    out.append(Case("attn QK^T", "bfloat16", 128, 2048, 128, batch=256, trans_b=True))
    out.append(Case("attn PV", "bfloat16", 128, 128, 2048, batch=256))
    return out


# ---------------------------------------------------------------------------------------
# Timing


class Timer:
    """Device time of queued calls: a spin kernel first, so that the host can queue the whole
    batch before the GPU reaches it, then events around the calls."""

    def __init__(self, reps):
        self.reps = reps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        cycles = 2_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.cycles_per_us = cycles / (start.elapsed_time(end) * 1e3)

    def spin(self, us):
        torch.cuda._sleep(int(us * self.cycles_per_us))

    def one(self, fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.spin(200)
        start.record()
        fn(0)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def compare(self, fns, sets):
        """Median milliseconds per call of each function, measured interleaved."""
        for fn in fns:
            for i in range(3):
                fn(i % sets)
        torch.cuda.synchronize()
        estimate = max(min(self.one(fn) for _ in range(3)) for fn in fns)
        runs = int(min(200, max(5, math.ceil(1.0 / max(estimate, 1e-3)))))
        # The spin before each block must outlast the host's queueing of the block, or the GPU
        # catches up with the host and the block times the host: 1.5x the slowest function's
        # host time per call (at least 20 us; hosts have taken 12-25 us per call).
        host_us = 0.0
        for fn in fns:
            self.spin(2000.0)
            t0 = time.perf_counter()
            for i in range(10):
                fn(i % sets)
            host_us = max(host_us, (time.perf_counter() - t0) / 10 * 1e6)
        torch.cuda.synchronize()
        per_call_us = max(20.0, 1.5 * host_us)
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(self.reps)] for _ in fns]
        turn = 0
        for rep in range(self.reps):
            # The order alternates: the block right after the idle spin runs at the clocks the
            # pause restored, which would favour whichever always came first.
            order = list(enumerate(fns)) if rep % 2 == 0 else list(enumerate(fns))[::-1]
            for f, fn in order:
                start, end = events[f][rep]
                self.spin(per_call_us * runs + 50.0)
                start.record()
                for _ in range(runs):
                    fn(turn % sets)
                    turn += 1
                end.record()
        torch.cuda.synchronize()
        return [statistics.median(s.elapsed_time(e) / runs for s, e in per) for per in events]


def warm_up_gpu(seconds=3.0):
    """Runs large products for a while, so that the first case is timed at the clocks and
    temperature the later ones see."""
    x = torch.empty((8192, 8192), dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            torch.matmul(x, x)
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------
# The run


def operand_sets(case, l2_bytes):
    """Enough (a, b) copies that cycling through them does not run from L2."""
    dt = case.torch_dtype
    size = torch.finfo(dt).bits // 8
    per_set = case.batch * (case.m * case.k + case.k * case.n) * size
    free, _ = torch.cuda.mem_get_info()
    sets = max(1, min(32, math.ceil(2.5 * l2_bytes / per_set)))
    while sets > 1 and sets * per_set > free // 3:
        sets -= 1
    a_shape = (case.m, case.k) if case.batch == 1 else (case.batch, case.m, case.k)
    b_mat = (case.n, case.k) if case.trans_b else (case.k, case.n)
    b_shape = b_mat if case.batch == 1 else (case.batch,) + b_mat
    a = [torch.empty(a_shape, dtype=dt, device="cuda").uniform_(-1, 1) for _ in range(sets)]
    b = [torch.empty(b_shape, dtype=dt, device="cuda").uniform_(-1, 1) for _ in range(sets)]
    c_shape = (case.m, case.n) if case.batch == 1 else (case.batch, case.m, case.n)
    return a, b, torch.empty(c_shape, dtype=dt, device="cuda"), sets


def functions(case, a, b, c):
    if case.batch == 1:
        if case.trans_b:
            def ours(i):
                G.gemm(a[i], b[i], out=c, trans_b=True)

            def theirs(i):
                torch.matmul(a[i], b[i].T, out=c)
        else:
            def ours(i):
                G.gemm(a[i], b[i], out=c)

            def theirs(i):
                torch.matmul(a[i], b[i], out=c)
    else:
        if case.trans_b:
            def ours(i):
                G.bmm(a[i], b[i], out=c, trans_b=True)

            def theirs(i):
                torch.matmul(a[i], b[i].transpose(1, 2), out=c)
        else:
            def ours(i):
                G.bmm(a[i], b[i], out=c)

            def theirs(i):
                torch.matmul(a[i], b[i], out=c)
    return ours, theirs


def relative_difference(x, y):
    x, y = x.float(), y.float()
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def rate(case, ms):
    if case.memory_bound:
        return case.weight_bytes / (ms * 1e-3) / 1e9, "GB/s"
    return case.flops / (ms * 1e-3) / 1e12, "TFLOP/s"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-tune", action="store_true", help="skip autotuning")
    parser.add_argument("--host-only", action="store_true",
                        help="only the host times, with the allocation alone beside them")
    args = parser.parse_args(argv)
    json_path(parser, args.json)
    if args.host_only:
        args.no_tune = True

    device = 0
    torch.cuda.set_device(device)
    props = torch.cuda.get_device_properties(device)
    l2_bytes = getattr(props, "L2_cache_size", 60 << 20) or (60 << 20)
    stream = torch.cuda.Stream(device)
    timer = Timer(reps=7 if args.quick else 15)
    results, host, spread, host_mismatches = [], {}, {}, []
    with torch.cuda.stream(stream):
        ctx = _core.InferenceContext.instance(device)
        G.clear_gemm_cache()
        warm_up_gpu(1.0 if args.quick else 3.0)
        all_cases = [] if args.host_only else cases()
        prepared = []
        for case in all_cases:
            a, b, c, sets = operand_sets(case, l2_bytes)
            ours, theirs = functions(case, a, b, c)
            # The same function on the same operands, from both libraries; the output is poisoned
            # before each, so that a call that leaves it unwritten shows as a NaN difference.
            c.fill_(float("nan"))
            ours(0)
            mine = c.clone()
            c.fill_(float("nan"))
            theirs(0)
            err = relative_difference(mine, c)
            torch_ms, default_ms = timer.compare([theirs, ours], sets)
            prepared.append((case, a, b, c, sets, ours, theirs))
            results.append({"case": case.name, "group": case.group, "dtype": case.dtype,
                            "batch": case.batch, "m": case.m, "n": case.n, "k": case.k,
                            "trans_b": case.trans_b, "sets": sets, "difference": err,
                            "torch_ms": torch_ms, "default_ms": default_ms})
            print(f"{case.name:34s} {case.dtype:9s} torch {torch_ms * 1e3:9.2f} us  "
                  f"default {default_ms * 1e3:9.2f} us  (diff {err:.1e}, {sets} sets)", flush=True)

        if not args.no_tune:
            groups = {}
            for case in all_cases:
                groups.setdefault((case.dtype, case.trans_b), []).append(case.tune_shape)
            tuned = {}
            for (dtype, trans_b), shapes in groups.items():
                for shape, r in zip(shapes, G.autotune_gemm(shapes, dtype, trans_b=trans_b)):
                    tuned[(dtype, trans_b, shape)] = r
            for row, (case, a, b, c, sets, ours, theirs) in zip(results, prepared):
                # c still holds a result of the untuned pass (that of a[0], b[0] where sets == 1):
                # poisoned first, or a tuned call that wrote nothing would compare equal.
                c.fill_(float("nan"))
                ours(0)
                mine = c.clone()
                c.fill_(float("nan"))
                theirs(0)
                row["tuned_difference"] = relative_difference(mine, c)
                row["torch_ms_2"], row["tuned_ms"] = timer.compare([theirs, ours], sets)
                r = tuned[(case.dtype, case.trans_b, case.tune_shape)]
                row["tune"] = {key: r[key] for key in ("backend", "algo_index", "candidates",
                                                       "valid", "default_ms", "tuned_ms")}
        del prepared

        # Host time per call on small shapes: plain calls (as users call them) and with out=.
        for m, n, k in HOST_SHAPES:
            a = torch.empty((m, k), dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
            b = torch.empty((k, n), dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
            c = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
            G.gemm(a, b, out=c)
            torch.matmul(a, b, out=c)
            shape = f"{m}x{n}x{k}"
            # The call timed below, checked first: the plain call (its own compiled path and its
            # own result) gives torch's bits, as the untuned product must (after autotuning, a
            # tuned algorithm of this shape may sum in another order: within bf16's rounding).
            err = relative_difference(G.gemm(a, b), torch.matmul(a, b))
            if not (err == 0.0 if args.no_tune else err < 1e-2):  # NaN fails both
                host_mismatches.append(shape)
            # The four timed in turns (bench/_host_timing.py), so a drift of the host's speed
            # falls on all of them alike; each plain result is dropped at once, as in a loop.
            fns = {
                "torch.matmul": lambda: torch.matmul(a, b),
                "inferctx.gemm": lambda: G.gemm(a, b),
                "torch.matmul(out=)": lambda: torch.matmul(a, b, out=c),
                "inferctx.gemm(out=)": lambda: G.gemm(a, b, out=c),
            }
            if args.host_only:
                fns["new_empty"] = lambda: a.new_empty(m, n)
                if EMPTY_STRIDED is not None:
                    fns["_empty_strided_cuda"] = lambda: EMPTY_STRIDED((m, n), (n, 1), a.dtype)
            rounds = {}
            host[shape] = host_us_interleaved(torch, fns, calls=100, reps=21, slack_us=60.0, rounds=rounds)
            spread[shape] = ratio_spread(rounds["inferctx.gemm"], rounds["torch.matmul"])
        # Whether the plain call takes the compiled torch path (it returns NotImplemented otherwise).
        fast_path = _core._torch_gemm(2, a, b, None, False, False, 1.0, 0.0, None, False) is not NotImplemented

    mismatches = report(results, host, spread, props, args, fast_path)
    for shape in host_mismatches:
        print(f"MISMATCH: the plain gemm(a, b) of {shape} differs from torch.matmul's result; its "
              f"host time above is moot")
    mismatches += len(host_mismatches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                       "gpu": props.name, "torch": torch.__version__,
                       "cuda": torch.version.cuda, "command": " ".join(sys.argv),
                       "cases": results, "host_us_per_call": host,
                       "plain_host_ratio_quartiles": spread}, f, indent=1)
    return 1 if mismatches else 0  # a wrong result makes every figure beside it moot


HOST_SHAPES = [(1, 4096, 4096), (8, 1024, 1024), (64, 64, 64)]
EMPTY_STRIDED = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None),
                        "_empty_strided_cuda", None)


def report(results, host, spread, props, args, fast_path):
    tuned = not args.no_tune
    if args.host_only:
        report_host(host, spread, fast_path)
        return 0
    print()
    print(f"GEMM, inferctx vs torch.matmul (out=), {props.name}, torch {torch.__version__}; "
          f"median device time per call")
    # Each ratio beside the torch time it divides by: the untuned pass's, then the tuned pass's.
    head = (f"{'case':34s} {'dtype':5s} {'torch us':>9s} {'default':>9s} {'def/t':>6s}"
            + (f" {'torch 2':>9s} {'tuned':>9s} {'tun/t':>6s}" if tuned else "")
            + f" {'torch':>8s} {'ours':>8s}"
            + " unit     diff" + (" chosen" if tuned else ""))
    print(head)
    print("-" * len(head))
    ratios = []
    default_ratios = []
    mismatches = 0  # shapes whose result differs from torch's (or is NaN)
    for row in results:
        default_ratios.append(row["default_ms"] / row["torch_ms"])
        case = Case(row["group"], row["dtype"], row["m"], row["n"], row["k"], row["batch"],
                    row["trans_b"])
        torch_ms = row["torch_ms_2"] if tuned else row["torch_ms"]
        ours_ms = row["tuned_ms"] if tuned else row["default_ms"]
        ratio = ours_ms / torch_ms
        ratios.append(ratio)
        torch_rate, unit = rate(case, torch_ms)
        ours_rate, _ = rate(case, ours_ms)
        diffs = (row["difference"], row.get("tuned_difference", 0.0))
        diff = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)  # max() may drop a NaN
        # Untuned, the product is torch's cublasGemmEx call: its bits exactly. A tuned algorithm
        # may sum in another order: within bf16's rounding (NaN fails both tests).
        flag = "" if row["difference"] == 0.0 and diffs[1] < 1e-2 else "  MISMATCH"
        mismatches += bool(flag)
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[row["dtype"]]
        line = (f"{row['case']:34s} {short:5s} {row['torch_ms'] * 1e3:9.2f} "
                f"{row['default_ms'] * 1e3:9.2f} {row['default_ms'] / row['torch_ms']:6.3f}")
        if tuned:
            line += f" {row['torch_ms_2'] * 1e3:9.2f} {row['tuned_ms'] * 1e3:9.2f} {ratio:6.3f}"
        line += f" {torch_rate:8.1f} {ours_rate:8.1f} {unit:8s} {diff:.0e}{flag}"
        if tuned:
            line += f" {row['tune']['backend']}"  # what autotune_gemm chose
        print(line)
    worst_default = max(default_ratios)
    # A verdict on times counts only where every result was right.
    def verdict(met):
        return "FAIL (MISMATCH above)" if mismatches else ("PASS" if met else "MISS")

    print(f"default/torch: worst {worst_default:.3f} (target <= 1.02 on every shape): "
          f"{verdict(worst_default <= 1.02)}")
    if tuned:
        geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"tuned/torch: geometric mean {geomean:.3f} (target <= 0.99), worst {max(ratios):.3f}: "
              f"{verdict(geomean <= 0.99)}")
    report_host(host, spread, fast_path)
    return mismatches


def report_host(host, spread, fast_path):
    print(f"host time per call, bf16 (torch fast path {'on' if fast_path else 'OFF'}):")
    for shape, h in host.items():
        plain, plain_t = h["inferctx.gemm"], h["torch.matmul"]
        o, t = h["inferctx.gemm(out=)"], h["torch.matmul(out=)"]
        print(f"  {shape:14s} gemm(a, b) {plain:6.2f} us vs torch.matmul {plain_t:6.2f} us "
              f"({plain / plain_t:.2f}x, target <= 1.0: {'PASS' if plain <= plain_t else 'MISS'}); "
              f"out=: {o:6.2f} vs {t:6.2f} us ({o / t:.2f}x)")
        low, mid, high = spread[shape]
        tie = " (a tie: the rounds fall on both sides of 1.0)" if low <= 1.0 <= high else ""
        print(f"  {'':14s} gemm(a, b) / torch.matmul round by round: quartiles {low:.3f} / {mid:.3f} / "
              f"{high:.3f}{tie}")
        if "new_empty" in h:
            fast = h.get("_empty_strided_cuda")
            print(f"  {'':14s} the result alone: new_empty {h['new_empty']:6.2f} us"
                  + (f", _empty_strided_cuda {fast:6.2f} us" if fast is not None else
                     ", _empty_strided_cuda not in this torch"))


if __name__ == "__main__":
    sys.exit(main())

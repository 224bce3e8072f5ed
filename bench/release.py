"""Release and retake of the workspace against cudaFree / cudaMalloc and a plain pinned cudaMemcpy.

Measured in one run on one device (medians of wall-clock times per call, after a warm-up cycle):

* ``release_workspace()`` and ``retake_workspace()`` of a workspace of at least 100 GiB (the
  llama-2-70b preset, batch 64, capped with memory_limit_bytes at --gib GiB), against
  ``cudaFree`` and ``cudaMalloc`` of the same bytes (what DeepSpeed's context does; called
  through CuPy's runtime bindings, cupy.cuda.runtime.free / malloc). Target: each <= 1.0x.
* ``release_workspace(keep_contents=True)`` and the ``retake_workspace()`` that copies the bytes
  back, of a workspace of --keep-gib GiB, against a plain synchronous ``cudaMemcpy`` of the same
  bytes from device to pinned host memory and back. Target: each >= 0.8x its bandwidth. The first
  such release also pins the host memory (kept for the next ones); it is shown on its own line
  and not in the median.

Between the two parts the free memory reported by cudaMemGetInfo is checked to rise by the
workspace's bytes at a release and fall by them at a retake (within 64 MiB), and the kept
contents are checked at both ends of the workspace; a failed check makes the exit status 1. The keep_contents size defaults to the smaller of --gib and 40 %
of the host's memory (the pinned copy and the baseline's pinned buffer are never held at once).

    python bench/release.py [--device 0] [--gib 104] [--keep-gib N] [--repeat 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time

from _cli import at_least, json_path, positive_float  # bench/, the script's folder

GIB = 1 << 30
MIB = 1 << 20
TARGET_TIME_RATIO = 1.0   # ours / cudaFree or cudaMalloc, at most
TARGET_BANDWIDTH_RATIO = 0.8  # ours / pinned cudaMemcpy bandwidth, at least
REQUEST = dict(batch_size=64, prompt_len=128, max_out_tokens=4096, dtype="float16")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--gib", type=float, default=104.0,
                    help="memory_limit_bytes of the large workspace, GiB (default 104: >= 100 GiB planned)")
    ap.add_argument("--keep-gib", type=float, default=None,
                    help="size of the keep_contents workspace, GiB (default: min(--gib, 40%% of host memory))")
    ap.add_argument("--repeat", type=int, default=7, help="timed cycles per measurement (median taken)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    at_least(ap, "--repeat", args.repeat, 1)
    positive_float(ap, "--gib", args.gib)
    positive_float(ap, "--keep-gib", args.keep_gib)
    json_path(ap, args.json)
    return args


def host_memory_bytes():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def timed(call):
    start = time.perf_counter_ns()
    call()
    return (time.perf_counter_ns() - start) / 1e6  # ms


class Row:
    def __init__(self, op, ours_ms, base_ms, base_op, nbytes, bandwidth=False):
        self.op, self.ours_ms, self.base_ms, self.base_op, self.nbytes = op, ours_ms, base_ms, base_op, nbytes
        self.bandwidth = bandwidth
        if base_ms is None:
            self.ratio, self.target, self.passed = None, "-", None
        elif bandwidth:  # ours / baseline bandwidth: the baseline's time over ours
            self.ratio = base_ms / ours_ms
            self.target = f">= {TARGET_BANDWIDTH_RATIO}x bandwidth"
            self.passed = self.ratio >= TARGET_BANDWIDTH_RATIO
        else:
            self.ratio = ours_ms / base_ms
            self.target = f"<= {TARGET_TIME_RATIO}x time"
            self.passed = self.ratio <= TARGET_TIME_RATIO

    def gbps(self, ms):
        return None if ms is None or not self.bandwidth else self.nbytes / (ms / 1e3) / 1e9

    def as_dict(self):
        return {"op": self.op, "bytes": self.nbytes, "ours_ms": self.ours_ms, "baseline_ms": self.base_ms,
                "baseline_op": self.base_op, "ours_gb_per_s": self.gbps(self.ours_ms),
                "baseline_gb_per_s": self.gbps(self.base_ms), "ratio": self.ratio, "target": self.target,
                "pass": self.passed}


def fmt(value, digits=1):
    return "-" if value is None else f"{value:,.{digits}f}"


def print_table(rows):
    header = ("op", "GiB", "ours ms", "base ms", "ours GB/s", "base GB/s", "ratio", "target", "pass", "baseline")
    lines = [(r.op, fmt(r.nbytes / GIB, 2), fmt(r.ours_ms), fmt(r.base_ms), fmt(r.gbps(r.ours_ms)),
              fmt(r.gbps(r.base_ms)), fmt(r.ratio, 2), r.target,
              {True: "PASS", False: "FAIL", None: "-"}[r.passed], r.base_op or "-") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    for line in (header, *lines):
        print("  ".join(str(x).ljust(w) if i in (0, 7, 9) else str(x).rjust(w)
                        for i, (x, w) in enumerate(zip(line, widths))).rstrip())


def free_bytes(core, device):
    return core._memory_info(device)[0]


def plan_fresh(ctx, limit_bytes):
    """The llama-2-70b workspace capped at `limit_bytes`, mapped afresh (no view alive)."""
    gc.collect()
    ctx.release_workspace()
    plan = ctx.gen_workspace("llama-2-70b", memory_limit_bytes=int(limit_bytes), **REQUEST)
    return plan, ctx.held_bytes


def mark_ends(cupy, ctx, value):
    """Writes `value` over the first and last MiB of the workspace (through CuPy, on its stream)."""
    ws = cupy.from_dlpack(ctx.workspace)
    ws[:MIB] = value
    ws[-MIB:] = value
    cupy.cuda.get_current_stream().synchronize()


def ends_hold(cupy, ctx, value):
    ws = cupy.from_dlpack(ctx.workspace)
    ok = bool((ws[:MIB] == value).all()) and bool((ws[-MIB:] == value).all())
    del ws
    return ok


def bench_release(ctx, core, cupy, repeat, gib):
    """Release and retake of the large workspace against cudaFree and cudaMalloc."""
    plan, held = plan_fresh(ctx, gib * GIB)
    print(f"large workspace: {held / GIB:.2f} GiB held ({plan.workspace_bytes / GIB:.2f} GiB planned, "
          f"{plan.max_tokens} tokens, bound by {plan.bound_by})", file=sys.stderr)
    checks = {}
    ctx.release_workspace()  # warm-up cycle
    ctx.retake_workspace()
    ours_release, ours_retake, rose, fell = [], [], [], []
    for _ in range(repeat):
        before = free_bytes(core, ctx.device)
        ours_release.append(timed(ctx.release_workspace))
        released = free_bytes(core, ctx.device)
        ours_retake.append(timed(ctx.retake_workspace))
        rose.append(released - before)
        fell.append(released - free_bytes(core, ctx.device))
    checks["free rise at release, min GiB"] = min(rose) / GIB
    checks["free fall at retake, min GiB"] = min(fell) / GIB
    # A release that freed nothing (or a retake that took nothing) would be timed as a fast one:
    # each must move the free memory by the workspace's bytes, less 64 MiB for the driver's own.
    moved = min(min(rose), min(fell))
    checks["free memory moved by the workspace at every cycle"] = moved >= held - (64 << 20)
    ctx.release_workspace()  # the baseline needs the memory

    base_free, base_malloc = [], []
    rt = cupy.cuda.runtime
    ptr = rt.malloc(held)
    try:
        rt.free(ptr)  # warm-up cycle
        ptr = rt.malloc(held)
        for _ in range(repeat):
            start = time.perf_counter_ns()
            rt.free(ptr)
            base_free.append((time.perf_counter_ns() - start) / 1e6)
            ptr = 0
            start = time.perf_counter_ns()
            ptr = rt.malloc(held)
            base_malloc.append((time.perf_counter_ns() - start) / 1e6)
    finally:
        if ptr:
            rt.free(ptr)
    ctx.retake_workspace()
    med = statistics.median
    rows = [Row("release_workspace()", med(ours_release), med(base_free), "cudaFree", held),
            Row("retake_workspace()", med(ours_retake), med(base_malloc), "cudaMalloc", held)]
    return rows, checks


def bench_keep(ctx, core, cupy, repeat, keep_gib):
    """keep_contents release and retake against a pinned cudaMemcpy of the same bytes."""
    from inferctx.context import PinnedBuffer

    plan, held = plan_fresh(ctx, keep_gib * GIB)
    print(f"keep_contents workspace: {held / GIB:.2f} GiB held", file=sys.stderr)
    checks = {}
    mark_ends(cupy, ctx, 0xA5)
    first_release = timed(lambda: ctx.release_workspace(keep_contents=True))  # pins the host copy
    first_retake = timed(ctx.retake_workspace)
    checks["contents kept (first cycle)"] = ends_hold(cupy, ctx, 0xA5)
    ours_release, ours_retake = [], []
    kept = True
    for i in range(repeat):
        value = i % 200 + 1
        mark_ends(cupy, ctx, value)
        ours_release.append(timed(lambda: ctx.release_workspace(keep_contents=True)))
        ours_retake.append(timed(ctx.retake_workspace))
        kept = ends_hold(cupy, ctx, value) and kept
    checks["contents kept (every cycle)"] = kept
    checks["host copy GiB"] = ctx.host_copy_bytes / GIB
    ctx.release_workspace()  # frees the host copy and the device memory for the baseline
    gc.collect()

    rt = cupy.cuda.runtime
    host = PinnedBuffer(held)
    dev = rt.malloc(held)
    base_d2h, base_h2d = [], []
    try:
        d2h, h2d = rt.memcpyDeviceToHost, rt.memcpyHostToDevice
        rt.memcpy(host.ptr, dev, held, d2h)  # warm-up
        rt.memcpy(dev, host.ptr, held, h2d)
        for _ in range(repeat):
            base_d2h.append(timed(lambda: rt.memcpy(host.ptr, dev, held, d2h)))
            base_h2d.append(timed(lambda: rt.memcpy(dev, host.ptr, held, h2d)))
    finally:
        rt.free(dev)
        host = None  # the pinned buffer goes before anything else is measured
        gc.collect()
    med = statistics.median
    rows = [Row("release_workspace(keep_contents=True)", med(ours_release), med(base_d2h),
                "cudaMemcpy D2H, pinned", held, bandwidth=True),
            Row("retake_workspace() (contents back)", med(ours_retake), med(base_h2d),
                "cudaMemcpy H2D, pinned", held, bandwidth=True),
            Row("  first keep_contents release (pins host memory)", first_release, None, None, held,
                bandwidth=True),
            Row("  its retake", first_retake, None, None, held, bandwidth=True)]
    return rows, checks


def main(argv=None):
    args = parse_args(argv)
    from inferctx import NoCudaDeviceError, _core
    from inferctx.context import InferenceContext

    try:
        ctx = InferenceContext.instance(args.device)
    except NoCudaDeviceError as exc:
        print(f"bench/release.py needs a GPU: {exc}", file=sys.stderr)
        return 2
    try:
        import cupy
    except ImportError:
        print("bench/release.py needs CuPy for the cudaMalloc / cudaFree / cudaMemcpy baselines", file=sys.stderr)
        return 2
    cupy.cuda.Device(args.device).use()
    if not ctx.addresses_stable:
        print("the cudaMalloc fallback is in force (addresses_stable is False): the figures are those of "
              "the fallback", file=sys.stderr)
    free, total = _core._memory_info(ctx.device)
    if free < (args.gib + 4) * GIB:
        print(f"bench/release.py needs about {args.gib + 4:.0f} GiB free; {free / GIB:.1f} GiB are",
              file=sys.stderr)
        return 2
    host = host_memory_bytes()
    keep_gib = args.keep_gib
    if keep_gib is None:
        keep_gib = args.gib if host is None else min(args.gib, int(0.4 * host / GIB))

    rows, checks = bench_release(ctx, _core, cupy, args.repeat, args.gib)
    keep_rows, keep_checks = bench_keep(ctx, _core, cupy, args.repeat, keep_gib)
    rows += keep_rows
    checks.update(keep_checks)
    ctx.release_workspace()  # leave the device as it was found

    props = cupy.cuda.runtime.getDeviceProperties(args.device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": name,
        "total_gib": total / GIB,
        "host_memory_gib": None if host is None else host / GIB,
        "python": platform.python_version(),
        "cupy": cupy.__version__,
        "addresses_stable": ctx.addresses_stable,
        "allocation_granularity": ctx.allocation_granularity,
        "command": " ".join(["python", "bench/release.py", *(argv if argv is not None else sys.argv[1:])]),
        "repeat": args.repeat,
        "checks": checks,
    }
    print(f"{meta['gpu']}, Python {meta['python']}, CuPy {meta['cupy']}, {meta['date']}; "
          f"addresses_stable={ctx.addresses_stable}, granularity {ctx.allocation_granularity} B")
    print_table(rows)
    for key, value in checks.items():
        print(f"check: {key}: {value if not isinstance(value, float) else round(value, 2)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": [r.as_dict() for r in rows]}, f, indent=2)
    contents_ok = checks.get("contents kept (first cycle)") and checks.get("contents kept (every cycle)")
    memory_ok = checks.get("free memory moved by the workspace at every cycle", True)  # absent: not run
    return 0 if contents_ok and memory_ok and all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

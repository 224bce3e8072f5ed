"""inferctx's few-row GEMM kernel ("gemv") against torch.matmul, on decoding shapes.

The tuner picks this kernel only where it beats cublasGemmEx by 1% or more, so bench/gemm.py
shows it only where it wins. This script shows its own figures on every shape it takes: a cache
file makes each problem a "gemv" entry, and gemm(out=) then runs the kernel; torch.matmul(out=)
(cublasGemmEx, inferctx's untuned call) runs on the same operands, interleaved.

Shapes: M in {1, 2, 4, 8} x (K, N) in {(4096, 4096), (4096, 14336), (14336, 4096),
(8192, 8192)}, bf16; M in {1, 8} at 4096 x 4096 in fp16 and fp32. Figures: median device time
per call, GB/s of B read, the ratio to torch, and the relative Frobenius difference of the two
results (the tuner accepts 2e-2 for bf16, 1e-2 for fp16, 1e-4 for fp32).

Method as bench/gemm.py's: events around calls queued behind a spin kernel, after warm-up,
medians, operands rotated among copies larger than L2 together.

    python bench/gemm_few_row.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

import torch

import gemm as bench  # bench/gemm.py, in this script's folder

G = bench.G


def cases():
    out = []
    for k, n in ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192)):
        for m in (1, 2, 4, 8):
            out.append(bench.Case("decode", "bfloat16", m, n, k))
    for dt in ("float16", "float32"):
        for m in (1, 8):
            out.append(bench.Case("decode", dt, m, 4096, 4096))
    return out


def as_gemv(a, b, c, folder):
    """Makes the problem of gemm(a, b, out=c) a "gemv" cache entry; False if the kernel cannot take it."""
    G.clear_gemm_cache()
    G.gemm(a, b, out=c)
    entries = G.gemm_cache_entries(tuned_only=False)
    entries[0].update(backend="gemv", algo=[])
    path = os.path.join(folder, "gemm.json")
    with open(path, "w") as f:
        json.dump({"format": "inferctx-gemm-cache", "version": 1, "entries": entries}, f)
    G.clear_gemm_cache()
    G.load_gemm_cache(path)
    # c holds the default call's (cuBLAS's) result: poisoned, so that the difference shown is the
    # kernel's own and a kernel that left c unwritten shows as NaN.
    c.fill_(float("nan"))
    G.gemm(a, b, out=c)
    return [e["backend"] for e in G.gemm_cache_entries()] == ["gemv"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gemm_few_row.py needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    timer = bench.Timer(7 if args.quick else 15)
    bench.warm_up_gpu(2.0 if args.quick else 3.0)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for case in cases():
            a, b, c, sets = bench.operand_sets(case, l2)
            c2 = torch.full_like(c, float("nan"))
            taken = as_gemv(a[0], b[0], c, folder)
            if not taken:
                print(f"{case.name} {case.dtype}: the kernel does not take this problem")
                continue
            torch.matmul(a[0], b[0], out=c2)
            diff = bench.relative_difference(c, c2)
            ours = lambda i: G.gemm(a[i], b[i], out=c)  # noqa: E731
            theirs = lambda i: torch.matmul(a[i], b[i], out=c2)  # noqa: E731
            ms_ours, ms_torch = timer.compare([ours, theirs], sets)
            rows.append(dict(case=case.name, dtype=case.dtype, m=case.m, n=case.n, k=case.k,
                             torch_us=ms_torch * 1e3, gemv_us=ms_ours * 1e3,
                             gemv_gbps=bench.rate(case, ms_ours)[0], torch_gbps=bench.rate(case, ms_torch)[0],
                             ratio=ms_ours / ms_torch, diff=diff, sets=sets))
            print(f"{case.name:24s} {case.dtype:9s} torch {ms_torch * 1e3:8.2f} us  gemv {ms_ours * 1e3:8.2f} us"
                  f"  ({ms_ours / ms_torch:.3f}x, diff {diff:.1e}, {sets} sets)", flush=True)
    G.clear_gemm_cache()
    print(f"\nFew-row kernel (gemv) vs torch.matmul (out=), {props.name}, torch {torch.__version__}; "
          "median device time per call")
    print(f"{'case':24s} {'dtype':9s} {'torch us':>9s} {'gemv us':>9s} {'ratio':>7s} {'torch GB/s':>11s}"
          f" {'gemv GB/s':>10s} {'diff':>8s}")
    for r in rows:
        print(f"{r['case']:24s} {r['dtype']:9s} {r['torch_us']:9.2f} {r['gemv_us']:9.2f} {r['ratio']:7.3f}"
              f" {r['torch_gbps']:11.1f} {r['gemv_gbps']:10.1f} {r['diff']:8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": props.name,
                       "torch": torch.__version__, "command": " ".join(["bench/gemm_few_row.py"] + sys.argv[1:]),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""compute-sanitizer initcheck and cuBLAS's half-precision results on Hopper, with torch alone.

Each case makes one result on the GPU and clones it (a device-to-device copy that initcheck
checks). Run as ``compute-sanitizer --tool initcheck python3 initcheck_half_gemm.py CASE``. On an
H100 (driver 580.159.04, compute-sanitizer of CUDA 13.0, torch's cuBLAS):

    control       a * 2, bf16 64x256        0 errors
    matmul-fp32   64x512 @ 512x256          0 errors
    matmul-bf16   64x512 @ 512x256          1024 errors: the whole 32 KiB result, one per 32 bytes
    bmm-fp16      4x32x16 @ 4x16x64         512 errors: the whole 16 KiB result

The values are right (the printed sums), so the stores happened: initcheck does not see the
stores of the kernels cuBLAS picks there, and reports every later read of their results.
"""
import sys

import torch


def main(case):
    torch.manual_seed(0)
    cuda = dict(device="cuda")
    if case == "matmul-bf16":
        a = torch.randn(64, 512, dtype=torch.bfloat16, **cuda)
        b = torch.randn(512, 256, dtype=torch.bfloat16, **cuda)
        c = torch.matmul(a, b)
    elif case == "matmul-fp32":
        c = torch.matmul(torch.randn(64, 512, **cuda), torch.randn(512, 256, **cuda))
    elif case == "bmm-fp16":
        a = torch.randn(4, 32, 16, dtype=torch.float16, **cuda)
        b = torch.randn(4, 64, 16, dtype=torch.float16, **cuda)
        c = torch.bmm(a, b.transpose(1, 2))
    elif case == "control":  # an elementwise kernel's result
        c = torch.randn(64, 256, dtype=torch.bfloat16, **cuda) * 2
    else:
        raise SystemExit(f"case must be control, matmul-fp32, matmul-bf16 or bmm-fp16, not {case!r}")
    d = c.clone()
    torch.cuda.synchronize()
    print(case, tuple(c.shape), c.nbytes, "bytes", float(d.float().abs().sum()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "control")

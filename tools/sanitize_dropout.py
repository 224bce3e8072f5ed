"""The dropout kernels of the package (eager: bit, byte and no mask, apply_mask, float32, float16
and bfloat16, sizes from 37 elements to 3 Mi; on a side stream; and the default call captured into
a CUDA graph and replayed) through the Python API, for compute-sanitizer on a machine with a GPU:

    compute-sanitizer --tool racecheck --kernel-name kns=dropout --error-exitcode 1 \\
        python3 tools/sanitize_dropout.py

(the same with --tool memcheck, initcheck or synccheck). Exits 0 after the last replay; the
sanitizer's summary line is the result.
"""

import torch

import inferctx


def main():
    dev = "cuda:0"
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for n in (37, 1024 * 5 + 37, 1 << 20, 3 << 20):
            x = torch.randn(n, device=dev).to(dt)
            for mask in ("bits", "bytes", None):
                y, m = inferctx.dropout(x, 0.3, mask=mask)
                if m is not None:
                    inferctx.apply_mask(x, m, 0.3)
        side = torch.cuda.Stream()
        x = torch.randn(1 << 20, device=dev).to(dt)
        side.wait_stream(torch.cuda.current_stream())  # x is written on the current stream
        with torch.cuda.stream(side):
            inferctx.dropout(x, 0.3)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            inferctx.dropout(x, 0.3)
        for _ in range(3):
            graph.replay()
    torch.cuda.synchronize()
    print("sanitize_dropout: done")


if __name__ == "__main__":
    main()

"""Which calls leave their callers' Python frames alive under compute-sanitizer.

Under the tool, views of the workspace stayed alive after tests that held them had returned,
held by those tests' frames, which no Python object held (docs/reliability.md). This script
calls each kind of operation from a function that keeps a marker object, then collects garbage
and counts the markers still alive: any count above 0 means a frame of that function outlived
it. Run it with and without the tool, and with the tool's options, on a machine with a GPU:

    python3 tools/sanitizer_frames.py
    compute-sanitizer --tool initcheck python3 tools/sanitizer_frames.py
    compute-sanitizer --tool initcheck --show-backtrace no python3 tools/sanitizer_frames.py

Prints one line per operation: its name and how many of its callers' frames stayed alive,
in a first round of calls and in a second.
"""

import gc
import os
import sys
import weakref

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX is imported

CALLS = 3


class Marker:
    pass


def operations():
    import numpy as np
    import torch

    ops = {}
    dev = "cuda:0"
    base = torch.full((1 << 20,), 2.0, device=dev)
    ops["torch kernel on memory torch holds"] = lambda: base.add_(0.0)

    def new_segment():  # a cudaMalloc inside the call, and its cudaFree
        torch.cuda.caching_allocator_delete(torch.cuda.caching_allocator_alloc(512 << 20))
        torch.cuda.empty_cache()

    ops["torch new 512 MiB segment"] = new_segment
    ops["cudaHostAlloc (torch pinned)"] = lambda: torch.empty(1 << 20, pin_memory=True)
    try:
        import inferctx
        from inferctx.context import PinnedBuffer
    except ImportError:
        pass
    else:
        ops["inferctx PinnedBuffer"] = lambda: PinnedBuffer(1 << 20)
        ops["inferctx dropout (pool result)"] = lambda: inferctx.dropout(base, 0.5)
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        pass
    else:
        j = jax.dlpack.from_dlpack(base)
        ops["jax.numpy reduction"] = lambda: float(jnp.min(j))
        ops["np.asarray of a JAX array"] = lambda: np.asarray(j).min()
    return ops


def count_kept(op):
    alive = []

    def caller():
        marker = Marker()
        alive.append(weakref.ref(marker))
        op()
        torch_sync()

    for _ in range(CALLS):
        caller()
    gc.collect()
    return sum(ref() is not None for ref in alive)


def torch_sync():
    import torch

    torch.cuda.synchronize()


def main():
    for name, op in operations().items():
        first = count_kept(op)  # the first calls load libraries and kernels
        print(f"{name}: {first} of {CALLS} callers' frames kept, then {count_kept(op)} of {CALLS}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

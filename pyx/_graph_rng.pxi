# Part of _core.pyx: Philox draws under CUDA-graph capture (cuda/include/inferctx/graph_rng.hpp,
# docs/graphs.md). A kernel that draws from the context's Philox state asks the context where
# its state comes from at the moment it is queued: on a stream that is not capturing, from the
# host counter (increment_offset, as before: one capture query more); on a capturing stream, from
# a new call site of the graph being captured, which the kernel reads from device memory at every
# replay. Explicit (seed, offset) arguments are host values either way, so under capture every
# replay of such a call draws the same numbers.

from libc.stdint cimport int64_t, uint64_t, uintptr_t

from inferctx._decl_gpu cimport (
    CppInferenceContext, GraphRngStats, PhiloxSource, cudaStream_t, stream_capturing)
from inferctx._decl_kernels cimport dropout_forward


cdef int _dropout_launch(InferenceContext context, const void* x, void* y, void* mask, int64_t n,
                         int dtype, double p, int mode, bint fixed, uint64_t seed,
                         uint64_t offset, uintptr_t stream, int device) except -1:
    """Queues dropout_forward on `stream` with the Philox state (seed, offset) when `fixed`, else
    the context's: increment_offset(4) eagerly, a graph call site under capture."""
    cdef CppInferenceContext* cx = context._c
    with nogil:
        if fixed:
            dropout_forward(x, y, mask, n, dtype, p, mode, PhiloxSource.host(seed, offset),
                            <cudaStream_t>stream, device, 0)
        else:  # drawn once the arguments passed: a refused call takes no offset or call site
            dropout_forward(x, y, mask, n, dtype, p, mode, cx.graph_rng(), <cudaStream_t>stream,
                            device, 0)
    return 0


def graph_rng_state(ctx=None):
    """The Philox state of ``ctx`` (default: the current device's context) for eager and graph draws.

    Returns a dict:

    - ``seed``: the seed (eager calls use it; graph replays read it from device memory, so a
      ``set_seed`` after capture applies to later replays).
    - ``offset``: the next eager offset (``rng_state[1]``); eager offsets stay below 2**63.
    - ``epoch``: ``set_seed`` calls so far; each one restarts every graph at replay 0.
    - ``sites``: call sites captured into CUDA graphs on this context (never reset, so a graph
      captured after ``set_seed`` cannot repeat a live one's numbers). Site ``k``, replay ``r``
      (replays since the site's capture or the last ``set_seed``) draws element ``i`` from
      ``curand_init(seed, k * 2**36 + i // 4, 2**63 + 4 * r)`` (dropout); the next capture takes
      site ``sites``.
    - ``live_sites``: sites whose graph (or an executable graph of it) still exists.
    - ``slots``: device slots allocated for sites (reused once their graph is destroyed).
    """
    cdef InferenceContext context
    if ctx is None:
        context = _context_of(None)
    elif isinstance(ctx, InferenceContext):
        context = <InferenceContext>ctx
    else:
        raise _ConfigError(f"ctx: got {type(ctx).__name__}; pass an inferctx.InferenceContext or "
                           f"None", argument="ctx")
    cdef GraphRngStats g = context._c.graph_rng().stats()
    return {"seed": g.seed, "offset": g.offset, "epoch": g.epoch, "sites": g.sites,
            "live_sites": g.live_sites, "slots": g.slots}


def _stream_capturing(stream, device):
    """True while `stream` (a handle or stream-like) on `device` is capturing a CUDA graph."""
    cdef uintptr_t handle = _stream_handle(stream, "stream")
    cdef int d = <int>_int_arg(device, "device")
    cdef bint capturing
    with nogil:
        capturing = stream_capturing(<cudaStream_t>handle, d)
    return capturing

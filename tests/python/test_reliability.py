"""Reliability under load and in hostile process states (issue 16: concurrency, processes, soak,
sticky errors).

- Concurrency: 16 threads share one context: Philox offsets (explicit and dropout's own draws),
  the token counter, dropout and gemm on each thread's torch stream, exports of the workspace's
  views, release / retake attempts. No lost or overlapping offset, no torn state, no deadlock
  (each thread is joined with a timeout; a thread still alive fails the test).
- Processes: a child forked after CUDA was initialised gets an inferctx error, not a hang; with
  CUDA_VISIBLE_DEVICES="" planning (API and CLI) works and every GPU entry point raises
  NoCudaDeviceError (that part runs without a GPU, in CI too).
- Soak: INFERCTX_SOAK_CYCLES (default 300) cycles of gen_workspace with random shapes,
  release / retake, exports to torch, dropout, gemm and CUDA graph replays; afterwards free device
  memory within 2 MiB of the start, no growth in live Python objects, in the pool or in the live
  graph RNG sites.
- Sticky errors: in a child process, a kernel faults (an illegal address) and every later
  inferctx call that reaches the GPU raises CudaError, without a hang.

Children run with a timeout and report one line per call (CALL before it, RESULT after it), so
that a hang names the call it hung in.
"""

from __future__ import annotations

import collections
import faulthandler
import functools
import gc
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import numpy as np
import philox_reference as ref
import pytest
from gpu_context import SHAPE, ctx, plan_small, settled_live_sites  # noqa: F401 (fixture)

import inferctx
from inferctx import (ModelShape, TokenLimitError, WorkspaceInUseError, WorkspaceOOMError,
                      WorkspaceStateError)
from inferctx import _core

MIB = 1 << 20

# The small plan of gpu_context, spelled out for the child processes (which do not import it).
CHILD_PLAN = ("ModelShape(num_layers=4, num_heads=8, hidden_dim=512, num_kv_heads=2), "
              "batch_size=2, prompt_len=16, max_out_tokens=64, dtype='float16'")


# -- helpers: dropout and gemm checked against torch ---------------------------------------------

def unpack_bits(torch, words, n):
    """Keep decisions (bool, n) from dropout's bit mask: bit i % 32 of 32-bit word i // 32."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = (words.reshape(-1).view(torch.int32).unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:n].bool()


def dropout_scale(p):
    """float32(1 / (1 - p)), p rounded to float32 first (cuda/include/inferctx/dropout.hpp)."""
    return float(np.float32(1.0 / (1.0 - float(np.float32(p)))))


def dropout_matches(torch, x, y, words, p):
    """y is the defined result for the mask: to_dtype(float32(x) * scale) where kept, 0 elsewhere;
    returns (matches, kept fraction)."""
    keep = unpack_bits(torch, words, x.numel()).view(x.shape)
    scale = torch.tensor(dropout_scale(p), dtype=torch.float32, device=x.device)
    want = torch.where(keep, (x.float() * scale).to(x.dtype), torch.zeros((), dtype=x.dtype,
                                                                          device=x.device))
    return torch.equal(y, want), float(keep.float().mean())


# Relative to max_i sum_k |a_ik| |b_kj|: float32 accumulation (k <= 128 terms) and one rounding
# of the result to the output type.
GEMM_TOL = {"float32": 3e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def gemm_error(torch, c, a, b):
    """max |c - a @ b| (float64 reference) over the largest sum of |a_ik b_kj|."""
    ref = a.double() @ b.double()
    bound = float((a.double().abs() @ b.double().abs()).max())
    return float((c.double() - ref).abs().max()) / max(bound, 1e-300)


def tdtype(torch, name):
    return getattr(torch, name)


# -- helpers: child processes -----------------------------------------------------------------------

CHILD_PRELUDE = textwrap.dedent("""
    import json, os, sys

    def say(line):
        os.write(1, (line + "\\n").encode())

    def report(name, fn):
        say("CALL " + name)
        try:
            value = fn()
            out = {"name": name, "raised": None, "inferctx": False, "cuda": False,
                   "no_device": False, "code_name": None, "message": repr(value)[:300]}
        except BaseException as e:  # noqa: BLE001 - every outcome is reported
            from inferctx.errors import CudaError, InferCtxError, NoCudaDeviceError
            out = {"name": name, "raised": type(e).__name__, "inferctx": isinstance(e, InferCtxError),
                   "cuda": isinstance(e, CudaError), "no_device": isinstance(e, NoCudaDeviceError),
                   "code_name": getattr(e, "name", None), "message": str(e)}
        say("RESULT " + json.dumps(out))
""")

Child = collections.namedtuple("Child", "rc stdout stderr timed_out results started notes")


def run_child(code, timeout, env=None):
    """Runs `code` in a new Python process (its own session, so that a grandchild it forks is
    killed with it); kills the whole group after `timeout` seconds."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", "(the output could not be read after the kill)"
    results, started, notes = {}, [], {}
    for line in (out or "").splitlines():
        if line.startswith("CALL "):
            started.append(line[5:])
        elif line.startswith("RESULT "):
            r = json.loads(line[7:])
            results[r["name"]] = r
        elif line.startswith("NOTE "):
            key, _, value = line[5:].partition(" ")
            notes[key] = value
        elif line.startswith("SKIP "):
            notes["skip"] = line[5:]
    return Child(proc.returncode, out or "", err or "", timed_out, results, started, notes)


def hung_call(child):
    """The call a child started and never finished, or None."""
    unfinished = [name for name in child.started if name not in child.results]
    return unfinished[0] if unfinished else None


def describe(child):
    lines = [f"rc={child.rc} timed_out={child.timed_out} hung in={hung_call(child)!r}"]
    for name, r in child.results.items():
        lines.append(f"  {name}: {r['raised'] or 'returned'}: {r['message'][:300]}")
    for key, value in child.notes.items():
        lines.append(f"  note {key}: {value[:300]}")
    lines.append("stderr (tail): " + child.stderr[-2000:])
    return "\n".join(lines)


# -- 1. Concurrency ----------------------------------------------------------------------------------

THREADS = 16
ITERATIONS = 24
TOKEN_LIMIT = 2048
JOIN_TIMEOUT_S = 120
BARRIER_TIMEOUT_S = 60
DROPOUT_N = 2048  # one mask: 64 words
DROPOUT_P = 0.25
SEED = 7
RELEASERS = (0, 5, 10, 15)  # threads that also release and retake the workspace


@pytest.mark.gpu
def test_16_threads_share_one_context(torch, ctx):
    """Offsets: the explicit increment_offset ranges and dropout's own draws (4 each) tile
    [0, final offset) with no overlap and no gap, each dropout's mask being the one its gap
    offset gives. Tokens: 16 threads advancing one at a time reach max_token_length exactly;
    mixed resets and advances leave the counter in range with consistent TokenLimitErrors.
    Dropout and gemm on each thread's stream equal torch's results; exports have the plan's
    shape and addresses; releases and retakes raise nothing but the documented
    WorkspaceInUseError / WorkspaceStateError; nothing deadlocks."""
    plan = ctx.gen_workspace(SHAPE, batch_size=2, prompt_len=16, max_out_tokens=TOKEN_LIMIT,
                             dtype="float16")
    limit = ctx.max_token_length
    assert limit == plan.max_tokens == TOKEN_LIMIT
    kv_shape = plan.kv_shape
    stable = ctx.addresses_stable
    k0_ptr = ctx.kv_cache(0)[0].ptr  # no view kept: under the cudaMalloc fallback it would
    workspace_ptr = ctx.workspace.ptr  # make every release a WorkspaceInUseError
    ctx.reset_tokens(0)
    torch.cuda.synchronize()
    ctx.set_seed(SEED)
    torch.cuda.synchronize()
    assert ctx.rng_state == (SEED, 0)

    errors = []  # (thread, traceback)
    offsets = [[] for _ in range(THREADS)]  # ((seed, offset), increment)
    masks = [[] for _ in range(THREADS)]  # dropout masks (int32 words, on the device)
    advanced = [0] * THREADS
    counts = [collections.Counter() for _ in range(THREADS)]
    phase_a_tokens = []
    start = threading.Barrier(THREADS, timeout=BARRIER_TIMEOUT_S)
    middle = threading.Barrier(THREADS, action=lambda: phase_a_tokens.append(ctx.current_tokens),
                               timeout=BARRIER_TIMEOUT_S)

    def guarded(i, fn):
        """Runs fn; False (and the error recorded, the barriers broken) when it raised."""
        try:
            fn()
            return True
        except threading.BrokenBarrierError:
            errors.append((i, "a barrier broke (another thread failed first)"))
        except BaseException:  # noqa: BLE001 - reported by the main thread
            errors.append((i, traceback.format_exc()))
        start.abort()
        middle.abort()
        return False

    def phase_a(i, rng):
        # Only advances: the counter ends at the limit, each success counted once.
        while True:
            inc = rng.randint(1, 12)
            offsets[i].append((ctx.increment_offset(inc), inc))
            try:
                ctx.advance_tokens(1)
            except TokenLimitError as e:
                assert (e.limit, e.requested) == (limit, 1) and e.current + 1 > limit, str(e)
                return
            advanced[i] += 1

    def phase_b(i, rng, stream):
        g = torch.Generator(device=f"cuda:{ctx.device}").manual_seed(1000 + i)
        dt = torch.float32 if i % 2 == 0 else torch.float16
        x = torch.randn(DROPOUT_N, device=f"cuda:{ctx.device}", dtype=torch.float32, generator=g)
        a = torch.randn(64, 96, device=f"cuda:{ctx.device}", generator=g).to(dt)
        b = torch.randn(96, 48, device=f"cuda:{ctx.device}", generator=g).to(dt)
        released_by_me = False
        for it in range(ITERATIONS):
            inc = rng.randint(1, 12)
            offsets[i].append((ctx.increment_offset(inc), inc))

            y, m = inferctx.dropout(x, DROPOUT_P)  # draws increment_offset(4) itself
            ok, kept = dropout_matches(torch, x, y, m, DROPOUT_P)
            assert ok, f"thread {i}: dropout's y does not match its mask"
            assert 0.6 < kept < 0.9, f"thread {i}: kept fraction {kept}"
            masks[i].append(m.clone())

            c = inferctx.gemm(a, b)
            assert c.dtype == dt and tuple(c.shape) == (64, 48)
            err = gemm_error(torch, c, a, b)
            assert err <= GEMM_TOL[str(dt).split(".")[-1]], f"thread {i}: gemm error {err}"

            try:
                k, v = ctx.kv_cache(rng.randrange(SHAPE.num_layers))
                kt = torch.from_dlpack(k)
                assert tuple(kt.shape) == kv_shape and kt.dtype == torch.float16
                assert kt.data_ptr() == k.ptr and tuple(v.shape) == kv_shape
                interface = ctx.workspace.__cuda_array_interface__
                assert interface["shape"] == (plan.workspace_bytes,)
                if stable:
                    assert interface["data"][0] == workspace_ptr
                del k, v, kt, interface
                counts[i]["exports"] += 1
            except WorkspaceStateError:
                counts[i]["refused while released"] += 1

            if rng.random() < 0.5:
                ctx.reset_tokens(rng.randint(0, limit))
            else:
                n = rng.randint(1, 4)
                try:
                    ctx.advance_tokens(n)
                except TokenLimitError as e:
                    assert e.limit == limit and e.requested == n and e.current + n > limit, str(e)
                    counts[i]["token limit"] += 1
            now = ctx.current_tokens
            assert 0 <= now <= limit, f"thread {i}: current_tokens {now} outside 0..{limit}"

            ctx.sync_comp()
            ctx.sync_comm()

            if i in RELEASERS:
                if released_by_me:
                    assert ctx.retake_workspace() is True
                    released_by_me = False
                elif it % 3 == 0:
                    try:
                        ctx.release_workspace()
                        released_by_me = True
                        counts[i]["releases"] += 1
                    except WorkspaceInUseError:  # the cudaMalloc fallback with views alive
                        assert not stable
                        counts[i]["in use"] += 1
        if released_by_me:
            ctx.retake_workspace()
        stream.synchronize()

    def work(i):
        rng = random.Random(i)
        with torch.cuda.device(ctx.device):
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                (guarded(i, start.wait) and guarded(i, lambda: phase_a(i, rng))
                 and guarded(i, middle.wait) and guarded(i, lambda: phase_b(i, rng, stream)))

    pool = [threading.Thread(target=work, args=(i,), name=f"reliability-{i}", daemon=True)
            for i in range(THREADS)]
    for t in pool:
        t.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for t in pool:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in pool if t.is_alive()]
    if stuck:
        faulthandler.dump_traceback(all_threads=True)
    assert not stuck, f"deadlock: threads {stuck} still running after {JOIN_TIMEOUT_S} s"
    assert not errors, "\n".join(f"thread {i}:\n{tb}" for i, tb in errors)
    torch.cuda.synchronize()

    # Tokens.
    assert sum(advanced) == limit and phase_a_tokens == [limit], (sum(advanced), phase_a_tokens)
    assert 0 <= ctx.current_tokens <= limit

    # Offsets: explicit ranges, then the gaps between them, which must be dropout's draws.
    ranges = []
    for calls in offsets:
        for (seed, offset), inc in calls:
            assert seed == SEED
            ranges.append((offset, offset + -(-inc // 4) * 4))
    ranges.sort()
    final = ctx.rng_state[1]
    gaps, at = [], 0
    for lo, hi in ranges:
        assert lo >= at, f"overlapping offset ranges at {lo} (previous range ends at {at})"
        gaps.extend(range(at, lo, 4))
        assert (lo - at) % 4 == 0
        at = hi
    assert final >= at and (final - at) % 4 == 0
    gaps.extend(range(at, final, 4))
    drawn = sum(len(m) for m in masks)
    assert drawn == THREADS * ITERATIONS
    assert len(gaps) == drawn, (f"{len(gaps)} 4-offset gaps between the explicit ranges, "
                                f"{drawn} dropout draws: offsets were lost or doubled")
    total = sum(hi - lo for lo, hi in ranges) + 4 * drawn
    assert total == final

    # Each dropout drew exactly one gap: its mask is the one that offset gives (the independent
    # reference's bits mask at that offset).
    want = np.stack([ref.pack_bits(ref.dropout_keep(SEED, o, DROPOUT_P, DROPOUT_N)) for o in gaps])
    got = torch.stack([m for per_thread in masks for m in per_thread])
    want_rows = sorted(r.tobytes() for r in want)
    got_rows = sorted(r.tobytes() for r in got.cpu().numpy())
    assert len(set(got_rows)) == drawn, "two dropouts drew the same mask"
    assert got_rows == want_rows, "some dropout masks match no offset left between the ranges"

    # The workspace is whole again: exports have the plan's layout and its memory is mapped.
    del got, want
    ctx.retake_workspace()
    assert not ctx.released and ctx.held_bytes >= plan.workspace_bytes
    k, v = ctx.kv_cache(SHAPE.num_layers - 1)
    kt, vt = torch.from_dlpack(k), torch.from_dlpack(v)
    kt.fill_(2.0)
    vt.fill_(-3.0)
    assert bool((kt == 2.0).all()) and bool((vt == -3.0).all())
    if stable:
        assert ctx.kv_cache(0)[0].ptr == k0_ptr and ctx.workspace.ptr == workspace_ptr
    del k, v, kt, vt
    gc.collect()
    assert ctx.views_alive == 0
    summary = sum(counts, collections.Counter())
    assert summary["exports"] > 0


# -- 2. Processes: fork ------------------------------------------------------------------------------

FORK_TIMEOUT_S = 60  # the forked child's calls, all together

FORK_SCRIPT = CHILD_PRELUDE + textwrap.dedent(f"""
    import signal, time
    import inferctx
    from inferctx import ModelShape
    from inferctx.context import InferenceContext

    ctx = InferenceContext.instance()
    ctx.gen_workspace({CHILD_PLAN})
    x = ctx.activations.view("float16", (64, 64))
    w = ctx.activations.view("float16", (64, 64), 64 * 64 * 2)
    c = ctx.activations.view("float16", (64, 64), 2 * 64 * 64 * 2)
    y, m = inferctx.dropout(x, 0.1)
    inferctx.gemm(x, w, out=c)
    ctx.stream.synchronize()
    del y, m
    sys.stdout.flush()
    sys.stderr.flush()

    pid = os.fork()
    if pid == 0:
        calls = [
            ("gen_workspace", lambda: ctx.gen_workspace({CHILD_PLAN})),
            ("dropout", lambda: inferctx.dropout(x, 0.1)),
            ("gemm", lambda: inferctx.gemm(x, w, out=c)),
            ("sync_comp", lambda: ctx.sync_comp()),
            ("stream.synchronize", lambda: ctx.stream.synchronize()),
            ("release_workspace", lambda: ctx.release_workspace()),
            ("PinnedBuffer", lambda: inferctx.PinnedBuffer(4096)),
            ("increment_offset", lambda: ctx.increment_offset(4)),
            ("InferenceContext.instance", lambda: InferenceContext.instance()),
        ]
        for name, fn in calls:
            report(name, fn)
        say("NOTE child_done yes")
        os._exit(0)

    deadline = time.monotonic() + {FORK_TIMEOUT_S}
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        say("NOTE child_hung yes")
    say("NOTE child_status " + str(status))
    # The parent's context is not affected by the child.
    y, m = inferctx.dropout(x, 0.1)
    ctx.stream.synchronize()
    say("NOTE parent_ok yes")
""")

# Calls that reach the GPU: each must raise an inferctx error in the forked child.
FORK_GPU_CALLS = ("gen_workspace", "dropout", "gemm", "sync_comp", "stream.synchronize",
                  "release_workspace")


# Under compute-sanitizer (INFERCTX_SANITIZE) the tool follows child processes: a child forked
# after CUDA was initialised hung in its first CUDA call instead of getting CUDA's error, and a
# child started with CUDA_VISIBLE_DEVICES="" still found a device (runs of 2026-12-06,
# docs/reliability.md). These tests check the process's environment, which the tool changes.
SANITIZED = bool(os.environ.get("INFERCTX_SANITIZE"))
not_under_a_sanitizer = pytest.mark.skipif(
    SANITIZED, reason="compute-sanitizer changes what a forked or CUDA_VISIBLE_DEVICES='' child sees")


@functools.lru_cache(maxsize=None)
def fork_child():
    return run_child(FORK_SCRIPT, timeout=FORK_TIMEOUT_S + 120)


@pytest.mark.gpu
@not_under_a_sanitizer
def test_forked_child_gets_an_inferctx_error_not_a_hang():
    child = fork_child()
    text = describe(child)
    assert not child.timed_out and "child_hung" not in child.notes, "hang:\n" + text
    assert child.notes.get("child_done") == "yes", "the forked child did not finish:\n" + text
    for name in FORK_GPU_CALLS:
        r = child.results[name]
        assert r["raised"] is not None, f"{name} returned in a forked child:\n{text}"
        assert r["inferctx"], f"{name} raised {r['raised']}, not an inferctx error:\n{text}"
    assert child.notes.get("parent_ok") == "yes", "the parent's context broke:\n" + text
    assert child.rc == 0, text


@pytest.mark.gpu
@not_under_a_sanitizer
def test_forked_child_error_says_it_was_forked():
    child = fork_child()
    text = describe(child)
    for name in FORK_GPU_CALLS:
        r = child.results.get(name)
        assert r is not None and r["inferctx"], f"{name}:\n{text}"
        message = r["message"].lower()
        assert "fork" in message and "spawn" in message, f"{name}: {r['message']}"


# -- 2. Processes: no visible device (runs without a GPU too) -----------------------------------------

NO_DEVICE_SCRIPT = CHILD_PRELUDE + textwrap.dedent("""
    import numpy as np
    import inferctx

    shape = inferctx.ModelShape.from_preset("llama-2-7b")
    plan = inferctx.plan_workspace(shape, batch_size=8, prompt_len=1, max_out_tokens=4096,
                                   dtype="float16", gpu="h100-80gb")
    say("NOTE plan " + json.dumps([plan.max_tokens, plan.workspace_bytes, plan.bound_by]))
    say("NOTE max_batch " + str(inferctx.max_batch_size("llama-2-7b", max_out_tokens=4096,
                                                        gpu="h100-80gb")))
    say("NOTE most_tokens " + str(inferctx.max_out_tokens_for("llama-2-7b", batch_size=8,
                                                              gpu="h100-80gb")))
    figures = inferctx.plan_workspace(shape, batch_size=8, prompt_len=1, max_out_tokens=4096,
                                      free_bytes=24 << 30, total_bytes=24 << 30)
    say("NOTE figures " + str(figures.max_tokens))
    say("NOTE core_loaded " + str("inferctx._core" in sys.modules))

    class Lying:
        # A CUDA array interface with a pointer no device can vouch for.
        def __init__(self, shape):
            self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4",
                                             "data": (1 << 32, False), "version": 3}

    report("InferenceContext.instance()", lambda: inferctx.InferenceContext.instance())
    report("InferenceContext.instance(0)", lambda: inferctx.InferenceContext.instance(0))
    report("plan_workspace(device)", lambda: inferctx.plan_workspace(
        shape, batch_size=8, prompt_len=1, max_out_tokens=4096))
    report("PinnedBuffer", lambda: inferctx.PinnedBuffer(4096))
    report("Stream", lambda: inferctx.Stream())
    report("Event", lambda: inferctx.Event())
    report("dropout(CUDA array interface)", lambda: inferctx.dropout(Lying((64,)), 0.1))
    report("apply_mask(CUDA array interface)",
           lambda: inferctx.apply_mask(Lying((64,)), Lying((2,)), 0.1))
    report("gemm(CUDA array interface)", lambda: inferctx.gemm(Lying((8, 8)), Lying((8, 8))))
    report("bmm(CUDA array interface)", lambda: inferctx.bmm(Lying((2, 8, 8)), Lying((2, 8, 8))))
    report("autotune_gemm", lambda: inferctx.autotune_gemm([(8, 8, 8)], "fp16"))
    report("dropout(numpy)", lambda: inferctx.dropout(np.ones(64, np.float32), 0.1))
""")

NO_DEVICE_GPU_CALLS = ("InferenceContext.instance()", "InferenceContext.instance(0)",
                       "plan_workspace(device)", "PinnedBuffer", "Stream", "Event",
                       "dropout(CUDA array interface)", "apply_mask(CUDA array interface)",
                       "gemm(CUDA array interface)", "bmm(CUDA array interface)", "autotune_gemm")


def no_device_env():
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


@not_under_a_sanitizer
def test_no_visible_device_planning_works_and_gpu_calls_raise_no_cuda_device():
    child = run_child(NO_DEVICE_SCRIPT, timeout=120, env=no_device_env())
    text = describe(child)
    assert child.rc == 0 and not child.timed_out, text
    max_tokens, workspace_bytes, bound_by = json.loads(child.notes["plan"])
    assert (max_tokens, bound_by) == (4096, "max_out_tokens") and workspace_bytes > 0, text
    assert int(child.notes["max_batch"]) >= 8 and int(child.notes["most_tokens"]) >= 4096
    assert int(child.notes["figures"]) > 0
    assert child.notes["core_loaded"] == "False", "planning loaded the GPU module"
    for name in NO_DEVICE_GPU_CALLS:
        r = child.results[name]
        assert r["raised"] == "NoCudaDeviceError" and r["no_device"], f"{name}:\n{text}"
        assert r["code_name"], f"{name} names no CUDA error:\n{text}"
        # Every such message says that planning works without a device.
        assert "without" in r["message"] and ("Planning" in r["message"]
                                              or "plan" in r["message"]), f"{name}:\n{text}"
    # Host arrays are an argument error, said before any device is looked for.
    r = child.results["dropout(numpy)"]
    assert r["raised"] == "ConfigError" and "CUDA array" in r["message"], text

    # The CLI: a GPU preset plans as the API does; the real device is a one-line error, status 2.
    cli = [sys.executable, "-m", "inferctx", "plan", "--preset", "llama-2-7b"]
    done = subprocess.run(cli + ["--gpu", "h100-80gb", "--batch", "8", "--max-tokens", "4096",
                                 "--json"], env=no_device_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)["plan"]
    assert (got["max_tokens"], got["workspace_bytes"]) == (max_tokens, workspace_bytes)
    done = subprocess.run(cli + ["--gpu", "h100-80gb", "--max-tokens", "4096", "--max-batch",
                                 "--json"], env=no_device_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["max_batch_size"] == int(child.notes["max_batch"])
    for where in (["--device", "0"], []):
        done = subprocess.run(cli + where + ["--batch", "8", "--max-tokens", "4096"],
                              env=no_device_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (where, done.stdout, done.stderr)
        assert done.stdout == "" and "Traceback" not in done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "no CUDA device" in lines[0] and "--gpu" in lines[0], lines


# -- 3. Soak -----------------------------------------------------------------------------------------

SOAK_CYCLES = int(os.environ.get("INFERCTX_SOAK_CYCLES", "300"))
SOAK_SEED = int(os.environ.get("INFERCTX_SOAK_SEED", "16"))
WARM_CYCLES = 10  # random cycles after the deterministic warm-up, before the first measurement
DTYPES = ("float32", "float16", "bfloat16")
DROPOUT_SIZES = (1000, 4096, 65_537)
GEMM_SHAPES = ((8, 64, 32), (33, 17, 65), (64, 128, 64))
GRAPH_N, GRAPH_P = 4096, 0.25
RECAPTURE_EVERY = 50
FREE_SLACK = 2 * MIB
# Live Python objects (gc.get_objects(): the containers the collector tracks), compared after
# collecting, with a slack of 50 + measured / 200. The fixed part absorbs objects made once, on
# a first use after the warm-up of some path of torch or Python (an internal cache, a warnings
# registry entry), which do not grow with the cycles; a leak does. One object left on every
# cycle exceeds the slack at any cycle count (290 objects against 51 at the default); one left
# on one cycle in k exceeds it when measured / k > 50 + measured / 200, e.g. for k up to 66 at
# the GPU run's 10,000 cycles.
OBJECT_SLACK_FIXED = 50
OBJECT_SLACK_PER_CYCLE = 1 / 200
OOM_REQUEST = dict(batch_size=8, prompt_len=1024, max_out_tokens=2048, dtype="float16",
                   memory_limit_bytes=1 * MIB)  # the prompt alone needs far more than 1 MiB


def live_objects():
    for _ in range(3):
        gc.collect()
    return len(gc.get_objects())




class Soak:
    """One soak run: random cycles over a context, with everything checked as it goes."""

    def __init__(self, torch, ctx, seed):
        self.torch, self.ctx, self.rng = torch, ctx, random.Random(seed)
        self.device = f"cuda:{ctx.device}"
        self.layers = SHAPE.num_layers
        self.counts = collections.Counter()
        self.cycle_no = 0
        self.drop_graph()

    # -- the graph ---------------------------------------------------------------------------
    def drop_graph(self):
        self.graph = self.gx = self.gy = self.gm = self.ga = self.gb = self.gc = None
        self.graph_mask = self.graph_gemm = None
        self.captured_at = 0

    def capture(self):
        t = self.torch
        self.drop_graph()
        self.gx = t.randn(GRAPH_N, device=self.device)
        self.gy = t.empty_like(self.gx)
        self.gm = t.empty(GRAPH_N // 32, dtype=t.int32, device=self.device)
        self.ga = t.randn(32, 48, device=self.device)
        self.gb = t.randn(48, 16, device=self.device)
        self.gc = t.empty(32, 16, device=self.device)
        t.cuda.synchronize()
        graph = t.cuda.CUDAGraph()
        with t.cuda.graph(graph):
            inferctx.dropout(self.gx, GRAPH_P, out=self.gy, mask_out=self.gm)
            inferctx.gemm(self.ga, self.gb, out=self.gc)
        self.graph = graph
        self.captured_at = self.cycle_no
        self.counts["captures"] += 1

    def replay(self):
        t = self.torch
        if self.graph is None or self.cycle_no - self.captured_at >= RECAPTURE_EVERY:
            self.capture()
        self.graph.replay()
        ok, kept = dropout_matches(t, self.gx, self.gy, self.gm, GRAPH_P)
        assert ok, f"cycle {self.cycle_no}: a replayed dropout's y does not match its mask"
        assert 0.65 < kept < 0.85, f"cycle {self.cycle_no}: replay kept {kept}"
        if self.graph_mask is not None:
            assert not t.equal(self.gm, self.graph_mask), (
                f"cycle {self.cycle_no}: a replay drew the previous replay's mask")
        self.graph_mask = self.gm.clone()
        if self.graph_gemm is None:
            err = gemm_error(t, self.gc, self.ga, self.gb)
            assert err <= GEMM_TOL["float32"], f"captured gemm error {err}"
            self.graph_gemm = self.gc.clone()
        else:
            assert t.equal(self.gc, self.graph_gemm), "a replayed gemm changed its result"
        self.counts["replays"] += 1

    # -- the workspace -----------------------------------------------------------------------
    def random_request(self, dtype=None):
        rng = self.rng
        kv = rng.choice((1, 2, 4))
        heads = kv * rng.choice((1, 2))
        head = rng.choice((32, 64, 80, 128))
        shape = ModelShape(rng.randint(1, 6), heads, heads * head, num_kv_heads=kv)
        prompt = rng.randint(1, 64)
        request = dict(batch_size=rng.randint(1, 4), prompt_len=prompt,
                       max_out_tokens=rng.randint(prompt, 512),
                       dtype=dtype or rng.choice(DTYPES),
                       policy="deepspeed" if rng.random() < 0.1 else "exact")
        return shape, request

    def plan(self, failing=False, dtype=None):
        ctx = self.ctx
        if failing:
            before = ctx.plan
            with pytest.raises(WorkspaceOOMError):
                ctx.gen_workspace(SHAPE, **OOM_REQUEST)
            assert ctx.plan == before and ctx.max_token_length == before.max_tokens
            self.counts["refused plans"] += 1
            return
        shape, request = self.random_request(dtype)
        plan = ctx.gen_workspace(shape, **request)
        assert plan.max_tokens == ctx.max_token_length == request["max_out_tokens"], (
            shape, request, plan.max_tokens)
        assert ctx.workspace_bytes == plan.workspace_bytes <= ctx.held_bytes
        self.layers = shape.num_layers
        self.counts["plans"] += 1

    def export(self):
        t, ctx = self.torch, self.ctx
        layer = self.rng.randrange(self.layers)
        k, v = ctx.kv_cache(layer)
        assert k.shape == v.shape == ctx.plan.kv_shape
        kt, vt = t.from_dlpack(k), t.from_dlpack(v)
        assert kt.data_ptr() == k.ptr and vt.data_ptr() == v.ptr
        a, b = float(self.cycle_no % 7 + 1), -float(self.cycle_no % 5 + 1)
        kt.fill_(a)
        vt.fill_(b)  # K and V (and the layers) do not overlap: K keeps its value
        assert bool((kt == a).all() & (vt == b).all()), f"cycle {self.cycle_no}: layer {layer}"
        self.counts["exports"] += 1

    def release_retake(self, keep):
        t, ctx = self.torch, self.ctx
        if keep:
            acts = t.from_dlpack(ctx.activations)
            n = min(4096, acts.numel())
            marker = float(self.cycle_no % 100 + 1)  # exact in every dtype
            acts[:n].fill_(marker)
            del acts
        ctx.release_workspace(keep_contents=keep)
        assert ctx.released and ctx.held_bytes == 0
        with pytest.raises(WorkspaceStateError):
            ctx.kv_cache(0)
        assert ctx.retake_workspace() is True
        assert not ctx.released and ctx.held_bytes >= ctx.workspace_bytes
        if keep:
            acts = t.from_dlpack(ctx.activations)
            assert bool((acts[:n] == marker).all()), f"cycle {self.cycle_no}: contents lost"
        self.counts["releases with contents" if keep else "releases"] += 1

    # -- kernels -----------------------------------------------------------------------------
    def dropout(self, n=None, dtype=None):
        t = self.torch
        n = n or self.rng.choice(DROPOUT_SIZES)
        dtype = dtype or self.rng.choice(DTYPES)
        x = t.randn(n, device=self.device).to(tdtype(t, dtype))
        seed, offset = self.ctx.rng_state  # what the call draws from: increment_offset(4)
        y, m = inferctx.dropout(x, DROPOUT_P)
        assert isinstance(y, t.Tensor) and y.dtype == x.dtype and m.dtype == t.int32
        ok, _ = dropout_matches(t, x, y, m, DROPOUT_P)
        assert ok, f"cycle {self.cycle_no}: dropout of {n} {dtype}"
        self.check_mask(m, seed, offset, DROPOUT_P, n)
        self.counts["dropouts"] += 1

    def check_mask(self, mask, seed, offset, p, n):
        """The mask is the one the independent Philox reference gives at (seed, offset)."""
        words = self.torch.from_dlpack(mask).cpu().numpy().view(np.uint32)
        want = ref.pack_bits(ref.dropout_keep(seed, offset, p, n))
        assert np.array_equal(words, want), (
            f"cycle {self.cycle_no}: a dropout of {n} at offset {offset} drew another mask")

    def view_dropout(self):
        """dropout of a DeviceView (in the workspace): results come from the context's pool."""
        t, ctx = self.torch, self.ctx
        n = min(1024, ctx.workspace_bytes // 4)
        ws = t.from_dlpack(ctx.workspace)
        ws[:4 * n].view(t.float32).fill_(1.5)
        del ws
        seed, offset = ctx.rng_state
        y, m = inferctx.dropout(ctx.workspace.view("float32", (n,)), 0.5)
        assert type(y).__name__ == "DeviceView" and type(m).__name__ == "DeviceView"
        yt, mt = t.from_dlpack(y), t.from_dlpack(m)
        keep = unpack_bits(t, mt, n)
        want = t.where(keep, t.tensor(3.0, device=self.device), t.tensor(0.0, device=self.device))
        assert t.equal(yt, want), f"cycle {self.cycle_no}: dropout of a DeviceView"
        self.check_mask(mt, seed, offset, 0.5, n)
        self.counts["view dropouts"] += 1

    def gemm(self, shape=None, dtype=None):
        t, ctx = self.torch, self.ctx
        m, k, n = shape or self.rng.choice(GEMM_SHAPES)
        dtype = dtype or self.rng.choice(DTYPES)
        dt = tdtype(t, dtype)
        a = t.randn(m, k, device=self.device).to(dt)
        b = t.randn(k, n, device=self.device).to(dt)
        c = inferctx.gemm(a, b)
        assert c.dtype == dt and tuple(c.shape) == (m, n)
        err = gemm_error(t, c, a, b)
        assert err <= GEMM_TOL[dtype], f"cycle {self.cycle_no}: gemm {m}x{k}x{n} {dtype}: {err}"
        nbytes = m * n * a.element_size()
        if ctx.workspace_bytes >= nbytes:  # into the workspace, through a torch export
            out = t.from_dlpack(ctx.workspace)[:nbytes].view(dt).view(m, n)
            inferctx.gemm(a, b, out=out)
            err = gemm_error(t, out, a, b)
            assert err <= GEMM_TOL[dtype], f"cycle {self.cycle_no}: gemm into the workspace: {err}"
        self.counts["gemms"] += 1

    # -- cycles ------------------------------------------------------------------------------
    def warm_up(self):
        """Every kind of step with every variant once, so that lazily loaded kernels, cuBLAS
        workspaces, graph RNG slabs and Python-side caches exist before the first measurement."""
        self.plan(failing=True)
        for dtype in DTYPES:  # the plan's dtype is that of the exports' fills and compares
            self.plan(dtype=dtype)
            self.export()
            self.release_retake(keep=False)
            self.release_retake(keep=True)
            self.view_dropout()
            for n in DROPOUT_SIZES:
                self.dropout(n, dtype)
            for shape in GEMM_SHAPES:
                self.gemm(shape, dtype)
        for _ in range(3):
            self.replay()
        self.capture()
        self.replay()

    def cycle(self):
        rng = self.rng
        self.cycle_no += 1
        self.plan(failing=rng.random() < 0.05)
        self.export()
        if rng.random() < 0.3:
            self.release_retake(keep=rng.random() < 0.5)
        self.dropout()
        if rng.random() < 0.5:
            self.view_dropout()
        self.gemm()
        self.replay()

    def settle(self):
        """The same state at both measurement points: no graph, no view alive, the small plan
        mapped afresh (a release first, so the workspace holds exactly that plan's bytes),
        torch's cache emptied and the pool trimmed. Returns the figures to compare."""
        t, ctx = self.torch, self.ctx
        self.drop_graph()
        t.cuda.synchronize()
        gc.collect()
        assert ctx.views_alive == 0
        ctx.release_workspace()
        plan_small(ctx)
        t.cuda.synchronize()
        gc.collect()
        t.cuda.empty_cache()
        ctx.memory_pool.trim()
        sites = settled_live_sites(ctx)
        t.cuda.synchronize()
        free = t.cuda.mem_get_info(ctx.device)[0]
        pool = ctx.memory_pool.stats()
        return {"free": free, "pool_reserved": pool["reserved_bytes"],
                "pool_used": pool["used_bytes"], "live_sites": sites,
                "held": ctx.held_bytes, "torch_allocated": t.cuda.memory_allocated(ctx.device)}


@pytest.mark.gpu
def test_soak(torch, ctx):
    """INFERCTX_SOAK_CYCLES cycles (default 300): free device memory, the pool's reserved
    bytes, live graph RNG sites and live Python objects do not grow from a measurement after
    warm-up to the end."""
    assert SOAK_CYCLES > WARM_CYCLES, "INFERCTX_SOAK_CYCLES must exceed the warm-up cycles"
    soak = Soak(torch, ctx, SOAK_SEED)
    soak.warm_up()
    for _ in range(WARM_CYCLES):
        soak.cycle()
    start = soak.settle()
    objects_start = live_objects()
    measured = SOAK_CYCLES - WARM_CYCLES
    for _ in range(measured):
        soak.cycle()
    end = soak.settle()
    objects_end = live_objects()

    figures = f"start {start}\nend   {end}\nsteps {dict(soak.counts)}"
    assert soak.counts["replays"] >= SOAK_CYCLES and soak.counts["captures"] >= 2, figures
    assert end["held"] == start["held"], figures
    assert abs(end["free"] - start["free"]) <= FREE_SLACK, (
        f"free device memory moved by {(end['free'] - start['free']) / MIB:+.2f} MiB over "
        f"{measured} cycles\n{figures}")
    assert end["pool_reserved"] <= start["pool_reserved"], figures
    assert end["pool_used"] <= start["pool_used"], figures
    assert end["live_sites"] <= start["live_sites"], figures
    slack = OBJECT_SLACK_FIXED + int(measured * OBJECT_SLACK_PER_CYCLE)
    assert objects_end - objects_start <= slack, (
        f"live Python objects grew by {objects_end - objects_start} over {measured} cycles "
        f"(slack {slack})\n{figures}")


# -- 4. Sticky errors --------------------------------------------------------------------------------

STICKY_TIMEOUT_S = 180

# The fault, by mode. "released": a torch tensor of the workspace written after
# release_workspace (the documented way to end a process's CUDA context; needs CUDA virtual
# memory). "address-8": a CuPy kernel that writes to address 8.
STICKY_SETUP = {
    "released": textwrap.dedent("""
        import torch
        pkg = "torch"
        ctx = InferenceContext.instance(torch.cuda.current_device())
        if not ctx.addresses_stable:
            say("SKIP the workspace is a cudaMalloc allocation here (no CUDA virtual memory)")
            sys.exit(0)
        ctx.gen_workspace(PLAN)
        xp = torch.ones(4096, device="cuda")
        yp, mp = torch.empty_like(xp), torch.empty(128, dtype=torch.int32, device="cuda")
        ap, bp, cp_ = (torch.ones(64, 64, device="cuda") for _ in range(3))

        def fault():
            k = torch.from_dlpack(ctx.kv_cache(0)[0])
            torch.cuda.synchronize()
            ctx.release_workspace()
            k.fill_(1.0)  # the released range has no memory behind it
            torch.cuda.synchronize()
    """),
    "address-8": textwrap.dedent("""
        try:
            import cupy
        except Exception as e:  # noqa: BLE001
            say("SKIP cupy is not usable: " + repr(e))
            sys.exit(0)
        pkg = "cupy"
        ctx = InferenceContext.instance(cupy.cuda.Device().id)
        ctx.gen_workspace(PLAN)
        xp = cupy.ones(4096, dtype=cupy.float32)
        yp, mp = cupy.empty_like(xp), cupy.empty(128, dtype=cupy.uint32)
        ap, bp, cp_ = (cupy.ones((64, 64), dtype=cupy.float32) for _ in range(3))
        poison = cupy.RawKernel(
            'extern "C" __global__ void poison() { *(volatile int*)8 = 1; }', "poison")

        def fault():
            poison((1,), (1,), ())
            cupy.cuda.Device().synchronize()
    """),
}

def sticky_script(mode):
    setup = STICKY_SETUP[mode].replace(
        "ctx.gen_workspace(PLAN)", f"ctx.gen_workspace({CHILD_PLAN})")
    return CHILD_PRELUDE + textwrap.dedent("""
        import inferctx
        from inferctx import ModelShape
        from inferctx.context import InferenceContext
    """) + setup + textwrap.dedent(f"""
        # Operands of no package, in the context's pool (results of p = 0 dropouts of the
        # workspace), and a warm-up of every call before the fault.
        src = ctx.activations.view("float32", (64, 64))
        pa, _ = inferctx.dropout(src, 0.0, mask=None)
        pb, _ = inferctx.dropout(src, 0.0, mask=None)
        pc, _ = inferctx.dropout(src, 0.0, mask=None)
        inferctx.dropout(pa, 0.1)
        inferctx.gemm(pa, pb, out=pc)
        inferctx.dropout(xp, 0.1, out=yp, mask_out=mp)
        inferctx.gemm(ap, bp, out=cp_)
        ctx.sync_comp()
        ctx.stream.synchronize()
        say("NOTE package " + pkg)
        try:
            fault()
            say("NOTE fault not surfaced")
        except Exception as e:  # noqa: BLE001
            say("NOTE fault " + type(e).__name__ + ": " + str(e).replace("\\n", " ")[:300])

        report("gen_workspace", lambda: ctx.gen_workspace({CHILD_PLAN}))
        report("dropout(DeviceView)", lambda: inferctx.dropout(pa, 0.1))
        report("gemm(DeviceView)", lambda: inferctx.gemm(pa, pb, out=pc))
        report("sync_comp", lambda: ctx.sync_comp())
        report("stream.synchronize", lambda: ctx.stream.synchronize())
        report("own_stream.synchronize", lambda: ctx.own_stream.synchronize())
        if ctx.released:
            report("retake_workspace", lambda: ctx.retake_workspace())
        else:
            report("release_workspace", lambda: ctx.release_workspace())
        report("dropout(package, out=)", lambda: inferctx.dropout(xp, 0.1, out=yp, mask_out=mp))
        report("gemm(package, out=)", lambda: inferctx.gemm(ap, bp, out=cp_))
        report("PinnedBuffer", lambda: inferctx.PinnedBuffer(4096))
        report("memory_pool.trim", lambda: ctx.memory_pool.trim())
        report("increment_offset", lambda: ctx.increment_offset(4))
        report("advance_tokens", lambda: ctx.advance_tokens(1))
        say("NOTE calls_done yes")
    """)


# Calls whose GPU work is inferctx's own: each must raise inferctx's CudaError. Releasing a held
# workspace synchronises the device; retaking a released one (mode "released") asks the
# context's stream first, since the driver's virtual memory calls alone need not report the
# context's error.
STICKY_GPU_CALLS = {
    "address-8": ("gen_workspace", "dropout(DeviceView)", "gemm(DeviceView)", "sync_comp",
                  "stream.synchronize", "own_stream.synchronize", "release_workspace"),
    "released": ("gen_workspace", "dropout(DeviceView)", "gemm(DeviceView)", "sync_comp",
                 "stream.synchronize", "own_stream.synchronize", "retake_workspace"),
}
# Calls on another package's arrays: the package may notice the error first; they must raise.
STICKY_PACKAGE_CALLS = ("dropout(package, out=)", "gemm(package, out=)")


@functools.lru_cache(maxsize=None)
def sticky_child(mode):
    return run_child(sticky_script(mode), timeout=STICKY_TIMEOUT_S)


def checked_sticky_child(mode):
    child = sticky_child(mode)
    if "skip" in child.notes:
        # CuPy that this process can import must work in the child too: not a reason to skip.
        import importlib.util

        if "cupy" in child.notes["skip"] and importlib.util.find_spec("cupy") is not None:
            pytest.fail("the child could not use CuPy, which is installed:\n" + describe(child))
        pytest.skip(child.notes["skip"])
    text = describe(child)
    assert not child.timed_out, "hang:\n" + text
    assert child.notes.get("calls_done") == "yes", text
    fault = child.notes.get("fault", "")
    assert fault and "not surfaced" not in fault, "the kernel fault did not surface:\n" + text
    # The fault is CUDA's (an illegal address, a launch failure), not any exception of the setup.
    assert any(word in fault.lower() for word in ("illegal", "launch failure", "cuda")), (
        "the fault raised something other than a CUDA error:\n" + text)
    return child, text


@pytest.mark.gpu
@pytest.mark.parametrize("mode", sorted(STICKY_SETUP))
def test_sticky_error_every_gpu_call_raises_cuda_error(mode):
    child, text = checked_sticky_child(mode)
    for name in STICKY_GPU_CALLS[mode]:
        r = child.results.get(name)
        assert r is not None, f"{name} was not called:\n{text}"
        assert r["raised"] is not None, f"{name} returned after a sticky error:\n{text}"
        assert r["cuda"], f"{name} raised {r['raised']}, not inferctx's CudaError:\n{text}"
        assert r["code_name"], f"{name} names no CUDA error:\n{text}"
    for name in STICKY_PACKAGE_CALLS:
        r = child.results[name]
        assert r["raised"] is not None, f"{name} returned after a sticky error:\n{text}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", sorted(STICKY_SETUP))
def test_sticky_error_message_says_restart(mode):
    child, text = checked_sticky_child(mode)
    # (retake_workspace maps memory through the driver's virtual-memory calls, which may still
    # succeed in a lost context; the calls checked are those that reach the runtime.)
    for name in STICKY_GPU_CALLS[mode]:
        r = child.results.get(name)
        assert r is not None and r["cuda"], f"{name}:\n{text}"
        assert "restart" in r["message"].lower(), f"{name}: {r['message']}"


# -- 5. Races on the context's shared state ----------------------------------------------------------

RACE_ROUNDS = 150
STREAM_SWITCHES = 300


def run_together(fns, timeout=JOIN_TIMEOUT_S):
    """Runs each of `fns` in a thread of its own, all released at once by a barrier; returns the
    tracebacks of those that raised. A thread still alive after `timeout` fails the test."""
    go = threading.Barrier(len(fns), timeout=BARRIER_TIMEOUT_S)
    errors = []

    def run(fn):
        try:
            go.wait()
            fn()
        except BaseException:  # noqa: BLE001 - reported by the caller
            go.abort()
            errors.append(traceback.format_exc())

    pool = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in fns]
    for t in pool:
        t.start()
    deadline = time.monotonic() + timeout
    for t in pool:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in pool):
        faulthandler.dump_traceback(all_threads=True)
        pytest.fail(f"deadlock: threads still running after {timeout} s")
    return errors


@pytest.mark.gpu
def test_racing_release_and_retake_leave_the_refusal_in_step_with_the_workspace(torch, ctx):
    """A release in one thread and a retake in another, started together while a third thread
    keeps the GIL busy: afterwards the compiled fast paths refuse (gemm's returns NotImplemented
    while a workspace is released) exactly when the workspace is released. A thread that read the
    released state, lost the GIL, and applied it after the other thread's release had noted the
    newer state, took the released workspace out of the list that refuses its kernels (the next
    one on it would have been an illegal memory access), or left a held one in it."""
    if not ctx.addresses_stable:
        pytest.skip("under the cudaMalloc fallback a released workspace has no addresses to refuse")
    dev = f"cuda:{ctx.device}"
    a = torch.ones(16, 32, device=dev, dtype=torch.float16)
    b = torch.ones(32, 8, device=dev, dtype=torch.float16)
    inferctx.gemm(a, b)  # the general path works out the layout the fast path then finds

    def fast_path_refuses():
        # Only torch's own tensors: nothing here touches the workspace, released or not.
        got = _core._torch_gemm(2, a, b, None, False, False, 1.0, 0.0, None, False)
        return got is NotImplemented

    assert not ctx.released and not fast_path_refuses()
    stop = threading.Event()

    def hog():  # bytecode only: it gives the GIL up only when another thread asks for it
        n = 0
        while not stop.is_set():
            n += 1

    hogger = threading.Thread(target=hog, daemon=True)
    hogger.start()
    wrong = []
    try:
        for r in range(RACE_ROUNDS):
            errors = run_together([lambda: ctx.release_workspace(), lambda: ctx.retake_workspace()])
            assert not errors, "\n".join(errors)
            released = ctx.released
            if fast_path_refuses() != released:
                wrong.append((r, "released" if released else "held"))
            if released:
                ctx.retake_workspace()
            if fast_path_refuses():
                wrong.append((r, "held after a retake"))
    finally:
        stop.set()
        hogger.join(timeout=JOIN_TIMEOUT_S)
        if ctx.released:
            ctx.retake_workspace()
    torch.cuda.synchronize()
    assert not wrong, (f"rounds where the fast path's refusal disagreed with the workspace's state "
                       f"(round, state): {wrong[:10]}")


@pytest.mark.gpu
def test_ctx_stream_keeps_alive_the_adopted_stream_it_names(ctx):
    """ctx.stream read in one thread while another adopts stream after stream (each kept only by
    the context): every Stream it returns for an adopted stream keeps that very stream alive. One
    made between use_stream's switch of the C++ stream and its storing the new object had the new
    handle but kept the previous object alive, and the stream it named was destroyed at the next
    switch while the Stream was still held."""

    class Adopted(inferctx.Stream):
        pass

    adopted_handles = set()
    done = threading.Event()
    wrong = []
    checked = [0]

    def switcher():
        try:
            for _ in range(STREAM_SWITCHES):
                s = Adopted(device=ctx.device)
                adopted_handles.add(s.handle)
                ctx.use_stream(s)
                del s  # the context alone keeps it now
            ctx.use_stream(None)
        finally:
            done.set()

    def reader():
        while not done.is_set():
            s = ctx.stream
            if s.handle not in adopted_handles:
                continue  # the own stream, or torch's current one (before and after)
            checked[0] += 1
            # What the returned Stream keeps alive (its source object).
            kept = [o for o in gc.get_referents(s) if isinstance(o, Adopted)]
            if not any(o.handle == s.handle for o in kept):
                wrong.append(f"{s!r} keeps {[hex(o.handle) for o in kept]} alive")

    errors = run_together([switcher, reader])
    assert not errors, "\n".join(errors)
    ctx.use_stream(None)
    assert checked[0] > 0, "the reader never saw an adopted stream"
    assert not wrong, f"{len(wrong)} of {checked[0]} Streams keep another stream alive: {wrong[:5]}"


PARTIAL_TORCH_SCRIPT = CHILD_PRELUDE + textwrap.dedent("""
    import importlib.machinery, sys, types
    from inferctx import _core

    # torch as another thread's `import torch` leaves it part way: in sys.modules, with Tensor,
    # its dtypes and _C, but not yet the functions bound further down its __init__ (empty_like).
    torch = types.ModuleType("torch")
    torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    torch.__spec__._initializing = True  # as the import system marks a module being imported
    asked = []

    class Tensor:
        def get_device(self):
            asked.append(1)  # the fast path took it for a torch tensor
            return -1  # a CPU tensor: the fast path leaves it to the general one

    torch.Tensor = Tensor
    torch.bfloat16 = object()
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda device: 0)
    sys.modules["torch"] = torch
    a, b = Tensor(), Tensor()

    def fast_gemm():
        before = len(asked)
        got = _core._torch_gemm(2, a, b, None, False, False, 1.0, 0.0, None, False)
        return (got, len(asked) > before)

    report("while importing", fast_gemm)
    # The rest of its __init__ runs (no module is imported after this point) and the import ends.
    torch.empty_like = lambda x: x
    torch.__spec__._initializing = False
    report("once imported", fast_gemm)
""")


def test_a_torch_being_imported_in_another_thread_is_learned_once_complete():
    """A kernel call while another thread is still importing torch (torch in sys.modules without
    all of its functions yet) neither raises nor leaves the package caches half set, and once the
    import is done the next call learns torch, although no module was imported since. (A first
    look that met torch part way set the dtype table, then raised AttributeError for
    torch.empty_like, and every later gemm raised TypeError on the type cache left None.)"""
    child = run_child(PARTIAL_TORCH_SCRIPT, timeout=120)
    text = describe(child)
    assert child.rc == 0 and not child.timed_out, text
    for name, learned in (("while importing", False), ("once imported", True)):
        r = child.results.get(name)
        assert r is not None, f"{name} was not called:\n{text}"
        assert r["raised"] is None, f"{name}: raised {r['raised']}: {r['message']}\n{text}"
        assert r["message"] == repr((NotImplemented, learned)), f"{name}: {r['message']}\n{text}"

"""Threads and processes on the paths that need no GPU: the package's first import, the GEMM cache
file. Each race runs in a child interpreter of its own (a fresh import, forks, time limits), its
threads started together by a barrier; a child that hangs is ended by its own deadlines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

N_THREADS = 16


def _child(script: str, *args: str, timeout: float = 60) -> str:
    """Runs `script` in a new interpreter (this one's environment); its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _core_loads_here() -> bool:
    out = subprocess.run([sys.executable, "-c", "import inferctx._core"], capture_output=True)
    return out.returncode == 0


# ---------------------------------------------------------------------------------------
# The first import


_CORE_DURING_FIRST_IMPORT = """
    import json, os, sys, threading, time
    N = int(sys.argv[1])
    barrier = threading.Barrier(N)
    errors, during = [], []

    def work(i):
        try:
            barrier.wait()
            if i == 0:
                import inferctx
                return
            # Once the package has begun loading its own modules; the import system does not
            # wait for a package that another thread is still importing.
            while "inferctx.errors" not in sys.modules:
                time.sleep(0.0002)
            package = sys.modules["inferctx"]
            during.append(getattr(package.__spec__, "_initializing", False))
            import inferctx._core
        except BaseException as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    core = sys.modules.get("inferctx._core")
    loader = type(getattr(getattr(core, "__spec__", None), "loader", None)).__name__
    print(json.dumps({"errors": sorted(set(errors)), "during": any(during), "loader": loader,
                      "hung": sum(t.is_alive() for t in threads)}))
    sys.stdout.flush()
    os._exit(0)
"""


def test_the_gpu_module_imported_while_another_thread_runs_the_first_import_gets_cublas():
    # A thread importing inferctx._core (as `from inferctx._core import ...`) finds the package
    # in sys.modules as soon as another thread's `import inferctx` has begun. The finder that
    # loads cuBLAS first (and then inferctx.context) was installed only at the end of the
    # package's import, so such a thread loaded the extension without it: ImportError
    # "libcublas.so.13: cannot open shared object file" where cuBLAS comes from the wheel.
    if not _core_loads_here():
        pytest.skip("the GPU module cannot be loaded here at all")
    exercised = 0
    for _ in range(4):
        result = json.loads(_child(_CORE_DURING_FIRST_IMPORT, str(N_THREADS)))
        assert result["hung"] == 0
        assert result["errors"] == [], result["errors"]
        assert result["loader"] == "_ThenContext", result  # loaded through the package's finder
        exercised += result["during"]
    assert exercised, "no trial imported inferctx._core while the package was still loading"


# ---------------------------------------------------------------------------------------
# The GEMM cache file

# The in-process cache needs a GPU to hold entries: the children stand in one entry for it
# (what save_gemm_cache writes), through _core's export.
_ENTRY = """
    import importlib, inferctx
    from inferctx import _core
    gm = importlib.import_module("inferctx.gemm")

    def entry(m):
        p = _core._gemm_packed_problem(1, m, 64, 64, 1, False, False, False)
        return {"device": 0, "device_name": "NVIDIA H100", "cublas_version": 130000, "problem": p,
                "align_a": 256, "align_b": 256, "align_c": 256, "backend": 1, "algo": [], "time_ms": 0.1}
"""

_FIRST_SAVE_RACE = _ENTRY + """
    import json, os, sys, threading, time
    path, N = sys.argv[1], int(sys.argv[2])
    mine = [entry(8)]
    _core._gemm_cache_export = lambda tuned_only: list(mine)
    real_realpath = os.path.realpath
    local = threading.local()

    def slow_realpath(p, *args, **kwargs):
        # A slow file system: the first lookup of each waiting thread takes a while, during which
        # the first save makes the file.
        if getattr(local, "slow", False):
            local.slow = False
            time.sleep(0.3)
        return real_realpath(p, *args, **kwargs)

    os.path.realpath = slow_realpath
    barrier = threading.Barrier(N)
    outcomes = [None] * N

    def work(i):
        barrier.wait()
        try:
            if i == 0:  # the first save, which makes the file
                time.sleep(0.1)
                outcomes[i] = ("saved", gm.save_gemm_cache(path))
                return
            local.slow = True
            if i % 2:
                outcomes[i] = ("saved", gm.save_gemm_cache(path))
            else:
                outcomes[i] = ("loaded", gm.load_gemm_cache(path))
        except BaseException as exc:
            outcomes[i] = ("error", f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    print(json.dumps({"outcomes": outcomes, "hung": sum(t.is_alive() for t in threads)}))
    sys.stdout.flush()
    os._exit(0)
"""


def test_saves_and_loads_racing_the_save_that_makes_the_file_all_succeed(tmp_path):
    # save_gemm_cache / load_gemm_cache looked at the name twice: it did not exist, then what it
    # resolves to did (made meanwhile by another thread's or process's first save), and the call
    # was refused with "names no file the system can open, yet resolves to the existing ...":
    # a save's entries went unsaved, a load failed on a good file.
    for trial in range(2):
        path = tmp_path / f"gemm{trial}.json"
        result = json.loads(_child(_FIRST_SAVE_RACE, str(path), str(N_THREADS)))
        assert result["hung"] == 0
        errors = [o[1] for o in result["outcomes"] if o[0] == "error"]
        assert errors == [], errors
        assert sorted({o[0] for o in result["outcomes"]}) == ["loaded", "saved"]
        assert all(o[1] == 1 for o in result["outcomes"] if o[0] == "saved")
        document = json.loads(path.read_text())
        assert [e["m"] for e in document["entries"]] == [8]
        assert sorted(p.name for p in tmp_path.iterdir()) == [f"gemm{i}.json" for i in range(trial + 1)]


_FORK_DURING_SAVE = _ENTRY + """
    import json, os, sys, threading, time
    path, N = sys.argv[1], int(sys.argv[2])
    mine = [entry(16)]
    _core._gemm_cache_export = lambda tuned_only: list(mine)
    with open(path, "w") as f:
        json.dump({"format": "inferctx-gemm-cache", "version": 1,
                   "entries": [gm._entry_to_json(entry(8))]}, f)
    parent = os.getpid()
    inside, go_on = threading.Event(), threading.Event()
    real_read = gm._read_cache_file

    def held_read(p):
        # The first save stays inside its merge (the folder locked) until the fork is made.
        if os.getpid() == parent and not inside.is_set():
            inside.set()
            go_on.wait()
        return real_read(p)

    gm._read_cache_file = held_read
    first = threading.Thread(target=gm.save_gemm_cache, args=(path,))
    first.start()
    inside.wait()
    child = os.fork()
    if child == 0:  # a worker forked meanwhile (multiprocessing's "fork"): it saves, then ends
        mine[:] = [entry(24)]
        gm.save_gemm_cache(path)
        os._exit(0)
    time.sleep(0.2)
    go_on.set()
    first.join(10)
    barrier = threading.Barrier(N)
    saved = []

    def work():
        barrier.wait()
        saved.append(gm.save_gemm_cache(path))

    threads = [threading.Thread(target=work) for _ in range(N)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    child_status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            child_status = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.02)
    else:
        os.kill(child, 9)
        os.waitpid(child, 0)
    print(json.dumps({"first_hung": first.is_alive(), "hung": sum(t.is_alive() for t in threads),
                      "saved": len(saved), "child": child_status}))
    sys.stdout.flush()
    os._exit(0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_process_forked_during_a_save_leaves_the_folder_lock_to_its_parent(tmp_path):
    # The merge's flock belongs to the open file description of the folder, which a child forked
    # during the save shares: the lock stayed held after the parent's save, for as long as the
    # child lived. The child's own save waited for it (forever), and so did every later save of
    # the parent and of any other process into that folder.
    path = tmp_path / "gemm.json"
    result = json.loads(_child(_FORK_DURING_SAVE, str(path), str(N_THREADS)))
    assert result == {"first_hung": False, "hung": 0, "saved": N_THREADS, "child": 0}, result
    entries = json.loads(path.read_text())["entries"]
    assert sorted(e["m"] for e in entries) == [8, 16, 24]  # the merges kept every process's entry

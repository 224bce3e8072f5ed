"""The README's GPU example runs, as written, on a GPU (its planning examples are tested with
the planner)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def _section_code(title: str) -> str:
    text = open(README, encoding="utf-8").read()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)
    assert len(blocks) == 1, f"README section {title!r} has {len(blocks)} python blocks"
    return blocks[0]


def test_the_gpu_example_is_in_the_readme():
    code = _section_code("On a GPU")
    for name in ("inferctx.dropout(x, 0.1)", "inferctx.gemm(a, w)", "ctx.sync_comp()"):
        assert name in code


@pytest.mark.gpu
def test_the_gpu_example_runs_as_written(tmp_path):
    torch = pytest.importorskip("torch")
    import gc

    import inferctx

    # The example plans against the device's free memory: this process gives back what earlier
    # tests hold (its workspace, torch's cache, the pool's unused blocks).
    ctx = inferctx.InferenceContext.instance(0)
    gc.collect()
    if ctx.workspace_bytes and not ctx.released:
        ctx.release_workspace(force=True)
    torch.cuda.empty_cache()
    ctx.memory_pool.trim()
    code = _section_code("On a GPU")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[0] == "0.0"  # c and c_buf agree, unsynchronised
    assert (tmp_path / "gemm.json").exists()
    # autotune_gemm wrote the tuned (8, 4096, 4096) bf16 problem to the cache file.
    import json

    doc = json.loads((tmp_path / "gemm.json").read_text())
    assert doc["format"] == "inferctx-gemm-cache" and doc["version"] == 1
    assert [(e["dtype"], e["m"], e["n"], e["k"], e["batch"]) for e in doc["entries"]] == [
        ("bfloat16", 8, 4096, 4096, 1)]

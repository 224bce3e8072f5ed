"""The scripts under tools/, checked where they can be without a GPU: they parse, gpu-suite
refuses a step it does not know, and its fuzz step runs every GPU fuzz suite there is."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import shutil
import subprocess

import pytest

TOP = pathlib.Path(__file__).resolve().parents[2]
BASH_SCRIPTS = ("gpu-suite", "run-tests", "bench-run")

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@needs_bash
@pytest.mark.parametrize("name", BASH_SCRIPTS)
def test_any_machine_each_bash_script_parses(name):
    path = TOP / "tools" / name
    assert path.read_text().startswith("#!/usr/bin/env bash\n")
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@needs_bash
def test_any_machine_gpu_suite_refuses_an_unknown_step(tmp_path):
    done = subprocess.run(["bash", str(TOP / "tools" / "gpu-suite"), "nosuchstep"], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "unknown step nosuchstep" in done.stderr


def _default_fuzz_suites():
    script = (TOP / "tools" / "gpu-suite").read_text()
    found = re.findall(r"\$\{FUZZ_SUITES:-([a-z_ ]+)\}", script)
    assert len(found) == 1, found
    return found[0].split()


def test_any_machine_the_fuzz_step_runs_every_gpu_fuzz_suite():
    """Each name in gpu-suite's default list selects exactly one hypothesis test of
    test_fuzz_gpu.py (pytest -k test_gpu_NAME), and every such test is named once."""
    module = importlib.import_module("test_fuzz_gpu")
    suites = sorted(name[len("test_gpu_"):] for name, fn in inspect.getmembers(module, inspect.isfunction)
                    if name.startswith("test_gpu_") and hasattr(fn, "hypothesis"))
    listed = _default_fuzz_suites()
    assert len(listed) == len(set(listed)), listed
    assert sorted(listed) == suites
    for name in listed:  # -k matches substrings: no suite's name may contain another's
        assert [s for s in suites if name in s] == [name], name

"""The scripts under tools/, checked where they can be without a GPU: they parse, gpu-suite
refuses a step it does not know, its fuzz step runs every GPU fuzz suite there is, and the
commands the docs give for gpu-suite and bench-run name steps, variables, files and benchmarks
that exist."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import shutil
import subprocess

import pytest

TOP = pathlib.Path(__file__).resolve().parents[2]
BASH_SCRIPTS = ("gpu-suite", "run-tests", "bench-run", "host-sanitize")

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
    assert suites, "test_fuzz_gpu.py has no hypothesis suite named test_gpu_*"
    assert len(listed) == len(set(listed)), listed
    assert sorted(listed) == suites
    for name in listed:  # -k matches substrings: no suite's name may contain another's
        assert [s for s in suites if name in s] == [name], name


def _documented_commands(script):
    """Each command in backquotes in README.md and docs/*.md that runs tools/`script`: the
    variables it sets and the words after the script's name."""
    found = []
    for page in [TOP / "README.md", *sorted((TOP / "docs").glob("*.md"))]:
        for text in re.findall(r"`([^`]*tools/%s\b[^`]*)`" % re.escape(script), page.read_text()):
            before, after = text.split(f"tools/{script}", 1)
            env = dict(re.findall(r'([A-Z][A-Z0-9_]*)=("[^"]*"|\S+)', before))
            found.append((page.name, {k: v.strip('"') for k, v in env.items()}, after.split()))
    return found


def _gpu_suite_steps():
    script = (TOP / "tools" / "gpu-suite").read_text()
    return set(re.findall(r"^    ([a-z]+)\)$", script, re.M))


def test_any_machine_the_steps_and_variables_the_docs_give_gpu_suite_exist():
    """A documented gpu-suite command names only steps the script has and sets only variables
    that the scripts or the tests read; its suites, files and executables exist."""
    steps = _gpu_suite_steps()
    assert {"build", "tests", "faults", "sanitize", "pysanitize", "fuzz", "bench"} <= steps
    scripts = "".join((TOP / "tools" / s).read_text() for s in BASH_SCRIPTS)
    tests = "".join(p.read_text() for p in (TOP / "tests" / "python").glob("*.py"))
    commands = _documented_commands("gpu-suite")
    assert len(commands) >= 5, commands
    for page, env, words in commands:
        assert set(words) <= steps, (page, words)
        for name, value in env.items():
            is_read = "${%s" % name in scripts or f'"{name}"' in tests  # ${NAME...} or os.environ["NAME"]
            assert is_read, f"{page}: {name} is read by no script under tools/ and no test"
            if name == "FUZZ_SUITES" and value != "SUITE":
                assert set(value.split()) <= set(_default_fuzz_suites()), (page, value)
            if name == "SANITIZE_TESTS":
                for exe in value.split():
                    stem = pathlib.Path(exe).name
                    assert exe == f"build/ctest/tests/cpp/{stem}", (page, exe)
                    assert list((TOP / "tests" / "cpp").glob(stem + ".c*")), (page, exe)
            if name == "PYSANITIZE_TESTS" and value != "...":
                # Files, then optionally pytest's -k and its expression (the step passes the words on).
                words = value.split()
                if "-k" in words:
                    at = words.index("-k")
                    assert at == len(words) - 2 and at > 0, (page, value)
                    words = words[:at]
                for f in words:
                    assert (TOP / f).is_file(), (page, f)


def test_any_machine_the_benchmarks_the_docs_give_bench_run_exist():
    commands = _documented_commands("bench-run")
    assert len(commands) >= 2, commands
    for page, _, words in commands:
        assert words, (page, "tools/bench-run with no benchmark")
        for name in (w for w in words if w != "NAME..."):  # NAME...: the usage line
            assert (TOP / "bench" / f"{name}.py").is_file(), (page, name)

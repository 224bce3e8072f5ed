"""The public API type-checks: mypy --strict on a user's script (tests/python/typing/user_script.py)
that plans, catches the errors by their fields, and uses the GPU names (never run, only checked)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "typing" / "user_script.py"


def mypy(tmp_path, source, *flags):
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install '.[test]'")
    script = tmp_path / "user_script.py"
    script.write_text(source)
    # run outside the repository, so that the installed package (with py.typed) is checked
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", *flags, str(script)],
                          capture_output=True, text=True, cwd=tmp_path)


@pytest.mark.parametrize("flags", [(), ("--python-version", "3.10")])
def test_user_script_passes_mypy_strict(tmp_path, flags):
    # Also as a user on Python 3.10 checks it (requires-python), whose typing has no Self.
    r = mypy(tmp_path, SCRIPT.read_text(), *flags)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found" in r.stdout


@pytest.mark.parametrize("flags", [(), ("--python-version", "3.10")])
def test_the_context_instance_is_typed_on_every_supported_python(tmp_path, flags):
    # InferenceContext.instance() is an InferenceContext, not Any, also for Python 3.10 (a stub
    # that imported typing.Self made it Any there): into an int it is an error.
    r = mypy(tmp_path, "import inferctx\n"
                       "n: int = inferctx.InferenceContext.instance(0)\n", *flags)
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r'user_script\.py:2: error: Incompatible types in assignment \(expression has type '
                     r'"InferenceContext", variable has type "int"\)', r.stdout), r.stdout


def test_mypy_sees_wrong_uses(tmp_path):
    # The same checker refuses a misuse: the stubs carry real types, not Any everywhere.
    r = mypy(tmp_path, "import inferctx\n"
                       "x: str = inferctx.plan_workspace('llama-2-7b', batch_size=1, prompt_len=1,\n"
                       "                                 max_out_tokens=4, gpu='h200').max_tokens\n"
                       "e = inferctx.WorkspaceOOMError('m')\n"
                       "y: str = e.max_batch_size\n"
                       "inferctx.gemm(1, 2, alpha='x')\n")
    assert r.returncode == 1
    assert r.stdout.count("error:") == 3, r.stdout
    # One error at each misuse: the int max_tokens and the int-or-None max_batch_size into a str
    # (lines 2 and 5), and alpha='x' for gemm's float (line 6).
    found = sorted((int(m.group(1)), m.group(2)) for m in
                   re.finditer(r"user_script\.py:(\d+): error: .*\[([a-z-]+)\]$", r.stdout, re.M))
    assert found == [(2, "assignment"), (5, "assignment"), (6, "arg-type")], r.stdout
    assert re.search(r':6: error: Argument "alpha" .*"str".*"float"', r.stdout), r.stdout
    shutil.rmtree(tmp_path / ".mypy_cache", ignore_errors=True)


def test_planning_modules_pass_mypy_strict(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install '.[test]'")
    import inferctx

    # a copy of the installed package's sources and stubs, checked as sources
    copy = tmp_path / "inferctx"
    shutil.copytree(Path(inferctx.__file__).parent, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    modules = ("__init__", "errors", "dtypes", "planning", "_plan_args", "_model_shape", "_workspace_plan",
               "presets", "cli", "_libs")
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental",
                        *(f"inferctx/{m}.py" for m in modules)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr

"""The `inferctx` command line: output, JSON, sweeps, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from inferctx.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_readme_command(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h100-80gb", "--batch", "8",
                       "--max-tokens", "4096")
    assert code == 0
    assert "max tokens 4096" in out and "28,454,158,336 bytes" in out


def test_json_output(capsys):
    code, out, _ = run(capsys, "plan", "--layers", "32", "--heads", "32", "--hidden", "4096", "--free-gb", "8",
                       "--total-gb", "80", "--batch", "8", "--max-tokens", "2048", "--policy", "deepspeed",
                       "--json")
    assert code == 0
    d = json.loads(out)
    assert d["plan"]["max_tokens"] == 1367 and d["request"]["policy"] == "deepspeed"


def test_kv_heads_override(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--kv-heads", "8", "--gpu", "h200", "--json")
    assert code == 0 and json.loads(out)["request"]["num_kv_heads"] == 8


def test_sweep(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-70b", "--free-gb", "40", "--max-tokens", "100000",
                       "--sweep-batch", "4", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["batch_size"] for r in rows] == [1, 2, 3, 4]
    tokens = [r["max_tokens"] for r in rows]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] > tokens[-1] > 0


def test_plot(capsys, tmp_path):
    path = tmp_path / "curve.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        code, _, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "3",
                           "--plot", str(path))
        assert code == 2 and "pip install 'inferctx[plot]'" in err
        return
    code, _, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "3",
                     "--plot", str(path))
    assert code == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_presets_listing(capsys):
    code, out, _ = run(capsys, "presets")
    assert code == 0 and "llama-2-70b" in out and "h100-80gb" in out
    code, out, _ = run(capsys, "presets", "--json")
    assert json.loads(out)["models"]["falcon-7b"]["num_kv_heads"] == 1


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--preset", "nope", "--gpu", "h200"], "unknown model preset"),
    (["plan", "--preset", "llama-2-7b", "--gpu", "nope"], "unknown GPU preset"),
    (["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--batch", "x"], "--batch"),
    (["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--batch", "0"], "--batch: got 0"),
    (["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--dtype", "int4"], "dtype"),
    (["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--policy", "x"], "--policy"),
    (["plan", "--layers", "32", "--gpu", "h200"], "--hidden"),
    (["plan", "--preset", "llama-2-70b", "--gpu", "rtx-4090", "--batch", "64", "--prompt-len", "2048",
      "--max-tokens", "4096"], "WorkspaceOOMError"),
    (["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--free-gb", "3"], "not both"),
    (["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--plot", "x.png"], "--sweep-batch"),
    (["frobnicate"], "invalid choice"),
])
def test_errors_are_one_line_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_console_script_and_module_entry():
    r = subprocess.run([sys.executable, "-m", "inferctx", "plan", "--preset", "mistral-7b", "--gpu", "l40s",
                        "--batch", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("inferctx: ") and "Traceback" not in r.stderr

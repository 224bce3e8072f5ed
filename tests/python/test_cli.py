"""The `inferctx` command line: output, JSON, sweeps, answers, and one-line errors with exit code 2."""

import io
import json
import subprocess
import sys

import pytest

from inferctx import plan_workspace
from inferctx.cli import main
from inferctx.presets import gpu_preset, model_preset

GIB, MIB = 1 << 30, 1 << 20


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_readme_command_counts_the_weights(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h100-80gb", "--batch", "8",
                       "--max-tokens", "4096")
    assert code == 0
    assert "max tokens 4096" in out and "28,454,158,336 bytes" in out
    # 6,738,415,616 parameters x 2 B = 12.55 GiB; free 81559 - 1244 MiB = 78.43 GiB; planned 65.88 GiB
    assert "weights    12.55 GiB still to load (6,738,415,616 parameters x 2 B)" in out
    assert "free 78.43 GiB of 79.65 GiB (GPU preset h100-80gb" in out
    assert "against 65.88 GiB free after the weights" in out


def test_json_output(capsys):
    code, out, _ = run(capsys, "plan", "--layers", "32", "--heads", "32", "--hidden", "4096", "--free-gb", "8",
                       "--total-gb", "80", "--batch", "8", "--max-tokens", "2048", "--policy", "deepspeed",
                       "--json")
    assert code == 0
    d = json.loads(out)
    assert d["plan"]["max_tokens"] == 1367 and d["request"]["policy"] == "deepspeed"
    assert d["request"]["weights_bytes"] == 0 and d["sources"]["weights"] == "none"


def test_json_has_the_weights_and_the_memory_planned_against(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h100-80gb", "--json")
    d = json.loads(out)
    free = (81559 - 1244) * MIB
    assert code == 0 and d["request"]["weights_bytes"] == 13_476_831_232 and d["request"]["free_bytes"] == free
    assert d["plan"]["planned_free_bytes"] == free - 13_476_831_232
    assert d["sources"]["memory"].startswith("GPU preset h100-80gb")
    # ... and as fields, which a program reads without parsing those words
    assert {k: d["sources"][k] for k in ("memory_from", "gpu_preset", "device", "weights_from")} == {
        "memory_from": "gpu_preset", "gpu_preset": "h100-80gb", "device": None, "weights_from": "parameters"}
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "30", "--weights-gb", "2", "--json")
    d = json.loads(out)
    assert code == 0 and (d["sources"]["memory_from"], d["sources"]["gpu_preset"], d["sources"]["weights_from"],
                          d["sources"]["weights"]) == ("given", None, "given", "given")


@pytest.mark.parametrize("flags,weights", [
    (["--gpu", "h200"], 13_476_831_232),                      # auto with a preset and a GPU preset
    (["--gpu", "h200", "--weights", "none"], 0),
    (["--gpu", "h200", "--weights-gb", "1.5"], 3 * GIB // 2),
    (["--free-gb", "40"], 0),                                 # free memory given: taken as after loading
    (["--free-gb", "40", "--weights", "auto"], 13_476_831_232),
    (["--gpu", "h200", "--mp-size", "4"], 13_476_831_232 // 4),
    (["--gpu", "h200", "--dtype", "fp32"], 26_953_662_464),
])
def test_weights_flags(capsys, flags, weights):
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--json", *flags)
    assert code == 0 and json.loads(out)["request"]["weights_bytes"] == weights


def test_weights_make_an_impossible_plan_an_error(capsys):
    code, _, err = run(capsys, "plan", "--preset", "llama-3.1-405b", "--gpu", "rtx-4090")
    assert code == 2 and "the weights (755.96 GiB) exceed free memory 22.77 GiB" in err and "--mp-size" in err
    # the example: 512 sequences of 8192 tokens no longer fill the whole H100
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h100-80gb", "--batch", "512",
                       "--max-tokens", "8192", "--json")
    d = json.loads(out)
    assert code == 0 and d["plan"]["bound_by"] == "memory"
    assert d["plan"]["workspace_bytes"] + d["request"]["weights_bytes"] <= gpu_preset("h100-80gb").free_bytes
    # Budget 80315 MiB - 13,476,831,232 B of weights - 500 MiB = 70,215,262,208 B; a token of 512
    # sequences takes 512 x (606,208 + 32x8192x2) = 578,813,952 B: 121 tokens (70,036,488,192 B).
    assert d["plan"]["budget_bytes"] == 80315 * MIB - 13_476_831_232 - 500 * MIB == 70_215_262_208
    assert d["plan"]["max_tokens"] == 121 and d["plan"]["workspace_bytes"] == 121 * 578_813_952


def test_kv_heads_and_head_dim_override(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--kv-heads", "8", "--gpu", "h200", "--json")
    assert code == 0 and json.loads(out)["request"]["num_kv_heads"] == 8
    code, out, _ = run(capsys, "plan", "--layers", "28", "--heads", "16", "--hidden", "3072", "--head-dim", "256",
                       "--free-gb", "40", "--max-tokens", "16", "--json")
    # Gemma-7B's attention: activations 10 x 16 x 256 x 16 tokens x 2 B
    assert code == 0 and json.loads(out)["plan"]["activations_bytes"] == 10 * 16 * 256 * 16 * 2


def test_max_batch_and_most_tokens(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h100-80gb", "--max-tokens", "4096",
                       "--max-batch", "--json")
    d = json.loads(out)
    b = d["max_batch_size"]
    assert code == 0 and d["plan"]["max_tokens"] == 4096 and d["request"]["batch_size"] == b
    # A sequence of 4096 tokens with max_out_tokens 4096: 4096 x (606,208 + 32x4096x2) =
    # 3,556,769,792 B; the budget 70,215,262,208 B (80315 MiB less the weights and 500 MiB)
    # holds 19 of them (67,578,626,048 B), not 20.
    assert b == 70_215_262_208 // 3_556_769_792 == 19
    kw = dict(prompt_len=1, max_out_tokens=4096, gpu="h100-80gb")
    assert plan_workspace("llama-2-7b", batch_size=b, **kw).max_tokens == 4096
    assert plan_workspace("llama-2-7b", batch_size=b + 1, **kw).max_tokens < 4096
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h100-80gb", "--batch", "8",
                       "--most-tokens")
    assert code == 0 and out.startswith("most tokens a batch of 8 holds: ")
    m = int(out.split(":")[1].split()[0])
    # 8 sequences, t tokens, max_out_tokens t: 8 x t x 606,208 + 8x32 x t x t x 2 = 4,849,664 t +
    # 512 t^2 <= 70,215,262,208, i.e. t^2 + 9472 t <= 137,139,184: t = 7896 (137,137,728).
    assert m == 7896
    assert plan_workspace("llama-2-7b", batch_size=8, prompt_len=1, max_out_tokens=m, gpu="h100-80gb").max_tokens == m
    small = plan_workspace("llama-2-7b", batch_size=8, prompt_len=1, max_out_tokens=m + 1, gpu="h100-80gb")
    assert small.max_tokens < m + 1


def test_max_batch_none_fits(capsys):
    code, _, err = run(capsys, "plan", "--preset", "llama-2-70b", "--free-gb", "2", "--max-tokens", "100000",
                       "--max-batch")
    # Llama-2-70B, one sequence of t tokens holding all t: (163,840 + 327,680) t + 64 x t x t x 2 =
    # 491,520 t + 128 t^2; 100,000 tokens need 1,329,152,000,000 B = 1.21 TiB. The budget of
    # 2 GiB - 500 MiB = 1,623,195,648 B: t^2 + 3840 t <= 12,681,216 gives t = 2125 (12,675,625).
    assert 491_520 * 100_000 + 128 * 100_000**2 == 1_329_152_000_000
    assert 491_520 * 2125 + 128 * 2125**2 <= 1_623_195_648 < 491_520 * 2126 + 128 * 2126**2
    assert code == 2 and err == (
        "inferctx: WorkspaceOOMError: --max-batch: not even a batch of 1 holds all --max-tokens=100000 tokens: "
        "they need 1.21 TiB, and a budget of 1.51 GiB (free 2.00 GiB - reserve 500.00 MiB) holds 2125 at most; "
        "would fit: --max-tokens <= 2125\n")


def test_max_batch_under_the_deepspeed_policy_counts_its_minimum_once(capsys):
    # Under DeepSpeed's policy the planner's refusal counts DeepSpeed's minimum (the 500 MiB
    # reserve and the temp term) in what the request needs, and the budget beside it has that
    # minimum taken off already: the answer said 35.62 GiB, half a GiB more than a user must free.
    # Llama-2-7B, one sequence of 20,000 tokens, fp16, in elements per token: activations
    # 10 x 32 x 128 = 40,960, temp 32 x 20,000 = 640,000, cache 32 x 4096 x 2 = 262,144; x 2 B x
    # 20,000 tokens = 37,724,160,000 B = 35.13 GiB, the workspace that the budget is to hold.
    assert (40_960 + 640_000 + 262_144) * 2 * 20_000 == 37_724_160_000
    assert f"{37_724_160_000 / 2**30:.2f}" == "35.13"
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "30", "--max-tokens", "20000",
                         "--max-batch", "--policy", "deepspeed")
    assert code == 2 and out == ""
    assert err.startswith("inferctx: WorkspaceOOMError: --max-batch: not even a batch of 1 holds all "
                          "--max-tokens=20000 tokens: they need 35.13 GiB, and a budget of 29.51 GiB (free "
                          "30.00 GiB - reserve 500.00 MiB - DeepSpeed's temp term"), err


# Llama-2-7B, batch b, t tokens, fp16 (head 128, 32 heads, 32 layers): activations 10 x 32 x 128 x 2 = 81,920 B
# and K + V of 64 x 32 x 128 x 2 = 524,288 B per token and sequence, attention scores 32 x t x 2 B per token
# and sequence: b x t x (606,208 + 64 t) bytes, the scores rounded up to 256 bytes.
def llama2_7b_bytes(b, t):
    return b * t * 606_208 + -(-b * 64 * t * t // 256) * 256


def test_max_batch_miss_names_max_tokens_and_the_largest_that_fits(capsys):
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "1", "--max-tokens", "100000",
                         "--max-batch")
    # budget at 1 GiB free: less the 100 MiB reserve, 924 MiB = 968,884,224 B; 100000 tokens need
    # 700,620,800,000 B = 652.50 GiB; 1393 tokens need 968,636,672 B, 1394 need 969,421,056 B
    budget = 924 * MIB
    assert llama2_7b_bytes(1, 100_000) == 700_620_800_000
    assert llama2_7b_bytes(1, 1393) <= budget < llama2_7b_bytes(1, 1394)
    assert code == 2 and out == ""
    assert err == ("inferctx: WorkspaceOOMError: --max-batch: not even a batch of 1 holds all --max-tokens=100000 "
                   "tokens: they need 652.50 GiB, and a budget of 924.00 MiB (free 1.00 GiB - reserve 100.00 MiB) "
                   "holds 1393 at most; would fit: --max-tokens <= 1393\n")
    kw = dict(batch_size=1, prompt_len=1, free_bytes=GIB, total_bytes=GIB)
    assert plan_workspace("llama-2-7b", max_out_tokens=1393, **kw).max_tokens == 1393
    assert plan_workspace("llama-2-7b", max_out_tokens=1394, **kw).max_tokens < 1394
    # a prompt longer than that must shrink too: at 512 MiB free (budget 412 MiB) a batch of 1 holds 665
    code, _, err = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "0.5", "--prompt-len", "5000",
                       "--max-tokens", "100000", "--max-batch")
    assert llama2_7b_bytes(1, 665) <= 412 * MIB < llama2_7b_bytes(1, 666)
    assert code == 2 and err.endswith("holds 665 at most; would fit: --max-tokens <= 665 with --prompt-len <= 665\n")
    assert "--min-tokens" not in err and err.count("\n") == 1


def _llama_at_1_gib(capsys, *flags):
    """`inferctx plan` of llama-2-7b with 1 GiB free (a budget of 924 MiB), and `flags`."""
    return run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "1", *flags)


def test_plan_miss_on_min_tokens_names_the_most_that_fit(capsys):
    # --max-tokens 5000 sizes the scores for 5000 tokens, so t tokens take t x 606,208 B plus
    # 64 x 5000 x t = 320,000 t B: 1046 tokens take 968,813,568 B, within the 924 MiB budget of
    # 968,884,224 B; 1047 take 969,739,776 B. 5000 tokens need 4,631,040,000 B = 4.31 GiB.
    code, out, err = _llama_at_1_gib(capsys, "--max-tokens", "5000", "--min-tokens", "5000")
    assert 1046 * 606_208 + 320_000 * 1046 == 968_813_568 <= 924 * MIB < 1047 * 926_208
    assert llama2_7b_bytes(1, 5000) == 4_631_040_000
    assert code == 2 and out == ""
    assert err == ("inferctx: WorkspaceOOMError: workspace does not fit: 1046 tokens fit, fewer than "
                   "--min-tokens=5000; needs 4.31 GiB for 5000 tokens, free 1.00 GiB of 1.00 GiB, budget 924.00 MiB "
                   "(reserve); would fit: --min-tokens <= 1046\n")
    # The answer fits, bound by memory at the same 1046 tokens.
    code, out, _ = _llama_at_1_gib(capsys, "--max-tokens", "5000", "--min-tokens", "1046")
    assert code == 0 and "max tokens 1046  (bound by memory" in out
    # A prompt over the most that fit is named with it.
    code, _, err = _llama_at_1_gib(capsys, "--max-tokens", "5000", "--prompt-len", "3000", "--min-tokens", "5000")
    assert code == 2 and err.endswith("would fit: --prompt-len <= 1046 and --min-tokens <= 1046\n")


def test_most_tokens_when_neither_a_smaller_batch_nor_a_shorter_prompt_alone_fits(capsys):
    # At 1 GiB free (budget 924 MiB) a batch of 2000 holds no token (2000 x 606,208 B is more), and
    # no batch holds 1500 tokens (a batch of 1 holds 1393): only both together fit.
    code, out, err = _llama_at_1_gib(capsys, "--batch", "2000", "--prompt-len", "1500", "--most-tokens")
    assert llama2_7b_bytes(2000, 1) > 924 * MIB and llama2_7b_bytes(1, 1500) > 924 * MIB
    assert llama2_7b_bytes(1, 1393) <= 924 * MIB < llama2_7b_bytes(1, 1394)
    assert llama2_7b_bytes(2000, 1500) == 2_106_624_000_000  # 1.92 TiB
    assert code == 2 and out == ""
    assert err == ("inferctx: WorkspaceOOMError: --most-tokens: a batch of 2000 cannot hold --prompt-len=1500 tokens: "
                   "they need 1.92 TiB, and a budget of 924.00 MiB (free 1.00 GiB - reserve 100.00 MiB) holds none; "
                   "would fit: --batch 1 with --prompt-len <= 1393\n")
    code, out, _ = _llama_at_1_gib(capsys, "--batch", "1", "--prompt-len", "1393", "--most-tokens")
    assert code == 0 and "most tokens a batch of 1 holds: 1393" in out


def test_most_tokens_miss_names_prompt_len_and_what_fits(capsys):
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "1", "--prompt-len", "5000",
                         "--most-tokens")
    assert llama2_7b_bytes(1, 5000) == 4_631_040_000  # 4.31 GiB
    assert code == 2 and out == ""
    assert err == ("inferctx: WorkspaceOOMError: --most-tokens: a batch of 1 cannot hold --prompt-len=5000 tokens: "
                   "they need 4.31 GiB, and a budget of 924.00 MiB (free 1.00 GiB - reserve 100.00 MiB) holds 1393 "
                   "at most; would fit: --prompt-len <= 1393\n")
    # a batch of 64 holds 24 tokens (38,797,312 B per token plus 4096 B per token squared); 500 tokens fit 3
    code, _, err = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "1", "--batch", "64",
                       "--prompt-len", "500", "--most-tokens")
    assert llama2_7b_bytes(64, 24) <= 924 * MIB < llama2_7b_bytes(64, 25)
    assert llama2_7b_bytes(3, 500) <= 924 * MIB < llama2_7b_bytes(4, 500)
    assert code == 2 and err == (
        "inferctx: WorkspaceOOMError: --most-tokens: a batch of 64 cannot hold --prompt-len=500 tokens: they need "
        "19.02 GiB, and a budget of 924.00 MiB (free 1.00 GiB - reserve 100.00 MiB) holds 24 at most; would fit: "
        "--prompt-len <= 24 or --batch <= 3\n")
    kw = dict(prompt_len=500, max_out_tokens=500, free_bytes=GIB, total_bytes=GIB)
    assert plan_workspace("llama-2-7b", batch_size=3, **kw).max_tokens == 500
    # --min-tokens given and above the prompt: it is the one named
    code, _, err = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "1", "--prompt-len", "5000",
                       "--min-tokens", "6000", "--most-tokens")
    assert code == 2 and "cannot hold --min-tokens=6000 tokens" in err
    assert err.endswith("would fit: --prompt-len <= 1393 and --min-tokens <= 1393\n")


def test_sweep(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-70b", "--free-gb", "40", "--max-tokens", "100000",
                       "--sweep-batch", "4", "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["batch_size"] for r in rows] == [1, 2, 3, 4]
    # Llama-2-70B, max_out_tokens 100000: a token of b sequences takes b x (163,840 + 327,680 +
    # 64x100000x2) = 13,291,520 b bytes (multiples of 256); the budget 40 GiB - 500 MiB =
    # 42,425,384,960 B holds 3191, 1595, 1063 and 797 tokens.
    tokens = [r["max_tokens"] for r in rows]
    assert tokens == [42_425_384_960 // (13_291_520 * b) for b in (1, 2, 3, 4)] == [3191, 1595, 1063, 797]
    assert [r["workspace_bytes"] for r in rows] == [t * 13_291_520 * b for b, t in zip((1, 2, 3, 4), tokens)]
    assert all(r["bound_by"] == "memory" for r in rows)


def test_sweep_past_the_memory(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "2", "--prompt-len", "1000",
                       "--max-tokens", "2000", "--sweep-batch", "40", "--json")
    rows = json.loads(out)
    fit = [r for r in rows if r["bound_by"] != "does not fit"]
    # A token of b sequences takes b x (606,208 + 32x2000x2) = 734,208 b bytes; the budget
    # 2 GiB - 500 MiB = 1,623,195,648 B. The 1000 prompt tokens need 734,208,000 b: b <= 2.
    # b = 1 holds all 2000 tokens (1,468,416,000 B); b = 2 holds 1105 (1,622,599,680 B).
    assert code == 0 and [r["batch_size"] for r in rows] == list(range(1, 41))
    assert [(r["max_tokens"], r["workspace_bytes"], r["bound_by"]) for r in fit] == [
        (2000, 1_468_416_000, "max_out_tokens"), (1105, 1_622_599_680, "memory")]
    assert all(r["bound_by"] == "does not fit" and r["max_tokens"] == 0 for r in rows[len(fit):])


def test_plot_is_titled_with_model_gpu_and_dtype(capsys, tmp_path, monkeypatch, request):
    titles = []
    try:
        import matplotlib
    except ImportError:  # the stand-in, its axes recording the title the CLI gives
        fake = request.getfixturevalue("fake_matplotlib")

        class Axes:
            def set_title(self, title, **style):
                titles.append(title)

            def __getattr__(self, name):  # plot, set_xlabel, set_ylabel, grid
                return lambda *a, **k: None

        monkeypatch.setattr(sys.modules["matplotlib.pyplot"], "subplots", lambda **k: (fake(), Axes()))
    else:
        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        original = Figure.savefig
        monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (titles.append(self.axes[0].get_title()),
                                                                        original(self, *a, **k)))
    path = tmp_path / "curve.png"
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--dtype", "bf16",
                       "--sweep-batch", "3", "--plot", str(path))
    assert code == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {path}" in out
    assert titles == ["llama-2-7b on h200, bfloat16: max tokens by batch size (policy exact)"]


def test_plot_of_a_shape_wraps_its_title_and_counts_whole_batches(capsys, tmp_path):
    # A model given as a shape has a long name: the title wraps (it once ran past both edges of
    # the figure), and the batch axis ticks whole numbers only (it once showed 2.5, 7.5, ...).
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    seen = []
    original = Figure.savefig

    def record(self, *a, **k):
        ax = self.axes[0]
        self.canvas.draw()
        seen.append((ax.get_title(), list(ax.get_xticks()), self.get_size_inches()[0] * self.dpi,
                     ax.title.get_window_extent()))
        return original(self, *a, **k)

    import unittest.mock

    with unittest.mock.patch.object(Figure, "savefig", record):
        code, _, _ = run(capsys, "plan", "--layers", "32", "--heads", "32", "--hidden", "4096", "--free-gb", "30",
                         "--dtype", "bf16", "--policy", "deepspeed", "--sweep-batch", "20",
                         "--plot", str(tmp_path / "long.png"))
    assert code == 0
    [(title, ticks, width, box)] = seen
    assert title.replace("\n", " ") == ("32 layers x 32 heads, hidden 4096 on 30.00 GiB free, bfloat16: max "
                                        "tokens by batch size (policy deepspeed)")
    assert title.count("\n") == 1 and 0 <= box.x0 and box.x1 <= width  # inside the figure
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_plot_title_wraps_and_both_axes_count_whole_numbers_as_the_cli_draws_it(capsys, tmp_path, fake_matplotlib,
                                                                                 monkeypatch):
    # What the test above sees in matplotlib's own drawing, seen in the calls (it runs without
    # matplotlib): the title in two lines of at most 72 characters, whole-number ticks on both axes.
    calls = []

    class Axes:
        def set_title(self, title, **style):
            calls.append(("title", title))

        def locator_params(self, **kw):
            calls.append(("locator", kw))

        def __getattr__(self, name):
            return lambda *a, **k: None

    monkeypatch.setattr(sys.modules["matplotlib.pyplot"], "subplots", lambda **k: (fake_matplotlib(), Axes()))
    code, _, _ = run(capsys, "plan", "--layers", "32", "--heads", "32", "--hidden", "4096", "--free-gb", "30",
                     "--dtype", "bf16", "--policy", "deepspeed", "--sweep-batch", "3", "--plot",
                     str(tmp_path / "p.png"))
    assert code == 0
    assert calls == [("locator", {"axis": "both", "integer": True}),
                     # 66 characters; with " tokens", 73
                     ("title", "32 layers x 32 heads, hidden 4096 on 30.00 GiB free, bfloat16: max\n"
                               "tokens by batch size (policy deepspeed)")]


def test_a_matplotlibrc_asking_latex_for_text_is_one_line_naming_the_setting(capsys, tmp_path, fake_matplotlib,
                                                                            monkeypatch):
    # text.usetex in the user's matplotlibrc, and no LaTeX: matplotlib fails as it lays the figure
    # out, before any file is written. One line naming --plot and the setting, exit 2.
    def no_latex(self):
        raise RuntimeError("Failed to process string with tex because latex could not be found")

    monkeypatch.setattr(fake_matplotlib, "tight_layout", no_latex)
    monkeypatch.setattr(sys.modules["matplotlib"], "rcParams", {"text.usetex": True}, raising=False)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2",
                         "--json", "--plot", "curve.png")
    assert code == 2 and len(json.loads(out)) == 2
    assert err == ("inferctx: error: --plot: matplotlib could not write 'curve.png': Failed to process string "
                   "with tex because latex could not be found; text.usetex is on in your matplotlib settings: "
                   "turn it off (matplotlibrc, MATPLOTLIBRC) or install LaTeX\n")
    assert list(tmp_path.iterdir()) == []  # nothing left behind


class _FakeFigure:
    """What the CLI uses of matplotlib's Figure; savefig writes through the file system."""

    class canvas:  # noqa: N801 - matplotlib's attribute name
        @staticmethod
        def get_supported_filetypes():
            return {"png": "Portable Network Graphics", "svg": "Scalable Vector Graphics"}

    def tight_layout(self):
        pass

    def savefig(self, path):
        with open(path, "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n")


@pytest.fixture
def fake_matplotlib(monkeypatch):
    """A stand-in for matplotlib (an optional extra), enough for --plot: the checks, the drawing, savefig."""
    import types

    class Axes:
        def __getattr__(self, name):  # plot, set_xlabel, set_ylabel, set_title, grid
            return lambda *a, **k: None

    mpl = types.ModuleType("matplotlib")
    mpl.use = lambda backend: None
    figure = types.ModuleType("matplotlib.figure")
    figure.Figure = _FakeFigure
    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.subplots = lambda **k: (_FakeFigure(), Axes())
    pyplot.close = lambda fig: None
    mpl.figure, mpl.pyplot = figure, pyplot
    for name, module in (("matplotlib", mpl), ("matplotlib.figure", figure), ("matplotlib.pyplot", pyplot)):
        monkeypatch.setitem(sys.modules, name, module)
    return _FakeFigure


def test_plot_with_json_keeps_stdout_json(capsys, tmp_path, fake_matplotlib):
    path = tmp_path / "curve.png"
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2",
                         "--json", "--plot", str(path))
    assert code == 0 and path.read_bytes() == b"\x89PNG\r\n\x1a\n"
    assert [r["batch_size"] for r in json.loads(out)] == [1, 2]  # the whole of stdout is the document
    assert err == f"wrote {path}\n"
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2",
                         "--plot", str(path))
    assert code == 0 and out.endswith(f"\nwrote {path}\n") and err == ""  # without --json, on stdout


def test_plot_to_a_folder_is_refused_before_anything_is_printed(capsys, tmp_path, fake_matplotlib, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short names: messages clip values past 60 characters
    (tmp_path / "d.png").mkdir()
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "3",
                         "--plot", "d.png")
    assert code == 2 and out == ""
    assert err == "inferctx: error: --plot: 'd.png' is a folder; give a file name, e.g. 'd.png/sweep.png'\n"


def test_plot_to_a_read_only_file_is_refused(capsys, tmp_path, fake_matplotlib, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.png").write_bytes(b"")
    (tmp_path / "old.png").chmod(0o444)
    if os.access("old.png", os.W_OK):
        # This user (root) may write a read-only file: the file system is asked as it would
        # answer another user.
        real_access = os.access
        read_only = str(tmp_path / "old.png")
        monkeypatch.setattr(os, "access", lambda path, mode, *a, **k: (
            False if os.path.abspath(path) == read_only and mode & os.W_OK else real_access(path, mode, *a, **k)))
        assert not os.access("old.png", os.W_OK) and os.access(str(tmp_path), os.W_OK)
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "3",
                         "--plot", "old.png")
    assert code == 2 and out == "" and err == "inferctx: error: --plot: 'old.png' exists and is not writable\n"


def test_plot_write_failure_is_one_line(capsys, tmp_path, fake_matplotlib, monkeypatch):
    import errno

    def full_disk(self, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(fake_matplotlib, "savefig", full_disk)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2",
                         "--json", "--plot", "curve.png")
    assert code == 2 and len(json.loads(out)) == 2  # the sweep was printed before the plot was drawn
    assert err == "inferctx: error: --plot: could not write 'curve.png': No space left on device\n"


def test_plot_writer_failure_other_than_the_disk_is_one_line_and_keeps_a_file_there(capsys, tmp_path,
                                                                                     fake_matplotlib, monkeypatch):
    # matplotlib's .pgf writer needs LaTeX and raises RuntimeError without it; any such failure
    # of the writer is a one-line error naming --plot, and a file that was there is left alone.
    def no_latex(self, path):
        with open(path, "wb") as f:
            f.write(b"half")
        raise RuntimeError("'xelatex' not found; install it or change rcParams['pgf.texsystem']\nmore")

    monkeypatch.setattr(fake_matplotlib, "savefig", no_latex)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2",
                         "--json", "--plot", "curve.png")
    assert code == 2 and len(json.loads(out)) == 2  # the sweep was printed before the plot was drawn
    assert err == ("inferctx: error: --plot: matplotlib could not write 'curve.png': 'xelatex' not found; install "
                   "it or change rcParams['pgf.texsystem']; choose another extension, such as .png, .svg or .pdf\n")
    assert not (tmp_path / "curve.png").exists()  # the half-written file made by the failed call is gone
    (tmp_path / "old.png").write_bytes(b"an earlier plot")
    code, _, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2",
                       "--plot", "old.png")
    assert code == 2 and err.startswith("inferctx: error: --plot: matplotlib could not write 'old.png'")
    assert (tmp_path / "old.png").exists()  # a file that was there before is not removed


def test_a_full_disk_on_stdout_is_one_line(tmp_path):
    # `inferctx presets > out.txt` on a full disk: one line on stderr, exit 2, no traceback, and
    # nothing more at the interpreter's exit.
    import os
    import subprocess

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for argv in (["presets"], ["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "40"]):
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, "-m", "inferctx", *argv], stdout=full, stderr=subprocess.PIPE,
                                  text=True, env=env, timeout=120)
        assert done.returncode == 2 and done.stderr == (
            "inferctx: could not write the output: No space left on device\n"), (argv, done.stderr)


def test_a_number_past_pythons_digit_limit_is_said_to_be_too_large(capsys):
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--batch", "9" * 5000)
    assert code == 2 and out == ""
    assert err.startswith("inferctx: error: --batch: got '999") and err.endswith(
        "; it must be below 2**63 = 9,223,372,036,854,775,808\n")


def test_plot_without_matplotlib(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "3",
                         "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "pip install 'inferctx[plot]'" in err and out == ""


@pytest.mark.parametrize("path,needle", [
    ("missing-folder/x.png", "does not exist"),
    ("x.xyz", "extension .xyz; valid:"),
    ("noext", "no extension"),
])
def test_plot_path_checked_before_anything_is_printed(capsys, tmp_path, path, needle, request):
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the checks need no drawing: the stand-in serves (its formats are .png, .svg)
        request.getfixturevalue("fake_matplotlib")
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "3",
                         "--plot", str(tmp_path / path))
    assert code == 2 and needle in err and out == ""
    assert err.startswith("inferctx: error: --plot: ") and err.count("\n") == 1
    if "valid:" in needle or "no extension" in needle:
        assert ".png" in err.split("valid: ", 1)[1]


def test_presets_listing(capsys):
    code, out, _ = run(capsys, "presets")
    assert code == 0 and "llama-2-70b" in out and "h100-80gb" in out and "gemma-7b" in out and "6.74B" in out
    code, out, _ = run(capsys, "presets", "--json")
    d = json.loads(out)
    assert d["models"]["falcon-7b"]["num_kv_heads"] == 1 and d["models"]["gemma-7b"]["head_dim"] == 256
    assert d["models"]["llama-2-7b"]["num_params"] == 6_738_415_616
    assert d["gpus"]["h200"]["free_bytes"] == (143771 - 1244) * MIB
    # The text gives both: the total, and what planning counts (it showed the total under a header
    # that called the column free). H200: 143,771 MiB = 140.40 GiB; less 1244 MiB, 142,527 MiB = 139.19 GiB.
    code, out, _ = run(capsys, "presets")
    assert "  h200              140.40 GiB  139.19 GiB  NVIDIA H200 (141 GB HBM3e)\n" in out


GPU = ["plan", "--preset", "llama-2-7b", "--gpu", "h200"]


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--preset", "nope", "--gpu", "h200"], "ConfigError: --preset: unknown model preset 'nope'; valid: "),
    (["plan", "--preset", "llama-2-7b", "--gpu", "nope"], "ConfigError: --gpu: unknown GPU preset 'nope'; valid: "),
    (GPU + ["--batch", "x"], "--batch: got 'x'; it must be a whole number"),
    (GPU + ["--batch", "0"], "--batch: got 0; it must be >= 1"),
    (GPU + ["--dtype", "int4"], "--dtype: got 'int4'"),
    # the names a command line can give, not "or the NumPy/torch dtype of one of them"
    (GPU + ["--dtype", "torch.float16"], "ConfigError: --dtype: got 'torch.float16'; valid: 'float32' ('fp32'), "
     "'float16' ('fp16', 'half') or 'bfloat16' ('bf16')\n"),
    (GPU + ["--policy", "x"], "argument --policy: invalid choice: 'x' (choose from 'exact', 'deepspeed')"),
    (["plan", "--layers", "32", "--gpu", "h200"], "give --preset NAME, or all of --layers, --heads and --hidden "
                                                  "(missing --heads, --hidden)"),
    # 68,976,648,192 parameters x 2 B = 128.48 GiB against the RTX 4090's 24564 - 1244 MiB = 22.77 GiB
    (["plan", "--preset", "llama-2-70b", "--gpu", "rtx-4090", "--batch", "64", "--prompt-len", "2048",
      "--max-tokens", "4096"],
     "WorkspaceOOMError: workspace does not fit: the weights (128.48 GiB) exceed free memory 22.77 GiB"),
    (GPU + ["--free-gb", "3"], "give either --gpu or --free-gb/--total-gb, not both (got --gpu and --free-gb)"),
    (GPU + ["--plot", "x.png"], "--plot needs --sweep-batch N"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    # integers >= 2^63, in any integer flag
    (GPU + ["--batch", str(2**63)], "--batch: got 9223372036854775808; it must be below 2**63"),
    (GPU + ["--max-tokens", str(10**30)], "--max-tokens: got 1000000000000000000000000000000"),
    (["plan", "--layers", str(2**64), "--heads", "1", "--hidden", "1", "--free-gb", "1"],
     "--layers: got 18446744073709551616; it must be below 2**63"),
    (GPU + ["--mp-size", str(2**63)], "--mp-size: got 9223372036854775808; it must be below 2**63"),
    (["plan", "--preset", "llama-2-7b", "--device", str(2**63)],
     "--device: got 9223372036854775808; it must be below 2**63"),
    # floats out of range in GiB flags: named in GiB
    (["plan", "--preset", "llama-2-7b", "--free-gb", "inf"], "--free-gb: got 'inf'; it must be a finite number"),
    (["plan", "--preset", "llama-2-7b", "--free-gb", "1e300"], "--free-gb: got '1e300'; it must be below"),
    (["plan", "--preset", "llama-2-7b", "--free-gb", "8", "--memory-limit-gb", "inf"],
     "--memory-limit-gb: got 'inf'; it must be a finite number"),
    (["plan", "--preset", "llama-2-7b", "--free-gb", "8", "--reserve-gb", "1e999"],
     "--reserve-gb: got '1e999'; it must be a finite number"),
    (["plan", "--preset", "llama-2-7b", "--free-gb", "8", "--reserve-gb", "nan"], "--reserve-gb: got 'nan'"),
    (["plan", "--preset", "llama-2-7b", "--free-gb", "8", "--reserve-gb", "-1"],
     "--reserve-gb: got '-1'; it must be a number of GiB (>= 0)"),
    (GPU + ["--memory-fraction", "nan"], "--memory-fraction: got 'nan'; it must be a finite number"),
    (GPU + ["--memory-fraction", "1.5"], "--memory-fraction: got '1.5'; it must be in (0, 1]"),
    (["plan", "--preset", "llama-2-7b", "--free-gb", "9", "--total-gb", "8"], "at most --total-gb"),
    # contradictions
    (GPU + ["--device", "0"], "give either --gpu (a preset) or --device (a real GPU), not both"),
    (["plan", "--preset", "llama-2-7b", "--device", "0", "--free-gb", "3"], "--device or --free-gb"),
    (GPU + ["--batch", "2", "--sweep-batch", "3"], "give either --batch or --sweep-batch, not both"),
    (GPU + ["--sweep-batch", "0"], "--sweep-batch: got 0; it must be >= 1"),
    (GPU + ["--sweep-batch", "100000"], "--sweep-batch: got 100000; it must be at most 4096"),
    (GPU + ["--sweep-batch"], "--sweep-batch: expected one argument"),
    (GPU + ["--max-batch", "--batch", "3"], "--max-batch finds the batch size"),
    (GPU + ["--most-tokens", "--max-tokens", "3"], "--most-tokens finds --max-tokens"),
    (GPU + ["--max-batch", "--most-tokens"], "not both"),
    (GPU + ["--weights", "auto", "--weights-gb", "3"], "give either --weights or --weights-gb"),
    (["plan", "--layers", "2", "--heads", "2", "--hidden", "64", "--gpu", "h200"], "give --weights-gb N"),
    (["plan", "--layers", "2", "--heads", "2", "--hidden", "64", "--free-gb", "2", "--weights", "auto"],
     "--weights auto needs --preset"),
    (GPU + ["--weights-gb", "-2"], "--weights-gb: got '-2'"),
    # planner errors in flag names
    (GPU + ["--mp-size", "3"], "--mp-size: num_heads=32 is not divisible by --mp-size=3"),
    (GPU + ["--rank", "1"], "--rank: got 1; it must be in [0, --mp-size)"),
    (GPU + ["--prompt-len", "5000"], "--prompt-len=5000 exceeds --max-tokens=2048"),
    (["plan", "--layers", "32", "--heads", "32", "--hidden", "4100", "--free-gb", "8"],
     "--hidden=4100 is not divisible by --heads=32; give --head-dim"),
    (GPU + ["--policy", "deepspeed", "--memory-limit-gb", "3"], "--memory-limit-gb: applies to the exact policy"),
    # DeepSpeed's sizing counts no KV heads and no head size of their own: the flags changed nothing
    (GPU + ["--policy", "deepspeed", "--kv-heads", "8"], "ConfigError: --kv-heads: applies to the exact policy only; "
     "the deepspeed policy sizes as DeepSpeed does: the KV cache by the query heads, and each head as the hidden "
     "size / the heads"),
    (["plan", "--layers", "32", "--heads", "32", "--hidden", "4096", "--free-gb", "40", "--policy", "deepspeed",
      "--head-dim", "256"], "ConfigError: --head-dim: applies to the exact policy only"),
    (["plan", "--preset", "llama-2-7b", "--free-gb", "3", "--reserve-gb", "3"],
     "is not more than the reserve of 3.00 GiB (--reserve-gb)"),
    (["plan", "--layers", str(2**40), "--heads", "1", "--hidden", "128", "--free-gb", "8", "--batch",
      str(2**40)], "--batch: --batch=1099511627776 makes the workspace byte count overflow"),
])
def test_errors_are_one_line_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
    assert "_bytes" not in err  # keyword names are the Python API's, not the command's


@pytest.mark.parametrize("flags,message", [
    (["--kv-heads", "5"], "ConfigError: --kv-heads: num_heads=32 is not divisible by --kv-heads=5; each KV head "
                          "must serve a whole group of query heads"),
    (["--head-dim", str(2**63 - 1)], "ConfigError: --head-dim: --head-dim=9223372036854775807 makes the workspace "
                                     "byte count overflow 64 bits (num_layers=32, --batch=1, --max-tokens=2048, "
                                     "1 tokens); reduce --head-dim"),
])
def test_shape_flags_with_a_preset_are_named_as_flags(capsys, flags, message):
    # the preset's own figures (num_heads, num_layers) keep their names: no flag gave them
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", *flags)
    assert code == 2 and out == "" and err == f"inferctx: {message}\n"


@pytest.mark.parametrize("flags,message", [
    # 1e-10 GiB is 0.107 bytes
    (["--free-gb", "8", "--memory-limit-gb", "0.0000000001"],
     "error: --memory-limit-gb: got '0.0000000001', under one byte; it must be at least 9.31e-10 GiB (one byte)"),
    (["--free-gb", "0", "--total-gb", "1e-12"],
     "error: --total-gb: got '1e-12', under one byte; it must be at least 9.31e-10 GiB (one byte)"),
    (["--free-gb", "1e-12"], "error: --free-gb: got '1e-12', under one byte, and --total-gb, not given, defaults to "
                             "it; give --total-gb too (a positive number of GiB)"),
    (["--free-gb", "0"], "error: --free-gb: got '0' and --total-gb, not given, defaults to it; give --total-gb too "
                         "(a positive number of GiB)"),
    # 0.0001 GiB = 107,374 B = 104.86 KiB of budget; one token needs 81,920 + 524,288 + 64 -> 256 B = 720.00 KiB
    (["--free-gb", "8", "--memory-limit-gb", "0.0001"],
     "WorkspaceOOMError: workspace does not fit: 0 tokens fit, fewer than --min-tokens=1; needs 720.00 KiB for "
     "1 token, free 8.00 GiB of 8.00 GiB, budget 104.86 KiB (--memory-limit-gb); no smaller --batch or --max-tokens "
     "fits within the --memory-limit-gb asked for: raise it, or use a smaller dtype, --mp-size or --external-cache"),
])
def test_gib_flags_are_reported_in_gib_and_by_flag(capsys, flags, message):
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", *flags)
    assert code == 2 and out == "" and err == f"inferctx: {message}\n"


def test_no_gpu_message_speaks_cli():
    # With no device visible (CUDA_VISIBLE_DEVICES empty: on a GPU machine too) the device's free
    # memory cannot be read; the message says so in the command's own terms.
    import os

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "inferctx", *argv], capture_output=True, text=True, env=env,
                              timeout=120)

    done = cli("plan", "--preset", "llama-2-7b")
    assert done.returncode == 2 and done.stdout == ""
    names = ("cudaErrorNoDevice", "cudaErrorInsufficientDriver")  # no device visible / no driver
    assert done.stderr in [f"inferctx: no CUDA device to read free memory from ({name}): give --gpu PRESET (see "
                           f"`inferctx presets`) or --free-gb N to plan without a GPU\n" for name in names], done.stderr
    # argument errors come first
    done = cli("plan", "--preset", "llama-2-7b", "--mp-size", "3")
    assert done.returncode == 2 and done.stderr == (
        "inferctx: ConfigError: --mp-size: num_heads=32 is not divisible by --mp-size=3; heads are split evenly "
        "across model-parallel ranks\n"), done.stderr


def test_long_inputs_are_clipped(capsys):
    code, _, err = run(capsys, "plan", "--preset", "x" * 1_000_000, "--gpu", "h200")
    assert code == 2 and len(err) < 1000 and "1,000,000 characters" in err
    # The value is clipped once, to its first 60 characters, and its length is the value's.
    assert err.startswith("inferctx: ConfigError: --preset: unknown model preset '" + "x" * 60
                          + "'... (1,000,000 characters); valid: llama-2-7b, "), err
    assert err.count(" characters)") == 1, err
    code, _, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--policy", "y" * 100_000)
    assert code == 2 and len(err) < 1000
    assert err.startswith("inferctx: error: argument --policy: invalid choice: 'yyyy") and err.count("y" * 61) == 0
    assert err.endswith(" characters) (choose from 'exact', 'deepspeed')\n"), err
    code, _, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--batch", "9" * 10_000)
    assert code == 2 and len(err) < 1000 and "--batch" in err
    assert err == ("inferctx: error: --batch: got '" + "9" * 60 + "'... (10,000 characters); it must be below "
                   "2**63 = 9,223,372,036,854,775,808\n")


def test_version_and_bare_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == "inferctx 0.1.0"
    code, out, err = run(capsys)
    assert code == 2 and out == "" and err.startswith("usage: inferctx") and "give a command" in err


class ClosedPipe(io.StringIO):
    """A stdout whose reader has gone (`| head`)."""

    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        raise OSError("no file descriptor")


def test_closed_pipe_is_quiet(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["presets", "--json"]) == 0


def test_closed_pipe_in_a_shell():
    r = subprocess.run(f"{sys.executable} -m inferctx presets --json | head -n 1", shell=True,
                       capture_output=True, text=True)
    assert r.stdout == "{\n" and r.stderr == ""


def test_console_script_and_module_entry():
    r = subprocess.run([sys.executable, "-m", "inferctx", "plan", "--preset", "mistral-7b", "--gpu", "l40s",
                        "--batch", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("inferctx: ") and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "inferctx", "plan", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--weights-gb" in r.stdout and "1244 MiB" in r.stdout
    # The module itself runs too (it printed nothing and exited 0 before).
    r = subprocess.run([sys.executable, "-m", "inferctx.cli", "plan", "--preset", "mistral-7b", "--gpu", "l40s",
                        "--batch", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("inferctx: ") and "Traceback" not in r.stderr
    # The console script: the installed distribution's `inferctx` entry point is cli.main.
    from importlib import metadata

    (script,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "inferctx"]
    assert script.value == "inferctx.cli:main" and script.load() is main


def test_preset_shapes_are_what_the_cli_plans(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "gemma-7b", "--free-gb", "40", "--json")
    d = json.loads(out)["request"]
    s = model_preset("gemma-7b")
    # Gemma-7B's config.json: 28 layers, 16 heads of 256 (16 KV heads), hidden 3072
    assert code == 0 and (d["num_layers"], d["num_heads"], d["num_kv_heads"], d["head_dim"], d["hidden_dim"]) == (
        s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.hidden_dim) == (28, 16, 16, 256, 3072)


def test_a_closed_stdout_is_one_line_exit_2():
    # `inferctx plan ... >&-`: Python starts with sys.stdout None and print() writes nothing; the
    # output is lost, so one line on stderr and exit 2, as for any failed write, no traceback.
    # A usage error says its own line, as with stdout open.
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for argv, line in ((["presets"], "inferctx: could not write the output: standard output is closed\n"),
                       (["plan", "--preset", "llama-2-7b", "--gpu", "h200"],
                        "inferctx: could not write the output: standard output is closed\n"),
                       (["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--batch", "0"],
                        "inferctx: error: --batch: got 0; it must be >= 1\n")):
        done = subprocess.run([sys.executable, "-m", "inferctx", *argv], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=120,
                              preexec_fn=lambda: os.close(1))
        assert done.returncode == 2 and done.stderr == line, (argv, done.stderr)


def test_sweep_where_not_even_a_batch_of_1_fits_says_why(capsys):
    # Llama-2-70B's weights (68,976,648,192 x 2 B = 128.48 GiB) exceed an H100's 78.43 GiB free:
    # the plain plan's reason and its --mp-size hint, not a table of misses and exit 0.
    code, out, err = run(capsys, "plan", "--preset", "llama-2-70b", "--gpu", "h100-80gb", "--sweep-batch", "3")
    _, _, plain = run(capsys, "plan", "--preset", "llama-2-70b", "--gpu", "h100-80gb")
    assert code == 2 and out == ""
    assert plain.startswith("inferctx: WorkspaceOOMError: workspace does not fit: the weights (128.48 GiB)")
    assert err == plain.replace("WorkspaceOOMError: ", "WorkspaceOOMError: --sweep-batch: not even a batch of 1 "
                                "fits: ", 1)
    assert "--mp-size=2 would put 64.24 GiB of weights on each GPU" in err


def test_sweep_keeps_the_rows_that_fit_when_a_larger_batch_passes_2_to_the_63_bytes(capsys):
    # 2e18 tokens of a one-layer model in 8e9 GiB: batches 1 and 2 plan (as their own plans do),
    # batch 3's byte count passes 2**63, which no device holds: "does not fit" from there on, not
    # an error about a --batch=3 the user never gave that throws away the rows that fit.
    argv = ("plan", "--layers", "1", "--heads", "1", "--hidden", "1", "--free-gb", "8000000000",
            "--max-tokens", "2000000000000000000")
    code, out, err = run(capsys, *argv, "--sweep-batch", "4", "--json")
    assert code == 0 and err == ""
    rows = json.loads(out)
    assert [r["batch_size"] for r in rows] == [1, 2, 3, 4]
    for row in rows[:2]:
        code, single, _ = run(capsys, *argv, "--batch", str(row["batch_size"]), "--json")
        plan = json.loads(single)["plan"]
        assert code == 0 and row["max_tokens"] > 0 and row["bound_by"] == "memory"
        assert (row["max_tokens"], row["workspace_bytes"]) == (plan["max_tokens"], plan["workspace_bytes"])
    assert [(r["max_tokens"], r["workspace_bytes"], r["bound_by"]) for r in rows[2:]] == [(0, 0, "does not fit")] * 2
    code, _, err = run(capsys, *argv, "--batch", "3")
    assert code == 2 and "overflow 64 bits" in err


def test_an_echoed_value_is_not_renamed_as_a_keyword(capsys):
    # The CLI names keywords as flags (prompt_len -> --prompt-len) but not inside the value the
    # user typed.
    for argv, needle in ((("--preset", "llama-2-7b", "--gpu", "h200", "--dtype", "prompt_len"),
                          "inferctx: ConfigError: --dtype: got 'prompt_len'; valid: "),
                         (("--preset", "max_out_tokens", "--gpu", "h200"),
                          "inferctx: ConfigError: --preset: unknown model preset 'max_out_tokens'; valid: "),
                         (("--preset", "llama-2-7b", "--gpu", "rank:"),
                          "inferctx: ConfigError: --gpu: unknown GPU preset 'rank:'; valid: ")):
        code, _, err = run(capsys, "plan", *argv)
        assert code == 2 and err.startswith(needle), err


def test_deepspeed_budget_names_the_temp_term_it_subtracts(capsys):
    # DeepSpeed's minimum is the reserve (500 MiB) plus its temp term, batch x heads / mp x
    # max_out_tokens = 64 x 32 x 100,000 = 204,800,000 elements added as bytes (195.31 MiB):
    # 20 GiB - 524,288,000 - 204,800,000 = 20,745,748,480 B = 19.32 GiB.
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "20", "--batch", "64",
                       "--max-tokens", "100000", "--policy", "deepspeed")
    assert code == 0
    assert ("  planned    against 20.00 GiB free; budget 19.32 GiB (free - reserve 500.00 MiB - DeepSpeed's "
            "temp term 195.31 MiB)\n") in out
    p = plan_workspace("llama-2-7b", batch_size=64, prompt_len=1, max_out_tokens=100_000, policy="deepspeed",
                       free_bytes=20 * GIB, total_bytes=20 * GIB)
    assert p.budget_bytes == 20 * GIB - 500 * MIB - 204_800_000 == 20_745_748_480
    # The exact policy has no such term.
    _, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "20", "--batch", "64",
                    "--max-tokens", "100000")
    assert "budget 19.51 GiB (free - reserve 500.00 MiB)\n" in out


def test_no_weights_with_a_gpu_preset_say_they_live_elsewhere(capsys):
    # Nothing is read from a device with --gpu: the weights counted as 0 live elsewhere; with
    # --free-gb, free memory as given already excludes them.
    for flags, line in ((("--gpu", "h200", "--weights", "none"), "  weights    none counted: they live elsewhere\n"),
                        (("--gpu", "h200", "--weights-gb", "0"), "  weights    none counted: they live elsewhere\n"),
                        (("--free-gb", "20", "--weights", "none"),
                         "  weights    none counted: free memory is taken as read with the weights already loaded\n")):
        code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", *flags)
        assert code == 0 and line in out, (flags, out)


@pytest.mark.parametrize("device", ["2147483648", "99999999999", str(2**63 - 1)])
def test_a_device_past_a_c_int_is_one_line_exit_2(capsys, device):
    # Checked before the device is read: no traceback, on a machine with a GPU or without.
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--device", device)
    assert code == 2 and out == ""
    assert err == (f"inferctx: ConfigError: --device: got {device}; it must be a device ordinal below 2**31 (the "
                   f"CUDA runtime's int)\n")


@pytest.mark.parametrize("argv", [["plan", "--help"], ["--help"], ["--version"]])
def test_help_and_version_into_a_full_disk_are_one_line_exit_2(argv):
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "inferctx", *argv], stdout=full, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stderr == (
        "inferctx: could not write the output: No space left on device\n"), (argv, done.stderr)


def test_help_and_version_report_a_failed_write(monkeypatch, capsys):
    import errno

    class Full(io.StringIO):
        def write(self, s):
            raise OSError(errno.ENOSPC, "No space left on device")

        def fileno(self):
            raise OSError("no file descriptor")

    for argv in (["--version"], ["plan", "--help"]):
        monkeypatch.setattr(sys, "stdout", Full())
        assert main(argv) == 2
        assert capsys.readouterr().err == "inferctx: could not write the output: No space left on device\n"
    # a reader that stops early (`inferctx plan --help | head -1`) ends quietly, as for the commands
    class ClosedPipe(Full):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["plan", "--help"]) == 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("flags,message", [
    # values that start like negative numbers are the flag's value, judged by its own check
    (["--free-gb", "-inf"], "error: --free-gb: got '-inf'; it must be a finite number"),
    (["--free-gb", "-Infinity"], "error: --free-gb: got '-Infinity'; it must be a finite number"),
    (["--free-gb", "-nan"], "error: --free-gb: got '-nan'; it must be a finite number"),
    (["--free-gb", "-1e5"], "error: --free-gb: got '-1e5'; it must be a number of GiB (>= 0)"),
    (["--free-gb", "8", "--reserve-gb", "-2E-3"],
     "error: --reserve-gb: got '-2E-3'; it must be a number of GiB (>= 0)"),
    (["--free-gb", "8", "--memory-fraction", "-1e-3"],
     "error: --memory-fraction: got '-1e-3'; it must be in (0, 1], a fraction of free memory"),
    (["--gpu", "h200", "--batch", "-1e3"], "error: --batch: got '-1e3'; it must be a whole number"),
    # a flag is still a flag
    (["--gpu", "h200", "--batch", "--json"], "error: argument --batch: expected one argument"),
    (["--gpu", "h200", "-inf"], "error: unrecognized arguments: -inf"),
])
def test_negative_number_like_values_reach_their_flag(capsys, flags, message):
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", *flags)
    assert code == 2 and out == "" and err == f"inferctx: {message}\n"


def test_long_whole_numbers_are_judged_by_their_value(capsys):
    # Far below the flag's minimum is said so (not "below 2**63"); leading zeros are no digits.
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--batch", "-" + "9" * 50)
    assert code == 2 and out == ""
    assert err == "inferctx: error: --batch: got '-" + "9" * 50 + "'; it must be >= 1\n"
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--rank", "-" + "9" * 5000)
    assert code == 2 and err.endswith(" (5,001 characters); it must be >= 0\n") and len(err) < 200
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--batch", "0" * 5000 + "4",
                       "--json")
    assert code == 0 and json.loads(out)["request"]["batch_size"] == 4


def test_free_above_total_echoes_both_values_clipped_on_one_line(capsys):
    # The figures are shown as typed, quoted and clipped: a newline float() skips, or thousands of
    # leading zeros, must not spread the message over lines or screens.
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "81\n", "--total-gb", "\n80\n")
    assert code == 2 and out == ""
    assert err == "inferctx: error: --free-gb: got '81\\n'; it must be at most --total-gb '\\n80\\n'\n", err
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "0" * 5000 + "81",
                         "--total-gb", "80")
    assert code == 2 and out == "" and err.count("\n") == 1 and len(err) < 250
    assert "--free-gb: got '000" in err and "(5,002 characters); it must be at most --total-gb '80'" in err


@pytest.mark.parametrize("argv", [["--version"], ["plan", "--help"], ["--help"]])
def test_help_and_version_into_a_closed_stdout_are_one_line_exit_2(argv):
    # `inferctx --version >&-`: the output is lost, as a command's is; argparse would have put it
    # on stderr and exited 0.
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "inferctx", *argv], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env, timeout=120, preexec_fn=lambda: os.close(1))
    assert done.returncode == 2 and done.stderr == (
        "inferctx: could not write the output: standard output is closed\n"), (argv, done.stderr)


@pytest.mark.parametrize("argv,message", [
    # argparse echoes these as typed: a newline split the line, spaces kept _clip_words from clipping
    (["x\ny"], "error: unrecognized arguments: 'x\\ny'"),
    (["a b " * 20_000], "error: unrecognized arguments: '" + "a b " * 15 + "'... (80,000 characters)"),
    (["a", "b", "c", "d", "e", "f", "g"], "error: unrecognized arguments: a b c d e ... (7 in all)"),
    (["--weights", "a b " * 20_000], "error: argument --weights: invalid choice: '" + "a b " * 15
     + "'... (80,000 characters) (choose from 'auto', 'none')"),
    (["--weights", "x\ny"], "error: argument --weights: invalid choice: 'x\\ny' (choose from 'auto', 'none')"),
    (["--max=1\n2"], "error: ambiguous option: '--max=1\\n2' could match --max-tokens, --max-batch"),
    (["--max=" + "a b " * 20_000], "error: ambiguous option: '--max=" + "a b " * 13 + "a '... (80,006 characters) "
                                   "could match --max-tokens, --max-batch"),
    (["--json=1\n2"], "error: argument --json: ignored explicit argument '1\\n2'"),
])
def test_arguments_argparse_echoes_are_one_short_line(capsys, argv, message):
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", *argv)
    assert code == 2 and out == "" and err == f"inferctx: {message}\n", err


def test_a_long_explicit_argument_to_a_switch_is_clipped(capsys):
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--json=" + "a b " * 20_000)
    assert code == 2 and out == "" and err.count("\n") == 1 and len(err) < 500
    assert err.startswith("inferctx: error: argument --json: ignored explicit argument 'a b a b")


def _run_catching_ctrl_c(capsys, *argv):
    """run(), where a KeyboardInterrupt that escapes main fails the test instead of ending pytest."""
    try:
        return run(capsys, *argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main: the user sees a traceback")


def test_ctrl_c_is_one_line_exit_130(capsys, monkeypatch):
    # Ctrl-C during a long --sweep-batch (or any command): one line and the shell's status for
    # SIGINT, 128 + 2, no traceback.
    import inferctx.cli as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "plan_workspace", interrupted)
    for argv in (["--sweep-batch", "40"], ["--batch", "2"], ["--max-batch"]):
        code, out, err = _run_catching_ctrl_c(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", *argv)
        assert code == 130 and out == "" and err == "inferctx: interrupted\n", (argv, err)


def test_ctrl_c_while_the_plot_is_written_leaves_no_half_file(capsys, tmp_path, fake_matplotlib, monkeypatch):
    def interrupted(self, path):
        with open(path, "wb") as f:
            f.write(b"\x89PNG")
        raise KeyboardInterrupt

    monkeypatch.setattr(fake_matplotlib, "savefig", interrupted)
    monkeypatch.chdir(tmp_path)
    code, _, err = _run_catching_ctrl_c(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200",
                                        "--sweep-batch", "2", "--plot", "curve.png")
    assert code == 130 and err == "inferctx: interrupted\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written, no temporary file
    (tmp_path / "old.png").write_bytes(b"an earlier plot")
    code, _, _ = _run_catching_ctrl_c(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200",
                                      "--sweep-batch", "2", "--plot", "old.png")
    assert code == 130 and (tmp_path / "old.png").read_bytes() == b"an earlier plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.png"]


def test_a_failed_plot_write_keeps_the_earlier_plot_whole(capsys, tmp_path, fake_matplotlib, monkeypatch):
    # A full disk midway through the file: the plot that was there is kept as it was, not left
    # truncated, and no partial file stays behind.
    import errno

    def full_disk(self, path):
        with open(path, "wb") as f:
            f.write(b"\x89PNG")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(fake_matplotlib, "savefig", full_disk)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.png").write_bytes(b"an earlier plot")
    code, _, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2",
                       "--plot", "old.png")
    assert code == 2 and err == "inferctx: error: --plot: could not write 'old.png': No space left on device\n"
    assert (tmp_path / "old.png").read_bytes() == b"an earlier plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.png"]
    code, _, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2",
                     "--plot", "new.png")
    assert code == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["old.png"]


def test_a_replaced_plot_keeps_its_permissions(capsys, tmp_path, fake_matplotlib, monkeypatch):
    import os
    import stat

    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.png").write_bytes(b"an earlier plot")
    os.chmod(tmp_path / "old.png", 0o640)
    code, _, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2",
                     "--plot", "old.png")
    assert code == 0 and (tmp_path / "old.png").read_bytes() == b"\x89PNG\r\n\x1a\n"
    assert stat.S_IMODE(os.stat(tmp_path / "old.png").st_mode) == 0o640
    umask = os.umask(0)
    os.umask(umask)
    code, _, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2",
                     "--plot", "new.png")
    assert code == 0 and stat.S_IMODE(os.stat(tmp_path / "new.png").st_mode) == 0o666 & ~umask


def test_a_non_blocking_stdout_gets_the_whole_output():
    # A parent that made its pipe non-blocking (node, some CI runners) and reads slowly: the
    # output arrives whole (Python's own writes would drop what the pipe cannot take at once and
    # still exit 0), and the pipe is left non-blocking as it was found.
    import os
    import select
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        p = subprocess.Popen([sys.executable, "-m", "inferctx", "plan", "--preset", "llama-2-7b", "--gpu", "h200",
                              "--sweep-batch", "2000", "--json"], stdout=w, stderr=subprocess.PIPE, env=env)
        time.sleep(1)  # the pipe fills before anything is read
        chunks = []
        while True:
            if select.select([r], [], [], 0.2)[0]:
                chunks.append(os.read(r, 1 << 16))
            elif p.poll() is not None:
                break
        err = p.stderr.read()
        p.stderr.close()
        assert p.returncode == 0 and err == b""
        assert [row["batch_size"] for row in json.loads(b"".join(chunks))] == list(range(1, 2001))
        assert not os.get_blocking(w)
    finally:
        os.close(r)
        os.close(w)


def test_a_plot_name_the_output_cannot_encode_is_escaped(tmp_path, fake_matplotlib, monkeypatch):
    # PYTHONIOENCODING=ascii with --plot é.png, or a name of bytes that are not UTF-8 (taken
    # from the command line as surrogates) on a strict UTF-8 stdout: the plot is written under
    # its own name and the note shows the name escaped, where print() raised UnicodeEncodeError.
    import os

    monkeypatch.chdir(tmp_path)
    for encoding, name, shown in (("ascii", "\u00e9.png", "\\xe9.png"), ("utf-8", "\udcff.png", "\\xff.png")):
        raw = io.BytesIO()
        monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding=encoding, errors="strict"))
        code = main(["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2", "--plot", name])
        sys.stdout.flush()
        assert code == 0 and raw.getvalue().decode(encoding).endswith(f"\nwrote {shown}\n")
        assert os.path.exists(os.fsencode(name))


def test_bytes_typed_that_are_not_utf_8_are_shown_as_bytes(capsys):
    # `--preset $'\xff'`: Python passes the byte as the surrogate U+DCFF; the message shows the
    # byte, not the surrogate.
    code, out, err = run(capsys, "plan", "--preset", "llama\udcff", "--gpu", "h200")
    assert code == 2 and out == "" and err.startswith("inferctx: ConfigError: --preset: unknown model preset "
                                                      "'llama\\xff'; valid: ")
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--b\udcc3\udca4tch", "3")
    assert code == 2 and err == "inferctx: error: unrecognized arguments: '--b\\xc3\\xa4tch' 3\n"
    # a backslash typed before "udcff" is the user's own text, left as typed
    code, out, err = run(capsys, "plan", "--preset", "\\udcff", "--gpu", "h200")
    assert code == 2 and "preset '\\\\udcff'; valid" in err


def test_a_relative_plot_in_a_deleted_folder_is_one_line(capsys, tmp_path, fake_matplotlib, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2",
                         "--plot", "curve.png")
    assert code == 2 and out == ""
    assert err == ("inferctx: error: --plot: 'curve.png' is relative to the current folder, which no longer "
                   "exists; give a full path\n")


def test_an_unwritable_stderr_still_exits_2(capsys, monkeypatch):
    # `inferctx plan ... 2>/dev/full`: the message cannot be shown; the status still says usage
    # error (not 1 from a traceback that could not be shown either).
    import errno

    class Full(io.StringIO):
        def write(self, s):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "stderr", Full())
    assert main(["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--batch", "0"]) == 2
    assert main([]) == 2
    assert capsys.readouterr().out == ""


def test_an_unwritable_stderr_in_a_shell_still_exits_2():
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for argv in (["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--batch", "0"], []):
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, "-m", "inferctx", *argv], stdout=subprocess.PIPE, stderr=full,
                                  text=True, env=env, timeout=120)
        assert done.returncode == 2 and done.stdout == "", (argv, done.stdout)


def test_a_closed_stderr_keeps_messages_off_stdout(capsys, tmp_path, fake_matplotlib, monkeypatch):
    # `inferctx plan ... --json --plot x.png 2>&-`: stdout holds the JSON document alone; print()
    # would have sent the note, or an error, to stdout in stderr's place.
    monkeypatch.setattr(sys, "stderr", None)
    path = tmp_path / "curve.png"
    code = main(["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "2", "--json",
                 "--plot", str(path)])
    out = capsys.readouterr().out
    assert code == 0 and path.exists() and [r["batch_size"] for r in json.loads(out)] == [1, 2]
    assert main(["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--batch", "0"]) == 2
    assert main([]) == 2
    assert capsys.readouterr().out == ""


def test_a_sweep_cut_short_by_the_reader_still_writes_the_plot(tmp_path, fake_matplotlib, monkeypatch):
    # `inferctx plan ... --sweep-batch 4000 --plot sweep.png | head -3`: the table is cut short
    # (quietly, status 0) but the plot asked for is written.
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    for extra in ([], ["--json"]):
        path = tmp_path / f"sweep{len(extra)}.png"
        assert main(["plan", "--preset", "llama-2-7b", "--gpu", "h200", "--sweep-batch", "40", *extra,
                     "--plot", str(path)]) == 0
        assert path.read_bytes() == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,message", [
    (["--plot", "-x.png", "--sweep-batch", "2"],
     "argument --plot: expected one argument; -x.png starts with '-', so it was taken for a flag: "
     "give it as --plot=-x.png"),
    (["--preset", "-x\ty"],
     "argument --preset: expected one argument; '-x\\ty' starts with '-', so it was taken for a flag: "
     "give it as '--preset=-x\\ty'"),
    (["--preset", "--json", "--batch", "2"], "argument --preset: expected one argument"),  # a flag: no hint
    (["--pre", "-x"], "argument --preset: expected one argument; -x starts with '-', so it was taken for a flag: "
                      "give it as --preset=-x"),
])
def test_a_value_that_starts_with_a_dash_says_how_to_give_it(capsys, argv, message):
    code, out, err = run(capsys, "plan", "--gpu", "h200", *argv)
    assert code == 2 and out == "" and err == f"inferctx: error: {message}\n", err


def test_an_invalid_mplbackend_does_not_stop_the_plot(tmp_path):
    # The plot is drawn with matplotlib's Agg whatever the environment says; matplotlib refuses
    # to load with MPLBACKEND set to a backend it does not know.
    import os
    import textwrap

    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(textwrap.dedent("""\
        import os
        if os.environ.get("MPLBACKEND", "agg").lower() not in ("agg", "svg", "pdf"):
            raise ValueError("Key backend: %r is not a valid value for backend" % os.environ["MPLBACKEND"])
        def use(backend):
            pass
        """))
    (fake / "figure.py").write_text(textwrap.dedent("""\
        class Figure:
            class canvas:
                @staticmethod
                def get_supported_filetypes():
                    return {"png": "Portable Network Graphics"}
            def tight_layout(self):
                pass
            def savefig(self, path):
                with open(path, "wb") as f:
                    f.write(b"png")
        """))
    (fake / "pyplot.py").write_text(textwrap.dedent("""\
        from .figure import Figure
        class _Axes:
            def __getattr__(self, name):
                return lambda *a, **k: None
        def subplots(**kwargs):
            return Figure(), _Axes()
        def close(fig):
            pass
        """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *sys.path]), "MPLBACKEND": "bogus"}
    path = tmp_path / "curve.png"
    done = subprocess.run([sys.executable, "-m", "inferctx", "plan", "--preset", "llama-2-7b", "--gpu", "h200",
                           "--sweep-batch", "2", "--json", "--plot", str(path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0 and done.stderr == f"wrote {path}\n" and path.read_bytes() == b"png", done.stderr


def test_presets_listing_gives_parameters_in_billions_on_each_models_row(capsys):
    code, out, _ = run(capsys, "presets")
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert code == 0
    # 6,738,415,616 and 68,976,648,192 parameters: decimal billions, not GiB-like 2**30 units
    assert rows["llama-2-7b"].split()[6] == "6.74B"
    assert rows["llama-2-70b"].split()[6] == "68.98B"
    assert rows["llama-2-7b"].split()[1:6] == ["32", "32", "32", "128", "4096"]


def test_a_miss_states_the_budget_from_the_memory_left_after_the_weights(capsys):
    # RTX 4090: 24564 - 1244 MiB = 22.77 GiB free, less 12.55 GiB of weights = 10.22 GiB
    code, _, err = run(capsys, "plan", "--preset", "llama-2-7b", "--gpu", "rtx-4090", "--max-batch",
                       "--max-tokens", "1000000")
    assert code == 2
    assert "a budget of 9.73 GiB (free 10.22 GiB after the weights - reserve 500.00 MiB)" in err


def test_device_0_is_a_device_the_command_reads(capsys, monkeypatch):
    from inferctx import planning

    read = []
    monkeypatch.setattr(planning, "_device_memory", lambda device: (read.append(device), (8 * GIB, 8 * GIB))[1])
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--device", "0", "--max-tokens", "64", "--json")
    assert code == 0, err
    sources = json.loads(out)["sources"]
    assert read == [0] and sources["memory"] == "device 0, read now"
    assert (sources["memory_from"], sources["device"], sources["gpu_preset"]) == ("device", 0, None)


def test_total_gb_without_free_gb_is_one_line_exit_2(capsys):
    code, out, err = run(capsys, "plan", "--preset", "llama-2-7b", "--total-gb", "80")
    assert code == 2 and out == ""
    assert err == "inferctx: error: --total-gb needs --free-gb\n"


def test_most_tokens_json_gives_the_answer_as_max_out_tokens(capsys):
    code, out, _ = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "20", "--batch", "8",
                       "--most-tokens", "--json")
    d = json.loads(out)
    assert code == 0 and d["max_out_tokens"] == d["request"]["max_out_tokens"] == d["plan"]["max_tokens"] > 0


@pytest.mark.parametrize("flag", ["--total-gb", "--memory-limit-gb"])
def test_a_zero_gib_flag_that_must_be_positive_is_named(capsys, flag):
    code, _, err = run(capsys, "plan", "--preset", "llama-2-7b", "--free-gb", "8", flag, "0")
    assert code == 2 and err == f"inferctx: error: {flag}: got '0'; it must be a positive number of GiB\n"

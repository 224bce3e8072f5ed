"""bench/_host_timing.py on the CPU, with a stand-in for torch and for the clock: the rounds it
records, the order it runs them in, and the quartiles of a ratio round by round."""

from __future__ import annotations

import importlib.util
import pathlib
import types

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def _bench_module(name):
    """bench/NAME.py loaded under a name of its own (bench/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def timing():
    return _bench_module("_host_timing")


class _Cuda:
    """torch.cuda as host_us_interleaved uses it: a clock rate, a sleep kernel, synchronize."""

    def __init__(self, log):
        self.log = log

    def current_device(self):
        return 0

    def get_device_properties(self, device):
        return types.SimpleNamespace(clock_rate=1_000_000)  # kHz: 1 GHz

    def synchronize(self):
        pass

    def _sleep(self, cycles):
        self.log.append(("sleep", cycles))


def test_rounds_are_recorded_in_turns_and_their_medians_returned(timing, monkeypatch):
    now = [0]
    monkeypatch.setattr(timing.time, "perf_counter_ns", lambda: now[0])
    log = []
    costs = {"a": [3000, 1000, 2000], "b": [1000, 1000, 1000]}  # ns per call, round by round
    loops = {"a": 0, "b": 0}

    def fn(name):
        def call():
            # the warm-up's 20 calls come first and cost nothing; then each loop of 10 calls
            if loops[name] >= 20:
                now[0] += costs[name][(loops[name] - 20) // 10]
            loops[name] += 1
        return call

    torch = types.SimpleNamespace(cuda=_Cuda(log))
    rounds = {}
    medians = timing.host_us_interleaved(torch, {"a": fn("a"), "b": fn("b")}, calls=10, reps=3,
                                         slack_us=5.0, rounds=rounds)
    assert rounds == {"a": [3.0, 1.0, 2.0], "b": [1.0, 1.0, 1.0]}  # µs per call
    assert medians == {"a": 2.0, "b": 1.0}
    # One sleep before each loop, of calls x slack_us at 1 GHz: 10 x 5 µs = 50,000 cycles.
    assert log == [("sleep", 50_000)] * 6


def test_ratio_quartiles_by_hand(timing):
    # Ratios 1..21 in some order: the inclusive quartiles are the 6th, 11th and 16th in order.
    ours = [float(r) for r in (21, 3, 8, 1, 17, 12, 5, 19, 2, 14, 10, 7, 20, 4, 16, 9, 13, 6, 18, 11, 15)]
    assert timing.ratio_spread([2 * o for o in ours], [2.0] * 21) == (6.0, 11.0, 16.0)
    assert timing.ratio_spread([1.0, 3.0], [1.0, 1.0]) == (1.5, 2.0, 2.5)
    with pytest.raises(ValueError):
        timing.ratio_spread([1.0], [1.0])
    with pytest.raises(ValueError):
        timing.ratio_spread([1.0, 2.0], [1.0])


@pytest.fixture
def checks():
    return _bench_module("_checks")


def test_bit_masks_are_read_bit_i_mod_32_of_word_i_div_32(checks):
    torch = pytest.importorskip("torch")
    # word 0: bits 0 and 31 (a negative int32), word 1: bit 2; 40 elements read.
    words = torch.tensor([1 | (1 << 31) - (1 << 32), 1 << 2], dtype=torch.int32)
    keep = checks.keep_from_bits(torch, words, 40)
    assert keep.tolist() == [i in (0, 31, 34) for i in range(40)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_dropout_check_takes_the_right_result_and_names_the_wrong_ones(checks, dtype):
    torch = pytest.importorskip("torch")
    p = 0.1
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1 << 16, generator=g).to(getattr(torch, dtype))
    keep = torch.rand(1 << 16, generator=g) >= p
    right = torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype))
    assert checks.dropout_mismatch(torch, x, right, keep, p) is None
    # a prefix: the first elements of longer arrays
    assert checks.dropout_mismatch(torch, torch.cat([x, x]), torch.cat([right, x]), keep, p) is None
    unwritten = right.clone()
    unwritten[-5:] = float("nan")
    assert checks.dropout_mismatch(torch, x, unwritten, keep, p).startswith("5 of 65536 elements differ")
    scaled_in_low_precision = torch.where(keep, x * torch.tensor(1.0 / (1.0 - p), dtype=x.dtype), 0)
    if not torch.equal(scaled_in_low_precision, right):  # the scale rounded to the dtype first
        assert "differ" in checks.dropout_mismatch(torch, x, scaled_in_low_precision, keep, p)
    everything = torch.ones_like(keep)  # an all-ones (poisoned, unwritten) mask
    assert "keeps 1.0000 of the elements, not about 0.9000" in checks.dropout_mismatch(
        torch, x, x * (1.0 / (1.0 - p)), everything, p)


def test_an_all_kept_mask_fails_the_density_check_for_small_p_too(checks):
    torch = pytest.importorskip("torch")
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(5))
    everything = torch.ones(1 << 20, dtype=torch.bool)
    for p in (0.001, 0.0001):
        assert "keeps 1.0000" in checks.dropout_mismatch(torch, x, x * (1.0 / (1.0 - p)), everything, p)
    # a right mask of a small count and a tiny p passes: a single drop is within the slack
    keep = torch.ones(1024, dtype=torch.bool)
    keep[7] = False
    y = torch.where(keep, x[:1024] * (1.0 / (1.0 - 1e-6)), torch.zeros(()))
    assert checks.dropout_mismatch(torch, x[:1024], y, keep, 1e-6) is None


def test_the_decoder_benchmark_times_transformers_prefill_as_its_generate_runs_it(monkeypatch):
    """bench/decoder.py derives transformers' per-step time from a prefill it times alone: that
    prefill must ask for what generate's does (the last position's logits only, where the model
    takes logits_to_keep), or its longer time shortens transformers' step."""
    monkeypatch.syspath_prepend(str(BENCH))  # its own helpers (_cli)
    decoder = _bench_module("decoder")
    mask = object()

    class New:
        def forward(self, input_ids, attention_mask=None, use_cache=None, logits_to_keep=0):
            pass

    class Old:
        def forward(self, input_ids, attention_mask=None, use_cache=None, num_logits_to_keep=0):
            pass

    class Neither:
        def forward(self, input_ids, attention_mask=None, use_cache=None):
            pass

    given = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False}
    assert decoder.hf_prefill_kwargs(New(), given) == dict(use_cache=True, attention_mask=mask, logits_to_keep=1)
    assert decoder.hf_prefill_kwargs(Old(), given) == dict(use_cache=True, attention_mask=mask,
                                                           num_logits_to_keep=1)
    assert decoder.hf_prefill_kwargs(Neither(), given) == dict(use_cache=True, attention_mask=mask)


# ---------------------------------------------------------------------------------------------
# The dropout check: bits, poison and density bounds


def _dropout_case(torch, p, count=1 << 16, seed=3, dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, generator=g)
    if dtype is not None:
        x = x.to(dtype)
    keep = torch.rand(count, generator=g) >= p
    right = torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype))
    return x, keep, right


def test_the_dropout_check_takes_no_tolerance_in_float32(checks):
    torch = pytest.importorskip("torch")
    p = 0.1
    x, keep, right = _dropout_case(torch, p)
    # x / (1 - p) rounds differently from x * (1 / (1 - p)) on some elements: one ulp off
    divided = torch.where(keep, x / (1.0 - p), torch.zeros(()))
    off = int((divided != right).sum())
    assert off > 0
    assert checks.dropout_mismatch(torch, x, divided, keep, p).startswith(f"{off} of 65536 elements differ")
    # a single element one ulp off
    nudged = right.clone()
    i = int(keep.nonzero()[0])
    nudged[i] = torch.nextafter(right[i], torch.tensor(float("inf")))
    assert checks.dropout_mismatch(torch, x, nudged, keep, p).startswith("1 of 65536 elements differ")


def test_an_output_left_unwritten_where_the_mask_drops_fails_the_check(checks):
    torch = pytest.importorskip("torch")
    p = 0.1
    x, keep, right = _dropout_case(torch, p)
    only_kept_written = right.clone()
    only_kept_written[~keep] = float("nan")  # the NaN poison left where the zeros belong
    dropped = int((~keep).sum())
    assert checks.dropout_mismatch(torch, x, only_kept_written, keep, p).startswith(
        f"{dropped} of 65536 elements differ")


def test_a_mask_that_drops_too_much_fails_the_density_check(checks):
    torch = pytest.importorskip("torch")
    p = 0.1
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(4))
    nothing = torch.zeros(1 << 16, dtype=torch.bool)  # an all-zeros mask, and y all zeros with it
    assert "keeps 0.0000 of the elements, not about 0.9000" in checks.dropout_mismatch(
        torch, x, torch.zeros_like(x), nothing, p)


def _mask_keeping(torch, count, kept):
    keep = torch.zeros(count, dtype=torch.bool)
    keep[:kept] = True
    return keep[torch.randperm(count, generator=torch.Generator().manual_seed(kept))]


@pytest.mark.parametrize("side", [1, -1])
def test_the_density_bound_is_five_standard_deviations(checks, side):
    torch = pytest.importorskip("torch")
    import math

    p, count = 0.1, 1 << 20
    x = torch.randn(count, generator=torch.Generator().manual_seed(6))
    sd = math.sqrt(p * (1 - p) / count) * count  # in elements
    for sds, passes in ((4.5, True), (5.5, False)):
        keep = _mask_keeping(torch, count, round((1 - p) * count + side * sds * sd))
        y = torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros(()))
        result = checks.dropout_mismatch(torch, x, y, keep, p)
        assert (result is None) == passes, (sds, side, result)


def test_the_density_bound_allows_three_elements_more_for_a_tiny_p(checks):
    torch = pytest.importorskip("torch")
    p, count = 1e-6, 1024
    x = torch.randn(count, generator=torch.Generator().manual_seed(8))
    for drops, passes in ((3, True), (4, False)):
        keep = torch.ones(count, dtype=torch.bool)
        keep[torch.arange(drops) * 100] = False
        y = torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros(()))
        result = checks.dropout_mismatch(torch, x, y, keep, p)
        assert (result is None) == passes, (drops, result)


# ---------------------------------------------------------------------------------------------
# Host timing: the order of the rounds, what each loop holds, medians, the sleep's length


class _LoggingCuda(_Cuda):
    def __init__(self, log, clock_rate=1_000_000):
        super().__init__(log)
        self.clock_rate = clock_rate

    def get_device_properties(self, device):
        if self.clock_rate is None:
            return types.SimpleNamespace()
        return types.SimpleNamespace(clock_rate=self.clock_rate)

    def synchronize(self):
        self.log.append(("sync",))


def test_the_rounds_rotate_which_callable_goes_first(timing):
    log = []
    torch = types.SimpleNamespace(cuda=_LoggingCuda(log))
    counts = {"a": 0, "b": 0, "c": 0}

    def fn(name):
        def call():
            counts[name] += 1
            if counts[name] > 20:  # past the warm-up
                log.append(("call", name))
        return call

    timing.host_us_interleaved(torch, {n: fn(n) for n in "abc"}, calls=2, reps=4, slack_us=1.0)
    loops = []
    for entry in log:
        if entry[0] == "call" and (not loops or loops[-1][-1] != entry[1] or len(loops[-1]) == 2):
            loops.append([entry[1]])
        elif entry[0] == "call":
            loops[-1].append(entry[1])
    assert [names[0] for names in loops] == list("abc" "bca" "cab" "abc")
    assert all(len(names) == 2 for names in loops)


@pytest.mark.parametrize("keep", [True, False])
def test_each_loop_waits_for_the_gpu_then_holds_it_and_keeps_results_as_asked(timing, keep):
    log = []
    torch = types.SimpleNamespace(cuda=_LoggingCuda(log))
    made = [0]

    class Result:
        def __del__(self):
            log.append(("free",))

    def call():
        made[0] += 1
        if made[0] > 20:
            log.append(("call",))
        return Result()

    timing.host_us_interleaved(torch, {"a": call}, calls=3, reps=2, keep=keep, slack_us=1.0)
    timed = log[next(i for i, e in enumerate(log) if e == ("sync",)):]
    loop = [("sync",), ("sleep", 3000)]
    if keep:
        loop += [("call",)] * 3 + [("free",)] * 3  # alive until the loop's end
    else:
        loop += [("call",), ("free",)] * 3  # each dropped at once
    assert timed == loop * 2 + [("sync",)]


def test_the_figure_is_the_median_of_the_rounds(timing, monkeypatch):
    now = [0]
    monkeypatch.setattr(timing.time, "perf_counter_ns", lambda: now[0])
    costs = [1000, 2000, 4000, 9000]  # ns per call in rounds 1..4
    loops = [0]

    def call():
        if loops[0] >= 20:
            now[0] += costs[(loops[0] - 20) // 10]
        loops[0] += 1

    torch = types.SimpleNamespace(cuda=_Cuda([]))
    assert timing.host_us_interleaved(torch, {"a": call}, calls=10, reps=4, slack_us=1.0) == {"a": 3.0}


@pytest.mark.parametrize("clock_rate", [0, None])
def test_a_device_without_a_clock_rate_is_held_as_at_2_ghz(timing, clock_rate):
    log = []
    torch = types.SimpleNamespace(cuda=_LoggingCuda(log, clock_rate))
    timing.host_us_interleaved(torch, {"a": lambda: None}, calls=10, reps=1, slack_us=5.0)
    assert [e for e in log if e[0] == "sleep"] == [("sleep", 100_000)]  # 10 x 5 µs at 2 GHz


def test_ratio_quartiles_refuse_lists_of_different_lengths(timing):
    with pytest.raises(ValueError):
        timing.ratio_spread([1.0, 2.0, 3.0], [1.0, 1.0])
    with pytest.raises(ValueError):
        timing.ratio_spread([1.0, 2.0], [1.0, 1.0, 1.0])


# ---------------------------------------------------------------------------------------------
# Command-line checks


@pytest.fixture
def cli():
    return _bench_module("_cli")


def _refused(call, *args):
    with pytest.raises(SystemExit) as e:
        call(*args)
    return e.value.code == 2


def test_command_line_values_are_checked_against_their_bounds(cli, tmp_path, capsys):
    import argparse

    ap = argparse.ArgumentParser()
    cli.at_least(ap, "--iters", 0, 0)
    cli.at_least(ap, "--sizes", [4, 5], 4)
    assert _refused(cli.at_least, ap, "--iters", -1, 0)
    assert _refused(cli.at_least, ap, "--sizes", [4, 3], 4)  # any value of a list, not the first only
    cli.positive_float(ap, "--gib", None)
    cli.positive_float(ap, "--gib", 0.5)
    for bad in (0.0, -1.0, float("nan")):
        assert _refused(cli.positive_float, ap, "--gib", bad)
    for good in (0.1, 0.5, 0.999):
        cli.drop_probability(ap, good)
    # the ends, NaN, and values that round to 0 or 1 in float32
    for bad in (0.0, 1.0, -0.1, 1.5, float("nan"), 1e-50, 1.0 - 1e-9):
        assert _refused(cli.drop_probability, ap, bad), bad
    cli.json_path(ap, None)
    cli.json_path(ap, str(tmp_path / "out.json"))
    assert _refused(cli.json_path, ap, str(tmp_path / "missing" / "out.json"))
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert _refused(cli.json_path, ap, str(a_file / "out.json"))  # its "folder" is a file
    capsys.readouterr()


@pytest.fixture
def dropout_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # its own helpers (_cli, _checks, _host_timing)
    return _bench_module("dropout")


@pytest.fixture
def graph_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return _bench_module("graph_dropout")


def test_the_dropout_benchmark_refuses_bad_arguments(dropout_bench, capsys):
    args = dropout_bench.parse_args(["--sizes-mib", "1", "--iters", "0", "--warmup", "0"])
    assert (args.sizes_mib, args.iters, args.warmup, args.p) == ([1], 0, 0, 0.1)
    for argv in (["--sizes-mib", "0"], ["--sizes-mib", "16", "0"], ["--warmup", "-1"], ["--iters", "-1"],
                 ["--p", "0"], ["--p", "1"], ["--p", "nan"]):
        assert _refused(dropout_bench.parse_args, argv), argv
    capsys.readouterr()


def test_the_graph_benchmark_refuses_bad_arguments(graph_bench, capsys):
    args = graph_bench.parse_args(["--sizes-kib", "4", "--calls", "1"])
    assert (args.sizes_kib, args.calls) == ([4], [1])
    for argv in (["--sizes-kib", "3"], ["--calls", "0"], ["--calls", "1", "0"], ["--warmup", "-1"],
                 ["--iters", "-1"], ["--max-step-mib", "0"], ["--p", "0"]):
        assert _refused(graph_bench.parse_args, argv), argv
    capsys.readouterr()


def test_timed_calls_by_size(dropout_bench, graph_bench):
    mib = 1 << 20
    assert [dropout_bench.default_iters(b) for b in (mib, 64 * mib, 64 * mib + 1, 512 * mib, 512 * mib + 1)] == \
        [100, 100, 30, 30, 10]
    assert [graph_bench.default_iters(b) for b in (mib, 16 * mib, 16 * mib + 1, 256 * mib, 256 * mib + 1)] == \
        [200, 200, 40, 40, 10]


# ---------------------------------------------------------------------------------------------
# graph_dropout.py: buffer sets and its timer


def test_buffer_sets_rotate_three_times_l2_of_a_graphs_inputs(graph_bench):
    def torch_with(**props):
        cuda = types.SimpleNamespace(get_device_properties=lambda device: types.SimpleNamespace(**props))
        return types.SimpleNamespace(cuda=cuda)

    torch = torch_with(L2_cache_size=50 << 20)
    mib = 1 << 20
    assert graph_bench.buffer_sets(torch, mib, None, 1) == 150
    assert graph_bench.buffer_sets(torch, 7 * mib, None, 1) == 22  # rounded up: 21 sets fall short
    assert graph_bench.buffer_sets(torch, mib, None, 2) == 75  # a graph of 2 calls reads 2 inputs
    assert graph_bench.buffer_sets(torch, 512 * mib, None, 1) == 1
    assert graph_bench.buffer_sets(torch_with(), 7 * mib, None, 1) == 22  # no L2 size: 50 MiB


class _EventCuda:
    """torch.cuda as the timers use it: a clock in ms that calls and sleeps advance (1 GHz)."""

    def __init__(self, log):
        self.log, self.now = log, 0.0
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = cuda.now
                cuda.log.append(("record",))

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.t - self.t

        self.Event = Event

    def _sleep(self, cycles):
        self.now += cycles * 1e-6
        self.log.append(("sleep", cycles))

    def synchronize(self):
        pass


def test_the_graph_timer_times_every_call_once_in_parts_behind_a_hold(graph_bench):
    log = []
    cuda = _EventCuda(log)
    timer = graph_bench.Timer(types.SimpleNamespace(cuda=cuda))
    del log[:]

    def fn(i):
        cuda.now += 0.01
        log.append(("call", i))

    times = timer.run(fn, iters=1000, warmup=2, launches=1, distinct=5)
    assert len(times) == 1000
    first_sleep = log.index(next(e for e in log if e[0] == "sleep"))
    # each of the 5 distinct calls once before anything is timed, then 3 for the host's pace
    assert [e[1] for e in log[:first_sleep]] == [0, 1, 2, 3, 4, 0, 1, 2]
    parts, timed = [], []
    for e in log[first_sleep:]:
        if e[0] == "sleep":
            parts.append(0)
        elif e[0] == "call":
            parts[-1] += 1
            timed.append(e[1])
    assert parts == [300, 300, 300, 100]  # 900 commands a part: a call and its two events
    assert timed == list(range(1000))


# ---------------------------------------------------------------------------------------------
# gemm.py: the comparison of results, the report's verdicts, the interleaved timer


@pytest.fixture
def gemm_bench(monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("inferctx")
    monkeypatch.syspath_prepend(str(BENCH))
    return _bench_module("gemm")


def test_a_nan_left_in_a_gemm_result_shows_in_the_difference(gemm_bench):
    import math

    import torch

    y = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert gemm_bench.relative_difference(y.clone(), y) == 0.0
    poisoned = y.clone()
    poisoned[3, 5] = float("nan")
    assert math.isnan(gemm_bench.relative_difference(poisoned, y))


def test_gemm_cases_count_flops_and_bytes_of_every_batch(gemm_bench):
    attn = gemm_bench.Case("attn QK^T", "bfloat16", 128, 2048, 128, batch=256, trans_b=True)
    assert attn.flops == 2.0 * 256 * 128 * 2048 * 128
    assert attn.weight_bytes == 256 * 128 * 2048 * 2
    assert gemm_bench.rate(attn, 1.0) == (attn.flops / 1e-3 / 1e12, "TFLOP/s")
    decode = gemm_bench.Case("decode", "bfloat16", 8, 4096, 4096)
    assert gemm_bench.rate(decode, 1.0) == (4096 * 4096 * 2 / 1e-3 / 1e9, "GB/s")
    assert not gemm_bench.Case("square", "float16", 8192, 8192, 8192).memory_bound


def _gemm_row(difference, tuned_difference=None):
    row = dict(case="decode 8x4096x4096", group="decode", dtype="bfloat16", batch=1, m=8, n=4096, k=4096,
               trans_b=False, difference=difference, torch_ms=0.1, default_ms=0.1)
    if tuned_difference is not None:
        row.update(tuned_difference=tuned_difference, torch_ms_2=0.1, tuned_ms=0.09, tune={"backend": "x"})
    return row


@pytest.mark.parametrize("tuned", [False, True])
def test_the_gemm_report_takes_only_torchs_bits_untuned(gemm_bench, capsys, tuned):
    args = types.SimpleNamespace(no_tune=not tuned, host_only=False)
    props = types.SimpleNamespace(name="stand-in")
    extra = 0.0 if tuned else None
    right = [_gemm_row(0.0, extra), _gemm_row(0.0, extra)]
    assert gemm_bench.report(right, {}, {}, props, args, True) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "PASS" in out
    # untuned, a result within bf16's rounding of torch's is still not torch's result
    wrong = [_gemm_row(0.0, extra), _gemm_row(1e-3, extra), _gemm_row(float("nan"), extra)]
    assert gemm_bench.report(wrong, {}, {}, props, args, True) == 2
    out = capsys.readouterr().out
    assert out.count("  MISMATCH") == 2 and "FAIL (MISMATCH above)" in out and "PASS" not in out


def test_the_gemm_report_takes_a_tuned_result_within_rounding_only(gemm_bench, capsys):
    args = types.SimpleNamespace(no_tune=False, host_only=False)
    props = types.SimpleNamespace(name="stand-in")
    rows = [_gemm_row(0.0, 5e-3), _gemm_row(0.0, 0.5), _gemm_row(0.0, float("nan"))]
    assert gemm_bench.report(rows, {}, {}, props, args, True) == 2
    assert capsys.readouterr().out.count("  MISMATCH") == 2


def test_the_gemm_timer_alternates_the_order_and_gives_time_per_call(gemm_bench, monkeypatch):
    log = []
    cuda = _EventCuda(log)
    monkeypatch.setattr(gemm_bench, "torch", types.SimpleNamespace(cuda=cuda))
    timer = gemm_bench.Timer(reps=4)

    def fn(name, ms):
        def call(i):
            cuda.now += ms
            log.append(("call", name))
        return call

    medians = timer.compare([fn("theirs", 0.5), fn("ours", 0.25)], sets=2)
    assert medians == [0.5, 0.25]
    blocks, current = [], []
    for e in log:
        if e[0] == "record":
            if current:
                blocks.append(current)
            current = []
        elif e[0] == "call":
            current.append(e[1])
    timed = blocks[-8:]  # the last 4 rounds of 2 blocks, each 5 calls (at least 5 a block)
    assert [b[0] for b in timed] == ["theirs", "ours", "ours", "theirs", "theirs", "ours", "ours", "theirs"]
    assert all(len(b) == 5 and len(set(b)) == 1 for b in timed)

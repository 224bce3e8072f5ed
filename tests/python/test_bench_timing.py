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

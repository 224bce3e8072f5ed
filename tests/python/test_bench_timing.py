"""bench/_host_timing.py on the CPU, with a stand-in for torch and for the clock: the rounds it
records, the order it runs them in, and the quartiles of a ratio round by round."""

from __future__ import annotations

import importlib.util
import pathlib
import types

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def timing():
    spec = importlib.util.spec_from_file_location("_host_timing_under_test", BENCH / "_host_timing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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

"""A stand-in for the GPU half of inferctx.gemm.autotune_gemm (timing, and the algorithm cache
it fills), so that autotuning and the cache file run without a GPU."""

from __future__ import annotations

import importlib
import types

import pytest

from inferctx import _core

gm = importlib.import_module("inferctx.gemm")

STUBBED = ("_gemm_tune", "_gemm_cache_export", "_gemm_cache_import", "_gemm_cache_clear")


class StubTuner:
    """Stands in for the GPU half of autotune_gemm (timing, and the algorithm cache it fills):
    records what it was asked to tune; cache entries hold the packed problem C++ builds."""

    def __init__(self):
        self.tunes = []
        self.cache = []  # entries as _gemm_cache_export gives them
        self.imported = None
        self.aligns = {}  # (batch, m, n, k) -> the (a, b, c) alignments a tune records; else 256s
        self.fail_on = None  # (batch, m, n, k) whose tune raises

    def _gemm_tune(self, ctx, dtype, trans_a, trans_b, m, n, k, batch, tf32, max_algorithms, warmup,
                   repeats):
        self.tunes.append((dtype, trans_a, trans_b, m, n, k, batch, tf32, max_algorithms, warmup,
                           repeats))
        if (batch, m, n, k) == self.fail_on:
            raise MemoryError("out of device memory (a stand-in failure)")
        problem = _core._gemm_packed_problem(dtype, m, n, k, batch, trans_a, trans_b, tf32)
        a, b, c = self.aligns.get((batch, m, n, k), (256, 256, 256))
        self.cache.append(dict(device=ctx.device, device_name="Fake GPU", cublas_version=130100,
                               problem=problem, align_a=a, align_b=b, align_c=c, backend=0,
                               algo=[1, 2, 3, 4, 5, 6, 7, 2**64 - 1], time_ms=0.5))
        return dict(backend=0, algo_index=2, algo=[1] * 8, algo_id=21, tile_id=3, stages_id=4,
                    splitk=1, default_ms=0.75, best_ms=0.5, candidates=9, valid=8,
                    rotated_sets=4)

    def _gemm_cache_export(self, tuned_only):
        return list(self.cache)

    def _gemm_cache_import(self, entries):
        self.imported = entries
        return len(entries)

    def _gemm_cache_clear(self):
        self.cache.clear()


def install(monkeypatch, stub):
    """Puts `stub` in place of the GPU half, and a context of device 0 in place of the current
    device's; returns the stub."""
    for name in STUBBED:
        monkeypatch.setattr(gm._core, name, getattr(stub, name))
    monkeypatch.setattr(gm, "_context_of_current_device", lambda: types.SimpleNamespace(device=0))
    return stub


@pytest.fixture
def tuner(monkeypatch):
    return install(monkeypatch, StubTuner())

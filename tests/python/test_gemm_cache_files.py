"""The GEMM cache file as autotune_gemm and save_gemm_cache meet it: files a merge cannot read,
folders that do not exist, and files that already hold every tuning (read-only storage).

The GPU half of autotune_gemm (timing, and the in-process algorithm cache) is stood in for, as
in test_gemm.py, so that all of this runs without a GPU."""

import errno
import importlib
import json
import os
import types

import pytest

from inferctx import _core
from inferctx.errors import ConfigError

gm = importlib.import_module("inferctx.gemm")

_MERGE_HINT = "pass merge=False to replace it"


class _Tuner:
    """Stands in for _core's tuner and algorithm cache: each tune adds the packed problem's entry."""

    def __init__(self):
        self.tunes = []
        self.cache = []

    def tune(self, ctx, dtype, trans_a, trans_b, m, n, k, batch, tf32, *rest):
        self.tunes.append((batch, m, n, k))
        problem = _core._gemm_packed_problem(dtype, m, n, k, batch, trans_a, trans_b, tf32)
        self.cache.append(dict(device=ctx.device, device_name="Test GPU", cublas_version=130100,
                               problem=problem, align_a=256, align_b=256, align_c=256, backend=1,
                               algo=[], time_ms=0.25))
        return dict(backend=1, algo_index=0, algo=[], algo_id=-1, tile_id=-1, stages_id=-1,
                    splitk=-1, default_ms=0.25, best_ms=0.25, candidates=4, valid=4, rotated_sets=4)

    def export(self, tuned_only):
        return list(self.cache)

    def import_(self, entries):
        return len(entries)

    def clear(self):
        self.cache.clear()


@pytest.fixture
def tuner(monkeypatch):
    stub = _Tuner()
    monkeypatch.setattr(gm._core, "_gemm_tune", stub.tune)
    monkeypatch.setattr(gm._core, "_gemm_cache_export", stub.export)
    monkeypatch.setattr(gm._core, "_gemm_cache_import", stub.import_)
    monkeypatch.setattr(gm._core, "_gemm_cache_clear", stub.clear)
    monkeypatch.setattr(gm, "_context_of_current_device", lambda: types.SimpleNamespace(device=0))
    return stub


@pytest.mark.parametrize("content, words", [
    ("", "is not JSON"),
    ('{"format": "inferctx-gemm-cache", "version": 1, "entries": [', "is not JSON"),
    ('{"format": "inferctx-gemm-cache", "version": 2, "entries": []}', "has cache format version 2"),
    ('{"format": "something else", "entries": []}', "is not an inferctx GEMM cache"),
    (b"\xff\xfe{}", "is not a JSON file inferctx can read"),
])
def test_a_save_that_cannot_read_the_file_it_merges_says_how_to_replace_it(tuner, tmp_path, content, words):
    # An empty, truncated, newer or foreign file: the merge cannot keep its entries. The error
    # says so and names the way out (merge=False), as it does for a malformed entry; telling the
    # caller of save_gemm_cache to give "a file written by save_gemm_cache" names none.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    path = tmp_path / "gemm.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    before = path.read_bytes()
    with pytest.raises(ConfigError) as info:
        gm.save_gemm_cache(path)
    assert info.value.argument == "path"
    assert str(info.value).startswith(f"path: {path} ") and words in str(info.value), str(info.value)
    assert _MERGE_HINT in str(info.value), str(info.value)
    assert path.read_bytes() == before  # left as it was
    assert gm.save_gemm_cache(path, merge=False) == 1 and gm.load_gemm_cache(path) == 1


def test_autotune_refuses_a_cache_file_in_a_missing_folder_before_tuning(tuner, tmp_path, monkeypatch):
    # The file is written after every shape is tuned (minutes on a GPU): a folder that does not
    # exist failed only then, and a script ending on that error lost every tuning. It is named
    # before anything is tuned, as a bad cache_file is.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain").write_text("not a folder")
    for name in (tmp_path / "missing" / "gemm.json", "missing/gemm.json", "plain/gemm.json"):
        with pytest.raises(ConfigError) as info:
            gm.autotune_gemm([(8, 16, 32), (16, 32, 64)], "float16", progress=False, cache_file=name)
        assert info.value.argument == "cache_file"
        assert str(info.value).startswith(f"cache_file: {os.fsdecode(name)} ") and "folder" in str(info.value)
        assert tuner.tunes == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]
    # A new file in a folder that exists is made as before.
    [r] = gm.autotune_gemm([(8, 16, 32)], "float16", progress=False, cache_file="gemm.json")
    assert r["skipped"] is False and len(json.loads((tmp_path / "gemm.json").read_text())["entries"]) == 1


def test_autotune_leaves_a_cache_file_that_holds_every_tuning_as_it_is(tuner, tmp_path, monkeypatch):
    # A cache file shipped with a deployment, on storage the process cannot write (a read-only
    # mount): every shape asked for is in it, so there is nothing to write, and autotune_gemm must
    # not fail trying to replace it.
    gm.autotune_gemm([(8, 16, 32), (2, 8, 16, 32)], "float16", progress=False)
    path = tmp_path / "gemm.json"
    assert gm.save_gemm_cache(path) == 2
    before = os.stat(path)

    def read_only_file_system(target):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.dirname(target))

    monkeypatch.setattr(gm, "_new_file_beside", read_only_file_system)
    results = gm.autotune_gemm([(8, 16, 32), (2, 8, 16, 32)], "float16", progress=False, cache_file=path)
    assert [r["skipped"] for r in results] == [True, True] and len(tuner.tunes) == 2
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not replaced
    # A shape that is tuned now has to be written: there the read-only storage is an error.
    with pytest.raises(OSError) as info:
        gm.autotune_gemm([(4, 4, 4)], "float16", progress=False, cache_file=path)
    assert info.value.errno == errno.EROFS and len(tuner.tunes) == 3
    # So has a tuning the process holds that the file lacks, though nothing was tuned in the call.
    monkeypatch.undo()
    monkeypatch.setattr(gm._core, "_gemm_tune", tuner.tune)
    monkeypatch.setattr(gm._core, "_gemm_cache_export", tuner.export)
    monkeypatch.setattr(gm._core, "_gemm_cache_import", tuner.import_)
    monkeypatch.setattr(gm, "_context_of_current_device", lambda: types.SimpleNamespace(device=0))
    results = gm.autotune_gemm([(8, 16, 32)], "float16", progress=False, cache_file=path)
    assert results[0]["skipped"] is True and len(tuner.tunes) == 3
    assert len(json.loads(path.read_text())["entries"]) == 3
    # A file removed meanwhile holds nothing: it is made again.
    path.unlink()
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False, cache_file=path)
    assert len(json.loads(path.read_text())["entries"]) == 3 and len(tuner.tunes) == 3

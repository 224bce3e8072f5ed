"""The GEMM cache file as autotune_gemm and save_gemm_cache meet it: files a merge cannot read,
folders that do not exist, and files that already hold every tuning (read-only storage).

The GPU half of autotune_gemm (timing, and the in-process algorithm cache) is stood in for
(gemm_tuner_stub, as in test_gemm.py), so that all of this runs without a GPU."""

import errno
import json
import os

import pytest
from gemm_tuner_stub import gm, install, tuner  # noqa: F401 (fixture)

from inferctx.errors import ConfigError

_MERGE_HINT = "pass merge=False to replace it"


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
    install(monkeypatch, tuner)
    results = gm.autotune_gemm([(8, 16, 32)], "float16", progress=False, cache_file=path)
    assert results[0]["skipped"] is True and len(tuner.tunes) == 3
    assert len(json.loads(path.read_text())["entries"]) == 3
    # A file removed meanwhile holds nothing: it is made again.
    path.unlink()
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False, cache_file=path)
    assert len(json.loads(path.read_text())["entries"]) == 3 and len(tuner.tunes) == 3

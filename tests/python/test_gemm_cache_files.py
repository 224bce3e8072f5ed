"""The GEMM cache file as autotune_gemm and save_gemm_cache meet it: files a merge cannot read,
folders that do not exist, and files that already hold every tuning (read-only storage).

What each entry keeps through the file, which entries count as tuned already, and saves that run
at once (the folder's lock, the file replaced whole, a fork during a save) are pinned too. The GPU
half of autotune_gemm (timing, and the in-process algorithm cache) is stood in for
(gemm_tuner_stub, as in test_gemm.py), so that all of this runs without a GPU."""

import errno
import fcntl
import json
import os
import stat
import threading
import time
import types
import warnings

import pytest
from gemm_tuner_stub import gm, install, tuner  # noqa: F401 (fixture)

from inferctx import _gemm_cache
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


@pytest.mark.parametrize("merge", [True, False])
def test_a_save_into_a_missing_folder_is_a_config_error_naming_path(tuner, tmp_path, monkeypatch, merge):
    # It was a bare FileNotFoundError, where autotune_gemm's cache_file names the folder.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain").write_text("not a folder")
    for name in (tmp_path / "missing" / "gemm.json", "missing/gemm.json", "plain/gemm.json"):
        with pytest.raises(ConfigError) as info:
            gm.save_gemm_cache(name, merge=merge)
        assert info.value.argument == "path"
        folder = os.path.dirname(os.path.realpath(name))
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        assert str(info.value) == (f"path: {os.fsdecode(name)} cannot be made: its folder {folder} {what}; create "
                                   f"the folder first, or give a file name in an existing folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]
    assert gm.save_gemm_cache("gemm.json", merge=merge) == 1


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


# ---------------------------------------------------------------------------------------
# What an entry keeps through the file, and which entries count as tuned already

_EMPTY = '{"format": "inferctx-gemm-cache", "version": 1, "entries": []}'


def _on_device(device):
    return types.SimpleNamespace(device=device)


def test_an_entry_keeps_its_transposes_tf32_alignments_and_device_through_the_file(tuner, tmp_path):
    # Every field that keys the cache goes to the file as it is and comes back as it was: a
    # transposed a with a plain b is not the other way round, TF32 (float32) is not plain float32,
    # the three alignments are a's, b's and c's in that order, and the device is the one tuned on.
    tuner.aligns[(1, 8, 16, 32)] = (256, 128, 64)
    gm.autotune_gemm([(8, 16, 32)], "float32", trans_a=True, tf32=True, ctx=_on_device(1), progress=False)
    path = tmp_path / "gemm.json"
    assert gm.save_gemm_cache(path) == 1
    [entry] = json.loads(path.read_text())["entries"]
    assert (entry["device"], entry["trans_a"], entry["trans_b"], entry["tf32"]) == (1, True, False, True)
    assert entry["align"] == [256, 128, 64] and entry["dtype"] == "float32"
    assert gm.gemm_cache_entries() == [entry]
    assert gm.load_gemm_cache(path) == 1
    [back] = tuner.imported
    assert back == tuner.cache[0]
    assert (back["problem"]["trans_a"], back["problem"]["trans_b"], back["problem"]["tf32"]) == (True, False, True)
    assert (back["align_a"], back["align_b"], back["align_c"], back["device"]) == (256, 128, 64, 1)


def test_a_tuning_made_on_another_device_is_not_taken_for_this_ones(tuner):
    # The cache keys its entries by device: cuda:1's tuning does nothing for calls on cuda:0,
    # so autotune_gemm on cuda:0 tunes that problem again rather than reporting it cached.
    [first] = gm.autotune_gemm([(8, 16, 32)], "float16", ctx=_on_device(1), progress=False)
    [here] = gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)  # the current device: 0
    assert first["skipped"] is False and here["skipped"] is False and len(tuner.tunes) == 2
    [again] = gm.autotune_gemm([(8, 16, 32)], "float16", ctx=_on_device(1), progress=False)
    assert again["skipped"] is True and len(tuner.tunes) == 2


def test_tf32_and_plain_float32_are_tuned_apart(tuner):
    [plain] = gm.autotune_gemm([(4, 4, 4)], "float32", progress=False)
    [with_tf32] = gm.autotune_gemm([(4, 4, 4)], "float32", tf32=True, progress=False)
    assert plain["skipped"] is False and with_tf32["skipped"] is False and with_tf32["tf32"] is True
    assert [t[7] for t in tuner.tunes] == [False, True]
    [again] = gm.autotune_gemm([(4, 4, 4)], "float32", tf32=True, progress=False)
    assert again["skipped"] is True and len(tuner.tunes) == 2


def test_one_shape_may_be_given_bare(tuner):
    [r] = gm.autotune_gemm((8, 16, 32), "float16", progress=False)
    assert r["shape"] == (1, 8, 16, 32)
    [r] = gm.autotune_gemm((2, 8, 16, 32), "float16", progress=False)
    assert r["shape"] == (2, 8, 16, 32)
    assert [t[3:7] for t in tuner.tunes] == [(8, 16, 32, 1), (8, 16, 32, 2)]


def test_autotune_takes_no_warmup_runs(tuner):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False, warmup=0)
    assert tuner.tunes[-1][9] == 0


def test_the_progress_line_of_a_tuning_without_a_default_timing_is_its_time(tuner, monkeypatch, capsys):
    # A tuning whose cublasGemmEx run gave no time has no speedup; it was still tuned now, not
    # found in the cache.
    tune = tuner._gemm_tune

    def without_default(*args):
        return dict(tune(*args), default_ms=0.0)

    monkeypatch.setattr(gm._core, "_gemm_tune", without_default)
    [r] = gm.autotune_gemm([(8, 16, 32)], "float16")
    assert r["skipped"] is False and r["speedup"] is None and r["default_ms"] is None
    err = capsys.readouterr().err
    assert "fp16 8x16x32: 500.0 us" in err and "cached" not in err, err


def test_gemm_cache_entries_lists_heuristic_entries_on_request_and_clear_forgets_them(tuner, monkeypatch):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    tuned = tuner.cache[0]
    heuristic = dict(tuned, problem=dict(tuned["problem"], m=16, ldc=16), time_ms=-1.0)
    asked = []

    def export(tuned_only):
        asked.append(tuned_only)
        return [tuned] if tuned_only else [tuned, heuristic]

    monkeypatch.setattr(gm._core, "_gemm_cache_export", export)
    assert [e["m"] for e in gm.gemm_cache_entries()] == [8]
    assert [(e["m"], e["time_ms"]) for e in gm.gemm_cache_entries(tuned_only=False)] == [(8, 0.5), (16, -1.0)]
    assert asked == [True, False]
    with pytest.raises(ConfigError) as info:
        gm.gemm_cache_entries(tuned_only="no")
    assert info.value.argument == "tuned_only"
    monkeypatch.setattr(gm._core, "_gemm_cache_export", tuner._gemm_cache_export)
    gm.clear_gemm_cache()
    assert tuner.cache == [] and gm.gemm_cache_entries() == []


# ---------------------------------------------------------------------------------------
# Reading the file


@pytest.mark.parametrize("entries", ["null", "{}", "5", '"abc"'])
def test_a_file_whose_entries_are_no_list_is_no_cache(tuner, tmp_path, entries):
    path = tmp_path / "gemm.json"
    path.write_text(f'{{"format": "inferctx-gemm-cache", "version": 1, "entries": {entries}}}')
    with pytest.raises(ConfigError) as info:
        gm.load_gemm_cache(path)
    assert info.value.argument == "path" and "is not an inferctx GEMM cache" in str(info.value), str(info.value)


def test_an_alignment_of_2_31_is_refused(tuner, tmp_path):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    good = gm.gemm_cache_entries()[0]
    path = tmp_path / "gemm.json"
    path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1,
                                "entries": [dict(good, align=[256, 256, 2**31])]}))
    with pytest.raises(ConfigError) as info:
        gm.load_gemm_cache(path)
    assert info.value.argument == "path" and "align is [256, 256, 2147483648]" in str(info.value)
    path.write_text(json.dumps({"format": "inferctx-gemm-cache", "version": 1,
                                "entries": [dict(good, align=[256, 256, 2**31 - 1])]}))
    assert gm.load_gemm_cache(path) == 1  # the compiled checks are stood in for here


def test_a_file_of_exactly_64_mib_is_read(tuner, tmp_path):
    # The limit is on more than 64 MiB: a file of exactly that size (an empty cache, padded with
    # spaces) is read whole.
    path = tmp_path / "big.json"
    document = _EMPTY.encode()
    with open(path, "wb") as f:
        f.write(document + b" " * ((64 << 20) - len(document)))
    assert path.stat().st_size == 64 << 20
    assert gm.load_gemm_cache(path) == 0


class _FirstLookSeesARegularFile:
    """The os module, but for a stat of `name`, which reports `regular`'s: a name swapped for
    another file between the look and the open."""

    def __init__(self, name, regular):
        self._name, self._regular = os.fspath(name), os.fspath(regular)

    def stat(self, path, *args, **kwargs):
        if os.fspath(path) == self._name:
            return os.stat(self._regular)
        return os.stat(path, *args, **kwargs)

    def __getattr__(self, attribute):
        return getattr(os, attribute)


def test_a_fifo_swapped_in_after_the_first_look_is_refused_through_its_descriptor(tuner, tmp_path, monkeypatch):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    regular = tmp_path / "gemm.json"
    regular.write_text(_EMPTY)
    monkeypatch.setattr(_gemm_cache, "os", _FirstLookSeesARegularFile(fifo, regular))
    box = {}

    def load():
        try:
            box["value"] = gm.load_gemm_cache(fifo)
        except BaseException as exc:  # noqa: BLE001 - looked at on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(5)
    try:
        assert not thread.is_alive(), "load_gemm_cache blocked on the FIFO"
    finally:
        try:  # a reader blocked on it goes on
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    error = box.get("error")
    assert isinstance(error, ConfigError), box
    assert error.argument == "path" and str(error).startswith(f"path: {fifo} is a FIFO, not a regular file")


@pytest.mark.parametrize("name", ["sub/..", "sub/.", "sub/"])
def test_a_name_of_a_folder_is_refused_as_such(tuner, tmp_path, monkeypatch, name):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    for call in (lambda: gm.load_gemm_cache(name), lambda: gm.save_gemm_cache(name),
                 lambda: gm.save_gemm_cache(name, merge=False)):
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.argument == "path" and "names a folder, not a file" in str(info.value), str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub"] and list((tmp_path / "sub").iterdir()) == []


def test_autotune_refuses_a_link_into_a_missing_folder_before_tuning(tuner, tmp_path):
    # A link whose file would be made in a folder that does not exist: the save would fail only
    # after every shape was tuned.
    link = tmp_path / "gemm.json"
    link.symlink_to(tmp_path / "missing" / "gemm.json")
    with pytest.raises(ConfigError) as info:
        gm.autotune_gemm([(8, 16, 32)], "float16", progress=False, cache_file=link)
    assert info.value.argument == "cache_file" and "folder" in str(info.value), str(info.value)
    assert tuner.tunes == [] and not (tmp_path / "missing").exists()


# ---------------------------------------------------------------------------------------
# Writing the file: replaced whole, by one save at a time


def test_a_save_replaces_the_file_whole_so_a_reader_of_the_old_one_reads_it_whole(tuner, tmp_path):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    path = tmp_path / "gemm.json"
    path.write_text(_EMPTY)
    with open(path) as reader:
        assert gm.save_gemm_cache(path) == 1
        assert reader.read() == _EMPTY  # the file it opened, untouched
    assert len(json.loads(path.read_text())["entries"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemm.json"]


@pytest.mark.parametrize("merge", [True, False])
def test_a_save_that_fails_while_writing_leaves_the_file_and_no_other(tuner, tmp_path, monkeypatch, merge):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    path = tmp_path / "gemm.json"
    path.write_text(_EMPTY)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gm, "json", types.SimpleNamespace(dump=disk_full, dumps=json.dumps))
    with pytest.raises(OSError) as info:
        gm.save_gemm_cache(path, merge=merge)
    assert info.value.errno == errno.ENOSPC
    assert path.read_text() == _EMPTY and sorted(p.name for p in tmp_path.iterdir()) == ["gemm.json"]


def test_a_save_never_writes_over_a_file_of_the_name_it_picked_for_its_new_one(tuner, tmp_path, monkeypatch):
    # The new file is written under a random name beside the old one; a file of that name
    # already there (another save's, say) is left alone and another name picked.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    names = iter(["0" * 16, "1" * 16])
    monkeypatch.setattr(gm, "secrets", types.SimpleNamespace(token_hex=lambda n: next(names)))
    theirs = tmp_path / f".gemm-cache-{'0' * 16}.json"
    theirs.write_text("another save's file")
    path = tmp_path / "gemm.json"
    assert gm.save_gemm_cache(path) == 1
    assert theirs.read_text() == "another save's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name, "gemm.json"]
    assert len(json.loads(path.read_text())["entries"]) == 1


def test_two_merging_saves_into_one_folder_take_turns(tuner, tmp_path, monkeypatch):
    # A save that read the file while another was between its read and its replacement would
    # write it back without the other's entries: the second waits for the first to finish.
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    path = tmp_path / "gemm.json"
    path.write_text(_EMPTY)
    read = gm._read_cache_file
    reading, go = threading.Event(), threading.Event()
    calls = []

    def slow_first_read(name):
        calls.append(name)
        if len(calls) == 1:
            reading.set()
            assert go.wait(10)
        return read(name)

    monkeypatch.setattr(gm, "_read_cache_file", slow_first_read)
    done = []
    first = threading.Thread(target=lambda: done.append(("first", gm.save_gemm_cache(path))))
    second = threading.Thread(target=lambda: done.append(("second", gm.save_gemm_cache(path))))
    first.start()
    try:
        assert reading.wait(10)
        second.start()
        second.join(0.5)
        assert second.is_alive() and done == [] and len(calls) == 1  # waiting for the first
    finally:
        go.set()
        first.join(10)
        second.join(10)
    assert sorted(done) == [("first", 1), ("second", 1)] and len(calls) == 2


def test_a_process_forked_during_a_save_does_not_keep_the_folder_locked(tuner, tmp_path, monkeypatch):
    gm.autotune_gemm([(8, 16, 32)], "float16", progress=False)
    path = tmp_path / "gemm.json"
    path.write_text(_EMPTY)
    read = gm._read_cache_file
    children = []

    def fork_while_locked(name):
        with warnings.catch_warnings():  # Python 3.12 warns of fork() in a process with threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child outlives the save, holding whatever it inherited
            try:
                time.sleep(10)
            finally:
                os._exit(0)
        children.append(pid)
        return read(name)

    monkeypatch.setattr(gm, "_read_cache_file", fork_while_locked)
    try:
        assert gm.save_gemm_cache(path) == 1
        # The child lets go of the folder as soon as it runs (it may not have run yet), not
        # when it exits.
        folder = os.open(tmp_path, os.O_RDONLY)
        try:
            deadline = time.monotonic() + 3
            while True:
                try:
                    fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the forked child keeps the folder locked"
                    time.sleep(0.01)
        finally:
            os.close(folder)
    finally:
        for pid in children:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    assert stat.S_ISREG(path.stat().st_mode)

"""`--suite-part K/N` (suite_parts.py): the N parts together run every test once, whole files each,
about as many tests each; a bad value is refused before anything runs."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from suite_parts import part_of_each_file

HERE = pathlib.Path(__file__).resolve().parent

# Five files of 4, 1, 6, 2 and 3 tests (16 in all), named so that they collect in this order.
FILES = {"test_a.py": 4, "test_b.py": 1, "test_c.py": 6, "test_d.py": 2, "test_e.py": 3}


@pytest.fixture
def small_suite(tmp_path):
    for name, n in FILES.items():
        (tmp_path / name).write_text("".join(f"def test_{i}():\n    pass\n\n" for i in range(n)))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "suite_parts", "-p", "no:cacheprovider",
                               "--rootdir", str(tmp_path), *args, str(tmp_path)],
                              capture_output=True, text=True, cwd=tmp_path, timeout=120,
                              env={"PYTHONPATH": str(HERE), "PATH": "/usr/bin:/bin"})
    return run


def _ran(done):
    """The test ids pytest -v reported as passed, and its closing line."""
    ids = re.findall(r"^(\S+::\S+) PASSED", done.stdout, re.M)
    return ids, done.stdout.strip().splitlines()[-1]


def test_any_machine_the_parts_run_every_test_once_in_whole_files(small_suite):
    everything, _ = _ran(small_suite("-v"))
    assert len(everything) == 16
    for parts, want in ((2, [["test_a.py", "test_b.py"], ["test_c.py", "test_d.py", "test_e.py"]]),
                        (3, [["test_a.py", "test_b.py"], ["test_c.py"], ["test_d.py", "test_e.py"]])):
        got = []
        for k in range(1, parts + 1):
            done = small_suite("-v", "--suite-part", f"{k}/{parts}")  # as the docs write it
            assert done.returncode == 0, done.stdout + done.stderr
            ids, closing = _ran(done)
            files = sorted({i.split("::")[0] for i in ids})
            assert files == want[k - 1], (parts, k, files)
            assert len(ids) == sum(FILES[f] for f in files)
            assert f"{16 - len(ids)} deselected" in closing, closing
            got += ids
        assert sorted(got) == sorted(everything), parts  # each test once, none left out


def test_any_machine_each_file_goes_to_the_part_holding_its_middle_test():
    # 16 tests: a's middle is test 2 (part 1 of 2 covers tests 0..7), b's 4.5, c's 8 (part 2),
    # d's 12, e's 14.5. In thirds (0..5.33, 5.33..10.67, 10.67..16): 1, 1, 2, 3, 3.
    assert part_of_each_file(list(FILES.values()), 2) == [1, 1, 2, 2, 2]
    assert part_of_each_file(list(FILES.values()), 3) == [1, 1, 2, 3, 3]
    assert part_of_each_file([5], 4) == [3]          # one file: the part of its middle (2.5 of 5)
    assert part_of_each_file([1, 1], 1) == [1, 1]
    assert part_of_each_file([1, 1, 1, 1], 4) == [1, 2, 3, 4]


@pytest.mark.parametrize("value", ["3/2", "0/2", "1/0", "x", "1", "1/2/3", "-1/2", ""])
def test_any_machine_a_bad_part_is_refused_by_name_before_anything_runs(small_suite, tmp_path, value):
    # Before anything is collected: a test module that leaves a file when it is imported leaves none.
    (tmp_path / "test_f.py").write_text("import pathlib\npathlib.Path(__file__).with_name('imported').touch()\n")
    done = small_suite(f"--suite-part={value}")  # one word: argparse takes "-1/2" for an option
    assert done.returncode == 4, done.stdout + done.stderr  # pytest's usage error
    assert f"--suite-part {value!r}: give K/N, two whole numbers with 1 <= K <= N" in done.stderr
    assert "passed" not in done.stdout
    assert not (tmp_path / "imported").exists()  # refused at configure time, not at collection


def test_any_machine_the_suites_own_conftest_applies_the_parts():
    # The tests above load suite_parts as a plugin of their own; this one runs the suite's own
    # conftest.py, which must apply the parts (with its hook emptied, every part ran everything).
    # test_readme_gpu.py holds 2 tests and test_concurrency.py 3 (5 in all): the first's middle,
    # test 1, lies in part 1 of 2 (tests 0..2.5), the second's, 3.5, in part 2.
    for part, collected, deselected in (("1/2", 2, 3), ("2/2", 3, 2)):
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                               "--suite-part", part, "test_readme_gpu.py", "test_concurrency.py"],
                              capture_output=True, text=True, cwd=HERE, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"{collected}/5 tests collected ({deselected} deselected)" in done.stdout, done.stdout

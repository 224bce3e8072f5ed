"""`--suite-part K/N`: run the K-th of N parts of the collected tests.

A whole suite too long for one run of a machine with a time limit is run as N runs, one part
each, that together run every collected test exactly once. A part is a run of whole test files
in collection order (a file's fixtures and its module state stay together), and the parts hold
about as many tests each: a file belongs to the part that holds its middle test. The tests of the
other parts are reported as deselected, so each run's closing line says how many it left to the
others. conftest.py takes these hooks; elsewhere, `-p suite_parts` with this folder on the path.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--suite-part", metavar="K/N", default=None,
        help="run the K-th of N parts of the collected tests (whole files, about as many tests "
             "each); the N runs 1/N .. N/N together run every test once")


def parse_part(text: str) -> tuple[int, int]:
    """(K, N) from "K/N", or pytest.UsageError naming the value and what would be valid."""
    k, sep, n = text.partition("/")
    try:
        part, parts = int(k), int(n)
    except ValueError:
        part = parts = 0
    if not sep or parts < 1 or not 1 <= part <= parts:
        raise pytest.UsageError(
            f"--suite-part {text!r}: give K/N, two whole numbers with 1 <= K <= N (e.g. 1/2, then 2/2)")
    return part, parts


def pytest_configure(config):
    text = config.getoption("suite_part", None)
    if text is not None:
        parse_part(text)  # a bad value stops the run before anything is collected


def part_of_each_file(counts: list[int], parts: int) -> list[int]:
    """For files holding counts[i] tests, in order: the part (1..parts) each file belongs to, the
    one whose share of the tests holds the file's middle test."""
    total = sum(counts)
    out, start = [], 0
    for n in counts:
        middle = start + n / 2
        out.append(min(parts, int(middle * parts / total) + 1) if total else 1)
        start += n
    return out


def pytest_collection_modifyitems(config, items):
    text = config.getoption("suite_part", None)
    if text is None or not items:
        return
    part, parts = parse_part(text)
    files: list[list] = []  # the items of each file, in collection order
    for item in items:
        if files and files[-1][0].path == item.path:
            files[-1].append(item)
        else:
            files.append([item])
    owners = part_of_each_file([len(f) for f in files], parts)
    keep = [item for f, owner in zip(files, owners) if owner == part for item in f]
    drop = [item for f, owner in zip(files, owners) if owner != part for item in f]
    items[:] = keep
    if drop:
        config.hook.pytest_deselected(items=drop)

"""Shared fixtures: the `gpu` marker skips, visibly, where no CUDA device is usable; `--suite-part
K/N` runs one of N parts of the suite (suite_parts.py)."""

from __future__ import annotations

import functools

import pytest

import suite_parts
from suite_parts import pytest_addoption, pytest_configure  # noqa: F401  (--suite-part)


@functools.lru_cache(maxsize=1)
def gpu_available() -> tuple[bool, str]:
    from inferctx import _core
    from inferctx.errors import NoCudaDeviceError

    try:
        n = _core._device_count()
    except NoCudaDeviceError as exc:
        return False, f"no CUDA device: {exc.name}"
    return n > 0, f"{n} CUDA device(s)"


def pytest_collection_modifyitems(config, items):
    suite_parts.pytest_collection_modifyitems(config, items)
    ok, why = gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU ({why})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def torch():
    """torch with a CUDA device (the test skips, saying why, otherwise)."""
    t = pytest.importorskip("torch")
    if not t.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    before = t.cuda.current_stream()
    yield t
    # A test whose torch.cuda.graph capture failed leaves torch's capture stream current (its
    # __exit__ raises from capture_end before restoring the stream): every later test would run
    # on that stream, and CuPy callers' work would no longer be ordered with torch's.
    if t.cuda.current_stream() != before:
        t.cuda.set_stream(before)

"""The source distribution holds what a build from it needs, and nothing built or cached; the
installed distribution carries its type stubs, py.typed, licences and metadata.

The sdist is made by scikit-build-core's own PEP 517 hook (``build_sdist``, no CMake run), in the
repository root, into a temporary folder: the same file list ``python -m build --sdist`` gives.
scikit-build-core (in the test extra) is looked for in this interpreter, then in the one this
virtual environment was made from; where neither has it the sdist tests skip, saying why. The installed-distribution tests skip where inferctx is not installed as
a distribution (run from the source tree on sys.path, say).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What a build from the sdist reads (CMake files, sources, the vendored header and its licence,
# the Python package with its stubs and marker) and what the README's commands use from it.
REQUIRED = [
    "pyproject.toml",
    "CMakeLists.txt",
    "README.md",
    "LICENSE",
    "PKG-INFO",
    "cmake/cuda_libraries.cmake",
    "cuda/CMakeLists.txt",
    "pyx/CMakeLists.txt",
    "pyx/_core.pyx",
    "pyx/_plan.pyx",
    "third_party/dlpack/LICENSE",
    "third_party/dlpack/include/dlpack/dlpack.h",
    "python/inferctx/__init__.py",
    "python/inferctx/py.typed",
    "python/inferctx/_core.pyi",
    "python/inferctx/_plan.pyi",
    "tools/run-tests",
    "tests/cpp/CMakeLists.txt",
    "tests/python/conftest.py",
    "pytest.ini",
]

# Every file of these folders that the build or the test suite reads must be in the sdist.
SOURCE_DIRS = ["cmake", "cuda", "pyx", "python/inferctx", "third_party", "tests/cpp", "tests/python"]
SOURCE_SUFFIXES = {
    ".cmake", ".txt", ".cu", ".cuh", ".cpp", ".hpp", ".h", ".pyx", ".pxi", ".pxd", ".py", ".pyi",
}
SOURCE_NAMES = {"py.typed", "LICENSE"}

# Build outputs, caches and environments: never in an sdist.
FORBIDDEN_PARTS = {
    "build", "_skbuild", "dist", "__pycache__", ".pytest_cache", ".mypy_cache", ".hypothesis",
    ".git", ".ci", "gpu-logs", "hostsan-logs", ".whl",
}
FORBIDDEN_SUFFIXES = {".so", ".o", ".a", ".pyc", ".whl", ".gz", ".egg-info"}
MAX_MEMBER_BYTES = 1 << 20
MAX_TOTAL_BYTES = 16 << 20

_PROBE = (
    "import scikit_build_core, packaging.version as v; "
    "assert v.Version(scikit_build_core.__version__) >= v.Version('0.10'), scikit_build_core.__version__"
)
_BUILD = (
    "import sys; from scikit_build_core.build import build_sdist; "
    "print(build_sdist(sys.argv[1]))"
)


def _run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = 40, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def _interpreter_with_skbuild() -> tuple[str, dict[str, str]] | str:
    """(python, environment) that can import scikit-build-core >= 0.10, or why there is none."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    tried = []
    candidates = [sys.executable]
    base = getattr(sys, "_base_executable", None)
    # (compared as given, not resolved: a venv's python is often a link to the base one, which
    # sees other site-packages when called by its own path)
    if base and os.path.abspath(base) != os.path.abspath(sys.executable):
        candidates.append(base)
    for python in candidates:
        try:
            if _run([python, "-c", _PROBE], env=env).returncode == 0:
                return python, env
        except (OSError, subprocess.TimeoutExpired):
            pass
        tried.append(python)
    return (f"scikit-build-core >= 0.10 is not importable from {', '.join(tried)} "
            f"(pip install '.[test]' installs it)")


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tarfile.TarFile]:
    if not (ROOT / "pyproject.toml").is_file() or not (ROOT / "CMakeLists.txt").is_file():
        pytest.skip(f"no source tree at {ROOT}: the sdist is made from the repository root")
    tmp = tmp_path_factory.mktemp("sdist")
    found = _interpreter_with_skbuild()
    if isinstance(found, str):
        pytest.skip(found)
    python, env = found
    out = tmp / "out"
    out.mkdir()
    proc = _run([python, "-c", _BUILD, str(out)], env=env, cwd=ROOT, timeout=50)
    assert proc.returncode == 0, f"build_sdist failed:\n{proc.stdout}\n{proc.stderr}"
    archives = list(out.glob("*.tar.gz"))
    assert len(archives) == 1, archives
    tar = tarfile.open(archives[0])
    yield tar
    tar.close()


def _members(tar: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """Members by their path below the sdist's top folder (inferctx-0.1.0/)."""
    out = {}
    for m in tar.getmembers():
        parts = PurePosixPath(m.name).parts
        assert len(parts) >= 1 and parts[0].startswith("inferctx-"), m.name
        if len(parts) > 1:
            out[PurePosixPath(*parts[1:]).as_posix()] = m
    return out


def test_sdist_holds_what_the_build_needs(sdist: tarfile.TarFile) -> None:
    members = _members(sdist)
    missing = [p for p in REQUIRED if p not in members or not members[p].isfile()]
    assert not missing, f"the sdist lacks {missing}"


def test_sdist_holds_every_source_file_of_the_tree(sdist: tarfile.TarFile) -> None:
    members = _members(sdist)
    missing = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            rel = path.relative_to(ROOT)
            if not path.is_file() or "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            if path.suffix in SOURCE_SUFFIXES or path.name in SOURCE_NAMES:
                if rel.as_posix() not in members:
                    missing.append(rel.as_posix())
    assert not missing, f"source files of the tree missing from the sdist: {missing}"


def test_sdist_holds_no_build_outputs_caches_or_large_files(sdist: tarfile.TarFile) -> None:
    members = _members(sdist)
    bad = [
        p for p in members
        if FORBIDDEN_PARTS.intersection(PurePosixPath(p).parts)
        or any(p.endswith(s) for s in FORBIDDEN_SUFFIXES)
        or PurePosixPath(p).parts[0].startswith(".venv")
    ]
    assert not bad, f"the sdist holds build outputs, caches or environments: {bad}"
    large = [(p, m.size) for p, m in members.items() if m.size > MAX_MEMBER_BYTES]
    assert not large, f"the sdist holds files over {MAX_MEMBER_BYTES} bytes: {large}"
    total = sum(m.size for m in members.values())
    assert total <= MAX_TOTAL_BYTES, f"the sdist's files add up to {total} bytes"


def test_sdist_keeps_the_test_script_executable(sdist: tarfile.TarFile) -> None:
    member = _members(sdist)["tools/run-tests"]
    assert member.mode & 0o111, f"tools/run-tests is stored with mode {oct(member.mode)}"


def test_sdist_metadata_names_the_licences_it_holds(sdist: tarfile.TarFile) -> None:
    members = _members(sdist)
    f = sdist.extractfile(members["PKG-INFO"])
    assert f is not None
    meta = Parser().parsestr(f.read().decode("utf-8"), headersonly=True)
    assert meta["Name"] == "inferctx"
    assert meta["License-Expression"] == "Apache-2.0"
    files = meta.get_all("License-File") or []
    assert set(files) >= {"LICENSE", "third_party/dlpack/LICENSE"}, files
    assert [p for p in files if p not in members] == []
    assert meta["Requires-Python"] == ">=3.10"


@pytest.fixture(scope="module")
def dist() -> importlib.metadata.Distribution:
    try:
        d = importlib.metadata.distribution("inferctx")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("inferctx is not installed as a distribution")
    if d.files is None:
        pytest.skip("the installed inferctx distribution lists no files (no RECORD)")
    import inferctx

    installed = Path(str(d.locate_file("inferctx"))).resolve()
    if Path(inferctx.__file__).resolve().parent != installed:
        pytest.skip(f"inferctx is imported from {Path(inferctx.__file__).parent}, not the installed {installed}")
    return d


def test_installed_package_has_stubs_marker_and_licences(dist: importlib.metadata.Distribution) -> None:
    assert dist.files is not None
    names = {f.as_posix() for f in dist.files}
    for want in ("inferctx/py.typed", "inferctx/_core.pyi", "inferctx/_plan.pyi"):
        assert want in names, f"{want} is not installed"
        assert Path(str(dist.locate_file(want))).is_file(), want
    info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    for lic in ("LICENSE", "third_party/dlpack/LICENSE"):
        assert f"{info}/licenses/{lic}" in names, f"{lic} is not in {info}/licenses"


def test_installed_metadata(dist: importlib.metadata.Distribution) -> None:
    meta = dist.metadata
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.10"
    requires = dist.requires or []
    base = {r.split(";")[0].replace(" ", "") for r in requires if "extra ==" not in r}
    assert any(r.startswith("nvidia-cublas") for r in base), requires
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"test", "plot", "demo"} <= extras, extras
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts.get("inferctx") == "inferctx.cli:main", scripts

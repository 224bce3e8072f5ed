"""The scripts under tools/, checked where they can be without a GPU: they parse, gpu-suite
refuses a step it does not know, its fuzz step runs every GPU fuzz suite there is, the
commands the docs give for gpu-suite and bench-run name steps, variables, files and benchmarks
that exist, and, with stand-ins for python3, cmake, ctest and compute-sanitizer on PATH, the
steps' summaries and exit statuses on success and on each kind of failure; and the programs GPU
tests run in a child process use no name they do not define."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import shutil
import subprocess

import pytest

TOP = pathlib.Path(__file__).resolve().parents[2]
BASH_SCRIPTS = ("gpu-suite", "run-tests", "bench-run", "host-sanitize", "source-stamp")

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@needs_bash
@pytest.mark.parametrize("name", BASH_SCRIPTS)
def test_any_machine_each_bash_script_parses(name):
    path = TOP / "tools" / name
    assert path.read_text().startswith("#!/usr/bin/env bash\n")
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@needs_bash
def test_any_machine_gpu_suite_refuses_an_unknown_step(tmp_path):
    done = subprocess.run(["bash", str(TOP / "tools" / "gpu-suite"), "nosuchstep"], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "unknown step nosuchstep" in done.stderr


def _default_fuzz_suites():
    script = (TOP / "tools" / "gpu-suite").read_text()
    found = re.findall(r"\$\{FUZZ_SUITES:-([a-z_ ]+)\}", script)
    assert len(found) == 1, found
    return found[0].split()


def test_any_machine_the_fuzz_step_runs_every_gpu_fuzz_suite():
    """Each name in gpu-suite's default list selects exactly one hypothesis test of
    test_fuzz_gpu.py (pytest -k test_gpu_NAME), and every such test is named once."""
    module = importlib.import_module("test_fuzz_gpu")
    suites = sorted(name[len("test_gpu_"):] for name, fn in inspect.getmembers(module, inspect.isfunction)
                    if name.startswith("test_gpu_") and hasattr(fn, "hypothesis"))
    listed = _default_fuzz_suites()
    assert suites, "test_fuzz_gpu.py has no hypothesis suite named test_gpu_*"
    assert len(listed) == len(set(listed)), listed
    assert sorted(listed) == suites
    for name in listed:  # -k matches substrings: no suite's name may contain another's
        assert [s for s in suites if name in s] == [name], name


def _documented_commands(script):
    """Each command in backquotes in README.md and docs/*.md that runs tools/`script`: the
    variables it sets and the words after the script's name."""
    found = []
    for page in [TOP / "README.md", *sorted((TOP / "docs").glob("*.md"))]:
        for text in re.findall(r"`([^`]*tools/%s\b[^`]*)`" % re.escape(script), page.read_text()):
            before, after = text.split(f"tools/{script}", 1)
            env = dict(re.findall(r'([A-Z][A-Z0-9_]*)=("[^"]*"|\S+)', before))
            found.append((page.name, {k: v.strip('"') for k, v in env.items()}, after.split()))
    return found


def _gpu_suite_steps():
    script = (TOP / "tools" / "gpu-suite").read_text()
    return set(re.findall(r"^    ([a-z]+)\)$", script, re.M))


def test_any_machine_the_steps_and_variables_the_docs_give_gpu_suite_exist():
    """A documented gpu-suite command names only steps the script has and sets only variables
    that the scripts or the tests read; its suites, files and executables exist."""
    steps = _gpu_suite_steps()
    assert {"build", "tests", "faults", "sanitize", "pysanitize", "fuzz", "bench"} <= steps
    scripts = "".join((TOP / "tools" / s).read_text() for s in BASH_SCRIPTS)
    tests = "".join(p.read_text() for p in (TOP / "tests" / "python").glob("*.py"))
    commands = _documented_commands("gpu-suite")
    assert len(commands) >= 5, commands
    for page, env, words in commands:
        assert set(words) <= steps, (page, words)
        for name, value in env.items():
            is_read = "${%s" % name in scripts or f'"{name}"' in tests  # ${NAME...} or os.environ["NAME"]
            assert is_read, f"{page}: {name} is read by no script under tools/ and no test"
            if name == "FUZZ_SUITES" and value != "SUITE":
                assert set(value.split()) <= set(_default_fuzz_suites()), (page, value)
            if name == "SANITIZE_TESTS":
                for exe in value.split():
                    stem = pathlib.Path(exe).name
                    assert exe == f"build/ctest/tests/cpp/{stem}", (page, exe)
                    assert list((TOP / "tests" / "cpp").glob(stem + ".c*")), (page, exe)
            if name == "PYSANITIZE_TESTS" and value != "...":
                # Files, then optionally pytest's -k and its expression (the step passes the words on).
                words = value.split()
                if "-k" in words:
                    at = words.index("-k")
                    assert at == len(words) - 2 and at > 0, (page, value)
                    words = words[:at]
                for f in words:
                    assert (TOP / f).is_file(), (page, f)


def test_any_machine_the_benchmarks_the_docs_give_bench_run_exist():
    commands = _documented_commands("bench-run")
    assert len(commands) >= 2, commands
    for page, _, words in commands:
        assert words, (page, "tools/bench-run with no benchmark")
        for name in (w for w in words if w != "NAME..."):  # NAME...: the usage line
            assert (TOP / "bench" / f"{name}.py").is_file(), (page, name)


# Stand-ins for the programs the scripts run on the GPU machine. Each notes its call in $CALLS;
# the variables named in capitals choose what it does.
STAND_INS = {
    "python3": r"""
printf 'python3 %s | SANITIZE=%s\n' "$*" "${INFERCTX_SANITIZE:-}" >>"$CALLS"
if [ "$1 $2" = "-m pip" ]; then
  prev=""; for a in "$@"; do [ "$prev" = --target ] && target=$a; prev=$a; done
  echo "  [3/40] Building CXX object CMakeFiles/inferctx.dir/cuda/errors.cpp.o"
  [ "${PIP_RC:-0}" = 0 ] || exit "$PIP_RC"
  mkdir -p "$target/inferctx"; echo "Successfully installed inferctx-0.1.0"; exit 0
fi
if [ "$1 $2" = "-m pytest" ]; then
  for a in "$@"; do printf '  arg<%s>\n' "$a" >>"$CALLS"; done  # each argument as pytest gets it
  echo "...."
  case "${PYTEST:-pass}" in
    pass) echo "3 passed in 0.10s" ;;
    fail) echo "1 failed, 2 passed in 0.10s"; exit 1 ;;
    warning) echo "1 warning in 0.59s"; exit 5 ;;
    killed) kill -KILL $$ ;;
  esac
  exit 0
fi
case "$1" in bench/*.py)
  b=$(basename "$1" .py); prev=""; for a in "$@"; do [ "$prev" = --json ] && json=$a; prev=$a; done
  [ "$b" = "${BENCH_FAIL:-}" ] && { echo "Traceback"; exit 3; }
  echo '{}' >"$json"; echo "$b done"; exit 0 ;;
esac
exit 99
""",
    "cmake": r"""
printf 'cmake %s | SANITIZE=%s\n' "$*" "${INFERCTX_SANITIZE:-}" >>"$CALLS"
if [ "$1" = -S ]; then mkdir -p "$4"; exit 0; fi
[ "${BUILD_RC:-0}" = 0 ] || exit "$BUILD_RC"
mkdir -p "$2/tests/cpp"
for t in ${EXES-test_plan test_fp16 test_context}; do
  printf '#!/usr/bin/env bash\necho "%s ran"\n' "$t" >"$2/tests/cpp/$t"; chmod +x "$2/tests/cpp/$t"
done
""",
    "ctest": r"""
printf 'ctest %s | SANITIZE=%s LSAN_OPTIONS=%s\n' "$*" "${INFERCTX_SANITIZE:-}" "${LSAN_OPTIONS:-}" >>"$CALLS"
if [ "${CTEST_RC:-0}" = 0 ]; then
  echo "100% tests passed out of 3"
  [ -z "${CTEST_SKIPPED:-}" ] || printf 'The following tests did not run:\n\t  3 - test_context (Skipped)\n'
  exit 0
fi
echo "15 cases, 2 failed checks"; echo "67% tests passed, 1 tests failed out of 3"; exit 8
""",
    "compute-sanitizer": r"""
printf 'compute-sanitizer %s | VMM_OFF=%s SANITIZE=%s\n' "$*" "${INFERCTX_DISABLE_VMM:-}" "${INFERCTX_SANITIZE:-}" >>"$CALLS"
while [ $# -gt 0 ]; do case "$1" in
  --tool) tool=$2; shift 2 ;;
  --error-exitcode|--require-cuda-init|--kernel-name|--kernel-name-exclude|--report-api-errors) shift 2 ;;
  *) break ;; esac; done
"$@"; rc=$?
case " ${SAN_KILL_WRAPPER:-} " in *" $tool:$(basename "$1") "*)  # the bash around timeout around this
  kill -KILL "$(ps -o ppid= -p "$PPID" | tr -d ' ')"; exit 1 ;; esac
case " ${SAN_KILL:-} " in *" $tool:$(basename "$1") "*|*" $tool "*)
  echo "========= Error: process didn't terminate successfully"; echo "========= ERROR SUMMARY: 0 errors"; exit 0 ;; esac
case " ${SAN_FAIL:-} " in *" $tool:$(basename "$1") "*)
  echo "========= ERROR SUMMARY: 2 errors"; exit 1 ;; esac
echo "========= ERROR SUMMARY: 0 errors"; exit $rc
""",
    "g++": r"""
case "$1" in --version) echo "g++ (stand-in) 12" ;; -print-file-name=*) echo "/nonexistent/${1#*=}" ;; esac
""",
}


@pytest.fixture
def stand_ins(tmp_path):
    """tools/ copied into a folder whose path has a space, with the few sources its stamp reads and
    two benchmarks (and a helper module), the stand-ins first on PATH; returns run(SCRIPT,
    *ARGS, **ENV) and the folders."""
    repo = tmp_path / "a repo"
    shutil.copytree(TOP / "tools", repo / "tools")
    for f in ("CMakeLists.txt", "pyproject.toml", "cmake/libs.cmake", "cuda/k.cu", "pyx/m.pyx",
              "python/inferctx/__init__.py", "third_party/dlpack/include/dlpack.h",
              "bench/fast.py", "bench/other.py", "bench/_helper.py"):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text("# " + f + "\n")
    bin_dir = tmp_path / "stand-ins"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body.lstrip("\n"))
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "out dir"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out), "CALLS": str(tmp_path / "calls.log"),
           "INFERCTX_SITE": str(tmp_path / "site dir"), "INFERCTX_FAULT_SITE": str(tmp_path / "fault site"),
           "HOSTSAN_BUILD": str(tmp_path / "hostsan build"), "FUZZ_SUITES": "dropout"}

    def run(script, *args, **extra):
        (tmp_path / "calls.log").write_text("")
        done = subprocess.run(["bash", str(repo / "tools" / script), *args], capture_output=True, text=True,
                              env={**env, **extra}, timeout=120)
        summary = out / "summary.txt"
        done.summary = summary.read_text() if summary.exists() else ""
        done.calls = (tmp_path / "calls.log").read_text()
        return done

    run.repo, run.out, run.site = repo, out, pathlib.Path(env["INFERCTX_SITE"])
    return run


@needs_bash
def test_any_machine_run_tests_runs_pytest_after_a_failed_ctest(stand_ins):
    done = stand_ins("run-tests", "-x", CTEST_RC="1")
    assert done.returncode == 8, (done.stdout, done.stderr)
    assert "-m pytest tests/python -ra -x" in done.calls
    done = stand_ins("run-tests", CTEST_RC="1", PYTEST="fail")
    assert done.returncode == 1
    assert stand_ins("run-tests").returncode == 0


@needs_bash
def test_any_machine_gpu_suite_reads_this_runs_output_only(stand_ins):
    """A second run into the same $OUT whose pytest was killed shows no pytest line, not the
    first run's; a killed fault-injection run shows none either, not a line of its build."""
    first = stand_ins("gpu-suite")
    assert first.returncode == 0, (first.stdout, first.stderr)
    assert first.summary.splitlines()[-2:] == ["100% tests passed out of 3", "3 passed in 0.10s"]
    again = stand_ins("gpu-suite", "tests", PYTEST="killed")
    assert again.returncode == 1
    assert again.summary.splitlines()[0].startswith("tests rc=137 ")
    assert "passed in" not in again.summary
    faults = stand_ins("gpu-suite", "faults", PYTEST="killed")
    assert faults.returncode == 1
    lines = faults.summary.splitlines()
    assert [line.split()[:2] for line in lines] == [["build-faults", "rc=0"], ["faults", "rc=137"],
                                                    ["faults-cudamalloc", "rc=137"]], lines


@needs_bash
def test_any_machine_gpu_suite_pysanitize_counts_a_killed_run_of_this_run_only(stand_ins):
    killed = stand_ins("gpu-suite", "pysanitize", PYSANITIZE_TOOLS="memcheck racecheck", SAN_KILL="racecheck")
    assert killed.returncode == 1
    assert "py-racecheck: the process was killed" in killed.summary
    assert "py-memcheck: the process was killed" not in killed.summary
    again = stand_ins("gpu-suite", "pysanitize", PYSANITIZE_TOOLS="racecheck")
    assert again.returncode == 0, again.summary
    assert "killed" not in again.summary


@needs_bash
def test_any_machine_gpu_suite_sanitize(stand_ins):
    """Every executable under the four tools, from a folder whose path has a space; a failed run
    fails the exit status whatever the executable's name; INFERCTX_SANITIZE is set for the
    sanitized runs, not for a later step; no earlier run's log joins sanitizer.log."""
    stand_ins.out.mkdir()
    (stand_ins.out / "san-memcheck.test_gone.log").write_text("========= ERROR SUMMARY: 9 errors\n")
    done = stand_ins("gpu-suite", "sanitize", "tests", SAN_FAIL="initcheck:test_fp16")
    assert done.returncode == 1, (done.stdout, done.stderr)
    runs = sorted(line for line in done.summary.splitlines() if "check:" in line)
    assert len(runs) == 12, runs  # three executables, four tools each (test_context alone)
    assert "initcheck:test_fp16 rc=1" in runs
    sanitized = [line for line in done.calls.splitlines() if line.startswith("compute-sanitizer")]
    assert len(sanitized) == 12 and all(line.endswith("SANITIZE=1") for line in sanitized)
    assert all("a repo/build/ctest/tests/cpp/test_" in line for line in sanitized)
    later = [line for line in done.calls.splitlines() if line.startswith(("ctest", "python3 -m pytest"))]
    assert later and not [line for line in later if "SANITIZE=1" in line], later
    log = (stand_ins.out / "sanitizer.log").read_text()
    assert "9 errors" not in log and log.count("#####") == 12
    assert not list(stand_ins.out.glob("san-*.log"))
    assert stand_ins("gpu-suite", "sanitize").returncode == 0


@needs_bash
def test_any_machine_gpu_suite_sanitize_fails_when_nothing_or_the_wrong_thing_runs(stand_ins):
    none = stand_ins("gpu-suite", "sanitize", EXES="")
    assert none.returncode == 1 and "sanitize: no executable" in none.summary
    typo = stand_ins("gpu-suite", "sanitize", SANITIZE_TESTS="build/ctest/tests/cpp/test_plna")
    assert typo.returncode == 1
    assert "sanitize: no executable build/ctest/tests/cpp/test_plna" in typo.summary
    # A ctest build that failed stops the step, not the steps after it.
    unbuilt = stand_ins("gpu-suite", "sanitize", "fuzz", BUILD_RC="1")
    assert unbuilt.returncode == 1
    assert "sanitize: the ctest executables did not build" in unbuilt.summary
    assert "fuzz:dropout rc=0" in unbuilt.summary


@needs_bash
def test_any_machine_gpu_suite_builds_once_and_never_tests_a_stale_build(stand_ins):
    done = stand_ins("gpu-suite", "build", "bench")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.calls.count("-m pip install") == 1  # bench-run takes the build step's
    assert "=== build: python3 -m pip" in (stand_ins.out / "build.log").read_text()
    assert "=== fast rc=0" in done.summary and "=== other rc=0" in done.summary and "_helper" not in done.summary
    # tests, pysanitize and fuzz build what is not a build of these sources, once.
    (stand_ins.repo / "cuda" / "k.cu").write_text("// changed\n")
    done = stand_ins("gpu-suite", "tests", "fuzz", PYSANITIZE_TOOLS="memcheck")
    assert done.returncode == 0
    assert done.calls.count("-m pip install") == 1
    assert stand_ins("gpu-suite", "pysanitize", PYSANITIZE_TOOLS="memcheck").calls.count("-m pip") == 0
    # After a failed build nothing runs against the build that was there before.
    (stand_ins.repo / "cuda" / "k.cu").write_text("// changed again\n")
    failed = stand_ins("gpu-suite", "build", "tests", "bench", "faults", PIP_RC="1")
    assert failed.returncode == 1
    assert "tests: not run, the build step failed" in failed.summary
    assert "bench: not run, the build step failed" in failed.summary
    assert "-m pytest" not in failed.calls and "bench/" not in failed.calls
    assert "build-faults rc=1" in failed.summary  # faults makes a build of its own


@needs_bash
def test_any_machine_a_failed_benchmark_fails_bench_run_and_the_bench_step(stand_ins):
    done = stand_ins("gpu-suite", "bench", BENCH_FAIL="fast")
    assert done.returncode == 1
    assert done.summary.splitlines()[0].startswith("bench rc=1 ")
    assert "=== fast rc=3" in done.summary
    again = stand_ins("bench-run", "other")
    assert again.returncode == 0
    assert (stand_ins.out / "bench-summary.txt").read_text().splitlines()[0].startswith("=== other rc=0")


@needs_bash
def test_any_machine_gpu_suite_checks_every_step_name_first(stand_ins):
    done = stand_ins("gpu-suite", "build", "tsets")
    assert done.returncode == 2
    assert "unknown step tsets" in done.stderr
    assert done.calls == ""


def _sanitizer_flags(text):
    """The sanitizers' parse of an options string: name=value pairs apart at spaces, colons or
    commas, a value in quotes kept whole."""
    flags, i = {}, 0
    while i < len(text):
        if text[i] in " :,\t\n":
            i += 1
            continue
        eq = text.index("=", i)
        name, i = text[i:eq], eq + 1
        if i < len(text) and text[i] in "'\"":
            end = text.index(text[i], i + 1)
            flags[name], i = text[i + 1:end], end + 1
        else:
            end = i
            while end < len(text) and text[end] not in " :,\t\n":
                end += 1
            flags[name], i = text[i:end], end
    return flags


@needs_bash
def test_any_machine_host_sanitize(stand_ins):
    """The suppressions file reaches LeakSanitizer from a path with a space, and a pytest that
    died leaves no pytest line (a ctest executable's "N cases, M failed checks" is none)."""
    done = stand_ins("host-sanitize", CTEST_RC="1", PYTEST="killed")
    assert done.returncode == 1
    lsan = re.search(r"LSAN_OPTIONS=(.*)$", [c for c in done.calls.splitlines() if c.startswith("ctest")][0]).group(1)
    assert _sanitizer_flags(lsan)["suppressions"] == str(stand_ins.repo / "tools" / "lsan.supp")
    lines = done.stdout.splitlines()
    assert lines[-2:] == ["67% tests passed, 1 tests failed out of 3", lines[-1]]
    assert lines[-1].startswith("hostsan pytest rc=137 "), lines
    done = stand_ins("gpu-suite", "hostsan", PYTEST_ARGS="--durations=5")
    assert done.returncode == 0, done.stdout
    assert done.summary.splitlines()[-1] == "3 passed in 0.10s"
    assert "--durations=5" in done.calls


def _child_scripts():
    """(file, name, source) of every module-level string constant named *_SCRIPT in the test
    files: the programs GPU tests run in a child process, which no CPU run ever executes."""
    import ast

    found = []
    for path in sorted((TOP / "tests" / "python").glob("test_*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and node.targets[0].id.endswith("_SCRIPT")
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                found.append((path.name, node.targets[0].id, node.value.value))
    return found


def _undefined_globals(source):
    """Names a program reads as globals (at top level or from inside its functions) that it
    neither assigns, imports, defines nor gets from builtins."""
    import builtins
    import symtable

    top = symtable.symtable(source, "<script>", "exec")
    bound = {s.get_name() for s in top.get_symbols()
             if s.is_assigned() or s.is_imported() or s.is_namespace()}
    read = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    todo = list(top.get_children())
    while todo:
        table = todo.pop()
        todo.extend(table.get_children())
        for s in table.get_symbols():
            if s.is_referenced() and s.is_global():
                read.add(s.get_name())
            if s.is_declared_global() and s.is_assigned():
                bound.add(s.get_name())
    return sorted(read - bound - set(dir(builtins)))


def test_any_machine_the_child_process_scripts_define_every_name_they_use():
    scripts = _child_scripts()
    # The files that hold such scripts today: a rename that hid them from this test fails here.
    assert {f for f, _, _ in scripts} >= {"test_call_contract.py", "test_decoder.py", "test_fuzz_gpu.py",
                                           "test_streams.py", "test_views.py"}
    for file, name, source in scripts:
        assert _undefined_globals(source) == [], f"{file}: {name}"


def test_any_machine_the_script_name_check_finds_a_name_defined_only_in_the_test_file():
    # What the check is for: a name the test module defines, used in the child's program.
    assert _undefined_globals("import torch\ntorch.cuda._sleep(100 * _LONG)\n") == ["_LONG"]
    assert _undefined_globals("def f():\n    return _LONG\nf()\n") == ["_LONG"]
    assert _undefined_globals("_LONG = 1\ndef f():\n    return _LONG + len([])\nf()\n") == []
    assert _undefined_globals("def f():\n    global g\n    g = 1\nf()\nprint(g)\n") == []


@needs_bash
def test_any_machine_the_tool_scripts_refuse_what_would_run_nothing(stand_ins):
    bogus = stand_ins("gpu-suite", "bogus")
    assert bogus.returncode == 2 and not stand_ins.out.exists()  # refused before making $OUT
    for step, extra, words in [
            ("sanitize", {"SANITIZE_TESTS": " "}, "sanitize: SANITIZE_TESTS names nothing to run"),
            ("fuzz", {"FUZZ_SUITES": " "}, "fuzz: FUZZ_SUITES names nothing to run"),
            ("pysanitize", {"PYSANITIZE_TOOLS": " "}, "pysanitize: PYSANITIZE_TOOLS or PYSANITIZE_TESTS names nothing")]:
        done = stand_ins("gpu-suite", step, **extra)
        assert done.returncode == 1 and words in done.summary, (step, done.summary)
    none = stand_ins("bench-run")
    assert none.returncode == 2 and "usage: tools/bench-run NAME" in none.stderr
    typo = stand_ins("bench-run", "other", "fsat")
    assert typo.returncode == 2 and "no benchmark bench/fsat.py" in typo.stderr
    assert "-m pip" not in typo.calls and "bench/other.py" not in typo.calls


@needs_bash
def test_any_machine_bench_run_keeps_no_earlier_lines_after_a_failed_build(stand_ins):
    assert stand_ins("bench-run", "other").returncode == 0
    summary = stand_ins.out / "bench-summary.txt"
    assert summary.read_text().startswith("=== other rc=0")
    (stand_ins.repo / "cuda" / "k.cu").write_text("// changed\n")
    failed = stand_ins("bench-run", "other", PIP_RC="1")
    assert failed.returncode == 1 and summary.read_text() == ""
    assert not (stand_ins.out / "bench-json.tgz").exists()


@needs_bash
def test_any_machine_the_source_stamp_covers_cmake_and_third_party(stand_ins):
    def stamp():
        return subprocess.run(["bash", str(stand_ins.repo / "tools" / "source-stamp")], capture_output=True,
                              text=True, check=True).stdout

    before = stamp()
    for f in ("cmake/libs.cmake", "third_party/dlpack/include/dlpack.h"):
        (stand_ins.repo / f).write_text("# changed\n")
        after = stamp()
        assert after != before, f
        before = after


@needs_bash
def test_any_machine_ctest_skips_are_counted_beside_its_line(stand_ins):
    done = stand_ins("gpu-suite", "tests", CTEST_SKIPPED="1")
    assert done.returncode == 0
    lines = done.summary.splitlines()
    i = lines.index("100% tests passed out of 3")
    assert lines[i + 1] == "ctest: 1 of them skipped (tests.log names them)"
    assert "skipped" not in stand_ins("gpu-suite", "tests").summary


@needs_bash
def test_any_machine_pytests_closing_line_of_warnings_alone_is_read(stand_ins):
    # pytest ends a run that ran no test but warned with "1 warning in ..."; its absence from the
    # summary would read as a pytest that died.
    done = stand_ins("gpu-suite", "tests", PYTEST="warning")
    assert done.summary.splitlines()[-1] == "1 warning in 0.59s"


@needs_bash
def test_any_machine_pysanitize_keeps_a_k_expression_whole(stand_ins):
    done = stand_ins("gpu-suite", "pysanitize", PYSANITIZE_TOOLS="memcheck",
                     PYSANITIZE_TESTS="tests/python/test_gemm.py -k autotune and not slow")
    assert done.returncode == 0, done.summary
    args = [line[len("  arg<"):-1] for line in done.calls.splitlines() if line.startswith("  arg<")]
    assert args[-3:] == ["tests/python/test_gemm.py", "-k", "autotune and not slow"], args


@needs_bash
def test_any_machine_a_sanitize_run_killed_with_its_wrapper_fails_the_step(stand_ins):
    # The wrapper of one parallel run killed: xargs stops starting the queued ones, which print no
    # status line; the step counts the lines it got against the runs it queued.
    done = stand_ins("gpu-suite", "sanitize", EXES="test_plan test_fp16", SAN_KILL_WRAPPER="memcheck:test_plan")
    assert done.returncode == 1, done.summary
    assert re.search(r"^sanitize: \d of 8 runs ended with a status line$", done.summary, re.M), done.summary


@needs_bash
def test_any_machine_run_tests_help_builds_nothing(stand_ins):
    done = stand_ins("run-tests", "--help")
    assert done.returncode == 0 and "tools/run-tests [--build-only | PYTEST_ARGS...]" in done.stdout
    assert done.calls == ""  # neither cmake nor ctest nor pytest ran
    mixed = stand_ins("run-tests", "-x", "--build-only")
    assert mixed.returncode == 2 and "--build-only takes no other argument" in mixed.stderr and mixed.calls == ""


@needs_bash
def test_any_machine_gpu_suite_says_on_stdout_that_it_finished(stand_ins):
    done = stand_ins("gpu-suite", "tests")
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "---- gpu-suite finished: tests, exit 0"
    failed = stand_ins("gpu-suite", "tests", PYTEST="fail")
    assert failed.returncode == 1 and failed.stdout.splitlines()[-1] == "---- gpu-suite finished: tests, exit 1"
    cut = stand_ins("gpu-suite", "tests", PYTEST="killed")  # pytest killed: the step fails, the run ends
    assert cut.stdout.splitlines()[-1] == "---- gpu-suite finished: tests, exit 1"


@needs_bash
def test_any_machine_gpu_suite_builds_and_tests_with_the_python_named(stand_ins, tmp_path):
    """PYTHON names the interpreter of the build, the tests and the sanitized pytest alike, so
    that a build is never tested by another interpreter than the one that made it."""
    other = tmp_path / "other python"
    other.write_text('#!/usr/bin/env bash\nprintf "other-python\\n" >>"$CALLS"\nexec python3 "$@"\n')
    other.chmod(0o755)
    done = stand_ins("gpu-suite", "build", "tests", "pysanitize", PYTHON=str(other),
                     PYSANITIZE_TOOLS="memcheck")
    assert done.returncode == 0, (done.stdout, done.stderr, done.summary)
    lines = done.calls.splitlines()
    runs = [i for i, line in enumerate(lines) if line.startswith("python3 -m ")]
    assert len(runs) >= 3, lines  # the build, the tests' pytest, the sanitized pytest
    for i in runs:  # each run of python3 came through the interpreter named
        assert i > 0 and lines[i - 1] == "other-python", (i, lines)


@needs_bash
def test_any_machine_sanitize_runs_the_workspace_suites_under_the_fallback_when_asked(stand_ins):
    plain = stand_ins("gpu-suite", "sanitize", EXES="test_plan test_context")
    assert plain.returncode == 0, plain.summary
    assert "_cudamalloc" not in plain.summary and "VMM_OFF=1" not in plain.calls
    both = stand_ins("gpu-suite", "sanitize", EXES="test_plan test_context", SANITIZE_CUDAMALLOC="1")
    assert both.returncode == 0, both.summary
    runs = [line for line in both.summary.splitlines() if "check:" in line]
    assert len(runs) == 12, runs  # two executables, four tools each, and test_context's fallback
    fallback = [line for line in both.calls.splitlines() if "VMM_OFF=1" in line]
    assert len(fallback) == 4 and all("/tests/cpp/test_context " in line for line in fallback), fallback
    for tool in ("memcheck", "racecheck", "initcheck", "synccheck"):
        assert f"{tool}:test_context_cudamalloc rc=0" in runs and f"{tool}:test_context rc=0" in runs
    assert "##### memcheck.test_context_cudamalloc" in (stand_ins.out / "sanitizer.log").read_text()


@needs_bash
def test_any_machine_the_pytest_step_runs_pytest_alone_with_pytest_args(stand_ins):
    """The second half of a whole suite in two runs: pytest with PYTEST_ARGS, no ctest."""
    done = stand_ins("gpu-suite", "pytest", PYTEST_ARGS="--suite-part 2/2 --durations=30")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "ctest" not in done.calls and "cmake" not in done.calls
    args = [line[len("  arg<"):-1] for line in done.calls.splitlines() if line.startswith("  arg<")]
    assert args == ["-m", "pytest", "tests/python", "-q", "-ra", "--suite-part", "2/2", "--durations=30"], args
    lines = done.summary.splitlines()
    assert [line.split()[:2] for line in lines[:2]] == [["build", "rc=0"], ["pytest", "rc=0"]], lines
    assert lines[-1] == "3 passed in 0.10s"
    failed = stand_ins("gpu-suite", "pytest", PYTEST="fail")
    assert failed.returncode == 1
    assert failed.summary.splitlines()[-2:][0].startswith("pytest rc=1 ")
    assert failed.summary.splitlines()[-1] == "1 failed, 2 passed in 0.10s"

"""Every README example about planning and the CLI runs as written (sections "Set-up", "Python",
"Weights and free memory"): the Python block is executed, its `# -> value` comments are checked,
every `inferctx ...` command runs in-process and exits 0, and the plan excerpt shown under
"Set-up" is what the main job prints."""

import re
import shlex
from pathlib import Path

import pytest

from inferctx.cli import main

README = (Path(__file__).parents[2] / "README.md").read_text()
SECTIONS = ("## Set-up", "## Python", "## Weights and free memory")


def section(title):
    start = README.index(title)
    end = README.find("\n## ", start + len(title))
    return README[start:end if end != -1 else None]


def blocks(text, lang):
    """The fenced blocks of `text` whose info string is `lang` ("" for a bare fence)."""
    found, current, info = [], None, None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, info = [], line[3:].strip()
            else:
                if info == lang:
                    found.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return found


def commands():
    found = []
    for title in SECTIONS:
        for block in blocks(section(title), "bash"):
            for line in block.splitlines():
                for part in line.split("&&"):
                    if part.strip().startswith("inferctx "):
                        found.append(part.strip())
    return found


def test_readme_has_the_main_job():
    assert "inferctx plan --preset llama-2-7b --gpu h100-80gb --batch 8 --max-tokens 4096" in commands()


@pytest.mark.parametrize("command", commands())
def test_readme_commands_run(capsys, command):
    code = main(shlex.split(command)[1:])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out and not err


def test_readme_plan_excerpt_is_what_the_main_job_prints(capsys):
    (excerpt,) = blocks(section("## Set-up"), "")
    main(shlex.split("plan --preset llama-2-7b --gpu h100-80gb --batch 8 --max-tokens 4096"))
    printed = capsys.readouterr().out.splitlines()
    lines = excerpt.strip("\n").splitlines()
    assert len(lines) == 5  # memory, weights, planned, max tokens, workspace
    for line in lines:
        assert line in printed


def test_readme_python_runs(capsys):
    (source,) = blocks(section("## Python"), "python")
    # `expr  # -> value` lines become assertions
    checked = []
    lines = []
    for line in source.splitlines():
        m = re.match(r"^(\S.*?)\s*# -> (.+)$", line)
        if m:
            lines.append(f"assert ({m.group(1)}) == {m.group(2)}, {m.group(1)!r}")
            checked.append(m.group(1))
        else:
            lines.append(line)
    exec(compile("\n".join(lines), "README.md (Python)", "exec"), {})
    assert len(checked) == 2
    out = capsys.readouterr().out
    assert "weights" in out and "inferctx workspace plan" in out

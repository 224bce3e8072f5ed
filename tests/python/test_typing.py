"""The public API type-checks: mypy --strict on a user's script (tests/python/typing/user_script.py)
that plans, catches the errors by their fields, and uses the GPU names (never run, only checked)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "typing" / "user_script.py"


def mypy(tmp_path, source, *flags):
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install '.[test]'")
    script = tmp_path / "user_script.py"
    script.write_text(source)
    # run outside the repository, so that the installed package (with py.typed) is checked
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", *flags, str(script)],
                          capture_output=True, text=True, cwd=tmp_path)


@pytest.mark.parametrize("flags", [(), ("--python-version", "3.10")])
def test_user_script_passes_mypy_strict(tmp_path, flags):
    # Also as a user on Python 3.10 checks it (requires-python), whose typing has no Self.
    r = mypy(tmp_path, SCRIPT.read_text(), *flags)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found" in r.stdout


@pytest.mark.parametrize("flags", [(), ("--python-version", "3.10")])
def test_the_context_instance_is_typed_on_every_supported_python(tmp_path, flags):
    # InferenceContext.instance() is an InferenceContext, not Any, also for Python 3.10 (a stub
    # that imported typing.Self made it Any there): into an int it is an error.
    r = mypy(tmp_path, "import inferctx\n"
                       "n: int = inferctx.InferenceContext.instance(0)\n", *flags)
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r'user_script\.py:2: error: Incompatible types in assignment \(expression has type '
                     r'"InferenceContext", variable has type "int"\)', r.stdout), r.stdout


def test_mypy_sees_wrong_uses(tmp_path):
    # The same checker refuses a misuse: the stubs carry real types, not Any everywhere.
    r = mypy(tmp_path, "import inferctx\n"
                       "x: str = inferctx.plan_workspace('llama-2-7b', batch_size=1, prompt_len=1,\n"
                       "                                 max_out_tokens=4, gpu='h200').max_tokens\n"
                       "e = inferctx.WorkspaceOOMError('m')\n"
                       "y: str = e.max_batch_size\n"
                       "inferctx.gemm(1, 2, alpha='x')\n")
    assert r.returncode == 1
    assert r.stdout.count("error:") == 3, r.stdout
    # One error at each misuse: the int max_tokens and the int-or-None max_batch_size into a str
    # (lines 2 and 5), and alpha='x' for gemm's float (line 6).
    found = sorted((int(m.group(1)), m.group(2)) for m in
                   re.finditer(r"user_script\.py:(\d+): error: .*\[([a-z-]+)\]$", r.stdout, re.M))
    assert found == [(2, "assignment"), (5, "assignment"), (6, "arg-type")], r.stdout
    assert re.search(r':6: error: Argument "alpha" .*"str".*"float"', r.stdout), r.stdout
    shutil.rmtree(tmp_path / ".mypy_cache", ignore_errors=True)


def test_planning_modules_pass_mypy_strict(tmp_path):
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install '.[test]'")
    import inferctx

    # a copy of the installed package's sources and stubs, checked as sources
    copy = tmp_path / "inferctx"
    shutil.copytree(Path(inferctx.__file__).parent, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    modules = ("__init__", "errors", "dtypes", "planning", "_plan_args", "_model_shape", "_workspace_plan",
               "presets", "cli", "_libs")
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental",
                        *(f"inferctx/{m}.py" for m in modules)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_views_context_is_the_public_class_and_gemm_takes_only_a_context(tmp_path):
    # Every context is made as inferctx.InferenceContext (with gen_workspace), the class a view's
    # `context` gives; gemm's and bmm's ctx is a context or None, as for dropout.
    r = mypy(tmp_path, "import inferctx\n"
                       "ctx = inferctx.InferenceContext.instance(0)\n"
                       "k, v = ctx.kv_cache(0)\n"
                       "same: inferctx.InferenceContext = k.context\n"
                       "k.context.gen_workspace('llama-2-7b', batch_size=1, prompt_len=1, max_out_tokens=8)\n"
                       "inferctx.gemm(k, v, ctx=k.context)\n"
                       "inferctx.bmm(k, v, ctx=None)\n"
                       "inferctx.gemm(k, v, ctx='cuda:0')\n"
                       "inferctx.bmm(k, v, ctx=0)\n")
    found = sorted((int(m.group(1)), m.group(2)) for m in
                   re.finditer(r"user_script\.py:(\d+): error: .*\[([a-z-]+)\]$", r.stdout, re.M))
    assert found == [(8, "arg-type"), (9, "arg-type")], r.stdout


def test_decoder_modules_pass_mypy_strict_against_the_stubs(tmp_path):
    # The reference decoder calls the compiled module's fused kernels as the stubs declare them
    # (_models imports transformers, which the check leaves out).
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install '.[test]'")
    pytest.importorskip("torch", reason="the decoder's types come from torch")
    import inferctx

    copy = tmp_path / "inferctx"
    shutil.copytree(Path(inferctx.__file__).parent, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    modules = ("__init__", "_backend", "_decoder", "_fused", "_layers", "_spec")
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental",
                        *(f"inferctx/decoder/{m}.py" for m in modules)], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_generates_logits_are_a_tensor_where_they_were_asked_for(tmp_path):
    # Generation.logits is a tensor for return_logits=True, None for the default, either for a
    # flag known only at run time; a user's `out.logits - ref` type-checks without a None test.
    pytest.importorskip("torch", reason="the decoder's types come from torch")
    r = mypy(tmp_path, "import torch\n"
                       "from inferctx.decoder import ReferenceDecoder\n"
                       "def f(dec: ReferenceDecoder, p: torch.Tensor, flag: bool) -> None:\n"
                       "    asked = dec.generate(p, return_logits=True)\n"
                       "    plain = dec.generate(p, 4, timing=True)\n"
                       "    either = dec.generate(p, return_logits=flag)\n"
                       "    reveal_type(asked.logits)\n"
                       "    reveal_type(plain.logits)\n"
                       "    reveal_type(either.logits)\n"
                       "    (asked.logits - asked.logits).abs()\n", "--follow-imports=silent")
    revealed = re.findall(r'Revealed type is "(.*)"', r.stdout)
    assert revealed == ["torch._tensor.Tensor", "None", "Union[torch._tensor.Tensor, None]"] or revealed == [
        "torch._tensor.Tensor", "None", "torch._tensor.Tensor | None"], r.stdout
    assert ": error: " not in r.stdout, r.stdout


README = Path(__file__).parents[2] / "README.md"


def _readme_python_block(title):
    text = README.read_text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return re.findall(r"```python\n(.*?)```", text[start:end if end != -1 else None], re.S)[0]


@pytest.mark.parametrize("title", ["## Python", "## On a GPU", "## Release and retake", "## Reference decoder"])
def test_readme_examples_pass_mypy_strict(tmp_path, title):
    source = _readme_python_block(title)
    if "import torch" in source:
        pytest.importorskip("torch", reason="the example uses torch")
    r = mypy(tmp_path, source)
    # torch's own stubs do not re-export from_dlpack; that is torch's to fix, not the example's.
    errors = [line for line in r.stdout.splitlines() if ": error: " in line
              and 'Module "torch" does not explicitly export attribute "from_dlpack"' not in line]
    assert not errors, r.stdout


def _stub_parameters(node):
    """(name, kind, default as written) of a stub function's parameters."""
    import ast

    a = node.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    found = [(p.arg, "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD", defaults[i])
             for i, p in enumerate(positional)]
    if a.vararg:
        found.append((a.vararg.arg, "VAR_POSITIONAL", None))
    found += [(p.arg, "KEYWORD_ONLY", None if d is None else ast.unparse(d))
              for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        found.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return found


def _runtime_parameters(obj):
    import inspect

    return [(p.name, p.kind.name, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in inspect.signature(obj).parameters.values()]


@pytest.mark.parametrize("module", ["_core", "_plan"])
def test_stubs_match_the_compiled_modules(module):
    # Every name of the compiled module is in its stub and the other way round; functions and
    # methods take the same parameters (names, kinds, defaults), properties are properties.
    import ast
    import importlib
    import inspect

    import inferctx

    try:
        compiled = importlib.import_module(f"inferctx.{module}")
    except inferctx.CudaLibraryError as exc:
        pytest.skip(str(exc))
    tree = ast.parse((Path(inferctx.__file__).parent / f"{module}.pyi").read_text())
    aliases = {"_DLDevice", "_Ctx"}  # the stub's own type aliases
    stubbed = set()
    problems = []
    for node in tree.body:
        if isinstance(node, ast.AnnAssign):
            stubbed.add(node.target.id)
        elif isinstance(node, ast.Assign):
            stubbed.update(t.id for t in node.targets)
        elif isinstance(node, ast.FunctionDef):
            stubbed.add(node.name)
            if hasattr(compiled, node.name) and _stub_parameters(node) != _runtime_parameters(
                    getattr(compiled, node.name)):
                problems.append(f"{node.name}: stub {_stub_parameters(node)}, "
                                f"runtime {_runtime_parameters(getattr(compiled, node.name))}")
        elif isinstance(node, ast.ClassDef):
            stubbed.add(node.name)
            cls = getattr(compiled, node.name, None)
            if cls is None:
                continue
            members = set()
            for item in node.body:
                if not isinstance(item, ast.FunctionDef):
                    continue
                members.add(item.name)
                decorators = {ast.unparse(d) for d in item.decorator_list}
                try:
                    static = inspect.getattr_static(cls, item.name)
                except AttributeError:
                    if item.name != "__buffer__":  # the buffer protocol's name from Python 3.12 on
                        problems.append(f"{node.name}.{item.name}: not at runtime")
                    continue
                is_property = type(static).__name__ in ("getset_descriptor", "member_descriptor", "property")
                if ("property" in decorators) != is_property:
                    problems.append(f"{node.name}.{item.name}: property in one, method in the other")
                if item.name == "__init__":  # as the class's docstring opens: "Stream(source=None, ...)"
                    line = (cls.__doc__ or "").splitlines()[0] if cls.__doc__ else ""
                    if not line.startswith(f"{node.name}("):
                        problems.append(f"{node.name}.__init__: no signature in the class's docstring")
                        continue
                    written = ast.parse(f"def {line}: ...").body[0]
                    if _stub_parameters(item)[1:] != _stub_parameters(written):
                        problems.append(f"{node.name}.__init__: stub {_stub_parameters(item)[1:]}, "
                                        f"runtime {_stub_parameters(written)}")
                    continue
                if is_property or type(static).__name__ == "wrapper_descriptor":
                    continue  # slot wrappers take (self, /)
                stub = _stub_parameters(item)
                runtime = _runtime_parameters(getattr(cls, item.name) if "classmethod" in decorators else static)
                if "classmethod" in decorators:
                    stub = stub[1:]
                if stub != runtime:
                    problems.append(f"{node.name}.{item.name}: stub {stub}, runtime {runtime}")
            for name in sorted(n for n in vars(cls) if not n.startswith("__") and n not in members):
                problems.append(f"{node.name}.{name}: not in the stub")
    runtime_names = {n for n, v in vars(compiled).items() if not n.startswith("__") and not inspect.ismodule(v)}
    problems += [f"{n}: not in the stub" for n in sorted(runtime_names - stubbed)]
    problems += [f"{n}: not at runtime" for n in sorted(stubbed - runtime_names - aliases)]
    assert not problems, "\n".join(problems)

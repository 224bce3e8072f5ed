"""`import inferctx` and planning load no CUDA library; the GPU names load it on first use."""

import json
import subprocess
import sys

import inferctx

PROBE = """
import json, sys
def loaded():
    maps = open('/proc/self/maps').read()
    return {'modules': sorted(m for m in sys.modules if 'cublas' in m or m in ('inferctx._core', 'inferctx.gemm',
                                                                          'inferctx.context')),
            'libraries': sorted({line.split()[-1] for line in maps.splitlines()
                                 if any(lib in line for lib in ('libcublas', 'libcudart', 'libcuda.so',
                                                                'libnvrtc', 'libcurand'))})}
"""


def probe(body):
    r = subprocess.run([sys.executable, "-c", PROBE + body], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_and_planning_load_no_cuda_library():
    out = probe("""
import inferctx, inferctx.cli
before = loaded()
inferctx.plan_workspace('llama-2-7b', batch_size=8, prompt_len=1, max_out_tokens=4096, gpu='h100-80gb')
inferctx.max_batch_size('llama-2-7b', max_out_tokens=4096, gpu='h200')
inferctx.max_out_tokens_for('gemma-7b', batch_size=4, free_bytes=40 << 30, total_bytes=80 << 30)
inferctx.cli.main(['plan', '--preset', 'llama-2-7b', '--gpu', 'h200', '--json'])
inferctx.cli.main(['presets'])
print(json.dumps({'before': before, 'after': loaded()}))
""")
    assert out["before"] == out["after"] == {"modules": [], "libraries": []}


def test_gpu_names_load_the_gpu_module_and_cublas_on_first_use():
    out = probe("""
import inferctx
before = loaded()
inferctx.InferenceContext
print(json.dumps({'before': before, 'after': loaded()}))
""")
    assert out["before"] == {"modules": [], "libraries": []}
    assert "inferctx._core" in out["after"]["modules"] and "inferctx.context" in out["after"]["modules"]
    assert any("libcublas.so" in lib for lib in out["after"]["libraries"])


def test_importing_a_gpu_module_directly_preloads_cublas_first():
    out = probe("""
import inferctx._libs as libs
assert not libs._done
import inferctx.gemm
print(json.dumps({'preloaded': libs._done, **loaded()}))
""")
    assert out["preloaded"] is True and "inferctx._core" in out["modules"]


def test_every_context_is_the_public_class_whichever_module_loads_the_gpu_module():
    # gemm or dropout may make the first context (ctx=None): inferctx.context, whose subclass
    # adds gen_workspace, is loaded with inferctx._core and has registered its class by then.
    for first in ("inferctx._core", "inferctx.gemm", "inferctx.context"):
        out = probe(f"""
import importlib, {first}
import inferctx
from inferctx import _core
cls = inferctx.InferenceContext
print(json.dumps({{'modules': loaded()['modules'], 'subclass': issubclass(cls, _core.InferenceContext),
                  'module': cls.__module__,
                  'compiled_has_gen_workspace': hasattr(_core.InferenceContext, 'gen_workspace')}}))
""")
        assert "inferctx.context" in out["modules"], first
        assert out["subclass"] and out["module"] == "inferctx.context"
        assert not out["compiled_has_gen_workspace"]  # the Python layer adds it


def test_lazy_names_are_the_gpu_modules_names():
    import importlib

    _core, context, gemm = (importlib.import_module(f"inferctx.{m}") for m in ("_core", "context", "gemm"))

    lazy = inferctx._GPU_NAMES
    # The GPU names the package's docstring lists, each from the module that defines it.
    assert {n: lazy.get(n) for n in ("InferenceContext", "DeviceView", "PinnedBuffer", "Stream", "Event", "dropout",
                                     "apply_mask", "gemm", "bmm")} == {
        "InferenceContext": "context", "DeviceView": "context", "PinnedBuffer": "context", "Stream": "context",
        "Event": "context", "dropout": "_core", "apply_mask": "_core", "gemm": "gemm", "bmm": "gemm"}
    assert {n for n, m in lazy.items() if m == "gemm"} == set(gemm.__all__)
    assert {n for n, m in lazy.items() if m == "context"} == set(context.__all__) - {"logger"}
    for name, module in lazy.items():
        assert getattr(inferctx, name) is getattr({"gemm": gemm, "context": context, "_core": _core}[module], name)
        assert name in dir(inferctx) and name in inferctx.__all__


def test_gemm_stays_the_function_after_its_module_is_imported():
    out = subprocess.run([sys.executable, "-c", "import inferctx.gemm, inferctx, sys, types; "
                          "print(callable(inferctx.gemm), isinstance(inferctx.gemm, types.ModuleType), "
                          "inferctx.gemm is sys.modules['inferctx.gemm'].gemm, "
                          "type(sys.modules['inferctx.gemm']).__name__)"], capture_output=True, text=True)
    assert out.stdout.split() == ["True", "False", "True", "module"], out.stderr


def test_unknown_attribute():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        inferctx.nope  # noqa: B018


def test_license_in_the_repository_and_the_installed_distribution():
    from importlib import metadata
    from pathlib import Path

    repo = (Path(__file__).parents[2] / "LICENSE").read_text()
    assert repo.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in repo
    assert "END OF TERMS AND CONDITIONS" in repo
    files = {f.as_posix().split("/licenses/", 1)[-1]: f for f in metadata.files("inferctx") or []
             if f.name == "LICENSE"}
    assert "LICENSE" in files and files["LICENSE"].read_text() == repo
    # DLPack's header is compiled into the GPU module: its licence ships beside ours.
    dlpack = (Path(__file__).parents[2] / "third_party" / "dlpack" / "LICENSE").read_text()
    assert "third_party/dlpack/LICENSE" in files and files["third_party/dlpack/LICENSE"].read_text() == dlpack
    assert metadata.metadata("inferctx")["License-Expression"] == "Apache-2.0"


def test_a_missing_cublas_says_which_wheel_provides_it():
    import pytest

    from inferctx import _libs

    class Loader:
        def __init__(self, message):
            self.message = message

        def create_module(self, spec):
            raise ImportError(self.message)

    missing = "libcublas.so.13: cannot open shared object file: No such file or directory"
    with pytest.raises(ImportError) as info:
        _libs._ThenContext(Loader(missing)).create_module(None)
    assert str(info.value).startswith(missing) and "pip install 'nvidia-cublas>=13,<14'" in str(info.value)
    with pytest.raises(ImportError) as info:  # another library's failure passes unchanged
        _libs._ThenContext(Loader("libfoo.so.1: cannot open shared object file")).create_module(None)
    assert str(info.value) == "libfoo.so.1: cannot open shared object file"


def test_the_decoder_without_torch_says_which_extra_to_install(monkeypatch):
    import pytest

    import inferctx.decoder as decoder

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails
    monkeypatch.delitem(sys.modules, "inferctx.decoder._decoder", raising=False)  # not loaded yet
    monkeypatch.delitem(decoder.__dict__, "ReferenceDecoder", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'inferctx\[demo\]'") as info:
        decoder.ReferenceDecoder  # noqa: B018
    assert info.value.name == "torch"


def test_an_unloadable_cublas_is_passed_over_and_named(tmp_path, monkeypatch):
    # A truncated library or a folder under a library's name, earlier in the search, is no reason
    # to fail: the search goes on, and the error of a GPU module that cannot load names what it skipped.
    import pytest

    from inferctx import _libs, errors

    broken, folder = tmp_path / "broken", tmp_path / "folder"
    for name in _libs._LIBS:
        broken.mkdir(exist_ok=True)
        (broken / name).write_bytes(b"")
        (folder / name).mkdir(parents=True)
    monkeypatch.setattr(_libs, "_done", False)
    monkeypatch.setattr(_libs, "_unloadable", [])
    monkeypatch.setattr(_libs, "_candidate_dirs", lambda: iter([str(broken), str(folder)]))
    _libs.preload()
    assert [why.startswith(str(d / _libs._LIBS[0])) for d, why in zip((broken, folder), _libs._unloadable)] == [
        True, True]

    class Loader:
        def create_module(self, spec):
            raise ImportError("libcublas.so.13: cannot open shared object file: No such file or directory")

    with pytest.raises(errors.CudaLibraryError) as info:
        _libs._ThenContext(Loader()).create_module(None)
    assert isinstance(info.value, ImportError) and isinstance(info.value, errors.InferCtxError)
    assert f"passed over {broken / _libs._LIBS[0]}" in str(info.value)
    assert "pip install 'nvidia-cublas>=13,<14'" in str(info.value) and "Planning" in str(info.value)


def test_the_library_search_takes_sys_path_entries_of_any_type(monkeypatch):
    from pathlib import Path

    from inferctx import _libs

    monkeypatch.setattr(sys, "path", [b"/from/bytes", 5, None, Path("/from/path"), "", "/from/str"])
    dirs = list(_libs._candidate_dirs())[1:]  # after the folder beside the package
    assert dirs == [f"/from/{kind}/nvidia/cu13/lib" for kind in ("bytes", "path", "str")]


# The start of a child script in which the extension's loader fails as the dynamic loader does
# where the nvidia-cublas wheel is missing.
_WITHOUT_CUBLAS = """
import sys
from importlib.machinery import ExtensionFileLoader
real = ExtensionFileLoader.create_module
def create_module(self, spec):
    if spec.name != 'inferctx._core':
        return real(self, spec)
    raise ImportError('libcublas.so.13: cannot open shared object file: No such file or directory', name=spec.name)
ExtensionFileLoader.create_module = create_module
"""


def test_the_cli_without_cublas_prints_one_line_and_exits_2():
    code = _WITHOUT_CUBLAS + """
import inferctx.cli
code = inferctx.cli.main(['plan', '--preset', 'llama-2-7b'])
print('planned', inferctx.cli.main(['plan', '--preset', 'llama-2-7b', '--gpu', 'h200']), file=sys.stderr)
sys.exit(code)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 2, done.stderr
    assert lines[0].startswith("inferctx: CudaLibraryError: libcublas.so.13: cannot open shared object file")
    assert "pip install 'nvidia-cublas>=13,<14'" in lines[0] and lines[1] == "planned 0"


def test_without_cublas_planning_names_import_and_whole_package_listings_name_the_wheel():
    # README: without cuBLAS, planning names import by name; `import *`, help() and
    # inspect.getmembers touch the GPU names and raise CudaLibraryError, naming the wheel.
    code = _WITHOUT_CUBLAS + """
import inspect, pydoc
import inferctx
from inferctx import max_batch_size, plan_workspace
print('planned', max_batch_size('llama-2-7b', max_out_tokens=4096, gpu='h100-80gb'))
for name, call in [('star', lambda: exec('from inferctx import *', {})),
                   ('help', lambda: pydoc.render_doc(inferctx, renderer=pydoc.plaintext)),
                   ('getmembers', lambda: inspect.getmembers(inferctx))]:
    try:
        call()
        print(name, 'no error')
    except inferctx.CudaLibraryError as exc:
        print(name, 'CudaLibraryError', "nvidia-cublas" in str(exc))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["planned 19", "star CudaLibraryError True",
                                        "help CudaLibraryError True", "getmembers CudaLibraryError True"]

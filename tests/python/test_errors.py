"""The error hierarchy: base classes, fields, pickling, and the C++ translation."""

import json
import os
import pickle
import subprocess
import sys

import pytest

from inferctx import errors

CASES = [
    (errors.ConfigError, dict(argument="batch_size"), (ValueError,)),
    (errors.WorkspaceOOMError, dict(requested_bytes=10, free_bytes=5, total_bytes=8, budget_bytes=4,
                                    max_batch_size=None, max_out_tokens=3), (MemoryError,)),
    (errors.TokenLimitError, dict(current=5, requested=1, limit=5), (IndexError,)),
    (errors.WorkspaceStateError, {}, (RuntimeError,)),
    (errors.WorkspaceInUseError, dict(views_alive=2), (errors.WorkspaceStateError,)),
    (errors.CudaError, dict(call="cudaMalloc", code=2, name="cudaErrorMemoryAllocation", device=0),
     (RuntimeError,)),
    (errors.CublasError, dict(call="cublasGemmEx", code=7, name="CUBLAS_STATUS_INVALID_VALUE", device=0),
     (errors.CudaError,)),
    (errors.NoCudaDeviceError, dict(call="cudaGetDeviceCount", code=100, name="cudaErrorNoDevice",
                                    device=None), (errors.CudaError,)),
]


@pytest.mark.parametrize("cls,fields,bases", CASES)
def test_hierarchy_and_pickle(cls, fields, bases):
    e = cls("what is wrong", **fields)
    assert isinstance(e, errors.InferCtxError)
    for b in bases:
        assert isinstance(e, b)
    clone = pickle.loads(pickle.dumps(e))
    assert type(clone) is cls and str(clone) == "what is wrong"
    for k, v in fields.items():
        assert getattr(clone, k) == v


def test_unknown_field_is_a_type_error():
    with pytest.raises(TypeError, match=r"^ConfigError got unknown fields \['colour'\]$"):
        errors.ConfigError("x", colour="red")


def test_cpp_config_error_translated_with_argument():
    from inferctx import _core

    from inferctx.planning import _request_fields

    fields = _request_fields("llama-2-7b", batch_size=1, prompt_len=1, max_out_tokens=4,
                             free_bytes=1 << 30, total_bytes=1 << 30)
    fields["num_heads"] = 0
    with pytest.raises(errors.ConfigError) as info:
        _core._plan(fields)
    assert info.value.argument == "num_heads" and "got 0" in str(info.value)


# What cudaGetDeviceCount gives where no device can be used: none visible, or no driver.
NO_DEVICE = {"cudaErrorNoDevice": 100, "cudaErrorInsufficientDriver": 35}


def _device_count_where(visible):
    """_core._device_count() in a fresh process that sees the devices `visible` names
    (CUDA_VISIBLE_DEVICES): the count, or the NoCudaDeviceError's fields."""
    code = ("import json\n"
            "from inferctx import _core, errors\n"
            "try:\n"
            "    print(json.dumps({'count': _core._device_count()}))\n"
            "except errors.NoCudaDeviceError as e:\n"
            "    print(json.dumps({'error': str(e), 'name': e.name, 'code': e.code, 'call': e.call,\n"
            "                      'device': e.device, 'type': type(e).__name__}))\n")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible,
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_device_count_or_no_device_error():
    from conftest import gpu_available

    from inferctx import _core

    if gpu_available()[0]:
        assert _core._device_count() >= 1
        # One device made visible is one device counted (the first of those this process may see).
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
        assert _device_count_where(first) == {"count": 1}
    else:
        with pytest.raises(errors.NoCudaDeviceError) as info:
            _core._device_count()
        assert "Planning" in str(info.value) and info.value.name in NO_DEVICE
        assert info.value.code == NO_DEVICE[info.value.name] and info.value.call == "cudaGetDeviceCount"
    # No device visible, on any machine: NoCudaDeviceError, from cudaGetDeviceCount.
    got = _device_count_where("")
    assert got["type"] == "NoCudaDeviceError" and got["name"] in NO_DEVICE, got
    assert (got["code"], got["call"], got["device"]) == (NO_DEVICE[got["name"]], "cudaGetDeviceCount", None)
    assert "Planning" in got["error"]


def test_no_device_error_words_the_planning_remedy():
    # Run where no device is visible (CUDA_VISIBLE_DEVICES empty), so that a GPU machine checks
    # it too: the C++ message ends with the facts; the Python class adds the fix in the CLI's terms.
    got = _device_count_where("")
    assert got.get("type") == "NoCudaDeviceError", got
    assert got["error"].startswith(f"{got['name']}: ")
    assert got["error"].endswith("(in cudaGetDeviceCount); no usable CUDA device or driver. Planning "
                                 "(plan_workspace, `inferctx plan --free-gb ... --total-gb ...`) works without one.")


@pytest.mark.parametrize("remedy, device, part", [
    (1, None, "release_workspace(force=True), and retry"),
    (2, None, "pass force=True to detach the workspace"),
    (3, None, "torch.cuda.empty_cache()) and call retake_workspace again"),
    (4, 3, "or InferenceContext.instance(3) for that stream"),
    (5, None, "`inferctx plan --free-gb ... --total-gb ...`"),
])
def test_remedies_are_worded_by_the_python_classes(remedy, device, part):
    e = errors.WorkspaceInUseError._from_core("release_workspace: 2 view(s) are alive", remedy, device,
                                              views_alive=2)
    assert type(e) is errors.WorkspaceInUseError and e.views_alive == 2
    assert str(e).startswith("release_workspace: 2 view(s) are alive") and part in str(e)
    clone = pickle.loads(pickle.dumps(e))
    assert str(clone) == str(e) and clone.views_alive == 2  # worded once, not again


def test_no_remedy_leaves_the_message_as_it_is():
    e = errors.ConfigError._from_core("p: got 2; it must be in [0, 1)", 0, None, argument="p")
    assert str(e) == "p: got 2; it must be in [0, 1)" and e.argument == "p"


@pytest.mark.parametrize("cls,fields,bases", CASES)
def test_pickle_keeps_notes_and_attributes(cls, fields, bases):
    # As a plain exception does: add_note's notes and attributes set on the error come back too.
    e = cls("what is wrong", **fields)
    e.add_note("while planning rank 3")
    e.request_id = "r-17"
    clone = pickle.loads(pickle.dumps(e))
    assert type(clone) is cls and str(clone) == "what is wrong"
    assert clone.__notes__ == ["while planning rank 3"] and clone.request_id == "r-17"
    assert {k: getattr(clone, k) for k in fields} == fields
    # one without either pickles as before: nothing beyond its fields
    plain = pickle.loads(pickle.dumps(cls("what is wrong", **fields)))
    assert not hasattr(plain, "__notes__") and set(vars(plain)) == set(cls._fields)


def test_cuda_library_error_is_an_import_error_that_pickles():
    e = errors.CudaLibraryError("libcublas.so.13: cannot open shared object file", name="inferctx._core",
                                path="/site/inferctx/_core.so")
    assert isinstance(e, ImportError) and isinstance(e, errors.InferCtxError)
    clone = pickle.loads(pickle.dumps(e))
    assert type(clone) is errors.CudaLibraryError and str(clone) == str(e)
    assert (clone.name, clone.path) == ("inferctx._core", "/site/inferctx/_core.so")

# Included by _plan.pyx and _core.pyx: the argument coercions that python/inferctx (through
# inferctx._plan, which loads no CUDA library) and the compiled classes share.


cdef bint _is_numpy_bool(object value):
    """numpy.bool_ (numpy.bool in NumPy 2), told by its type: NumPy need not be imported."""
    t = type(value)
    return t.__module__ == "numpy" and t.__name__ in ("bool", "bool_")


cdef bint _bool_arg(object value, str argument) except -1:
    """A flag: True or False (a numpy.bool_ too); 1, None and strings are refused."""
    if value is True:
        return True
    if value is False:
        return False
    if _is_numpy_bool(value):
        return True if value else False
    raise _errors.ConfigError(f"{argument}: got {_brief(value)}; it must be True or False",
                              argument=argument)


def _as_bool(value, argument):
    """A flag argument as a bool (ConfigError naming `argument` otherwise)."""
    return _bool_arg(value, argument)


# Other names of the element types, each to its canonical (NumPy and torch) name: the one table
# of them. python/inferctx/dtypes.py takes the planner's from it through inferctx._plan, and
# DeviceView's dtype table (_dtypes.pxi) all of them.
DTYPE_ALIASES = {
    "fp32": "float32", "f32": "float32", "float": "float32", "single": "float32",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "bf16": "bfloat16",
    "fp64": "float64", "f64": "float64", "double": "float64",
    "byte": "uint8", "bool_": "bool",
}


def _name_of(dtype):
    """The name of a string, NumPy, torch, JAX or ml_dtypes dtype (None: not a dtype).

    torch is never imported: its dtypes print as 'torch.float16'.
    """
    if isinstance(dtype, str):
        return dtype
    module = type(dtype).__module__ or ""
    if module.startswith("torch"):
        return str(dtype).rpartition(".")[2]
    name = getattr(dtype, "name", None)  # numpy.dtype, ml_dtypes
    if isinstance(name, str):
        return name
    if isinstance(dtype, type):  # numpy scalar types such as numpy.float16
        try:
            import numpy as np

            return np.dtype(dtype).name
        except TypeError:
            return None
    return None

# Included by _plan.pyx and _core.pyx: reading the name of a dtype object, as dtypes.py (the
# planner's dtype argument) and DeviceView's dtypes both coerce it.


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

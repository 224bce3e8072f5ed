# Part of _core.pyx: argument checks shared by the GPU classes. Each failure is a ConfigError
# that names the argument, the value it got and what is valid.

from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.stdint cimport INT64_MAX, int64_t, uint64_t

from inferctx._decl_gpu cimport check_device_ordinal, current_device

import operator as _operator


cdef str _type_name(object value):
    """'numpy.ndarray', 'torch.Tensor', 'list': the qualified name of a value's type."""
    cls = type(value)
    module = cls.__module__
    if module in ("builtins", None):
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


cdef bint _is_flag(object value):
    """A bool, Python's or NumPy's: never a number here (NumPy 1.x's bool_ has __index__)."""
    return PyBool_Check(value) or _is_numpy_bool(value)


cdef int64_t _int_arg_slow(object value, str argument) except? -1:
    if _is_flag(value) or value is None:
        raise _ConfigError(f"{argument}: got {_brief(value)}; it must be an "
                           "integer", argument=argument)
    try:
        value = _operator.index(value)
    except TypeError:
        raise _ConfigError(f"{argument}: got {_brief(value)} ({_type_name(value)}); it must be "
                           "an integer",
                           argument=argument) from None
    if not -(1 << 63) <= value < (1 << 63):
        raise _ConfigError(f"{argument}: got {_brief(value)}; it is outside the 64-bit "
                           f"integer range",
                           argument=argument)
    return value


cdef inline int64_t _int_arg(object value, str argument) except? -1:
    """An int64 argument; bool and floats are refused (True is not a count)."""
    cdef int overflow = 0
    cdef long long n
    if type(value) is int:
        n = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow == 0:
            return n
    return _int_arg_slow(value, argument)


cdef inline int64_t _count_arg(object value, str argument, int64_t minimum) except? -1:
    cdef int64_t n = _int_arg(value, argument)
    if n < minimum:
        raise _ConfigError(f"{argument}: got {n}; it must be >= {minimum}", argument=argument)
    return n


cdef inline uint64_t _uint64_arg(object value, str argument) except? 0:
    """A uint64 argument (a seed, a Philox increment): 0 <= value < 2**64."""
    cdef int overflow = 0
    cdef long long n
    if type(value) is int:
        n = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow == 0 and n >= 0:
            return <uint64_t>n
    return _uint64_arg_slow(value, argument)


cdef uint64_t _uint64_arg_slow(object value, str argument) except? 0:
    if _is_flag(value) or value is None:
        raise _ConfigError(f"{argument}: got {_brief(value)}; it must be an integer in [0, 2**64)",
                           argument=argument)
    try:
        value = _operator.index(value)
    except TypeError:
        raise _ConfigError(f"{argument}: got {_brief(value)} ({_type_name(value)}); it must be an "
                           f"integer in [0, 2**64)", argument=argument) from None
    if not 0 <= value < (1 << 64):
        raise _ConfigError(f"{argument}: got {_brief(value)}; it must be in [0, 2**64)",
                           argument=argument)
    return <uint64_t>value


cdef int _device_arg(object device) except -1:
    """A device ordinal: the calling thread's current device for None, else a checked int."""
    cdef int d
    if device is None:
        with nogil:
            d = current_device()
        return d
    cdef int64_t n = _int_arg(device, "device")
    if not 0 <= n < (1 << 31):
        raise _ConfigError(f"device: got {n}; it must be a device ordinal >= 0", argument="device")
    d = <int>n
    with nogil:
        check_device_ordinal(d)
    return d


cdef tuple _shape_arg(object shape, str argument):
    """A shape as a tuple of ints >= 0 (an int is a 1-D shape); -1 is left for the caller."""
    if isinstance(shape, (tuple, list)):
        items = tuple(shape)
    else:
        items = (shape,)
    out = []
    for i, item in enumerate(items):
        if _is_flag(item):
            raise _ConfigError(f"{argument}: got {_brief(shape)}; its entries must be "
                               f"integers", argument=argument)
        try:
            n = _operator.index(item)
        except TypeError:
            raise _ConfigError(f"{argument}: got {_brief(shape)}; its entries must be "
                               f"integers", argument=argument) from None
        if n < -1:
            raise _ConfigError(f"{argument}: entry {i} is {_brief(n)}; sizes must be >= 0 "
                               f"(one may be -1 to take what is left)", argument=argument)
        if n > INT64_MAX:
            raise _ConfigError(f"{argument}: entry {i} is {_brief(n)}; a size must be below "
                               f"2**63", argument=argument)
        out.append(n)
    return tuple(out)

# Part of _core.pyx: the element types of views and kernel operands (one table: name, DLPack
# type code, bits, CUDA array interface typestr) and the names they are known by.

from libc.stdint cimport int64_t, uint8_t

from inferctx._decl_dlpack cimport kDLBfloat, kDLBool, kDLFloat, kDLInt, kDLUInt
from inferctx._decl_planner cimport DType


cdef enum:
    # Indices into the dtype table below. The first three are inferctx::DType's codes (0, 1,
    # 2), so a plan's dtype is also the index of its views' dtype.
    DT_FLOAT32 = <int>DType.Float32
    DT_FLOAT16 = <int>DType.Float16
    DT_BFLOAT16 = <int>DType.BFloat16
    DT_FLOAT64 = 3
    DT_INT8 = 4
    DT_INT16 = 5
    DT_INT32 = 6
    DT_INT64 = 7
    DT_UINT8 = 8
    DT_UINT16 = 9
    DT_UINT32 = 10
    DT_UINT64 = 11
    DT_BOOL = 12
    NUM_DTYPES = 13


# name, DLPack type code, bits, __cuda_array_interface__ typestr (None: the interface has none)
cdef tuple _DTYPE_TABLE = (
    ("float32", kDLFloat, 32, "<f4"),
    ("float16", kDLFloat, 16, "<f2"),
    ("bfloat16", kDLBfloat, 16, None),
    ("float64", kDLFloat, 64, "<f8"),
    ("int8", kDLInt, 8, "|i1"),
    ("int16", kDLInt, 16, "<i2"),
    ("int32", kDLInt, 32, "<i4"),
    ("int64", kDLInt, 64, "<i8"),
    ("uint8", kDLUInt, 8, "|u1"),
    ("uint16", kDLUInt, 16, "<u2"),
    ("uint32", kDLUInt, 32, "<u4"),
    ("uint64", kDLUInt, 64, "<u8"),
    ("bool", kDLBool, 8, "|b1"),
)

cdef uint8_t _DTYPE_DLPACK_CODE[NUM_DTYPES]
cdef uint8_t _DTYPE_BITS[NUM_DTYPES]
cdef int64_t _DTYPE_ITEMSIZE[NUM_DTYPES]
cdef tuple _DTYPE_NAMES = tuple(row[0] for row in _DTYPE_TABLE)
cdef tuple _DTYPE_TYPESTRS = tuple(row[3] for row in _DTYPE_TABLE)
# name or alias (DTYPE_ALIASES, _coerce.pxi) -> index
cdef dict _DTYPE_BY_NAME = {row[0]: i for i, row in enumerate(_DTYPE_TABLE)}
_DTYPE_BY_NAME.update({alias: _DTYPE_BY_NAME[name] for alias, name in DTYPE_ALIASES.items()})
cdef dict _DTYPE_BY_DLPACK = {(row[1], row[2]): i for i, row in enumerate(_DTYPE_TABLE)}
# typestr without its byte-order character ('<', '|' or '=') -> index
cdef dict _DTYPE_BY_TYPESTR = {row[3][1:]: i for i, row in enumerate(_DTYPE_TABLE) if row[3]}
for _i, _row in enumerate(_DTYPE_TABLE):
    _DTYPE_DLPACK_CODE[_i] = _row[1]
    _DTYPE_BITS[_i] = _row[2]
    _DTYPE_ITEMSIZE[_i] = _row[2] // 8
del _i, _row


cdef int _dtype_index(object dtype, str argument) except -1:
    """The dtype table index of a name ('float16', 'bf16', ...) or a NumPy/torch dtype."""
    index = _DTYPE_BY_NAME.get(dtype) if type(dtype) is str else None
    if index is not None:
        return index
    if isinstance(dtype, str):
        name = dtype
    else:  # a NumPy, torch, JAX or ml_dtypes dtype (_coerce.pxi)
        name = _name_of(dtype)
    if isinstance(name, str):
        index = _DTYPE_BY_NAME.get(name.strip().lower())
    if index is None:
        raise _ConfigError(f"{argument}: got {_brief(dtype)}; valid: {', '.join(_DTYPE_NAMES)} "
                           "(or the NumPy/torch dtype of one of them)", argument=argument)
    return index

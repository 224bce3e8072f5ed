# Part of _core.pyx: CudaArray, the form in which kernels take their arrays. Any CUDA array
# (a DeviceView, a DLPack exporter, a __cuda_array_interface__ exporter) is reduced to a
# pointer, a shape, strides in elements, a dtype and an owner that keeps the memory alive.

from libc.stdint cimport INT64_MAX, int64_t, uintptr_t

from inferctx._decl_dlpack cimport (
    DLPACK_FLAG_BITMASK_READ_ONLY, DLTensor, kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged)
from inferctx._decl_gpu cimport (
    check_cuda, cudaError_t, cudaMemoryTypeDevice, cudaMemoryTypeManaged, cudaPointerAttributes,
    cudaPointerGetAttributes, cudaSuccess)

cdef class CudaArray:
    """A CUDA array as a kernel takes it; ``owner`` keeps the memory alive.

    ``strides`` count elements and are always filled in. For a DLPack import ``owner`` holds the
    consumed tensor and calls its producer's deleter when the CudaArray (and anything holding the
    owner) is gone; otherwise it is the object the array came from.
    """

    cdef readonly uintptr_t ptr
    cdef readonly tuple shape
    cdef readonly tuple strides
    cdef readonly str dtype
    cdef readonly int itemsize
    cdef readonly int device
    cdef readonly int64_t size
    cdef readonly int64_t nbytes
    cdef readonly bint contiguous
    cdef readonly bint read_only
    cdef readonly object owner
    cdef int _dtype  # index into the dtype table (DT_FLOAT16, ...)

    def __init__(self, *args, **kwargs):
        raise TypeError("CudaArray objects are made by inferctx._core._as_cuda_array")

    @property
    def ndim(self):
        return len(self.shape)

    def __repr__(self):
        return (f"<inferctx.CudaArray {self.dtype}{list(self.shape)} strides={self.strides} "
                f"on cuda:{self.device} at {self.ptr:#x}>")


cdef bint _is_contiguous(tuple shape, tuple strides):
    """C-contiguous: strides (elements) of the packed layout, ignoring sizes of 1; an empty
    array, whose strides address nothing, always (as torch, NumPy and CuPy say)."""
    cdef int64_t expected = 1
    cdef Py_ssize_t i
    for n in shape:
        if n == 0:
            return True
    for i in range(len(shape) - 1, -1, -1):
        n = shape[i]
        if n != 1 and strides[i] != expected:
            return False
        expected *= n
    return True


cdef int64_t _shape_size(tuple shape, int64_t itemsize, str argument) except -1:
    """Elements of `shape`; ConfigError naming `argument` for a negative size, or for more bytes
    than an int64 counts (a lying producer: the product would wrap, and a kernel would size its
    result from the wrapped count)."""
    cdef int64_t size = 1
    cdef int64_t d
    cdef bint zero = False
    cdef bint too_big = False
    for n in shape:
        d = n
        if d < 0:
            raise _ConfigError(f"{argument}: shape {shape} has a negative size", argument=argument)
        if d == 0:
            zero = True
        elif not too_big:
            if size > INT64_MAX // d:
                too_big = True
            else:
                size *= d
    if zero:
        # No bytes, but the sizes after the last 0 still make C-contiguous strides, which must
        # not wrap: (0, 2**62, 4) would have a first stride of 2**64 elements.
        if _suffix_bytes(shape, itemsize) > INT64_MAX:
            raise _ConfigError(f"{argument}: shape {shape} of {itemsize}-byte items has strides of "
                               f"more than 2**63 - 1 bytes", argument=argument)
        return 0
    if too_big or size > INT64_MAX // itemsize:
        raise _ConfigError(f"{argument}: shape {shape} of {itemsize}-byte items is more than "
                           f"2**63 - 1 bytes", argument=argument)
    return size


cdef object _suffix_bytes(tuple shape, int64_t itemsize):
    """The largest C-contiguous stride of `shape`, in bytes (a Python int: it may pass int64):
    the product of the sizes after the first one, from the last 0 on (a 0 makes the strides
    before it 0)."""
    span = itemsize
    most = itemsize
    for n in reversed(shape[1:]):
        if n == 0:
            break
        span *= n
        most = span
    return most


cdef CudaArray _cuda_array(uintptr_t ptr, tuple shape, tuple strides, int64_t size, int dtype,
                           int device, object owner, bint read_only):
    """`size`: the elements of `shape` (its producer's count, or _shape_size's for producers
    that may lie)."""
    cdef CudaArray a = CudaArray.__new__(CudaArray)
    _require_mapped(ptr, shape, strides, _DTYPE_ITEMSIZE[dtype], device)
    a.ptr = ptr
    a.shape = shape
    a.strides = strides
    a._dtype = dtype
    a.dtype = _DTYPE_NAMES[dtype]
    a.itemsize = <int>_DTYPE_ITEMSIZE[dtype]
    a.device = device
    a.size = size
    a.nbytes = size * _DTYPE_ITEMSIZE[dtype]
    a.contiguous = _is_contiguous(shape, strides)
    a.read_only = read_only
    a.owner = owner
    return a


cdef str _not_cuda(object obj, str argument, str where):
    # An output on the host cannot be mended by moving it: the copy, not it, would be written.
    remedy = (f"Pass a CUDA array, or no {argument}= for a new result"
              if argument == "out" or argument == "mask_out" else
              f"Put it on the GPU first, e.g. torch.as_tensor({argument}, device='cuda') or "
              f"cupy.asarray({argument})")
    return (f"{argument} must be a CUDA array (DLPack or __cuda_array_interface__); got a "
            f"{_type_name(obj)} {where}. {remedy}")


cdef str _device_words(int device_type):
    if device_type == kDLCPU:
        return "on the CPU (DLPack device kDLCPU)"
    if device_type == kDLCUDAHost:
        return ("in pinned host memory (DLPack device kDLCUDAHost); a DeviceView's "
                "copy_from_host copies a PinnedBuffer to the GPU")
    return f"on DLPack device type {device_type}, which is not CUDA"


cdef CudaArray as_cuda_array(object obj, str argument, uintptr_t stream):
    """`obj` as a CudaArray, for a kernel that runs on `stream`.

    `stream` is the handle of the stream the kernel will run on: the producer's pending work
    is ordered before it (DeviceView: an event handshake with its context's ctx.stream;
    DLPack: passed as __dlpack__'s stream; __cuda_array_interface__: its "stream" is waited
    for). 0 asks for no ordering (the caller synchronises). Raises ConfigError naming
    `argument` for anything that is not CUDA memory.
    """
    if isinstance(obj, DeviceView):
        return _from_device_view(<DeviceView>obj, stream)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, argument, stream)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cuda_array_interface(obj, argument, stream)
    raise _ConfigError(_not_cuda(obj, argument, "with neither __dlpack__ nor "
                                                "__cuda_array_interface__"), argument=argument)


cdef CudaArray _from_device_view(DeviceView view, uintptr_t stream):
    if stream != 0:
        view._ctx._order(_ctx_stream(view._ctx), stream, True)  # as _begin_call's joins
    _note_use(view, stream)
    return _cuda_array(view._ptr, view._shape, _contiguous_strides(view._shape), view._size,
                       view._dtype, view._device, view, False)


cdef CudaArray _from_dlpack(object obj, str argument, uintptr_t stream):
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if dlpack_device is not None:
        device_type = _dlpack_device_checked(obj, dlpack_device, argument)[0]
        if device_type != kDLCUDA and device_type != kDLCUDAManaged:
            raise _ConfigError(_not_cuda(obj, argument, _device_words(device_type)),
                               argument=argument)
    # The DLPack spec: None would mean the legacy stream; -1 asks the producer not to sync.
    cdef object consumer = -1
    if stream != 0:
        consumer = stream
    try:
        capsule = obj.__dlpack__(stream=consumer, max_version=(1, 0))
    except TypeError:  # a producer older than DLPack 1.0
        capsule = obj.__dlpack__(stream=consumer)
    cdef _DLPackImport taken = _consume_capsule(capsule, obj, argument)
    cdef DLTensor* tensor = _import_tensor(taken)
    if tensor.device.device_type != kDLCUDA and tensor.device.device_type != kDLCUDAManaged:
        raise _ConfigError(_not_cuda(obj, argument, _device_words(tensor.device.device_type)),
                           argument=argument)
    dtype = _DTYPE_BY_DLPACK.get((tensor.dtype.code, tensor.dtype.bits))
    if dtype is None or tensor.dtype.lanes != 1:
        raise _ConfigError(
            f"{argument}: its DLPack dtype (code {tensor.dtype.code}, {tensor.dtype.bits} bits, "
            f"{tensor.dtype.lanes} lanes) is not one inferctx handles: {', '.join(_DTYPE_NAMES)}",
            argument=argument)
    cdef int ndim = tensor.ndim
    cdef int i
    shape = tuple([tensor.shape[i] for i in range(ndim)])
    cdef int64_t size = _shape_size(shape, _DTYPE_ITEMSIZE[<int>dtype], argument)
    if tensor.strides == NULL:  # allowed before DLPack 1.2: C-contiguous
        strides = _contiguous_strides(shape)
    else:
        strides = tuple([tensor.strides[i] for i in range(ndim)])
    return _cuda_array(<uintptr_t>tensor.data + <uintptr_t>tensor.byte_offset, shape, strides, size,
                       dtype, tensor.device.device_id, taken,
                       (_import_flags(taken) & DLPACK_FLAG_BITMASK_READ_ONLY) != 0)


cdef CudaArray _from_cuda_array_interface(object obj, str argument, uintptr_t stream):
    interface = obj.__cuda_array_interface__
    if not isinstance(interface, dict):
        raise _ConfigError(f"{argument}: {_type_name(obj)}.__cuda_array_interface__ is not a dict",
                           argument=argument)
    if interface.get("mask") is not None:
        raise _ConfigError(f"{argument}: masked CUDA arrays (a 'mask' in "
                           f"__cuda_array_interface__) are not supported", argument=argument)
    for key in ("typestr", "shape", "data"):
        if key not in interface:
            _bad_interface(obj, argument, f"has no {key!r}")
    typestr = interface["typestr"]
    if not isinstance(typestr, str):
        _bad_interface(obj, argument, f"'typestr' is {_brief(typestr)}, not a str")
    dtype = _DTYPE_BY_TYPESTR.get(typestr[1:]) if typestr[:1] in ("<", "|", "=", ">") else None
    if dtype is not None and typestr[0] == ">" and _DTYPE_ITEMSIZE[<int>dtype] != 1:
        dtype = None  # big-endian; for one-byte items the byte order means nothing
    if dtype is None:
        raise _ConfigError(f"{argument}: its typestr {_brief(typestr)} is not one inferctx handles "
                           f"(little-endian {', '.join([_DTYPE_NAMES[d] for d in _DTYPE_BY_TYPESTR.values()])}"
                           f"; bfloat16 has no typestr: pass it by DLPack)", argument=argument)
    cdef int64_t itemsize = _DTYPE_ITEMSIZE[<int>dtype]
    shape = _interface_ints(obj, argument, "shape", interface["shape"], False)
    cdef int64_t size = _shape_size(shape, itemsize, argument)
    data = interface["data"]
    if not isinstance(data, tuple) or len(data) != 2:
        _bad_interface(obj, argument, f"'data' is {_brief(data)}; the interface gives "
                                      "(pointer, read_only)")
    address, read_only = data
    if address is None:
        address = 0
    if PyBool_Check(address) or not isinstance(address, int) or not 0 <= address < (1 << 64):
        _bad_interface(obj, argument, f"'data' pointer is {_brief(address)}; it must be an int "
                                      "in [0, 2**64)")
    byte_strides = interface.get("strides")
    if byte_strides is None:
        strides = _contiguous_strides(shape)
    else:
        byte_strides = _interface_ints(obj, argument, "strides", byte_strides, True)
        if len(byte_strides) != len(shape):
            _bad_interface(obj, argument, f"'strides' {byte_strides} has {len(byte_strides)} entries "
                                          f"for the {len(shape)} of 'shape' {shape}")
        # Only a stride that steps between elements must be whole items: one on a dimension
        # of size 1, or of an empty array, addresses nothing (as _is_contiguous ignores it).
        if size and any(s % itemsize for n, s in zip(shape, byte_strides) if n > 1):
            raise _ConfigError(f"{argument}: strides {tuple(byte_strides)} (bytes) are not "
                               f"multiples of the {itemsize}-byte items", argument=argument)
        strides = tuple([s // itemsize for s in byte_strides])
    version = interface.get("version", 0)
    if PyBool_Check(version) or not isinstance(version, int):
        _bad_interface(obj, argument, f"'version' is {_brief(version)}, not an int")
    producer = interface.get("stream") if version >= 3 else None
    if producer is not None and stream != 0:
        if PyBool_Check(producer) or not isinstance(producer, int) or not 0 < producer < (1 << 64):
            raise _ConfigError(f"{argument}: __cuda_array_interface__ 'stream' is "
                               f"{_brief(producer)}; the interface allows None, 1, 2 or a stream "
                               "handle (an int in [3, 2**64))", argument=argument)
    cdef uintptr_t ptr = <uintptr_t>address
    cdef int device = _pointer_device(ptr, obj, argument) if ptr else _device_arg(None)
    if producer is not None and stream != 0:
        _context_of(device)._order(<uintptr_t>producer, stream)
    return _cuda_array(ptr, shape, strides, size, dtype, device, obj, True if read_only else False)


cdef int _bad_interface(object obj, str argument, str what) except -1:
    raise _ConfigError(f"{argument}: {_type_name(obj)}.__cuda_array_interface__ {what}",
                       argument=argument)


cdef tuple _interface_ints(object obj, str argument, str key, object value, bint signed):
    """A shape (non-negative) or strides (signed) entry of the interface as a tuple of ints
    (Python or NumPy integers within int64)."""
    cdef list out = []
    cdef bint bad = not isinstance(value, (tuple, list))
    if not bad:
        for n in value:
            try:
                i = None if _is_flag(n) else _operator.index(n)
            except TypeError:
                i = None
            if i is None or not -(1 << 63) <= i < (1 << 63) or (not signed and i < 0):
                bad = True
                break
            out.append(i)
    if bad:
        _bad_interface(obj, argument, f"{key!r} is {_brief(value)}; it must be a tuple of "
                                      f"{'ints' if signed else 'non-negative ints'} within int64")
    return tuple(out)


cdef int _pointer_device(uintptr_t ptr, object obj, str argument) except -1:
    """The device of a pointer from __cuda_array_interface__, which does not say it."""
    cdef cudaPointerAttributes attributes
    cdef cudaError_t status
    with nogil:
        status = cudaPointerGetAttributes(&attributes, <const void*>ptr)
    if status != cudaSuccess:
        check_cuda(status, "cudaPointerGetAttributes", -1)
    if attributes.type != cudaMemoryTypeDevice and attributes.type != cudaMemoryTypeManaged:
        raise _ConfigError(_not_cuda(obj, argument, "whose __cuda_array_interface__ pointer is "
                                                    "not device memory"), argument=argument)
    if attributes.device < 0:  # CUDA names the device of device and managed memory
        raise _ConfigError(_not_cuda(obj, argument, "whose __cuda_array_interface__ pointer CUDA "
                                                    "places on no device"), argument=argument)
    return attributes.device


def _as_cuda_array(obj, argument="x", stream=None):
    """``obj`` as a CudaArray (what the kernels take); ``stream``: the stream to order it
    before (a stream-like object or handle), None for no ordering."""
    if not isinstance(argument, str):
        raise _ConfigError(f"argument: got {_brief(argument)}; it must be the argument's name "
                           "(str)",
                           argument="argument")
    cdef uintptr_t handle = 0 if stream is None else _stream_handle(stream, "stream")
    return as_cuda_array(obj, argument, handle)

# Part of _core.pyx: the capsules that carry DLPack tensors (export and import). The DLPack 1.x
# ABI comes from the vendored dlpack.h (_decl_dlpack.pxd).

from cpython.bool cimport PyBool_Check
from cpython.pycapsule cimport PyCapsule_New, PyCapsule_Destructor
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc

from inferctx._decl_dlpack cimport (
    DLDeviceType, DLManagedTensor, DLManagedTensorVersioned, DLTensor, PyCapsule_SetName,
    _capsule_is_valid, _capsule_pointer)

# The error classes raised from here on (module-private names, not attributes of _core).
cdef object _ConfigError = _errors.ConfigError
cdef object _WorkspaceStateError = _errors.WorkspaceStateError


cdef enum:
    # The DLPack version this module exports (it uses nothing newer than 1.0).
    DLPACK_EXPORT_MAJOR = 1
    DLPACK_EXPORT_MINOR = 0


# Capsule names of the DLPack Python specification (static storage, as it requires).
cdef const char* _DLTENSOR = b"dltensor"
cdef const char* _DLTENSOR_VERSIONED = b"dltensor_versioned"
cdef const char* _USED_DLTENSOR = b"used_dltensor"
cdef const char* _USED_DLTENSOR_VERSIONED = b"used_dltensor_versioned"


# ---------------------------------------------------------------------------------------------
# Export: the managed tensor and its shape/strides arrays live in one malloc'd block whose
# manager_ctx holds a reference to the Python object that owns the memory.

cdef void _delete_managed(DLManagedTensor* managed) noexcept with gil:
    # Consumers call deleters from any thread, with or without the GIL.
    if managed != NULL:
        Py_XDECREF(<PyObject*>managed.manager_ctx)
        free(managed)


cdef void _delete_managed_versioned(DLManagedTensorVersioned* managed) noexcept with gil:
    if managed != NULL:
        Py_XDECREF(<PyObject*>managed.manager_ctx)
        free(managed)


cdef void _capsule_destructor(PyObject* capsule) noexcept:
    # Runs when a capsule dies; a consumed capsule was renamed and its consumer owns the tensor.
    cdef DLManagedTensor* managed
    if _capsule_is_valid(capsule, _DLTENSOR):
        managed = <DLManagedTensor*>_capsule_pointer(capsule, _DLTENSOR)
        if managed.deleter != NULL:
            managed.deleter(managed)


cdef void _capsule_destructor_versioned(PyObject* capsule) noexcept:
    cdef DLManagedTensorVersioned* managed
    if _capsule_is_valid(capsule, _DLTENSOR_VERSIONED):
        managed = <DLManagedTensorVersioned*>_capsule_pointer(capsule, _DLTENSOR_VERSIONED)
        if managed.deleter != NULL:
            managed.deleter(managed)


cdef object _export_capsule(object owner, void* data, int32_t device_type, int32_t device_id,
                            tuple shape, int dtype, bint versioned, uint64_t flags):
    """A DLPack capsule of the C-contiguous array `shape` x `dtype` at `data`, kept alive by
    `owner`. Strides are always filled in (the specification recommends it)."""
    cdef Py_ssize_t ndim = len(shape)
    cdef size_t head = sizeof(DLManagedTensorVersioned) if versioned else sizeof(DLManagedTensor)
    cdef char* block = <char*>malloc(head + 2 * <size_t>ndim * sizeof(int64_t))
    if block == NULL:
        raise MemoryError("__dlpack__: out of host memory for the DLPack tensor")
    cdef DLManagedTensorVersioned* versioned_tensor
    cdef DLManagedTensor* legacy_tensor
    cdef DLTensor* tensor
    cdef int64_t stride = 1
    cdef Py_ssize_t i
    if versioned:
        versioned_tensor = <DLManagedTensorVersioned*>block
        versioned_tensor.version.major = DLPACK_EXPORT_MAJOR
        versioned_tensor.version.minor = DLPACK_EXPORT_MINOR
        versioned_tensor.manager_ctx = <void*>owner
        versioned_tensor.deleter = _delete_managed_versioned
        versioned_tensor.flags = flags
        tensor = &versioned_tensor.dl_tensor
    else:
        legacy_tensor = <DLManagedTensor*>block
        legacy_tensor.manager_ctx = <void*>owner
        legacy_tensor.deleter = _delete_managed
        tensor = &legacy_tensor.dl_tensor
    tensor.data = data
    tensor.device.device_type = <DLDeviceType>device_type
    tensor.device.device_id = device_id
    tensor.ndim = <int32_t>ndim
    tensor.dtype.code = _DTYPE_DLPACK_CODE[dtype]
    tensor.dtype.bits = _DTYPE_BITS[dtype]
    tensor.dtype.lanes = 1
    tensor.byte_offset = 0
    # Both structs are multiples of 8 bytes, so the arrays after them are aligned.
    tensor.shape = <int64_t*>(block + head)
    tensor.strides = tensor.shape + ndim
    try:
        for i in range(ndim - 1, -1, -1):
            tensor.shape[i] = <int64_t>shape[i]
            tensor.strides[i] = stride
            stride *= tensor.shape[i]
        capsule = PyCapsule_New(
            block, _DLTENSOR_VERSIONED if versioned else _DLTENSOR,
            <PyCapsule_Destructor>(_capsule_destructor_versioned if versioned else _capsule_destructor))
    except BaseException:
        free(block)
        raise
    # Only now that the capsule exists does the tensor own a reference.
    Py_INCREF(owner)
    return capsule


# ---------------------------------------------------------------------------------------------
# Import: a consumed capsule is renamed, and the tensor's deleter is called when the last
# CudaArray built from it is gone.

cdef class _DLPackImport:
    """Owns a DLPack tensor taken from a capsule; calls the producer's deleter when it dies."""

    cdef void* managed
    cdef bint versioned

    def __init__(self):
        raise TypeError("_DLPackImport objects are made by inferctx only")

    def __dealloc__(self):
        cdef DLManagedTensorVersioned* versioned_tensor
        cdef DLManagedTensor* legacy_tensor
        if self.managed == NULL:
            return
        if self.versioned:
            versioned_tensor = <DLManagedTensorVersioned*>self.managed
            if versioned_tensor.deleter != NULL:
                versioned_tensor.deleter(versioned_tensor)
        else:
            legacy_tensor = <DLManagedTensor*>self.managed
            if legacy_tensor.deleter != NULL:
                legacy_tensor.deleter(legacy_tensor)
        self.managed = NULL


cdef _DLPackImport _consume_capsule(object capsule, object producer, str argument):
    """Takes ownership of the tensor in a DLPack capsule (renaming it to used_*)."""
    cdef _DLPackImport taken = _DLPackImport.__new__(_DLPackImport)
    cdef DLManagedTensorVersioned* versioned_tensor
    cdef PyObject* raw = <PyObject*>capsule
    if _capsule_is_valid(raw, _DLTENSOR_VERSIONED):
        versioned_tensor = <DLManagedTensorVersioned*>_capsule_pointer(raw, _DLTENSOR_VERSIONED)
        if versioned_tensor.version.major != 1:
            raise BufferError(
                f"{argument}: its DLPack tensor has version {versioned_tensor.version.major}."
                f"{versioned_tensor.version.minor}; inferctx reads DLPack 1.x")
        PyCapsule_SetName(capsule, _USED_DLTENSOR_VERSIONED)
        taken.versioned = True
        taken.managed = versioned_tensor
    elif _capsule_is_valid(raw, _DLTENSOR):
        taken.managed = _capsule_pointer(raw, _DLTENSOR)
        PyCapsule_SetName(capsule, _USED_DLTENSOR)
        taken.versioned = False
    else:
        raise _ConfigError(
            f"{argument}: {_type_name(producer)}.__dlpack__() returned {_brief(capsule)}, not "
            "an unused DLPack capsule ('dltensor' or 'dltensor_versioned')", argument=argument)
    return taken


cdef inline DLTensor* _import_tensor(_DLPackImport taken) noexcept:
    if taken.versioned:
        return &(<DLManagedTensorVersioned*>taken.managed).dl_tensor
    return &(<DLManagedTensor*>taken.managed).dl_tensor


cdef inline uint64_t _import_flags(_DLPackImport taken) noexcept:
    return (<DLManagedTensorVersioned*>taken.managed).flags if taken.versioned else 0


# ---------------------------------------------------------------------------------------------
# Arguments of __dlpack__ shared by DeviceView and PinnedBuffer.

cdef bint _wants_versioned(object max_version) except -1:
    """True when the consumer takes DLPack >= 1.0 capsules (the spec's max_version)."""
    if max_version is None:
        return False
    if (not isinstance(max_version, tuple) or len(max_version) != 2
            or any(PyBool_Check(v) or not isinstance(v, int) for v in max_version)):
        raise TypeError(f"max_version: got {_brief(max_version)}; the DLPack spec passes None or a "
                        f"(major, minor) tuple of ints")
    return max_version[0] >= 1


cdef int _copy_mode(object copy) except -2:
    """-1: copy=None (only if needed), 0: copy=False (never), 1: copy=True (always)."""
    if copy is None:
        return -1
    if copy is True:
        return 1
    if copy is False:
        return 0
    raise _ConfigError(f"copy: got {_brief(copy)}; valid: None, True or False", argument="copy")


cdef bint _is_int32(object value):
    """An int (not a bool) that a C int32_t holds, as DLPack's device_type and device_id are."""
    return (isinstance(value, int) and not PyBool_Check(value)
            and -(1 << 31) <= value < (1 << 31))


cdef bint _is_device_pair(object value):
    """Whether `value` is a DLPack (device_type, device_id) pair: a tuple of two 32-bit ints
    (DLDevice's two int32_t fields), no bools."""
    return (isinstance(value, tuple) and len(value) == 2
            and _is_int32(value[0]) and _is_int32(value[1]))


cdef tuple _dl_device_arg(object dl_device):
    """(device_type, device_id) of a dl_device argument, or None."""
    if dl_device is None:
        return None
    if not _is_device_pair(dl_device):
        raise BufferError(f"dl_device: got {_brief(dl_device)}; the DLPack spec passes a "
                          f"(device_type, device_id) tuple of 32-bit ints, such as (1, 0) for "
                          f"the CPU")
    return (int(dl_device[0]), int(dl_device[1]))

# cython: language_level=3
# extern declarations of DLPack 1.0 (third_party/dlpack/include/dlpack/dlpack.h, vendored with its
# licence) and of the capsule calls that carry its tensors between Python packages.

from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "dlpack/dlpack.h" nogil:
    ctypedef enum DLDeviceType:
        kDLCPU
        kDLCUDA
        kDLCUDAHost
        kDLCUDAManaged

    ctypedef enum DLDataTypeCode:
        kDLInt
        kDLUInt
        kDLFloat
        kDLBfloat
        kDLBool

    # Bits of DLManagedTensorVersioned.flags (macros in the header).
    enum:
        DLPACK_FLAG_BITMASK_READ_ONLY
        DLPACK_FLAG_BITMASK_IS_COPIED

    ctypedef struct DLDevice:
        DLDeviceType device_type
        int32_t device_id

    ctypedef struct DLDataType:
        uint8_t code
        uint8_t bits
        uint16_t lanes

    ctypedef struct DLTensor:
        void* data
        DLDevice device
        int32_t ndim
        DLDataType dtype
        int64_t* shape
        int64_t* strides
        uint64_t byte_offset

    ctypedef struct DLManagedTensor:
        DLTensor dl_tensor
        void* manager_ctx
        void (*deleter)(DLManagedTensor* self) noexcept nogil

    ctypedef struct DLPackVersion:
        uint32_t major
        uint32_t minor

    ctypedef struct DLManagedTensorVersioned:
        DLPackVersion version
        void* manager_ctx
        void (*deleter)(DLManagedTensorVersioned* self) noexcept nogil
        uint64_t flags
        DLTensor dl_tensor


cdef extern from "Python.h":
    # Without exception checks: these run inside capsule destructors, which may not raise.
    bint _capsule_is_valid "PyCapsule_IsValid"(PyObject* capsule, const char* name)
    void* _capsule_pointer "PyCapsule_GetPointer"(PyObject* capsule, const char* name)
    int PyCapsule_SetName(object capsule, const char* name) except -1

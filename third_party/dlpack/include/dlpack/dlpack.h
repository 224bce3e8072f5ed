/*!
 *  Copyright (c) 2017 by Contributors
 * \file dlpack.h
 * \brief The common header of DLPack.
 *
 * DLPack (https://github.com/dmlc/dlpack) is licensed under the Apache License, Version 2.0;
 * see ../../LICENSE. The declarations below are those of DLPack 1.0, the ABI inferctx speaks.
 */
#ifndef DLPACK_DLPACK_H_
#define DLPACK_DLPACK_H_

/*! \brief Compatibility with C++ */
#ifdef __cplusplus
#define DLPACK_EXTERN_C extern "C"
#else
#define DLPACK_EXTERN_C
#endif

/*! \brief The current major version of dlpack */
#define DLPACK_MAJOR_VERSION 1

/*! \brief The current minor version of dlpack */
#define DLPACK_MINOR_VERSION 0

/*! \brief DLPACK_DLL prefix for windows */
#ifdef _WIN32
#ifdef DLPACK_EXPORTS
#define DLPACK_DLL __declspec(dllexport)
#else
#define DLPACK_DLL __declspec(dllimport)
#endif
#else
#define DLPACK_DLL
#endif

#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/*!
 * \brief The DLPack version.
 *
 * A change in major version means a changed layout of DLManagedTensorVersioned: a consumer
 * that gets a major version other than DLPACK_MAJOR_VERSION must only call the deleter. A
 * change in minor version adds enumeration values; the layout stays the same.
 */
typedef struct {
  /*! \brief DLPack major version. */
  uint32_t major;
  /*! \brief DLPack minor version. */
  uint32_t minor;
} DLPackVersion;

/*! \brief The device type in DLDevice. */
#ifdef __cplusplus
typedef enum : int32_t {
#else
typedef enum {
#endif
  /*! \brief CPU device */
  kDLCPU = 1,
  /*! \brief CUDA GPU device */
  kDLCUDA = 2,
  /*! \brief Pinned CUDA CPU memory by cudaMallocHost */
  kDLCUDAHost = 3,
  /*! \brief OpenCL devices. */
  kDLOpenCL = 4,
  /*! \brief Vulkan buffer for next generation graphics. */
  kDLVulkan = 7,
  /*! \brief Metal for Apple GPU. */
  kDLMetal = 8,
  /*! \brief Verilog simulator buffer */
  kDLVPI = 9,
  /*! \brief ROCm GPUs for AMD GPUs */
  kDLROCM = 10,
  /*! \brief Pinned ROCm CPU memory allocated by hipMallocHost */
  kDLROCMHost = 11,
  /*! \brief Reserved extension device type, used for quickly testing an extension device. */
  kDLExtDev = 12,
  /*! \brief CUDA managed/unified memory allocated by cudaMallocManaged */
  kDLCUDAManaged = 13,
  /*! \brief Unified shared memory allocated on a oneAPI non-partitioned device. */
  kDLOneAPI = 14,
  /*! \brief GPU support for next generation WebGPU standard. */
  kDLWebGPU = 15,
  /*! \brief Qualcomm Hexagon DSP */
  kDLHexagon = 16,
  /*! \brief Microsoft MAIA devices */
  kDLMAIA = 17,
} DLDeviceType;

/*! \brief A Device for Tensor and operator. */
typedef struct {
  /*! \brief The device type used in the device. */
  DLDeviceType device_type;
  /*! \brief The device index; 0 for CPU memory, pinned memory and managed memory. */
  int32_t device_id;
} DLDevice;

/*! \brief The type code options DLDataType. */
typedef enum {
  /*! \brief signed integer */
  kDLInt = 0U,
  /*! \brief unsigned integer */
  kDLUInt = 1U,
  /*! \brief IEEE floating point */
  kDLFloat = 2U,
  /*! \brief Opaque handle type, reserved for testing purposes. */
  kDLOpaqueHandle = 3U,
  /*! \brief bfloat16 */
  kDLBfloat = 4U,
  /*! \brief complex number (C/C++/Python layout: compact struct per complex number) */
  kDLComplex = 5U,
  /*! \brief boolean */
  kDLBool = 6U,
} DLDataTypeCode;

/*!
 * \brief The data type the tensor can hold, in native byte order.
 *
 *  Examples
 *   - float: type_code = 2, bits = 32, lanes = 1
 *   - float4 (vectorized 4 float): type_code = 2, bits = 32, lanes = 4
 *   - int8: type_code = 0, bits = 8, lanes = 1
 *   - std::complex<float>: type_code = 5, bits = 64, lanes = 1
 *   - bool: type_code = 6, bits = 8, lanes = 1
 */
typedef struct {
  /*! \brief Type code of base types (a DLDataTypeCode, kept in uint8_t). */
  uint8_t code;
  /*! \brief Number of bits, common choices are 8, 16, 32. */
  uint8_t bits;
  /*! \brief Number of lanes in the type, used for vector types. */
  uint16_t lanes;
} DLDataType;

/*! \brief Plain C Tensor object, does not manage memory. */
typedef struct {
  /*! \brief The data pointer: a CUDA device pointer, a host pointer, or opaque. */
  void* data;
  /*! \brief The device of the tensor */
  DLDevice device;
  /*! \brief Number of dimensions */
  int32_t ndim;
  /*! \brief The data type of the pointer */
  DLDataType dtype;
  /*! \brief The shape of the tensor */
  int64_t* shape;
  /*! \brief Strides of the tensor in elements (not bytes); NULL means compact row-major. */
  int64_t* strides;
  /*! \brief The offset in bytes to the beginning pointer to data */
  uint64_t byte_offset;
} DLTensor;

/*!
 * \brief C Tensor object, manages the memory of a DLTensor (the legacy, unversioned
 * exchange structure; DLManagedTensorVersioned replaces it).
 */
typedef struct DLManagedTensor {
  /*! \brief DLTensor which is being memory managed */
  DLTensor dl_tensor;
  /*! \brief The context of the producer framework; it can be NULL. */
  void* manager_ctx;
  /*! \brief Destructor of manager_ctx; it deletes self as well. It can be NULL. */
  void (*deleter)(struct DLManagedTensor* self);
} DLManagedTensor;

/* bit masks used in DLManagedTensorVersioned.flags */

/*! \brief bit mask to indicate that the tensor is read only. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (1UL << 0UL)

/*!
 * \brief bit mask to indicate that the tensor is a copy made by the producer: the consumer
 * owns it alone until it calls the deleter.
 */
#define DLPACK_FLAG_BITMASK_IS_COPIED (1UL << 1UL)

/*! \brief A versioned and managed C Tensor object, manages the memory of a DLTensor. */
typedef struct DLManagedTensorVersioned {
  /*! \brief The API and ABI version of the current managed Tensor */
  DLPackVersion version;
  /*! \brief The context of the producer framework; it can be NULL. */
  void* manager_ctx;
  /*! \brief Destructor of manager_ctx; it deletes self as well. It can be NULL. */
  void (*deleter)(struct DLManagedTensorVersioned* self);
  /*! \brief Bitmask flags (DLPACK_FLAG_BITMASK_*), 0 by default. */
  uint64_t flags;
  /*! \brief DLTensor which is being memory managed */
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

#ifdef __cplusplus
}  // DLPACK_EXTERN_C
#endif
#endif  // DLPACK_DLPACK_H_

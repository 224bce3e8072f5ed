# Locates cuBLAS / cuBLASLt / cuRAND headers and the cuBLAS libraries: from the CUDA toolkit
# when it has them, otherwise from the nvidia-cublas / nvidia-curand wheels
# (site-packages/nvidia/cu13), which pip installs into the build and run environments.

find_package(CUDAToolkit REQUIRED)
find_package(Python 3.10 COMPONENTS Interpreter REQUIRED)

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import os, sys\nfor p in sys.path:\n    d = os.path.join(p, 'nvidia', 'cu13')\n    if os.path.isdir(d): print(d)"
  OUTPUT_VARIABLE _inferctx_wheel_roots
  OUTPUT_STRIP_TRAILING_WHITESPACE)
string(REPLACE "\n" ";" _inferctx_wheel_roots "${_inferctx_wheel_roots}")
set(_inferctx_wheel_include "")
set(_inferctx_wheel_lib "")
foreach(root IN LISTS _inferctx_wheel_roots)
  list(APPEND _inferctx_wheel_include "${root}/include")
  list(APPEND _inferctx_wheel_lib "${root}/lib")
endforeach()

find_path(INFERCTX_CUBLAS_INCLUDE_DIR cublas_v2.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} ${_inferctx_wheel_include} NO_DEFAULT_PATH)
find_path(INFERCTX_CURAND_INCLUDE_DIR curand_kernel.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} ${_inferctx_wheel_include} NO_DEFAULT_PATH)
find_library(INFERCTX_CUBLAS_LIBRARY NAMES cublas libcublas.so.13
  HINTS ${CUDAToolkit_LIBRARY_DIR} ${_inferctx_wheel_lib} NO_DEFAULT_PATH)
find_library(INFERCTX_CUBLASLT_LIBRARY NAMES cublasLt libcublasLt.so.13
  HINTS ${CUDAToolkit_LIBRARY_DIR} ${_inferctx_wheel_lib} NO_DEFAULT_PATH)

foreach(var INFERCTX_CUBLAS_INCLUDE_DIR INFERCTX_CURAND_INCLUDE_DIR INFERCTX_CUBLAS_LIBRARY INFERCTX_CUBLASLT_LIBRARY)
  if(NOT ${var})
    message(FATAL_ERROR
      "${var} not found in the CUDA toolkit (${CUDAToolkit_INCLUDE_DIRS}) nor in an nvidia-cu13 wheel "
      "(${_inferctx_wheel_roots}). Install them: pip install nvidia-cublas nvidia-curand")
  endif()
endforeach()

get_filename_component(INFERCTX_CUBLAS_LIBRARY_DIR "${INFERCTX_CUBLAS_LIBRARY}" DIRECTORY)
message(STATUS "inferctx: cuBLAS headers ${INFERCTX_CUBLAS_INCLUDE_DIR}, library ${INFERCTX_CUBLAS_LIBRARY}")
message(STATUS "inferctx: cuRAND headers ${INFERCTX_CURAND_INCLUDE_DIR}")

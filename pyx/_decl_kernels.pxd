# cython: language_level=3
# extern declarations of inferctx_core's dropout kernels (cuda/include/inferctx/dropout.hpp).

from libc.stdint cimport int64_t, uint64_t

from inferctx._decl_errors cimport raise_inferctx_error
from inferctx._decl_gpu cimport GraphRng, PhiloxSource, cudaStream_t


cdef extern from "inferctx/dropout.hpp" namespace "inferctx" nogil:
    int64_t dropout_mask_elements(int64_t n, int mask_mode) except +raise_inferctx_error
    void dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, double p,
                         int mask_mode, uint64_t seed, uint64_t offset, cudaStream_t stream,
                         int device, int max_blocks) except +raise_inferctx_error
    # The same drawing from a PhiloxSource (host values or a captured call site).
    void dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, double p,
                         int mask_mode, const PhiloxSource& source, cudaStream_t stream,
                         int device, int max_blocks) except +raise_inferctx_error
    # The same drawing from a context's GraphRng once the arguments are checked.
    void dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, double p,
                         int mask_mode, GraphRng& rng, cudaStream_t stream, int device,
                         int max_blocks) except +raise_inferctx_error
    void dropout_apply_mask(const void* grad, const void* mask, void* out, int64_t n, int dtype,
                            double p, int mask_mode, cudaStream_t stream, int device,
                            int max_blocks) except +raise_inferctx_error

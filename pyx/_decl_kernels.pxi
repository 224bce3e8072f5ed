# extern declarations of inferctx_core's kernels (cuda/include/inferctx: dropout, gemm).
# Included by _core.pxd after _decl_gpu.pxi.

from libcpp.vector cimport vector as cpp_vector


cdef extern from "inferctx/dropout.hpp" namespace "inferctx" nogil:
    int64_t dropout_mask_elements(int64_t n, int mask_mode) except +raise_inferctx_error
    void dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, double p,
                         int mask_mode, uint64_t seed, uint64_t offset, cudaStream_t stream,
                         int device, int max_blocks) except +raise_inferctx_error
    # The same drawing from a PhiloxSource (host values or a captured call site).
    void dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, double p,
                         int mask_mode, const PhiloxSource& source, cudaStream_t stream,
                         int device, int max_blocks) except +raise_inferctx_error
    void dropout_apply_mask(const void* grad, const void* mask, void* out, int64_t n, int dtype,
                            double p, int mask_mode, cudaStream_t stream, int device,
                            int max_blocks) except +raise_inferctx_error


cdef extern from "inferctx/gemm.hpp" namespace "inferctx" nogil:
    cdef cppclass GemmProblem:
        int dtype
        bool trans_a
        bool trans_b
        int64_t m, n, k, batch, lda, ldb, ldc, stride_a, stride_b, stride_c
        bool tf32

    cdef cppclass GemmTuneOptions:
        int max_algorithms
        int warmup
        int repeats
        double min_batch_ms
        bool include_cublas

    cdef cppclass GemmTuneResult:
        int backend
        int algo_index
        cpp_vector[uint64_t] algo
        int algo_id, tile_id, stages_id, splitk
        double default_ms, best_ms
        int candidates, valid, rotated_sets

    cdef cppclass GemmCacheEntry:
        int device
        string device_name
        int64_t cublas_version
        GemmProblem problem
        int align_a, align_b, align_c
        int backend
        cpp_vector[uint64_t] algo
        double time_ms

    void gemm(CublasHandle& handle, cudaStream_t stream, const GemmProblem& problem, const void* a,
              const void* b, void* c, float alpha, float beta) except +raise_inferctx_error
    GemmTuneResult tune_gemm(CublasHandle& handle, cudaStream_t stream, const GemmProblem& problem,
                             const GemmTuneOptions& options) except +raise_inferctx_error
    cpp_vector[GemmCacheEntry] export_gemm_cache(bool tuned_only) except +raise_inferctx_error
    int64_t import_gemm_cache(const cpp_vector[GemmCacheEntry]& entries) except +raise_inferctx_error
    void clear_gemm_cache() except +raise_inferctx_error

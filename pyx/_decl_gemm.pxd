# cython: language_level=3
# extern declarations of inferctx_core's GEMM (cuda/include/inferctx/gemm.hpp): the problem, the
# layout a call's operands make, running it, the tuner and the algorithm cache.

from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libcpp cimport bool
from libcpp.string cimport string
from libcpp.vector cimport vector as cpp_vector

from inferctx._decl_errors cimport raise_inferctx_error
from inferctx._decl_gpu cimport CublasHandle, cudaStream_t


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

    cdef cppclass GemmOperand:
        int dtype
        string dtype_name
        cpp_vector[int64_t] shape
        cpp_vector[int64_t] strides

    cdef cppclass GemmLayout:
        GemmProblem problem
        bool swap
        cpp_vector[int64_t] out_shape

    GemmProblem packed_gemm_problem(int dtype, int64_t m, int64_t n, int64_t k, int64_t batch,
                                    bool trans_a, bool trans_b, bool tf32) except +raise_inferctx_error
    GemmProblem normalized_gemm_problem(const GemmProblem& problem)
    int packed_operand_alignment(int64_t batch, int64_t stride, int64_t esize)
    GemmLayout gemm_layout(int ndim, bool trans_a, bool trans_b, const GemmOperand& a,
                           const GemmOperand& b, const GemmOperand* out) except +raise_inferctx_error
    void check_gemm_addresses(const GemmLayout& layout, uintptr_t a, uintptr_t b,
                              uintptr_t c) except +raise_inferctx_error
    void gemm(CublasHandle& handle, cudaStream_t stream, const GemmProblem& problem, const void* a,
              const void* b, void* c, float alpha, float beta) except +raise_inferctx_error
    void gemm(CublasHandle& handle, cudaStream_t stream, const GemmLayout& layout, const void* a,
              const void* b, void* c, float alpha, float beta, bool tf32) except +raise_inferctx_error
    GemmTuneResult tune_gemm(CublasHandle& handle, cudaStream_t stream, const GemmProblem& problem,
                             const GemmTuneOptions& options) except +raise_inferctx_error
    cpp_vector[GemmCacheEntry] export_gemm_cache(bool tuned_only) except +raise_inferctx_error
    int64_t import_gemm_cache(const cpp_vector[GemmCacheEntry]& entries) except +raise_inferctx_error
    void check_gemm_cache(const cpp_vector[GemmCacheEntry]& entries) except +raise_inferctx_error
    void clear_gemm_cache() except +raise_inferctx_error

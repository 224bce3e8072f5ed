# cython: language_level=3
# extern declarations of inferctx_core's GPU resources (cuda/include/inferctx: cuda_check, memory,
# stream, blas, philox, graph_rng, context, pool) and of the few CUDA runtime calls pyx/ makes
# itself (each checked with check_cuda). The C++ classes whose names the Python classes take are
# declared as Cpp*.

from libc.stdint cimport int64_t, uint64_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string
from libcpp.utility cimport pair

from inferctx._decl_errors cimport raise_inferctx_error
from inferctx._decl_planner cimport PlanRequest, WorkspacePlan


cdef extern from "cuda_runtime_api.h" nogil:
    ctypedef enum cudaError_t:
        cudaSuccess
        cudaErrorNotReady
        cudaErrorStreamCaptureImplicit

    ctypedef void* cudaStream_t
    ctypedef void* cudaEvent_t
    # Special handles: (cudaStream_t)0x1 and (cudaStream_t)0x2.
    cudaStream_t cudaStreamLegacy
    cudaStream_t cudaStreamPerThread

    ctypedef enum cudaMemoryType:
        cudaMemoryTypeUnregistered
        cudaMemoryTypeHost
        cudaMemoryTypeDevice
        cudaMemoryTypeManaged

    ctypedef struct cudaPointerAttributes:
        cudaMemoryType type
        int device

    cudaError_t cudaGetDevice(int* device)
    cudaError_t cudaSetDevice(int device)
    cudaError_t cudaGetLastError()
    cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
    cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags)
    cudaError_t cudaEventSynchronize(cudaEvent_t event)
    cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr)
    cudaError_t cudaStreamGetDevice(cudaStream_t stream, int* device)
    ctypedef enum cudaStreamCaptureStatus:
        cudaStreamCaptureStatusNone
        cudaStreamCaptureStatusActive
        cudaStreamCaptureStatusInvalidated
    cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status)
    # The later arguments (graph, dependencies) keep their C++ defaults.
    cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, cudaStreamCaptureStatus* status,
                                         unsigned long long* capture_id)


cdef extern from "cublas_v2.h" nogil:
    ctypedef void* cublasHandle_t


cdef extern from "inferctx/cuda_check.hpp" namespace "inferctx" nogil:
    cdef cppclass MemoryInfo:
        int64_t free_bytes
        int64_t total_bytes

    int device_count() except +raise_inferctx_error
    int current_device() except +raise_inferctx_error
    MemoryInfo memory_info(int device) except +raise_inferctx_error
    void check_cuda(cudaError_t status, const char* call, int device) except +raise_inferctx_error
    void check_device_ordinal(int device) except +raise_inferctx_error


cdef extern from "inferctx/memory.hpp" namespace "inferctx" nogil:
    cdef cppclass DeviceAllocation:
        DeviceAllocation(int device, int64_t bytes) except +raise_inferctx_error
        void* data()
        int64_t size()
        int device()
        bool accessible()

    cdef cppclass PinnedAllocation:
        PinnedAllocation(int64_t bytes) except +raise_inferctx_error
        void* data()
        int64_t size()

    void copy_async(void* dst, const void* src, int64_t bytes, void* stream,
                    int device) except +raise_inferctx_error


cdef extern from "inferctx/stream.hpp" namespace "inferctx" nogil:
    bool stream_is_on_device(cudaStream_t stream, int device) except +raise_inferctx_error
    bool stream_was_destroyed(cudaStream_t stream)
    cdef cppclass CppStream "inferctx::Stream":
        CppStream()
        @staticmethod
        CppStream create(int device) except +raise_inferctx_error
        @staticmethod
        CppStream borrow(cudaStream_t handle, int device) except +raise_inferctx_error
        cudaStream_t handle()
        bool owned()
        int device()
        void synchronize() except +raise_inferctx_error

    cdef cppclass CppEvent "inferctx::Event":
        CppEvent(int device, bool timing) except +raise_inferctx_error
        cudaEvent_t handle()
        int device()
        bool timing()
        void record(cudaStream_t stream) except +raise_inferctx_error
        void make_wait(cudaStream_t stream) except +raise_inferctx_error
        void make_wait(cudaStream_t stream, int stream_device) except +raise_inferctx_error
        bool query() except +raise_inferctx_error
        void synchronize() except +raise_inferctx_error
        float elapsed_ms_since(const CppEvent& start) except +raise_inferctx_error


cdef extern from "inferctx/blas.hpp" namespace "inferctx" nogil:
    cdef cppclass CublasHandle:
        cublasHandle_t get()
        void* workspace()
        int64_t workspace_bytes()
        int device()
        cudaStream_t stream()
        void set_tf32(bool enabled) except +raise_inferctx_error
        bool tf32()


cdef extern from "inferctx/philox.hpp" namespace "inferctx" nogil:
    cdef cppclass PhiloxState:
        pair[uint64_t, uint64_t] increment_offset(uint64_t increment) except +raise_inferctx_error
        void set_seed(uint64_t seed)
        uint64_t seed()
        uint64_t offset()
        pair[uint64_t, uint64_t] state()


cdef extern from "inferctx/graph_rng.hpp" namespace "inferctx" nogil:
    cdef cppclass GraphPhilox:
        uint64_t uid
        uint64_t site
        uint64_t step

    cdef cppclass PhiloxSource:
        bool captured
        uint64_t seed
        uint64_t offset
        GraphPhilox graph
        @staticmethod
        PhiloxSource host(uint64_t seed, uint64_t offset)

    cdef cppclass GraphRngStats:
        uint64_t seed
        uint64_t offset
        uint64_t epoch
        uint64_t sites
        int64_t live_sites
        int64_t slots

    cdef cppclass GraphRng:
        PhiloxSource draw(cudaStream_t stream, uint64_t increment) except +raise_inferctx_error
        GraphRngStats stats() except +raise_inferctx_error

    bool stream_capturing(cudaStream_t stream, int device) except +raise_inferctx_error


cdef extern from "inferctx/context.hpp" namespace "inferctx" nogil:
    cdef cppclass CppInferenceContext "inferctx::InferenceContext":
        @staticmethod
        shared_ptr[CppInferenceContext] instance(int device) except +raise_inferctx_error

        int device()
        int multiprocessor_count()
        int compute_capability()

        WorkspacePlan gen_workspace(const PlanRequest& request) except +raise_inferctx_error
        bool has_plan()
        WorkspacePlan plan() except +raise_inferctx_error
        uint64_t plan_generation()
        shared_ptr[DeviceAllocation] workspace() except +raise_inferctx_error
        int64_t workspace_bytes()
        int64_t max_token_length()
        bool released()
        int64_t views_alive()
        void release_workspace(bool force, bool keep_contents) except +raise_inferctx_error
        bool retake_workspace() except +raise_inferctx_error
        bool addresses_stable()
        const string& fallback_reason()
        int64_t allocation_granularity()
        int64_t held_bytes()
        int64_t host_copy_bytes()
        uint64_t contents_epoch()
        bool in_released_range(const void* p, int64_t bytes)
        bool addresses_released()

        int64_t current_tokens()
        void advance_tokens(int64_t n) except +raise_inferctx_error
        void reset_tokens(int64_t initial) except +raise_inferctx_error

        cudaStream_t stream()
        cudaStream_t comm_stream()
        void use_stream(cudaStream_t external) except +raise_inferctx_error
        void sync_comp() except +raise_inferctx_error
        void sync_comm() except +raise_inferctx_error
        void sync_comp(cudaStream_t compute) except +raise_inferctx_error
        void sync_comm(cudaStream_t compute) except +raise_inferctx_error
        cudaStream_t own_stream()

        pair[uint64_t, uint64_t] increment_offset(uint64_t increment) except +raise_inferctx_error
        # Also writes the graphs' device header (graph_rng.hpp), so it can raise.
        void set_seed(uint64_t seed) except +raise_inferctx_error
        void set_seed(uint64_t seed, cudaStream_t stream) except +raise_inferctx_error
        const PhiloxState& philox()
        GraphRng& graph_rng()
        CublasHandle& cublas()


cdef extern from "inferctx/pool.hpp" namespace "inferctx" nogil:
    cdef cppclass PoolStats:
        int64_t reserved_bytes
        int64_t used_bytes
        int64_t peak_reserved_bytes
        int64_t peak_used_bytes
        int64_t allocations

    cdef cppclass PooledAllocation(DeviceAllocation):
        void note_use(cudaStream_t stream) except +raise_inferctx_error
        void note_unknown_use()

    cdef cppclass DevicePool:
        @staticmethod
        shared_ptr[DevicePool] of(int device) except +raise_inferctx_error
        int device()
        shared_ptr[PooledAllocation] allocate(int64_t bytes, cudaStream_t stream) except +raise_inferctx_error
        PoolStats stats() except +raise_inferctx_error
        void reset_peak() except +raise_inferctx_error
        int64_t trim(int64_t keep_bytes) except +raise_inferctx_error
        void note_durable(cudaStream_t stream) except +raise_inferctx_error

ctypedef PooledAllocation* PooledAllocationPtr

# cython: language_level=3
# extern declarations of cuda/include/inferctx/plan.hpp (in inferctx_plan): the planner, pure
# host code.

from libc.stdint cimport int64_t
from libcpp cimport bool
from libcpp.string cimport string

from inferctx._decl_errors cimport raise_inferctx_error


cdef extern from "inferctx/plan.hpp" namespace "inferctx" nogil:
    cdef enum class DType(int):
        Float32
        Float16
        BFloat16

    int64_t dtype_size(int dtype) except +raise_inferctx_error
    string human_bytes(int64_t bytes) except +raise_inferctx_error

    cdef cppclass ModelShape:
        int64_t num_layers
        int64_t num_heads
        int64_t hidden_dim
        int64_t num_kv_heads
        int64_t head_dim

    cdef cppclass PlanRequest:
        ModelShape shape
        int64_t batch_size
        int64_t prompt_len
        int64_t max_out_tokens
        int64_t min_out_tokens
        int dtype
        int64_t mp_size
        int64_t rank
        bool external_cache
        int policy
        int64_t free_bytes
        int64_t total_bytes
        int64_t weights_bytes
        bool has_reserve
        int64_t reserve_bytes
        bool has_memory_limit
        int64_t memory_limit_bytes
        bool has_memory_fraction
        double memory_fraction
        int64_t allocation_granularity

    cdef cppclass Region:
        string name
        int64_t offset
        int64_t size

    cdef cppclass WorkspacePlan:
        PlanRequest request
        int64_t elem_size
        int64_t head_dim
        int64_t head_dim_padded
        int64_t heads_per_rank
        int64_t kv_heads_per_rank
        int64_t max_tokens
        int64_t workspace_bytes
        int64_t planned_free_bytes
        int64_t budget_bytes
        int64_t reserve_bytes
        string budget_limit
        string bound_by
        int64_t activations_offset
        int64_t activations_bytes
        int64_t kv_cache_offset
        int64_t kv_cache_bytes
        int64_t kv_layer_stride
        int64_t kv_value_offset
        int64_t kv_tensor_bytes
        int64_t attention_scores_offset
        int64_t attention_scores_bytes

    WorkspacePlan plan_workspace(const PlanRequest& request) except +raise_inferctx_error
    int64_t workspace_bytes_for(const PlanRequest& request, int64_t tokens) except +raise_inferctx_error
    void check_request(const PlanRequest& request) except +raise_inferctx_error
    int64_t region_count(const WorkspacePlan& plan) except +raise_inferctx_error
    Region region_at(const WorkspacePlan& plan, int64_t index) except +raise_inferctx_error
    int64_t max_batch_size(const PlanRequest& request) except +raise_inferctx_error
    int64_t max_out_tokens_for(const PlanRequest& request) except +raise_inferctx_error
    int64_t weights_bytes_for(int64_t num_params, int dtype, int64_t mp_size) except +raise_inferctx_error
    int64_t default_reserve(int64_t free)

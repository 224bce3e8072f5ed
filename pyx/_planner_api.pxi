# Bindings of the C++ workspace planner (pure host code). Included by _plan.pyx and, through
# _planner.pxi, by _core.pyx (whose gen_workspace builds requests with make_request and hands
# them back to the Python half with request_to_dict).

from libc.stdint cimport int64_t

from inferctx._decl_planner cimport (
    DType, PlanRequest, Region, WorkspacePlan, check_request, default_reserve, dtype_size,
    human_bytes, max_batch_size, max_out_tokens_for, plan_workspace, region_at, region_count,
    weights_bytes_for, workspace_bytes_for)

cdef PlanRequest make_request(dict f) except *:
    """The C++ request of coerced fields (planning._request_fields: every int fits int64_t)."""
    cdef PlanRequest r
    r.shape.num_layers = f["num_layers"]
    r.shape.num_heads = f["num_heads"]
    r.shape.hidden_dim = f["hidden_dim"]
    r.shape.num_kv_heads = f["num_kv_heads"]
    r.shape.head_dim = f["head_dim"]
    r.batch_size = f["batch_size"]
    r.prompt_len = f["prompt_len"]
    r.max_out_tokens = f["max_out_tokens"]
    r.min_out_tokens = f["min_out_tokens"]
    r.dtype = f["dtype"]
    r.mp_size = f["mp_size"]
    r.rank = f["rank"]
    r.external_cache = f["external_cache"]
    r.policy = f["policy"]
    r.free_bytes = f["free_bytes"]
    r.total_bytes = f["total_bytes"]
    r.weights_bytes = f["weights_bytes"]
    r.has_reserve = f["reserve_bytes"] is not None
    r.reserve_bytes = f["reserve_bytes"] or 0
    r.has_memory_limit = f["memory_limit_bytes"] is not None
    r.memory_limit_bytes = f["memory_limit_bytes"] or 0
    r.has_memory_fraction = f["memory_fraction"] is not None
    r.memory_fraction = 1.0 if f["memory_fraction"] is None else f["memory_fraction"]
    # Not a planning argument: what a context adds for its mapping's granularity (a caller that
    # asks what a context's gen_workspace would give; a coerced int >= 0).
    r.allocation_granularity = f.get("allocation_granularity", 0)
    return r


cdef dict request_to_dict(const PlanRequest& r):
    """The planner's request as the dict WorkspacePlan takes (the inverse of make_request)."""
    return {
        "num_layers": r.shape.num_layers,
        "num_heads": r.shape.num_heads,
        "hidden_dim": r.shape.hidden_dim,
        "num_kv_heads": r.shape.num_kv_heads,
        "head_dim": r.shape.head_dim,
        "batch_size": r.batch_size,
        "prompt_len": r.prompt_len,
        "max_out_tokens": r.max_out_tokens,
        "min_out_tokens": r.min_out_tokens,
        "dtype": r.dtype,
        "mp_size": r.mp_size,
        "rank": r.rank,
        "external_cache": r.external_cache,
        "policy": r.policy,
        "free_bytes": r.free_bytes,
        "total_bytes": r.total_bytes,
        "weights_bytes": r.weights_bytes,
        "reserve_bytes": r.reserve_bytes if r.has_reserve else None,
        "memory_limit_bytes": r.memory_limit_bytes if r.has_memory_limit else None,
        "memory_fraction": r.memory_fraction if r.has_memory_fraction else None,
    }


cdef dict plan_to_dict(const WorkspacePlan& p):
    return {
        "max_tokens": p.max_tokens,
        "workspace_bytes": p.workspace_bytes,
        "elem_size": p.elem_size,
        "head_dim": p.head_dim,
        "head_dim_padded": p.head_dim_padded,
        "heads_per_rank": p.heads_per_rank,
        "kv_heads_per_rank": p.kv_heads_per_rank,
        "planned_free_bytes": p.planned_free_bytes,
        "budget_bytes": p.budget_bytes,
        "reserve_bytes": p.reserve_bytes,
        "budget_limit": p.budget_limit.decode(),
        "bound_by": p.bound_by.decode(),
        "activations_offset": p.activations_offset,
        "activations_bytes": p.activations_bytes,
        "kv_cache_offset": p.kv_cache_offset,
        "kv_cache_bytes": p.kv_cache_bytes,
        "kv_layer_stride": p.kv_layer_stride,
        "kv_value_offset": p.kv_value_offset,
        "kv_tensor_bytes": p.kv_tensor_bytes,
        "attention_scores_offset": p.attention_scores_offset,
        "attention_scores_bytes": p.attention_scores_bytes,
    }


cdef WorkspacePlan layout_of(dict result, int64_t num_layers):
    """The layout fields of a plan dict (plan_to_dict's), as region_at reads them."""
    cdef WorkspacePlan p
    p.request.shape.num_layers = num_layers
    p.activations_offset = result["activations_offset"]
    p.activations_bytes = result["activations_bytes"]
    p.kv_cache_offset = result["kv_cache_offset"]
    p.kv_layer_stride = result["kv_layer_stride"]
    p.kv_value_offset = result["kv_value_offset"]
    p.kv_tensor_bytes = result["kv_tensor_bytes"]
    p.attention_scores_offset = result["attention_scores_offset"]
    p.attention_scores_bytes = result["attention_scores_bytes"]
    return p


def _plan(dict fields):
    """Plans a workspace from validated, coerced fields; returns the plan as a dict."""
    cdef PlanRequest r = make_request(fields)
    cdef WorkspacePlan p
    with nogil:
        p = plan_workspace(r)
    return plan_to_dict(p)


def _check(dict fields):
    """The planner's checks that do not involve the memory figures (ConfigError naming one)."""
    cdef PlanRequest r = make_request(fields)
    with nogil:
        check_request(r)


def _workspace_bytes_for(dict fields, int64_t tokens):
    """Bytes the request's layout needs for `tokens` tokens."""
    cdef PlanRequest r = make_request(fields)
    cdef int64_t n
    with nogil:
        n = workspace_bytes_for(r, tokens)
    return n


def _max_batch_size(dict fields):
    """The largest batch_size that holds all max_out_tokens (0: none)."""
    cdef PlanRequest r = make_request(fields)
    cdef int64_t n
    with nogil:
        n = max_batch_size(r)
    return n


def _max_out_tokens_for(dict fields):
    """The largest max_out_tokens held in full for the request's batch_size (0: none)."""
    cdef PlanRequest r = make_request(fields)
    cdef int64_t n
    with nogil:
        n = max_out_tokens_for(r)
    return n


def _weights_bytes(int64_t num_params, int dtype, int64_t mp_size):
    """Bytes of num_params parameters of `dtype` on one of mp_size ranks (rounded up)."""
    cdef int64_t n
    with nogil:
        n = weights_bytes_for(num_params, dtype, mp_size)
    return n


def _default_reserve(int64_t free):
    """The exact policy's default reserve for `free` bytes."""
    return default_reserve(free)


def _region_count(dict result, int64_t num_layers):
    cdef WorkspacePlan p = layout_of(result, num_layers)
    return region_count(p)


def _region(dict result, int64_t num_layers, int64_t index):
    """(name, offset, size) of region `index` of a plan (ConfigError outside the range)."""
    cdef WorkspacePlan p = layout_of(result, num_layers)
    cdef Region g = region_at(p, index)
    return g.name.decode(), g.offset, g.size


def _human_bytes(int64_t n):
    """1536 -> '1.50 KiB': the one byte formatter (binary units, two decimals)."""
    return human_bytes(n).decode()


# The planner's dtypes (inferctx::DType): their codes and sizes, read from the C++ enum and
# dtype_size. python/inferctx/dtypes.py takes them from here.
DTYPE_FLOAT32 = <int>DType.Float32
DTYPE_FLOAT16 = <int>DType.Float16
DTYPE_BFLOAT16 = <int>DType.BFloat16
DTYPE_ITEMSIZE = {code: dtype_size(code) for code in (DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16)}

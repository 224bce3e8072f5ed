# Part of _core.pyx: bindings of the C++ workspace planner.

cdef PlanRequest make_request(dict f) except *:
    cdef PlanRequest r
    r.shape.num_layers = f["num_layers"]
    r.shape.num_heads = f["num_heads"]
    r.shape.hidden_dim = f["hidden_dim"]
    r.shape.num_kv_heads = f["num_kv_heads"]
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
    r.has_reserve = f["reserve_bytes"] is not None
    r.reserve_bytes = f["reserve_bytes"] or 0
    r.has_memory_limit = f["memory_limit_bytes"] is not None
    r.memory_limit_bytes = f["memory_limit_bytes"] or 0
    r.has_memory_fraction = f["memory_fraction"] is not None
    r.memory_fraction = 1.0 if f["memory_fraction"] is None else f["memory_fraction"]
    return r


cdef dict plan_to_dict(const WorkspacePlan& p):
    cdef size_t i
    regions = []
    for i in range(p.regions.size()):
        regions.append((p.regions[i].name.decode(), p.regions[i].offset, p.regions[i].size))
    return {
        "max_tokens": p.max_tokens,
        "workspace_bytes": p.workspace_bytes,
        "elem_size": p.elem_size,
        "head_dim": p.head_dim,
        "head_dim_padded": p.head_dim_padded,
        "heads_per_rank": p.heads_per_rank,
        "kv_heads_per_rank": p.kv_heads_per_rank,
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
        "regions": regions,
    }


def _plan(dict fields):
    """Plans a workspace from validated, coerced fields; returns the plan as a dict."""
    cdef PlanRequest r = make_request(fields)
    cdef WorkspacePlan p
    with nogil:
        p = plan_workspace(r)
    return plan_to_dict(p)


def _workspace_bytes_for(dict fields, int64_t tokens):
    """Bytes the request's layout needs for `tokens` tokens."""
    cdef PlanRequest r = make_request(fields)
    cdef int64_t n
    with nogil:
        n = workspace_bytes_for(r, tokens)
    return n


def _device_count():
    """Number of visible CUDA devices; NoCudaDeviceError when none."""
    cdef int n
    with nogil:
        n = device_count()
    return n


def _current_device():
    cdef int d
    with nogil:
        d = current_device()
    return d


def _memory_info(int device):
    """(free_bytes, total_bytes) of `device`, read now."""
    cdef MemoryInfo m
    with nogil:
        m = memory_info(device)
    return m.free_bytes, m.total_bytes

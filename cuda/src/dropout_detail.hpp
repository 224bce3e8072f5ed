// What dropout's two files share, internal to cuda/src: dropout.cpp checks the arguments and
// handles the values of p that need no kernel; dropout_kernels.cu holds the kernels and launches
// them through these two functions.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "inferctx/dropout.hpp"
#include "inferctx/graph_rng.hpp"

namespace inferctx::detail {

// Queues the forward kernel over n > 0 elements of `dtype` on `stream` of `device` (the calling
// thread's current device), the arguments checked: element i is kept iff its Philox output is
// >= threshold (dropout_keep_threshold), a kept element is multiplied by `scale`. The Philox
// inputs come from `source`: the host's (seed, offset), or a call site's state read when the
// kernel runs (which the kernel then advances). The 16-byte path is taken where the pointers
// allow it, the scalar path elsewhere; max_blocks as dropout_forward's.
void launch_dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, MaskMode mode,
                            uint32_t threshold, float scale, const PhiloxSource& source, cudaStream_t stream,
                            int device, int max_blocks);

// Queues the kernel that applies a stored Bytes or Bits mask: out_i = mask_i ? grad_i * scale : +0,
// under the same conditions as launch_dropout_forward.
void launch_dropout_apply(const void* grad, const void* mask, void* out, int64_t n, int dtype, MaskMode mode,
                          float scale, cudaStream_t stream, int device, int max_blocks);

}  // namespace inferctx::detail

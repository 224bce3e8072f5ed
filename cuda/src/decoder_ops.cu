// The reference decoder's fused elementwise kernels (decoder_ops.hpp): GELU (tanh form), SiLU
// times the up projection, and the rotary embedding, each rounded as the eager sequence it
// replaces. Small grid-stride kernels: the decoder runs them on a few thousand to a few hundred
// thousand elements per call, inside a CUDA graph.
#include "inferctx/decoder_ops.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <climits>
#include <cstdint>
#include <string>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/plan.hpp"
#include "array_checks.hpp"
#include "dtype_dispatch.hpp"
#include "elem.cuh"

namespace inferctx {

using detail::address;
using detail::check_pointer;
using detail::invalid;

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;  // the kernels loop over what a capped grid leaves

template <typename T>
__device__ __forceinline__ float load(T v) {
  return detail::Elem<T>::to_float(v);
}

template <typename T>
__device__ __forceinline__ T store(float v) {
  return detail::Elem<T>::from_float(v);
}

// v rounded to T and back: what an eager kernel's result holds.
template <typename T>
__device__ __forceinline__ float rnd(float v) {
  return load<T>(store<T>(v));
}

__device__ __forceinline__ int64_t first_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

template <typename T>
__global__ void gelu_new_kernel(T* x, int64_t n, CubeRounding cube, float c_cube, float c_tanh) {
  for (int64_t i = first_index(); i < n; i += grid_threads()) {
    const float v = load(x[i]);
    float t;
    if (cube == CubeRounding::EachProduct) {
      t = rnd<T>(__fmul_rn(rnd<T>(__fmul_rn(v, v)), v));
    } else if (cube == CubeRounding::Float) {
      t = rnd<T>(__fmul_rn(__fmul_rn(v, v), v));
    } else {
      t = rnd<T>(powf(v, 3.0f));
    }
    t = rnd<T>(__fmul_rn(t, c_cube));
    t = rnd<T>(__fadd_rn(t, v));
    t = rnd<T>(__fmul_rn(t, c_tanh));
    t = rnd<T>(tanhf(t));
    t = rnd<T>(__fadd_rn(t, 1.0f));
    const float half_x = rnd<T>(__fmul_rn(v, 0.5f));
    x[i] = store<T>(__fmul_rn(half_x, t));
  }
}

template <typename T>
__global__ void silu_mul_kernel(T* gate, const T* up, int64_t cols, int64_t total, int64_t ld_gate, int64_t ld_up) {
  for (int64_t i = first_index(); i < total; i += grid_threads()) {
    const int64_t r = i / cols;
    const int64_t c = i - r * cols;
    T* g = gate + r * ld_gate + c;
    const float v = load(*g);
    const float s = rnd<T>(__fdiv_rn(v, __fadd_rn(1.0f, expf(-v))));
    *g = store<T>(__fmul_rn(s, load(up[r * ld_up + c])));
  }
}

struct RopeStrides {
  int64_t batch, token, head;
};

template <typename T>
__global__ void rope_kernel(const T* src, T* dst, const T* cos, const T* sin, int64_t tokens, int64_t heads,
                            int64_t half, int64_t total, RopeStrides s, RopeStrides d, int64_t cs) {
  for (int64_t i = first_index(); i < total; i += grid_threads()) {
    const int64_t j = i % half;
    int64_t row = i / half;
    const int64_t h = row % heads;
    row /= heads;
    const int64_t t = row % tokens;
    const int64_t b = row / tokens;
    const T* x = src + b * s.batch + t * s.token + h * s.head;
    T* y = dst + b * d.batch + t * d.token + h * d.head;
    const T* c = cos + t * cs;
    const T* sn = sin + t * cs;
    const float x1 = load(x[j]);
    const float x2 = load(x[j + half]);
    const float a1 = rnd<T>(__fmul_rn(x1, load(c[j])));
    const float a2 = rnd<T>(__fmul_rn(x2, load(c[j + half])));
    const float b1 = rnd<T>(__fmul_rn(x2, load(sn[j])));
    const float b2 = rnd<T>(__fmul_rn(x1, load(sn[j + half])));
    y[j] = store<T>(__fsub_rn(a1, b1));
    y[j + half] = store<T>(__fadd_rn(a2, b2));
  }
}

// -- host side -------------------------------------------------------------------------------

void check_count(const char* name, int64_t v) {
  if (v < 0) invalid(name, "got " + std::to_string(v) + "; must be >= 0");
  if (v > INT32_MAX) invalid(name, "got " + std::to_string(v) + "; at most 2147483647 is supported");
}

void check_stride(const char* name, int64_t v) {
  if (v < 0 || v > (int64_t{1} << 40))
    invalid(name, "got " + std::to_string(v) + "; strides (in elements) must be in [0, 2^40]");
}

// The bytes from the first element of an array of `dims` sizes (each > 0) and element strides
// to the end of its last element; ConfigError(argument) when that passes 2^63.
int64_t span_bytes(const char* argument, const int64_t* sizes, const int64_t* strides, int dims, int64_t elem) {
  int64_t last = 0, part = 0, bytes = 0;
  bool over = false;
  for (int k = 0; k < dims && !over; ++k)
    over = __builtin_mul_overflow(sizes[k] - 1, strides[k], &part) || __builtin_add_overflow(last, part, &last);
  if (over || __builtin_add_overflow(last, 1, &last) || __builtin_mul_overflow(last, elem, &bytes))
    invalid(argument, "the array these sizes and strides describe would span more than 2^63 bytes");
  return bytes;
}

unsigned blocks_for(int64_t work) {
  int64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

}  // namespace

void gelu_new_inplace(void* x, int64_t n, int dtype, int cube, cudaStream_t stream, int device) {
  const int64_t elem = dtype_size(dtype);  // ConfigError("dtype") outside DType
  if (n < 0) invalid("n", "got " + std::to_string(n) + "; the element count must be >= 0");
  if (n > (int64_t{1} << 40)) invalid("n", "got " + std::to_string(n) + "; at most 2^40 elements are supported");
  if (cube < 0 || cube > 2)
    invalid("cube", "got " + std::to_string(cube) + "; valid: 0 (each product), 1 (float), 2 (powf)");
  if (n == 0) return;
  check_pointer("x", x, elem);
  const float c_cube = static_cast<float>(0.044715);
  const float c_tanh = static_cast<float>(std::sqrt(2.0 / 3.14159265358979323846));  // math.sqrt(2 / math.pi)
  CurrentDeviceScope scoped(device);
  detail::with_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    gelu_new_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<T*>(x), n, static_cast<CubeRounding>(cube),
                                                                 c_cube, c_tanh);
  });
  INFERCTX_CUDA(cudaGetLastError(), scoped.device());
}

void silu_mul_inplace(void* gate, const void* up, int64_t rows, int64_t cols, int64_t ld_gate, int64_t ld_up,
                      int dtype, cudaStream_t stream, int device) {
  const int64_t elem = dtype_size(dtype);  // ConfigError("dtype") outside DType
  check_count("rows", rows);
  check_count("cols", cols);
  check_stride("ld_gate", ld_gate);
  check_stride("ld_up", ld_up);
  if (rows == 0 || cols == 0) return;
  if (rows > 1 && ld_gate < cols)
    invalid("ld_gate", "got " + std::to_string(ld_gate) + "; a row stride must be >= cols (" + std::to_string(cols) + ")");
  if (rows > 1 && ld_up < cols)
    invalid("ld_up", "got " + std::to_string(ld_up) + "; a row stride must be >= cols (" + std::to_string(cols) + ")");
  check_pointer("gate", gate, elem);
  check_pointer("up", up, elem);
  const int64_t sizes[2] = {rows, cols};
  const int64_t gs[2] = {ld_gate, 1};
  const int64_t us[2] = {ld_up, 1};
  if (detail::overlaps(gate, span_bytes("ld_gate", sizes, gs, 2, elem), up, span_bytes("ld_up", sizes, us, 2, elem))) {
    // Interleaved rows of one matrix (gate = m[:, :cols], up = m[:, cols:]) share no element:
    // the same row stride, and up's column offset within a row in [cols, ld - cols].
    const int64_t diff = static_cast<int64_t>(address(up)) - static_cast<int64_t>(address(gate));
    const int64_t offset = diff / elem;
    bool disjoint = ld_gate == ld_up && ld_gate >= 2 * cols && diff % elem == 0;
    if (disjoint) {
      const int64_t column = ((offset % ld_gate) + ld_gate) % ld_gate;
      disjoint = column >= cols && column <= ld_gate - cols;
    }
    if (!disjoint) invalid("up", "shares elements with gate; pass separate columns or arrays");
  }
  CurrentDeviceScope scoped(device);
  const int64_t total = rows * cols;
  detail::with_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    silu_mul_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(static_cast<T*>(gate), static_cast<const T*>(up),
                                                                     cols, total, ld_gate, ld_up);
  });
  INFERCTX_CUDA(cudaGetLastError(), scoped.device());
}

void rope_apply(const void* src, void* dst, const void* cos, const void* sin, int64_t batch, int64_t tokens,
                int64_t heads, int64_t head_dim, const int64_t src_strides[3], const int64_t dst_strides[3],
                int64_t cs_token_stride, int dtype, cudaStream_t stream, int device) {
  const int64_t elem = dtype_size(dtype);  // ConfigError("dtype") outside DType
  check_count("batch", batch);
  check_count("tokens", tokens);
  check_count("heads", heads);
  check_count("head_dim", head_dim);
  if (head_dim % 2 != 0) invalid("head_dim", "got " + std::to_string(head_dim) + "; must be even");
  static const char* const kSrc[3] = {"src_strides[0]", "src_strides[1]", "src_strides[2]"};
  static const char* const kDst[3] = {"dst_strides[0]", "dst_strides[1]", "dst_strides[2]"};
  for (int k = 0; k < 3; ++k) {
    check_stride(kSrc[k], src_strides[k]);
    check_stride(kDst[k], dst_strides[k]);
  }
  check_stride("cs_token_stride", cs_token_stride);
  const int64_t half = head_dim / 2;
  int64_t rows = 0;
  if (__builtin_mul_overflow(batch, tokens, &rows) || __builtin_mul_overflow(rows, heads, &rows) || rows > INT32_MAX ||
      rows * half > (int64_t{1} << 40))
    invalid("batch", "batch * tokens * heads * head_dim is too large for one call");
  if (rows == 0 || half == 0) return;
  check_pointer("src", src, elem);
  check_pointer("dst", dst, elem);
  check_pointer("cos", cos, elem);
  check_pointer("sin", sin, elem);
  const int64_t sizes[4] = {batch, tokens, heads, head_dim};
  const int64_t ss[4] = {src_strides[0], src_strides[1], src_strides[2], 1};
  const int64_t ds[4] = {dst_strides[0], dst_strides[1], dst_strides[2], 1};
  const int64_t table_sizes[2] = {tokens, head_dim};
  const int64_t table_strides[2] = {cs_token_stride, 1};
  const int64_t out = span_bytes("dst_strides", sizes, ds, 4, elem);
  const int64_t table = span_bytes("cs_token_stride", table_sizes, table_strides, 2, elem);
  // Two threads writing one element of dst would leave either's value there.
  if (!detail::elements_distinct(sizes, ds, 4))
    invalid("dst_strides", "got (" + std::to_string(dst_strides[0]) + ", " + std::to_string(dst_strides[1]) + ", " +
                               std::to_string(dst_strides[2]) + ") for dst [" + std::to_string(batch) + ", " +
                               std::to_string(tokens) + ", " + std::to_string(heads) + ", " +
                               std::to_string(head_dim) + "]: two of its rows would share elements; give each " +
                               "(batch, token, head) row head_dim elements of its own");
  if (detail::overlaps(dst, out, src, span_bytes("src_strides", sizes, ss, 4, elem)))
    invalid("dst", "overlaps src; pass a separate array");
  if (detail::overlaps(dst, out, cos, table) || detail::overlaps(dst, out, sin, table))
    invalid("dst", "overlaps cos or sin; pass a separate array");
  CurrentDeviceScope scoped(device);
  const int64_t total = rows * half;
  const RopeStrides s{src_strides[0], src_strides[1], src_strides[2]};
  const RopeStrides d{dst_strides[0], dst_strides[1], dst_strides[2]};
  detail::with_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    rope_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
        static_cast<const T*>(src), static_cast<T*>(dst), static_cast<const T*>(cos), static_cast<const T*>(sin),
        tokens, heads, half, total, s, d, cs_token_stride);
  });
  INFERCTX_CUDA(cudaGetLastError(), scoped.device());
}

}  // namespace inferctx

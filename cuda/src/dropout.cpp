// Dropout's host side (dropout.hpp): the argument checks, the keep threshold and the scale of p,
// the mask sizes, and the values of p that need no kernel (a copy or a fill). The kernels and
// their launchers are in dropout_kernels.cu.
#include "inferctx/dropout.hpp"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "inferctx/cuda_check.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/graph_rng.hpp"
#include "inferctx/plan.hpp"
#include "array_checks.hpp"
#include "dropout_detail.hpp"

namespace inferctx {

using detail::check_pointer;
using detail::invalid;
using detail::overlaps;

namespace {

std::string p_text(double p) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", p);
  return buf;
}

void check_p(double p) {
  if (std::isnan(p) || p < 0.0 || p > 1.0)
    invalid("p", "got " + p_text(p) + "; the drop probability must be in [0, 1]");
}

void check_mask_mode(int mask_mode) {
  if (mask_mode != static_cast<int>(MaskMode::None) && mask_mode != static_cast<int>(MaskMode::Bytes) &&
      mask_mode != static_cast<int>(MaskMode::Bits))
    invalid("mask_mode", "got code " + std::to_string(mask_mode) + "; valid: 0 (none), 1 (bytes), 2 (bits)");
}

void check_n(int64_t n, int64_t elem_bytes) {
  if (n < 0) invalid("n", "got " + std::to_string(n) + "; the element count must be >= 0");
  if (n > INT64_MAX / 16 / elem_bytes)
    invalid("n", "got " + std::to_string(n) + "; the byte size of the array does not fit in 64 bits");
}

// curand's uniform float of a 32-bit output r: fl32(fl32(r) * 2^-32 + 2^-33). Formed in double,
// where the sum is exact (at most 34 significant bits), then rounded once to float: the same
// value as the float operations, whatever precision the host evaluates float expressions in.
float curand_uniform_of(uint32_t r) {
  const double scaled = static_cast<double>(static_cast<float>(r)) * 0x1p-32;
  return static_cast<float>(scaled + 0x1p-33);
}

// The input and output of a call on `bytes` > 0 bytes of elem-byte elements: both aligned, and
// the output either the input itself (in place) or apart from it.
void check_in_out(const char* in_name, const void* in, const char* out_name, const void* out, int64_t bytes,
                  int64_t elem) {
  check_pointer(in_name, in, elem);
  check_pointer(out_name, out, elem);
  if (in != out && overlaps(in, bytes, out, bytes))
    invalid(out_name, std::string("partly overlaps ") + in_name + "; pass " + in_name +
                          " itself (in place) or a separate array");
}

// The mask of p == 0: every element kept. Bits: n / 8 bytes of ones, a partial byte, then zero
// bytes up to the end of the last word (bit i of the little-endian words is bit i % 8 of byte i / 8).
void fill_mask_all_kept(void* mask, int64_t n, MaskMode mode, cudaStream_t stream, int device) {
  auto* bytes = static_cast<unsigned char*>(mask);
  if (mode == MaskMode::Bytes) {
    INFERCTX_CUDA(cudaMemsetAsync(bytes, 1, static_cast<size_t>(n), stream), device);
  } else if (mode == MaskMode::Bits) {
    const int64_t total = dropout_mask_bytes(n, static_cast<int>(mode));
    int64_t done = n / 8;
    if (done > 0) INFERCTX_CUDA(cudaMemsetAsync(bytes, 0xff, static_cast<size_t>(done), stream), device);
    if (n % 8 != 0) {
      INFERCTX_CUDA(cudaMemsetAsync(bytes + done, (1 << (n % 8)) - 1, 1, stream), device);
      ++done;
    }
    if (total > done) INFERCTX_CUDA(cudaMemsetAsync(bytes + done, 0, static_cast<size_t>(total - done), stream), device);
  }
}

}  // namespace

int64_t dropout_mask_elements(int64_t n, int mask_mode) {
  check_mask_mode(mask_mode);
  if (n < 0) invalid("n", "got " + std::to_string(n) + "; the element count must be >= 0");
  switch (static_cast<MaskMode>(mask_mode)) {
    case MaskMode::Bytes: return n;
    case MaskMode::Bits: return n / 32 + (n % 32 != 0 ? 1 : 0);
    default: return 0;
  }
}

int64_t dropout_mask_bytes(int64_t n, int mask_mode) {
  const int64_t elements = dropout_mask_elements(n, mask_mode);
  return mask_mode == static_cast<int>(MaskMode::Bits) ? elements * 4 : elements;
}

float dropout_scale(double p) {
  check_p(p);
  if (p == 1.0) return 0.0f;
  return static_cast<float>(1.0 / (1.0 - p));
}

uint64_t dropout_keep_threshold(double p_in) {
  check_p(p_in);
  const float p = static_cast<float>(p_in);
  // Smallest r in [0, 2^32] with uniform(r) > p, taking uniform(2^32) as +infinity.
  uint64_t lo = 0, hi = uint64_t{1} << 32;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (curand_uniform_of(static_cast<uint32_t>(mid)) > p) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

void dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, double p, int mask_mode,
                     uint64_t seed, uint64_t offset, cudaStream_t stream, int device, int max_blocks) {
  dropout_forward(x, y, mask, n, dtype, p, mask_mode, PhiloxSource::host(seed, offset), stream, device, max_blocks);
}

namespace {

// The checks that do not depend on where the Philox state comes from (n, dtype, p, mask_mode,
// pointers, overlaps).
void check_forward(const void* x, const void* y, const void* mask, int64_t n, int dtype, double p, int mask_mode) {
  const int64_t elem = dtype_size(dtype);
  check_n(n, elem);
  check_mask_mode(mask_mode);
  check_p(p);
  if (n == 0) return;
  const int64_t bytes = n * elem;
  check_in_out("x", x, "y", y, bytes, elem);
  const MaskMode mode = static_cast<MaskMode>(mask_mode);
  if (mode != MaskMode::None) {
    const int64_t mask_bytes = dropout_mask_bytes(n, mask_mode);
    check_pointer("mask", mask, mode == MaskMode::Bits ? 4 : 1);
    if (overlaps(mask, mask_bytes, x, bytes) || overlaps(mask, mask_bytes, y, bytes))
      invalid("mask", "overlaps x or y; the mask needs its own " + std::to_string(mask_bytes) + " bytes");
  }
}

// dropout_forward once check_forward has passed.
void forward_checked(const void* x, void* y, void* mask, int64_t n, int dtype, double p, int mask_mode,
                     const PhiloxSource& source, cudaStream_t stream, int device, int max_blocks) {
  const int64_t elem = dtype_size(dtype);
  if (!source.captured && source.offset % 4 != 0)
    invalid("offset", "got " + std::to_string(source.offset) +
                          "; it must be a multiple of 4 (one Philox counter gives 4 values; take it from "
                          "increment_offset)");
  if (source.captured) {
    const GraphPhilox& g = source.graph;
    if (g.header == nullptr || g.slot == nullptr || g.uid == 0 || g.site >= kGraphSites || g.step == 0 ||
        g.step % 4 != 0 || g.step > kGraphMaxStep)
      invalid("site", "is not a call site taken by GraphRng::capture (null state, uid 0, site past 2^28 or a step "
                      "that is not a multiple of 4 in [4, 2^62])");
    if (n > kGraphMaxElements)
      invalid("n", "got " + std::to_string(n) + "; a call captured into a CUDA graph draws for at most 2^38 elements");
  }
  const MaskMode mode = static_cast<MaskMode>(mask_mode);
  if (n == 0) return;
  const int64_t bytes = n * elem;
  const int64_t mask_bytes = dropout_mask_bytes(n, mask_mode);

  CurrentDeviceScope scoped(device);
  const int dev = scoped.device();
  // p rounded to float decides which elements are kept (the uniform is a float); a p that
  // rounds to 0 or 1 keeps every element or none.
  if (static_cast<float>(p) == 0.0f) {
    if (x != y)
      INFERCTX_CUDA(cudaMemcpyAsync(y, x, static_cast<size_t>(bytes), cudaMemcpyDefault, stream), dev);
    fill_mask_all_kept(mask, n, mode, stream, dev);
    return;
  }
  if (static_cast<float>(p) == 1.0f) {
    INFERCTX_CUDA(cudaMemsetAsync(y, 0, static_cast<size_t>(bytes), stream), dev);
    if (mode != MaskMode::None) INFERCTX_CUDA(cudaMemsetAsync(mask, 0, static_cast<size_t>(mask_bytes), stream), dev);
    return;
  }

  detail::launch_dropout_forward(x, y, mask, n, dtype, mode, static_cast<uint32_t>(dropout_keep_threshold(p)),
                                 dropout_scale(p), source, stream, dev, max_blocks);
}

}  // namespace

void dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, double p, int mask_mode,
                     const PhiloxSource& source, cudaStream_t stream, int device, int max_blocks) {
  check_forward(x, y, mask, n, dtype, p, mask_mode);
  forward_checked(x, y, mask, n, dtype, p, mask_mode, source, stream, device, max_blocks);
}

void dropout_forward(const void* x, void* y, void* mask, int64_t n, int dtype, double p, int mask_mode,
                     GraphRng& rng, cudaStream_t stream, int device, int max_blocks) {
  check_forward(x, y, mask, n, dtype, p, mask_mode);  // a refused call takes no offset or site
  if (n > kGraphMaxElements) {  // the limit of a captured draw, checked before a site is taken
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    const cudaError_t status = cudaStreamIsCapturing(stream, &capture);
    if (status != cudaSuccess) cudaGetLastError();  // left to the draw, which reports it
    if (status == cudaSuccess && capture != cudaStreamCaptureStatusNone)
      invalid("n", "got " + std::to_string(n) + "; a call captured into a CUDA graph draws for at most 2^38 elements");
  }
  forward_checked(x, y, mask, n, dtype, p, mask_mode, rng.draw(stream, 4), stream, device, max_blocks);
}

void dropout_apply_mask(const void* grad, const void* mask, void* out, int64_t n, int dtype, double p,
                        int mask_mode, cudaStream_t stream, int device, int max_blocks) {
  const int64_t elem = dtype_size(dtype);
  check_n(n, elem);
  check_mask_mode(mask_mode);
  if (mask_mode == static_cast<int>(MaskMode::None))
    invalid("mask_mode", "got 0 (none); apply_mask needs the mask of the forward call: 1 (bytes) or 2 (bits)");
  check_p(p);
  const MaskMode mode = static_cast<MaskMode>(mask_mode);
  if (n == 0) return;
  const int64_t bytes = n * elem;
  check_in_out("grad", grad, "out", out, bytes, elem);
  const int64_t mask_bytes = dropout_mask_bytes(n, mask_mode);
  check_pointer("mask", mask, mode == MaskMode::Bits ? 4 : 1);
  if (overlaps(mask, mask_bytes, out, bytes))
    invalid("mask", "overlaps out; the mask needs its own " + std::to_string(mask_bytes) + " bytes");

  CurrentDeviceScope scoped(device);
  const int dev = scoped.device();
  if (p == 1.0) {
    INFERCTX_CUDA(cudaMemsetAsync(out, 0, static_cast<size_t>(bytes), stream), dev);
    return;
  }
  detail::launch_dropout_apply(grad, mask, out, n, dtype, mode, dropout_scale(p), stream, dev, max_blocks);
}

}  // namespace inferctx

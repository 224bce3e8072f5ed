// Dropout kernels against a host reference written from the definition in DESIGN.md, bit for bit.
// The host reference (Philox4x32-10, curand's uniform, the scale and the dtype rounding) is
// itself checked against the Random123 known answers and against cuRAND's curand_kernel.h code,
// both run on the host (its functions are host-callable with QUALIFIERS redefined) and on the
// device. Cases named "host: ..." need no GPU and run everywhere; "gpu: ..." cases need a device
// (without one the binary runs the former and exits 77).
#define QUALIFIERS static __forceinline__ __host__ __device__
#include <curand_kernel.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.hpp"
#include "inferctx/cuda_check.hpp"
#include "inferctx/dropout.hpp"
#include "inferctx/errors.hpp"
#include "inferctx/plan.hpp"

using namespace inferctx;

namespace {

constexpr int F32 = static_cast<int>(DType::Float32);
constexpr int F16 = static_cast<int>(DType::Float16);
constexpr int BF16 = static_cast<int>(DType::BFloat16);
constexpr int kNone = static_cast<int>(MaskMode::None);
constexpr int kBytes = static_cast<int>(MaskMode::Bytes);
constexpr int kBits = static_cast<int>(MaskMode::Bits);
const char* kDTypeNames[] = {"float32", "float16", "bfloat16"};
const char* kModeNames[] = {"none", "bytes", "bits"};

using check::rng;

// ---- host reference ----------------------------------------------------------------------------

struct Block {
  uint32_t v[4];
};

// Philox4x32-10: ten rounds of (hi(M0*x) and lo(M1*z) products, xor with the other words and the
// key), the key bumped by the Weyl constants between rounds.
Block philox_ref(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t a = uint64_t{0xD2511F53u} * c0;
    const uint64_t b = uint64_t{0xCD9E8D57u} * c2;
    const uint32_t n0 = static_cast<uint32_t>(b >> 32) ^ c1 ^ k0;
    const uint32_t n1 = static_cast<uint32_t>(b);
    const uint32_t n2 = static_cast<uint32_t>(a >> 32) ^ c3 ^ k1;
    const uint32_t n3 = static_cast<uint32_t>(a);
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
  }
  return {{c0, c1, c2, c3}};
}

// The first block of curand_init(seed, subsequence, offset) for offset % 4 == 0.
Block stream_block(uint64_t seed, uint64_t subsequence, uint64_t offset) {
  const uint64_t q = offset / 4;
  return philox_ref(static_cast<uint32_t>(q), static_cast<uint32_t>(q >> 32), static_cast<uint32_t>(subsequence),
                    static_cast<uint32_t>(subsequence >> 32), static_cast<uint32_t>(seed),
                    static_cast<uint32_t>(seed >> 32));
}

// _curand_uniform in float arithmetic (volatile: each step rounded to float as on the device).
float uniform_ref(uint32_t r) {
  volatile float f = static_cast<float>(r);
  volatile float prod = f * 2.3283064365386963e-10f;
  volatile float sum = prod + 1.16415321826934814e-10f;
  return sum;
}

bool keep_ref(uint64_t seed, uint64_t offset, uint64_t i, float p) {
  return uniform_ref(stream_block(seed, i / 4, offset).v[i % 4]) > p;
}

std::vector<uint8_t> keep_vector(uint64_t seed, uint64_t offset, int64_t n, float p) {
  std::vector<uint8_t> keep(static_cast<size_t>(n));
  for (int64_t b = 0; b * 4 < n; ++b) {
    const Block blk = stream_block(seed, static_cast<uint64_t>(b), offset);
    for (int e = 0; e < 4 && b * 4 + e < n; ++e) keep[static_cast<size_t>(b * 4 + e)] = uniform_ref(blk.v[e]) > p;
  }
  return keep;
}

float scale_ref(float p) { return p == 1.0f ? 0.0f : static_cast<float>(1.0 / (1.0 - static_cast<double>(p))); }

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;  // mant * 2^-24, exact
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// Round to nearest even; NaN maps to a quiet NaN (payloads are not compared).
uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {                          // below 2^-14: subnormal (or zero) half
    const float q = std::fabs(f) * 16777216.0f;   // in units of 2^-24, exact
    return sign | static_cast<uint16_t>(std::nearbyint(q));
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu);
  const uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Host arrays hold raw element bits: uint32 for fp32, uint16 for the 16-bit types.
float elem_to_float(int dtype, uint32_t bits) {
  if (dtype == F32) return bits_float(bits);
  if (dtype == F16) return half_to_float(static_cast<uint16_t>(bits));
  return bf16_to_float(static_cast<uint16_t>(bits));
}

uint32_t float_to_elem(int dtype, float v) {
  if (dtype == F32) return float_bits(v);
  if (dtype == F16) return float_to_half(v);
  return float_to_bf16(v);
}

bool elem_is_nan(int dtype, uint32_t bits) { return std::isnan(elem_to_float(dtype, bits)); }

// y of one element: to_dtype(fl32(x * scale)) where kept, +0 elsewhere.
uint32_t expected_elem(int dtype, uint32_t x_bits, bool keep, float scale) {
  if (!keep) return 0;
  volatile float prod = elem_to_float(dtype, x_bits) * scale;
  return float_to_elem(dtype, prod);
}

// Random elements: every bit pattern for 16-bit types (NaN, inf, subnormals included); for
// fp32 mostly values in [-8, 8] and some raw patterns.
std::vector<uint32_t> random_elements(int dtype, int64_t n) {
  std::vector<uint32_t> v(static_cast<size_t>(n));
  std::uniform_real_distribution<float> val(-8.0f, 8.0f);
  for (auto& e : v) {
    if (dtype == F32) {
      e = (rng()() % 16 == 0) ? static_cast<uint32_t>(rng()()) : float_bits(val(rng()));
    } else {
      e = static_cast<uint32_t>(rng()() & 0xffffu);
    }
  }
  return v;
}

std::vector<uint8_t> to_bytes(int dtype, const std::vector<uint32_t>& elems) {
  std::vector<uint8_t> out(elems.size() * static_cast<size_t>(dtype_size(dtype)));
  for (size_t i = 0; i < elems.size(); ++i) {
    if (dtype == F32) {
      std::memcpy(&out[i * 4], &elems[i], 4);
    } else {
      const uint16_t h = static_cast<uint16_t>(elems[i]);
      std::memcpy(&out[i * 2], &h, 2);
    }
  }
  return out;
}

uint32_t elem_at(int dtype, const uint8_t* bytes, int64_t i) {
  if (dtype == F32) {
    uint32_t u;
    std::memcpy(&u, bytes + i * 4, 4);
    return u;
  }
  uint16_t h;
  std::memcpy(&h, bytes + i * 2, 2);
  return h;
}

std::vector<uint32_t> pack_bits(const std::vector<uint8_t>& keep) {
  std::vector<uint32_t> words((keep.size() + 31) / 32, 0u);
  for (size_t i = 0; i < keep.size(); ++i)
    if (keep[i]) words[i / 32] |= 1u << (i % 32);
  return words;
}

// ---- device helpers ----------------------------------------------------------------------------

struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) : size(bytes) {
    INFERCTX_CUDA(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes), -1);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  uint8_t* bytes() const { return static_cast<uint8_t*>(ptr); }
  void* ptr = nullptr;
  size_t size = 0;
};

void upload(void* dst, const std::vector<uint8_t>& src) {
  if (!src.empty()) INFERCTX_CUDA(cudaMemcpy(dst, src.data(), src.size(), cudaMemcpyHostToDevice), -1);
}

std::vector<uint8_t> download(const void* src, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  if (bytes) INFERCTX_CUDA(cudaMemcpy(out.data(), src, bytes, cudaMemcpyDeviceToHost), -1);
  return out;
}

constexpr size_t kGuard = 64;        // bytes after each output that must stay untouched
constexpr uint8_t kYFill = 0x5a;     // pre-fill of y and its guard
constexpr uint8_t kMaskFill = 0xa5;  // pre-fill of the mask and its guard

struct Outcome {
  std::vector<uint8_t> y;     // n elements
  std::vector<uint8_t> mask;  // dropout_mask_bytes
  bool guards_intact = true;
};

// Runs dropout_forward on fresh buffers; `shift_*` moves a pointer by that many bytes from a
// 256-byte aligned allocation (to take the scalar path). in_place: y is x.
Outcome run_forward(int dtype, const std::vector<uint32_t>& x, int mode, float p, uint64_t seed, uint64_t offset,
                    size_t shift_x = 0, size_t shift_y = 0, size_t shift_mask = 0, bool in_place = false,
                    int max_blocks = 0, cudaStream_t stream = nullptr) {
  const int64_t n = static_cast<int64_t>(x.size());
  const size_t bytes = x.size() * static_cast<size_t>(dtype_size(dtype));
  const size_t mask_bytes = static_cast<size_t>(dropout_mask_bytes(n, mode));
  DeviceBuffer xbuf(bytes + 256 + kGuard), ybuf(bytes + 256 + kGuard), mbuf(mask_bytes + 256 + kGuard);
  uint8_t* xp = xbuf.bytes() + shift_x;
  uint8_t* yp = in_place ? xp : ybuf.bytes() + shift_y;
  uint8_t* mp = mbuf.bytes() + shift_mask;
  INFERCTX_CUDA(cudaMemset(xbuf.ptr, kYFill, xbuf.size), -1);
  INFERCTX_CUDA(cudaMemset(ybuf.ptr, kYFill, ybuf.size), -1);
  INFERCTX_CUDA(cudaMemset(mbuf.ptr, kMaskFill, mbuf.size), -1);
  upload(xp, to_bytes(dtype, x));
  // The memsets run on the legacy stream and a pageable upload may return before its DMA lands;
  // a non-blocking `stream` is not ordered after either.
  INFERCTX_CUDA(cudaDeviceSynchronize(), -1);
  dropout_forward(xp, yp, mode == kNone ? nullptr : mp, n, dtype, p, mode, seed, offset, stream, -1, max_blocks);
  INFERCTX_CUDA(cudaStreamSynchronize(stream), -1);
  Outcome out;
  const auto y_all = download(yp, bytes + kGuard);
  out.y.assign(y_all.begin(), y_all.begin() + static_cast<std::ptrdiff_t>(bytes));
  for (size_t i = bytes; i < y_all.size(); ++i) out.guards_intact &= y_all[i] == kYFill;
  const auto m_all = download(mp, mask_bytes + kGuard);
  out.mask.assign(m_all.begin(), m_all.begin() + static_cast<std::ptrdiff_t>(mask_bytes));
  for (size_t i = mask_bytes; i < m_all.size(); ++i) out.guards_intact &= m_all[i] == kMaskFill;
  return out;
}

// Compares an outcome with the reference; prints the first mismatches. Returns true when equal.
bool matches_reference(const char* what, int dtype, int mode, const std::vector<uint32_t>& x,
                       const std::vector<uint8_t>& keep, float p, const Outcome& out) {
  const float scale = scale_ref(p);
  int64_t bad_y = 0, bad_mask = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const uint32_t want = expected_elem(dtype, x[i], keep[i] != 0, scale);
    const uint32_t got = elem_at(dtype, out.y.data(), static_cast<int64_t>(i));
    const bool same = got == want || (elem_is_nan(dtype, got) && elem_is_nan(dtype, want));
    if (!same && bad_y++ < 3)
      std::printf("  %s: y[%zu] = 0x%x, expected 0x%x (x = 0x%x, keep %d)\n", what, i, got, want, x[i], keep[i]);
  }
  if (mode == kBytes) {
    for (size_t i = 0; i < keep.size(); ++i)
      if (out.mask[i] != keep[i] && bad_mask++ < 3)
        std::printf("  %s: mask byte %zu = %d, expected %d\n", what, i, out.mask[i], keep[i]);
  } else if (mode == kBits) {
    const auto words = pack_bits(keep);
    for (size_t w = 0; w < words.size(); ++w) {
      uint32_t got;
      std::memcpy(&got, &out.mask[w * 4], 4);
      if (got != words[w] && bad_mask++ < 3)
        std::printf("  %s: mask word %zu = 0x%08x, expected 0x%08x\n", what, w, got, words[w]);
    }
  }
  if (!out.guards_intact) std::printf("  %s: bytes past the end of y or the mask were written\n", what);
  if (bad_y || bad_mask)
    std::printf("  %s: %lld y and %lld mask mismatches\n", what, static_cast<long long>(bad_y),
                static_cast<long long>(bad_mask));
  return bad_y == 0 && bad_mask == 0 && out.guards_intact;
}

bool gpu_has_free_bytes(size_t bytes) {
  size_t free_b = 0, total_b = 0;
  INFERCTX_CUDA(cudaMemGetInfo(&free_b, &total_b), -1);
  return free_b > bytes;
}

// ---- device-side definitions for cross-checks --------------------------------------------------

struct CurandCase {
  unsigned long long seed, subsequence, offset;
};

__global__ void curand_outputs(const CurandCase* cases, int count, uint4* raw, float4* uniforms) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  curandStatePhilox4_32_10_t s;
  curand_init(cases[i].seed, cases[i].subsequence, cases[i].offset, &s);
  raw[i] = curand4(&s);
  curand_init(cases[i].seed, cases[i].subsequence, cases[i].offset, &s);
  uniforms[i] = curand_uniform4(&s);
}

// DESIGN.md's definition, literally: element i kept iff output i % 4 of curand_uniform4 after
// curand_init(seed, i / 4, offset) is greater than p.
__global__ void curand_keep(unsigned long long seed, unsigned long long offset, float p, int64_t n, uint8_t* keep) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b * 4 >= n) return;
  curandStatePhilox4_32_10_t s;
  curand_init(seed, static_cast<unsigned long long>(b), offset, &s);
  const float4 u = curand_uniform4(&s);
  const float v[4] = {u.x, u.y, u.z, u.w};
  for (int e = 0; e < 4 && b * 4 + e < n; ++e) keep[b * 4 + e] = v[e] > p;
}

// Deterministic finite fp16 pattern of element i for the large-array case.
__host__ __device__ inline uint16_t pattern_half(uint64_t i) {
  uint64_t h = (i + 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
  h ^= h >> 31;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 29;
  const uint16_t sign = static_cast<uint16_t>(h & 0x8000u);
  return static_cast<uint16_t>(sign | ((h >> 16) % 0x7c00u));  // exponent < 31: finite
}

__global__ void fill_pattern_half(uint16_t* x, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    x[i] = pattern_half(static_cast<uint64_t>(i));
}

const CurandCase kCurandCases[] = {
    {0, 0, 0},
    {0x0123456789abcdefull, 5, 8},
    {0xffffffffffffffffull, 0xffffffffffffffffull, 0xfffffffffffffffcull},
    {42, 0, 4ull * ((1ull << 32) - 2)},
    {42, 1, 4ull * ((1ull << 32) - 1)},
    {42, 2, 4ull * (1ull << 32)},
    {42, (1ull << 32) - 1, 4},
    {42, 1ull << 32, 4},
    {42, 1ull << 33, 4ull * ((1ull << 32) + 1)},
    {0x9e3779b97f4a7c15ull, 123456789, 0x8000000000000000ull},
};

const uint64_t kOffsets[] = {0,
                             4,
                             4ull * ((1ull << 32) - 2),
                             4ull * ((1ull << 32) - 1),
                             4ull * (1ull << 32),
                             4ull * ((1ull << 32) + 1),
                             0x8000000000000000ull,
                             0xfffffffffffffffcull};

const int64_t kSizes[] = {1, 2, 3, 4, 5, 31, 32, 33, 63, 1000, 1023, 1024, 1025, 2047, 3079, 4103, 32768, 65536 + 33, 1000003};

// ================================================================================================
// host cases

TEST_CASE("host: Philox4x32-10 matches the Random123 known-answer vectors") {
  const Block a = philox_ref(0, 0, 0, 0, 0, 0);
  CHECK_EQ(a.v[0], 0x6627e8d5u);
  CHECK_EQ(a.v[1], 0xe169c58du);
  CHECK_EQ(a.v[2], 0xbc57ac4cu);
  CHECK_EQ(a.v[3], 0x9b00dbd8u);
  const Block b = philox_ref(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu);
  CHECK_EQ(b.v[0], 0x408f276du);
  CHECK_EQ(b.v[1], 0x41c83b0eu);
  CHECK_EQ(b.v[2], 0xa20bc7c6u);
  CHECK_EQ(b.v[3], 0x6d5451fdu);
  const Block c = philox_ref(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  CHECK_EQ(c.v[0], 0xd16cfe09u);
  CHECK_EQ(c.v[1], 0x94fdccebu);
  CHECK_EQ(c.v[2], 0x5001e420u);
  CHECK_EQ(c.v[3], 0x24126ea1u);
}

TEST_CASE("host: the reference equals curand_init + curand4 / curand_uniform4 run on the host") {
  for (const CurandCase& k : kCurandCases) {
    if (k.offset % 4 != 0) continue;
    curandStatePhilox4_32_10_t s;
    curand_init(k.seed, k.subsequence, k.offset, &s);
    const uint4 raw = curand4(&s);
    curand_init(k.seed, k.subsequence, k.offset, &s);
    const float4 u = curand_uniform4(&s);
    const Block blk = stream_block(k.seed, k.subsequence, k.offset);
    CHECK_EQ(raw.x, blk.v[0]);
    CHECK_EQ(raw.y, blk.v[1]);
    CHECK_EQ(raw.z, blk.v[2]);
    CHECK_EQ(raw.w, blk.v[3]);
    CHECK_EQ(float_bits(u.x), float_bits(uniform_ref(blk.v[0])));
    CHECK_EQ(float_bits(u.y), float_bits(uniform_ref(blk.v[1])));
    CHECK_EQ(float_bits(u.z), float_bits(uniform_ref(blk.v[2])));
    CHECK_EQ(float_bits(u.w), float_bits(uniform_ref(blk.v[3])));
  }
}

TEST_CASE("host: the keep threshold partitions outputs exactly as curand's uniform > p") {
  // By hand: u(2^31 + 128) rounds to 0.5 (tie to even), u(2^31 + 129) is the first above 0.5;
  // only u == 1.0 (r >= 2^32 - 128) exceeds the largest float below 1.
  CHECK_EQ(dropout_keep_threshold(0.0f), uint64_t{0});
  CHECK_EQ(dropout_keep_threshold(0.5f), (uint64_t{1} << 31) + 129);
  CHECK_EQ(dropout_keep_threshold(std::nextafter(1.0f, 0.0f)), (uint64_t{1} << 32) - 128);
  CHECK_EQ(dropout_keep_threshold(1.0f), uint64_t{1} << 32);
  CHECK_EQ(dropout_keep_threshold(1.16415321826934814e-10f), uint64_t{1});  // p = 2^-33
  const float ps[] = {1e-7f, 0.1f, 0.25f, 1.0f / 3.0f, 0.5f, 0.9f, 0.999f, std::nextafter(0.5f, 1.0f)};
  for (float p : ps) {
    const uint64_t t = dropout_keep_threshold(p);
    int bad = 0;
    for (int64_t d = -300; d <= 300; ++d) {
      const int64_t r = static_cast<int64_t>(t) + d;
      if (r < 0 || r > 0xffffffffll) continue;
      const bool above = _curand_uniform(static_cast<unsigned>(r)) > p;
      bad += above != (static_cast<uint64_t>(r) >= t);
    }
    for (int k = 0; k < 20000; ++k) {
      const uint32_t r = static_cast<uint32_t>(rng()());
      bad += (_curand_uniform(r) > p) != (r >= t);
    }
    CHECK_EQ(bad, 0);
  }
}

TEST_CASE("host: scale and mask sizes") {
  CHECK_EQ(float_bits(dropout_scale(0.0f)), float_bits(1.0f));
  CHECK_EQ(float_bits(dropout_scale(0.5f)), float_bits(2.0f));
  CHECK_EQ(float_bits(dropout_scale(0.1f)), float_bits(static_cast<float>(1.0 / (1.0 - static_cast<double>(0.1f)))));
  CHECK_EQ(float_bits(dropout_scale(1.0f)), float_bits(0.0f));
  // The scale is worked out from the double p, rounded once: for 0.9 that is 10.0f, where p
  // rounded to float first gives 9.999998f.
  CHECK_EQ(float_bits(dropout_scale(0.1)), float_bits(static_cast<float>(1.0 / (1.0 - 0.1))));
  CHECK_EQ(float_bits(dropout_scale(1.0 / 3.0)), float_bits(static_cast<float>(1.0 / (1.0 - 1.0 / 3.0))));
  CHECK_EQ(float_bits(dropout_scale(0.9)), float_bits(10.0f));
  CHECK_EQ(dropout_mask_bytes(0, kBits), 0);
  CHECK_EQ(dropout_mask_bytes(1, kBits), 4);
  CHECK_EQ(dropout_mask_bytes(32, kBits), 4);
  CHECK_EQ(dropout_mask_bytes(33, kBits), 8);
  CHECK_EQ(dropout_mask_bytes((int64_t{1} << 32) + 1, kBits), (int64_t{1} << 29) + 4);
  CHECK_EQ(dropout_mask_bytes(33, kBytes), 33);
  CHECK_EQ(dropout_mask_bytes(33, kNone), 0);
  CHECK_EQ(dropout_mask_elements(33, kBits), 2);
  CHECK_EQ(dropout_mask_elements(33, kBytes), 33);
  CHECK_THROWS(ConfigError, dropout_mask_bytes(-1, kBits));
  CHECK_THROWS(ConfigError, dropout_mask_bytes(8, 3));
}

// Expects ConfigError naming `argument`.
template <typename F>
void expect_config_error(const char* argument, F&& call) {
  try {
    call();
    std::printf("  no ConfigError for %s\n", argument);
    ++check::failures();
  } catch (const ConfigError& e) {
    if (e.argument != argument) {
      std::printf("  ConfigError names '%s', expected '%s' (%s)\n", e.argument.c_str(), argument, e.what());
      ++check::failures();
    }
  }
}

TEST_CASE("host: forward arguments are checked before anything runs") {
  // Validation needs no device: these fake addresses are never touched.
  void* x = reinterpret_cast<void*>(0x100000);
  void* y = reinterpret_cast<void*>(0x200000);
  void* m = reinterpret_cast<void*>(0x300000);
  const int64_t n = 1000;
  const float nan = std::nanf("");
  expect_config_error("p", [&] { dropout_forward(x, y, m, n, F32, -0.1f, kBits, 1, 0, nullptr); });
  expect_config_error("p", [&] { dropout_forward(x, y, m, n, F32, 1.5f, kBits, 1, 0, nullptr); });
  expect_config_error("p", [&] { dropout_forward(x, y, m, n, F32, nan, kBits, 1, 0, nullptr); });
  expect_config_error("p", [&] { dropout_forward(x, y, m, 0, F32, nan, kBits, 1, 0, nullptr); });
  expect_config_error("dtype", [&] { dropout_forward(x, y, m, n, 3, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("mask_mode", [&] { dropout_forward(x, y, m, n, F32, 0.5f, 3, 1, 0, nullptr); });
  expect_config_error("mask_mode", [&] { dropout_forward(x, y, m, n, F32, 0.5f, -1, 1, 0, nullptr); });
  expect_config_error("n", [&] { dropout_forward(x, y, m, -1, F32, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("n", [&] { dropout_forward(x, y, m, INT64_MAX / 4, F32, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("offset", [&] { dropout_forward(x, y, m, n, F32, 0.5f, kBits, 1, 6, nullptr); });
  expect_config_error("x", [&] { dropout_forward(nullptr, y, m, n, F32, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("y", [&] { dropout_forward(x, nullptr, m, n, F32, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("mask", [&] { dropout_forward(x, y, nullptr, n, F32, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("mask", [&] { dropout_forward(x, y, nullptr, n, F32, 0.5f, kBytes, 1, 0, nullptr); });
  // Misaligned for the element type, partial overlaps.
  auto* xb = static_cast<uint8_t*>(x);
  expect_config_error("x", [&] { dropout_forward(xb + 2, y, m, n, F32, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("x", [&] { dropout_forward(xb + 1, y, m, n, F16, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("y", [&] { dropout_forward(x, static_cast<uint8_t*>(y) + 2, m, n, F32, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("mask", [&] { dropout_forward(x, y, static_cast<uint8_t*>(m) + 2, n, F32, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("y", [&] { dropout_forward(x, xb + 4, m, n, F32, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("mask", [&] { dropout_forward(x, y, xb + 400, n, F32, 0.5f, kBits, 1, 0, nullptr); });
  expect_config_error("mask", [&] { dropout_forward(x, y, static_cast<uint8_t*>(y) + 3996, n, F32, 0.5f, kBytes, 1, 0, nullptr); });
  // Nothing to do: n == 0 accepts null pointers; mask_mode none ignores the mask pointer.
  dropout_forward(nullptr, nullptr, nullptr, 0, F16, 0.5f, kBits, 1, 0, nullptr);
  dropout_forward(nullptr, nullptr, nullptr, 0, BF16, 1.0f, kNone, 1, 0, nullptr);
  // A ConfigError's message names the argument and the valid range.
  try {
    dropout_forward(x, y, m, n, F32, 2.0f, kBits, 1, 0, nullptr);
    CHECK(false);  // p = 2 must be refused
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("p: got 2") == 0);
    CHECK(std::string(e.what()).find("[0, 1]") != std::string::npos);
  }
}

TEST_CASE("host: apply_mask arguments are checked before anything runs") {
  void* g = reinterpret_cast<void*>(0x100000);
  void* o = reinterpret_cast<void*>(0x200000);
  void* m = reinterpret_cast<void*>(0x300000);
  const int64_t n = 1000;
  expect_config_error("mask_mode", [&] { dropout_apply_mask(g, m, o, n, F16, 0.5f, kNone, nullptr); });
  expect_config_error("mask_mode", [&] { dropout_apply_mask(g, m, o, n, F16, 0.5f, 7, nullptr); });
  expect_config_error("p", [&] { dropout_apply_mask(g, m, o, n, F16, std::nanf(""), kBits, nullptr); });
  expect_config_error("p", [&] { dropout_apply_mask(g, m, o, n, F16, -1.0f, kBits, nullptr); });
  expect_config_error("dtype", [&] { dropout_apply_mask(g, m, o, n, 9, 0.5f, kBits, nullptr); });
  expect_config_error("n", [&] { dropout_apply_mask(g, m, o, -5, F16, 0.5f, kBits, nullptr); });
  expect_config_error("grad", [&] { dropout_apply_mask(nullptr, m, o, n, F16, 0.5f, kBits, nullptr); });
  expect_config_error("out", [&] { dropout_apply_mask(g, m, nullptr, n, F16, 0.5f, kBits, nullptr); });
  expect_config_error("mask", [&] { dropout_apply_mask(g, nullptr, o, n, F16, 0.5f, kBytes, nullptr); });
  expect_config_error("mask", [&] { dropout_apply_mask(g, static_cast<uint8_t*>(m) + 1, o, n, F16, 0.5f, kBits, nullptr); });
  expect_config_error("out", [&] { dropout_apply_mask(g, m, static_cast<uint8_t*>(g) + 2, n, F16, 0.5f, kBits, nullptr); });
  expect_config_error("mask", [&] { dropout_apply_mask(g, static_cast<uint8_t*>(o) + 8, o, n, F16, 0.5f, kBits, nullptr); });
  dropout_apply_mask(nullptr, nullptr, nullptr, 0, F32, 0.5f, kBytes, nullptr);
}

// ================================================================================================
// GPU cases

TEST_CASE("gpu: device curand_init + curand4 / curand_uniform4 equal the host reference") {
  const int count = static_cast<int>(sizeof(kCurandCases) / sizeof(kCurandCases[0]));
  DeviceBuffer cases(sizeof(kCurandCases)), raw(count * sizeof(uint4)), uni(count * sizeof(float4));
  INFERCTX_CUDA(cudaMemcpy(cases.ptr, kCurandCases, sizeof(kCurandCases), cudaMemcpyHostToDevice), -1);
  curand_outputs<<<1, 64>>>(static_cast<CurandCase*>(cases.ptr), count, static_cast<uint4*>(raw.ptr),
                            static_cast<float4*>(uni.ptr));
  INFERCTX_CUDA(cudaGetLastError(), -1);
  std::vector<uint4> r(count);
  std::vector<float4> u(count);
  INFERCTX_CUDA(cudaMemcpy(r.data(), raw.ptr, raw.size, cudaMemcpyDeviceToHost), -1);
  INFERCTX_CUDA(cudaMemcpy(u.data(), uni.ptr, uni.size, cudaMemcpyDeviceToHost), -1);
  for (int i = 0; i < count; ++i) {
    const Block blk = stream_block(kCurandCases[i].seed, kCurandCases[i].subsequence, kCurandCases[i].offset);
    CHECK_EQ(r[i].x, blk.v[0]);
    CHECK_EQ(r[i].y, blk.v[1]);
    CHECK_EQ(r[i].z, blk.v[2]);
    CHECK_EQ(r[i].w, blk.v[3]);
    CHECK_EQ(float_bits(u[i].x), float_bits(uniform_ref(blk.v[0])));
    CHECK_EQ(float_bits(u[i].y), float_bits(uniform_ref(blk.v[1])));
    CHECK_EQ(float_bits(u[i].z), float_bits(uniform_ref(blk.v[2])));
    CHECK_EQ(float_bits(u[i].w), float_bits(uniform_ref(blk.v[3])));
  }
}

TEST_CASE("gpu: the bytes mask equals curand_init(seed, i/4, offset) + curand_uniform4 > p computed on the device") {
  const int64_t n = 100003;
  const float ps[] = {0.1f, 0.5f, 0.77f};
  int idx = 0;
  for (uint64_t offset : kOffsets) {
    const float p = ps[idx++ % 3];
    const uint64_t seed = 0x5eed0000ull + static_cast<uint64_t>(idx) * 0x100000001ull;
    DeviceBuffer keep(static_cast<size_t>(n));
    curand_keep<<<static_cast<unsigned>((n / 4 + 256) / 256), 256>>>(seed, offset, p, n, keep.bytes());
    INFERCTX_CUDA(cudaGetLastError(), -1);
    const auto want = download(keep.ptr, static_cast<size_t>(n));
    const std::vector<uint32_t> x(static_cast<size_t>(n), float_bits(1.0f));
    const Outcome out = run_forward(F32, x, kBytes, p, seed, offset);
    CHECK(out.mask == want);
    CHECK(want == keep_vector(seed, offset, n, p));
  }
}

TEST_CASE("gpu: forward equals the reference for every dtype, mask mode, odd sizes and counter-carrying offsets") {
  const float ps[] = {0.1f, 0.5f, 0.9f, 0.3f, 1e-6f, 0.999f};
  int combo = 0;
  for (int64_t n : kSizes) {
    for (int rep = 0; rep < 2; ++rep, ++combo) {
      const uint64_t offset = kOffsets[combo % 8];
      const float p = ps[combo % 6];
      const uint64_t seed = rng()();
      const auto keep = keep_vector(seed, offset, n, p);
      for (int dtype : {F32, F16, BF16}) {
        const auto x = random_elements(dtype, n);
        for (int mode : {kNone, kBytes, kBits}) {
          char what[160];
          std::snprintf(what, sizeof(what), "%s n=%lld mask=%s p=%g offset=0x%llx", kDTypeNames[dtype],
                        static_cast<long long>(n), kModeNames[mode], static_cast<double>(p),
                        static_cast<unsigned long long>(offset));
          const bool ok = matches_reference(what, dtype, mode, x, keep, p, run_forward(dtype, x, mode, p, seed, offset));
          CHECK(ok);
        }
      }
    }
  }
}

TEST_CASE("gpu: misaligned pointers take the scalar path with identical results") {
  for (int dtype : {F32, F16, BF16}) {
    const size_t e = static_cast<size_t>(dtype_size(dtype));
    for (int64_t n : {int64_t{1}, int64_t{33}, int64_t{1024}, int64_t{5000}, int64_t{70001}}) {
      const uint64_t seed = rng()();
      const uint64_t offset = 4ull * ((1ull << 32) - 1);
      const float p = 0.4f;
      const auto x = random_elements(dtype, n);
      const auto keep = keep_vector(seed, offset, n, p);
      for (int mode : {kBytes, kBits}) {
        const Outcome aligned = run_forward(dtype, x, mode, p, seed, offset);
        CHECK(matches_reference("aligned", dtype, mode, x, keep, p, aligned));
        const Outcome mx = run_forward(dtype, x, mode, p, seed, offset, e, 0, 0);
        CHECK(matches_reference("x shifted by one element", dtype, mode, x, keep, p, mx));
        const Outcome my = run_forward(dtype, x, mode, p, seed, offset, 0, 3 * e, 0);
        CHECK(matches_reference("y shifted by three elements", dtype, mode, x, keep, p, my));
        const Outcome both = run_forward(dtype, x, mode, p, seed, offset, e, e, 0);
        CHECK(matches_reference("x and y shifted by one element", dtype, mode, x, keep, p, both));
        if (mode == kBytes) {
          const Outcome mm = run_forward(dtype, x, mode, p, seed, offset, 0, 0, 1);
          CHECK(matches_reference("mask shifted by one byte", dtype, mode, x, keep, p, mm));
        }
      }
    }
  }
}

TEST_CASE("gpu: results do not depend on the launch shape, the stream or in-place use") {
  cudaStream_t stream = nullptr;
  INFERCTX_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), -1);
  const int64_t n = 1000003;
  for (int dtype : {F32, F16, BF16}) {
    const uint64_t seed = rng()();
    const uint64_t offset = 4ull * (1ull << 32);
    const float p = 0.25f;
    const auto x = random_elements(dtype, n);
    const auto keep = keep_vector(seed, offset, n, p);
    const Outcome base = run_forward(dtype, x, kBits, p, seed, offset);
    CHECK(matches_reference("default grid", dtype, kBits, x, keep, p, base));
    for (int blocks : {1, 2, 7, 1000}) {
      const Outcome o = run_forward(dtype, x, kBits, p, seed, offset, 0, 0, 0, false, blocks);
      CHECK(o.y == base.y);
      CHECK(o.mask == base.mask);
    }
    const Outcome on_stream = run_forward(dtype, x, kBits, p, seed, offset, 0, 0, 0, false, 0, stream);
    CHECK(on_stream.y == base.y && on_stream.mask == base.mask);
    const Outcome in_place = run_forward(dtype, x, kBits, p, seed, offset, 0, 0, 0, true);
    CHECK(in_place.y == base.y && in_place.mask == base.mask);
    const Outcome in_place_scalar = run_forward(dtype, x, kBits, p, seed, offset, dtype_size(dtype), 0, 0, true, 3);
    CHECK(in_place_scalar.y == base.y && in_place_scalar.mask == base.mask);
  }
  INFERCTX_CUDA(cudaStreamDestroy(stream), -1);
}

TEST_CASE("gpu: p = 0 copies x bit for bit (NaN payloads, -0) with a full mask; p = 1 gives zeros") {
  for (int dtype : {F32, F16, BF16}) {
    for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{4096}, int64_t{100001}}) {
      auto x = random_elements(dtype, n);
      x[0] = dtype == F32 ? 0x7f800001u : 0x7d01u;  // signalling NaN with a payload
      if (n > 1) x[1] = dtype == F32 ? 0x80000000u : 0x8000u;  // -0
      const auto xbytes = to_bytes(dtype, x);
      for (int mode : {kNone, kBytes, kBits}) {
        const Outcome zero = run_forward(dtype, x, mode, 0.0f, 9, 0);
        CHECK(zero.y == xbytes);
        CHECK(zero.guards_intact);
        if (mode == kBytes) CHECK(zero.mask == std::vector<uint8_t>(static_cast<size_t>(n), 1));
        if (mode == kBits) {
          const auto words = pack_bits(std::vector<uint8_t>(static_cast<size_t>(n), 1));
          CHECK(std::memcmp(zero.mask.data(), words.data(), zero.mask.size()) == 0);
        }
        const Outcome in_place = run_forward(dtype, x, mode, 0.0f, 9, 0, 0, 0, 0, true);
        CHECK(in_place.y == xbytes);
        const Outcome one = run_forward(dtype, x, mode, 1.0f, 9, 0);
        CHECK(one.y == std::vector<uint8_t>(xbytes.size(), 0));
        CHECK(one.mask == std::vector<uint8_t>(one.mask.size(), 0));
        CHECK(one.guards_intact);
      }
    }
  }
}

TEST_CASE("gpu: keep rate within 5 sigma of 1 - p; consecutive offsets give different masks") {
  const int64_t n = int64_t{1} << 26;
  for (float p : {0.1f, 0.5f, 0.9f}) {
    DeviceBuffer x(static_cast<size_t>(n) * 2), mask(static_cast<size_t>(dropout_mask_bytes(n, kBits)));
    DeviceBuffer mask2(mask.size);
    INFERCTX_CUDA(cudaMemset(x.ptr, 0x3c, x.size), -1);
    dropout_forward(x.ptr, x.ptr, mask.ptr, n, F16, p, kBits, 77, 400, nullptr);
    dropout_forward(x.ptr, x.ptr, mask2.ptr, n, F16, p, kBits, 77, 404, nullptr);
    INFERCTX_CUDA(cudaDeviceSynchronize(), -1);
    const auto a = download(mask.ptr, mask.size), b = download(mask2.ptr, mask2.size);
    int64_t kept = 0, differ = 0;
    for (size_t w = 0; w < a.size() / 4; ++w) {
      uint32_t u, v;
      std::memcpy(&u, &a[w * 4], 4);
      std::memcpy(&v, &b[w * 4], 4);
      kept += __builtin_popcount(u);
      differ += __builtin_popcount(u ^ v);
    }
    const double q = 1.0 - static_cast<double>(p);
    const double sigma = std::sqrt(static_cast<double>(n) * q * (1.0 - q));
    CHECK(std::fabs(static_cast<double>(kept) - static_cast<double>(n) * q) < 5.0 * sigma);
    // Independent masks differ in a fraction 2 q (1 - q) of the elements.
    const double want = 2.0 * q * (1.0 - q) * static_cast<double>(n);
    CHECK(std::fabs(static_cast<double>(differ) - want) < 5.0 * std::sqrt(want));
  }
}

TEST_CASE("gpu: apply_mask scales where the mask is set, for both formats, aligned or not, in place") {
  const float ps[] = {0.1f, 0.5f, 0.999f, 0.0f, 1.0f};
  int combo = 0;
  for (int dtype : {F32, F16, BF16}) {
    const size_t e = static_cast<size_t>(dtype_size(dtype));
    for (int64_t n : {int64_t{1}, int64_t{31}, int64_t{33}, int64_t{1024}, int64_t{1057}, int64_t{262147}}) {
      const float p = ps[combo++ % 5];
      const float scale = scale_ref(p);
      const auto g = random_elements(dtype, n);
      const auto gbytes = to_bytes(dtype, g);
      std::vector<uint8_t> keep(static_cast<size_t>(n));
      std::vector<uint8_t> mask_bytes(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t r = rng()();
        keep[static_cast<size_t>(i)] = r & 1u;
        mask_bytes[static_cast<size_t>(i)] = (r & 1u) ? static_cast<uint8_t>(1 + (r >> 8) % 255) : 0;  // any nonzero
      }
      auto words = pack_bits(keep);
      if (n % 32) words.back() |= ~((1u << (n % 32)) - 1u);  // bits past n are ignored
      std::vector<uint8_t> wbytes(words.size() * 4);
      std::memcpy(wbytes.data(), words.data(), wbytes.size());
      for (int mode : {kBytes, kBits}) {
        const auto& mbytes = mode == kBits ? wbytes : mask_bytes;
        for (int variant = 0; variant < 4; ++variant) {  // aligned, misaligned, in place, a one-block grid
          const size_t shift = variant == 1 ? e : 0;
          DeviceBuffer gbuf(gbytes.size() + 256 + kGuard), obuf(gbytes.size() + 256 + kGuard),
              mbuf(mbytes.size() + 256);
          uint8_t* gp = gbuf.bytes() + shift;
          uint8_t* op = variant == 2 ? gp : obuf.bytes() + shift;
          uint8_t* mp = mbuf.bytes() + (mode == kBytes && variant == 1 ? 1 : 0);
          INFERCTX_CUDA(cudaMemset(gbuf.ptr, kYFill, gbuf.size), -1);
          INFERCTX_CUDA(cudaMemset(obuf.ptr, kYFill, obuf.size), -1);
          upload(gp, gbytes);
          upload(mp, mbytes);
          dropout_apply_mask(gp, mp, op, n, dtype, p, mode, nullptr, -1, variant == 3 ? 1 : 0);
          INFERCTX_CUDA(cudaDeviceSynchronize(), -1);
          const auto out = download(op, gbytes.size() + kGuard);
          int bad = 0;
          for (int64_t i = 0; i < n; ++i) {
            const bool set = keep[static_cast<size_t>(i)] != 0 && p < 1.0f;
            const uint32_t want = expected_elem(dtype, g[static_cast<size_t>(i)], set, scale);
            const uint32_t got = elem_at(dtype, out.data(), i);
            if (!(got == want || (elem_is_nan(dtype, got) && elem_is_nan(dtype, want)))) ++bad;
          }
          for (size_t i = gbytes.size(); i < out.size(); ++i) bad += out[i] != kYFill;
          if (bad)
            std::printf("  apply_mask %s n=%lld mask=%s p=%g variant=%d: %d mismatches\n", kDTypeNames[dtype],
                        static_cast<long long>(n), kModeNames[mode], static_cast<double>(p), variant, bad);
          CHECK_EQ(bad, 0);
        }
      }
    }
  }
}

TEST_CASE("gpu: apply_mask of the forward mask reproduces the forward output") {
  const int64_t n = 300007;
  for (int dtype : {F32, F16, BF16}) {
    for (int mode : {kBytes, kBits}) {
      const auto x = random_elements(dtype, n);
      const auto xbytes = to_bytes(dtype, x);
      const size_t bytes = xbytes.size();
      DeviceBuffer xb(bytes), yb(bytes), mb(static_cast<size_t>(dropout_mask_bytes(n, mode))), ob(bytes);
      upload(xb.ptr, xbytes);
      dropout_forward(xb.ptr, yb.ptr, mb.ptr, n, dtype, 0.3f, mode, 5, 4ull << 32, nullptr);
      dropout_apply_mask(xb.ptr, mb.ptr, ob.ptr, n, dtype, 0.3f, mode, nullptr);
      INFERCTX_CUDA(cudaDeviceSynchronize(), -1);
      const auto y = download(yb.ptr, bytes), o = download(ob.ptr, bytes);
      int bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t a = elem_at(dtype, y.data(), i), b = elem_at(dtype, o.data(), i);
        bad += !(a == b || (elem_is_nan(dtype, a) && elem_is_nan(dtype, b)));
      }
      CHECK_EQ(bad, 0);
    }
  }
}

TEST_CASE("gpu: more than 2^32 elements (64-bit indexing, high counter words), sampled windows") {
  // Under compute-sanitizer a 32 GiB pass takes hours; the sampled windows are covered unsanitized.
  if (std::getenv("INFERCTX_SANITIZE") != nullptr) {
    std::printf("  note: skipped under INFERCTX_SANITIZE (runs in the plain ctest pass)\n");
    return;
  }
  // 2^34 + 1037 fp16 elements in place (32 GiB) reach subsequence 2^32 (counter word 3); fall back
  // to 2^32 + 1037 (8 GiB) on smaller devices.
  const int64_t candidates[] = {(int64_t{1} << 34) + 1037, (int64_t{1} << 32) + 1037};
  int64_t n = 0;
  for (int64_t c : candidates) {
    const size_t need = static_cast<size_t>(c) * 2 + static_cast<size_t>(dropout_mask_bytes(c, kBits)) + (size_t{1} << 30);
    if (gpu_has_free_bytes(need)) {
      n = c;
      break;
    }
  }
  if (n == 0) {
    std::printf("  not enough free device memory for 2^32 + 1037 fp16 elements; case not run\n");
    return;
  }
  std::printf("  n = %lld\n", static_cast<long long>(n));
  DeviceBuffer x(static_cast<size_t>(n) * 2), mask(static_cast<size_t>(dropout_mask_bytes(n, kBits)));
  fill_pattern_half<<<1024, 256>>>(static_cast<uint16_t*>(x.ptr), n);
  INFERCTX_CUDA(cudaGetLastError(), -1);
  const uint64_t seed = 0xfeedface12345678ull, offset = 4ull * ((1ull << 32) - 1);
  const float p = 0.35f, scale = scale_ref(p);
  dropout_forward(x.ptr, x.ptr, mask.ptr, n, F16, p, kBits, seed, offset, nullptr);
  INFERCTX_CUDA(cudaDeviceSynchronize(), -1);
  const int64_t w = 4096;
  std::vector<int64_t> starts = {0, (int64_t{1} << 31) - w / 2, (int64_t{1} << 32) - w / 2, (int64_t{1} << 33) + 5 * 32,
                                 (int64_t{1} << 34) - w / 2, n - w};
  for (int k = 0; k < 8; ++k) starts.push_back(static_cast<int64_t>(rng()() % static_cast<uint64_t>(n - w)) / 32 * 32);
  int64_t bad = 0;
  for (int64_t s : starts) {
    if (s < 0 || s + w > n) continue;
    s = s / 32 * 32;
    const auto y = download(x.bytes() + s * 2, static_cast<size_t>(w) * 2);
    const auto m = download(mask.bytes() + s / 8, static_cast<size_t>(w) / 8);
    for (int64_t i = 0; i < w; ++i) {
      const uint64_t idx = static_cast<uint64_t>(s + i);
      const bool keep = keep_ref(seed, offset, idx, p);
      const uint32_t want = expected_elem(F16, pattern_half(idx), keep, scale);
      const uint32_t got = elem_at(F16, y.data(), i);
      const bool mask_bit = (m[static_cast<size_t>(i / 8)] >> (i % 8)) & 1u;
      if (got != want || mask_bit != keep) {
        if (bad < 3)
          std::printf("  element %llu: y 0x%x (want 0x%x), bit %d (want %d)\n", static_cast<unsigned long long>(idx),
                      got, want, mask_bit, keep);
        ++bad;
      }
    }
  }
  // The last word's bits past n are zero.
  uint32_t last;
  INFERCTX_CUDA(cudaMemcpy(&last, mask.bytes() + mask.size - 4, 4, cudaMemcpyDeviceToHost), -1);
  CHECK_EQ(last >> (n % 32), 0u);
  CHECK_EQ(bad, int64_t{0});
}

}  // namespace

int main() {
  check::run_seed();
  return check::run_all_or_cpu_cases("host:");
}

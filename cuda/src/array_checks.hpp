// Argument checks of the kernels' host sides (dropout.cpp, decoder_ops.cu; gemm_problem.cpp's
// distinct elements): a ConfigError naming the argument, and the pointer and overlap rules of
// raw device arrays.
// Internal to cuda/src.
#pragma once

#include <cstdint>
#include <string>


namespace inferctx::detail {

// ConfigError(argument) with the message "argument: detail" (plan_request.cpp).
[[noreturn]] void invalid(const char* argument, const std::string& detail);

inline uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte (never, if either is empty).
inline bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  return address(a) < address(b) + static_cast<uint64_t>(b_bytes) &&
         address(b) < address(a) + static_cast<uint64_t>(a_bytes);
}

// Whether no two index tuples of an array of n <= 8 dimensions (`sizes` >= 0, element `strides`
// >= 0) name one element. Sufficient, not necessary: sorted by stride, each dimension of more
// than one index steps past everything the dimensions with smaller strides reach, as every
// layout made by slicing and permuting a dense array does. A reach past 2^63 reaches everything.
inline bool elements_distinct(const int64_t* sizes, const int64_t* strides, int n) {
  int order[8];
  int used = 0;
  for (int k = 0; k < n; ++k) {
    if (sizes[k] == 0) return true;  // no elements at all
    if (sizes[k] == 1) continue;
    int at = used++;
    for (; at > 0 && strides[order[at - 1]] > strides[k]; --at) order[at] = order[at - 1];
    order[at] = k;
  }
  int64_t reach = 1;  // from the first element to one past the last, over the dimensions so far
  for (int u = 0; u < used; ++u) {
    const int k = order[u];
    if (strides[k] < reach) return false;
    int64_t part = 0;
    if (__builtin_mul_overflow(strides[k], sizes[k] - 1, &part) || __builtin_add_overflow(reach, part, &reach))
      reach = INT64_MAX;
  }
  return true;
}

// A device pointer to an array with elements to read or write: not null, element-aligned.
inline void check_pointer(const char* name, const void* p, int64_t alignment) {
  if (p == nullptr) invalid(name, "is null with elements to access; pass a device pointer to the array");
  if (address(p) % static_cast<uint64_t>(alignment) != 0)
    invalid(name, "address " + std::to_string(address(p)) + " is not aligned to its element size (" +
                      std::to_string(alignment) + " bytes)");
}

}  // namespace inferctx::detail

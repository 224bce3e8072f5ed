// Argument checks of the elementwise kernels' host sides (dropout.cpp, decoder_ops.cu): a
// ConfigError naming the argument, and the pointer and overlap rules of raw device arrays.
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

// A device pointer to an array with elements to read or write: not null, element-aligned.
inline void check_pointer(const char* name, const void* p, int64_t alignment) {
  if (p == nullptr) invalid(name, "is null with elements to access; pass a device pointer to the array");
  if (address(p) % static_cast<uint64_t>(alignment) != 0)
    invalid(name, "address " + std::to_string(address(p)) + " is not aligned to its element size (" +
                      std::to_string(alignment) + " bytes)");
}

}  // namespace inferctx::detail

// Exception types thrown by inferctx_core. pyx/ maps each one to the Python class of
// the same name in inferctx.errors; the fields travel with it. Messages hold the facts in
// the library's own terms; where the fix names the Python API (a method, a keyword, the
// CLI), the error carries a Remedy that the Python class words.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace inferctx {

enum class ErrorKind : int {
  Config = 1,
  WorkspaceOOM = 2,
  TokenLimit = 3,
  WorkspaceState = 4,
  WorkspaceInUse = 5,
  Cuda = 6,
  Cublas = 7,
  NoCudaDevice = 8,
};

// What the caller can do about an error, worded by the Python error class and appended to
// the message (python/inferctx/errors.py keeps the same codes).
enum class Remedy : int {
  None = 0,
  DropViewsOrForceRelease = 1,  // views keep the old workspace: drop them, or release it by force
  DropViewsOrDetach = 2,        // a release refused for its views: drop them, or detach by force
  FreeMemoryThenRetake = 3,     // free device memory, then retake the workspace
  ContextOfDevice = 4,          // use the context of device `remedy_device` for that stream
  PlanWithoutDevice = 5,        // planning works without a device
  BatchedGemm = 6,              // a batch of matrices goes to the batched entry point
  MakeContiguous = 7,           // copy the array into a contiguous one first
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

  Remedy remedy = Remedy::None;
  int remedy_device = -1;  // the device a remedy names (Remedy::ContextOfDevice)

 private:
  ErrorKind kind_;
};

// `error` with a remedy: throw with_remedy(WorkspaceInUseError(...), Remedy::DropViewsOrDetach).
template <class E>
E with_remedy(E error, Remedy remedy, int remedy_device = -1) {
  error.remedy = remedy;
  error.remedy_device = remedy_device;
  return error;
}

// An argument outside what is valid; `argument` names it.
class ConfigError : public Error {
 public:
  ConfigError(std::string argument, const std::string& message)
      : Error(ErrorKind::Config, message), argument(std::move(argument)) {}
  std::string argument;
};

// A workspace that does not fit, with the figures that say why and what would fit
// (-1 where nothing would).
class WorkspaceOOMError : public Error {
 public:
  WorkspaceOOMError(const std::string& message, int64_t requested_bytes, int64_t free_bytes,
                    int64_t total_bytes, int64_t budget_bytes, int64_t max_batch_size,
                    int64_t max_out_tokens)
      : Error(ErrorKind::WorkspaceOOM, message),
        requested_bytes(requested_bytes),
        free_bytes(free_bytes),
        total_bytes(total_bytes),
        budget_bytes(budget_bytes),
        max_batch_size(max_batch_size),
        max_out_tokens(max_out_tokens) {}
  int64_t requested_bytes, free_bytes, total_bytes, budget_bytes, max_batch_size, max_out_tokens;
};

class TokenLimitError : public Error {
 public:
  TokenLimitError(const std::string& message, int64_t current, int64_t requested, int64_t limit)
      : Error(ErrorKind::TokenLimit, message), current(current), requested(requested), limit(limit) {}
  int64_t current, requested, limit;
};

class WorkspaceStateError : public Error {
 public:
  explicit WorkspaceStateError(const std::string& message) : Error(ErrorKind::WorkspaceState, message) {}

 protected:
  WorkspaceStateError(ErrorKind kind, const std::string& message) : Error(kind, message) {}
};

class WorkspaceInUseError : public WorkspaceStateError {
 public:
  WorkspaceInUseError(const std::string& message, int64_t views_alive)
      : WorkspaceStateError(ErrorKind::WorkspaceInUse, message), views_alive(views_alive) {}
  int64_t views_alive;
};

// A failed CUDA runtime call: the call, its code and name, and the device it ran on.
class CudaError : public Error {
 public:
  CudaError(const std::string& message, std::string call, int code, std::string code_name, int device)
      : Error(ErrorKind::Cuda, message),
        call(std::move(call)),
        code(code),
        code_name(std::move(code_name)),
        device(device) {}
  std::string call;
  int code;
  std::string code_name;
  int device;

 protected:
  CudaError(ErrorKind kind, const std::string& message, std::string call, int code,
            std::string code_name, int device)
      : Error(kind, message), call(std::move(call)), code(code), code_name(std::move(code_name)), device(device) {}
};

class CublasError : public CudaError {
 public:
  CublasError(const std::string& message, std::string call, int code, std::string code_name, int device)
      : CudaError(ErrorKind::Cublas, message, std::move(call), code, std::move(code_name), device) {}
};

// No usable device (none present, or no driver); planning still works without one.
class NoCudaDeviceError : public CudaError {
 public:
  NoCudaDeviceError(const std::string& message, std::string call, int code, std::string code_name)
      : CudaError(ErrorKind::NoCudaDevice, message, std::move(call), code, std::move(code_name), -1) {}
};

// Flattened view of the exception being handled, for the Python translation in pyx/: the
// fields of every error type, named as there; those of other types keep their defaults.
// Call only inside a catch block (it rethrows the current exception).
struct ErrorInfo {
  int kind = 0;  // 0: not an inferctx::Error; -1: std::bad_alloc
  std::string message;
  int remedy = 0;
  int remedy_device = -1;
  // ConfigError
  std::string argument;
  // WorkspaceOOMError (-1: no batch size / max_out_tokens would fit)
  int64_t requested_bytes = 0, free_bytes = 0, total_bytes = 0, budget_bytes = 0;
  int64_t max_batch_size = -1, max_out_tokens = -1;
  // TokenLimitError
  int64_t current = 0, requested = 0, limit = 0;
  // WorkspaceInUseError
  int64_t views_alive = 0;
  // CudaError, CublasError, NoCudaDeviceError
  std::string call;
  std::string code_name;
  int code = 0;
  int device = -1;
};

ErrorInfo current_error_info();

}  // namespace inferctx

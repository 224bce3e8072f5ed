#include "inferctx/errors.hpp"

#include <exception>
#include <new>

namespace inferctx {

ErrorInfo current_error_info() {
  ErrorInfo info;
  try {
    throw;
  } catch (const WorkspaceOOMError& e) {
    info.kind = static_cast<int>(e.kind());
    info.message = e.what();
    info.values[0] = e.requested_bytes;
    info.values[1] = e.free_bytes;
    info.values[2] = e.total_bytes;
    info.values[3] = e.budget_bytes;
    info.values[4] = e.max_batch_size;
    info.values[5] = e.max_out_tokens;
  } catch (const ConfigError& e) {
    info.kind = static_cast<int>(e.kind());
    info.message = e.what();
    info.argument = e.argument;
  } catch (const TokenLimitError& e) {
    info.kind = static_cast<int>(e.kind());
    info.message = e.what();
    info.values[0] = e.current;
    info.values[1] = e.requested;
    info.values[2] = e.limit;
  } catch (const WorkspaceInUseError& e) {
    info.kind = static_cast<int>(e.kind());
    info.message = e.what();
    info.values[0] = e.views_alive;
  } catch (const CudaError& e) {  // CublasError and NoCudaDeviceError too
    info.kind = static_cast<int>(e.kind());
    info.message = e.what();
    info.call = e.call;
    info.code = e.code;
    info.code_name = e.code_name;
    info.device = e.device;
  } catch (const Error& e) {
    info.kind = static_cast<int>(e.kind());
    info.message = e.what();
  } catch (const std::bad_alloc&) {
    info.kind = -1;
    info.message = "host memory exhausted (std::bad_alloc)";
  } catch (const std::exception& e) {
    info.kind = 0;
    info.message = e.what();
  } catch (...) {
    info.kind = 0;
    info.message = "unknown C++ exception";
  }
  return info;
}

}  // namespace inferctx

#include "inferctx/errors.hpp"

#include <exception>
#include <new>

namespace inferctx {

namespace {

void take_common(ErrorInfo& info, const Error& e) {
  info.kind = static_cast<int>(e.kind());
  info.message = e.what();
  info.remedy = static_cast<int>(e.remedy);
  info.remedy_device = e.remedy_device;
}

}  // namespace

ErrorInfo current_error_info() {
  ErrorInfo info;
  try {
    throw;
  } catch (const WorkspaceOOMError& e) {
    take_common(info, e);
    info.requested_bytes = e.requested_bytes;
    info.free_bytes = e.free_bytes;
    info.total_bytes = e.total_bytes;
    info.budget_bytes = e.budget_bytes;
    info.max_batch_size = e.max_batch_size;
    info.max_out_tokens = e.max_out_tokens;
  } catch (const ConfigError& e) {
    take_common(info, e);
    info.argument = e.argument;
  } catch (const TokenLimitError& e) {
    take_common(info, e);
    info.current = e.current;
    info.requested = e.requested;
    info.limit = e.limit;
  } catch (const WorkspaceInUseError& e) {
    take_common(info, e);
    info.views_alive = e.views_alive;
  } catch (const CudaError& e) {  // CublasError and NoCudaDeviceError too
    take_common(info, e);
    info.call = e.call;
    info.code = e.code;
    info.code_name = e.code_name;
    info.device = e.device;
  } catch (const Error& e) {
    take_common(info, e);
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

// What the context's two files share, internal to cuda/src: context.cpp makes the context and
// plans and maps its workspace, context_release.cpp gives the workspace's memory back and takes
// it again.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "inferctx/memory.hpp"
#include "inferctx/plan.hpp"

namespace inferctx::detail {

// An allocation of `bytes` on `device`, or null when the device is out of memory; any other
// failure throws.
std::shared_ptr<DeviceAllocation> allocate_or_null(int device, int64_t bytes);

// "N tokens, X GiB": a plan as the context's messages name it.
std::string describe_plan(const WorkspacePlan& plan);

}  // namespace inferctx::detail

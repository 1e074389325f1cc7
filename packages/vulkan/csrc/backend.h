// The backend table handed to the core, and what the Python bindings need besides it.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "common.h"
#include "device.h"

namespace recurra_vk {

// The static table (abi_version = RECURRA_BACKEND_ABI_VERSION).
recurra_backend_table* backend_table();

struct BackendSummary {
  std::vector<PhysicalDevice> devices;
  std::string reason;
};
// The devices the table offers (creating the instance if needed; never throws Error).
BackendSummary backend_summary();

// Runs fn on device `index` under the backend's lock (for the benchmark entry point);
// rethrows failures as Error.
void with_device(int index, const std::function<void(Device&)>& fn);

}  // namespace recurra_vk

// Shared basics of the Vulkan backend: the error type that carries a recurra_status, and
// Vulkan result checking.
//
// Every failure inside the backend is an Error thrown with the status the C table returns
// (backend.cpp catches it at the boundary and keeps the message for get_last_error).
#pragma once

#include <vulkan/vulkan.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "recurra/backend.h"

namespace recurra_vk {

struct Error : std::runtime_error {
  int status;
  Error(int s, const std::string& msg) : std::runtime_error(msg), status(s) {}
};

[[noreturn]] inline void fail(int status, const std::string& msg) { throw Error(status, msg); }
[[noreturn]] inline void fail_invalid(const std::string& msg) { fail(RECURRA_ERR_INVALID, msg); }

const char* vk_result_name(VkResult r);

// Throws the Error matching a failed VkResult: out of memory -> RECURRA_ERR_OOM, device
// lost -> RECURRA_ERR_DEVICE_LOST, anything else -> RECURRA_ERR_DEVICE_LOST too (the driver
// refused work it accepted before; the device cannot be trusted any more).
[[noreturn]] void fail_vk(VkResult r, const std::string& what);

inline void vk_check(VkResult r, const char* what) {
  if (r != VK_SUCCESS) fail_vk(r, what);
}

inline uint64_t align_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

}  // namespace recurra_vk

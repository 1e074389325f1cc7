// The C backend table (recurra/backend.h) over the C++ Device objects.
//
// One process-wide Backend: the Vulkan instance is created on first use, each logical
// device on the first call that names it. Every table function takes the backend's lock
// (the core may call from several threads), turns exceptions into a recurra_status and
// keeps the message for get_last_error. The Backend is never destroyed at exit (drivers
// may already be unloading then); shutdown() releases it explicitly.
#include "backend.h"

#include <memory>
#include <mutex>

#include "device.h"
#include "ops/ops.h"

namespace recurra_vk {

namespace {

struct Backend {
  std::mutex mu;
  std::unique_ptr<Instance> instance;
  std::vector<std::unique_ptr<Device>> devices;
  std::string last_error;
  bool shut_down = false;

  Instance& inst() {
    if (!instance) {
      instance = std::make_unique<Instance>();
      devices.clear();
      devices.resize(instance->devices().size());
    }
    return *instance;
  }

  Device& device(int index) {
    if (shut_down) fail_invalid("the Vulkan backend was shut down; its buffers and devices are gone");
    Instance& in = inst();
    if (index < 0 || index >= static_cast<int>(devices.size()))
      fail_invalid("Vulkan device " + std::to_string(index) + " does not exist (" + std::to_string(devices.size()) +
                   " device(s)" + (in.reason().empty() ? "" : ": " + in.reason()) + ")");
    if (!devices[index]) devices[index] = std::make_unique<Device>(in.devices()[index]);
    return *devices[index];
  }
};

Backend& backend() {
  static Backend* b = new Backend();  // deliberately leaked: see the file comment
  return *b;
}

template <class F>
int guarded(F&& f) {
  Backend& b = backend();
  std::lock_guard<std::mutex> lk(b.mu);
  try {
    f(b);
    return RECURRA_OK;
  } catch (const Error& e) {
    b.last_error = e.what();
    if (e.status == RECURRA_ERR_OOM) b.last_error += "; " RECURRA_OOM_HINT;
    return e.status;
  } catch (const std::bad_alloc&) {
    b.last_error = "out of host memory (in the Vulkan backend); " RECURRA_OOM_HINT;
    return RECURRA_ERR_OOM;
  } catch (const std::exception& e) {
    b.last_error = e.what();
    return RECURRA_ERR_INVALID;
  }
}

int t_device_count(void*) {
  Backend& b = backend();
  std::lock_guard<std::mutex> lk(b.mu);
  if (b.shut_down) return 0;
  try {
    return static_cast<int>(b.inst().devices().size());
  } catch (...) {
    return 0;
  }
}

int t_device_info(void*, int device, recurra_device_info* out) {
  return guarded([&](Backend& b) {
    if (!out) fail_invalid("device_info: null output");
    if (b.shut_down) fail_invalid("the Vulkan backend was shut down");
    const auto& devs = b.inst().devices();
    if (device < 0 || device >= static_cast<int>(devs.size()))
      fail_invalid("device_info: no Vulkan device " + std::to_string(device));
    const PhysicalDevice& d = devs[device];
    *out = recurra_device_info{};
    std::snprintf(out->name, sizeof out->name, "%s", d.name.c_str());
    std::snprintf(out->kind, sizeof out->kind, "%s", d.kind.c_str());
    out->memory_bytes = d.memory_bytes;
    out->index = static_cast<uint32_t>(device);
    out->max_buffer_bytes = d.max_buffer_bytes();
    out->max_tensor_elements = kMaxIndex;
    const uint64_t reserved = b.devices[device] ? b.devices[device]->memory().bytes_reserved() : 0;
    out->free_bytes = free_device_bytes(d.handle, d.heap, d.memory_budget, reserved);
  });
}

int t_alloc(void*, int device, size_t nbytes, int persistent, recurra_buffer* out) {
  return guarded([&](Backend& b) {
    if (!out) fail_invalid("alloc: null output");
    *out = b.device(device).alloc(nbytes, persistent != 0);
  });
}

int t_free(void*, int device, recurra_buffer buf) {
  return guarded([&](Backend& b) {
    if (b.shut_down) return;  // everything is gone already
    b.device(device).free(buf);
  });
}

int t_copy_in(void*, int device, recurra_buffer dst, size_t offset, const void* src, size_t nbytes) {
  return guarded([&](Backend& b) { b.device(device).copy_in(dst, offset, src, nbytes); });
}

int t_copy_out(void*, int device, recurra_buffer src, size_t offset, void* dst, size_t nbytes) {
  return guarded([&](Backend& b) { b.device(device).copy_out(src, offset, dst, nbytes); });
}

int t_supports_op(void*, int device, const recurra_node_desc* node) {
  int answer = 0;
  int st = guarded([&](Backend& b) {
    if (!node) fail_invalid("supports_op: null node");
    // a valid device index (and its device made) first
    const std::string why = check_node(*node, b.device(device).half_storage());
    answer = why.empty() ? 1 : 0;
    if (!why.empty()) b.last_error = why;
  });
  return st == RECURRA_OK ? answer : 0;
}

int t_compute(void*, int device, const recurra_node_desc* nodes, int32_t n) {
  return guarded([&](Backend& b) { compute_nodes(b.device(device), nodes, n); });
}

int t_synchronize(void*, int device) {
  return guarded([&](Backend& b) { b.device(device).synchronize(); });
}

int t_alloc_host(void*, int device, size_t nbytes, recurra_buffer* out, void** host) {
  return guarded([&](Backend& b) {
    if (!out || !host) fail_invalid("alloc_host: null output");
    *out = b.device(device).alloc_host(nbytes, host);
  });
}

int t_import_host(void*, int device, void* host, size_t nbytes, recurra_buffer* out) {
  return guarded([&](Backend& b) {
    if (!out) fail_invalid("import_host: null output");
    *out = b.device(device).import_host(host, nbytes);
  });
}

int t_mark(void*, int device, uint64_t* value) {
  return guarded([&](Backend& b) {
    if (!value) fail_invalid("mark: null output");
    *value = b.device(device).mark();
  });
}

int t_wait_mark(void*, int device, uint64_t value) {
  return guarded([&](Backend& b) { b.device(device).wait_mark(value); });
}

const char* t_get_last_error(void*) {
  Backend& b = backend();
  std::lock_guard<std::mutex> lk(b.mu);
  return b.last_error.empty() ? nullptr : b.last_error.c_str();
}

void t_shutdown(void*) {
  Backend& b = backend();
  std::lock_guard<std::mutex> lk(b.mu);
  b.devices.clear();  // waits for each device, then destroys it
  b.instance.reset();
  b.shut_down = true;
}

recurra_backend_table g_table = {
    RECURRA_BACKEND_ABI_VERSION,
    "vulkan",
    nullptr,
    t_device_count,
    t_device_info,
    t_alloc,
    t_free,
    t_copy_in,
    t_copy_out,
    t_supports_op,
    t_compute,
    t_synchronize,
    t_get_last_error,
    t_shutdown,
    t_alloc_host,
    t_mark,
    t_wait_mark,
    t_import_host,
};

}  // namespace

recurra_backend_table* backend_table() { return &g_table; }

BackendSummary backend_summary() {
  Backend& b = backend();
  std::lock_guard<std::mutex> lk(b.mu);
  BackendSummary s;
  if (b.shut_down) {
    s.reason = "the Vulkan backend was shut down";
    return s;
  }
  Instance& in = b.inst();
  s.devices = in.devices();
  s.reason = in.reason();
  return s;
}

void with_device(int index, const std::function<void(Device&)>& fn) {
  const int st = guarded([&](Backend& b) { fn(b.device(index)); });
  if (st != RECURRA_OK) throw Error(st, backend().last_error);
}

}  // namespace recurra_vk

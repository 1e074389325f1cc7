// Plugin backends registered with the core (the CPU is backend 0 and is not in the table).
//
// A plugin hands over a recurra_backend_table (recurra/backend.h) in a PyCapsule; each of its
// devices becomes one backend id here ("vulkan:0", "vulkan:1", ...). Status codes returned by
// the table become exceptions with the plugin's own message.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "memory.h"
#include "recurra/backend.h"

namespace recurra {

constexpr int kCpuBackend = 0;

struct BackendEntry {
  std::string name;  // "vulkan:0"
  const recurra_backend_table* table = nullptr;
  int device = 0;
  bool closed = false;  // released: buffers it handed out are stale from now on
};

// Registers every device of `table`; returns their backend ids. Throws ValueError when the
// ABI version differs from this core's.
std::vector<int> register_backend(const recurra_backend_table* table);
BackendEntry& backend_entry(int id);  // id >= 1; throws ValueError otherwise
int n_backends();                     // including the CPU
std::string backend_name(int id);
int find_backend(const std::string& name);  // "cpu", "vulkan", "vulkan:1"; -1 when unknown
// Marks a backend released; with shutdown=true also calls the plugin's shutdown hook.
void close_backend(int id, bool shutdown);
// What a device backend can hold (its recurra_device_info): the largest buffer (0: no
// limit), memory free now (0: unknown) and the device's memory.
struct DeviceLimits {
  uint64_t max_buffer_bytes = 0;
  uint64_t max_tensor_elements = 0;  // 0: no limit
  uint64_t free_bytes = 0;
  uint64_t memory_bytes = 0;
};
DeviceLimits device_limits(int id);
// Whether backend `id` (a plugin's) has asynchronous reads (alloc_host, mark, wait_mark).
bool has_async_reads(int id);
// Whether backend `id` may import host memory (import_host; the device may still refuse
// a given range).
bool can_import_host(int id);
// A value standing for the work submitted to backend `id` so far; waiting for it.
uint64_t backend_mark(int id);
void backend_wait_mark(int id, uint64_t value);
// Raises the exception matching a failed status of backend `id` during `what`.
void check_status(int id, int status, const std::string& what);

struct TransferStats {
  int64_t h2d_count = 0, h2d_bytes = 0, d2h_count = 0, d2h_bytes = 0;
};
TransferStats transfer_stats();
void transfer_stats_reset();
void count_transfer(bool to_device, size_t bytes);

// Memory on a plugin backend, freed when the last owner lets go. Use after the backend was
// closed raises RuntimeError instead of touching freed memory.
class DeviceBuffer {
 public:
  DeviceBuffer(int backend, size_t nbytes, Pool pool);
  // Host-visible memory of the backend (has_async_reads): nodes use it like any buffer, the
  // host reads and writes it at host().
  struct HostVisible {};
  DeviceBuffer(int backend, size_t nbytes, HostVisible);
  // A buffer over host memory that the caller allocated and keeps valid while the buffer
  // lives (recurra_backend_table::import_host; can_import_host): like HostVisible memory.
  struct Imported {};
  DeviceBuffer(int backend, void* host, size_t nbytes, Imported);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  int backend() const { return backend_; }
  size_t nbytes() const { return nbytes_; }
  const recurra_buffer& handle() const;  // throws if the backend was closed
  bool valid() const;
  void upload(size_t offset, const void* src, size_t n);
  void download(size_t offset, void* dst, size_t n) const;
  // The host address of host-visible memory (null for device memory; throws when the backend
  // was closed).
  uint8_t* host() const;

 private:
  int backend_;
  size_t nbytes_;
  Pool pool_;
  recurra_buffer buf_{};
  uint8_t* host_ = nullptr;
  bool imported_ = false;
};

}  // namespace recurra

#include "backend_registry.h"

#include <mutex>

namespace recurra {

namespace {
std::mutex g_backends_mu;
std::vector<BackendEntry>& entries() {
  static std::vector<BackendEntry> e;  // index = id - 1
  return e;
}
TransferStats g_transfers;
}  // namespace

std::vector<int> register_backend(const recurra_backend_table* t) {
  if (!t) throw ValueError("register_backend: null backend table");
  if (t->abi_version != RECURRA_BACKEND_ABI_VERSION)
    throw ValueError("backend '" + std::string(t->name ? t->name : "?") + "' was built for backend ABI " +
                     std::to_string(t->abi_version) + ", this recurra-core speaks ABI " +
                     std::to_string(RECURRA_BACKEND_ABI_VERSION) + "; install matching versions");
  if (!t->device_count || !t->alloc || !t->free || !t->copy_in || !t->copy_out || !t->supports_op ||
      !t->compute || !t->synchronize)
    throw ValueError("backend '" + std::string(t->name ? t->name : "?") + "' has an incomplete table");
  std::lock_guard<std::mutex> lk(g_backends_mu);
  std::vector<int> ids;
  const int n = t->device_count(t->ctx);
  for (int d = 0; d < n; ++d) {
    std::string name = std::string(t->name) + ":" + std::to_string(d);
    bool dup = false;
    for (size_t i = 0; i < entries().size(); ++i)
      if (entries()[i].name == name && !entries()[i].closed) {
        ids.push_back(static_cast<int>(i) + 1);
        dup = true;
      }
    if (dup) continue;
    entries().push_back({name, t, d, false});
    ids.push_back(static_cast<int>(entries().size()));
  }
  return ids;
}

BackendEntry& backend_entry(int id) {
  if (id < 1 || id > static_cast<int>(entries().size()))
    throw ValueError("unknown backend id " + std::to_string(id));
  return entries()[id - 1];
}

int n_backends() { return static_cast<int>(entries().size()) + 1; }

std::string backend_name(int id) { return id == kCpuBackend ? "cpu" : backend_entry(id).name; }

int find_backend(const std::string& name) {
  if (name == "cpu") return kCpuBackend;
  std::string full = name.find(':') == std::string::npos ? name + ":0" : name;
  for (size_t i = 0; i < entries().size(); ++i)
    if (entries()[i].name == full && !entries()[i].closed) return static_cast<int>(i) + 1;
  return -1;
}

void close_backend(int id, bool shutdown) {
  BackendEntry& e = backend_entry(id);
  if (e.closed) return;
  e.closed = true;
  if (shutdown && e.table->shutdown) {
    bool others = false;
    for (const auto& o : entries())
      if (o.table == e.table && !o.closed) others = true;
    if (!others) e.table->shutdown(e.table->ctx);
  }
}

DeviceLimits device_limits(int id) {
  const BackendEntry& e = backend_entry(id);
  DeviceLimits lim;
  recurra_device_info info{};
  if (!e.closed && e.table->device_info && e.table->device_info(e.table->ctx, e.device, &info) == RECURRA_OK) {
    lim.max_buffer_bytes = info.max_buffer_bytes;
    lim.max_tensor_elements = info.max_tensor_elements;
    lim.free_bytes = info.free_bytes;
    lim.memory_bytes = info.memory_bytes;
  }
  return lim;
}

void check_status(int id, int status, const std::string& what) {
  if (status == RECURRA_OK) return;
  const BackendEntry& e = backend_entry(id);
  std::string msg = e.name + ": " + what + " failed";
  if (e.table->get_last_error) {
    const char* m = e.table->get_last_error(e.table->ctx);
    if (m && *m) msg += ": " + std::string(m);
  }
  switch (status) {
    case RECURRA_ERR_OOM: throw OutOfMemory(msg);  // the plugin's message ends with RECURRA_OOM_HINT
    case RECURRA_ERR_INVALID: throw ValueError(msg);
    case RECURRA_ERR_UNSUPPORTED: throw ValueError(msg + " (not supported by this backend)");
    case RECURRA_ERR_DEVICE_LOST:
      throw StateError(msg + " (the device was lost; recreate tensors on another device)");
    default: throw StateError(msg + " (status " + std::to_string(status) + ")");
  }
}

TransferStats transfer_stats() {
  std::lock_guard<std::mutex> lk(g_backends_mu);
  return g_transfers;
}
void transfer_stats_reset() {
  std::lock_guard<std::mutex> lk(g_backends_mu);
  g_transfers = {};
}
void count_transfer(bool to_device, size_t bytes) {
  std::lock_guard<std::mutex> lk(g_backends_mu);
  if (to_device) {
    g_transfers.h2d_count++;
    g_transfers.h2d_bytes += static_cast<int64_t>(bytes);
  } else {
    g_transfers.d2h_count++;
    g_transfers.d2h_bytes += static_cast<int64_t>(bytes);
  }
}

DeviceBuffer::DeviceBuffer(int backend, size_t nbytes, Pool pool) : backend_(backend), nbytes_(nbytes), pool_(pool) {
  BackendEntry& e = backend_entry(backend);
  if (e.closed) throw StateError(e.name + " was released; allocate on another device");
  int st = e.table->alloc(e.table->ctx, e.device, nbytes == 0 ? 4 : nbytes, pool == Pool::persistent, &buf_);
  check_status(backend, st, "allocating " + std::to_string(nbytes) + " bytes");
  memory_stats_adjust(pool_, static_cast<int64_t>(nbytes_));
}

DeviceBuffer::DeviceBuffer(int backend, size_t nbytes, HostVisible)
    : backend_(backend), nbytes_(nbytes), pool_(Pool::persistent) {
  BackendEntry& e = backend_entry(backend);
  if (e.closed) throw StateError(e.name + " was released; allocate on another device");
  if (!has_async_reads(backend)) throw ValueError(e.name + " has no host-visible buffers (alloc_host)");
  void* p = nullptr;
  int st = e.table->alloc_host(e.table->ctx, e.device, nbytes == 0 ? 4 : nbytes, &buf_, &p);
  check_status(backend, st, "allocating " + std::to_string(nbytes) + " bytes of host-visible memory");
  if (!p) {
    e.table->free(e.table->ctx, e.device, buf_);
    throw StateError(e.name + ": alloc_host returned no host address");
  }
  host_ = static_cast<uint8_t*>(p);
  memory_stats_adjust(pool_, static_cast<int64_t>(nbytes_));
}

DeviceBuffer::DeviceBuffer(int backend, void* host, size_t nbytes, Imported)
    : backend_(backend), nbytes_(nbytes), pool_(Pool::persistent) {
  BackendEntry& e = backend_entry(backend);
  if (e.closed) throw StateError(e.name + " was released; allocate on another device");
  if (!can_import_host(backend)) throw ValueError(e.name + " cannot import host memory (import_host)");
  if (!host || nbytes == 0) throw ValueError("import_host: no memory to import");
  int st = e.table->import_host(e.table->ctx, e.device, host, nbytes, &buf_);
  check_status(backend, st, "importing " + std::to_string(nbytes) + " bytes of host memory");
  host_ = static_cast<uint8_t*>(host);
  imported_ = true;
  // not counted in the memory stats: the caller's memory, not the backend's
}

uint8_t* DeviceBuffer::host() const {
  if (host_) handle();  // raises once the backend was closed
  return host_;
}

bool has_async_reads(int id) {
  if (id <= kCpuBackend || id >= n_backends()) return false;
  const BackendEntry& e = backend_entry(id);
  return !e.closed && e.table->alloc_host && e.table->mark && e.table->wait_mark;
}

bool can_import_host(int id) {
  return has_async_reads(id) && backend_entry(id).table->import_host;
}

uint64_t backend_mark(int id) {
  const BackendEntry& e = backend_entry(id);
  uint64_t v = 0;
  check_status(id, e.table->mark(e.table->ctx, e.device, &v), "mark");
  return v;
}

void backend_wait_mark(int id, uint64_t value) {
  const BackendEntry& e = backend_entry(id);
  check_status(id, e.table->wait_mark(e.table->ctx, e.device, value), "wait");
}

DeviceBuffer::~DeviceBuffer() {
  if (!imported_) memory_stats_adjust(pool_, -static_cast<int64_t>(nbytes_));
  BackendEntry& e = backend_entry(backend_);
  if (!e.closed) e.table->free(e.table->ctx, e.device, buf_);  // never throw from here
}

bool DeviceBuffer::valid() const { return !backend_entry(backend_).closed; }

const recurra_buffer& DeviceBuffer::handle() const {
  const BackendEntry& e = backend_entry(backend_);
  if (e.closed)
    throw StateError("this tensor's memory on " + e.name +
                     " is gone: the backend was released (stale handle)");
  return buf_;
}

void DeviceBuffer::upload(size_t offset, const void* src, size_t n) {
  if (offset + n > nbytes_) throw ValueError("upload past the end of a device buffer");
  const BackendEntry& e = backend_entry(backend_);
  check_status(backend_, e.table->copy_in(e.table->ctx, e.device, handle(), offset, src, n), "copy to device");
  count_transfer(true, n);
}

void DeviceBuffer::download(size_t offset, void* dst, size_t n) const {
  if (offset + n > nbytes_) throw ValueError("download past the end of a device buffer");
  const BackendEntry& e = backend_entry(backend_);
  check_status(backend_, e.table->copy_out(e.table->ctx, e.device, handle(), offset, dst, n), "copy from device");
  count_transfer(false, n);
}

}  // namespace recurra

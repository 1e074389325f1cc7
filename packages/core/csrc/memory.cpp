#include "memory.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <map>
#include <utility>
#include <new>
#include <unordered_map>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include "recurra/backend.h"
#include "recurra/format.h"

namespace recurra {

namespace {
std::mutex g_stats_mu;
PoolStats g_stats[2];
}  // namespace

void memory_stats_adjust(Pool pool, int64_t delta) {
  std::lock_guard<std::mutex> lk(g_stats_mu);
  PoolStats& s = g_stats[static_cast<int>(pool)];
  s.bytes += delta;
  if (delta > 0) s.n_allocs++;
  if (s.bytes > s.peak_bytes) s.peak_bytes = s.bytes;
}

PoolStats memory_stats(Pool pool) {
  std::lock_guard<std::mutex> lk(g_stats_mu);
  return g_stats[static_cast<int>(pool)];
}

void memory_stats_reset_peak() {
  std::lock_guard<std::mutex> lk(g_stats_mu);
  for (auto& s : g_stats) s.peak_bytes = s.bytes;
}

namespace {

constexpr size_t kCacheMin = size_t{1} << 20;    // smaller blocks go straight to malloc/free
constexpr size_t kCacheLimit = size_t{1} << 30;  // most bytes kept idle

// Large blocks: those handed out (with their capacity) and those freed and kept for reuse.
// Under AddressSanitizer nothing is kept, so that a use after free is still reported.
struct LargeBlocks {
  std::mutex mu;
  std::unordered_map<void*, size_t> live;
  std::multimap<size_t, void*> idle;  // capacity -> block
  size_t idle_bytes = 0;
};

LargeBlocks& large_blocks() {
  static LargeBlocks* b = new LargeBlocks;  // never destroyed: buffers may be freed during exit
  return *b;
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kKeepIdle = false;
#else
constexpr bool kKeepIdle = true;
#endif

}  // namespace

std::string bytes_str(uint64_t n) {
  char buf[64];
  recurra_format_bytes(buf, sizeof buf, n);
  return buf;
}

namespace {

// The host's memory: {available, total} in bytes (Linux: MemAvailable and MemTotal of
// /proc/meminfo; elsewhere the physical pages, available unknown = 0).
std::pair<uint64_t, uint64_t> host_memory() {
  uint64_t avail = 0, total = 0;
#if defined(__linux__)
  if (FILE* f = std::fopen("/proc/meminfo", "r")) {
    char key[64];
    unsigned long long kb = 0;
    while (std::fscanf(f, "%63s %llu kB\n", key, &kb) == 2) {
      if (std::strcmp(key, "MemAvailable:") == 0) avail = kb << 10;
      if (std::strcmp(key, "MemTotal:") == 0) total = kb << 10;
    }
    std::fclose(f);
  }
#endif
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  if (!total) total = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
#endif
  return {avail, total};
}

[[noreturn]] void host_out_of_memory(const char* pool, size_t bytes) {
  const auto [avail, total] = host_memory();
  throw OutOfMemory("recurra: out of host memory: the " + std::string(pool) + " pool asked for " + bytes_str(bytes) +
                    "; the host has " + (avail ? bytes_str(avail) : std::string("an unknown amount")) +
                    " available of " + bytes_str(total) + ", recurra holds " +
                    bytes_str(static_cast<uint64_t>(memory_stats(Pool::persistent).bytes)) + " persistent + " +
                    bytes_str(static_cast<uint64_t>(memory_stats(Pool::transient).bytes)) + " transient; " +
                    RECURRA_OOM_HINT);
}

}  // namespace

void* host_alloc(size_t bytes, const char* pool) {
  constexpr size_t kHuge = size_t{4} << 20, kHugeAlign = size_t{2} << 20;
  if (bytes > (SIZE_MAX >> 1)) host_out_of_memory(pool, bytes);
  size_t cap = (bytes + 63) / 64 * 64;
  if (cap == 0) cap = 64;
  LargeBlocks& lb = large_blocks();
  if (cap >= kCacheMin) {
    std::lock_guard<std::mutex> lk(lb.mu);
    auto it = lb.idle.lower_bound(cap);
    if (it != lb.idle.end() && it->first <= cap + cap / 8) {
      void* p = it->second;
      lb.live.emplace(p, it->first);
      lb.idle_bytes -= it->first;
      lb.idle.erase(it);
      return p;
    }
  }
  const bool huge = cap >= kHuge;
  void* p = nullptr;
  if (posix_memalign(&p, huge ? kHugeAlign : 64, cap) != 0 || !p) {
    host_cache_clear();  // memory may be short because of what is kept: try once more
    if (posix_memalign(&p, huge ? kHugeAlign : 64, cap) != 0 || !p) host_out_of_memory(pool, bytes);
  }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (huge) madvise(p, cap, MADV_HUGEPAGE);  // only a hint: a kernel without THP refuses it
#endif
  if (cap >= kCacheMin) {
    std::lock_guard<std::mutex> lk(lb.mu);
    lb.live.emplace(p, cap);
  }
  return p;
}

void host_free(void* p) {
  if (!p) return;
  LargeBlocks& lb = large_blocks();
  {
    std::lock_guard<std::mutex> lk(lb.mu);
    auto it = lb.live.find(p);
    if (it != lb.live.end()) {
      const size_t cap = it->second;
      lb.live.erase(it);
      if (kKeepIdle && cap <= kCacheLimit) {
        lb.idle.emplace(cap, p);
        lb.idle_bytes += cap;
        while (lb.idle_bytes > kCacheLimit) {  // drop the largest idle blocks first
          auto last = std::prev(lb.idle.end());
          lb.idle_bytes -= last->first;
          std::free(last->second);
          lb.idle.erase(last);
        }
        return;
      }
    }
  }
  std::free(p);
}

size_t host_cache_bytes() {
  LargeBlocks& lb = large_blocks();
  std::lock_guard<std::mutex> lk(lb.mu);
  return lb.idle_bytes;
}

void host_cache_clear() {
  LargeBlocks& lb = large_blocks();
  std::lock_guard<std::mutex> lk(lb.mu);
  for (auto& [cap, p] : lb.idle) std::free(p);
  lb.idle.clear();
  lb.idle_bytes = 0;
}

HostBuffer::HostBuffer(size_t bytes, Pool pool) : nbytes_(bytes), pool_(pool) {
  data_ = host_alloc(bytes, pool == Pool::persistent ? "persistent" : "transient");
  memory_stats_adjust(pool_, static_cast<int64_t>(bytes));
}

HostBuffer::~HostBuffer() {
  host_free(data_);
  memory_stats_adjust(pool_, -static_cast<int64_t>(nbytes_));
}

}  // namespace recurra

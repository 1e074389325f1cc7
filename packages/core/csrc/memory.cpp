#include "memory.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace recurra {

namespace {
std::mutex g_mu;
PoolStats g_stats[2];
}  // namespace

void memory_stats_adjust(Pool pool, int64_t delta) {
  std::lock_guard<std::mutex> lk(g_mu);
  PoolStats& s = g_stats[static_cast<int>(pool)];
  s.bytes += delta;
  if (delta > 0) s.n_allocs++;
  if (s.bytes > s.peak_bytes) s.peak_bytes = s.bytes;
}

PoolStats memory_stats(Pool pool) {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_stats[static_cast<int>(pool)];
}

void memory_stats_reset_peak() {
  std::lock_guard<std::mutex> lk(g_mu);
  for (auto& s : g_stats) s.peak_bytes = s.bytes;
}

void* host_alloc(size_t bytes) {
  constexpr size_t kHuge = size_t{4} << 20, kHugeAlign = size_t{2} << 20;
  const bool huge = bytes >= kHuge;
  size_t cap = (bytes + 63) / 64 * 64;
  if (cap == 0) cap = 64;
  void* p = nullptr;
  if (posix_memalign(&p, huge ? kHugeAlign : 64, cap) != 0 || !p) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (huge) madvise(p, cap, MADV_HUGEPAGE);  // only a hint: a kernel without THP refuses it
#endif
  return p;
}

HostBuffer::HostBuffer(size_t bytes, Pool pool) : nbytes_(bytes), pool_(pool) {
  data_ = host_alloc(bytes);
  memory_stats_adjust(pool_, static_cast<int64_t>(bytes));
}

HostBuffer::~HostBuffer() {
  std::free(data_);
  memory_stats_adjust(pool_, -static_cast<int64_t>(nbytes_));
}

}  // namespace recurra

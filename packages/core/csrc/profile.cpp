#include "profile.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace recurra {

namespace {
std::atomic<bool> g_on{false};
std::atomic<bool> g_by_shape{false};
std::mutex g_profile_mu;
struct Totals {
  int64_t calls = 0, ns = 0;
};
std::unordered_map<std::string, Totals>& table() {
  static auto* t = new std::unordered_map<std::string, Totals>();  // outlives static dtors
  return *t;
}
}  // namespace

void profile_enable(bool on, bool by_shape) {
  g_by_shape.store(by_shape, std::memory_order_relaxed);
  g_on.store(on, std::memory_order_relaxed);
}

bool profile_enabled() { return g_on.load(std::memory_order_relaxed); }
bool profile_by_shape() { return g_by_shape.load(std::memory_order_relaxed); }

void profile_record(const std::string& key, int64_t ns) {
  std::lock_guard<std::mutex> lk(g_profile_mu);
  Totals& t = table()[key];
  t.calls += 1;
  t.ns += ns;
}

std::vector<ProfileEntry> profile_snapshot() {
  std::vector<ProfileEntry> out;
  {
    std::lock_guard<std::mutex> lk(g_profile_mu);
    for (const auto& [k, t] : table()) out.push_back({k, t.calls, t.ns});
  }
  std::sort(out.begin(), out.end(), [](const ProfileEntry& a, const ProfileEntry& b) {
    return a.ns != b.ns ? a.ns > b.ns : a.key < b.key;
  });
  return out;
}

void profile_reset() {
  std::lock_guard<std::mutex> lk(g_profile_mu);
  table().clear();
}

}  // namespace recurra

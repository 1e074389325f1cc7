// An op profiler: wall time per op of every CPU node that Graph::compute runs, summed over
// calls, while it is on. Off by default (one relaxed atomic load per node then). Keys are the
// op name, or with `by_shape` the op name and the shapes of its sources and result, so that
// a user can see which matmul of a model is slow. Device splits are timed as one entry per
// backend ("<backend> split"), as their nodes run asynchronously there.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace recurra {

struct ProfileEntry {
  std::string key;
  int64_t calls = 0;
  int64_t ns = 0;
};

// Turns profiling on or off; on clears nothing (see profile_reset).
void profile_enable(bool on, bool by_shape);
bool profile_enabled();
bool profile_by_shape();
// Adds one call of `ns` nanoseconds to `key`.
void profile_record(const std::string& key, int64_t ns);
// The entries recorded since the start or the last reset, most time first.
std::vector<ProfileEntry> profile_snapshot();
void profile_reset();

}  // namespace recurra

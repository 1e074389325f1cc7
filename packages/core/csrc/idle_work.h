// Work a pool worker may do while it waits for the next job: threadpool.cpp calls it from
// its spin loop between two jobs. ops/gemv.cpp defines it: it streams the start of the next
// matrix-vector product's weights into the cache (see there), so that the memory is busy
// while the calling thread runs a token step's small nodes alone.
#pragma once

#include <atomic>
#include <cstdint>

namespace recurra {

// Does one piece of pending idle work, if there is any; returns whether it did. It stops
// early once `epoch` differs from `seen` (the pool has a new job: the worker is wanted).
bool gemv_idle_work(const std::atomic<uint64_t>& epoch, uint64_t seen);

}  // namespace recurra

// Memory accounting and host buffers.
//
// Two pools, as in docs/design.md ("Memory"): the *persistent* pool holds what outlives a step (weights,
// optimizer state, any tensor the user keeps); the *transient* pool holds the arenas of
// planned graphs (activations and gradients of one step). memory_stats() reports both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common.h"

namespace recurra {

enum class Pool : int { persistent = 0, transient = 1 };

struct PoolStats {
  int64_t bytes = 0;       // in use now
  int64_t peak_bytes = 0;  // most ever in use at once
  int64_t n_allocs = 0;    // allocations made so far
};

void memory_stats_adjust(Pool pool, int64_t delta_bytes);

// Host memory for tensors, arenas and kernel scratch; give it back with host_free. 64-byte
// aligned; blocks of 4 MiB and more are 2 MiB aligned and advised to use transparent huge
// pages (as numpy does for its arrays): a kernel that walks a large array with strides would
// otherwise miss the TLB on almost every row. Freed blocks of 1 MiB and more are kept (up
// to 1 GiB in all) and handed out again for a request of up to 1/8 less: a training step
// allocates the same large buffers every time, and fresh pages cost a page fault and the
// kernel's zeroing each (about a tenth of a Mamba scan's backward). Throws OutOfMemory
// naming `pool` (what the memory is for), the bytes asked and the host's free memory.
void* host_alloc(size_t bytes, const char* pool = "internal (kernel scratch)");
void host_free(void* p);
size_t host_cache_bytes();  // bytes of freed blocks kept for reuse
void host_cache_clear();    // gives them back to the system
PoolStats memory_stats(Pool pool);
// "1.50 GiB (1610612736 bytes)", "3.00 MiB (3145728 bytes)", "512 bytes"
std::string bytes_str(uint64_t n);
void memory_stats_reset_peak();

// A 64-byte-aligned block of host memory counted in one pool. Owned through shared_ptr by
// the Python objects that use it; `generation` changes when it is released, so a handle
// that outlived it can tell.
class HostBuffer {
 public:
  HostBuffer(size_t bytes, Pool pool);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Pool pool_;
};

}  // namespace recurra

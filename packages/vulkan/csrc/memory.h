// Device memory: large blocks sub-allocated into buffers, and handles with generations.
//
// Drivers cap the number of VkDeviceMemory allocations (4096 on many), so memory comes in
// blocks (64-256 MiB, see Device) each carrying one VkBuffer with a device address; a
// recurra_buffer is a range of a block. Shaders reach memory through buffer device
// addresses, so a sub-allocation is nothing more than block address + offset.
//
// A recurra_buffer is {handle = slot + 1, generation, nbytes}. Freeing a buffer clears its
// slot's generation; every lookup compares generations, so a stale copy of a handle is an
// error (RECURRA_ERR_INVALID) instead of a read of memory that now belongs to someone else.
#pragma once

#include <functional>
#include <map>
#include <vector>

#include "common.h"

namespace recurra_vk {

// Device memory free for new allocations on heap `heap` of `pd`: the driver's budget minus
// its usage with VK_EXT_memory_budget (`has_budget`), else the heap's size minus
// `reserved` (what recurra holds). RECURRA_VK_MEMORY_LIMIT_MB (a test or GPU-sharing cap on
// what recurra reserves) lowers it further.
uint64_t free_device_bytes(VkPhysicalDevice pd, uint32_t heap, bool has_budget, uint64_t reserved);
// RECURRA_VK_MEMORY_LIMIT_MB in bytes, or 0 when unset.
uint64_t memory_limit_env();
// "1.50 GiB (1610612736 bytes)", "3.00 MiB (3145728 bytes)", "512 bytes"
std::string bytes_str(uint64_t n);

// A range of one block.
struct Allocation {
  uint32_t block = 0;
  VkDeviceSize offset = 0;
  VkDeviceSize size = 0;    // reserved bytes (aligned)
  VkDeviceSize nbytes = 0;  // bytes asked for: what copies and views may touch
};

class DeviceMemory {
 public:
  // host_visible_preferred: put blocks in host-visible device memory when there is such
  // (CPU and integrated devices), so copies are plain memcpy.
  // heap: the device-local heap whose size and budget the error messages report.
  DeviceMemory(VkDevice dev, VkPhysicalDevice pd, bool host_visible_preferred, VkDeviceSize block_size,
               VkDeviceSize max_allocation, uint32_t heap, bool has_budget);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  // A new buffer of nbytes (> 0). Throws Error(OOM) when the device is full, with a message
  // naming the pool, the bytes asked, the largest allocation and what is free.
  recurra_buffer alloc(size_t nbytes, bool persistent);
  // The allocation behind a live handle; throws Error(INVALID) naming `what` when stale.
  const Allocation& lookup(const recurra_buffer& b, const char* what) const;
  // Frees a live handle (throws when stale). Returns true when a block became empty and
  // can be released with release_empty_blocks() once the GPU no longer uses it.
  bool free(const recurra_buffer& b);
  // A buffer in host-visible, host-coherent memory (host-cached where the device offers
  // it): a dedicated block the shaders reach like any other buffer and the host reads and
  // writes through `*mapped` (recurra_backend_table::alloc_host). Freed with free().
  recurra_buffer alloc_host(size_t nbytes, uint8_t** mapped);
  // A buffer over n bytes of host memory at p that the caller allocated and keeps mapped
  // until free() (VK_EXT_external_memory_host, after enable_import): used like alloc_host's
  // (host_range finds it), not counted as the device's memory. Throws Error(UNSUPPORTED)
  // where the device cannot import it (no extension, p or n not multiples of the import
  // alignment, memory the driver refuses or cannot make host-coherent).
  recurra_buffer import_host(void* p, size_t n);
  void enable_import(PFN_vkGetMemoryHostPointerPropertiesEXT fn, VkDeviceSize alignment) {
    host_pointer_props_ = fn;
    import_alignment_ = alignment;
  }
  // Whether a live handle is an import_host buffer (free() then destroys its block at once:
  // wait for the GPU first).
  bool imported(const recurra_buffer& b) const;
  // Whether [p, p + n) lies in the mapping of a block of alloc_host(): then *buffer is that
  // block's buffer and *offset the place of p in it (a device copy reaches it directly).
  bool host_range(const void* p, size_t n, VkBuffer* buffer, VkDeviceSize* offset) const;
  // Internal memory (scratch of multi-pass ops), not reachable through handles.
  Allocation alloc_internal(size_t nbytes);
  bool free_internal(const Allocation& a);
  // Gives empty blocks back to the driver (keeps one per pool). Call only when no
  // submitted work can touch them.
  // Frees empty blocks beyond those kept for reuse (all of them with `all`); true when it
  // freed any.
  bool release_empty_blocks(bool all = false);
  // Frees the empty dedicated blocks kept for reuse (waits for the GPU first through `drain`).
  // take() calls it before making a new dedicated block when none of them fits: memory kept
  // for a buffer that no longer comes would otherwise add to the peak.
  bool release_idle_dedicated();
  // Set by the device: waits for every pending submission (before empty blocks are freed to
  // make room for an allocation that found the device full).
  std::function<void()> drain;

  VkDeviceAddress address(const Allocation& a) const { return blocks_[a.block].address + a.offset; }
  VkBuffer vk_buffer(const Allocation& a) const { return blocks_[a.block].buffer; }
  // Host pointer to the allocation, or nullptr when its block is not host-visible.
  uint8_t* mapped(const Allocation& a) const {
    return blocks_[a.block].mapped ? blocks_[a.block].mapped + a.offset : nullptr;
  }
  // What is held: per pool (persistent, transient arena, internal scratch) the bytes in use
  // and their high-water mark; the bytes of device memory reserved (blocks) and its
  // high-water mark; empty blocks kept for reuse.
  struct Stats {
    uint64_t in_use[3] = {}, peak_in_use[3] = {};
    uint64_t reserved = 0, peak_reserved = 0, idle_bytes = 0;
    size_t blocks = 0;
    uint64_t blocks_made = 0;  // since the start: each one a driver allocation
  };
  Stats stats() const;
  void reset_peaks();

  uint64_t bytes_in_use() const { return in_use_; }
  uint64_t bytes_reserved() const { return reserved_; }
  uint64_t free_bytes() const { return free_device_bytes(pd_, heap_, has_budget_, reserved_); }
  size_t block_count() const;

 private:
  enum Pool { kPersistent = 0, kTransient = 1, kInternal = 2 };
  struct Block {
    VkDeviceMemory memory = VK_NULL_HANDLE;
    VkBuffer buffer = VK_NULL_HANDLE;
    VkDeviceAddress address = 0;
    uint8_t* mapped = nullptr;
    VkDeviceSize size = 0, used = 0;
    int pool = kTransient;
    bool dedicated = false;  // made for one large buffer
    bool host = false;       // alloc_host's: host memory, never handed to another buffer
    bool imported = false;   // import_host's: the caller's memory (not mapped, not counted)
    std::map<VkDeviceSize, VkDeviceSize> free;  // offset -> size, coalesced
  };
  struct Slot {
    Allocation a;
    uint64_t generation = 0;  // 0: free slot
  };

  Allocation take(VkDeviceSize size, int pool);
  bool give_back(const Allocation& a);
  // asked: the bytes the caller asked for (what an out-of-memory message reports).
  // host: host-visible, host-coherent memory (cached preferred), always mapped.
  uint32_t new_block(VkDeviceSize size, int pool, bool dedicated, VkDeviceSize asked, bool host = false);
  uint32_t slot_for(const Allocation& a);  // a new handle slot holding `a`
  [[noreturn]] void out_of_memory(int pool, VkDeviceSize asked, const std::string& why) const;
  void destroy_block(Block& b);

  VkDevice dev_;
  VkPhysicalDevice pd_;
  uint32_t heap_;
  bool has_budget_;
  VkPhysicalDeviceMemoryProperties mem_props_{};
  PFN_vkGetMemoryHostPointerPropertiesEXT host_pointer_props_ = nullptr;
  VkDeviceSize import_alignment_ = 0;
  bool host_visible_preferred_;
  VkDeviceSize block_size_, max_allocation_;
  VkDeviceSize keep_bytes_ = 0;  // bytes of empty blocks kept for reuse
  std::vector<Block> blocks_;  // destroyed blocks stay as empty entries (ids are stable)
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_slots_;
  uint64_t next_generation_ = 1;
  uint64_t in_use_ = 0, reserved_ = 0, peak_reserved_ = 0;
  uint64_t pool_in_use_[3] = {}, pool_peak_[3] = {};
  uint64_t blocks_made_ = 0;
};

}  // namespace recurra_vk

#include "memory.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "recurra/format.h"

namespace recurra_vk {

namespace {

constexpr VkDeviceSize kAlign = 256;  // sub-allocation alignment: vec4 loads, cache lines

const char* const kPoolName[3] = {"persistent", "transient arena", "internal (op scratch)"};

// RECURRA_VK_TRACE_BLOCKS=1: each block of device memory made or freed is printed to stderr.
bool trace_blocks() {
  static const bool on = [] {
    const char* v = std::getenv("RECURRA_VK_TRACE_BLOCKS");
    return v && *v && *v != '0';
  }();
  return on;
}

}  // namespace

std::string bytes_str(uint64_t n) {
  char buf[64];
  recurra_format_bytes(buf, sizeof buf, n);
  return buf;
}

uint64_t memory_limit_env() {
  const char* v = std::getenv("RECURRA_VK_MEMORY_LIMIT_MB");
  if (!v || !*v) return 0;
  const unsigned long long mb = std::strtoull(v, nullptr, 10);
  return mb ? static_cast<uint64_t>(mb) << 20 : 0;
}

uint64_t free_device_bytes(VkPhysicalDevice pd, uint32_t heap, bool has_budget, uint64_t reserved) {
  VkPhysicalDeviceMemoryBudgetPropertiesEXT budget{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT};
  VkPhysicalDeviceMemoryProperties2 mp{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2};
  if (has_budget) mp.pNext = &budget;
  vkGetPhysicalDeviceMemoryProperties2(pd, &mp);
  if (heap >= mp.memoryProperties.memoryHeapCount) return 0;
  uint64_t free = 0;
  if (has_budget)
    free = budget.heapBudget[heap] > budget.heapUsage[heap] ? budget.heapBudget[heap] - budget.heapUsage[heap] : 0;
  else
    free = mp.memoryProperties.memoryHeaps[heap].size > reserved ? mp.memoryProperties.memoryHeaps[heap].size - reserved : 0;
  if (const uint64_t limit = memory_limit_env()) free = std::min<uint64_t>(free, limit > reserved ? limit - reserved : 0);
  return free;
}

DeviceMemory::DeviceMemory(VkDevice dev, VkPhysicalDevice pd, bool host_visible_preferred,
                           VkDeviceSize block_size, VkDeviceSize max_allocation, uint32_t heap, bool has_budget)
    : dev_(dev), pd_(pd), heap_(heap), has_budget_(has_budget), host_visible_preferred_(host_visible_preferred),
      block_size_(block_size), max_allocation_(max_allocation) {
  vkGetPhysicalDeviceMemoryProperties(pd, &mem_props_);
  // Empty blocks kept for reuse: a sixteenth of the largest device-local heap (at least
  // 1 GiB). They go first when an allocation finds the device full.
  VkDeviceSize largest = 0;
  for (uint32_t i = 0; i < mem_props_.memoryHeapCount; ++i)
    if (mem_props_.memoryHeaps[i].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT)
      largest = std::max(largest, mem_props_.memoryHeaps[i].size);
  keep_bytes_ = std::max<VkDeviceSize>(VkDeviceSize{1} << 30, largest / 16);
}

void DeviceMemory::out_of_memory(int pool, VkDeviceSize asked, const std::string& why) const {
  const uint64_t heap = heap_ < mem_props_.memoryHeapCount ? mem_props_.memoryHeaps[heap_].size : 0;
  fail(RECURRA_ERR_OOM, "out of device memory: the " + std::string(kPoolName[pool]) + " pool asked for " +
                            bytes_str(asked) + ": " + why + "; this device's largest allocation is " +
                            bytes_str(max_allocation_) + ", " + bytes_str(free_bytes()) + " free of " +
                            bytes_str(heap) + (has_budget_ ? " (VK_EXT_memory_budget)" : "") + ", recurra holds " +
                            bytes_str(reserved_) + " (" + bytes_str(in_use_) + " in use)");
}

DeviceMemory::~DeviceMemory() {
  for (Block& b : blocks_) destroy_block(b);
}

void DeviceMemory::destroy_block(Block& b) {
  if (b.memory && trace_blocks())
    std::fprintf(stderr, "recurra-vulkan: block freed: %s, %s, %s\n", kPoolName[b.pool],
                 b.dedicated ? "dedicated" : "shared", bytes_str(b.size).c_str());
  if (b.buffer) vkDestroyBuffer(dev_, b.buffer, nullptr);
  if (b.memory) {
    if (b.mapped && !b.imported) vkUnmapMemory(dev_, b.memory);
    vkFreeMemory(dev_, b.memory, nullptr);
    if (!b.imported) reserved_ -= b.size;
  }
  b = Block{};
}

size_t DeviceMemory::block_count() const {
  size_t n = 0;
  for (const Block& b : blocks_) n += b.memory != VK_NULL_HANDLE;
  return n;
}

uint32_t DeviceMemory::new_block(VkDeviceSize size, int pool, bool dedicated, VkDeviceSize asked, bool host) {
  if (size > max_allocation_) out_of_memory(pool, asked, "one buffer cannot be that large");
  const uint64_t limit = memory_limit_env();
  if (limit && reserved_ + size > limit)
    out_of_memory(pool, asked, "RECURRA_VK_MEMORY_LIMIT_MB caps what recurra reserves at " + bytes_str(limit));
  Block b;
  b.size = size;
  b.pool = pool;
  b.dedicated = dedicated;
  b.host = host;
  VkBufferCreateInfo bi{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
  bi.size = size;
  bi.usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_TRANSFER_SRC_BIT |
             VK_BUFFER_USAGE_TRANSFER_DST_BIT | VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT;
  bi.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  // The driver running out is an out-of-memory like any other: same message.
  auto refused = [&](VkResult r, const char* what) {
    if (r == VK_ERROR_OUT_OF_DEVICE_MEMORY || r == VK_ERROR_OUT_OF_HOST_MEMORY)
      out_of_memory(pool, asked, std::string(what) + " refused a block of " + bytes_str(size) + " (" +
                                     vk_result_name(r) + ")");
    fail_vk(r, what);
  };
  if (VkResult r = vkCreateBuffer(dev_, &bi, nullptr, &b.buffer); r != VK_SUCCESS) refused(r, "vkCreateBuffer");
  VkMemoryRequirements req;
  vkGetBufferMemoryRequirements(dev_, b.buffer, &req);

  // Pick the memory type: see the header (host-visible device memory on CPU/integrated
  // devices, plain device-local memory on discrete GPUs).
  int best = -1, best_score = -1;
  for (uint32_t i = 0; i < mem_props_.memoryTypeCount; ++i) {
    if (!(req.memoryTypeBits & (1u << i))) continue;
    const VkMemoryPropertyFlags f = mem_props_.memoryTypes[i].propertyFlags;
    const bool local = f & VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT;
    const bool visible = (f & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT) && (f & VK_MEMORY_PROPERTY_HOST_COHERENT_BIT);
    const bool cached = f & VK_MEMORY_PROPERTY_HOST_CACHED_BIT;
    int score = 0;
    if (host) {
      if (!visible) continue;
      score = (cached ? 2 : 0) + (local ? 0 : 1);  // host RAM the CPU reads fast, not the BAR
    } else if (host_visible_preferred_)
      score = (local ? 4 : 0) + (visible ? 2 : 0) + (cached ? 1 : 0);
    else
      score = (local ? 4 : 0) + (visible ? 0 : 2);
    if (score > best_score) best = static_cast<int>(i), best_score = score;
  }
  if (best < 0) {
    vkDestroyBuffer(dev_, b.buffer, nullptr);
    fail(RECURRA_ERR_DEVICE_LOST, "no memory type can hold a storage buffer on this device");
  }
  VkMemoryAllocateFlagsInfo flags{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO};
  flags.flags = VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT;
  VkMemoryAllocateInfo ai{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO};
  ai.pNext = &flags;
  ai.allocationSize = req.size;
  ai.memoryTypeIndex = static_cast<uint32_t>(best);
  VkResult r = vkAllocateMemory(dev_, &ai, nullptr, &b.memory);
  if (r == VK_ERROR_OUT_OF_DEVICE_MEMORY || r == VK_ERROR_OUT_OF_HOST_MEMORY) {
    if (drain) drain();  // the GPU is done with every freed buffer
    if (release_empty_blocks(true)) r = vkAllocateMemory(dev_, &ai, nullptr, &b.memory);  // again
  }
  if (r != VK_SUCCESS) {
    vkDestroyBuffer(dev_, b.buffer, nullptr);
    refused(r, "vkAllocateMemory");
  }
  reserved_ += size;
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  ++blocks_made_;
  if (trace_blocks())
    std::fprintf(stderr, "recurra-vulkan: block made: %s, %s, %s\n", kPoolName[pool],
                 dedicated ? "dedicated" : "shared", bytes_str(size).c_str());
  const VkMemoryPropertyFlags f = mem_props_.memoryTypes[best].propertyFlags;
  try {
    vk_check(vkBindBufferMemory(dev_, b.buffer, b.memory, 0), "vkBindBufferMemory");
    if ((f & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT) && (f & VK_MEMORY_PROPERTY_HOST_COHERENT_BIT) &&
        (host_visible_preferred_ || host)) {
      void* p = nullptr;
      vk_check(vkMapMemory(dev_, b.memory, 0, VK_WHOLE_SIZE, 0, &p), "vkMapMemory");
      b.mapped = static_cast<uint8_t*>(p);
    }
  } catch (...) {
    destroy_block(b);
    throw;
  }
  VkBufferDeviceAddressInfo ad{VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO};
  ad.buffer = b.buffer;
  b.address = vkGetBufferDeviceAddress(dev_, &ad);
  b.free[0] = size;
  for (uint32_t i = 0; i < blocks_.size(); ++i)
    if (blocks_[i].memory == VK_NULL_HANDLE) {
      blocks_[i] = std::move(b);
      return i;
    }
  blocks_.push_back(std::move(b));
  return static_cast<uint32_t>(blocks_.size() - 1);
}

Allocation DeviceMemory::take(VkDeviceSize nbytes, int pool) {
  VkDeviceSize size = align_up(std::max<VkDeviceSize>(nbytes, 4), kAlign);
  // The test cap applies to what is in use, not only to new blocks: a buffer carved from a
  // block already held (large blocks on big GPUs, kept empty blocks) counts as well.
  if (const uint64_t limit = memory_limit_env(); limit && in_use_ + size > limit)
    out_of_memory(pool, nbytes, "RECURRA_VK_MEMORY_LIMIT_MB caps what recurra uses at " + bytes_str(limit));
  if (size > block_size_ / 2) {  // a block of its own: large buffers do not fragment blocks
    // An idle one kept from an earlier graph when one fits (up to a quarter larger): a
    // step that needs the same large scratch every time then allocates nothing.
    // Any pool's: a dedicated block is plain device memory.
    auto fitting = [&] {
      uint32_t id = UINT32_MAX;
      for (uint32_t i = 0; i < blocks_.size(); ++i) {
        const Block& b = blocks_[i];
        if (b.memory && b.dedicated && !b.host && b.used == 0 && b.size >= size && b.size <= size + size / 4 &&
            (id == UINT32_MAX || b.size < blocks_[id].size))
          id = i;
      }
      return id;
    };
    uint32_t id = fitting();
    if (id == UINT32_MAX) {
      release_idle_dedicated();
      id = new_block(size, pool, true, nbytes);
    }
    Block& b = blocks_[id];
    b.free.clear();
    b.used = size;
    b.pool = pool;
    in_use_ += size;
    pool_in_use_[pool] += size;
    pool_peak_[pool] = std::max(pool_peak_[pool], pool_in_use_[pool]);
    return {id, 0, size, nbytes};
  }
  // Best fit over the pool's blocks; else an empty shared block kept from any pool.
  uint32_t best_block = UINT32_MAX;
  VkDeviceSize best_off = 0, best_size = ~VkDeviceSize(0);
  for (uint32_t i = 0; i < blocks_.size(); ++i) {
    const Block& b = blocks_[i];
    if (!b.memory || b.pool != pool || b.dedicated) continue;
    for (const auto& [off, sz] : b.free)
      if (sz >= size && sz < best_size) best_block = i, best_off = off, best_size = sz;
  }
  for (uint32_t i = 0; best_block == UINT32_MAX && i < blocks_.size(); ++i) {
    Block& b = blocks_[i];
    if (b.memory && !b.dedicated && !b.host && b.used == 0 && b.size >= size) {
      b.pool = pool;
      best_block = i, best_off = 0, best_size = b.size;
    }
  }
  if (best_block == UINT32_MAX) {
    best_block = new_block(block_size_, pool, false, nbytes);
    best_off = 0;
    best_size = block_size_;
  }
  Block& b = blocks_[best_block];
  b.free.erase(best_off);
  if (best_size > size) b.free[best_off + size] = best_size - size;
  b.used += size;
  in_use_ += size;
  pool_in_use_[pool] += size;
  pool_peak_[pool] = std::max(pool_peak_[pool], pool_in_use_[pool]);
  return {best_block, best_off, size, nbytes};
}

bool DeviceMemory::give_back(const Allocation& a) {
  Block& b = blocks_[a.block];
  b.used -= a.size;
  in_use_ -= a.size;
  pool_in_use_[b.pool] -= a.size;
  if (b.dedicated) return true;
  auto it = b.free.emplace(a.offset, a.size).first;
  auto nx = std::next(it);
  if (nx != b.free.end() && it->first + it->second == nx->first) {
    it->second += nx->second;
    b.free.erase(nx);
  }
  if (it != b.free.begin()) {
    auto pv = std::prev(it);
    if (pv->first + pv->second == it->first) {
      pv->second += it->second;
      b.free.erase(it);
    }
  }
  return b.used == 0;
}

recurra_buffer DeviceMemory::alloc(size_t nbytes, bool persistent) {
  if (nbytes == 0) fail_invalid("alloc: a buffer needs at least one byte");
  const Allocation a = take(nbytes, persistent ? kPersistent : kTransient);
  const uint32_t slot = slot_for(a);
  recurra_buffer out;
  out.handle = slot + 1;
  out.generation = slots_[slot].generation;
  out.nbytes = nbytes;
  return out;
}

recurra_buffer DeviceMemory::alloc_host(size_t nbytes, uint8_t** mapped) {
  if (nbytes == 0) fail_invalid("alloc_host: a buffer needs at least one byte");
  const VkDeviceSize size = align_up(static_cast<VkDeviceSize>(nbytes), kAlign);
  if (const uint64_t limit = memory_limit_env(); limit && in_use_ + size > limit)
    out_of_memory(kPersistent, nbytes, "RECURRA_VK_MEMORY_LIMIT_MB caps what recurra uses at " + bytes_str(limit));
  const uint32_t id = new_block(size, kPersistent, true, nbytes, true);
  Block& b = blocks_[id];
  if (!b.mapped) {
    destroy_block(b);
    fail(RECURRA_ERR_UNSUPPORTED, "alloc_host: this device has no host-visible, host-coherent memory");
  }
  b.free.clear();
  b.used = size;
  in_use_ += size;
  pool_in_use_[kPersistent] += size;
  pool_peak_[kPersistent] = std::max(pool_peak_[kPersistent], pool_in_use_[kPersistent]);
  const uint32_t slot = slot_for({id, 0, size, nbytes});
  if (mapped) *mapped = b.mapped;
  recurra_buffer out;
  out.handle = slot + 1;
  out.generation = slots_[slot].generation;
  out.nbytes = nbytes;
  return out;
}

recurra_buffer DeviceMemory::import_host(void* p, size_t n) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  const VkDeviceSize align = import_alignment_;
  if (!host_pointer_props_ || !align)
    fail(RECURRA_ERR_UNSUPPORTED, "import_host: this device has no VK_EXT_external_memory_host");
  if (!p || n == 0 || at % align || n % align)
    fail(RECURRA_ERR_UNSUPPORTED, "import_host: the address and size must be nonzero multiples of " +
                                      std::to_string(align) + " bytes (the device's import alignment)");
  constexpr auto kType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT;
  VkMemoryHostPointerPropertiesEXT hp{VK_STRUCTURE_TYPE_MEMORY_HOST_POINTER_PROPERTIES_EXT};
  if (VkResult r = host_pointer_props_(dev_, kType, p, &hp); r != VK_SUCCESS)
    fail(RECURRA_ERR_UNSUPPORTED, std::string("import_host: the driver refuses this memory (") + vk_result_name(r) + ")");
  Block b;
  b.size = n;
  b.pool = kPersistent;
  b.dedicated = b.host = b.imported = true;
  VkExternalMemoryBufferCreateInfo eb{VK_STRUCTURE_TYPE_EXTERNAL_MEMORY_BUFFER_CREATE_INFO};
  eb.handleTypes = kType;
  VkBufferCreateInfo bi{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
  bi.pNext = &eb;
  bi.size = n;
  bi.usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT |
             VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT;
  bi.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  vk_check(vkCreateBuffer(dev_, &bi, nullptr, &b.buffer), "vkCreateBuffer");
  VkMemoryRequirements req;
  vkGetBufferMemoryRequirements(dev_, b.buffer, &req);
  int best = -1, best_score = -1;  // host-coherent, host-cached preferred
  for (uint32_t i = 0; i < mem_props_.memoryTypeCount; ++i) {
    const VkMemoryPropertyFlags f = mem_props_.memoryTypes[i].propertyFlags;
    if (!(req.memoryTypeBits & hp.memoryTypeBits & (1u << i)) || !(f & VK_MEMORY_PROPERTY_HOST_COHERENT_BIT)) continue;
    const int score = (f & VK_MEMORY_PROPERTY_HOST_CACHED_BIT) ? 1 : 0;
    if (score > best_score) best = static_cast<int>(i), best_score = score;
  }
  if (best < 0 || req.size > n) {
    vkDestroyBuffer(dev_, b.buffer, nullptr);
    fail(RECURRA_ERR_UNSUPPORTED, "import_host: no host-coherent memory type of this device takes this memory");
  }
  VkMemoryAllocateFlagsInfo flags{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO};
  flags.flags = VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT;
  VkImportMemoryHostPointerInfoEXT imp{VK_STRUCTURE_TYPE_IMPORT_MEMORY_HOST_POINTER_INFO_EXT};
  imp.pNext = &flags;
  imp.handleType = kType;
  imp.pHostPointer = p;
  VkMemoryAllocateInfo ai{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO};
  ai.pNext = &imp;
  ai.allocationSize = n;
  ai.memoryTypeIndex = static_cast<uint32_t>(best);
  if (VkResult r = vkAllocateMemory(dev_, &ai, nullptr, &b.memory); r != VK_SUCCESS) {
    vkDestroyBuffer(dev_, b.buffer, nullptr);
    fail(RECURRA_ERR_UNSUPPORTED, std::string("import_host: vkAllocateMemory refused the memory (") +
                                      vk_result_name(r) + ")");
  }
  b.mapped = static_cast<uint8_t*>(p);
  if (VkResult r = vkBindBufferMemory(dev_, b.buffer, b.memory, 0); r != VK_SUCCESS) {
    destroy_block(b);
    fail_vk(r, "vkBindBufferMemory");
  }
  VkBufferDeviceAddressInfo ad{VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO};
  ad.buffer = b.buffer;
  b.address = vkGetBufferDeviceAddress(dev_, &ad);
  b.used = n;  // never handed to another buffer, never released as empty
  uint32_t id = static_cast<uint32_t>(blocks_.size());
  for (uint32_t i = 0; i < blocks_.size(); ++i)
    if (blocks_[i].memory == VK_NULL_HANDLE) {
      id = i;
      break;
    }
  if (id == blocks_.size())
    blocks_.push_back(std::move(b));
  else
    blocks_[id] = std::move(b);
  const uint32_t slot = slot_for({id, 0, n, n});
  recurra_buffer out;
  out.handle = slot + 1;
  out.generation = slots_[slot].generation;
  out.nbytes = n;
  return out;
}

bool DeviceMemory::imported(const recurra_buffer& b) const {
  return blocks_[lookup(b, "free").block].imported;
}

bool DeviceMemory::host_range(const void* p, size_t n, VkBuffer* buffer, VkDeviceSize* offset) const {
  const auto at = reinterpret_cast<uintptr_t>(p);
  for (const Block& b : blocks_) {
    if (!b.memory || !b.host || !b.mapped) continue;
    const auto begin = reinterpret_cast<uintptr_t>(b.mapped);
    if (at >= begin && at - begin <= b.size && n <= b.size - (at - begin)) {
      *buffer = b.buffer;
      *offset = at - begin;
      return true;
    }
  }
  return false;
}

uint32_t DeviceMemory::slot_for(const Allocation& a) {
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  slots_[slot].a = a;
  slots_[slot].generation = next_generation_++;
  return slot;
}

const Allocation& DeviceMemory::lookup(const recurra_buffer& b, const char* what) const {
  if (b.handle == 0 || b.handle > slots_.size() || b.generation == 0 ||
      slots_[b.handle - 1].generation != b.generation)
    fail_invalid(std::string(what) + ": stale or unknown buffer handle (handle " + std::to_string(b.handle) +
                 ", generation " + std::to_string(b.generation) +
                 "): the buffer was freed or belongs to another backend");
  return slots_[b.handle - 1].a;
}

bool DeviceMemory::free(const recurra_buffer& b) {
  const Allocation a = lookup(b, "free");
  slots_[b.handle - 1].generation = 0;
  free_slots_.push_back(static_cast<uint32_t>(b.handle - 1));
  if (blocks_[a.block].imported) {  // the caller's memory: let go of it now
    destroy_block(blocks_[a.block]);
    return false;
  }
  return give_back(a);
}

Allocation DeviceMemory::alloc_internal(size_t nbytes) { return take(nbytes, kInternal); }

bool DeviceMemory::free_internal(const Allocation& a) { return give_back(a); }

bool DeviceMemory::release_empty_blocks(bool all) {
  // Keep empty blocks up to keep_bytes_: the next graph (usually the same step again, with
  // the same large scratch buffers and gradients) reuses them instead of allocating (and the
  // driver clearing) them again - once per step when a step needs one block more than it
  // keeps. Shared blocks first (any pool takes them), then dedicated ones.
  VkDeviceSize kept = 0;
  bool released = false;
  std::vector<char> keep(blocks_.size(), 0);
  for (int pass = 0; pass < 2 && !all; ++pass)
    for (size_t k = blocks_.size(); k-- > 0;) {
      const Block& b = blocks_[k];
      if (!b.memory || b.used != 0 || b.host || b.dedicated != (pass == 1)) continue;
      if (kept + b.size <= keep_bytes_) kept += b.size, keep[k] = 1;
    }
  for (size_t k = blocks_.size(); k-- > 0;) {
    Block& b = blocks_[k];
    if (!b.memory || b.used != 0 || keep[k]) continue;
    destroy_block(b);
    released = true;
  }
  return released;
}

bool DeviceMemory::release_idle_dedicated() {
  bool any = false;
  for (const Block& b : blocks_) any |= b.memory && b.dedicated && b.used == 0;
  if (!any) return false;
  if (drain) drain();  // the GPU is done with every freed buffer
  bool released = false;
  for (Block& b : blocks_)
    if (b.memory && b.dedicated && b.used == 0) {
      destroy_block(b);
      released = true;
    }
  return released;
}

DeviceMemory::Stats DeviceMemory::stats() const {
  Stats st;
  for (int p = 0; p < 3; ++p) st.in_use[p] = pool_in_use_[p], st.peak_in_use[p] = pool_peak_[p];
  st.reserved = reserved_;
  st.peak_reserved = peak_reserved_;
  st.blocks_made = blocks_made_;
  for (const Block& b : blocks_)
    if (b.memory) {
      ++st.blocks;
      if (b.used == 0) st.idle_bytes += b.size;
    }
  return st;
}

void DeviceMemory::reset_peaks() {
  for (int p = 0; p < 3; ++p) pool_peak_[p] = pool_in_use_[p];
  peak_reserved_ = reserved_;
}

}  // namespace recurra_vk

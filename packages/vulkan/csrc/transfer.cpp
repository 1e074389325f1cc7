// Copies between the host and device memory (Device::copy_in / copy_out): straight into
// or out of alloc_host memory by one device copy, else through the staging buffer, whose
// two halves take turns.
#include <algorithm>
#include <cstring>

#include "device.h"

namespace recurra_vk {

namespace {
constexpr VkDeviceSize kStagingBytes = 64ull << 20;  // two halves of 32 MiB
}  // namespace

uint64_t Device::submit_copy(VkBuffer src, VkDeviceSize src_offset, VkBuffer dst, VkDeviceSize dst_offset,
                             VkDeviceSize nbytes) {
  Submission& s = acquire();
  VkCommandBufferBeginInfo bi{VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
  bi.flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT;
  vk_check(vkBeginCommandBuffer(s.cb, &bi), "vkBeginCommandBuffer");
  VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
  mb.srcAccessMask = VK_ACCESS_MEMORY_WRITE_BIT | VK_ACCESS_HOST_WRITE_BIT;
  mb.dstAccessMask = VK_ACCESS_TRANSFER_READ_BIT | VK_ACCESS_TRANSFER_WRITE_BIT;
  vkCmdPipelineBarrier(s.cb, VK_PIPELINE_STAGE_ALL_COMMANDS_BIT | VK_PIPELINE_STAGE_HOST_BIT,
                       VK_PIPELINE_STAGE_TRANSFER_BIT, 0, 1, &mb, 0, nullptr, 0, nullptr);
  VkBufferCopy region{};
  region.srcOffset = src_offset;
  region.dstOffset = dst_offset;
  region.size = nbytes;
  vkCmdCopyBuffer(s.cb, src, dst, 1, &region);
  mb.srcAccessMask = VK_ACCESS_TRANSFER_WRITE_BIT;
  mb.dstAccessMask = VK_ACCESS_HOST_READ_BIT | VK_ACCESS_MEMORY_READ_BIT;
  vkCmdPipelineBarrier(s.cb, VK_PIPELINE_STAGE_TRANSFER_BIT, VK_PIPELINE_STAGE_HOST_BIT | VK_PIPELINE_STAGE_ALL_COMMANDS_BIT,
                       0, 1, &mb, 0, nullptr, 0, nullptr);
  submit(s);
  return s.serial;
}

void Device::wait_serial(uint64_t serial) {
  for (auto& s : subs_)  // a submission acquired again since was waited for then
    if (s->pending && s->serial == serial) wait(*s);
}

void Device::staged_copy(const Allocation& a, size_t offset, void* host, size_t nbytes, bool to_device) {
  if (!staging_.buffer) staging_ = make_host_buffer(kStagingBytes, false);
  auto* h = static_cast<uint8_t*>(host);
  // The staging buffer's two halves take turns: the device copies one chunk while the host
  // copies the other (a large download is no longer device copy, wait, memcpy, in turn).
  const size_t half = staging_.size / 2;
  const VkDeviceSize base = a.offset + offset;
  uint64_t serial[2] = {0, 0};  // the last submission on each half (0: none)
  size_t chunk_at[2] = {0, 0}, chunk_n[2] = {0, 0};
  auto finish = [&](int k) {  // waits for half k's copy; a download's chunk goes to the host
    if (!serial[k]) return;
    wait_serial(serial[k]);
    serial[k] = 0;
    if (!to_device) std::memcpy(h + chunk_at[k], staging_.mapped + k * half, chunk_n[k]);
  };
  int k = 0;
  for (size_t done = 0; done < nbytes; done += chunk_n[k], k ^= 1) {
    finish(k);  // the half's previous chunk (two chunks ago)
    const size_t n = std::min(nbytes - done, half);
    uint8_t* part = staging_.mapped + k * half;
    if (to_device) std::memcpy(part, h + done, n);
    chunk_at[k] = done;
    chunk_n[k] = n;
    serial[k] = to_device ? submit_copy(staging_.buffer, k * half, memory_->vk_buffer(a), base + done, n)
                          : submit_copy(memory_->vk_buffer(a), base + done, staging_.buffer, k * half, n);
    finish(k ^ 1);  // the other half's chunk, while this one is copied
  }
  finish(0);
  finish(1);
}

// The allocation of a copy_in / copy_out: the device not lost, bytes [offset, offset + nbytes)
// inside the buffer, a host pointer where there are bytes to copy.
Allocation Device::transfer_range(const recurra_buffer& b, size_t offset, size_t nbytes, const void* host,
                                  const char* what, const char* kind) {
  check_lost();
  const Allocation a = memory_->lookup(b, what);
  if (offset > a.nbytes || nbytes > a.nbytes - offset)
    fail_invalid(std::string(what) + ": bytes [" + std::to_string(offset) + ", " + std::to_string(offset + nbytes) +
                 ") lie outside the buffer of " + std::to_string(a.nbytes) + " bytes");
  if (nbytes && !host) fail_invalid(std::string(what) + ": null " + kind + " pointer");
  return a;
}

void Device::copy_in(const recurra_buffer& dst, size_t offset, const void* src, size_t nbytes) {
  const Allocation a = transfer_range(dst, offset, nbytes, src, "copy_in", "source");
  if (nbytes == 0) return;
  wait_all();
  if (uint8_t* p = memory_->mapped(a)) {
    std::memcpy(p + offset, src, nbytes);
    return;
  }
  VkBuffer hb;
  VkDeviceSize ho;
  if (memory_->host_range(src, nbytes, &hb, &ho)) {  // host-visible memory of this device: one device copy
    wait_serial(submit_copy(hb, ho, memory_->vk_buffer(a), a.offset + offset, nbytes));
    return;
  }
  staged_copy(a, offset, const_cast<void*>(src), nbytes, true);
}

void Device::copy_out(const recurra_buffer& src, size_t offset, void* dst, size_t nbytes) {
  const Allocation a = transfer_range(src, offset, nbytes, dst, "copy_out", "destination");
  if (nbytes == 0) return;
  wait_all();
  if (const uint8_t* p = memory_->mapped(a)) {
    std::memcpy(dst, p + offset, nbytes);
    return;
  }
  VkBuffer hb;
  VkDeviceSize ho;
  if (memory_->host_range(dst, nbytes, &hb, &ho)) {  // into host-visible memory of this device: no staging
    wait_serial(submit_copy(memory_->vk_buffer(a), a.offset + offset, hb, ho, nbytes));
    return;
  }
  staged_copy(a, offset, dst, nbytes, false);
}

}  // namespace recurra_vk

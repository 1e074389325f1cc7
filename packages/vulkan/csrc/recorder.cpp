#include "recorder.h"

#include "device.h"

#include <algorithm>

namespace recurra_vk {

Recorder::Recorder(Device& dev, Submission& sub)
    : dev_(dev), sub_(sub), cb_(sub.cb), profiling_(dev.profiling()), per_dispatch_(dev.profiling_dispatches()) {}

bool Recorder::conflicts(const Range* reads, size_t n_reads, const Range* writes, size_t n_writes) const {
  for (const Range* r = reads; r != reads + n_reads; ++r)
    for (const Range& w : writes_)
      if (overlap(*r, w)) return true;
  for (const Range* w = writes; w != writes + n_writes; ++w) {
    for (const Range& p : writes_)
      if (overlap(*w, p)) return true;
    for (const Range& p : reads_)
      if (overlap(*w, p)) return true;
  }
  return false;
}

void Recorder::barrier() {
  VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
  mb.srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_SHADER_READ_BIT;
  mb.dstAccessMask = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT;
  vkCmdPipelineBarrier(cb_, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, 0, 1, &mb,
                       0, nullptr, 0, nullptr);
  reads_.clear();
  writes_.clear();
}

void Recorder::dispatch_raw(const std::string& module, const std::vector<int32_t>& spec, const void* pc,
                            size_t pc_bytes, uint32_t gx, uint32_t gy, uint32_t gz,
                            const Range* reads, size_t n_reads, const Range* writes, size_t n_writes) {
  if (gx == 0 || gy == 0 || gz == 0) return;
  VkPipeline p = dev_.pipelines().get(module, spec);
  if (conflicts(reads, n_reads, writes, n_writes)) barrier();
  for (const Range* r = reads; r != reads + n_reads; ++r)
    if (r->hi > r->lo) reads_.push_back(*r);
  for (const Range* w = writes; w != writes + n_writes; ++w)
    if (w->hi > w->lo) writes_.push_back(*w);
  if (p != bound_) {
    vkCmdBindPipeline(cb_, VK_PIPELINE_BIND_POINT_COMPUTE, p);
    bound_ = p;
  }
  vkCmdPushConstants(cb_, dev_.pipelines().layout(), VK_SHADER_STAGE_COMPUTE_BIT, 0,
                     static_cast<uint32_t>(pc_bytes), pc);
  const bool mark = per_dispatch_ && 2 * n_profiled_ + 2 <= sub_.query_capacity;
  if (mark) {
    barrier();
    vkCmdWriteTimestamp(cb_, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, sub_.queries, 2 * n_profiled_);
    std::string label = op_ + "/" + module;
    for (size_t k = 0; k < spec.size(); ++k) label += (k ? "," : "[") + std::to_string(spec[k]);
    sub_.profile_ops.push_back(spec.empty() ? label : label + "]");
  }
  vkCmdDispatch(cb_, gx, gy, gz);
  if (mark) {
    barrier();
    vkCmdWriteTimestamp(cb_, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, sub_.queries, 2 * n_profiled_ + 1);
    ++n_profiled_;
  }
}

Recorder::Scratch Recorder::scratch(size_t nbytes) {
  // The smallest scratch an earlier node of this submission released that holds nbytes.
  const VkDeviceSize need = std::max<VkDeviceSize>(4, (nbytes + 255) & ~VkDeviceSize{255});
  size_t best = free_scratch_.size();
  for (size_t k = 0; k < free_scratch_.size(); ++k) {
    const Allocation& c = sub_.scratch[free_scratch_[k]];
    if (c.size >= need && (best == free_scratch_.size() || c.size < sub_.scratch[free_scratch_[best]].size)) best = k;
  }
  Allocation a;
  if (best < free_scratch_.size()) {
    node_reused_.push_back(free_scratch_[best]);
    a = sub_.scratch[free_scratch_[best]];
    free_scratch_.erase(free_scratch_.begin() + static_cast<std::ptrdiff_t>(best));
  } else {
    a = dev_.memory().alloc_internal(nbytes);
    sub_.scratch.push_back(a);
  }
  Scratch s;
  s.addr = dev_.memory().address(a);
  s.range = {a.block, a.offset, a.offset + need};
  return s;
}

Recorder::Scratch Recorder::zeroed_word() {
  if (pool_next_ == pool_end_) {
    constexpr uint32_t kWords = 256;
    const Allocation a = dev_.memory().alloc_internal(kWords * 4);
    word_pools_.push_back(sub_.scratch.size());
    sub_.scratch.push_back(a);
    pool_.addr = dev_.memory().address(a);
    pool_.range = {a.block, a.offset, a.offset + kWords * 4};
    pool_next_ = a.offset;
    pool_end_ = pool_.range.hi;
    const FillPC zero{static_cast<uint64_t>(pool_.addr), kWords, 0u};
    dispatch("fill", {}, zero, 1, 1, 1, {}, {pool_.range});
  }
  Scratch w;
  w.addr = pool_.addr + (pool_next_ - pool_.range.lo);
  w.range = {pool_.range.block, pool_next_, pool_next_ + 4};
  pool_next_ += 4;
  return w;
}

void Recorder::begin_node(const char* op) {
  node_first_scratch_ = sub_.scratch.size();
  node_reused_.clear();
  if (per_dispatch_) op_ = op;  // the label of this node's dispatches
  if (!profiling_ || per_dispatch_) return;
  barrier();  // profiled nodes run one at a time so each one's time is its own
  vkCmdWriteTimestamp(cb_, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, sub_.queries, 2 * n_profiled_);
  sub_.profile_ops.push_back(op);
}

void Recorder::end_node() {
  // The node's scratch is free for the next nodes (see Recorder::Scratch).
  for (size_t k = node_first_scratch_; k < sub_.scratch.size(); ++k)
    if (std::find(word_pools_.begin(), word_pools_.end(), k) == word_pools_.end()) free_scratch_.push_back(k);
  free_scratch_.insert(free_scratch_.end(), node_reused_.begin(), node_reused_.end());
  node_reused_.clear();
  node_first_scratch_ = sub_.scratch.size();
  if (!profiling_ || per_dispatch_) return;
  barrier();
  vkCmdWriteTimestamp(cb_, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, sub_.queries, 2 * n_profiled_ + 1);
  ++n_profiled_;
}

}  // namespace recurra_vk

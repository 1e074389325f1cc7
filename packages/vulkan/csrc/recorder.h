// Records the dispatches of one submission and places barriers only where needed.
//
// Every dispatch states the memory it reads and writes (block + byte range). A barrier is
// inserted before a dispatch that reads what an earlier dispatch since the last barrier
// wrote (read-after-write), or writes what one read or wrote (write-after-read/-write: the
// memory planner reuses the buffers of dead tensors). Independent nodes of a split thus run
// concurrently; dependent ones are ordered.
#pragma once

#include <initializer_list>
#include <string>
#include <vector>

#include "common.h"
#include "pipelines.h"

namespace recurra_vk {

class Device;
struct Submission;

struct Range {
  uint32_t block = 0;
  VkDeviceSize lo = 0, hi = 0;  // byte range within the block; empty when lo == hi
};

// fill.comp's push constants: n 4-byte words at d set to bits (Recorder::zeroed_word, the ops'
// fills).
struct FillPC {
  uint64_t d;
  uint32_t n;
  uint32_t bits;
};

inline bool overlap(const Range& a, const Range& b) {
  return a.block == b.block && a.lo < b.hi && b.lo < a.hi;
}

class Recorder {
 public:
  Recorder(Device& dev, Submission& sub);

  Device& device() { return dev_; }

  void dispatch_raw(const std::string& module, const std::vector<int32_t>& spec, const void* pc,
                    size_t pc_bytes, uint32_t gx, uint32_t gy, uint32_t gz,
                    const Range* reads, size_t n_reads, const Range* writes, size_t n_writes);

  // One dispatch of `module` with specialization constants `spec`, push constants `pc`
  // and gx * gy * gz workgroups (none when any is 0).
  template <class PC>
  void dispatch(const std::string& module, const std::vector<int32_t>& spec, const PC& pc, uint32_t gx,
                uint32_t gy, uint32_t gz, std::initializer_list<Range> reads,
                std::initializer_list<Range> writes) {
    static_assert(sizeof(PC) <= kPushConstantBytes, "push constants exceed 128 bytes");
    dispatch_raw(module, spec, &pc, sizeof(PC), gx, gy, gz, reads.begin(), reads.size(), writes.begin(),
                 writes.size());
  }
  // The same with the ranges in vectors (a number of them known only when recording).
  template <class PC>
  void dispatch(const std::string& module, const std::vector<int32_t>& spec, const PC& pc, uint32_t gx,
                uint32_t gy, uint32_t gz, const std::vector<Range>& reads, const std::vector<Range>& writes) {
    static_assert(sizeof(PC) <= kPushConstantBytes, "push constants exceed 128 bytes");
    dispatch_raw(module, spec, &pc, sizeof(PC), gx, gy, gz, reads.data(), reads.size(), writes.data(),
                 writes.size());
  }

  // Device memory for the node being recorded. It stays allocated until the submission
  // completes, but once the node is recorded a later node of the same submission may be
  // handed the same memory: the ranges each dispatch declares make the recorder put a barrier
  // between the two uses. A backward of 24 layers in one submission thus needs the scratch of
  // one layer, not of 24.
  struct Scratch {
    VkDeviceAddress addr = 0;
    Range range;
  };
  Scratch scratch(size_t nbytes);

  // A 4-byte word that is 0 when the dispatches recorded after this call start and that no
  // other dispatch of the submission is handed: the arrival counter of a dispatch whose last
  // workgroup does what must follow all the others (optim.comp). Words come from pools the
  // submission keeps; one fill dispatch zeroes a pool (again at each replay), and the
  // ranges the users declare make the recorder order them after it.
  Scratch zeroed_word();

  // Profiling marks around one node (no-ops unless profiling).
  void begin_node(const char* op);
  void end_node();

  // A full compute-to-compute memory barrier.
  void barrier();

 private:
  bool conflicts(const Range* reads, size_t n_reads, const Range* writes, size_t n_writes) const;

  Device& dev_;
  Submission& sub_;
  VkCommandBuffer cb_;
  bool profiling_, per_dispatch_;
  uint32_t n_profiled_ = 0;
  std::string op_;  // the node being recorded (per-dispatch profile labels)
  std::vector<Range> reads_, writes_;  // since the last barrier
  size_t node_first_scratch_ = 0;      // sub_.scratch index of the node's first new scratch
  std::vector<size_t> node_reused_;    // sub_.scratch indexes the node took from free_scratch_
  std::vector<size_t> free_scratch_;   // sub_.scratch indexes no node holds now
  std::vector<size_t> word_pools_;     // sub_.scratch indexes of zeroed_word's pools (never freed)
  Scratch pool_;                       // the pool zeroed_word hands words from
  VkDeviceSize pool_next_ = 0, pool_end_ = 0;
  VkPipeline bound_ = VK_NULL_HANDLE;
};

}  // namespace recurra_vk

// The Vulkan instance, the devices it offers, and one logical device with its queue,
// memory, pipelines and the ring of in-flight submissions.
//
// Ordering and synchronization (what the core may rely on):
// - compute() records all nodes of a split into ONE command buffer (barriers only between
//   dependent dispatches), submits it once and returns without waiting.
// - synchronize() waits for every submission, then reports errors found by the shaders
//   (out-of-range indices of get_rows / cross_entropy) as RECURRA_ERR_INVALID.
// - copy_in() and copy_out() first wait for all submitted work, then copy synchronously: a
//   buffer read or written by a pending compute is never raced, and a copy_out sees the
//   results of every compute submitted before it.
// - mark() names the work submitted so far; wait_mark() waits for that work only, while
//   later submissions run on (a download recorded into host-visible memory, alloc_host,
//   by a compute is read once its mark is waited for).
// - free() may be called while work using the buffer is in flight: memory is only reused
//   by later submissions on the same queue (ordered by a barrier at the start of every
//   command buffer) and blocks go back to the driver only after a wait.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "coopmat.h"
#include "memory.h"
#include "pipelines.h"

namespace recurra_vk {

constexpr int64_t kMaxIndex = (int64_t(1) << 31) - 1;  // shaders index with 32-bit ints

struct PhysicalDevice {
  VkPhysicalDevice handle = VK_NULL_HANDLE;
  std::string name, kind, driver;  // kind: "gpu", "integrated", "virtual", "cpu"
  uint32_t api_version = 0;
  uint64_t memory_bytes = 0;       // the largest device-local heap
  uint32_t heap = 0;               // its index
  bool memory_budget = false;      // VK_EXT_memory_budget: the driver reports what is free
  // VK_EXT_external_memory_host: buffers over host memory the caller allocated
  // (import_host); addresses and sizes multiples of import_alignment
  bool host_import = false;
  VkDeviceSize import_alignment = 0;
  uint32_t queue_family = 0;
  uint32_t timestamp_bits = 0;
  float timestamp_period_ns = 1.0f;
  uint32_t vk_index = 0;  // position among usable devices (what RECURRA_VULKAN_DEVICE counts)
  VkDeviceSize max_allocation = 0;
  CoopMatCaps coopmat;  // tensor cores through VK_KHR_cooperative_matrix (coopmat.h)
  bool storage16 = false;  // storageBuffer16BitAccess: shaders read and write 2-byte elements
  uint32_t max_shared_bytes = 0;  // maxComputeSharedMemorySize

  // The largest buffer the core may ask for (recurra_device_info::max_buffer_bytes): the
  // device's largest allocation, at most its heap, at most RECURRA_VK_MAX_BUFFER_MB (which
  // forces small arena segments, for tests).
  uint64_t max_buffer_bytes() const;
};

// The process-wide instance and the usable devices, sorted best first (discrete GPUs, then
// integrated, virtual, CPU) and filtered by RECURRA_VULKAN_DEVICE ("1" or "0,2").
class Instance {
 public:
  Instance();  // never throws: failures leave no devices and a reason
  ~Instance();
  Instance(const Instance&) = delete;
  Instance& operator=(const Instance&) = delete;

  VkInstance handle() const { return instance_; }
  const std::vector<PhysicalDevice>& devices() const { return devices_; }
  const std::string& reason() const { return reason_; }  // why there are no (or fewer) devices

 private:
  VkInstance instance_ = VK_NULL_HANDLE;
  std::vector<PhysicalDevice> devices_;
  std::string reason_;
};

// What the kernels need to know of a device's compute limits, queried once when the Device is
// made (the ops read them from there; none queries the driver itself).
struct DeviceLimits {
  uint32_t subgroup_size = 1;         // subgroup size of compute shaders (at least 1)
  uint32_t min_subgroup_size = 1;     // the smallest one a compute shader may get (Vulkan 1.3
                                      // devices with varying sizes report a range)
  uint32_t max_shared_bytes = 32768;  // maxComputeSharedMemorySize
  bool subgroup_shuffle = false;      // compute shaders have the basic and shuffle operations
};

// Error words set by shaders when a run-time index is out of range (see Device::wait_all):
// word i of the device's error buffer becomes nonzero.
enum ShaderError : uint32_t {
  kErrGetRows = 0,
  kErrGetRowsBack = 1,
  kErrCrossEntropy = 2,
  kErrCrossEntropyBack = 3,
  kErrSsmScan = 4,
  kErrSsmScanBack = 5,
  kNumShaderErrors = 6,
};

// Time of one profiled node, filled when its submission completes.
struct ProfileRecord {
  std::string op;
  double seconds = 0.0;
};

class Recorder;

// A recorded command buffer and what must live until its fence signals.
struct Submission {
  VkCommandBuffer cb = VK_NULL_HANDLE;
  VkFence fence = VK_NULL_HANDLE;
  VkQueryPool queries = VK_NULL_HANDLE;
  uint32_t query_capacity = 0;
  bool pending = false;
  uint64_t serial = 0;
  std::vector<Allocation> scratch;      // freed on completion (a kept one's: on eviction)
  std::vector<std::string> profile_ops;  // node i: timestamps 2i, 2i+1
  // A kept submission holds the recording of one node list for replay (see
  // Device::compute); `key` identifies the list, empty while it holds none.
  bool kept = false;
  std::vector<uint8_t> key;
  uint64_t last_use = 0;
};

class Device {
 public:
  explicit Device(const PhysicalDevice& pd);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const PhysicalDevice& info() const { return info_; }
  const DeviceLimits& limits() const { return limits_; }
  // Whether the cooperative-matrix features for the f16 (bf16) shaders were enabled: exactly
  // when the build has the shaders and the device offers what they need (CoopMatCaps::why_not).
  bool coopmat_enabled(bool bf16) const { return bf16 ? coopmat_bf16_ : coopmat_f16_; }
  // Whether shaders may load and store 2-byte elements (storageBuffer16BitAccess, enabled
  // where the device has it): the bfloat16/float16 kernels (shaders/half.glsl) need it.
  bool half_storage() const { return info_.storage16; }

  // --- the table's operations ------------------------------------------------------------
  recurra_buffer alloc(size_t nbytes, bool persistent);
  void free(const recurra_buffer& b);
  void copy_in(const recurra_buffer& dst, size_t offset, const void* src, size_t nbytes);
  void copy_out(const recurra_buffer& src, size_t offset, void* dst, size_t nbytes);
  // Records one split of n nodes into one command buffer and submits it. The device knows
  // no op: the op layer (ops/run.cpp) passes `validate`, which throws to refuse the nodes
  // before anything is recorded, and `record`, which adds their dispatches between the
  // device's opening and closing barriers. A list seen before may be replayed instead
  // (neither is then called).
  void compute(const recurra_node_desc* nodes, int32_t n, const std::function<void()>& validate,
               const std::function<void(Recorder&)>& record);
  void synchronize();
  // Host-visible memory for nodes (DeviceMemory::alloc_host); *host: its address.
  recurra_buffer alloc_host(size_t nbytes, void** host);
  // A buffer over host memory the caller allocated (DeviceMemory::import_host).
  recurra_buffer import_host(void* host, size_t nbytes);
  // The serial of the last submission: waiting for it (wait_mark) waits for everything
  // submitted so far and nothing submitted later.
  uint64_t mark() const { return next_serial_ - 1; }
  // Waits for the pending submissions of serial <= value, oldest first; later ones run on.
  void wait_mark(uint64_t value);

  // --- used by the recorder and the ops ------------------------------------------------------
  VkDevice vk() const { return dev_; }
  DeviceMemory& memory() { return *memory_; }
  Pipelines& pipelines() { return *pipelines_; }
  VkDeviceAddress error_flags_address() const { return errors_.address; }

  // Profiling: RECURRA_VULKAN_PROFILE=1 prints per-node GPU times to stderr; a sink (set by
  // the benchmark entry point) collects them instead.
  void set_profile_sink(std::vector<ProfileRecord>* sink) { sink_ = sink; }
  bool profiling() const { return (profile_env_ || sink_) && info_.timestamp_bits > 0; }
  // RECURRA_VULKAN_PROFILE=dispatch: one time per dispatch ("op/module[spec]") instead of per node.
  bool profiling_dispatches() const { return profile_dispatch_ && profiling(); }
  void set_profile_dispatches(bool on) { profile_dispatch_ = on; }

  // (node lists recorded for replay, node lists replayed) since the device opened
  std::pair<uint64_t, uint64_t> replay_counts() const { return {recorded_, replayed_}; }
 private:
  struct HostBuffer {
    VkBuffer buffer = VK_NULL_HANDLE;
    VkDeviceMemory memory = VK_NULL_HANDLE;
    uint8_t* mapped = nullptr;
    VkDeviceSize size = 0;
    VkDeviceAddress address = 0;
  };
  void release();
  HostBuffer make_host_buffer(VkDeviceSize size, bool device_address);
  void destroy_host_buffer(HostBuffer& b);

  Submission& acquire();
  Submission& new_submission(bool kept);  // a command buffer and fence, added to subs_
  Submission& acquire_kept();  // a kept submission to record into (evicts the least used)
  bool replay(const std::vector<uint8_t>& key);  // resubmits a kept recording of `key`
  void submit(Submission& s);
  void wait(Submission& s);  // waits for one pending submission and retires it
  void wait_all();           // all of them; reports shader-detected errors
  void check_lost() const;
  void staged_copy(const Allocation& a, size_t offset, void* host, size_t nbytes, bool to_device);
  Allocation transfer_range(const recurra_buffer& b, size_t offset, size_t nbytes, const void* host,
                            const char* what, const char* kind);
  // Records and submits one buffer-to-buffer copy (behind all earlier work, visible to the
  // host once done); returns the submission's serial for wait_serial().
  uint64_t submit_copy(VkBuffer src, VkDeviceSize src_offset, VkBuffer dst, VkDeviceSize dst_offset,
                       VkDeviceSize nbytes);
  void wait_serial(uint64_t serial);  // waits for that submission if it is still pending

  PhysicalDevice info_;
  DeviceLimits limits_;
  VkDevice dev_ = VK_NULL_HANDLE;
  VkQueue queue_ = VK_NULL_HANDLE;
  VkCommandPool pool_ = VK_NULL_HANDLE;
  std::unique_ptr<DeviceMemory> memory_;
  std::unique_ptr<Pipelines> pipelines_;
  HostBuffer staging_, errors_;
  std::deque<std::unique_ptr<Submission>> subs_;
  uint64_t next_serial_ = 1;
  bool lost_ = false;
  bool coopmat_f16_ = false, coopmat_bf16_ = false;
  bool blocks_to_release_ = false;
  bool profile_env_ = false;
  bool profile_dispatch_ = false;
  bool replay_enabled_ = true;  // RECURRA_VK_REPLAY=0 records every compute afresh
  uint64_t replay_clock_ = 0;
  uint64_t replayed_ = 0;  // node lists resubmitted from a kept recording
  uint64_t recorded_ = 0;  // node lists of a replayable size recorded afresh (kept for replay)
  std::vector<ProfileRecord>* sink_ = nullptr;
};

}  // namespace recurra_vk

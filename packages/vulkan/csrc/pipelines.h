// Compute pipelines: the embedded SPIR-V modules, one pipeline per (module, specialization
// constants), cached for the life of the device.
//
// Descriptor-free design: every shader reaches its tensors through buffer device addresses
// passed in push constants (with the shapes and strides), so all pipelines share one layout
// with a single 128-byte push-constant range (the minimum every Vulkan device guarantees)
// and no descriptor sets. Recording a node is then vkCmdPushConstants + vkCmdDispatch:
// nothing to allocate, update or cache per dispatch, and a sub-allocated buffer is just an
// address. Variants (op codes, memory layouts) are specialization constants, so the driver
// compiles branch-free code for each.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common.h"

namespace recurra_vk {

constexpr uint32_t kPushConstantBytes = 128;

class Pipelines {
 public:
  explicit Pipelines(VkDevice dev);
  ~Pipelines();
  Pipelines(const Pipelines&) = delete;
  Pipelines& operator=(const Pipelines&) = delete;

  // The pipeline of `module` (a shaders/*.comp variant name) with int specialization
  // constants spec[i] at constant_id i. Built on first use.
  VkPipeline get(const std::string& module, const std::vector<int32_t>& spec);
  VkPipelineLayout layout() const { return layout_; }

 private:
  VkShaderModule shader(const std::string& module);

  VkDevice dev_;
  VkPipelineLayout layout_ = VK_NULL_HANDLE;
  VkPipelineCache cache_ = VK_NULL_HANDLE;
  std::map<std::string, VkShaderModule> shaders_;
  std::map<std::pair<std::string, std::vector<int32_t>>, VkPipeline> pipelines_;
};

}  // namespace recurra_vk

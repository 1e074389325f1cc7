#include "pipelines.h"

#include "spirv_shaders.h"

namespace recurra_vk {

Pipelines::Pipelines(VkDevice dev) : dev_(dev) {
  VkPushConstantRange range{VK_SHADER_STAGE_COMPUTE_BIT, 0, kPushConstantBytes};
  VkPipelineLayoutCreateInfo li{VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO};
  li.pushConstantRangeCount = 1;
  li.pPushConstantRanges = &range;
  vk_check(vkCreatePipelineLayout(dev_, &li, nullptr, &layout_), "vkCreatePipelineLayout");
  VkPipelineCacheCreateInfo ci{VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO};
  if (vkCreatePipelineCache(dev_, &ci, nullptr, &cache_) != VK_SUCCESS) cache_ = VK_NULL_HANDLE;
}

Pipelines::~Pipelines() {
  for (auto& [k, p] : pipelines_) vkDestroyPipeline(dev_, p, nullptr);
  for (auto& [k, s] : shaders_) vkDestroyShaderModule(dev_, s, nullptr);
  if (cache_) vkDestroyPipelineCache(dev_, cache_, nullptr);
  if (layout_) vkDestroyPipelineLayout(dev_, layout_, nullptr);
}

VkShaderModule Pipelines::shader(const std::string& module) {
  auto it = shaders_.find(module);
  if (it != shaders_.end()) return it->second;
  for (const SpirvModule& m : kSpirvModules) {
    if (module != m.name) continue;
    VkShaderModuleCreateInfo si{VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO};
    si.codeSize = m.n_words * sizeof(uint32_t);
    si.pCode = m.words;
    VkShaderModule s;
    vk_check(vkCreateShaderModule(dev_, &si, nullptr, &s), "vkCreateShaderModule");
    shaders_[module] = s;
    return s;
  }
  fail_invalid("internal error: no embedded shader named '" + module + "'");
}

VkPipeline Pipelines::get(const std::string& module, const std::vector<int32_t>& spec) {
  auto key = std::make_pair(module, spec);
  auto it = pipelines_.find(key);
  if (it != pipelines_.end()) return it->second;
  std::vector<VkSpecializationMapEntry> entries(spec.size());
  for (size_t i = 0; i < spec.size(); ++i)
    entries[i] = {static_cast<uint32_t>(i), static_cast<uint32_t>(i * sizeof(int32_t)), sizeof(int32_t)};
  VkSpecializationInfo si{};
  si.mapEntryCount = static_cast<uint32_t>(entries.size());
  si.pMapEntries = entries.data();
  si.dataSize = spec.size() * sizeof(int32_t);
  si.pData = spec.data();
  VkComputePipelineCreateInfo pi{VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO};
  pi.stage.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO;
  pi.stage.stage = VK_SHADER_STAGE_COMPUTE_BIT;
  pi.stage.module = shader(module);
  pi.stage.pName = "main";
  pi.stage.pSpecializationInfo = spec.empty() ? nullptr : &si;
  pi.layout = layout_;
  VkPipeline p;
  vk_check(vkCreateComputePipelines(dev_, cache_, 1, &pi, nullptr, &p),
           ("vkCreateComputePipelines(" + module + ")").c_str());
  pipelines_.emplace(std::move(key), p);
  return p;
}

}  // namespace recurra_vk

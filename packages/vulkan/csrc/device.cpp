#include "device.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "recorder.h"

namespace recurra_vk {

namespace {

constexpr size_t kMaxInFlight = 4;
// Node lists of at least kMinReplayNodes nodes are recorded once and replayed while the same
// list (ops, buffers, offsets, shapes, parameters) comes back: a training step or a traced
// generation step then costs one vkQueueSubmit instead of recording every dispatch again.
constexpr int32_t kMinReplayNodes = 16;
constexpr size_t kMaxReplays = 4;

// Everything a recording depends on: the whole node list, field by field.
std::vector<uint8_t> replay_key(const recurra_node_desc* nodes, int32_t n) {
  std::vector<uint8_t> k;
  k.reserve(static_cast<size_t>(n) * 256);
  auto put = [&k](const void* p, size_t bytes) {
    const auto* b = static_cast<const uint8_t*>(p);
    k.insert(k.end(), b, b + bytes);
  };
  auto put_desc = [&put](const recurra_tensor_desc& d) {
    put(&d.dtype, sizeof d.dtype);
    put(&d.ndim, sizeof d.ndim);
    const int nd = std::max(0, std::min<int>(d.ndim, RECURRA_MAX_DIMS));
    put(d.shape, sizeof(int64_t) * nd);
    put(d.strides, sizeof(int64_t) * nd);
    put(&d.buffer.handle, sizeof d.buffer.handle);
    put(&d.buffer.generation, sizeof d.buffer.generation);
    put(&d.offset, sizeof d.offset);
  };
  for (int32_t i = 0; i < n; ++i) {
    const recurra_node_desc& nd = nodes[i];
    put(nd.op, std::strlen(nd.op) + 1);
    put_desc(nd.dst);
    put(&nd.n_src, sizeof nd.n_src);
    for (int s = 0; s < nd.n_src; ++s) put_desc(nd.src[s]);
    put(&nd.n_ip, sizeof nd.n_ip);
    if (nd.n_ip > 0) put(nd.ip, sizeof(int64_t) * nd.n_ip);
    put(&nd.n_fp, sizeof nd.n_fp);
    if (nd.n_fp > 0) put(nd.fp, sizeof(double) * nd.n_fp);
  }
  return k;
}

std::string version_str(uint32_t v) {
  return std::to_string(VK_API_VERSION_MAJOR(v)) + "." + std::to_string(VK_API_VERSION_MINOR(v)) + "." +
         std::to_string(VK_API_VERSION_PATCH(v));
}

int kind_rank(const std::string& k) {
  if (k == "gpu") return 0;
  if (k == "integrated") return 1;
  if (k == "virtual") return 2;
  if (k == "cpu") return 4;
  return 3;
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0;
}

}  // namespace

const char* vk_result_name(VkResult r) {
  switch (r) {
    case VK_SUCCESS: return "VK_SUCCESS";
    case VK_NOT_READY: return "VK_NOT_READY";
    case VK_TIMEOUT: return "VK_TIMEOUT";
    case VK_ERROR_OUT_OF_HOST_MEMORY: return "VK_ERROR_OUT_OF_HOST_MEMORY";
    case VK_ERROR_OUT_OF_DEVICE_MEMORY: return "VK_ERROR_OUT_OF_DEVICE_MEMORY";
    case VK_ERROR_INITIALIZATION_FAILED: return "VK_ERROR_INITIALIZATION_FAILED";
    case VK_ERROR_DEVICE_LOST: return "VK_ERROR_DEVICE_LOST";
    case VK_ERROR_MEMORY_MAP_FAILED: return "VK_ERROR_MEMORY_MAP_FAILED";
    case VK_ERROR_LAYER_NOT_PRESENT: return "VK_ERROR_LAYER_NOT_PRESENT";
    case VK_ERROR_EXTENSION_NOT_PRESENT: return "VK_ERROR_EXTENSION_NOT_PRESENT";
    case VK_ERROR_FEATURE_NOT_PRESENT: return "VK_ERROR_FEATURE_NOT_PRESENT";
    case VK_ERROR_INCOMPATIBLE_DRIVER: return "VK_ERROR_INCOMPATIBLE_DRIVER";
    case VK_ERROR_TOO_MANY_OBJECTS: return "VK_ERROR_TOO_MANY_OBJECTS";
    default: return "VkResult error";
  }
}

void fail_vk(VkResult r, const std::string& what) {
  const std::string msg = what + " failed: " + vk_result_name(r) + " (" + std::to_string(static_cast<int>(r)) + ")";
  if (r == VK_ERROR_OUT_OF_DEVICE_MEMORY || r == VK_ERROR_OUT_OF_HOST_MEMORY) fail(RECURRA_ERR_OOM, msg);
  fail(RECURRA_ERR_DEVICE_LOST, msg);
}

// ---- instance -----------------------------------------------------------------------------

Instance::Instance() {
  uint32_t loader = VK_API_VERSION_1_0;
  auto enum_version = reinterpret_cast<PFN_vkEnumerateInstanceVersion>(
      vkGetInstanceProcAddr(VK_NULL_HANDLE, "vkEnumerateInstanceVersion"));
  if (enum_version) enum_version(&loader);
  if (loader < VK_API_VERSION_1_2) {
    reason_ = "the Vulkan loader is version " + version_str(loader) + "; recurra-vulkan needs 1.2 or newer";
    return;
  }
  uint32_t n_ext = 0;
  vkEnumerateInstanceExtensionProperties(nullptr, &n_ext, nullptr);
  std::vector<VkExtensionProperties> exts(n_ext);
  vkEnumerateInstanceExtensionProperties(nullptr, &n_ext, exts.data());
  std::vector<const char*> enable;
  bool portability = false;
  for (const auto& e : exts)
    if (std::strcmp(e.extensionName, "VK_KHR_portability_enumeration") == 0) portability = true;
  if (portability) enable.push_back("VK_KHR_portability_enumeration");  // MoltenVK

  std::vector<const char*> layers;
  if (env_flag("RECURRA_VULKAN_VALIDATE")) layers.push_back("VK_LAYER_KHRONOS_validation");

  VkApplicationInfo app{VK_STRUCTURE_TYPE_APPLICATION_INFO};
  app.pApplicationName = "recurra";
  app.pEngineName = "recurra";
  app.apiVersion = VK_API_VERSION_1_2;
  VkInstanceCreateInfo ci{VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO};
  ci.pApplicationInfo = &app;
  ci.enabledExtensionCount = static_cast<uint32_t>(enable.size());
  ci.ppEnabledExtensionNames = enable.data();
  ci.enabledLayerCount = static_cast<uint32_t>(layers.size());
  ci.ppEnabledLayerNames = layers.data();
  if (portability) ci.flags |= 0x00000001;  // VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR
  VkResult r = vkCreateInstance(&ci, nullptr, &instance_);
  if (r != VK_SUCCESS) {
    instance_ = VK_NULL_HANDLE;
    reason_ = std::string("vkCreateInstance failed (") + vk_result_name(r) +
              "): no Vulkan driver is installed or it cannot start";
    return;
  }

  uint32_t n = 0;
  vkEnumeratePhysicalDevices(instance_, &n, nullptr);
  std::vector<VkPhysicalDevice> pds(n);
  vkEnumeratePhysicalDevices(instance_, &n, pds.data());
  std::vector<PhysicalDevice> usable;
  std::string skipped;
  for (VkPhysicalDevice h : pds) {
    VkPhysicalDeviceDriverProperties drv{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES};
    VkPhysicalDeviceMaintenance3Properties m3{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES};
    m3.pNext = &drv;
    VkPhysicalDeviceProperties2 p2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
    p2.pNext = &m3;
    vkGetPhysicalDeviceProperties2(h, &p2);
    const VkPhysicalDeviceProperties& p = p2.properties;
    PhysicalDevice d;
    d.handle = h;
    d.name = p.deviceName;
    d.api_version = p.apiVersion;
    switch (p.deviceType) {
      case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: d.kind = "gpu"; break;
      case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: d.kind = "integrated"; break;
      case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: d.kind = "virtual"; break;
      case VK_PHYSICAL_DEVICE_TYPE_CPU: d.kind = "cpu"; break;
      default: d.kind = "other"; break;
    }
    if (p.apiVersion < VK_API_VERSION_1_2) {
      skipped += "; " + d.name + ": Vulkan " + version_str(p.apiVersion) + " (needs 1.2)";
      continue;
    }
    d.driver = std::string(drv.driverName) + (drv.driverInfo[0] ? std::string(" ") + drv.driverInfo : "");
    d.max_allocation = m3.maxMemoryAllocationSize ? m3.maxMemoryAllocationSize : (VkDeviceSize(1) << 32);
    d.timestamp_period_ns = p.limits.timestampPeriod;
    d.max_shared_bytes = p.limits.maxComputeSharedMemorySize;

    VkPhysicalDeviceVulkan12Features f12{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES};
    VkPhysicalDevice16BitStorageFeatures s16{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES};
    VkPhysicalDeviceFeatures2 f2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
    f2.pNext = &f12;
    f12.pNext = &s16;
    vkGetPhysicalDeviceFeatures2(h, &f2);
    d.storage16 = s16.storageBuffer16BitAccess == VK_TRUE;
    if (!f12.bufferDeviceAddress) {
      skipped += "; " + d.name + ": no bufferDeviceAddress";
      continue;
    }
    if (p.limits.maxPushConstantsSize < kPushConstantBytes || p.limits.maxComputeWorkGroupInvocations < 256 ||
        p.limits.maxComputeSharedMemorySize < 32768) {
      skipped += "; " + d.name + ": compute limits too small";
      continue;
    }
    uint32_t nq = 0;
    vkGetPhysicalDeviceQueueFamilyProperties(h, &nq, nullptr);
    std::vector<VkQueueFamilyProperties> qf(nq);
    vkGetPhysicalDeviceQueueFamilyProperties(h, &nq, qf.data());
    int fam = -1;
    for (uint32_t i = 0; i < nq; ++i)
      if (qf[i].queueFlags & VK_QUEUE_COMPUTE_BIT) {
        fam = static_cast<int>(i);
        break;
      }
    if (fam < 0) {
      skipped += "; " + d.name + ": no compute queue";
      continue;
    }
    d.queue_family = static_cast<uint32_t>(fam);
    d.timestamp_bits = qf[fam].timestampValidBits;
    VkPhysicalDeviceMemoryProperties mp;
    vkGetPhysicalDeviceMemoryProperties(h, &mp);
    for (uint32_t i = 0; i < mp.memoryHeapCount; ++i)
      if ((mp.memoryHeaps[i].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) && mp.memoryHeaps[i].size > d.memory_bytes) {
        d.memory_bytes = mp.memoryHeaps[i].size;
        d.heap = i;
      }
    uint32_t n_dext = 0;
    vkEnumerateDeviceExtensionProperties(h, nullptr, &n_dext, nullptr);
    std::vector<VkExtensionProperties> dext(n_dext);
    vkEnumerateDeviceExtensionProperties(h, nullptr, &n_dext, dext.data());
    for (const auto& e : dext)
      if (std::strcmp(e.extensionName, VK_EXT_MEMORY_BUDGET_EXTENSION_NAME) == 0)
        d.memory_budget = true;
      else if (std::strcmp(e.extensionName, VK_EXT_EXTERNAL_MEMORY_HOST_EXTENSION_NAME) == 0)
        d.host_import = true;
    if (d.host_import) {
      VkPhysicalDeviceExternalMemoryHostPropertiesEXT hp{
          VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_EXTERNAL_MEMORY_HOST_PROPERTIES_EXT};
      VkPhysicalDeviceProperties2 hp2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
      hp2.pNext = &hp;
      vkGetPhysicalDeviceProperties2(h, &hp2);
      d.import_alignment = hp.minImportedHostPointerAlignment;
      d.host_import = d.import_alignment > 0;
    }
    d.coopmat = query_coopmat(instance_, h);
    usable.push_back(d);
  }
  std::stable_sort(usable.begin(), usable.end(),
                   [](const PhysicalDevice& a, const PhysicalDevice& b) { return kind_rank(a.kind) < kind_rank(b.kind); });
  for (size_t i = 0; i < usable.size(); ++i) usable[i].vk_index = static_cast<uint32_t>(i);

  const char* sel = std::getenv("RECURRA_VULKAN_DEVICE");
  if (sel && *sel) {
    std::string spec(sel);
    size_t pos = 0;
    while (pos <= spec.size()) {
      size_t comma = spec.find(',', pos);
      std::string tok = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
      pos = comma == std::string::npos ? spec.size() + 1 : comma + 1;
      if (tok.empty()) continue;
      char* end = nullptr;
      long idx = std::strtol(tok.c_str(), &end, 10);
      if (*end != '\0' || idx < 0 || idx >= static_cast<long>(usable.size())) {
        reason_ = "RECURRA_VULKAN_DEVICE=" + spec + ": '" + tok + "' is not a device index in [0, " +
                  std::to_string(usable.size()) + ")";
        devices_.clear();
        return;
      }
      devices_.push_back(usable[idx]);
    }
  } else {
    devices_ = usable;
  }
  if (devices_.empty())
    reason_ = pds.empty() ? "the Vulkan driver reports no devices"
                          : "no usable Vulkan device" + (skipped.empty() ? std::string() : ":" + skipped.substr(1));
  else if (!skipped.empty())
    reason_ = skipped.substr(2);
}

uint64_t PhysicalDevice::max_buffer_bytes() const {
  uint64_t n = max_allocation;
  if (memory_bytes) n = std::min<uint64_t>(n, memory_bytes);
  const char* v = std::getenv("RECURRA_VK_MAX_BUFFER_MB");
  if (v && *v) {
    const unsigned long long mb = std::strtoull(v, nullptr, 10);
    if (mb) n = std::min<uint64_t>(n, static_cast<uint64_t>(mb) << 20);
  }
  return n;
}

Instance::~Instance() {
  if (instance_) vkDestroyInstance(instance_, nullptr);
}

// ---- device -------------------------------------------------------------------------------

namespace {

DeviceLimits query_limits(const PhysicalDevice& pd) {
  VkPhysicalDeviceSubgroupProperties sp{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES};
  VkPhysicalDeviceProperties2 p2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
  p2.pNext = &sp;
#ifdef VK_API_VERSION_1_3
  VkPhysicalDeviceVulkan13Properties p13{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_PROPERTIES};
  const bool v13 = pd.api_version >= VK_API_VERSION_1_3;
  if (v13) sp.pNext = &p13;
#endif
  vkGetPhysicalDeviceProperties2(pd.handle, &p2);
  DeviceLimits l;
  l.subgroup_size = std::max<uint32_t>(1, sp.subgroupSize);
  l.min_subgroup_size = l.subgroup_size;
#ifdef VK_API_VERSION_1_3
  // Devices with varying subgroup sizes (Intel) report the range here.
  if (v13 && p13.minSubgroupSize > 0) l.min_subgroup_size = std::min(l.min_subgroup_size, p13.minSubgroupSize);
#endif
  l.max_shared_bytes = p2.properties.limits.maxComputeSharedMemorySize;
  l.subgroup_shuffle = (sp.supportedStages & VK_SHADER_STAGE_COMPUTE_BIT) &&
                       (sp.supportedOperations & VK_SUBGROUP_FEATURE_BASIC_BIT) &&
                       (sp.supportedOperations & VK_SUBGROUP_FEATURE_SHUFFLE_BIT);
  return l;
}

}  // namespace

Device::Device(const PhysicalDevice& pd) : info_(pd) {
  float prio = 1.0f;
  VkDeviceQueueCreateInfo qi{VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO};
  qi.queueFamilyIndex = info_.queue_family;
  qi.queueCount = 1;
  qi.pQueuePriorities = &prio;
  VkPhysicalDeviceVulkan12Features f12{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES};
  f12.bufferDeviceAddress = VK_TRUE;
  VkPhysicalDeviceFeatures2 f2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
  VkPhysicalDevice16BitStorageFeatures s16{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES};
  s16.storageBuffer16BitAccess = info_.storage16 ? VK_TRUE : VK_FALSE;
  f2.pNext = &s16;
  s16.pNext = &f12;
  // Tensor cores: the features the coopmat shaders need, only where the device offers them
  // all (and the build has the shaders).
  std::vector<const char*> exts;
  VkPhysicalDeviceCooperativeMatrixFeaturesKHR cm{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR};
  VkPhysicalDeviceShaderBfloat16FeaturesKHR bf{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_BFLOAT16_FEATURES_KHR};
  coopmat_f16_ = info_.coopmat.why_not(false).empty();
  coopmat_bf16_ = info_.coopmat.why_not(true).empty();
  if (coopmat_f16_ || coopmat_bf16_) {
    exts.push_back(VK_KHR_COOPERATIVE_MATRIX_EXTENSION_NAME);
    cm.cooperativeMatrix = VK_TRUE;
    f12.vulkanMemoryModel = VK_TRUE;
    f12.shaderFloat16 = coopmat_f16_ ? VK_TRUE : VK_FALSE;
    f12.pNext = &cm;
  }
  if (coopmat_bf16_) {
    exts.push_back(VK_KHR_SHADER_BFLOAT16_EXTENSION_NAME);
    bf.shaderBFloat16Type = VK_TRUE;
    bf.shaderBFloat16CooperativeMatrix = VK_TRUE;
    cm.pNext = &bf;
  }
  if (info_.host_import) exts.push_back(VK_EXT_EXTERNAL_MEMORY_HOST_EXTENSION_NAME);
  VkDeviceCreateInfo ci{VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO};
  ci.pNext = &f2;
  ci.queueCreateInfoCount = 1;
  ci.pQueueCreateInfos = &qi;
  ci.enabledExtensionCount = static_cast<uint32_t>(exts.size());
  ci.ppEnabledExtensionNames = exts.empty() ? nullptr : exts.data();
  vk_check(vkCreateDevice(info_.handle, &ci, nullptr, &dev_), "vkCreateDevice");
  vkGetDeviceQueue(dev_, info_.queue_family, 0, &queue_);
  try {
    VkCommandPoolCreateInfo pi{VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO};
    pi.flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT;
    pi.queueFamilyIndex = info_.queue_family;
    vk_check(vkCreateCommandPool(dev_, &pi, nullptr, &pool_), "vkCreateCommandPool");
    // RECURRA_VULKAN_HOST_VISIBLE=0: buffers as on a discrete GPU (not mapped: copies go
    // through staging, or straight into alloc_host memory) on any device; tests that path.
    const char* hv = std::getenv("RECURRA_VULKAN_HOST_VISIBLE");
    const bool host_visible =
        (info_.kind == "cpu" || info_.kind == "integrated") && !(hv && std::strcmp(hv, "0") == 0);
    VkDeviceSize block = host_visible ? (64ull << 20) : (256ull << 20);
    if (info_.memory_bytes) block = std::min<VkDeviceSize>(block, std::max<VkDeviceSize>(16ull << 20, info_.memory_bytes / 16));
    block = std::min<VkDeviceSize>(block, info_.max_allocation);
    memory_ = std::make_unique<DeviceMemory>(dev_, info_.handle, host_visible, block, info_.max_allocation,
                                             info_.heap, info_.memory_budget);
    if (info_.host_import)
      memory_->enable_import(reinterpret_cast<PFN_vkGetMemoryHostPointerPropertiesEXT>(
                                 vkGetDeviceProcAddr(dev_, "vkGetMemoryHostPointerPropertiesEXT")),
                             info_.import_alignment);
    memory_->drain = [this] {
      for (auto& s : subs_) wait(*s);
    };
    pipelines_ = std::make_unique<Pipelines>(dev_);
    errors_ = make_host_buffer(64, true);
    std::memset(errors_.mapped, 0, 64);
  } catch (...) {
    release();
    throw;
  }
  limits_ = query_limits(info_);
  profile_env_ = env_flag("RECURRA_VULKAN_PROFILE");
  if (const char* rp = std::getenv("RECURRA_VK_REPLAY")) replay_enabled_ = std::strcmp(rp, "0") != 0;
  const char* pe = std::getenv("RECURRA_VULKAN_PROFILE");
  profile_dispatch_ = pe && std::strcmp(pe, "dispatch") == 0;
}

Device::~Device() { release(); }

void Device::release() {
  if (!dev_) return;
  vkDeviceWaitIdle(dev_);
  for (auto& s : subs_) {
    if (s->fence) vkDestroyFence(dev_, s->fence, nullptr);
    if (s->queries) vkDestroyQueryPool(dev_, s->queries, nullptr);
  }
  subs_.clear();
  destroy_host_buffer(staging_);
  destroy_host_buffer(errors_);
  pipelines_.reset();
  memory_.reset();
  if (pool_) vkDestroyCommandPool(dev_, pool_, nullptr);
  vkDestroyDevice(dev_, nullptr);
  dev_ = VK_NULL_HANDLE;
}

Device::HostBuffer Device::make_host_buffer(VkDeviceSize size, bool device_address) {
  HostBuffer b;
  b.size = size;
  VkBufferCreateInfo bi{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
  bi.size = size;
  bi.usage = VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT | VK_BUFFER_USAGE_STORAGE_BUFFER_BIT |
             (device_address ? VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT : 0);
  vk_check(vkCreateBuffer(dev_, &bi, nullptr, &b.buffer), "vkCreateBuffer(host)");
  VkMemoryRequirements req;
  vkGetBufferMemoryRequirements(dev_, b.buffer, &req);
  VkPhysicalDeviceMemoryProperties mp;
  vkGetPhysicalDeviceMemoryProperties(info_.handle, &mp);
  int best = -1, best_score = -1;
  for (uint32_t i = 0; i < mp.memoryTypeCount; ++i) {
    if (!(req.memoryTypeBits & (1u << i))) continue;
    const VkMemoryPropertyFlags f = mp.memoryTypes[i].propertyFlags;
    if (!(f & VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT) || !(f & VK_MEMORY_PROPERTY_HOST_COHERENT_BIT)) continue;
    // Host memory that the CPU reads fast (cached); not the small BAR window.
    int score = ((f & VK_MEMORY_PROPERTY_HOST_CACHED_BIT) ? 2 : 0) + ((f & VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT) ? 0 : 1);
    if (score > best_score) best = static_cast<int>(i), best_score = score;
  }
  if (best < 0) {
    vkDestroyBuffer(dev_, b.buffer, nullptr);
    fail(RECURRA_ERR_DEVICE_LOST, "no host-visible memory type on this device");
  }
  VkMemoryAllocateFlagsInfo flags{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO};
  flags.flags = VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT;
  VkMemoryAllocateInfo ai{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO};
  ai.pNext = device_address ? &flags : nullptr;
  ai.allocationSize = req.size;
  ai.memoryTypeIndex = static_cast<uint32_t>(best);
  VkResult r = vkAllocateMemory(dev_, &ai, nullptr, &b.memory);
  if (r != VK_SUCCESS) {
    vkDestroyBuffer(dev_, b.buffer, nullptr);
    fail_vk(r, "vkAllocateMemory(host)");
  }
  vk_check(vkBindBufferMemory(dev_, b.buffer, b.memory, 0), "vkBindBufferMemory(host)");
  void* p = nullptr;
  vk_check(vkMapMemory(dev_, b.memory, 0, VK_WHOLE_SIZE, 0, &p), "vkMapMemory(host)");
  b.mapped = static_cast<uint8_t*>(p);
  if (device_address) {
    VkBufferDeviceAddressInfo ad{VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO};
    ad.buffer = b.buffer;
    b.address = vkGetBufferDeviceAddress(dev_, &ad);
  }
  return b;
}

void Device::destroy_host_buffer(HostBuffer& b) {
  if (b.buffer) vkDestroyBuffer(dev_, b.buffer, nullptr);
  if (b.memory) vkFreeMemory(dev_, b.memory, nullptr);
  b = HostBuffer{};
}

void Device::check_lost() const {
  if (lost_)
    fail(RECURRA_ERR_DEVICE_LOST, "the Vulkan device '" + info_.name +
                                      "' was lost; its memory is gone: recreate the tensors (restart the process)");
}

// ---- submissions ------------------------------------------------------------------------

Submission& Device::new_submission(bool kept) {
  auto s = std::make_unique<Submission>();
  VkCommandBufferAllocateInfo ai{VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO};
  ai.commandPool = pool_;
  ai.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
  ai.commandBufferCount = 1;
  vk_check(vkAllocateCommandBuffers(dev_, &ai, &s->cb), "vkAllocateCommandBuffers");
  VkFenceCreateInfo fi{VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
  vk_check(vkCreateFence(dev_, &fi, nullptr, &s->fence), "vkCreateFence");
  s->kept = kept;
  subs_.push_back(std::move(s));
  return *subs_.back();
}

Submission& Device::acquire() {
  size_t ordinary = 0;
  for (auto& s : subs_) {
    if (s->kept) continue;
    if (!s->pending) return *s;
    ++ordinary;
  }
  if (ordinary < kMaxInFlight) return new_submission(false);
  Submission* oldest = nullptr;
  for (auto& s : subs_)
    if (!s->kept && (!oldest || s->serial < oldest->serial)) oldest = s.get();
  wait(*oldest);
  return *oldest;
}

Submission& Device::acquire_kept() {
  Submission* lru = nullptr;
  size_t kept = 0;
  for (auto& s : subs_)
    if (s->kept) {
      ++kept;
      if (!lru || s->last_use < lru->last_use) lru = s.get();
    }
  if (kept < kMaxReplays || !lru) {
    lru = &new_submission(true);
  } else {  // evict: its recording and the scratch memory it reads go
    wait(*lru);
    for (const Allocation& a : lru->scratch)
      if (memory_->free_internal(a)) blocks_to_release_ = true;
    lru->scratch.clear();
    lru->key.clear();
    vkResetCommandBuffer(lru->cb, 0);
  }
  lru->last_use = ++replay_clock_;
  return *lru;
}

bool Device::replay(const std::vector<uint8_t>& key) {
  for (auto& s : subs_) {
    if (!s->kept || s->key != key) continue;
    wait(*s);  // a recording is resubmitted only once its last run has finished
    VkSubmitInfo si{VK_STRUCTURE_TYPE_SUBMIT_INFO};
    si.commandBufferCount = 1;
    si.pCommandBuffers = &s->cb;
    VkResult r = vkQueueSubmit(queue_, 1, &si, s->fence);
    if (r != VK_SUCCESS) {
      if (r == VK_ERROR_DEVICE_LOST) lost_ = true;
      fail_vk(r, "vkQueueSubmit");
    }
    s->pending = true;
    s->serial = next_serial_++;
    s->last_use = ++replay_clock_;
    return true;
  }
  return false;
}

void Device::submit(Submission& s) {
  vk_check(vkEndCommandBuffer(s.cb), "vkEndCommandBuffer");
  VkSubmitInfo si{VK_STRUCTURE_TYPE_SUBMIT_INFO};
  si.commandBufferCount = 1;
  si.pCommandBuffers = &s.cb;
  VkResult r = vkQueueSubmit(queue_, 1, &si, s.fence);
  if (r != VK_SUCCESS) {
    if (r == VK_ERROR_DEVICE_LOST) lost_ = true;
    fail_vk(r, "vkQueueSubmit");
  }
  s.pending = true;
  s.serial = next_serial_++;
}

void Device::wait(Submission& s) {
  if (!s.pending) return;
  VkResult r = vkWaitForFences(dev_, 1, &s.fence, VK_TRUE, UINT64_MAX);
  if (r != VK_SUCCESS) {
    if (r == VK_ERROR_DEVICE_LOST) lost_ = true;
    fail_vk(r, "vkWaitForFences");
  }
  s.pending = false;
  vkResetFences(dev_, 1, &s.fence);
  if (!s.kept) {  // a kept recording reads its scratch again when replayed
    for (const Allocation& a : s.scratch)
      if (memory_->free_internal(a)) blocks_to_release_ = true;
    s.scratch.clear();
  }
  if (!s.profile_ops.empty()) {
    const uint32_t n = static_cast<uint32_t>(s.profile_ops.size());
    std::vector<uint64_t> ts(2 * n);
    VkResult q = vkGetQueryPoolResults(dev_, s.queries, 0, 2 * n, ts.size() * sizeof(uint64_t), ts.data(),
                                       sizeof(uint64_t), VK_QUERY_RESULT_64_BIT | VK_QUERY_RESULT_WAIT_BIT);
    const uint64_t mask = info_.timestamp_bits >= 64 ? ~0ull : ((1ull << info_.timestamp_bits) - 1);
    for (uint32_t i = 0; q == VK_SUCCESS && i < n; ++i) {
      const double sec = static_cast<double>((ts[2 * i + 1] - ts[2 * i]) & mask) * info_.timestamp_period_ns * 1e-9;
      if (sink_)
        sink_->push_back({s.profile_ops[i], sec});
      else
        std::fprintf(stderr, "recurra-vulkan[%s] %-20s %12.3f us\n", info_.name.c_str(), s.profile_ops[i].c_str(),
                     sec * 1e6);
    }
    s.profile_ops.clear();
  }
}

void Device::wait_all() {
  std::vector<Submission*> order;
  for (auto& s : subs_)
    if (s->pending) order.push_back(s.get());
  std::sort(order.begin(), order.end(), [](Submission* a, Submission* b) { return a->serial < b->serial; });
  for (Submission* s : order) wait(*s);
  if (blocks_to_release_) {
    memory_->release_empty_blocks();
    blocks_to_release_ = false;
  }
  auto* flags = reinterpret_cast<volatile uint32_t*>(errors_.mapped);
  static const char* const kWhat[kNumShaderErrors] = {
      "get_rows: an index is out of range [0, V)", "get_rows_back: an index is out of range [0, V)",
      "cross_entropy: a target is out of range [0, C)", "cross_entropy_back: a target is out of range [0, C)",
      "ssm_scan: an entry of ids is out of range [0, n_rows)",
      "ssm_scan_back: an entry of ids is out of range [0, n_rows)"};
  std::string what;
  for (uint32_t i = 0; i < kNumShaderErrors; ++i)
    if (flags[i]) {
      flags[i] = 0;
      what += std::string(what.empty() ? "" : ", ") + kWhat[i];
    }
  if (!what.empty()) fail_invalid(what + " (the affected outputs are zero)");
}

void Device::synchronize() {
  check_lost();
  wait_all();
}

recurra_buffer Device::alloc_host(size_t nbytes, void** host) {
  check_lost();
  uint8_t* p = nullptr;
  const recurra_buffer b = memory_->alloc_host(nbytes, &p);
  if (host) *host = p;
  return b;
}

void Device::wait_mark(uint64_t value) {
  check_lost();
  if (value >= next_serial_)
    fail_invalid("wait_mark: " + std::to_string(value) + " names no submission yet (the last is " +
                 std::to_string(next_serial_ - 1) + ")");
  std::vector<Submission*> order;
  for (auto& s : subs_)
    if (s->pending && s->serial <= value) order.push_back(s.get());
  std::sort(order.begin(), order.end(), [](Submission* a, Submission* b) { return a->serial < b->serial; });
  for (Submission* s : order) wait(*s);
}

// ---- memory and copies ------------------------------------------------------------------

recurra_buffer Device::alloc(size_t nbytes, bool persistent) {
  check_lost();
  return memory_->alloc(nbytes, persistent);
}

recurra_buffer Device::import_host(void* host, size_t nbytes) {
  check_lost();
  return memory_->import_host(host, nbytes);
}

void Device::free(const recurra_buffer& b) {
  // The caller's memory is given back at once (it may be unmapped next): after the GPU
  // is done with it.
  if (memory_->imported(b)) wait_all();
  if (memory_->free(b)) blocks_to_release_ = true;
}

// ---- compute ------------------------------------------------------------------------------

void Device::compute(const recurra_node_desc* nodes, int32_t n, const std::function<void()>& validate,
                     const std::function<void(Recorder&)>& record) {
  check_lost();
  if (n < 0 || (n > 0 && !nodes)) fail_invalid("compute: bad node list");
  if (n == 0) return;
  const bool keep = replay_enabled_ && n >= kMinReplayNodes && !profiling();
  std::vector<uint8_t> key;
  if (keep) {
    key = replay_key(nodes, n);
    if (replay(key)) {  // validated and recorded when it was first seen
      ++replayed_;
      return;
    }
    ++recorded_;
  }
  validate();  // before anything is recorded: a failure leaves no half-built work

  Submission& s = keep ? acquire_kept() : acquire();
  VkCommandBufferBeginInfo bi{VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
  bi.flags = keep ? 0 : VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT;
  vk_check(vkBeginCommandBuffer(s.cb, &bi), "vkBeginCommandBuffer");
  try {
    const bool prof = profiling();
    if (prof) {
      // per dispatch: room for up to 64 dispatches a node (later ones go unprofiled)
      const uint32_t need = 2 * static_cast<uint32_t>(n) * (profiling_dispatches() ? 64 : 1);
      if (s.query_capacity < need) {
        if (s.queries) vkDestroyQueryPool(dev_, s.queries, nullptr);
        s.queries = VK_NULL_HANDLE;
        VkQueryPoolCreateInfo qi{VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO};
        qi.queryType = VK_QUERY_TYPE_TIMESTAMP;
        qi.queryCount = std::max<uint32_t>(need, 64);
        vk_check(vkCreateQueryPool(dev_, &qi, nullptr, &s.queries), "vkCreateQueryPool");
        s.query_capacity = qi.queryCount;
      }
      vkCmdResetQueryPool(s.cb, s.queries, 0, need);
    }
    // Earlier submissions (and transfers) wrote memory this one may read: order them.
    VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
    mb.srcAccessMask = VK_ACCESS_MEMORY_WRITE_BIT;
    mb.dstAccessMask = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT;
    vkCmdPipelineBarrier(s.cb, VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, 0, 1, &mb, 0,
                         nullptr, 0, nullptr);
    Recorder rec(*this, s);
    record(rec);
    // Results become visible to the host (copy_out of host-visible memory) and transfers.
    mb.srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT;
    mb.dstAccessMask = VK_ACCESS_HOST_READ_BIT | VK_ACCESS_TRANSFER_READ_BIT;
    vkCmdPipelineBarrier(s.cb, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                         VK_PIPELINE_STAGE_HOST_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT, 0, 1, &mb, 0, nullptr, 0, nullptr);
    submit(s);
    if (keep) s.key = std::move(key);
  } catch (...) {
    if (!s.pending) {
      vkEndCommandBuffer(s.cb);
      vkResetCommandBuffer(s.cb, 0);
      for (const Allocation& a : s.scratch) memory_->free_internal(a);
      s.scratch.clear();
      s.profile_ops.clear();
    }
    throw;
  }
}

}  // namespace recurra_vk

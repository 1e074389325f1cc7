// Diagnoses the cooperative-matrix matmul shaders on a device, without the library: for each
// SPIR-V module given, what the driver reports about its compiled pipeline
// (VK_KHR_pipeline_executable_properties: statistics such as register counts, and internal
// representations, written to files) and, for the standalone bf16 entry
// (shaders/matmul_coopmat.comp's and shaders/matmul_cm2.comp's push constants), its time on
// an S x S x S product of random bf16 matrices (timestamp queries, median of runs) with
// sampled entries checked against a float64 product. At the end the pipeline cache's data is
// written out (the driver's compiled code, for a disassembler).
//
//     g++ -O2 -std=c++17 -Ipackages/vulkan/csrc -Ipackages/core/src/recurra/include
//         packages/vulkan/tools/coopmat_probe.cpp -o coopmat_probe -lvulkan
//     coopmat_probe OUTDIR SIZE NAME:SPV:WG:BM:BN:KT[:C1,C2,...] ...
//
// WG is specialization constant 0 (the workgroup size), C1.. constants 1, 2, ...; KT = 0:
// statistics only (the op shader), else the K granule the module needs (BK * PD). A developer
// tool (issue 18); the benchmarks that count are bench/coopmat.py's.
//
// Entries whose module ends in .cubin (tools/cuda_gemm.cu, built by nvcc) are launched through
// VK_NVX_binary_import where the device offers it: NAME is the kernel, WG its invocations, C1
// the dynamic shared memory in bytes; the kernel's parameters are (A, B, C, M, N, K), the
// buffers' device addresses. The entry occupancy:MODULE.cubin:WG:0:0:0:S1,S2,.. instead prints
// how many workgroups of WG invocations with S bytes of dynamic shared memory run on one
// multiprocessor at once (the shared memory a Vulkan device gives a multiprocessor). Entries
// asking for the device's maxComputeSharedMemorySize or more are not run (on the H200 such a
// launch, or a kernel whose static shared memory reaches it, loses the device).
//
// Where the device has VK_NV_cooperative_matrix2 it is enabled (with every feature offered,
// and maintenance4 for the LocalSizeId that workgroup-scope matrices take) and its features,
// limits and flexible dimensions are printed. shaders/matmul_cm2.comp needs glslang >= 15
// (GL_NV_cooperative_matrix2, GL_EXT_bfloat16), e.g.
//     glslangValidator -V --target-env vulkan1.3 -S comp -DUNROLL=2 matmul_cm2.comp -o cm2.spv
//     coopmat_probe out 4096 c128x256:cm2.spv:256:128:256:32:128,256,32
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "coopmat.h"  // the VK_KHR_cooperative_matrix / VK_KHR_shader_bfloat16 types on old headers

namespace {

#define CHECK(x)                                                                  \
  do {                                                                            \
    VkResult r_ = (x);                                                            \
    if (r_ < 0) {                                                                 \
      std::fprintf(stderr, "%s failed: %d (line %d)\n", #x, int(r_), __LINE__);   \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

struct Entry {
  std::string name, spv;
  uint32_t wg = 0, bm = 0, bn = 0, kt = 0;
  std::vector<int32_t> consts;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t at = 0;
  for (;;) {
    const size_t e = s.find(sep, at);
    out.push_back(s.substr(at, e == std::string::npos ? std::string::npos : e - at));
    if (e == std::string::npos) return out;
    at = e + 1;
  }
}

struct Buffer {
  VkBuffer buf = VK_NULL_HANDLE;
  VkDeviceMemory mem = VK_NULL_HANDLE;
  void* map = nullptr;
  VkDeviceAddress addr = 0;
};

struct Ctx {
  VkPhysicalDevice pd = VK_NULL_HANDLE;
  VkDevice dev = VK_NULL_HANDLE;
  VkQueue queue = VK_NULL_HANDLE;
  uint32_t family = 0;
  VkCommandPool pool = VK_NULL_HANDLE;
  VkPipelineCache cache = VK_NULL_HANDLE;
  bool exec_props = false;
  double ts_period = 1.0;
  VkPhysicalDeviceMemoryProperties mp{};

  Buffer buffer(VkDeviceSize bytes, bool host) {
    Buffer b;
    VkBufferCreateInfo bi{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
    bi.size = bytes;
    bi.usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_TRANSFER_SRC_BIT |
               VK_BUFFER_USAGE_TRANSFER_DST_BIT | VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT;
    CHECK(vkCreateBuffer(dev, &bi, nullptr, &b.buf));
    VkMemoryRequirements req;
    vkGetBufferMemoryRequirements(dev, b.buf, &req);
    const VkMemoryPropertyFlags want = host ? VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
                                            : VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT;
    uint32_t type = UINT32_MAX;
    for (uint32_t i = 0; i < mp.memoryTypeCount && type == UINT32_MAX; ++i)
      if ((req.memoryTypeBits & (1u << i)) && (mp.memoryTypes[i].propertyFlags & want) == want) type = i;
    if (type == UINT32_MAX) {
      std::fprintf(stderr, "no memory type\n");
      std::exit(1);
    }
    VkMemoryAllocateFlagsInfo fi{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO};
    fi.flags = VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT;
    VkMemoryAllocateInfo ai{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO};
    ai.pNext = &fi;
    ai.allocationSize = req.size;
    ai.memoryTypeIndex = type;
    CHECK(vkAllocateMemory(dev, &ai, nullptr, &b.mem));
    CHECK(vkBindBufferMemory(dev, b.buf, b.mem, 0));
    if (host) CHECK(vkMapMemory(dev, b.mem, 0, bytes, 0, &b.map));
    VkBufferDeviceAddressInfo da{VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO};
    da.buffer = b.buf;
    b.addr = vkGetBufferDeviceAddress(dev, &da);
    return b;
  }
  void free(Buffer& b) {
    if (b.map) vkUnmapMemory(dev, b.mem);
    vkDestroyBuffer(dev, b.buf, nullptr);
    vkFreeMemory(dev, b.mem, nullptr);
    b = Buffer{};
  }
  template <class F>
  void submit(F record) {
    VkCommandBufferAllocateInfo ai{VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO};
    ai.commandPool = pool;
    ai.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
    ai.commandBufferCount = 1;
    VkCommandBuffer cb;
    CHECK(vkAllocateCommandBuffers(dev, &ai, &cb));
    VkCommandBufferBeginInfo bi{VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
    bi.flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT;
    CHECK(vkBeginCommandBuffer(cb, &bi));
    record(cb);
    CHECK(vkEndCommandBuffer(cb));
    VkSubmitInfo si{VK_STRUCTURE_TYPE_SUBMIT_INFO};
    si.commandBufferCount = 1;
    si.pCommandBuffers = &cb;
    CHECK(vkQueueSubmit(queue, 1, &si, VK_NULL_HANDLE));
    CHECK(vkQueueWaitIdle(queue));
    vkFreeCommandBuffers(dev, pool, 1, &cb);
  }
};

void barrier(VkCommandBuffer cb) {
  VkMemoryBarrier mb{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
  mb.srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_WRITE_BIT;
  mb.dstAccessMask = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_READ_BIT;
  vkCmdPipelineBarrier(cb, VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, 0, 1, &mb, 0,
                       nullptr, 0, nullptr);
}

void write_file(const std::string& path, const void* data, size_t n) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
}

// What the driver says about the compiled pipeline; returns its shared memory size in bytes
// (0 when not reported).
uint64_t report_executables(Ctx& c, VkPipeline pipe, const std::string& outdir, const std::string& name) {
  uint64_t shared = 0;
  if (!c.exec_props) return shared;
  auto props_fn = reinterpret_cast<PFN_vkGetPipelineExecutablePropertiesKHR>(
      vkGetDeviceProcAddr(c.dev, "vkGetPipelineExecutablePropertiesKHR"));
  auto stats_fn = reinterpret_cast<PFN_vkGetPipelineExecutableStatisticsKHR>(
      vkGetDeviceProcAddr(c.dev, "vkGetPipelineExecutableStatisticsKHR"));
  auto ir_fn = reinterpret_cast<PFN_vkGetPipelineExecutableInternalRepresentationsKHR>(
      vkGetDeviceProcAddr(c.dev, "vkGetPipelineExecutableInternalRepresentationsKHR"));
  VkPipelineInfoKHR pi{VK_STRUCTURE_TYPE_PIPELINE_INFO_KHR};
  pi.pipeline = pipe;
  uint32_t n = 0;
  CHECK(props_fn(c.dev, &pi, &n, nullptr));
  std::vector<VkPipelineExecutablePropertiesKHR> ex(n, {VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_PROPERTIES_KHR});
  CHECK(props_fn(c.dev, &pi, &n, ex.data()));
  for (uint32_t e = 0; e < n; ++e) {
    std::printf("  [%s] executable %u: %s (%s), subgroup %u\n", name.c_str(), e, ex[e].name, ex[e].description,
                ex[e].subgroupSize);
    VkPipelineExecutableInfoKHR ei{VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR};
    ei.pipeline = pipe;
    ei.executableIndex = e;
    uint32_t ns = 0;
    CHECK(stats_fn(c.dev, &ei, &ns, nullptr));
    std::vector<VkPipelineExecutableStatisticKHR> st(ns, {VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR});
    CHECK(stats_fn(c.dev, &ei, &ns, st.data()));
    for (const auto& s : st) {
      if (std::strcmp(s.name, "Shared Memory Size") == 0 && s.format == VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR)
        shared = s.value.u64;
      std::printf("    %s = ", s.name);
      switch (s.format) {
        case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR: std::printf("%u", s.value.b32); break;
        case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR: std::printf("%lld", (long long)s.value.i64); break;
        case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR:
          std::printf("%llu", (unsigned long long)s.value.u64);
          break;
        case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_FLOAT64_KHR: std::printf("%g", s.value.f64); break;
        default: std::printf("?");
      }
      std::printf("  (%s)\n", s.description);
    }
    uint32_t nr = 0;
    if (ir_fn(c.dev, &ei, &nr, nullptr) < 0 || nr == 0) continue;
    std::vector<VkPipelineExecutableInternalRepresentationKHR> ir(
        nr, {VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INTERNAL_REPRESENTATION_KHR});
    CHECK(ir_fn(c.dev, &ei, &nr, ir.data()));
    std::vector<std::vector<char>> data(nr);
    for (uint32_t i = 0; i < nr; ++i) {
      data[i].resize(ir[i].dataSize);
      ir[i].pData = data[i].data();
    }
    CHECK(ir_fn(c.dev, &ei, &nr, ir.data()));
    for (uint32_t i = 0; i < nr; ++i) {
      const std::string file = outdir + "/" + name + ".ir" + std::to_string(i) + (ir[i].isText ? ".txt" : ".bin");
      write_file(file, data[i].data(), ir[i].dataSize);
      std::printf("    internal representation %u: %s (%s), %zu bytes -> %s\n", i, ir[i].name, ir[i].description,
                  ir[i].dataSize, file.c_str());
    }
  }
  return shared;
}

VkPipeline make_pipeline(Ctx& c, const Entry& en, VkPipelineLayout layout) {
  std::ifstream f(en.spv, std::ios::binary);
  std::vector<char> code((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (code.empty() || code.size() % 4) {
    std::fprintf(stderr, "cannot read %s\n", en.spv.c_str());
    std::exit(1);
  }
  VkShaderModuleCreateInfo mi{VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO};
  mi.codeSize = code.size();
  mi.pCode = reinterpret_cast<const uint32_t*>(code.data());
  VkShaderModule mod;
  CHECK(vkCreateShaderModule(c.dev, &mi, nullptr, &mod));
  std::vector<int32_t> vals{int32_t(en.wg)};
  vals.insert(vals.end(), en.consts.begin(), en.consts.end());
  std::vector<VkSpecializationMapEntry> me(vals.size());
  for (uint32_t i = 0; i < vals.size(); ++i) me[i] = {i, i * 4, 4};
  VkSpecializationInfo si{uint32_t(me.size()), me.data(), vals.size() * 4, vals.data()};
  VkComputePipelineCreateInfo ci{VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO};
  if (c.exec_props)
    ci.flags = VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR | VK_PIPELINE_CREATE_CAPTURE_INTERNAL_REPRESENTATIONS_BIT_KHR;
  ci.stage = {VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO};
  ci.stage.stage = VK_SHADER_STAGE_COMPUTE_BIT;
  ci.stage.module = mod;
  ci.stage.pName = "main";
  ci.stage.pSpecializationInfo = &si;
  ci.layout = layout;
  VkPipeline pipe = VK_NULL_HANDLE;
  const VkResult r = vkCreateComputePipelines(c.dev, c.cache, 1, &ci, nullptr, &pipe);
  vkDestroyShaderModule(c.dev, mod, nullptr);
  if (r != VK_SUCCESS) {
    std::printf("%s: vkCreateComputePipelines failed (%d)\n", en.name.c_str(), int(r));
    return VK_NULL_HANDLE;
  }
  return pipe;
}

uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
double from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

struct PC {
  uint64_t a, b, c;
  uint32_t m, n, k;
};

// Times the standalone entry on size^3 (A, B, C device-local); prints TFLOP/s and the worst
// sampled error relative to sum |a| |b|.
// `one` (when given) records one product instead of the pipeline's dispatch.
void time_entry(Ctx& c, const Entry& en, VkPipeline pipe, VkPipelineLayout layout, uint32_t size, Buffer* abc,
                const std::vector<uint16_t>& ha, const std::vector<uint16_t>& hb, Buffer& readback,
                const std::function<void(VkCommandBuffer)>& one = nullptr) {
  if (size % en.bm || size % en.bn || size % en.kt) {
    std::printf("%s: %u is not a multiple of the tile\n", en.name.c_str(), size);
    return;
  }
  PC pc{abc[0].addr, abc[1].addr, abc[2].addr, size, size, size};
  VkQueryPoolCreateInfo qi{VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO};
  qi.queryType = VK_QUERY_TYPE_TIMESTAMP;
  qi.queryCount = 2;
  VkQueryPool qp;
  CHECK(vkCreateQueryPool(c.dev, &qi, nullptr, &qp));
  const int reps = 20, runs = 7;
  auto run = [&](int times, bool timed) {
    c.submit([&](VkCommandBuffer cb) {
      if (timed) vkCmdResetQueryPool(cb, qp, 0, 2);
      if (!one) {
        vkCmdBindPipeline(cb, VK_PIPELINE_BIND_POINT_COMPUTE, pipe);
        vkCmdPushConstants(cb, layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, sizeof(PC), &pc);
      }
      if (timed) vkCmdWriteTimestamp(cb, VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, qp, 0);
      for (int i = 0; i < times; ++i) {
        if (one)
          one(cb);
        else
          vkCmdDispatch(cb, size / en.bn, size / en.bm, 1);
        barrier(cb);
      }
      if (timed) vkCmdWriteTimestamp(cb, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, qp, 1);
    });
  };
  run(3, false);
  std::vector<double> secs;
  for (int r = 0; r < runs; ++r) {
    run(reps, true);
    uint64_t ts[2];
    CHECK(vkGetQueryPoolResults(c.dev, qp, 0, 2, sizeof(ts), ts, 8, VK_QUERY_RESULT_64_BIT | VK_QUERY_RESULT_WAIT_BIT));
    secs.push_back(double(ts[1] - ts[0]) * c.ts_period * 1e-9 / reps);
  }
  vkDestroyQueryPool(c.dev, qp, nullptr);
  std::sort(secs.begin(), secs.end());
  const double sec = secs[secs.size() / 2];
  // Sampled check.
  c.submit([&](VkCommandBuffer cb) {
    VkBufferCopy r{0, 0, VkDeviceSize(size) * size * 4};
    vkCmdCopyBuffer(cb, abc[2].buf, readback.buf, 1, &r);
  });
  const float* out = static_cast<const float*>(readback.map);
  double worst = 0.0;
  uint32_t seed = 12345;
  for (int s = 0; s < 256; ++s) {
    seed = seed * 1664525u + 1013904223u;
    const uint32_t i = (seed >> 8) % size;
    seed = seed * 1664525u + 1013904223u;
    const uint32_t j = (seed >> 8) % size;
    double ref = 0, mag = 0;
    for (uint32_t k = 0; k < size; ++k) {
      const double p = from_bf16(ha[size_t(i) * size + k]) * from_bf16(hb[size_t(k) * size + j]);
      ref += p;
      mag += std::fabs(p);
    }
    worst = std::max(worst, std::fabs(out[size_t(i) * size + j] - ref) / mag);
  }
  const double tf = 2.0 * size * size * double(size) / sec / 1e12;
  std::printf("%s: %.1f TFLOP/s (%.3f ms, min %.3f max %.3f), sampled rel err %.2e %s\n", en.name.c_str(), tf,
              sec * 1e3, secs.front() * 1e3, secs.back() * 1e3, worst, worst < 1e-4 ? "ok" : "WRONG");
  std::fflush(stdout);
}

// A .cubin entry (see the header), through VK_NVX_binary_import.
void run_cubin(Ctx& c, const Entry& en, VkPipelineLayout layout, uint32_t size, Buffer* abc,
               const std::vector<uint16_t>& ha, const std::vector<uint16_t>& hb, Buffer& host) {
  auto make_module = reinterpret_cast<PFN_vkCreateCuModuleNVX>(vkGetDeviceProcAddr(c.dev, "vkCreateCuModuleNVX"));
  auto make_function =
      reinterpret_cast<PFN_vkCreateCuFunctionNVX>(vkGetDeviceProcAddr(c.dev, "vkCreateCuFunctionNVX"));
  auto destroy_module =
      reinterpret_cast<PFN_vkDestroyCuModuleNVX>(vkGetDeviceProcAddr(c.dev, "vkDestroyCuModuleNVX"));
  auto destroy_function =
      reinterpret_cast<PFN_vkDestroyCuFunctionNVX>(vkGetDeviceProcAddr(c.dev, "vkDestroyCuFunctionNVX"));
  auto launch = reinterpret_cast<PFN_vkCmdCuLaunchKernelNVX>(vkGetDeviceProcAddr(c.dev, "vkCmdCuLaunchKernelNVX"));
  std::ifstream f(en.spv, std::ios::binary);
  std::vector<char> code((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (code.empty()) {
    std::printf("%s: cannot read %s\n", en.name.c_str(), en.spv.c_str());
    return;
  }
  VkCuModuleCreateInfoNVX mi{VK_STRUCTURE_TYPE_CU_MODULE_CREATE_INFO_NVX};
  mi.dataSize = code.size();
  mi.pData = code.data();
  VkCuModuleNVX mod;
  CHECK(make_module(c.dev, &mi, nullptr, &mod));
  VkCuFunctionCreateInfoNVX fi{VK_STRUCTURE_TYPE_CU_FUNCTION_CREATE_INFO_NVX};
  fi.module = mod;
  fi.pName = en.name.c_str();
  VkCuFunctionNVX fn;
  CHECK(make_function(c.dev, &fi, nullptr, &fn));
  auto record = [&](VkCommandBuffer cb, uint32_t grid, uint32_t shared, const void* const* params, size_t n) {
    VkCuLaunchInfoNVX li{VK_STRUCTURE_TYPE_CU_LAUNCH_INFO_NVX};
    li.function = fn;
    li.gridDimX = grid;
    li.gridDimY = li.gridDimZ = li.blockDimY = li.blockDimZ = 1;
    li.blockDimX = en.wg;
    li.sharedMemBytes = shared;
    li.paramCount = n;
    li.pParams = params;
    launch(cb, &li);
  };
  if (en.name == "occupancy") {
    // Counters at host-visible addresses: cnt[132..], peak[..] per SM id (below 1024).
    for (int32_t shared : en.consts) {
      std::memset(host.map, 0, 8192);
      uint64_t cnt = host.addr, peak = host.addr + 4096;
      int32_t spin = 2000000;
      const void* params[] = {&cnt, &peak, &spin};
      c.submit([&](VkCommandBuffer cb) { record(cb, 4096, uint32_t(shared), params, 3); });
      const uint32_t* p = static_cast<const uint32_t*>(host.map) + 1024;
      uint32_t lo = UINT32_MAX, hi = 0;
      for (int s = 0; s < 1024; ++s)
        if (p[s]) lo = std::min(lo, p[s]), hi = std::max(hi, p[s]);
      std::printf("occupancy: %u invocations, %d bytes of shared memory: %u to %u workgroups per SM\n", en.wg,
                  shared, lo, hi);
      std::fflush(stdout);
    }
  } else {
    uint64_t a = abc[0].addr, b = abc[1].addr, cc = abc[2].addr;
    int32_t m = int32_t(size), n = int32_t(size), k = int32_t(size);
    const void* params[] = {&a, &b, &cc, &m, &n, &k};
    const uint32_t shared = en.consts.empty() ? 0u : uint32_t(en.consts[0]);
    time_entry(c, en, VK_NULL_HANDLE, layout, size, abc, ha, hb, host, [&](VkCommandBuffer cb) {
      record(cb, (size / en.bm) * (size / en.bn), shared, params, 6);
    });
  }
  destroy_function(c.dev, fn, nullptr);
  destroy_module(c.dev, mod, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s OUTDIR SIZE NAME:SPV:WG:BM:BN:KT[:C1,C2,...] ...\n", argv[0]);
    return 2;
  }
  const std::string outdir = argv[1];
  const uint32_t size = uint32_t(std::stoul(argv[2]));
  std::vector<Entry> entries;
  for (int i = 3; i < argc; ++i) {
    const auto p = split(argv[i], ':');
    if (p.size() < 6) {
      std::fprintf(stderr, "bad entry %s\n", argv[i]);
      return 2;
    }
    Entry e{p[0], p[1], uint32_t(std::stoul(p[2])), uint32_t(std::stoul(p[3])), uint32_t(std::stoul(p[4])),
            uint32_t(std::stoul(p[5])), {}};
    if (p.size() > 6)
      for (const auto& v : split(p[6], ',')) e.consts.push_back(std::stoi(v));
    entries.push_back(e);
  }

  VkApplicationInfo app{VK_STRUCTURE_TYPE_APPLICATION_INFO};
  app.apiVersion = VK_API_VERSION_1_3;
  VkInstanceCreateInfo ici{VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO};
  ici.pApplicationInfo = &app;
  VkInstance inst;
  CHECK(vkCreateInstance(&ici, nullptr, &inst));
  uint32_t npd = 0;
  CHECK(vkEnumeratePhysicalDevices(inst, &npd, nullptr));
  std::vector<VkPhysicalDevice> pds(npd);
  CHECK(vkEnumeratePhysicalDevices(inst, &npd, pds.data()));
  Ctx c;
  VkPhysicalDeviceProperties props{};
  for (VkPhysicalDevice pd : pds) {
    vkGetPhysicalDeviceProperties(pd, &props);
    c.pd = pd;
    if (props.vendorID == 0x10DE) break;
  }
  std::printf("device: %s, driver %u.%u, api %u.%u.%u\n", props.deviceName, props.driverVersion >> 22,
              (props.driverVersion >> 14) & 0xFF, VK_API_VERSION_MAJOR(props.apiVersion),
              VK_API_VERSION_MINOR(props.apiVersion), VK_API_VERSION_PATCH(props.apiVersion));
  c.ts_period = props.limits.timestampPeriod;
  std::printf("maxComputeSharedMemorySize %u, timestampPeriod %g\n", props.limits.maxComputeSharedMemorySize,
              props.limits.timestampPeriod);
  vkGetPhysicalDeviceMemoryProperties(c.pd, &c.mp);

  uint32_t nx = 0;
  vkEnumerateDeviceExtensionProperties(c.pd, nullptr, &nx, nullptr);
  std::vector<VkExtensionProperties> xs(nx);
  vkEnumerateDeviceExtensionProperties(c.pd, nullptr, &nx, xs.data());
  auto has = [&](const char* n) {
    for (const auto& x : xs)
      if (std::strcmp(x.extensionName, n) == 0) return true;
    return false;
  };
  std::printf("extensions with 'cooperative', 'pipeline_executable', 'bfloat16':");
  for (const auto& x : xs)
    if (std::strstr(x.extensionName, "cooperative") || std::strstr(x.extensionName, "pipeline_executable") ||
        std::strstr(x.extensionName, "bfloat16"))
      std::printf(" %s", x.extensionName);
  std::printf("\n");
  auto get_shapes = reinterpret_cast<PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR>(
      vkGetInstanceProcAddr(inst, "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"));
  uint32_t nsh = 0;
  if (get_shapes && get_shapes(c.pd, &nsh, nullptr) == VK_SUCCESS) {
    std::vector<VkCooperativeMatrixPropertiesKHR> sh(nsh);
    for (auto& s : sh) s = VkCooperativeMatrixPropertiesKHR{VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR};
    get_shapes(c.pd, &nsh, sh.data());
    for (const auto& s : sh)
      std::printf("  coopmat %ux%ux%u A%d B%d C%d R%d scope %d sat %u\n", s.MSize, s.NSize, s.KSize, int(s.AType),
                  int(s.BType), int(s.CType), int(s.ResultType), int(s.scope), s.saturatingAccumulation);
  }

  VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR pe{
      VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR};
  VkPhysicalDeviceShaderBfloat16FeaturesKHR bf{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_BFLOAT16_FEATURES_KHR};
  VkPhysicalDeviceCooperativeMatrixFeaturesKHR cm{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR};
  VkPhysicalDevice16BitStorageFeatures s16{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES};
  VkPhysicalDeviceVulkan12Features f12{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES};
  VkPhysicalDeviceVulkan13Features f13{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES};  // maintenance4:
  // LocalSizeId, which glslang emits for a specialized workgroup size with workgroup-scope matrices
  VkPhysicalDeviceCooperativeMatrix2FeaturesNV cm2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_FEATURES_NV};
  VkPhysicalDeviceFeatures2 f2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
  f2.pNext = &f12;
  const bool vk13 = VK_API_VERSION_MINOR(props.apiVersion) >= 3 || VK_API_VERSION_MAJOR(props.apiVersion) > 1;
  f12.pNext = vk13 ? static_cast<void*>(&f13) : static_cast<void*>(&s16);
  f13.pNext = &s16;
  if (has(VK_KHR_COOPERATIVE_MATRIX_EXTENSION_NAME)) s16.pNext = &cm;
  cm.pNext = has(VK_KHR_SHADER_BFLOAT16_EXTENSION_NAME) ? static_cast<void*>(&bf) : nullptr;
  void** tail = has(VK_KHR_SHADER_BFLOAT16_EXTENSION_NAME) ? &bf.pNext : &cm.pNext;
  if (!has(VK_KHR_COOPERATIVE_MATRIX_EXTENSION_NAME)) tail = &s16.pNext;
  const bool want_pe = has(VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME);
  if (want_pe) {
    *tail = &pe;
    tail = &pe.pNext;
  }
  const bool want_cm2 = has(VK_NV_COOPERATIVE_MATRIX_2_EXTENSION_NAME);
  if (want_cm2) *tail = &cm2;
  vkGetPhysicalDeviceFeatures2(c.pd, &f2);  // enable what is offered, but of the core features
  const VkBool32 int16 = f2.features.shaderInt16;  // only shaderInt16 (as the library: no robustness)
  f2.features = VkPhysicalDeviceFeatures{};
  f2.features.shaderInt16 = int16;
  c.exec_props = want_pe && pe.pipelineExecutableInfo;
  std::printf("pipelineExecutableInfo: %d, bf16 coopmat: %u\n", int(c.exec_props), bf.shaderBFloat16CooperativeMatrix);
  if (want_cm2) {  // VK_NV_cooperative_matrix2: features, limits, the flexible dimensions
    std::printf("cooperative_matrix2: workgroupScope %u flexibleDimensions %u reductions %u conversions %u "
                "perElement %u tensorAddressing %u blockLoads %u\n",
                cm2.cooperativeMatrixWorkgroupScope, cm2.cooperativeMatrixFlexibleDimensions,
                cm2.cooperativeMatrixReductions, cm2.cooperativeMatrixConversions,
                cm2.cooperativeMatrixPerElementOperations, cm2.cooperativeMatrixTensorAddressing,
                cm2.cooperativeMatrixBlockLoads);
    VkPhysicalDeviceCooperativeMatrix2PropertiesNV p2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_PROPERTIES_NV};
    VkPhysicalDeviceProperties2 pp{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
    pp.pNext = &p2;
    vkGetPhysicalDeviceProperties2(c.pd, &pp);
    std::printf("  workgroup scope max workgroup %u, flexible max dimension %u, reserved shared memory %u\n",
                p2.cooperativeMatrixWorkgroupScopeMaxWorkgroupSize, p2.cooperativeMatrixFlexibleDimensionsMaxDimension,
                p2.cooperativeMatrixWorkgroupScopeReservedSharedMemory);
    auto get_flex = reinterpret_cast<PFN_vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV>(
        vkGetInstanceProcAddr(inst, "vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV"));
    uint32_t nf = 0;
    if (get_flex && get_flex(c.pd, &nf, nullptr) == VK_SUCCESS) {
      std::vector<VkCooperativeMatrixFlexibleDimensionsPropertiesNV> fl(nf);
      for (auto& f : fl)
        f = VkCooperativeMatrixFlexibleDimensionsPropertiesNV{
            VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_FLEXIBLE_DIMENSIONS_PROPERTIES_NV};
      get_flex(c.pd, &nf, fl.data());
      for (const auto& f : fl)
        std::printf("  flexible %ux%ux%u A%d B%d C%d R%d scope %d sat %u invocations %u\n", f.MGranularity,
                    f.NGranularity, f.KGranularity, int(f.AType), int(f.BType), int(f.CType), int(f.ResultType),
                    int(f.scope), f.saturatingAccumulation, f.workgroupInvocations);
    }
  } else {
    std::printf("cooperative_matrix2: not offered\n");
  }
  std::vector<const char*> exts;
  if (want_cm2) exts.push_back(VK_NV_COOPERATIVE_MATRIX_2_EXTENSION_NAME);
  for (const char* x : {VK_KHR_COOPERATIVE_MATRIX_EXTENSION_NAME, VK_KHR_SHADER_BFLOAT16_EXTENSION_NAME})
    if (has(x)) exts.push_back(x);
  if (c.exec_props) exts.push_back(VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME);
  const bool nvx = has("VK_NVX_binary_import");  // .cubin entries
  if (nvx) exts.push_back("VK_NVX_binary_import");
  std::printf("VK_NVX_binary_import: %s\n", nvx ? "enabled" : "not offered (.cubin entries left out)");

  uint32_t nq = 0;
  vkGetPhysicalDeviceQueueFamilyProperties(c.pd, &nq, nullptr);
  std::vector<VkQueueFamilyProperties> qf(nq);
  vkGetPhysicalDeviceQueueFamilyProperties(c.pd, &nq, qf.data());
  for (uint32_t i = 0; i < nq; ++i)
    if (qf[i].queueFlags & VK_QUEUE_COMPUTE_BIT) {
      c.family = i;
      break;
    }
  float prio = 1.0f;
  VkDeviceQueueCreateInfo qci{VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO};
  qci.queueFamilyIndex = c.family;
  qci.queueCount = 1;
  qci.pQueuePriorities = &prio;
  VkDeviceCreateInfo dci{VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO};
  dci.pNext = &f2;
  dci.queueCreateInfoCount = 1;
  dci.pQueueCreateInfos = &qci;
  dci.enabledExtensionCount = uint32_t(exts.size());
  dci.ppEnabledExtensionNames = exts.data();
  CHECK(vkCreateDevice(c.pd, &dci, nullptr, &c.dev));
  vkGetDeviceQueue(c.dev, c.family, 0, &c.queue);
  VkCommandPoolCreateInfo pci{VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO};
  pci.queueFamilyIndex = c.family;
  CHECK(vkCreateCommandPool(c.dev, &pci, nullptr, &c.pool));
  VkPipelineCacheCreateInfo cci{VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO};
  CHECK(vkCreatePipelineCache(c.dev, &cci, nullptr, &c.cache));

  VkPushConstantRange pcr{VK_SHADER_STAGE_COMPUTE_BIT, 0, 128};
  VkPipelineLayoutCreateInfo lci{VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO};
  lci.pushConstantRangeCount = 1;
  lci.pPushConstantRanges = &pcr;
  VkPipelineLayout layout;
  CHECK(vkCreatePipelineLayout(c.dev, &lci, nullptr, &layout));

  // Operands: random bf16 in [-1, 1).
  const size_t elems = size_t(size) * size;
  std::vector<uint16_t> ha(elems), hb(elems);
  uint32_t seed = 1;
  for (auto* v : {&ha, &hb})
    for (auto& x : *v) {
      seed = seed * 1664525u + 1013904223u;
      x = to_bf16(float(seed >> 8) / float(1u << 23) - 1.0f);
    }
  Buffer abc[3] = {c.buffer(elems * 2, false), c.buffer(elems * 2, false), c.buffer(elems * 4, false)};
  Buffer host = c.buffer(elems * 4, true);
  for (int i = 0; i < 2; ++i) {
    std::memcpy(host.map, (i ? hb : ha).data(), elems * 2);
    c.submit([&](VkCommandBuffer cb) {
      VkBufferCopy r{0, 0, elems * 2};
      vkCmdCopyBuffer(cb, host.buf, abc[i].buf, 1, &r);
    });
  }

  for (const Entry& en : entries) {
    if (en.spv.size() > 6 && en.spv.compare(en.spv.size() - 6, 6, ".cubin") == 0) {
      bool fits = true;  // a launch with 48 KiB or more of shared memory loses the device (H200)
      for (int32_t shared : en.consts) fits = fits && uint32_t(shared) < props.limits.maxComputeSharedMemorySize;
      if (!fits)
        std::printf("%s: dynamic shared memory at or over the device's %u bytes: not run\n", en.name.c_str(),
                    props.limits.maxComputeSharedMemorySize);
      else if (nvx)
        run_cubin(c, en, layout, size, abc, ha, hb, host);
      continue;
    }
    VkPipeline pipe = make_pipeline(c, en, layout);
    if (!pipe) continue;
    const uint64_t shared = report_executables(c, pipe, outdir, en.name);
    if (shared > props.limits.maxComputeSharedMemorySize)  // a dispatch would lose the device
      std::printf("%s: %llu bytes of shared memory, over the device's %u: not run\n", en.name.c_str(),
                  (unsigned long long)shared, props.limits.maxComputeSharedMemorySize);
    else if (en.kt)
      time_entry(c, en, pipe, layout, size, abc, ha, hb, host);
    vkDestroyPipeline(c.dev, pipe, nullptr);
  }

  size_t n = 0;
  CHECK(vkGetPipelineCacheData(c.dev, c.cache, &n, nullptr));
  std::vector<char> blob(n);
  CHECK(vkGetPipelineCacheData(c.dev, c.cache, &n, blob.data()));
  write_file(outdir + "/pipeline_cache.bin", blob.data(), n);
  std::printf("pipeline cache: %zu bytes\n", n);
  for (auto& b : abc) c.free(b);
  c.free(host);
  vkDestroyPipelineLayout(c.dev, layout, nullptr);
  vkDestroyPipelineCache(c.dev, c.cache, nullptr);
  vkDestroyCommandPool(c.dev, c.pool, nullptr);
  vkDestroyDevice(c.dev, nullptr);
  vkDestroyInstance(inst, nullptr);
  return 0;
}

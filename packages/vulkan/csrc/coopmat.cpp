#include "coopmat.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "backend.h"
#include "coopmat_config.h"
#include "device.h"
#include "recorder.h"

namespace recurra_vk {

namespace {

const char* component_name(uint32_t t) {
  switch (t) {
    case VK_COMPONENT_TYPE_FLOAT16_KHR: return "f16";
    case VK_COMPONENT_TYPE_FLOAT32_KHR: return "f32";
    case VK_COMPONENT_TYPE_FLOAT64_KHR: return "f64";
    case VK_COMPONENT_TYPE_SINT8_KHR: return "i8";
    case VK_COMPONENT_TYPE_SINT16_KHR: return "i16";
    case VK_COMPONENT_TYPE_SINT32_KHR: return "i32";
    case VK_COMPONENT_TYPE_SINT64_KHR: return "i64";
    case VK_COMPONENT_TYPE_UINT8_KHR: return "u8";
    case VK_COMPONENT_TYPE_UINT16_KHR: return "u16";
    case VK_COMPONENT_TYPE_UINT32_KHR: return "u32";
    case VK_COMPONENT_TYPE_UINT64_KHR: return "u64";
    case VK_COMPONENT_TYPE_BFLOAT16_KHR: return "bf16";
    default: return "?";
  }
}

bool has_extension(VkPhysicalDevice pd, const char* name) {
  uint32_t n = 0;
  vkEnumerateDeviceExtensionProperties(pd, nullptr, &n, nullptr);
  std::vector<VkExtensionProperties> exts(n);
  vkEnumerateDeviceExtensionProperties(pd, nullptr, &n, exts.data());
  for (const auto& e : exts)
    if (std::strcmp(e.extensionName, name) == 0) return true;
  return false;
}

// The shader's one shape: 16x16x16, A = B = `ab`, f32 accumulators and result, subgroup scope.
bool has_shape(const CoopMatCaps& c, uint32_t ab) {
  for (const CoopMatShape& s : c.shapes)
    if (s.m == 16 && s.n == 16 && s.k == 16 && s.a == ab && s.b == ab && s.c == VK_COMPONENT_TYPE_FLOAT32_KHR &&
        s.result == VK_COMPONENT_TYPE_FLOAT32_KHR && s.scope == VK_SCOPE_SUBGROUP_KHR && !s.saturating)
      return true;
  return false;
}

struct Variant {
  const char* name;
  int64_t bm, bn, bk, wm, wn;
  int64_t pd = 1;  // prefetch distance in K steps (K must be a multiple of bk * pd)
};
// Must match coopmat_variants in meson.build (two shared buffers each).
const Variant kVariants[] = {
    {"cm128", 128, 128, 32, 64, 32},
    {"cm64", 64, 64, 32, 32, 32},
    {"cm128x256d", 128, 256, 16, 64, 64},
    {"cm128w4dp2", 128, 128, 16, 64, 64, 2},
    {"cm128w4dp2rn", 128, 128, 16, 64, 64, 2},  // ROT and NC do not change the tiles
    {"cm128x256drn", 128, 256, 16, 64, 64},
    {"cm128w4m", 128, 128, 16, 64, 64},  // MB
    {"cm128w4m2", 128, 128, 16, 64, 64},  // MB 2, MBS 1
};

const Variant* find_variant(const std::string& name) {
  for (const Variant& v : kVariants)
    if (name == v.name) return &v;
  return nullptr;
}

struct CoopMatPC {
  uint64_t a, b, c;
  uint32_t m, n, k;
};

}  // namespace

std::string CoopMatShape::str() const {
  static const char* const kScopes[] = {"?", "device", "workgroup", "subgroup", "?", "queue family"};
  return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + " " + component_name(a) + "*" +
         component_name(b) + "+" + component_name(c) + "->" + component_name(result) + " " +
         (scope < 6 ? kScopes[scope] : "?") + (saturating ? " saturating" : "");
}

CoopMatCaps query_coopmat(VkInstance instance, VkPhysicalDevice pd) {
  CoopMatCaps c;
  c.extension = has_extension(pd, VK_KHR_COOPERATIVE_MATRIX_EXTENSION_NAME);
  c.bf16_extension = has_extension(pd, VK_KHR_SHADER_BFLOAT16_EXTENSION_NAME);

  VkPhysicalDeviceCooperativeMatrixFeaturesKHR cm{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR};
  VkPhysicalDeviceShaderBfloat16FeaturesKHR bf{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_BFLOAT16_FEATURES_KHR};
  VkPhysicalDeviceVulkan12Features f12{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES};
  VkPhysicalDeviceFeatures2 f2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
  f2.pNext = &f12;
  void** tail = &f12.pNext;
  if (c.extension) {
    *tail = &cm;
    tail = &cm.pNext;
  }
  if (c.bf16_extension) *tail = &bf;
  vkGetPhysicalDeviceFeatures2(pd, &f2);
  c.feature = cm.cooperativeMatrix;
  c.bf16_type = bf.shaderBFloat16Type;
  c.bf16_coopmat = bf.shaderBFloat16CooperativeMatrix;
  c.float16 = f12.shaderFloat16;
  c.memory_model = f12.vulkanMemoryModel;

  VkPhysicalDeviceSubgroupProperties sp{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES};
  VkPhysicalDeviceProperties2 p2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
  p2.pNext = &sp;
  vkGetPhysicalDeviceProperties2(pd, &p2);
  c.subgroup_size = sp.subgroupSize;
  c.subgroup_basic = (sp.supportedStages & VK_SHADER_STAGE_COMPUTE_BIT) &&
                     (sp.supportedOperations & VK_SUBGROUP_FEATURE_BASIC_BIT);
  c.max_shared_bytes = p2.properties.limits.maxComputeSharedMemorySize;
  c.max_workgroup_invocations = p2.properties.limits.maxComputeWorkGroupInvocations;

  if (c.extension) {
    auto get = reinterpret_cast<PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR>(
        vkGetInstanceProcAddr(instance, "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"));
    uint32_t n = 0;
    if (get && get(pd, &n, nullptr) == VK_SUCCESS && n > 0) {
      std::vector<VkCooperativeMatrixPropertiesKHR> props(n);
      for (auto& p : props) {
        p = VkCooperativeMatrixPropertiesKHR{};
        p.sType = VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR;
      }
      if (get(pd, &n, props.data()) >= VK_SUCCESS) {
        props.resize(n);
        for (const auto& p : props)
          c.shapes.push_back({p.MSize, p.NSize, p.KSize, static_cast<uint32_t>(p.AType), static_cast<uint32_t>(p.BType),
                              static_cast<uint32_t>(p.CType), static_cast<uint32_t>(p.ResultType),
                              static_cast<uint32_t>(p.scope), p.saturatingAccumulation == VK_TRUE});
      }
    }
  }
  return c;
}

std::string CoopMatCaps::why_not(bool bf16) const {
  if (!coopmat_built())
    return std::string(coopmat_build_note()) + (extension ? " (the device has VK_KHR_cooperative_matrix)"
                                                          : " (nor has the device VK_KHR_cooperative_matrix)");
  if (!extension) return "the device has no VK_KHR_cooperative_matrix";
  if (!feature) return "the device reports VK_KHR_cooperative_matrix without its cooperativeMatrix feature";
  if (!memory_model) return "the device lacks vulkanMemoryModel (the coopmat shaders use the Vulkan memory model)";
  if (!subgroup_basic) return "the device has no basic subgroup operations in compute shaders";
  if (bf16) {
    if (!bf16_extension) return "the device has no VK_KHR_shader_bfloat16 (f16 may work: dtype='f16')";
    if (!bf16_type || !bf16_coopmat)
      return "the device lacks the shaderBFloat16Type / shaderBFloat16CooperativeMatrix features";
  } else if (!float16) {
    return "the device lacks shaderFloat16";
  }
  if (!has_shape(*this, bf16 ? VK_COMPONENT_TYPE_BFLOAT16_KHR : VK_COMPONENT_TYPE_FLOAT16_KHR)) {
    std::string offered;
    for (const CoopMatShape& s : shapes) offered += (offered.empty() ? "" : ", ") + s.str();
    return std::string("the device offers no 16x16x16 ") + (bf16 ? "bf16" : "f16") +
           " cooperative matrix with f32 accumulators at subgroup scope (it offers: " +
           (offered.empty() ? "none" : offered) + ")";
  }
  return "";
}

std::string CoopMatCaps::summary() const {
  const std::string f16 = why_not(false), bf = why_not(true);
  const char* shape = " (16x16x16, f32 accumulators)";
  if (f16.empty() && bf.empty()) return std::string("f16, bf16") + shape;
  if (f16.empty()) return std::string("f16") + shape + "; no bf16: " + bf;
  if (bf.empty()) return std::string("bf16") + shape + "; no f16: " + f16;
  return "no: " + f16 + (bf == f16 ? "" : "; bf16: " + bf);
}

bool coopmat_built() { return RECURRA_VK_COOPMAT_BUILT != 0; }
const char* coopmat_build_note() { return RECURRA_VK_COOPMAT_BUILD_NOTE; }

bool coopmat_tile(const std::string& variant, int64_t& bm, int64_t& bn, int64_t& bk) {
  const Variant* v = find_variant(variant);
  if (!v) return false;
  bm = v->bm, bn = v->bn, bk = v->bk * v->pd;
  return true;
}

std::vector<std::string> coopmat_variants() {
  std::vector<std::string> out;
  for (const Variant& v : kVariants) out.push_back(v.name);
  return out;
}

// Must match coopmat_op_tiles in meson.build. per_sm: every 64x64-subgroup tiling uses 255
// registers (tools/coopmat_probe.cpp), so an SM holds one 256-invocation workgroup or two of
// 128; tflops: H200, bfloat16, full waves (bench/coopmat.py).
const CoopMatOpTile kOpTiles[] = {
    {"op128", 128, 128, 32, 64, 64, 2, 195.0},  // 4 subgroups of 64x64
    {"op64", 64, 64, 32, 32, 32, 4, 100.0},     // 4 subgroups of 32x32
    {"op128x256drnf", 128, 256, 16, 64, 64, 1, 238.0},  // 8 subgroups of 64x64, DEFER, ROT, NC, FS
    {"op128m", 128, 128, 16, 64, 64, 2, 262.0},         // 4 subgroups of 64x64, DEFER, ROT, NC, MB
};

static const CoopMatOpTile* find_op_tile(const std::string& name) {
  for (const CoopMatOpTile& t : kOpTiles)
    if (name == t.name) return &t;
  return nullptr;
}

std::string coopmat_op_why_not(const Device& d, bool bf16) {
  const std::string why = d.info().coopmat.why_not(bf16);
  if (!why.empty()) return why;
  if (!d.coopmat_enabled(bf16)) return "the cooperative-matrix features were not enabled";
  if (!d.half_storage()) return "the device lacks storageBuffer16BitAccess";
  const uint32_t sg = d.info().coopmat.subgroup_size;
  if (sg < 8 || d.limits().min_subgroup_size != sg)
    return "the coopmat shaders need a fixed subgroup size of at least 8 (the device has " +
           std::to_string(d.limits().min_subgroup_size) + " to " + std::to_string(sg) + ")";
  return "";
}

int64_t forced_splits() {
  const char* env = std::getenv("RECURRA_VK_SPLITK");
  if (!env || !*env || std::strcmp(env, "auto") == 0) return 0;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  if (*end || v < 1 || v > 32)
    fail_invalid(std::string("RECURRA_VK_SPLITK=") + env + ": expected auto or a number of slices from 1 to 32");
  return v;
}

namespace {

// The plan's cost model of an H200 (132 SMs, as for the float32 kernels' kEnoughTiles): the
// workgroups spread over the SMs, the busiest SM runs its share per_sm at a time, each round
// as long as one workgroup's K slice plus kFillSteps (its first loads and its epilogue) at
// the tiling's rate; a last round with fewer workgroups than per_sm costs at least kLoneShare
// of a full one (fewer warps hide less latency). A split adds the float32 partial sums'
// round trip through memory, sum_slices_h's dispatch and the rest's. The case behind it
// (bench/coopmat.py, the Mamba2-130M step's products): the LM head's input gradient in a
// 13-chunk step (315 x 50288 @ 50288 x 768, 18 128x128 tiles) in 15 slices was 270
// workgroups on op128, two per SM and 6 more: the second round doubled its time.
constexpr int64_t kSMs = 132;
constexpr double kFillSteps = 128.0;
constexpr double kLoneShare = 0.6;
constexpr double kBytesPerNs = 3000.0;
constexpr double kDispatchNs = 4000.0;

// ns of `groups` workgroups of tile t, each over `ks` elements of K.
double rounds_ns(const CoopMatOpTile& t, int64_t groups, int64_t ks) {
  const int64_t load = (groups + kSMs - 1) / kSMs;  // workgroups on the busiest SM
  const int64_t full = (load - 1) / t.per_sm;       // full rounds before the last
  const double last = std::max(static_cast<double>(load - full * t.per_sm), kLoneShare * static_cast<double>(t.per_sm));
  const double sm_flop_ns = t.tflops * 1e3 / static_cast<double>(kSMs);
  const double group_step_ns = 2.0 * static_cast<double>(t.bm * t.bn) / sm_flop_ns;  // one K element
  return (static_cast<double>(full * t.per_sm) + last) * (static_cast<double>(ks) + kFillSteps) * group_step_ns;
}

// transpose_a: a row-major A first copied transposed (read once, written with rows of M
// rounded up to 8), then the product.
double plan_ns(const CoopMatOpTile& t, int64_t m, int64_t n, int64_t k, int64_t batch, int64_t s, bool transpose_a) {
  const int64_t tiles = ((m + t.bm - 1) / t.bm) * ((n + t.bn - 1) / t.bn) * batch;
  if (transpose_a) {
    const double copy = 2.0 * static_cast<double>(m * k + (m + 7) / 8 * 8 * k) / kBytesPerNs;
    return rounds_ns(t, tiles, k) + kDispatchNs + copy;
  }
  if (s < 2) return rounds_ns(t, tiles, k);
  const int64_t ks = (k / s) & ~int64_t(15);  // split_k's slices (16-aligned) and the rest
  const int64_t rest = k - s * ks;
  double ns = rounds_ns(t, tiles * s, ks) + kDispatchNs +
              (8.0 * static_cast<double>(s) + 2.0) * static_cast<double>(m * n) / kBytesPerNs;
  if (rest > 0) ns += rounds_ns(t, tiles, rest) + kDispatchNs;
  return ns;
}

}  // namespace

bool transpose_forced() {
  const char* env = std::getenv("RECURRA_VK_TRANSPOSE");
  if (!env || !*env || std::strcmp(env, "auto") == 0 || std::strcmp(env, "off") == 0) return false;
  if (std::strcmp(env, "on") == 0) return true;
  fail_invalid(std::string("RECURRA_VK_TRANSPOSE=") + env + ": expected auto, on or off");
}

CoopMatOpPlan coopmat_op_plan(int64_t m, int64_t n, int64_t k, int64_t batch, bool a_transposable) {
  const char* env = std::getenv("RECURRA_VK_COOPMAT");
  const std::string v = env ? env : "";
  if (v == "off") return {nullptr, 1};
  const CoopMatOpTile* only = nullptr;
  if (!v.empty() && v != "auto") {
    only = find_op_tile(v);
    if (!only) {
      std::string names;
      for (const CoopMatOpTile& t : kOpTiles) names += std::string(", ") + t.name;
      fail_invalid("RECURRA_VK_COOPMAT=" + v + ": unknown tiling (expected auto, off" + names + ")");
    }
  }
  // Slices: single products with K of at least 128 a slice (16 when RECURRA_VK_SPLITK forces
  // them, as for the fallback), their partial sums indexable.
  const int64_t forced = forced_splits();
  int64_t most = batch == 1 ? std::min<int64_t>(32, k / (forced ? 16 : 128)) : 1;
  while (most > 1 && (most + 1) * m * n > kMaxIndex) --most;
  most = std::max<int64_t>(most, 1);
  const int64_t lo = forced ? std::min(forced, most) : 1, hi = forced ? lo : most;
  // RECURRA_VK_TRANSPOSE=on: every candidate without slices has A transposed first.
  const bool transpose = a_transposable && batch == 1 && transpose_forced();
  CoopMatOpPlan best{nullptr, 1};
  double best_ns = 0.0;
  for (const CoopMatOpTile& t : kOpTiles) {
    if (only ? &t != only : std::strcmp(t.name, "op128") == 0) continue;  // op128m replaces it
    for (int64_t s = lo; s <= hi; ++s) {
      const bool tr = transpose && s == 1;
      const double ns = plan_ns(t, m, n, k, batch, s, tr);
      if (!best.tile || ns < best_ns) best = {&t, s, tr}, best_ns = ns;
    }
  }
  return best;
}

std::vector<std::string> coopmat_op_tiles() {
  std::vector<std::string> out;
  for (const CoopMatOpTile& t : kOpTiles) out.push_back(t.name);
  return out;
}

uint32_t coopmat_op_workgroup(const Device& d, const CoopMatOpTile& t) {
  const CoopMatCaps& caps = d.info().coopmat;
  const int64_t nw = (t.bm / t.wm) * (t.bn / t.wn);
  const int64_t wg = nw * caps.subgroup_size;
  // Shared memory: two buffers per operand, each sized for either staging (rows padded by 8).
  const int64_t a_stage = std::max(t.bm * (t.bk + 8), t.bk * (t.bm + 8));
  const int64_t b_stage = std::max(t.bk * (t.bn + 8), t.bn * (t.bk + 8));
  const int64_t shared = 2 * (a_stage + b_stage) * 2;
  if ((t.bm * t.bk / 8) % wg || (t.bk * t.bn / 8) % wg || wg > caps.max_workgroup_invocations)
    fail(RECURRA_ERR_UNSUPPORTED, std::string("coopmat tiling ") + t.name + " does not fit a subgroup size of " +
                                      std::to_string(caps.subgroup_size));
  if (shared > caps.max_shared_bytes)
    fail(RECURRA_ERR_UNSUPPORTED, std::string("coopmat tiling ") + t.name + " needs " + std::to_string(shared) +
                                      " bytes of shared memory; the device has " +
                                      std::to_string(caps.max_shared_bytes));
  return static_cast<uint32_t>(wg);
}

double coopmat_matmul(int index, const uint16_t* a, const uint16_t* b, float* c, int64_t m, int64_t n, int64_t k,
                      bool bf16, const std::string& variant, int reps) {
  const Variant* v = find_variant(variant);
  if (!v) {
    std::string names;
    for (const Variant& x : kVariants) names += (names.empty() ? "" : ", ") + std::string(x.name);
    fail_invalid("unknown coopmat variant '" + variant + "' (expected one of " + names + ")");
  }
  const int64_t kt = v->bk * v->pd;  // K advances bk per step, pd steps per loop iteration
  if (m <= 0 || n <= 0 || k <= 0 || m % v->bm || n % v->bn || k % kt)
    fail_invalid("coopmat_matmul: M, N, K must be positive multiples of the " + variant + " tile (" +
                 std::to_string(v->bm) + ", " + std::to_string(v->bn) + ", " + std::to_string(kt) + "), got (" +
                 std::to_string(m) + ", " + std::to_string(n) + ", " + std::to_string(k) + ")");
  if (m * k > kMaxIndex || k * n > kMaxIndex || m * n > kMaxIndex)
    fail_invalid("coopmat_matmul: operands past 2^31 elements are not supported");
  if (reps < 1) fail_invalid("coopmat_matmul: reps must be at least 1");
  double seconds = 0.0;
  with_device(index, [&](Device& d) {
    const CoopMatCaps& caps = d.info().coopmat;
    const std::string why = caps.why_not(bf16);
    if (!why.empty())
      fail(RECURRA_ERR_UNSUPPORTED, std::string(bf16 ? "bf16" : "f16") + " tensor-core matmul is not supported on '" +
                                        d.info().name + "': " + why);
    if (!d.coopmat_enabled(bf16))
      fail(RECURRA_ERR_UNSUPPORTED, "the cooperative-matrix features were not enabled on '" + d.info().name + "'");
    // The shader splits the workgroup into NW subgroups of the device's (fixed) subgroup size
    // and sizes its register arrays for subgroups of at least 8.
    if (caps.subgroup_size < 8 || d.limits().min_subgroup_size != caps.subgroup_size)
      fail(RECURRA_ERR_UNSUPPORTED, "the coopmat shaders need a fixed subgroup size of at least 8; '" +
                                        d.info().name + "' has " + std::to_string(d.limits().min_subgroup_size) +
                                        " to " + std::to_string(caps.subgroup_size));
    const int64_t nw = (v->bm / v->wm) * (v->bn / v->wn);
    const int64_t wg = nw * caps.subgroup_size;
    const int64_t shared = 2 * (v->bm * ((v->bk + 8) / 8) + v->bk * ((v->bn + 8) / 8)) * 16;
    if ((v->bm * v->bk / 8) % wg || (v->bk * v->bn / 8) % wg || wg > caps.max_workgroup_invocations)
      fail(RECURRA_ERR_UNSUPPORTED, "coopmat variant " + variant + " does not fit a subgroup size of " +
                                        std::to_string(caps.subgroup_size) + " (try cm128)");
    if (shared > caps.max_shared_bytes)
      fail(RECURRA_ERR_UNSUPPORTED, "coopmat variant " + variant + " needs " + std::to_string(shared) +
                                        " bytes of shared memory; the device has " +
                                        std::to_string(caps.max_shared_bytes));

    const size_t bytes_a = static_cast<size_t>(m * k) * 2, bytes_b = static_cast<size_t>(k * n) * 2;
    const size_t bytes_c = static_cast<size_t>(m * n) * 4;
    std::vector<recurra_buffer> bufs;
    auto release = [&] {
      for (const recurra_buffer& x : bufs) d.free(x);
      bufs.clear();
    };
    try {
      for (size_t bytes : {bytes_a, bytes_b, bytes_c}) bufs.push_back(d.alloc(bytes, false));
      d.copy_in(bufs[0], 0, a, bytes_a);
      d.copy_in(bufs[1], 0, b, bytes_b);
      const Allocation al[3] = {d.memory().lookup(bufs[0], "coopmat"), d.memory().lookup(bufs[1], "coopmat"),
                                d.memory().lookup(bufs[2], "coopmat")};
      CoopMatPC pc{};
      pc.a = d.memory().address(al[0]);
      pc.b = d.memory().address(al[1]);
      pc.c = d.memory().address(al[2]);
      if (pc.a % 16 || pc.b % 16 || pc.c % 16) fail_invalid("coopmat_matmul: device buffers are not 16-byte aligned");
      pc.m = static_cast<uint32_t>(m);
      pc.n = static_cast<uint32_t>(n);
      pc.k = static_cast<uint32_t>(k);
      const Range ra{al[0].block, al[0].offset, al[0].offset + bytes_a};
      const Range rb{al[1].block, al[1].offset, al[1].offset + bytes_b};
      const Range rc{al[2].block, al[2].offset, al[2].offset + bytes_c};
      const std::string module = std::string("matmul_") + v->name + (bf16 ? "_bf16" : "_f16");
      recurra_node_desc node{};
      node.op = "coopmat_matmul";
      auto run = [&](int times) {
        d.compute(&node, 1, [] {}, [&](Recorder& rec) {
          rec.begin_node(node.op);
          for (int i = 0; i < times; ++i)
            rec.dispatch(module, {static_cast<int32_t>(wg)}, pc, static_cast<uint32_t>(n / v->bn),
                         static_cast<uint32_t>(m / v->bm), 1, {ra, rb}, {rc});
          rec.end_node();
        });
      };
      run(1);  // builds the pipeline; the GPU warms up
      d.synchronize();
      std::vector<ProfileRecord> recs;
      const bool timestamps = d.info().timestamp_bits > 0;
      if (timestamps) d.set_profile_sink(&recs);
      const auto t0 = std::chrono::steady_clock::now();
      try {
        run(reps);
        d.synchronize();
      } catch (...) {
        d.set_profile_sink(nullptr);
        throw;
      }
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      d.set_profile_sink(nullptr);
      seconds = (timestamps && !recs.empty() ? recs.back().seconds : wall) / reps;
      d.copy_out(bufs[2], 0, c, bytes_c);
    } catch (...) {
      release();
      throw;
    }
    release();
  });
  return seconds;
}

}  // namespace recurra_vk

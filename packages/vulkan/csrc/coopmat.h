// Tensor cores through VK_KHR_cooperative_matrix: what a device offers (queried when the
// instance lists its devices), the features enabled at device creation, and the standalone
// bf16/f16 matmul (shaders/matmul_coopmat.comp) for benchmarks until the core has 16-bit
// tensors.
//
// The Vulkan headers of Debian bookworm (1.3.239) predate VK_KHR_cooperative_matrix (1.3.255),
// VK_NV_cooperative_matrix2 (1.3.301) and VK_KHR_shader_bfloat16 (1.4.311): their types are
// declared here when missing, with the values of the Vulkan registry.
#pragma once

#include <string>
#include <vector>

#include "common.h"

#ifndef VK_KHR_cooperative_matrix
#define VK_KHR_cooperative_matrix 1
#define VK_KHR_COOPERATIVE_MATRIX_EXTENSION_NAME "VK_KHR_cooperative_matrix"
typedef enum VkComponentTypeKHR {
  VK_COMPONENT_TYPE_FLOAT16_KHR = 0,
  VK_COMPONENT_TYPE_FLOAT32_KHR = 1,
  VK_COMPONENT_TYPE_FLOAT64_KHR = 2,
  VK_COMPONENT_TYPE_SINT8_KHR = 3,
  VK_COMPONENT_TYPE_SINT16_KHR = 4,
  VK_COMPONENT_TYPE_SINT32_KHR = 5,
  VK_COMPONENT_TYPE_SINT64_KHR = 6,
  VK_COMPONENT_TYPE_UINT8_KHR = 7,
  VK_COMPONENT_TYPE_UINT16_KHR = 8,
  VK_COMPONENT_TYPE_UINT32_KHR = 9,
  VK_COMPONENT_TYPE_UINT64_KHR = 10,
  VK_COMPONENT_TYPE_MAX_ENUM_KHR = 0x7FFFFFFF
} VkComponentTypeKHR;
typedef enum VkScopeKHR {
  VK_SCOPE_DEVICE_KHR = 1,
  VK_SCOPE_WORKGROUP_KHR = 2,
  VK_SCOPE_SUBGROUP_KHR = 3,
  VK_SCOPE_QUEUE_FAMILY_KHR = 5,
  VK_SCOPE_MAX_ENUM_KHR = 0x7FFFFFFF
} VkScopeKHR;
typedef struct VkCooperativeMatrixPropertiesKHR {
  VkStructureType sType;
  void* pNext;
  uint32_t MSize;
  uint32_t NSize;
  uint32_t KSize;
  VkComponentTypeKHR AType;
  VkComponentTypeKHR BType;
  VkComponentTypeKHR CType;
  VkComponentTypeKHR ResultType;
  VkBool32 saturatingAccumulation;
  VkScopeKHR scope;
} VkCooperativeMatrixPropertiesKHR;
typedef struct VkPhysicalDeviceCooperativeMatrixFeaturesKHR {
  VkStructureType sType;
  void* pNext;
  VkBool32 cooperativeMatrix;
  VkBool32 cooperativeMatrixRobustBufferAccess;
} VkPhysicalDeviceCooperativeMatrixFeaturesKHR;
typedef VkResult(VKAPI_PTR* PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR)(
    VkPhysicalDevice physicalDevice, uint32_t* pPropertyCount, VkCooperativeMatrixPropertiesKHR* pProperties);
#define VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR ((VkStructureType)1000506000)
#define VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR ((VkStructureType)1000506001)
#endif

#ifndef VK_KHR_shader_bfloat16
#define VK_KHR_shader_bfloat16 1
#define VK_KHR_SHADER_BFLOAT16_EXTENSION_NAME "VK_KHR_shader_bfloat16"
typedef struct VkPhysicalDeviceShaderBfloat16FeaturesKHR {
  VkStructureType sType;
  void* pNext;
  VkBool32 shaderBFloat16Type;
  VkBool32 shaderBFloat16DotProduct;
  VkBool32 shaderBFloat16CooperativeMatrix;
} VkPhysicalDeviceShaderBfloat16FeaturesKHR;
#define VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_BFLOAT16_FEATURES_KHR ((VkStructureType)1000141000)
#define VK_COMPONENT_TYPE_BFLOAT16_KHR ((VkComponentTypeKHR)1000141000)
#endif

#ifndef VK_NV_cooperative_matrix2
#define VK_NV_cooperative_matrix2 1
#define VK_NV_COOPERATIVE_MATRIX_2_EXTENSION_NAME "VK_NV_cooperative_matrix2"
typedef struct VkPhysicalDeviceCooperativeMatrix2FeaturesNV {
  VkStructureType sType;
  void* pNext;
  VkBool32 cooperativeMatrixWorkgroupScope;
  VkBool32 cooperativeMatrixFlexibleDimensions;
  VkBool32 cooperativeMatrixReductions;
  VkBool32 cooperativeMatrixConversions;
  VkBool32 cooperativeMatrixPerElementOperations;
  VkBool32 cooperativeMatrixTensorAddressing;
  VkBool32 cooperativeMatrixBlockLoads;
} VkPhysicalDeviceCooperativeMatrix2FeaturesNV;
typedef struct VkPhysicalDeviceCooperativeMatrix2PropertiesNV {
  VkStructureType sType;
  void* pNext;
  uint32_t cooperativeMatrixWorkgroupScopeMaxWorkgroupSize;
  uint32_t cooperativeMatrixFlexibleDimensionsMaxDimension;
  uint32_t cooperativeMatrixWorkgroupScopeReservedSharedMemory;
} VkPhysicalDeviceCooperativeMatrix2PropertiesNV;
typedef struct VkCooperativeMatrixFlexibleDimensionsPropertiesNV {
  VkStructureType sType;
  void* pNext;
  uint32_t MGranularity;
  uint32_t NGranularity;
  uint32_t KGranularity;
  VkComponentTypeKHR AType;
  VkComponentTypeKHR BType;
  VkComponentTypeKHR CType;
  VkComponentTypeKHR ResultType;
  VkBool32 saturatingAccumulation;
  VkScopeKHR scope;
  uint32_t workgroupInvocations;
} VkCooperativeMatrixFlexibleDimensionsPropertiesNV;
typedef VkResult(VKAPI_PTR* PFN_vkGetPhysicalDeviceCooperativeMatrixFlexibleDimensionsPropertiesNV)(
    VkPhysicalDevice physicalDevice, uint32_t* pPropertyCount, VkCooperativeMatrixFlexibleDimensionsPropertiesNV* pProperties);
#define VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_FEATURES_NV ((VkStructureType)1000593000)
#define VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_FLEXIBLE_DIMENSIONS_PROPERTIES_NV ((VkStructureType)1000593001)
#define VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_PROPERTIES_NV ((VkStructureType)1000593002)
#endif

namespace recurra_vk {

class Device;
struct PhysicalDevice;

// One entry of vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR.
struct CoopMatShape {
  uint32_t m = 0, n = 0, k = 0;
  uint32_t a = 0, b = 0, c = 0, result = 0;  // VkComponentTypeKHR
  uint32_t scope = 0;                        // VkScopeKHR
  bool saturating = false;
  std::string str() const;  // e.g. "16x16x16 f16*f16+f32->f32 subgroup"
};

// What a physical device offers for the coopmat shaders.
struct CoopMatCaps {
  bool extension = false;       // VK_KHR_cooperative_matrix listed
  bool feature = false;         // cooperativeMatrix
  bool compute_stage = false;   // cooperativeMatrixSupportedStages has compute
  bool bf16_extension = false;  // VK_KHR_shader_bfloat16 listed
  bool bf16_type = false;       // shaderBFloat16Type
  bool bf16_coopmat = false;    // shaderBFloat16CooperativeMatrix
  bool float16 = false;         // shaderFloat16
  bool memory_model = false;    // vulkanMemoryModel (glslang's coopmat SPIR-V uses it)
  bool subgroup_basic = false;  // gl_SubgroupID in compute shaders
  uint32_t subgroup_size = 0;
  uint32_t max_shared_bytes = 0;
  uint32_t max_workgroup_invocations = 0;
  std::vector<CoopMatShape> shapes;

  // "" when the f16 (bf16) shaders can run on the device, else why not (the build's reason
  // first when the shaders were left out).
  std::string why_not(bool bf16) const;
  // A one-line summary for device info ("f16, bf16 (16x16x16, f32 accumulators)", "no: ...").
  std::string summary() const;
};

// Queried for one physical device (instance-level calls only; never throws).
CoopMatCaps query_coopmat(VkInstance instance, VkPhysicalDevice pd);

// Whether the coopmat SPIR-V modules are in this build, and the build's note (the compiler
// used, or why they were left out).
bool coopmat_built();
const char* coopmat_build_note();

// Standalone tensor-core matmul: C (m x n, f32) = A (m x k) @ B (k x n), A and B 16-bit
// floats (raw bits: bf16 or f16), row-major, M, N, K multiples of the variant's tile (see
// coopmat_tile). Runs the shader `reps` times on device `index` (after one untimed
// run) and returns the GPU seconds of one run (timestamps; wall clock around a fence when the
// queue has none). Throws Error(RECURRA_ERR_UNSUPPORTED) when the device or build lacks it,
// RECURRA_ERR_INVALID for bad shapes.
double coopmat_matmul(int index, const uint16_t* a, const uint16_t* b, float* c, int64_t m, int64_t n, int64_t k,
                      bool bf16, const std::string& variant, int reps);

// The variants built ("cm128", ...): their C tile and the multiple of K they take (the K step
// times the prefetch distance), or false for an unknown name.
bool coopmat_tile(const std::string& variant, int64_t& bm, int64_t& bn, int64_t& bk);
std::vector<std::string> coopmat_variants();

// ---- the bfloat16/float16 matmul op on tensor cores (shaders/matmul_coopmat_op.comp) ----------

// A tiling of the op's shader: BM x BN of C per workgroup, subgroups of WM x WN, K steps of BK.
struct CoopMatOpTile {
  const char* name;  // module "matmul_op_<name>_<bf16|f16>"
  int64_t bm, bn, bk, wm, wn;  // two shared buffers per operand
  int64_t per_sm;  // workgroups an SM of an H200 holds at once (registers)
  double tflops;   // the H200's bfloat16 throughput on full waves (the plan's cost model)
};

// "" when the op's coopmat shaders can run on `d` in that dtype (the features enabled, a fixed
// subgroup size of at least 8, 2-byte storage), else why not.
std::string coopmat_op_why_not(const Device& d, bool bf16);

// A product's plan on the op's shader: the tiling and the slices of K (split-K, 1: none).
struct CoopMatOpPlan {
  const CoopMatOpTile* tile;
  int64_t splits;
  bool transpose_a = false;  // a row-major A copied transposed first (transpose_h.comp; one slice)
};

// The plan for a product with an M x N output per batch matrix and inner size K (split-K
// only for batch 1): by a cost model of an H200 (coopmat_op_plan in coopmat.cpp: waves of
// workgroups on 132 SMs, the slices' partial sums through memory), over the tilings and 1 to
// 32 slices; RECURRA_VK_COOPMAT names a tiling ("op128x256drnf", "op128m", "op128",
// "op64") and RECURRA_VK_SPLITK a number of slices (each then chosen by the model given the
// other). tile nullptr when RECURRA_VK_COOPMAT=off (the op then runs the fallback shader).
// a_transposable: A is one row-major matrix the op can transpose (csrc/ops/matmul.cpp); with
// RECURRA_VK_TRANSPOSE=on every such product without slices has A transposed first (the plan
// then counts the copy's traffic); auto and off leave A as it is (round 10: on the H200 the
// copy and the faster product on the transposed A came out even in wall time,
// bench/coopmat.py).
// Throws Error (RECURRA_ERR_INVALID) for an unknown name or a bad number.
CoopMatOpPlan coopmat_op_plan(int64_t m, int64_t n, int64_t k, int64_t batch, bool a_transposable = false);
// Whether RECURRA_VK_TRANSPOSE is "on" (unset, empty, "auto" and "off": no); throws for
// another value.
bool transpose_forced();
// RECURRA_VK_SPLITK as a number of slices, 0 when unset or "auto" (throws for a bad value).
int64_t forced_splits();
std::vector<std::string> coopmat_op_tiles();

// The workgroup size of `tile` on `d` (its subgroups times the subgroup size); throws Error
// (RECURRA_ERR_UNSUPPORTED) when the tile does not fit the device (subgroup size, shared memory).
uint32_t coopmat_op_workgroup(const Device& d, const CoopMatOpTile& tile);

}  // namespace recurra_vk

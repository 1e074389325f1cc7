// Diagnosis kernels (issue 18, round 12), not part of the library: a bf16 matmul written for
// CUDA (fp32 accumulation, C = A @ B, all row-major, C float32) that stages its slabs through
// shared memory with asynchronous copies (cp.async, N stages), loads fragments with ldmatrix
// and multiplies with mma.sync m16n8k16: the pieces a Vulkan shader cannot name. With it, one
// kernel can be timed both ways on an NVIDIA GPU:
//   - launched by CUDA (tools/cuda_gemm.py, through libcuda with PyTorch's context), and
//   - launched on a Vulkan device through VK_NVX_binary_import (tools/coopmat_probe.cpp,
//     entries whose module ends in .cubin),
// and `occupancy` counts how many workgroups share a multiprocessor at once for a given
// shared memory size, by either launch. Build (CUDA 12 or later, Hopper):
//     nvcc -arch=sm_90 -cubin -O3 --resource-usage -o cuda_gemm.cubin cuda_gemm.cu
//
// Kernel names: g<BM>[x<BN>][w8][k<BK>]s<stages>[d]: a BM x BN tile (128 when BN is left
// out), 4 warps of 64x64 (w8: 8 warps of 64x32), K steps of BK (32 when left out), d: the
// stages in dynamic shared memory (the launch passes their size, stages * (BM + BN) * BK * 2
// bytes), else static. Parameters (A, B, C, M, N, K); M, N multiples of the tile, K of BK;
// grid: (M / BM) * (N / BN) workgroups of (BM / WM) * (BN / WN) * 32 invocations.
#include <cuda_bf16.h>
#include <stdint.h>
#define DEVI __device__ __forceinline__
typedef __nv_bfloat16 bf16;

DEVI uint32_t shared_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
DEVI void copy16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
DEVI void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
DEVI void copy_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
DEVI void ldsm4(uint32_t at, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at));
}
DEVI void ldsm4_trans(uint32_t at, uint32_t* r0, uint32_t* r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0[0]), "=r"(r0[1]), "=r"(r1[0]), "=r"(r1[1])
               : "r"(at));
}
DEVI void mma(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Shared layouts without padding: the 16-byte chunks of a row are permuted by an XOR with
// bits of the row, so that the 8 rows one ldmatrix matrix reads (same logical chunk) and the
// 32 chunks a warp's copies write fall in 8 different 16-byte bank groups.
template <int BK>
DEVI int a_at(int r, int c) {  // A's slab: BM rows of BK elements (BK / 8 chunks)
  return BK == 16   ? r * BK + ((c ^ ((r >> 2) & 1)) << 3)
         : BK == 32 ? r * BK + ((c ^ ((r >> 1) & 3)) << 3)
                    : r * BK + ((c ^ (r & 7)) << 3);
}
template <int BN>
DEVI int b_at(int r, int c) {  // B's slab: BK rows of BN elements (BN / 8 >= 8 chunks)
  return r * BN + ((c ^ (r & 7)) << 3);
}

template <int BM, int BN, int BK, int WM, int WN, int ST, bool DYN>
DEVI void gemm(const bf16* __restrict__ A, const bf16* __restrict__ B, float* __restrict__ C, int M, int N,
               int K) {
  constexpr int GROUP_M = 8;  // workgroups walk C in bands of 8 tile rows (L2 reuse of B)
  constexpr int NWN = BN / WN, NT = (BM / WM) * NWN * 32;
  constexpr int TM = WM / 16, TN = WN / 8;  // m16 and n8 tiles per warp
  constexpr int ACH = BK / 8, BCH = BN / 8;
  constexpr int AS = BM * BK, BS = BK * BN;  // elements per stage
  static_assert(BK == 16 || BK == 32 || BK == 64, "BK 16, 32 or 64");
  static_assert(BCH >= 8 && TN % 2 == 0, "BN >= 64, WN a multiple of 16");
  extern __shared__ __align__(128) uint8_t dynamic_shared[];
  __shared__ __align__(128) bf16 static_shared[DYN ? 8 : ST * (AS + BS)];
  bf16* sa = DYN ? reinterpret_cast<bf16*>(dynamic_shared) : static_shared;
  bf16* sb = sa + ST * AS;

  const int tiles_m = M / BM, tiles_n = N / BN;
  const int pid = blockIdx.x, per_group = GROUP_M * tiles_n;
  const int first_m = (pid / per_group) * GROUP_M;
  const int rows = min(tiles_m - first_m, GROUP_M);
  const int m0 = (first_m + (pid % per_group) % rows) * BM, n0 = ((pid % per_group) / rows) * BN;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int wm0 = (warp / NWN) * WM, wn0 = (warp % NWN) * WN;

  auto load = [&](int s, int kt) {  // K step kt's slabs into stage s (asynchronous)
    const bf16* a = A + (size_t)m0 * K + kt * BK;
#pragma unroll
    for (int i = 0; i < BM * ACH / NT; ++i) {
      const int q = i * NT + t, r = q / ACH, c = q % ACH;
      copy16(shared_u32(sa + s * AS + a_at<BK>(r, c)), a + (size_t)r * K + c * 8);
    }
    const bf16* b = B + (size_t)kt * BK * N + n0;
#pragma unroll
    for (int i = 0; i < BK * BCH / NT; ++i) {
      const int q = i * NT + t, r = q / BCH, c = q % BCH;
      copy16(shared_u32(sb + s * BS + b_at<BN>(r, c)), b + (size_t)r * N + c * 8);
    }
  };

  float acc[TM][TN][4];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  // ST - 1 steps in flight; at step kt, wait for its group, then (behind the barrier, which
  // also ends every read of the stage step kt - 1 used) start step kt + ST - 1 into that stage.
  const int steps = K / BK;
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < steps) load(s, s);
    copy_commit();
  }
  for (int kt = 0; kt < steps; ++kt) {
    copy_wait<ST - 2>();
    __syncthreads();
    if (kt + ST - 1 < steps) load((kt + ST - 1) % ST, kt + ST - 1);
    copy_commit();
    const bf16* a = sa + (kt % ST) * AS;
    const bf16* b = sb + (kt % ST) * BS;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t fa[TM][4], fb[TN][2];
#pragma unroll
      for (int i = 0; i < TM; ++i)  // rows 0-15 at K 0-7 (lanes 0-15), at K 8-15 (lanes 16-31)
        ldsm4(shared_u32(a + a_at<BK>(wm0 + i * 16 + (lane & 15), kk / 8 + (lane >> 4))), fa[i]);
#pragma unroll
      for (int j = 0; j < TN; j += 2)  // K rows 0-7, 8-15 of n tile j, then of n tile j + 1
        ldsm4_trans(shared_u32(b + b_at<BN>(kk + (lane & 15), (wn0 + j * 8) / 8 + (lane >> 4))), fb[j],
                    fb[j + 1]);
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) mma(acc[i][j], fa[i], fb[j]);
    }
  }
  copy_wait<0>();
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int r = m0 + wm0 + i * 16 + (lane >> 2), c = n0 + wn0 + j * 8 + 2 * (lane & 3);
      *reinterpret_cast<float2*>(C + (size_t)r * N + c) = make_float2(acc[i][j][0], acc[i][j][1]);
      *reinterpret_cast<float2*>(C + (size_t)(r + 8) * N + c) = make_float2(acc[i][j][2], acc[i][j][3]);
    }
}

#define KERNEL(name, BM, BN, BK, WM, WN, ST, MIN_BLOCKS, DYN)                          \
  extern "C" __global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MIN_BLOCKS) \
      name(const bf16* A, const bf16* B, float* C, int M, int N, int K) {              \
    gemm<BM, BN, BK, WM, WN, ST, DYN>(A, B, C, M, N, K);                               \
  }
KERNEL(g128s3, 128, 128, 32, 64, 64, 3, 2, false)       // 48 KiB static
KERNEL(g128s2d, 128, 128, 32, 64, 64, 2, 2, true)       // 32 KiB
KERNEL(g128k16s2d, 128, 128, 16, 64, 64, 2, 2, true)    // 16 KiB
KERNEL(g128k16s3d, 128, 128, 16, 64, 64, 3, 2, true)    // 24 KiB
KERNEL(g128k16s4d, 128, 128, 16, 64, 64, 4, 2, true)    // 32 KiB
KERNEL(g128x256k16s3d, 128, 256, 16, 64, 64, 3, 1, true)  // 36 KiB
KERNEL(g128x256s3d, 128, 256, 32, 64, 64, 3, 1, true)   // 72 KiB (CUDA only: over 48 KiB)

// How many workgroups run on one multiprocessor at once: each workgroup's first invocation
// counts itself in cnt[its SM], records the count's maximum in peak[its SM], spins for
// `spin` clocks and leaves. Launch many more workgroups than fit; read peak.
extern "C" __global__ void occupancy(unsigned* cnt, unsigned* peak, int spin) {
  extern __shared__ unsigned touched[];
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  if (threadIdx.x == 0) {
    touched[0] = sm;
    atomicMax(peak + sm, atomicAdd(cnt + sm, 1u) + 1u);
    const long long t0 = clock64();
    while (clock64() - t0 < spin) {
    }
    atomicSub(cnt + sm, 1u);
  }
}

// Matrix products on matmul.comp: matmul and out_prod, batched with numpy broadcasting of
// up to two batch axes, any operand strides (transposed views run without copies).
//
//   matmul    a (B..., m, k) @ b (B..., k, n)   -> (B..., m, n)
//   out_prod  a (B..., k, m), b (B..., k, n)    -> (B..., m, n) = a^T @ b
//
// Shader variants, chosen at every dispatch by the environment variable RECURRA_VK_MATMUL
// (read when the node is recorded, so it can change within a process):
//   legacy (also unset/empty)  matmul.comp: matmul_128 (128x128x8) when that gives >= 264
//                              tiles, else matmul_64 (64x64x16)
//   auto     matmul_reg.comp by size: r128 when >= 264 128x128 tiles (two per SM of an
//            H200), else r128x64 when >= 264 of those, else r64
//   r128k8   matmul_reg.comp 128x128 tile, BK 8, 256 threads, 8x8 per thread (legacy's
//            tiling with every register array in registers)
//   r128     128x128, BK 16, 256 threads, 8x8 per thread
//   r128x64  128 rows x 64 columns, BK 16, 128 threads, 8x8 per thread
//   r64      64x64, BK 16, 256 threads, 4x4 per thread
// Every variant handles every layout and size (edge tiles masked); an unknown name raises.
//
// bfloat16/float16 (issue 18): both sources and the output of one 2-byte type, float32
// accumulation, each output element rounded once to the type (round to nearest even), as the
// CPU does through the BLAS in float32. Where the device has cooperative matrices for the
// type: shaders/matmul_coopmat_op.comp on tensor cores, its tiling and split-K slices from
// coopmat_op_plan or RECURRA_VK_COOPMAT / RECURRA_VK_SPLITK (csrc/coopmat.h; "off" forces the
// fallback), a row-major A first copied transposed where the plan says so (transpose_h.comp,
// RECURRA_VK_TRANSPOSE). Elsewhere the fallback, the
// "_h" modules of matmul_reg.comp (2-byte scalar loads and stores, RECURRA_VK_MATMUL picks
// among r128k8, r128, r128x64, r64 as for float32; legacy means auto). Both need
// storageBuffer16BitAccess; without it the node is refused (the core runs it on the CPU).
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "../coopmat.h"
#include "ops.h"

namespace recurra_vk {

namespace {

struct MatmulPC {
  uint64_t a, b, c;
  int32_t M, N, K;
  int32_t a_rs, a_cs, b_rs, b_cs;
  int32_t nb1;
  int32_t a_b0, a_b1, b_b0, b_b1;
};

// A shader variant: module name and the C tile it owns per workgroup.
struct Kernel {
  const char* module;
  int64_t bm, bn;
};

// Two workgroups per SM of an H200 (132 SMs): below that, smaller tiles fill the GPU better.
constexpr int64_t kEnoughTiles = 264;

// half: the 2-byte modules ("_h"), which matmul.comp has none of (legacy means auto).
Kernel choose_kernel(int64_t m, int64_t n, int64_t batch, bool half) {
  static const Kernel legacy128{"matmul_128", 128, 128}, legacy64{"matmul_64", 64, 64};
  static const Kernel r128k8{"matmul_r128k8", 128, 128}, r128{"matmul_r128", 128, 128};
  static const Kernel r128x64{"matmul_r128x64", 128, 64}, r64{"matmul_r64", 64, 64};
  auto tiles = [&](const Kernel& k) { return ((m + k.bm - 1) / k.bm) * ((n + k.bn - 1) / k.bn) * batch; };
  const char* env = std::getenv("RECURRA_VK_MATMUL");
  const std::string v = env ? (half && std::strcmp(env, "legacy") == 0 ? "auto" : env) : "";
  if (v == "legacy") return tiles(legacy128) >= kEnoughTiles ? legacy128 : legacy64;
  // Default: measured on an H200 at 4096^3 (TF32 off), r128k8 34.5 TFLOP/s, r128 30.6, r64
  // 28.6, r128x64 22.9, legacy 2.3 (its accumulators spill); PyTorch 50.7.
  if (v.empty() || v == "auto") {
    if (tiles(r128k8) >= kEnoughTiles) return r128k8;
    return tiles(r128x64) >= kEnoughTiles ? r128x64 : r64;
  }
  if (v == "r128k8") return r128k8;
  if (v == "r128") return r128;
  if (v == "r128x64") return r128x64;
  if (v == "r64") return r64;
  fail_invalid("RECURRA_VK_MATMUL=" + v +
               ": unknown matmul variant (expected legacy, auto, r128k8, r128, r128x64 or r64)");
}

bool is_half(recurra_dtype dt) { return dt == RECURRA_BF16 || dt == RECURRA_F16; }

// Dtypes: all float32, or all one 2-byte float type, or two sources of one 2-byte type into
// a float32 output (the product not rounded: a 2-byte weight gradient the core widens, see
// its fold_casts) (check_node refuses 2-byte tensors on devices without 16-bit storage).
std::string product_dtypes(const recurra_node_desc& n) {
  if (!is_half(n.dst.dtype) && !is_half(n.src[0].dtype)) return require_f32(n, 2);
  const recurra_dtype dt = is_half(n.dst.dtype) ? n.dst.dtype : n.src[0].dtype;
  const char* name = dt == RECURRA_BF16 ? "bfloat16" : "float16";
  for (int i = 0; i < 2; ++i)
    if (n.src[i].dtype != dt)
      return std::string(n.op) + ": source " + std::to_string(i) + " must be " + name + " like " +
             (is_half(n.dst.dtype) ? "the output" : "source 0");
  return "";
}

// Split-K: a product with too few 128x128 tiles of C to fill the GPU and a long K (the
// weight gradients, whose K is the batch's tokens, and a chunked LM head's input gradient,
// whose K is the vocabulary: 18 tiles on 132 SMs took 3.6 ms where cuBLAS takes 0.6) runs as
// S products over slices of K, each a batch entry of the big-tile kernel writing its partial
// C into scratch, then summed slice by slice in a fixed order (deterministic). The number of
// slices fills kEnoughTiles workgroups, each slice at least 256 long, at most 32 of them.
int64_t split_count(int64_t m, int64_t n, int64_t k) {
  const int64_t tiles = ((m + 127) / 128) * ((n + 127) / 128);
  if (tiles >= kEnoughTiles || k < 1024) return 1;
  const int64_t s = std::min<int64_t>({(kEnoughTiles + tiles - 1) / tiles, k / 256, 32});
  if (s < 2 || (s + 1) * m * n > kMaxIndex) return 1;
  return s;
}

struct SumSlicesPC {
  uint64_t p, c;
  uint32_t n, slices;
};

// A product's K cut into `splits` slices of ks (a multiple of `align` elements, so the slice
// offsets keep vector loads aligned) and the rest (fewer than align * splits): `sliced` is
// the batch of slices (batch index = slice, partial sums into scratch from part), `rest` the
// one more product over the tail of K (K 0: none), writing after them.
struct Split {
  MatmulPC sliced, rest;
  int64_t slices, mn;
};

Split split_k(const MatmulPC& pc, int64_t splits, int64_t align, uint64_t elem_bytes, uint64_t part) {
  Split r{pc, pc, 0, int64_t(pc.M) * pc.N};
  const int64_t ks = (pc.K / splits) & ~(align - 1);
  const int64_t rest = pc.K - splits * ks;
  r.slices = splits + (rest > 0 ? 1 : 0);
  MatmulPC& s = r.sliced;
  s.c = part;
  s.K = static_cast<int32_t>(ks);
  s.nb1 = static_cast<int32_t>(splits);
  s.a_b0 = s.b_b0 = 0;
  s.a_b1 = static_cast<int32_t>(ks * pc.a_cs);
  s.b_b1 = static_cast<int32_t>(ks * pc.b_rs);
  MatmulPC& t = r.rest;
  t.a = pc.a + static_cast<uint64_t>(splits * ks * pc.a_cs) * elem_bytes;
  t.b = pc.b + static_cast<uint64_t>(splits * ks * pc.b_rs) * elem_bytes;
  t.c = part + static_cast<uint64_t>(splits * r.mn) * 4;
  t.K = static_cast<int32_t>(rest);
  return r;
}

// The bytes of float32 partial sums a split of pc into `splits` needs (at most one more slice).
size_t split_bytes(const MatmulPC& pc, int64_t splits) {
  return static_cast<size_t>((splits + 1) * int64_t(pc.M) * pc.N) * 4;
}

void sum_slices(NodeCall& c, const Split& sp, const Range& part, const char* module, std::vector<int32_t> spec) {
  SumSlicesPC r{sp.sliced.c, addr(c.dst), static_cast<uint32_t>(sp.mn), static_cast<uint32_t>(sp.slices)};
  c.rec.dispatch(module, spec, r, grid_groups(sp.mn, 256), 1, 1, {part}, {c.dst.range});
}

void record_split(NodeCall& c, const MatmulPC& pc, int64_t splits, int a_kc, int b_kc, int vec_a, int vec_b,
                  int vec_c) {
  static const Kernel big{"matmul_r128k8", 128, 128};
  const auto part = c.rec.scratch(split_bytes(pc, splits));
  const Split sp = split_k(pc, splits, 4, 4, part.addr);
  const uint32_t gx = static_cast<uint32_t>((pc.N + big.bn - 1) / big.bn);
  const uint32_t gy = static_cast<uint32_t>((pc.M + big.bm - 1) / big.bm);
  c.rec.dispatch(big.module, {a_kc, b_kc, vec_a, vec_b, vec_c}, sp.sliced, gx, gy, static_cast<uint32_t>(splits),
                 {c.src[0].range, c.src[1].range}, {part.range});
  if (sp.rest.K > 0)  // vec4 loads along K need K a multiple of 4
    c.rec.dispatch(big.module, {a_kc, b_kc, a_kc ? 0 : vec_a, b_kc ? 0 : vec_b, vec_c}, sp.rest, gx, gy, 1,
                   {c.src[0].range, c.src[1].range}, {part.range});
  sum_slices(c, sp, part.range, "sum_slices", {});
}

template <bool OUT_PROD>
std::string product_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 2);
  if (why.empty()) why = product_dtypes(n);
  if (!why.empty()) return why;
  const recurra_tensor_desc &a = n.src[0], &b = n.src[1], &d = n.dst;
  if (a.ndim < 2 || b.ndim < 2 || d.ndim < 2) return "needs at least 2 axes";
  if (d.ndim != std::max(a.ndim, b.ndim)) return "output rank must be the larger source rank";
  const int64_t m = OUT_PROD ? a.shape[a.ndim - 1] : a.shape[a.ndim - 2];
  const int64_t k = OUT_PROD ? a.shape[a.ndim - 2] : a.shape[a.ndim - 1];
  if (b.shape[b.ndim - 2] != k) return "the contracted dimensions differ";
  if (d.shape[d.ndim - 2] != m || d.shape[d.ndim - 1] != b.shape[b.ndim - 1]) return "wrong output shape";
  const int nbd = d.ndim - 2;
  int64_t batch = 1;
  for (int i = 0; i < nbd; ++i) {
    const int ia = a.ndim - d.ndim + i, ib = b.ndim - d.ndim + i;
    const int64_t da = ia >= 0 ? a.shape[ia] : 1, db = ib >= 0 ? b.shape[ib] : 1;
    if ((da != d.shape[i] && da != 1) || (db != d.shape[i] && db != 1)) return "batch axes do not broadcast";
    batch *= d.shape[i];
  }
  if (batch > 65535) return "more than 65535 batch matrices";
  const int64_t ncols = d.shape[d.ndim - 1];
  if ((m + 63) / 64 > 65535 || (ncols + 63) / 64 > 65535) return "more than 4M rows or columns";
  return "";
}

// uvec4 loads (8 elements) along an operand's staged rows: unit stride there, the row's
// extent, the other stride and the batch strides multiples of 8, the address 16-byte aligned.
int vec8(uint64_t p, int32_t unit, int64_t extent, std::initializer_list<int64_t> strides) {
  if (unit != 1 || p % 16 || extent % 8) return 0;
  for (int64_t st : strides)
    if (st % 8) return 0;
  return 1;
}

// How the coopmat shader stages each operand: along its contiguous axis, A m-contiguous (a_t:
// a_rs 1, x^T views) or k-contiguous/general, B k-contiguous (b_t: b_rs 1, W^T views) or
// n-contiguous/general; vec_*: 16-byte loads along the staged rows.
struct HalfLayout {
  int a_t, b_t, vec_a, vec_b;
};
HalfLayout half_layout(const MatmulPC& pc, const int64_t* sa, const int64_t* sb) {
  HalfLayout l{};
  l.a_t = pc.a_rs == 1 && pc.a_cs != 1;
  l.b_t = pc.b_rs == 1 && pc.b_cs != 1;
  l.vec_a = l.a_t ? vec8(pc.a, pc.a_rs, pc.M, {pc.a_cs, sa[0], sa[1]}) : vec8(pc.a, pc.a_cs, pc.K, {pc.a_rs, sa[0], sa[1]});
  l.vec_b = l.b_t ? vec8(pc.b, pc.b_rs, pc.K, {pc.b_cs, sb[0], sb[1]}) : vec8(pc.b, pc.b_cs, pc.N, {pc.b_rs, sb[0], sb[1]});
  return l;
}

// Whether the op can copy A transposed (transpose_h.comp): one matrix, row-major (k-contiguous,
// 16-byte loads), the copy (rows of M rounded up to 8) indexable.
bool a_transposable(const MatmulPC& pc, int64_t batch, const int64_t* sa, const int64_t* sb) {
  const HalfLayout l = half_layout(pc, sa, sb);
  return batch == 1 && pc.M > 1 && !l.a_t && l.vec_a && (int64_t(pc.M) + 7) * int64_t(pc.K) <= kMaxIndex &&
         (pc.K + 63) / 64 <= 65535 && (pc.M + 63) / 64 <= 65535;
}

struct TransposePC {
  uint64_t a, t;
  int32_t M, K, rs, ts;
};

// One dispatch of a bfloat16/float16 product over `batch` matrices (batch strides sa, sb in
// elements), C of 2-byte type dt, or float32 when c_f32 (a split-K slice's partial sums), on
// the coopmat tiling `tile` (nullptr: the fallback shader); ra: the memory A's view covers.
void dispatch_half(NodeCall& c, const CoopMatOpTile* tile, const MatmulPC& pc, int64_t batch, const int64_t* sa,
                   const int64_t* sb, int32_t dt, bool c_f32, const Range& ra, const Range& out) {
  Device& dev = c.rec.device();
  const bool bf16 = dt == 2;
  if (tile) {
    const HalfLayout l = half_layout(pc, sa, sb);
    const int32_t wg = static_cast<int32_t>(coopmat_op_workgroup(dev, *tile));
    c.rec.dispatch(std::string("matmul_") + tile->name + (bf16 ? "_bf16" : "_f16"),
                   {wg, l.a_t, l.b_t, l.vec_a, l.vec_b, c_f32 ? 0 : dt}, pc,
                   static_cast<uint32_t>((pc.N + tile->bn - 1) / tile->bn),
                   static_cast<uint32_t>((pc.M + tile->bm - 1) / tile->bm), static_cast<uint32_t>(batch),
                   {ra, c.src[1].range}, {out});
    return;
  }
  // The fallback: scalar 2-byte loads and stores (VEC_* 0), the float32 kernel choice.
  const int a_kc = !(pc.a_rs == 1 && pc.a_cs != 1);
  const int b_kc = pc.b_rs == 1 && pc.b_cs != 1;
  const Kernel k = choose_kernel(pc.M, pc.N, batch, true);
  c.rec.dispatch(std::string(k.module) + "_h", {a_kc, b_kc, 0, 0, 0, dt, c_f32 ? 1 : 0}, pc,
                 static_cast<uint32_t>((pc.N + k.bn - 1) / k.bn), static_cast<uint32_t>((pc.M + k.bm - 1) / k.bm),
                 static_cast<uint32_t>(batch), {ra, c.src[1].range}, {out});
}

// The same for one matrix (a_transposable) with A first copied transposed into scratch by
// transpose_h.comp: the product then stages an m-contiguous A (A_T), which the H200 runs
// faster (284.6 against 253.3 TFLOP/s at 4096^3 on op128m; the copy takes 32 us of 517).
void dispatch_half_at(NodeCall& c, const CoopMatOpTile* tile, const MatmulPC& pc, const int64_t* sb, int32_t dt,
                      bool c_f32, const Range& out) {
  const int32_t ts = (pc.M + 7) / 8 * 8;
  const auto at = c.rec.scratch(static_cast<size_t>(int64_t(ts) * pc.K) * 2);
  const TransposePC tp{pc.a, at.addr, pc.M, pc.K, pc.a_rs, ts};
  c.rec.dispatch("transpose_h", {}, tp, static_cast<uint32_t>((pc.K + 63) / 64), static_cast<uint32_t>((ts + 63) / 64),
                 1, {c.src[0].range}, {at.range});
  MatmulPC p = pc;
  p.a = at.addr;
  p.a_rs = 1;
  p.a_cs = ts;
  const int64_t none[2] = {0, 0};
  dispatch_half(c, tile, p, 1, none, sb, dt, c_f32, at.range, out);
}

// A bfloat16/float16 product (pc and the batch strides filled in by product_record). Split-K
// as for float32 (few tiles of C, a long K), on the same kernels: the slices are a batch of
// the product writing float32 partial sums into scratch (K slices of a multiple of 16
// elements, the rest in one more dispatch), then sum_slices_h adds them in a fixed order and
// rounds each element once to the type. On tensor cores the tiling and the slices come from
// coopmat_op_plan (a cost model: waves of workgroups, the partial sums' traffic); the
// fallback takes split_count's. RECURRA_VK_SPLITK forces the slices on both (for tests and
// measurements; at most K / 16 of them).
//
// A float32 output (2-byte sources): the sums written as they are, not rounded (c_f32 on the
// kernels, the float32 sum_slices).
void record_half(NodeCall& c, const MatmulPC& pc, int64_t batch, const int64_t* sa, const int64_t* sb) {
  const int32_t dt = c.src[0].d->dtype == RECURRA_BF16 ? 2 : 3;  // half.glsl's DT_BF16 / DT_F16
  const bool out_f32 = c.dst.d->dtype == RECURRA_F32;
  CoopMatOpPlan plan{nullptr, 1};
  const bool transposable = a_transposable(pc, batch, sa, sb);
  if (coopmat_op_why_not(c.rec.device(), dt == 2).empty())
    plan = coopmat_op_plan(pc.M, pc.N, pc.K, batch, transposable);
  // The fallback transposes A only when RECURRA_VK_TRANSPOSE=on (tests: it runs transpose_h
  // where there are no cooperative matrices), and then takes no slices.
  else if (transposable && transpose_forced())
    plan.transpose_a = true;
  int64_t splits = plan.splits;
  if (!plan.tile && batch == 1) {
    const int64_t forced = forced_splits();
    splits = forced ? std::min<int64_t>(forced, pc.K / 16) : split_count(pc.M, pc.N, pc.K);
    if ((splits + 1) * pc.M * pc.N > kMaxIndex) splits = 1;
  }
  if (plan.transpose_a) return dispatch_half_at(c, plan.tile, pc, sb, dt, out_f32, c.dst.range);
  if (splits < 2) return dispatch_half(c, plan.tile, pc, batch, sa, sb, dt, out_f32, c.src[0].range, c.dst.range);
  const auto part = c.rec.scratch(split_bytes(pc, splits));
  const Split sp = split_k(pc, splits, 16, 2, part.addr);
  const int64_t ssa[2] = {0, sp.sliced.a_b1}, ssb[2] = {0, sp.sliced.b_b1}, none[2] = {0, 0};
  dispatch_half(c, plan.tile, sp.sliced, splits, ssa, ssb, dt, true, c.src[0].range, part.range);
  if (sp.rest.K > 0) dispatch_half(c, plan.tile, sp.rest, 1, none, none, dt, true, c.src[0].range, part.range);
  if (out_f32)
    sum_slices(c, sp, part.range, "sum_slices", {});
  else
    sum_slices(c, sp, part.range, "sum_slices_h", {dt});
}

template <bool OUT_PROD>
void product_record(NodeCall& c) {
  const recurra_tensor_desc &a = *c.src[0].d, &b = *c.src[1].d, &d = *c.dst.d;
  const int na = a.ndim, nb = b.ndim, nd = d.ndim;
  MatmulPC pc{};
  pc.a = addr(c.src[0]);
  pc.b = addr(c.src[1]);
  pc.c = addr(c.dst);
  pc.M = static_cast<int32_t>(d.shape[nd - 2]);
  pc.N = static_cast<int32_t>(d.shape[nd - 1]);
  pc.K = static_cast<int32_t>(OUT_PROD ? a.shape[na - 2] : a.shape[na - 1]);
  // A(m, k): matmul reads a's last two axes as (m, k); out_prod as (k, m).
  pc.a_rs = static_cast<int32_t>(OUT_PROD ? a.strides[na - 1] : a.strides[na - 2]);
  pc.a_cs = static_cast<int32_t>(OUT_PROD ? a.strides[na - 2] : a.strides[na - 1]);
  pc.b_rs = static_cast<int32_t>(b.strides[nb - 2]);
  pc.b_cs = static_cast<int32_t>(b.strides[nb - 1]);
  // Size-1 axes: their stride is never used to move, make it neutral for layout checks.
  if (pc.M == 1) pc.a_rs = 0;
  if (pc.K == 1) pc.a_cs = 0, pc.b_rs = 0;
  if (pc.N == 1) pc.b_cs = 0;
  // Batch axes (at most two), right-aligned, stride 0 where broadcast.
  int64_t bdim[2] = {1, 1}, sa[2] = {0, 0}, sb[2] = {0, 0};
  const int nbd = nd - 2;
  for (int i = 0; i < nbd; ++i) {
    const int slot = 2 - nbd + i;
    bdim[slot] = d.shape[i];
    const int ia = na - nd + i, ib = nb - nd + i;
    sa[slot] = (ia < 0 || a.shape[ia] == 1) ? 0 : a.strides[ia];
    sb[slot] = (ib < 0 || b.shape[ib] == 1) ? 0 : b.strides[ib];
  }
  pc.nb1 = static_cast<int32_t>(bdim[1]);
  pc.a_b0 = static_cast<int32_t>(sa[0]);
  pc.a_b1 = static_cast<int32_t>(sa[1]);
  pc.b_b0 = static_cast<int32_t>(sb[0]);
  pc.b_b1 = static_cast<int32_t>(sb[1]);
  const int64_t batch = bdim[0] * bdim[1];
  if (batch * pc.M * pc.N == 0) return;

  // Layouts: which axis of each operand is contiguous (k-contiguous also covers general
  // strides: the scalar loads use both strides).
  const int a_kc = !(pc.a_rs == 1 && pc.a_cs != 1);
  const int b_kc = pc.b_rs == 1 && pc.b_cs != 1;
  auto aligned = [](uint64_t p, std::initializer_list<int64_t> strides, int64_t extent) {
    if (p % 16 || extent % 4) return false;
    for (int64_t s : strides)
      if (s % 4) return false;
    return true;
  };
  // vec4 loads along the contiguous axis: that axis' extent, the other stride and the batch
  // strides multiples of 4, the address 16-byte aligned.
  const int vec_a = a_kc ? (pc.a_cs == 1 && aligned(pc.a, {pc.a_rs, sa[0], sa[1]}, pc.K))
                         : aligned(pc.a, {pc.a_cs, sa[0], sa[1]}, pc.M);
  const int vec_b = b_kc ? aligned(pc.b, {pc.b_cs, sb[0], sb[1]}, pc.K)
                         : (pc.b_cs == 1 && aligned(pc.b, {pc.b_rs, sb[0], sb[1]}, pc.N));
  const int vec_c = pc.N % 4 == 0 && pc.c % 16 == 0;
  if (is_half(a.dtype)) return record_half(c, pc, batch, sa, sb);

  // One to four rows (a token's step): gemv.comp splits each column's K over many threads.
  // RECURRA_VK_MATMUL=legacy|r.. keeps the tiled kernels for them too.
  const char* forced = std::getenv("RECURRA_VK_MATMUL");
  const int cols = b_kc ? 8 : 64;
  if (pc.M <= 4 && (pc.N + cols - 1) / cols <= 65535 && (!forced || !*forced || std::strcmp(forced, "auto") == 0)) {
    c.rec.dispatch("gemv", {b_kc}, pc, static_cast<uint32_t>((pc.N + cols - 1) / cols), static_cast<uint32_t>(batch), 1,
                   {c.src[0].range, c.src[1].range}, {c.dst.range});
    return;
  }
  const int64_t splits = batch == 1 && (!forced || !*forced || std::strcmp(forced, "auto") == 0)
                             ? split_count(pc.M, pc.N, pc.K)
                             : 1;
  if (splits > 1) return record_split(c, pc, splits, a_kc, b_kc, vec_a, vec_b, vec_c);
  const Kernel k = choose_kernel(pc.M, pc.N, batch, false);
  c.rec.dispatch(k.module, {a_kc, b_kc, vec_a, vec_b, vec_c}, pc, static_cast<uint32_t>((pc.N + k.bn - 1) / k.bn),
                 static_cast<uint32_t>((pc.M + k.bm - 1) / k.bm), static_cast<uint32_t>(batch),
                 {c.src[0].range, c.src[1].range}, {c.dst.range});
}

}  // namespace

void register_matmul_ops() {
  add_op("matmul", {product_check<false>, product_record<false>});
  add_op("out_prod", {product_check<true>, product_record<true>});
}

}  // namespace recurra_vk

// The RWKV-family recurrences on Vulkan: rwkv_wkv6, rwkv_wkv7, gated_linear_attn and their
// *_back ops, with the sources, shapes and packed results of the core's kernels
// (packages/core/csrc/ops/rwkv.h, rwkv_wkv6.cpp, rwkv_wkv7.cpp, gated_linear_attn.cpp).
// Shaders: wkv.comp (forward), wkv_back.comp + wkv_reduce.comp (backward), sharing
// wkv_common.glsl; built once per op with -DOP (0 wkv6, 1 wkv7, 2 GLA).
//
//   wkv6: (k, v, r, tf, td, state) -> [y, final states]
//   wkv7: (r, w, k, v, a, b, state) -> [y, final states]
//   GLA:  (k, v, q, g, state), fp [scale] -> [y, final states]
//   *_back: the same sources plus the packed output gradient -> the source gradients packed
//   in source order. Per-token inputs (T, H, S), tf (H, S), states (N, H, S, S); T = N runs
//   of n tokens. Sources arrive dense (the core's OpDef sets contiguous_srcs).
//
// Work split. Columns nu of a head's state (the value axis: j of wkv6/GLA, i of wkv7) never
// mix, so each (run, head) is split into NB blocks of CW columns, one workgroup each, for the
// whole run: N * H * NB workgroups, the state in registers. Inside a workgroup, P lanes share
// a column and split the contracted axis (R rows each); sums over it are subgroup shuffles
// (P <= the subgroup size, queried from the device). Per chunk of C tokens the per-token
// vectors are staged in shared memory (two barriers per chunk, none per token).
//
// Backward: one sweep saves the block's state every K tokens (K a multiple of C), then each
// segment of K tokens is recomputed from its checkpoint and walked backwards. Scratch:
// checkpoints N*H*NB * ceil(n/K) * R*CJ * WG floats (about N*H*S*S * n/K), segment states
// N*H*NB * K * (R*CJ + CJ) * WG floats (about N*H*S*S * K): bounded by K, not by T. Per-row
// gradients summed over the columns (dr, dk, dw, ...) are reduced inside the workgroup in a
// fixed order (lanes, subgroup shuffles, shared memory by subgroup) and written per block to
// `part` (NB * NX * T*H*S floats); wkv_reduce.comp adds the blocks in block order (and
// wkv6's bonus terms); wkv6's d tf is a token sum by reduce.comp. No atomics: the results are
// deterministic.
//
// Grid for the benchmark sizes (head 64, 32 heads) on a device with 32-lane subgroups:
// P = 8, R = 8, WG = 256; forward CJ = 1 (CW = 32, NB = 2), backward CJ = 2 (CW = 64, NB = 1).
//   T 4096 x 1 run: forward 64 workgroups, backward 32 (+ T*H = 131072 reduce rows).
//   T 1024 x 4 runs: forward 256, backward 128.
// RECURRA_VK_WKV="P,CJf,CJb,WG,K" overrides the tile (powers of two; 0 keeps a default).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ops.h"

namespace recurra_vk {

namespace {

struct WkvOp {
  const char* name;
  const char* fwd_module;
  const char* back_module;
  const char* reduce_module;
  const char* signature;
  int n_src;          // forward sources
  std::vector<int> tok;  // the (T, H, S) sources
  int hs;             // the (H, S) source, or -1
  int st;             // the state source
  int n_fp;
  int nk, nx;         // staged per-row vectors; per-row backward quantities
};

const WkvOp kWkv6{"rwkv_wkv6", "wkv6", "wkv6_back", "wkv6_reduce", "(k, v, r, tf, td, state)", 6, {0, 1, 2, 4},
                  3, 5, 0, 3, 3};
const WkvOp kWkv7{"rwkv_wkv7", "wkv7", "wkv7_back", "wkv7_reduce", "(r, w, k, v, a, b, state)", 7,
                  {0, 1, 2, 3, 4, 5}, -1, 6, 0, 5, 5};
const WkvOp kGla{"gated_linear_attn", "gla", "gla_back", "gla_reduce", "(k, v, q, g, state)", 5, {0, 1, 2, 3},
                 -1, 4, 1, 3, 3};

// Largest head size: the backward's shared memory (staged vectors plus per-subgroup row
// partials of one token) must fit the 32 KiB every device has.
constexpr int64_t kMaxHead = 512;
constexpr int64_t kMaxElems = (int64_t(1) << 31) - 1;  // 32-bit indices in the shaders

struct WkvPC {
  uint64_t src[8];
  uint64_t dst, part, ckpt, seg;
  uint32_t T, H, S, n;
  uint32_t NB, K, nck;
  float scale;
};
static_assert(sizeof(WkvPC) == 128, "push constants must be 128 bytes");

struct Dims {
  int64_t T = 0, H = 0, S = 0, N = 0, n = 0;
  int64_t ths() const { return T * H * S; }
  int64_t nhss() const { return N * H * S * S; }
};

Dims dims_of(const recurra_node_desc& nd, const WkvOp& op) {
  const recurra_tensor_desc& x = nd.src[op.tok[0]];
  Dims d;
  d.T = x.shape[0];
  d.H = x.shape[1];
  d.S = x.shape[2];
  d.N = nd.src[op.st].shape[0];
  d.n = d.N > 0 ? d.T / d.N : 0;
  return d;
}

bool shape_is(const recurra_tensor_desc& t, std::initializer_list<int64_t> s) {
  if (t.ndim != static_cast<int>(s.size())) return false;
  int i = 0;
  for (int64_t v : s)
    if (t.shape[i++] != v) return false;
  return true;
}

// The core's validation (rwkv_wkv6.cpp check_sources) plus what the shaders need.
std::string wkv_check(const recurra_node_desc& nd, const WkvOp& op, bool back) {
  const int want = op.n_src + (back ? 1 : 0);
  std::string why = require_srcs(nd, want);
  if (why.empty()) why = require_f32(nd, want);
  if (!why.empty()) return why;
  if (nd.n_fp != op.n_fp) return std::string(nd.op) + " takes " + std::to_string(op.n_fp) + " float parameter(s)";
  const recurra_tensor_desc& x = nd.src[op.tok[0]];
  if (x.ndim != 3) return std::string(nd.op) + ": per-token inputs must have shape (T, H, S)";
  for (int i : op.tok)
    if (!shape_is(nd.src[i], {x.shape[0], x.shape[1], x.shape[2]}))
      return std::string(nd.op) + ": the per-token inputs of " + op.signature + " must all have the same shape (T, H, S)";
  const int64_t T = x.shape[0], H = x.shape[1], S = x.shape[2];
  if (T < 1 || H < 1 || S < 1) return std::string(nd.op) + ": T, H and S must be at least 1";
  const recurra_tensor_desc& s = nd.src[op.st];
  if (s.ndim != 4 || s.shape[0] < 1 || s.shape[1] != H || s.shape[2] != S || s.shape[3] != S)
    return std::string(nd.op) + ": the state must have shape (n_seqs, H, S, S) with the H and S of the inputs";
  if (T % s.shape[0] != 0) return std::string(nd.op) + ": T is not a multiple of n_seqs";
  if (op.hs >= 0 && !shape_is(nd.src[op.hs], {H, S}))
    return std::string(nd.op) + ": the per-head input must have shape (H, S)";
  const int64_t ths = T * H * S, nhss = s.shape[0] * H * S * S;
  int64_t total = ths + nhss;
  if (back) {
    if (!shape_is(nd.src[op.n_src], {ths + nhss}))
      return std::string(nd.op) + ": the output gradient must be 1-D with T*H*S + n_seqs*H*S*S elements";
    total = 0;
    for (int i = 0; i < op.n_src; ++i) total += numel(nd.src[i]);
  }
  if (!shape_is(nd.dst, {total})) return std::string(nd.op) + ": the output must be 1-D with " + std::to_string(total) + " elements";
  for (int i = 0; i < want; ++i)
    if (!is_dense(nd.src[i])) return std::string(nd.op) + ": needs dense sources";
  if (!is_dense(nd.dst)) return std::string(nd.op) + ": needs a dense output";
  if (S > kMaxHead) return std::string(nd.op) + ": head sizes above " + std::to_string(kMaxHead) + " are not implemented on Vulkan";
  if (total > kMaxElems || ths * 8 > kMaxElems) return std::string(nd.op) + ": more than 2^31 elements";
  return "";
}

// ---- device properties and the tile ---------------------------------------------------

struct DevProps {
  uint32_t subgroup = 1;
  uint32_t shared_bytes = 32768;
  bool shuffle = false;
};

// The recurrences' view of the device's limits (Device::limits): shuffles need a
// power-of-two subgroup; without them a cluster is one lane.
DevProps dev_props(Device& dev) {
  const DeviceLimits& dl = dev.limits();
  DevProps d;
  d.subgroup = dl.subgroup_size;
  d.shared_bytes = dl.max_shared_bytes;
  d.shuffle = dl.subgroup_shuffle && (d.subgroup & (d.subgroup - 1)) == 0;
  if (!d.shuffle) d.subgroup = 1;  // clusters of one lane: no shuffles run
  return d;
}

// RECURRA_VK_WKV="P,CJf,CJb,WG,K": tile overrides for tuning (0 or absent: default).
struct Overrides {
  int64_t P = 0, cj_fwd = 0, cj_back = 0, WG = 0, K = 0;
};

Overrides overrides() {
  Overrides o;
  const char* e = std::getenv("RECURRA_VK_WKV");
  if (!e || !*e) return o;
  int64_t v[5] = {0, 0, 0, 0, 0};
  const char* s = e;
  for (int i = 0; i < 5 && *s; ++i) {
    char* end = nullptr;
    v[i] = std::strtoll(s, &end, 10);
    if (end == s) break;
    s = *end == ',' ? end + 1 : end;
  }
  auto pow2 = [](int64_t x) { return x > 0 && (x & (x - 1)) == 0 ? x : 0; };
  o.P = pow2(v[0]);
  o.cj_fwd = v[1] > 0 && v[1] <= 8 ? v[1] : 0;
  o.cj_back = v[2] > 0 && v[2] <= 8 ? v[2] : 0;
  o.WG = pow2(v[3]) <= 1024 ? pow2(v[3]) : 0;
  o.K = v[4] > 0 ? v[4] : 0;
  return o;
}

int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

struct Tile {
  int64_t P = 1, R = 1, CJ = 1, WG = 1, SG = 1, C = 1, CW = 1, NB = 1;
  std::vector<int32_t> spec() const {
    return {static_cast<int32_t>(WG), static_cast<int32_t>(P), static_cast<int32_t>(R), static_cast<int32_t>(CJ),
            static_cast<int32_t>(C), static_cast<int32_t>(WG), static_cast<int32_t>(SG)};
  }
};

// Shared floats per staged token.
int64_t per_token(const Tile& t, const WkvOp& op, bool back) {
  const int64_t sp = t.P * t.R;
  return op.nk * sp + (back ? 2 * t.CW + op.nx * (t.WG / t.SG) * sp : t.CW);
}

Tile pick_tile(int64_t S, const DevProps& dp, const WkvOp& op, bool back) {
  const Overrides ov = overrides();
  Tile t;
  t.SG = dp.subgroup;
  // Lanes per column: about 8 rows each, at most a subgroup (and 32).
  t.P = 1;
  while (t.P * 8 < S && t.P < t.SG && t.P < 32) t.P *= 2;
  if (ov.P) t.P = std::min<int64_t>(ov.P, t.SG);
  t.R = (S + t.P - 1) / t.P;
  // Columns per lane: the backward's per-row sums over columns cost shuffles per lane;
  // two columns a lane halve them (and the blocks).
  t.CJ = (back && S >= 32) ? 2 : 1;
  if (back ? ov.cj_back : ov.cj_fwd) t.CJ = back ? ov.cj_back : ov.cj_fwd;
  const int64_t col_threads = (S + t.CJ - 1) / t.CJ;
  t.WG = next_pow2(t.P * col_threads);
  // Up to 256 threads: every workgroup stages all S rows of its tokens' vectors, so wider
  // blocks of columns stage less in all (H200, head 64, 4 x 1024 tokens: wkv6 fwd+bwd
  // 14.2 ms with 64 threads, 5.6 with 128, 3.3 with 256; 512 is slower in the backward).
  t.WG = std::min<int64_t>(t.WG, std::max<int64_t>({t.SG, 256, 8 * t.P}));
  if (ov.WG) t.WG = ov.WG;
  t.WG = std::max<int64_t>(t.WG, std::max<int64_t>(t.SG, t.P));
  const int64_t budget = std::min<int64_t>(dp.shared_bytes, 48 * 1024) / 4 - 64;
  auto fit = [&] {
    t.CW = (t.WG / t.P) * t.CJ;
    return per_token(t, op, back) <= budget;
  };
  while (!fit() && t.WG > std::max(t.SG, t.P)) t.WG /= 2;
  while (!fit() && t.CJ > 1) t.CJ /= 2;
  t.C = std::max<int64_t>(1, std::min<int64_t>(32, budget / per_token(t, op, back)));
  t.NB = (S + t.CW - 1) / t.CW;
  return t;
}

void fill_sources(WkvPC& pc, NodeCall& c, int count) {
  for (int i = 0; i < count; ++i) pc.src[i] = addr(c.src[i]);
}

Range src_range(NodeCall& c, int i) { return i < c.node.n_src ? c.src[i].range : Range{}; }

template <const WkvOp* OP>
std::string check_fwd(const recurra_node_desc& n) {
  return wkv_check(n, *OP, false);
}

template <const WkvOp* OP>
std::string check_back(const recurra_node_desc& n) {
  return wkv_check(n, *OP, true);
}

template <const WkvOp* OP>
void record_fwd(NodeCall& c) {
  const WkvOp& op = *OP;
  const Dims d = dims_of(c.node, op);
  const Tile t = pick_tile(d.S, dev_props(c.rec.device()), op, false);
  WkvPC pc{};
  fill_sources(pc, c, op.n_src);
  pc.dst = addr(c.dst);
  pc.T = static_cast<uint32_t>(d.T);
  pc.H = static_cast<uint32_t>(d.H);
  pc.S = static_cast<uint32_t>(d.S);
  pc.n = static_cast<uint32_t>(d.n);
  pc.NB = static_cast<uint32_t>(t.NB);
  pc.K = 1;
  pc.scale = op.n_fp ? static_cast<float>(fp(c.node, RECURRA_P_SCALE)) : 1.0f;
  uint32_t gx, gy;
  grid_2d(d.N * d.H * t.NB, gx, gy);
  c.rec.dispatch(op.fwd_module, t.spec(), pc, gx, gy, 1,
                 {src_range(c, 0), src_range(c, 1), src_range(c, 2), src_range(c, 3), src_range(c, 4),
                  src_range(c, 5), src_range(c, 6)},
                 {c.dst.range});
}

// The checkpoint interval: about 32 tokens (the segment states stay in a large GPU's L2),
// a multiple of the chunk.
int64_t checkpoint_interval(const Tile& t, int64_t n) {
  const Overrides ov = overrides();
  const int64_t want = ov.K ? ov.K : 32;
  int64_t K = std::max<int64_t>(1, (want + t.C - 1) / t.C) * t.C;
  // Short runs: one segment.
  if (n <= K) K = std::max<int64_t>(t.C, (n + t.C - 1) / t.C * t.C);
  return K;
}

template <const WkvOp* OP>
void record_back(NodeCall& c) {
  const WkvOp& op = *OP;
  Recorder& rec = c.rec;
  const Dims d = dims_of(c.node, op);
  const DevProps dp = dev_props(rec.device());
  const Tile t = pick_tile(d.S, dp, op, true);
  const int64_t K = checkpoint_interval(t, d.n), nck = (d.n + K - 1) / K;
  const int64_t groups = d.N * d.H * t.NB, rc = t.R * t.CJ;
  const auto ckpt = rec.scratch(static_cast<size_t>(groups * nck * rc * t.WG) * 4);
  const auto seg = rec.scratch(static_cast<size_t>(groups * K * (rc + t.CJ) * t.WG) * 4);
  const auto part = rec.scratch(static_cast<size_t>(t.NB * op.nx * d.ths()) * 4);
  WkvPC pc{};
  fill_sources(pc, c, op.n_src + 1);
  pc.dst = addr(c.dst);
  pc.part = part.addr;
  pc.ckpt = ckpt.addr;
  pc.seg = seg.addr;
  pc.T = static_cast<uint32_t>(d.T);
  pc.H = static_cast<uint32_t>(d.H);
  pc.S = static_cast<uint32_t>(d.S);
  pc.n = static_cast<uint32_t>(d.n);
  pc.NB = static_cast<uint32_t>(t.NB);
  pc.K = static_cast<uint32_t>(K);
  pc.nck = static_cast<uint32_t>(nck);
  pc.scale = op.n_fp ? static_cast<float>(fp(c.node, RECURRA_P_SCALE)) : 1.0f;
  const std::initializer_list<Range> srcs = {src_range(c, 0), src_range(c, 1), src_range(c, 2), src_range(c, 3),
                                             src_range(c, 4), src_range(c, 5), src_range(c, 6), src_range(c, 7)};
  uint32_t gx, gy;
  grid_2d(groups, gx, gy);
  rec.dispatch(op.back_module, t.spec(), pc, gx, gy, 1, srcs, {c.dst.range, part.range, ckpt.range, seg.range});

  // The block sums (and wkv6's bonus terms), one workgroup per (token, head).
  const bool wkv6 = OP == &kWkv6;
  Recorder::Scratch du{};
  if (wkv6) du = rec.scratch(static_cast<size_t>(d.ths()) * 4);
  WkvPC rp = pc;
  rp.ckpt = wkv6 ? du.addr : 0;
  Tile rt;
  rt.WG = 64;
  grid_2d(d.T * d.H, gx, gy);
  rec.dispatch(op.reduce_module, rt.spec(), rp, gx, gy, 1,
               {src_range(c, 0), src_range(c, 1), src_range(c, 2), src_range(c, 3), src_range(c, 4),
                src_range(c, 5), src_range(c, 6), part.range},
               {c.dst.range, du.range});
  if (wkv6) {
    // d tf[h, i] = the sum over all tokens of r k gv, in token order.
    ReduceSpec r;
    r.kn = 1;
    r.kshape[0] = d.H * d.S;
    r.kst[0] = 1;
    r.sn = 1;
    r.sshape[0] = d.T;
    r.sst[0] = d.H * d.S;
    record_reduce(rec, r, du.addr, du.range, addr(c.dst) + static_cast<uint64_t>(3 * d.ths()) * 4, c.dst.range);
  }
}

}  // namespace

void register_rwkv_ops() {
  add_op("rwkv_wkv6", {check_fwd<&kWkv6>, record_fwd<&kWkv6>});
  add_op("rwkv_wkv6_back", {check_back<&kWkv6>, record_back<&kWkv6>});
  add_op("rwkv_wkv7", {check_fwd<&kWkv7>, record_fwd<&kWkv7>});
  add_op("rwkv_wkv7_back", {check_back<&kWkv7>, record_back<&kWkv7>});
  add_op("gated_linear_attn", {check_fwd<&kGla>, record_fwd<&kGla>});
  add_op("gated_linear_attn_back", {check_back<&kGla>, record_back<&kGla>});
}

}  // namespace recurra_vk

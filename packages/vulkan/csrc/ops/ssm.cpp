// Mamba's recurrent ops: ssm_conv, ssm_conv_back, ssm_scan, ssm_scan_back.
// Shaders: ssm_conv.comp, ssm_scan.comp, ssm_scan_back_sum.comp, ssm_scan_chunked.comp.
//
// Shapes (numpy order) and packed results exactly as the core's CPU kernels
// (packages/core/csrc/ops/ssm_conv.cpp, ssm_scan/; docs/ops.md, "ssm_conv" and "ssm_scan"):
//   ssm_conv       (sx (S, D, W-1+T), c (D, W)) -> y (S, T, D)
//   ssm_conv_back  (dy, sx, c) -> packed d_sx (S, D, W-1+T), d_c (D, W)
//   ssm_scan       (s (R, H, P, N), x (S, T, H, P), dt (S, T, H), A (H, N) or (H, 1),
//                   B, C (S, T, G, N), ids (S,) i32) -> packed y (S, T, H, P), final states
//                   (S, H, P, N)
//   ssm_scan_back  (packed grad, s, x, dt, A, B, C, ids) -> packed ds (R, H, P, N),
//                   dx, ddt, dA, dB, dC
// The core's OpDefs set contiguous_srcs for all four, so every source arrives dense; the
// checks refuse only what the core refuses (and non-dense views, which it never passes).
// An entry of ids outside [0, R) sets an error flag that synchronize() reports (the CPU
// raises ValueError); the affected sequence starts from a zero state and its results are
// zero (forward) or meaningless (backward).
//
// ssm_conv: 32 channels x 32 tokens per workgroup through a shared-memory tile (loads
// coalesced along the input's fast axis, stores along the output's). d_c: one partial per
// (sequence, 32-token block) in scratch (S * ceil(T/32) * D * W floats), summed in order
// by a second dispatch.
//
// ssm_scan: see the header of ssm_scan.comp. The layout (lanes per unit NL, states per
// lane NT, units per workgroup UW, tokens per staged chunk TC) is chosen per node from the
// shapes and the device's minimum subgroup size and shared memory (scan_layout below):
// NL grows until each lane holds <= 16 states and there are ~64K lanes in flight.
// Grid: S * G * ceil(H/G * P / UW) workgroups of UW * NL threads. Benchmark sizes (H200,
// subgroup 32, 48 KiB shared memory):
//   Mamba-2 S4 T1024 H32 P64 N128 G1: NL 8, NT 16; forward UW 16 (128 threads), 512
//     workgroups; backward UW 32 (256 threads), 256 workgroups; staged tokens TC 27 (fwd), 8 (bwd).
//   Mamba-1 S4 T1024 H1536 P1 N16 G1: NL 8, NT 2; forward UW 16, 384 workgroups;
//     backward UW 32, 192 workgroups.
// Backward scratch, in floats (nst = S*H*P*N, nx = S*T*H*P, nbc = S*T*G*N,
// nblk = ceil(H/G*P / UW)):
//   checkpoints  nck * nst   one decay per head: anchors every K tokens, K = 64 doubled
//                            until 16 K >= T (<= 17 anchors); per state: K ~ sqrt(T)
//   work         nx (one decay per head: y) or K * nst (per state: one segment's states)
//   dC, dB parts 2 * nblk * nbc; d softplus(dt) parts nx; dA parts S*H*P*NA; d_s nst
// For the Mamba-2 benchmark that is ~16M + 8M + 67M + 8M + 1M floats (~400 MB); storing
// every state would take 4 GB. Very large d_state (N above ~2500 with 32 KiB of shared
// memory) does not fit the staging buffers: record() raises then.
//
// ssm_scan, chunked (state-space-duality) form: shaders/ssm_scan_chunked.comp (algorithm in its header).
// Taken for one decay per head (A (H, 1), Mamba-2) when T >= 128 (two 64-token chunks);
// RECURRA_VK_SSM=seq forces the sequential kernels above, =chunk the chunked ones for any
// Mamba-2 shape (T >= 1), =auto (or unset) the rule above. Any P, N, G, H work (tiles of 64
// channels / states, partial tiles masked); efficiency is best for P, N multiples of 64 and
// falls for P or N far below 64 (P = 1 uses 1/64 of a tile); Mamba-1 (A (H, N)) always runs
// sequentially. Scratch grows as S*H*ceil(T/64)*P*N (the states entering each chunk), with
// no per-token storage; past 2^31 floats (32-bit offsets), or on a device with less than
// ~26 KB of shared memory, the sequential kernels run instead. A <= 0 (Mamba's -exp(A_log))
// makes every exponent in the chunked form <= 0 (no overflow, at most underflow to 0); with
// a positive A the recurrence itself grows exponentially, and both paths can overflow.
// Dispatches (256 threads each) for the Mamba-2 benchmark (S 4, T 1024, H 32, P 64, N 128,
// G 1: nc = 16 chunks, 1 P tile, 2 N tiles; "chunks" = S*H*nc = 2048):
//   forward   prep 2048 | CB 64 | states 256 (one per state tile, 16 chunks in sequence) |
//             y 2048
//   backward  prep 2048 | CB 64 | [states 256] | state grads 256 (in reverse) | dC,dB 1024
//             (2 heads each) | du 2048 | decay 2048 | fin: dB,dC 2048, dA 1, ds 4096
// Checkpoints: a forward asked to save them (flag RECURRA_SSM_SCAN_SAVE_CHECKPOINTS: the Python API does when a gradient
// follows and an input is on a device) writes the states entering each chunk (nc*nst floats,
// the core's layout (S, H, nc, P, N)) after (y, final states) in its output instead of
// scratch; the backward given that output as a 9th source reads them and skips the
// bracketed dispatch (the forward's recomputation). Under RECURRA_VK_SSM=seq the
// sequential forward runs and prep and the states (VAR 3) then fill them; with
// checkpoints the chunked kernels run from T = 1 on. Head_dim 1 checkpoints (Mamba-1's CPU
// layout) are refused: such a node runs on the CPU.
// Each dispatch declares the scratch regions it reads and writes, so independent ones share
// a barrier phase: forward [prep, CB] [states] [y], backward [prep, CB] [states, state grads]
// [ds, dC/dB, du] [decay, fin dB/dC] [fin dA].
// Scratch (floats; sht = S*H*T, nst = S*H*P*N): forward 2*sht + S*G*nc*64*64 + nc*nst
// = 17.3M (69 MB; the nc*nst states, 16.8M, go to the output with checkpoints); backward
// adds nc*nst (state gradients) + nst + 2*S*T*N*H/hblk (dB, dC per block of hblk heads)
// + (1 + 2*npt)*sht + (1 + npt)*S*H*nc (npt = P tiles): 52.3M floats (209 MB) here.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <stdexcept>

#include "half_ops.h"
#include "ops.h"

namespace recurra_vk {

namespace {

// ---- device limits --------------------------------------------------------------------

struct Limits {
  uint32_t sg_min = 1;   // smallest subgroup size a compute shader may get
  uint32_t shmem = 32768;
  bool shuffle = false;
};

// The scan's view of the device's limits (Device::limits).
Limits limits_of(Device& dev) {
  const DeviceLimits& dl = dev.limits();
  Limits l;
  l.sg_min = dl.min_subgroup_size;
  l.shmem = std::min<uint32_t>(dl.max_shared_bytes, 49152);
  l.shuffle = dl.subgroup_shuffle;
  return l;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t pow2_ceil(int64_t v) {
  int64_t p = 1;
  while (p < v) p *= 2;
  return p;
}

bool same4(const recurra_tensor_desc& d, int64_t a, int64_t b, int64_t c, int64_t e) {
  return d.ndim == 4 && d.shape[0] == a && d.shape[1] == b && d.shape[2] == c && d.shape[3] == e;
}

std::string dense_srcs(const recurra_node_desc& n) {
  for (int i = 0; i < n.n_src; ++i)  // empty tensors have no layout to speak of
    if (numel(n.src[i]) > 0 && !is_dense(n.src[i])) return std::string(n.op) + " needs dense sources (the core passes them dense)";
  if (numel(n.dst) > 0 && !is_dense(n.dst)) return std::string(n.op) + " needs a dense output";
  return "";
}

// ---- ssm_conv -------------------------------------------------------------------------

struct ConvPC {
  uint64_t sx, c, dy, out, part;
  int32_t S, D, T, W, ntb, nch;
};

constexpr int64_t kConvCB = 32, kConvTB = 32;

// (sx, c) at sources off, off + 1: "" or why not; dims out.
std::string conv_dims(const recurra_node_desc& n, int off, int64_t* S, int64_t* D, int64_t* W, int64_t* T) {
  const recurra_tensor_desc &sx = n.src[off], &c = n.src[off + 1];
  if (sx.dtype != RECURRA_F32 || c.dtype != RECURRA_F32 || n.dst.dtype != RECURRA_F32)
    return std::string(n.op) + " takes float32 tensors";
  if (sx.ndim != 3 || c.ndim != 2 || c.shape[1] < 1 || c.shape[0] != sx.shape[1] || sx.shape[2] < c.shape[1] - 1)
    return std::string(n.op) + ": sx must be (n_seqs, d_inner, d_conv - 1 + n_tok), c (d_inner, d_conv)";
  *S = sx.shape[0];
  *D = sx.shape[1];
  *W = c.shape[1];
  *T = sx.shape[2] - (*W - 1);
  return "";
}

std::string conv_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 2);
  int64_t S, D, W, T;
  if (why.empty()) why = conv_dims(n, 0, &S, &D, &W, &T);
  if (!why.empty()) return why;
  if (n.dst.ndim != 3 || n.dst.shape[0] != S || n.dst.shape[1] != T || n.dst.shape[2] != D)
    return "ssm_conv: the output must be (n_seqs, n_tok, d_inner)";
  return dense_srcs(n);
}

void conv_record(NodeCall& c) {
  int64_t S, D, W, T;
  conv_dims(c.node, 0, &S, &D, &W, &T);
  if (S * T * D == 0) return;
  const int64_t nch = ceil_div(D, kConvCB), ntb = ceil_div(T, kConvTB);
  ConvPC pc{addr(c.src[0]), addr(c.src[1]), 0, addr(c.dst), 0, int32_t(S), int32_t(D), int32_t(T), int32_t(W),
            int32_t(ntb), int32_t(nch)};
  uint32_t gx, gy;
  grid_2d(S * ntb * nch, gx, gy);
  c.rec.dispatch("ssm_conv", {0}, pc, gx, gy, 1, {c.src[0].range, c.src[1].range}, {c.dst.range});
}

std::string conv_back_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 3);
  int64_t S, D, W, T;
  if (why.empty()) why = conv_dims(n, 1, &S, &D, &W, &T);
  if (!why.empty()) return why;
  const recurra_tensor_desc& dy = n.src[0];
  if (dy.dtype != RECURRA_F32 || dy.ndim != 3 || dy.shape[0] != S || dy.shape[1] != T || dy.shape[2] != D)
    return "ssm_conv_back: dy must be float32 (n_seqs, n_tok, d_inner)";
  if (n.dst.ndim != 1 || n.dst.shape[0] != numel(n.src[1]) + numel(n.src[2]))
    return "ssm_conv_back: the output must be the packed (d_sx, d_c)";
  return dense_srcs(n);
}

void conv_back_record(NodeCall& c) {
  int64_t S, D, W, T;
  conv_dims(c.node, 1, &S, &D, &W, &T);
  const int64_t L = W - 1 + T, nch = ceil_div(D, kConvCB), ntb = ceil_div(T, kConvTB);
  const uint64_t dsx = addr(c.dst), dc = dsx + uint64_t(S * D * L) * 4;
  Recorder& rec = c.rec;
  const Range &dyr = c.src[0].range, &sxr = c.src[1].range, &cr = c.src[2].range;
  if (S * D * L > 0) {
    ConvPC pc{addr(c.src[1]), addr(c.src[2]), addr(c.src[0]), dsx, 0, int32_t(S), int32_t(D), int32_t(T),
              int32_t(W), int32_t(ntb), int32_t(nch)};
    uint32_t gx, gy;
    grid_2d(S * ceil_div(L, kConvTB) * nch, gx, gy);
    rec.dispatch("ssm_conv", {1}, pc, gx, gy, 1, {dyr, cr}, {c.dst.range});
  }
  if (D * W == 0) return;
  const int64_t nparts = S * ntb;
  const auto part = rec.scratch(static_cast<size_t>(std::max<int64_t>(1, nparts * D * W)) * 4);
  ConvPC pc{addr(c.src[1]), addr(c.src[2]), addr(c.src[0]), dc, part.addr, int32_t(S), int32_t(D), int32_t(T),
            int32_t(W), int32_t(ntb), int32_t(nch)};
  if (nparts > 0) {
    uint32_t gx, gy;
    grid_2d(nparts * nch, gx, gy);
    rec.dispatch("ssm_conv", {2}, pc, gx, gy, 1, {dyr, sxr}, {part.range});
  }
  rec.dispatch("ssm_conv", {3}, pc, grid_groups(D * W, 256), 1, 1, {part.range}, {c.dst.range});
}

// ---- ssm_scan -------------------------------------------------------------------------

struct ScanDims {
  int64_t R, S, T, H, P, N, G, NA;
};

// (s, x, dt, A, B, C, ids) at sources off.. : "" or why not.
std::string scan_dims(const recurra_node_desc& n, int off, ScanDims* d) {
  // x, dt, B, C may be 2-byte (RECURRA_OPS_HALF_IN: the "_h" kernels read them as they are)
  for (int k = off; k < off + 6; ++k)
    if (n.src[k].dtype != RECURRA_F32 && (k == off || k == off + 3 || !is_half(n.src[k].dtype)))
      return std::string(n.op) + ": s and A must be float32, x, dt, B, C float32, bfloat16 or float16";
  if (n.src[off + 6].dtype != RECURRA_I32) return std::string(n.op) + ": ids must be int32";
  if (n.dst.dtype != RECURRA_F32) return std::string(n.op) + ": the output must be float32";
  const recurra_tensor_desc &s = n.src[off], &x = n.src[off + 1], &dt = n.src[off + 2], &A = n.src[off + 3],
                            &B = n.src[off + 4], &C = n.src[off + 5], &ids = n.src[off + 6];
  if (s.ndim != 4 || x.ndim != 4 || dt.ndim != 3 || A.ndim != 2 || B.ndim != 4 || ids.ndim != 1)
    return std::string(n.op) + ": wrong ranks (s 4, x 4, dt 3, A 2, B 4, C 4, ids 1)";
  d->R = s.shape[0];
  d->S = x.shape[0];
  d->T = x.shape[1];
  d->H = x.shape[2];
  d->P = x.shape[3];
  d->N = s.shape[3];
  d->G = B.shape[2];
  d->NA = A.shape[1];
  if (d->H < 1 || d->P < 1 || d->N < 1 || d->G < 1) return std::string(n.op) + ": sizes must be >= 1";
  if (s.shape[1] != d->H || s.shape[2] != d->P || d->R < d->S) return std::string(n.op) + ": s does not match x";
  if (dt.shape[0] != d->S || dt.shape[1] != d->T || dt.shape[2] != d->H) return std::string(n.op) + ": dt does not match x";
  if (A.shape[0] != d->H || (d->NA != d->N && d->NA != 1)) return std::string(n.op) + ": A must be (H, N) or (H, 1)";
  if (!same4(B, d->S, d->T, d->G, d->N) || !same4(C, d->S, d->T, d->G, d->N))
    return std::string(n.op) + ": B and C must be (n_seqs, n_tok, n_group, d_state)";
  if (d->H % d->G != 0) return std::string(n.op) + ": n_head must be a multiple of n_group";
  if (ids.shape[0] != d->S) return std::string(n.op) + ": ids must have n_seqs entries";
  // 32-bit indices in the shaders
  if (d->S * d->T * d->H * d->P >= (int64_t(1) << 31) || d->R * d->H * d->P * d->N >= (int64_t(1) << 31) ||
      d->S * d->T * d->G * d->N >= (int64_t(1) << 31))
    return std::string(n.op) + ": tensors past 2^31 elements";
  return "";
}

// Floats of (y, final states), the packed forward result without checkpoints.
int64_t scan_packed(const ScanDims& d) { return d.S * d.T * d.H * d.P + d.S * d.H * d.P * d.N; }

// Checkpoints a forward asked to save (RECURRA_SSM_SCAN_SAVE_CHECKPOINTS) for the backward: with one decay per head
// and head_dim > 1, the state entering each 64-token chunk, (S, H, ceil(T/64), P, N), after
// (y, final states) in the packed result (the core's layout; its CPU kernels write the same).
// The core's other checkpoint layout (head_dim 1, Mamba-1) is a CPU-kernel format: refused.
int64_t ck_floats(const ScanDims& d) { return d.S * d.H * ceil_div(d.T, 64) * d.P * d.N; }

std::string scan_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 7);
  ScanDims d;
  if (why.empty()) why = scan_dims(n, 0, &d);
  if (!why.empty()) return why;
  if (n.n_fp != 0 || n.n_ip > 1 || (n.n_ip == 1 && (n.ip[RECURRA_P_SCAN_FLAGS] & ~int64_t{RECURRA_SSM_SCAN_SAVE_CHECKPOINTS}) != 0))
    return "ssm_scan: the only parameter is save_checkpoints (0 or 1)";
  const bool ck = n.n_ip == 1 && (n.ip[RECURRA_P_SCAN_FLAGS] & RECURRA_SSM_SCAN_SAVE_CHECKPOINTS) != 0;
  if (ck && (d.P == 1 || d.NA != 1))
    return "ssm_scan: checkpoints for head_dim 1 or one decay per state are a CPU-kernel layout";
  if (n.dst.ndim != 1 || n.dst.shape[0] != scan_packed(d) + (ck ? ck_floats(d) : 0))
    return "ssm_scan: the output must be the packed (y, final states[, checkpoints])";
  return dense_srcs(n);
}

std::string scan_back_check(const recurra_node_desc& n) {
  std::string why = n.n_src == 9 ? "" : require_srcs(n, 8);
  ScanDims d;
  if (why.empty()) why = scan_dims(n, 1, &d);
  if (!why.empty()) return why;
  const int64_t ck = n.n_src == 9 ? ck_floats(d) : 0;
  if (n.n_src == 9) {
    const recurra_tensor_desc& fw = n.src[8];
    if (d.P == 1 || d.NA != 1) return "ssm_scan_back: checkpoints for head_dim 1 or one decay per state are a CPU-kernel layout";
    if (fw.dtype != RECURRA_F32 || fw.ndim != 1 || fw.shape[0] != scan_packed(d) + ck)
      return "ssm_scan_back: the 9th source must be the forward's packed result with checkpoints";
  }
  const recurra_tensor_desc& gr = n.src[0];
  if (gr.dtype != RECURRA_F32 || gr.ndim != 1 || (gr.shape[0] != scan_packed(d) && gr.shape[0] != scan_packed(d) + ck))
    return "ssm_scan_back: grad must be the packed float32 (y, final states) gradient";
  int64_t total = 0;
  for (int k = 1; k < 7; ++k) total += numel(n.src[k]);
  if (n.dst.ndim != 1 || n.dst.shape[0] != total) return "ssm_scan_back: the output must be the packed gradients";
  return dense_srcs(n);
}

struct ScanLayout {
  int64_t NL = 1, NT = 1, UW = 1, TC = 1, NRED = 1, nblk = 1;
};

// Lanes per unit, states per lane, units per workgroup and staged tokens (see the header).
ScanLayout scan_layout(const ScanDims& d, bool backward, const Limits& lim) {
  ScanLayout l;
  const int64_t nl_max = std::min<int64_t>(32, lim.shuffle ? lim.sg_min : 1);
  while (l.NL < nl_max && ceil_div(d.N, l.NL) > 16) l.NL *= 2;
  while (l.NL < nl_max && d.S * d.H * d.P * l.NL < 65536 && ceil_div(d.N, 2 * l.NL) >= 2) l.NL *= 2;
  l.NT = ceil_div(d.N, l.NL);
  const int64_t NB = l.NL * l.NT, U = d.H / d.G * d.P;
  l.UW = std::max<int64_t>(1, std::min((backward ? 256 : 128) / l.NL, pow2_ceil(U)));
  for (;;) {
    l.NRED = backward ? std::max<int64_t>(1, l.UW * l.NL / lim.sg_min) : 1;
    const int64_t per_tok = 4 * (2 * NB + 4 * l.UW + l.NRED * NB);
    l.TC = std::min<int64_t>(32, lim.shmem / per_tok);
    if (l.TC >= 1 || l.UW == 1) break;
    l.UW /= 2;
  }
  if (l.TC < 1)
    throw std::runtime_error("ssm_scan: d_state " + std::to_string(d.N) +
                             " does not fit this device's shared memory (" + std::to_string(lim.shmem) + " bytes)");
  l.nblk = ceil_div(U, l.UW);
  return l;
}

struct ScanPC {
  uint64_t gr, s, x, dt, A, B, C, ids, out, scr, err;
  int32_t R, S, T, H, P, N, G, nblk, K, nck;
};

// Push constants shared by every scan dispatch: the sources s, x, dt, A, B, C, ids from
// c.src[off..off+6] (off 1 for the backward, whose c.src[0] is the gradient), the error flags
// and the sizes. The caller adds out, scr and its layout's nblk, K, nck.
ScanPC scan_pc(NodeCall& c, const ScanDims& d, int off) {
  ScanPC pc{};
  if (off == 1) pc.gr = addr(c.src[0]);
  pc.s = addr(c.src[off + 0]);
  pc.x = addr(c.src[off + 1]);
  pc.dt = addr(c.src[off + 2]);
  pc.A = addr(c.src[off + 3]);
  pc.B = addr(c.src[off + 4]);
  pc.C = addr(c.src[off + 5]);
  pc.ids = addr(c.src[off + 6]);
  pc.err = c.rec.device().error_flags_address();
  pc.R = int32_t(d.R), pc.S = int32_t(d.S), pc.T = int32_t(d.T), pc.H = int32_t(d.H), pc.P = int32_t(d.P);
  pc.N = int32_t(d.N), pc.G = int32_t(d.G);
  return pc;
}

// The dtype codes of dt, x, B and C (sources off + 2, +1, +4, +5), which may be 2-byte
// (RECURRA_OPS_HALF_IN): the "_h" kernels read them as they are.
struct ScanDts {
  int32_t v[4] = {0, 0, 0, 0};
  bool half() const { return v[0] || v[1] || v[2] || v[3]; }
};

ScanDts scan_dts(const NodeCall& c, int off) {
  ScanDts d;
  const int at[4] = {off + 2, off + 1, off + 4, off + 5};
  for (int k = 0; k < 4; ++k) d.v[k] = dt_code(c.node.src[at[k]].dtype);
  return d;
}

std::vector<int32_t> scan_spec(const ScanLayout& l, int mode, bool pern, const ScanDts& dts) {
  return {int32_t(l.UW * l.NL), int32_t(l.NL), int32_t(l.NT), int32_t(l.TC), mode, pern ? 1 : 0, int32_t(l.UW),
          int32_t(l.NRED), dts.v[0], dts.v[1], dts.v[2], dts.v[3]};
}

struct FinPC {
  uint64_t src, src2, dst, dst2, dt, ids;
  uint32_t n, m, P, H, NA, nstate, S;
};

// ---- ssm_scan, chunked form (shaders/ssm_scan_chunked.comp) -----------------------------------------

constexpr int64_t kChunk = 64;  // chunk length = tile edge of ssm_scan_chunked.comp

struct SsdGeom {
  int64_t nc, npt, nnt;
  int64_t hblk;                     // heads per dC/dB workgroup
  int64_t fwd_floats, back_floats;  // scratch
};

// Scratch (floats, same order as in ssm_scan_chunked.comp): dtp, cs (S*H*T each), CB (S*G*nc*64*64),
// hin (S*H*nc*P*N) | backward: lam (S*H*nc*P*N), d s per sequence (S*H*P*N), dB and dC
// parts per block of hblk heads of a group (2 * H/G/hblk * S*T*G*N), dy . y per token
// (S*H*T), per-token partial sums per P tile (2 * npt*S*H*T), <lam, h_out> parts
// (S*H*nc*npt), dA parts (S*H*nc).
SsdGeom ssd_geom(const ScanDims& d) {
  SsdGeom g;
  g.nc = ceil_div(d.T, kChunk);
  g.npt = ceil_div(d.P, kChunk);
  g.nnt = ceil_div(d.N, kChunk);
  // Heads per dC/dB workgroup: 2 (their products with B and C are shared) while >= 512
  // workgroups remain, else 1. On the H200 at the benchmark size, 2 heads: 0.78 ms, 4: 0.85.
  // RECURRA_VK_SSD_HBLK=1|2|4 forces a block size (where it divides H / G; for tests).
  const int64_t hpg = d.H / d.G;
  const char* env = std::getenv("RECURRA_VK_SSD_HBLK");
  const int64_t forced = env ? std::atoi(env) : 0;
  g.hblk = 1;
  if (forced == 1 || forced == 2 || forced == 4) {
    if (hpg % forced == 0) g.hblk = forced;
  } else {
    if (hpg % 2 == 0 && d.S * d.G * g.nc * (hpg / 2) >= 512) g.hblk = 2;
  }
  const int64_t sht = d.S * d.H * d.T, nst = d.S * d.H * d.P * d.N;
  const int64_t nbc = hpg / g.hblk * d.S * d.T * d.G * d.N;
  g.fwd_floats = 2 * sht + d.S * d.G * g.nc * kChunk * kChunk + nst * g.nc;
  g.back_floats = g.fwd_floats + nst * g.nc + nst + 2 * nbc + sht + 2 * g.npt * sht +
                  d.S * d.H * g.nc * g.npt + d.S * d.H * g.nc;
  return g;
}

// Rows of ssm_scan_chunked.comp's matrix sM that a MODE uses (its constant SMR).
int32_t ssd_rows(int mode) { return mode >= 4 && mode <= 6 ? 64 : mode == 7 ? 2 : 1; }

// ssm_scan_chunked.comp's shared memory with K steps of kt and `rows` rows of sM: cs, dtp,
// two staged kt x 68 tiles, a rows x 65 matrix.
constexpr uint32_t ssd_shared(uint32_t kt, uint32_t rows) { return 4 * (2 * 64 + 2 * kt * 68 + rows * 65); }
constexpr uint32_t kSsdShared = ssd_shared(16, 64);

// The K step of each MODE's matmuls (index: MODE; 3 is unused), 32 only where the device
// has the shared memory (MODE 4, 5, 6: ~35 KB; the others ~18 KB), else 16. 32 halves the
// barrier rounds; 16 needs fewer registers (the next K step's operands are loaded ahead),
// and registers bound how many 256-thread workgroups a multiprocessor holds. NVIDIA's
// compiler (driver 580), registers at K 16 / 32: CB 63 / 95, states 64 / 119 (forward),
// 79 / 119 (recomputed), 104 / 128 (reverse), y 95 / 129; dC/dB 175, du 139 at 32. At 16
// the forward and recomputing state passes fit 3 workgroups per multiprocessor instead of
// 2, so their 384 workgroups at 8 x 512 tokens (24 heads) run in one wave. One scan's
// forward + backward (recomputing the states) at that shape, H100, per dispatch, K 32 ->
// 16: states 0.215 -> 0.135 ms (forward), 0.189 -> 0.119 (recomputed), 0.217 -> 0.221
// (reverse), y 0.271 -> 0.265, CB, prep and decay ~0.01 less each. dC/dB and du stay at
// 32: a variant of each with fewer live accumulators (135 and 126 registers at 16) was no
// faster at 16 (0.578 vs 0.573 ms, 0.229 vs 0.227).
constexpr int32_t kSsdKt[8] = {16, 16, 16, 16, 16, 32, 32, 16};

// y and du (MODE 4, 6) take K steps of 8 where two of their workgroups with K steps of 16
// (25.9 KB of shared memory each, and the 1 KB a multiprocessor reserves per workgroup) do
// not fit in the device's shared memory limit: on NVIDIA's driver that limit (48 KiB) is
// also all the shared memory a multiprocessor gives Vulkan work (about 49 KiB with the
// reserve, measured on the H200: README, issue 18 round 12), so at 16 or 32 one workgroup
// of 256 invocations runs per multiprocessor, at 8 (21.5 KB) two, as their registers allow
// (y 95, du at most 128). H200, Mamba2-130m layer at 8 x 512 tokens (bench/scan_dtypes.py,
// medians of 25, float32 / bfloat16 sources): y 0.258 / 0.268 -> 0.167 / 0.166 ms, du
// 0.215 / 0.246 -> 0.168 / 0.171; dC/dB (207 registers, one workgroup either way) stays at
// 32 (0.531 at 8 and 32). Devices whose limit holds two workgroups at 16 keep kSsdKt.
int32_t ssd_default_kt(Device& dev, int mode) {
  if ((mode == 4 || mode == 6) && 2 * (ssd_shared(16, ssd_rows(mode)) + 1024) > limits_of(dev).shmem)
    return 8;
  return kSsdKt[mode];
}

// RECURRA_VK_SSD_KT (for tests and measurements): 8 or 16 forces that K step everywhere, 32
// takes 32 wherever the shared memory allows, "MODE:K,..." (e.g. "4:16,6:16") sets the
// listed MODEs and leaves the others at their default (ssd_default_kt).
int32_t ssd_kt(Device& dev, int mode) {
  int32_t kt = ssd_default_kt(dev, mode);
  if (const char* env = std::getenv("RECURRA_VK_SSD_KT"); env && *env) {
    const std::string v = env;
    if (v == "8" || v == "16" || v == "32") {
      kt = std::atoi(env);
    } else {
      for (size_t at = 0;;) {  // items "MODE:K" between commas (none empty)
        const size_t comma = v.find(',', at);
        const std::string item = v.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
        const int m = item.size() > 2 && item[1] == ':' ? item[0] - '0' : -1;
        const std::string k = m < 0 ? "" : item.substr(2);
        if (m < 0 || m > 7 || (k != "8" && k != "16" && k != "32"))
          fail_invalid("RECURRA_VK_SSD_KT=" + v +
                       ": expected 8, 16, 32 or MODE:K,... (MODE 0-7, K 8, 16 or 32)");
        if (m == mode) kt = std::atoi(k.c_str());
        if (comma == std::string::npos) break;
        at = comma + 1;
      }
    }
  }
  if (kt == 8) return 8;
  return kt == 32 && limits_of(dev).shmem >= ssd_shared(32, ssd_rows(mode)) ? 32 : 16;
}

// RECURRA_VK_SSM: "seq" forces the sequential kernels, "chunk" the chunked ones wherever
// they apply; "" or "auto": chunked from T >= 2 chunks. They apply to one decay per head,
// T >= 1, scratch below 2^31 floats (32-bit offsets) and devices with the shared memory
// of ssm_scan_chunked.comp (~26 KB; Vulkan guarantees only 16 KB); elsewhere the sequential kernels run.
bool chunk_capable(const ScanDims& d, Device& dev) {
  return d.NA == 1 && d.T >= 1 && ssd_geom(d).back_floats < (int64_t(1) << 31) && limits_of(dev).shmem >= kSsdShared;
}

// ck: the node saves (forward) or reads (backward) checkpoints: then the chunked kernels run
// for any T unless RECURRA_VK_SSM=seq (their checkpoints are what the backward wants).
bool use_chunked(const ScanDims& d, Device& dev, bool ck) {
  const char* env = std::getenv("RECURRA_VK_SSM");
  const std::string v = env ? env : "";
  if (!v.empty() && v != "auto" && v != "seq" && v != "chunk")
    fail_invalid("RECURRA_VK_SSM=" + v + ": unknown ssm_scan path (expected auto, seq or chunk)");
  if (v == "seq" || !chunk_capable(d, dev)) return false;
  return v == "chunk" || ck || d.T >= 2 * kChunk;
}

// ssm_scan_chunked.comp's push constants: the scan's addresses, hin (the states entering each chunk),
// the sizes, and nc | hblk << 24.
struct SsdPC {
  uint64_t gr, s, x, dt, A, B, C, ids, out, scr, err, hin;
  int32_t R, S, T, H, P, N, G, nc_hblk;
};

// The shader's PIPE: its matmul loops load their first operands ahead (the K loops chained,
// the state passes one pipeline over the chunks). Only loads move: the same results bit for
// bit either way. By default on where it was measured faster: on the H200, Mamba2-130m layer
// at 8 x 512 tokens (bf16 autocast step, 4 layers, per layer, PIPE 0 -> 1): forward states
// 0.130 -> 0.120 ms, reverse states 0.233 -> 0.158, du (MODE 6) 0.265 -> 0.235; off where it
// was not: the recomputing state pass 0.120 -> 0.148 (by our reading of its SASS, 92 registers
// instead of 77: two workgroups per multiprocessor instead of three, 384 in two waves), dC/dB
// 0.555 -> 0.567, y 0.305 both. RECURRA_VK_SSD_PIPE=0 / 1 turns it off / on everywhere (for
// tests and measurements).
int32_t ssd_pipe(int mode, int var) {
  const char* env = std::getenv("RECURRA_VK_SSD_PIPE");
  if (env == nullptr || *env == 0) return (mode == 2 && (var == 0 || var == 2)) || mode == 6 ? 1 : 0;
  if (std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0) return *env - '0';
  fail_invalid(std::string("RECURRA_VK_SSD_PIPE=") + env + ": expected 0 or 1");
}

void ssd_dispatch(Recorder& rec, const ScanDts& dts, int mode, int var, const SsdPC& pc, int64_t groups,
                  std::initializer_list<Range> reads, std::initializer_list<Range> writes) {
  uint32_t gx, gy;
  grid_2d(groups, gx, gy);
  rec.dispatch(variant("ssm_scan_chunked", dts.half()),
               {mode, var, dts.v[0], dts.v[1], dts.v[2], dts.v[3], ssd_kt(rec.device(), mode), ssd_rows(mode),
                ssd_pipe(mode, var)},
               pc, gx, gy, 1, reads, writes);
}

SsdPC ssd_pc(NodeCall& c, const ScanDims& d, const SsdGeom& g, int off) {
  const ScanPC b = scan_pc(c, d, off);
  SsdPC pc{b.gr, b.s, b.x, b.dt, b.A, b.B, b.C, b.ids, 0, 0, b.err, 0, b.R, b.S, b.T, b.H, b.P, b.N, b.G,
           int32_t(g.nc | (g.hblk << 24))};
  return pc;
}

// Floats [lo, hi) of a region that starts at byte r.lo (scratch or a dense output): the
// recorder then orders only dispatches whose regions overlap, so independent passes of the
// chunked scan (prep and CB, the two state passes, ...) run side by side.
Range part(const Range& r, int64_t lo, int64_t hi) {
  return Range{r.block, r.lo + VkDeviceSize(lo) * 4, r.lo + VkDeviceSize(hi) * 4};
}

// The forward, chunked; with ck the states entering each chunk go to the output's checkpoint
// region instead of scratch. fill_only: the sequential kernels computed y and the final
// states; only the checkpoints are computed here (prep, states VAR 3).
void ssd_record(NodeCall& c, const ScanDims& d, bool ck, bool fill_only = false) {
  Recorder& rec = c.rec;
  const SsdGeom g = ssd_geom(d);
  const int64_t sht = d.S * d.H * d.T, nx = d.S * d.T * d.H * d.P, nst = d.S * d.H * d.P * d.N;
  const int64_t o_hin = 2 * sht + d.S * d.G * g.nc * kChunk * kChunk;
  const auto scr = rec.scratch(static_cast<size_t>(ck ? o_hin : g.fwd_floats) * 4);
  SsdPC pc = ssd_pc(c, d, g, 0);
  const ScanDts dts = scan_dts(c, 0);
  pc.out = addr(c.dst);
  pc.scr = scr.addr;
  pc.hin = ck ? pc.out + uint64_t(nx + nst) * 4 : scr.addr + uint64_t(o_hin) * 4;
  const Range &sr = c.src[0].range, &xr = c.src[1].range, &dtr = c.src[2].range, &Ar = c.src[3].range,
              &Br = c.src[4].range, &Cr = c.src[5].range, &idr = c.src[6].range;
  const Range pre = part(scr.range, 0, 2 * sht), cb = part(scr.range, 2 * sht, o_hin),
              hin = ck ? part(c.dst.range, nx + nst, nx + nst + ck_floats(d)) : part(scr.range, o_hin, g.fwd_floats);
  const Range out_y = part(c.dst.range, 0, nx), out_fin = part(c.dst.range, nx, nx + nst);
  const int64_t chunks = d.S * d.H * g.nc, tiles = d.S * d.H * g.npt * g.nnt;
  ssd_dispatch(rec, dts, 0, 0, pc, chunks, {dtr, Ar}, {pre});
  if (!fill_only) ssd_dispatch(rec, dts, 1, 0, pc, d.S * d.G * g.nc, {Br, Cr}, {cb});
  if (fill_only) {
    ssd_dispatch(rec, dts, 2, 3, pc, tiles, {sr, idr, xr, Br, pre}, {hin});
    return;
  }
  ssd_dispatch(rec, dts, 2, 0, pc, tiles, {sr, idr, xr, Br, pre}, {hin, out_fin});
  ssd_dispatch(rec, dts, 4, 0, pc, chunks * g.npt, {xr, Cr, idr, pre, cb, hin}, {out_y});
}

void ssd_back_record(NodeCall& c, const ScanDims& d) {
  Recorder& rec = c.rec;
  const SsdGeom g = ssd_geom(d);
  const auto scr = rec.scratch(static_cast<size_t>(g.back_floats) * 4);
  const int64_t sht = d.S * d.H * d.T, nst = d.S * d.H * d.P * d.N, nx = d.S * d.T * d.H * d.P;
  const int64_t nbc = d.S * d.T * d.G * d.N;
  // scratch regions (floats; the order of ssm_scan_chunked.comp)
  const int64_t nblkh = d.H / d.G / g.hblk, nbcp = nblkh * nbc;
  const int64_t o_cb = 2 * sht, o_hin = o_cb + d.S * d.G * g.nc * kChunk * kChunk;
  const int64_t o_lam = g.fwd_floats, o_dsi = o_lam + nst * g.nc, o_dbp = o_dsi + nst, o_dcp = o_dbp + nbcp;
  const int64_t o_qy = o_dcp + nbcp, o_q = o_qy + sht, o_e = o_q + 2 * g.npt * sht;
  const int64_t o_dap = o_e + d.S * d.H * g.nc * g.npt;
  const Range &sc = scr.range;
  const Range pre = part(sc, 0, o_cb), cb = part(sc, o_cb, o_hin), hin_s = part(sc, o_hin, o_lam),
              lam = part(sc, o_lam, o_dsi), dsi = part(sc, o_dsi, o_dbp), dbc = part(sc, o_dbp, o_qy),
              qy = part(sc, o_qy, o_q), qx = part(sc, o_q, o_e), ep = part(sc, o_e, o_dap),
              dap = part(sc, o_dap, g.back_floats);
  // packed outputs: ds, dx, ddt, dA, dB, dC (floats, then addresses)
  const int64_t f_dx = d.R * d.H * d.P * d.N, f_ddt = f_dx + nx, f_dA = f_ddt + d.S * d.T * d.H;
  const int64_t f_dB = f_dA + d.H, f_dC = f_dB + nbc, f_end = f_dC + nbc;
  const uint64_t base = addr(c.dst);
  const uint64_t p_ds = base, p_dx = base + uint64_t(f_dx) * 4, p_ddt = base + uint64_t(f_ddt) * 4;
  const uint64_t p_dA = base + uint64_t(f_dA) * 4, p_dB = base + uint64_t(f_dB) * 4;
  const uint64_t p_dC = base + uint64_t(f_dC) * 4;
  const Range &o = c.dst.range;
  const Range out_ds = part(o, 0, f_dx), out_dx = part(o, f_dx, f_ddt), out_ddt = part(o, f_ddt, f_dA),
              out_dA = part(o, f_dA, f_dB), out_dBC = part(o, f_dB, f_end);

  SsdPC pc = ssd_pc(c, d, g, 1);
  const ScanDts dts = scan_dts(c, 1);
  pc.scr = scr.addr;
  // the forward's checkpoints (a 9th source) replace the recomputed chunk states
  const bool ck = c.node.n_src == 9;
  const Range hin = ck ? part(c.src[8].range, nx + nst, nx + nst + ck_floats(d)) : hin_s;
  pc.hin = ck ? addr(c.src[8]) + uint64_t(nx + nst) * 4 : scr.addr + uint64_t(o_hin) * 4;
  const Range &grr = c.src[0].range, &sr = c.src[1].range, &xr = c.src[2].range, &dtr = c.src[3].range,
              &Ar = c.src[4].range, &Br = c.src[5].range, &Cr = c.src[6].range, &idr = c.src[7].range;
  const int64_t chunks = d.S * d.H * g.nc, tiles = d.S * d.H * g.npt * g.nnt;
  // Recorded in dependency order; consecutive dispatches on disjoint regions share a phase:
  // [prep, CB] [states, state grads] [ds, dC/dB, du] [decay, dB/dC] [dA]
  ssd_dispatch(rec, dts, 0, 0, pc, chunks, {dtr, Ar}, {pre});
  ssd_dispatch(rec, dts, 1, 0, pc, d.S * d.G * g.nc, {Br, Cr}, {cb});
  if (!ck) ssd_dispatch(rec, dts, 2, 1, pc, tiles, {sr, idr, xr, Br, pre}, {hin});
  ssd_dispatch(rec, dts, 2, 2, pc, tiles, {grr, Cr, pre}, {lam, dsi});

  const uint64_t sa = scr.addr;
  FinPC f{};
  f.P = uint32_t(d.P), f.H = uint32_t(d.H), f.NA = 1, f.nstate = uint32_t(d.H * d.P * d.N);
  f.S = uint32_t(d.S);
  {
    FinPC p = f;
    p.src = sa + uint64_t(o_dsi) * 4, p.dst = p_ds, p.ids = addr(c.src[7]), p.n = uint32_t(d.R * d.H * d.P * d.N);
    rec.dispatch("ssm_scan_back_sum", {3}, p, grid_groups(p.n, 256), 1, 1, {dsi, idr}, {out_ds});
  }
  ssd_dispatch(rec, dts, 5, 0, pc, d.S * d.G * nblkh * g.nc, {grr, xr, Br, Cr, pre, cb, hin, lam}, {dbc, qy});
  SsdPC p6 = pc;
  p6.out = p_dx;
  ssd_dispatch(rec, dts, 6, 0, p6, chunks * g.npt, {grr, xr, Br, Cr, pre, cb, hin, lam}, {out_dx, qx, ep});
  SsdPC p7 = pc;
  p7.out = p_ddt;
  ssd_dispatch(rec, dts, 7, 0, p7, chunks, {dtr, Ar, pre, qy, qx, ep}, {out_ddt, dap});
  if (nbc > 0) {
    FinPC p = f;
    p.src = sa + uint64_t(o_dbp) * 4, p.src2 = sa + uint64_t(o_dcp) * 4, p.dst = p_dB, p.dst2 = p_dC;
    p.n = uint32_t(nbc), p.m = uint32_t(nblkh);
    rec.dispatch("ssm_scan_back_sum", {0}, p, grid_groups(nbc, 256), 1, 1, {dbc}, {out_dBC});
  }
  {  // dA[h] = sum_i sum_chunk parts[i][h][chunk]: OP 2 with P = chunks
    FinPC p = f;
    p.src = sa + uint64_t(o_dap) * 4, p.dst = p_dA, p.n = uint32_t(d.H), p.P = uint32_t(g.nc);
    rec.dispatch("ssm_scan_back_sum", {2}, p, grid_groups(p.n, 256), 1, 1, {dap}, {out_dA});
  }
}

void scan_record(NodeCall& c) {
  ScanDims d;
  scan_dims(c.node, 0, &d);
  if (d.S == 0) return;
  Recorder& rec = c.rec;
  const bool ck = c.node.n_ip == 1 && (c.node.ip[RECURRA_P_SCAN_FLAGS] & RECURRA_SSM_SCAN_SAVE_CHECKPOINTS) != 0;
  if (use_chunked(d, rec.device(), ck)) return ssd_record(c, d, ck);
  const Limits lim = limits_of(rec.device());
  const ScanLayout l = scan_layout(d, false, lim);
  ScanPC pc = scan_pc(c, d, 0);
  pc.out = addr(c.dst);
  pc.nblk = int32_t(l.nblk), pc.K = 1, pc.nck = 0;
  uint32_t gx, gy;
  grid_2d(d.S * d.G * l.nblk, gx, gy);
  const ScanDts dts = scan_dts(c, 0);
  rec.dispatch(variant("ssm_scan", dts.half()), scan_spec(l, 0, d.NA != 1, dts), pc, gx, gy, 1,
               {c.src[0].range, c.src[1].range, c.src[2].range, c.src[3].range, c.src[4].range, c.src[5].range,
                c.src[6].range},
               {c.dst.range});
  // checkpoints asked for while the sequential kernels ran (RECURRA_VK_SSM=seq): computed by
  // the chunked ones, so that a chunked backward can read them. Where the chunked kernels
  // cannot run, no backward here reads them either (it runs sequentially).
  if (ck && d.T > 0 && chunk_capable(d, rec.device())) ssd_record(c, d, true, true);
}

void scan_back_record(NodeCall& c) {
  ScanDims d;
  scan_dims(c.node, 1, &d);
  Recorder& rec = c.rec;
  if (d.S > 0 && use_chunked(d, rec.device(), c.node.n_src == 9)) return ssd_back_record(c, d);
  const Limits lim = limits_of(rec.device());
  const ScanLayout l = scan_layout(d, true, lim);
  const bool pern = d.NA != 1;
  const int mode = pern ? 2 : 1;
  const ScanDts dts = scan_dts(c, 1);
  int64_t K = 1;
  if (mode == 1) {
    K = 64;
    while (K * 16 < d.T) K *= 2;
  } else {
    const int64_t r = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(d.T))));
    K = std::max<int64_t>(l.TC, ceil_div(r, l.TC) * l.TC);
  }
  const int64_t nck = ceil_div(d.T, K);
  const int64_t nst = d.S * d.H * d.P * d.N, nx = d.S * d.T * d.H * d.P, nbc = d.S * d.T * d.G * d.N;
  const int64_t scr_floats =
      nst * nck + (mode == 1 ? nx : nst * K) + 2 * l.nblk * nbc + nx + d.S * d.H * d.P * d.NA + nst;
  if (scr_floats >= (int64_t(1) << 32)) throw std::runtime_error("ssm_scan_back: scratch past 2^32 floats");
  const auto scr = rec.scratch(static_cast<size_t>(std::max<int64_t>(1, scr_floats)) * 4);
  const uint64_t o_dc = uint64_t(nst * nck + (mode == 1 ? nx : nst * K));
  const uint64_t o_db = o_dc + uint64_t(l.nblk * nbc), o_ddtp = o_db + uint64_t(l.nblk * nbc);
  const uint64_t o_da = o_ddtp + uint64_t(nx), o_dss = o_da + uint64_t(d.S * d.H * d.P * d.NA);

  // packed outputs: ds, dx, ddt, dA, dB, dC
  const uint64_t base = addr(c.dst);
  const uint64_t p_ds = base, p_dx = p_ds + uint64_t(d.R * d.H * d.P * d.N) * 4, p_ddt = p_dx + uint64_t(nx) * 4;
  const uint64_t p_dA = p_ddt + uint64_t(d.S * d.T * d.H) * 4, p_dB = p_dA + uint64_t(d.H * d.NA) * 4;
  const uint64_t p_dC = p_dB + uint64_t(nbc) * 4;

  if (d.S > 0) {
    ScanPC pc = scan_pc(c, d, 1);
    pc.out = p_dx;
    pc.scr = scr.addr;
    pc.nblk = int32_t(l.nblk), pc.K = int32_t(K), pc.nck = int32_t(nck);
    uint32_t gx, gy;
    grid_2d(d.S * d.G * l.nblk, gx, gy);
    rec.dispatch(variant("ssm_scan", dts.half()), scan_spec(l, mode, pern, dts), pc, gx, gy, 1,
                 {c.src[0].range, c.src[1].range, c.src[2].range, c.src[3].range, c.src[4].range, c.src[5].range,
                  c.src[6].range, c.src[7].range},
                 {c.dst.range, scr.range});
  }
  const uint64_t sa = scr.addr;
  FinPC f{};
  f.P = uint32_t(d.P), f.H = uint32_t(d.H), f.NA = uint32_t(d.NA), f.nstate = uint32_t(d.H * d.P * d.N);
  f.S = uint32_t(d.S);
  if (nbc > 0) {  // dC parts come first in scratch, dB's after
    FinPC p = f;
    p.src = sa + o_db * 4, p.src2 = sa + o_dc * 4, p.dst = p_dB, p.dst2 = p_dC, p.n = uint32_t(nbc);
    p.m = uint32_t(l.nblk);
    rec.dispatch("ssm_scan_back_sum", {0}, p, grid_groups(nbc, 256), 1, 1, {scr.range}, {c.dst.range});
  }
  if (d.S * d.T * d.H > 0) {
    FinPC p = f;
    p.src = sa + o_ddtp * 4, p.dst = p_ddt, p.dt = addr(c.src[3]), p.n = uint32_t(d.S * d.T * d.H);
    rec.dispatch(variant("ssm_scan_back_sum", dts.v[0] != 0), {1, dts.v[0]}, p, grid_groups(p.n, 256), 1, 1,
                 {scr.range, c.src[3].range}, {c.dst.range});
  }
  {
    FinPC p = f;
    p.src = sa + o_da * 4, p.dst = p_dA, p.n = uint32_t(d.H * d.NA);
    rec.dispatch("ssm_scan_back_sum", {2}, p, grid_groups(p.n, 256), 1, 1, {scr.range}, {c.dst.range});
  }
  {
    FinPC p = f;
    p.src = sa + o_dss * 4, p.dst = p_ds, p.ids = addr(c.src[7]), p.n = uint32_t(d.R * d.H * d.P * d.N);
    rec.dispatch("ssm_scan_back_sum", {3}, p, grid_groups(p.n, 256), 1, 1, {scr.range, c.src[7].range}, {c.dst.range});
  }
}

}  // namespace

void register_ssm_ops() {
  add_op("ssm_conv", {conv_check, conv_record});
  add_op("ssm_conv_back", {conv_back_check, conv_back_record});
  add_op("ssm_scan", {scan_check, scan_record});
  add_op("ssm_scan_back", {scan_back_check, scan_back_record});
}

}  // namespace recurra_vk

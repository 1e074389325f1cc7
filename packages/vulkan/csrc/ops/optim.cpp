// Optimizer ops on the device: sgd_step, adam_step, adamw_step, lion_step, grad_clip update
// their sources IN PLACE (parameter, moments, step count; the gradient for grad_clip) and
// write a 1-element dummy; grad_norm -> (2,) [norm, clip coefficient]. Semantics, source
// layout and hyper-parameter slots are the core's (packages/core/csrc/ops/optim_kernels.cpp):
//
//   sources: hyper (2 * RECURRA_HYPER_SLOTS,) f32, [gstat (2,) if ip[RECURRA_P_HAS_GSTAT]], then per
//   tensor (n = ip[RECURRA_P_N_TENSORS]):
//     sgd_step p, g, [buf if ip[RECURRA_P_HAS_BUF]], step     adam_step / adamw_step p, g, m, v, step
//     lion_step p, g, m, step                 grad_clip g
//   grad_norm: hyper, g... (ip {} or {0}); hyper, earlier grad_norm results... (ip {1})
//
// The core's scheduler runs these nodes where the memory they write lives (OpDef
// writes_src), so parameters and state never leave the device. The C table carries at most
// RECURRA_MAX_SRC sources per node: recurra's FusedStep cuts device steps to fit.
// Shaders: optim.comp (one dispatch for up to 3 tensors: the node's tensors, their step counts
// and its dummy; no barrier between the nodes of a step), grad_norm.comp.
#include <algorithm>
#include <string>

#include "ops.h"

namespace recurra_vk {

namespace {

enum UpdateOp { kSgd = 0, kAdam = 1, kAdamW = 2, kLion = 3, kClip = 4 };
constexpr int64_t kHyperLen = 2 * RECURRA_HYPER_SLOTS;

// optim.comp's push constants: one dispatch updates up to 3 tensors.
struct OptimPC {
  uint64_t hyper, gstat;
  uint64_t counter;  // a word that is 0 when the dispatch starts (0 for grad_clip: no counts)
  uint64_t dummy;    // the node's 1-element result, or 0 when another dispatch writes it
  uint64_t a[10];    // the tensors' sources, `per` each, in the op's source order
  uint32_t n[3];     // the tensors' sizes
  uint32_t flags;    // bit 0: gstat; bit 1: sgd has a momentum buffer; bits 2-3: tensors
};

struct NormPC {
  uint64_t hyper, x, partial, out;
  uint32_t n, base, raw;
};

int per_tensor(const recurra_node_desc& n, int op) {
  switch (op) {
    case kSgd: return ip(n, RECURRA_P_HAS_BUF) != 0 ? 4 : 3;
    case kAdam:
    case kAdamW: return 5;
    case kLion: return 4;
    default: return 1;
  }
}

bool is_vector(const recurra_tensor_desc& d, int64_t len) { return numel(d) == len && is_dense(d); }

template <int OP>
std::string update_check(const recurra_node_desc& n) {
  const int64_t want_ip = OP == kSgd ? 3 : 2;
  if (n.n_ip != want_ip || n.n_fp != 0) return std::string(n.op) + ": unexpected parameters";
  const int64_t count = ip(n, RECURRA_P_N_TENSORS), has_gstat = ip(n, RECURRA_P_HAS_GSTAT);
  if (count < 1 || (has_gstat != 0 && has_gstat != 1)) return std::string(n.op) + ": bad (n, has_gstat)";
  if (OP == kSgd && ip(n, RECURRA_P_HAS_BUF) != 0 && ip(n, RECURRA_P_HAS_BUF) != 1) return "sgd_step: has_buf must be 0 or 1";
  const int per = per_tensor(n, OP), first = 1 + static_cast<int>(has_gstat);
  if (n.n_src != first + count * per) return std::string(n.op) + ": source count does not match n";
  if (n.src[0].dtype != RECURRA_F32 || !is_vector(n.src[0], kHyperLen)) return "bad hyper-parameter tensor";
  if (has_gstat && (n.src[1].dtype != RECURRA_F32 || !is_vector(n.src[1], 2))) return "bad gstat tensor";
  for (int64_t t = 0; t < count; ++t) {
    const int base = first + static_cast<int>(t) * per;
    const int64_t len = numel(n.src[base]);
    for (int k = 0; k < per; ++k) {
      const recurra_tensor_desc& s = n.src[base + k];
      const bool is_step = OP != kClip && k == per - 1;
      if (is_step) {
        if (s.dtype != RECURRA_I32 || numel(s) != 1) return "the step count must be one int32";
      } else if (s.dtype != RECURRA_F32 || !is_vector(s, len)) {
        return std::string(n.op) + ": sources of one tensor must be dense float32 of one size";
      }
    }
    if (len >= (int64_t(1) << 31)) return "tensor too large";
  }
  return "";
}

// Tensors a dispatch updates at most (OptimPC::n), their addresses (OptimPC::a) and the
// workgroups one tensor gets at most, so that a dispatch stays within 65535 (optim.comp's
// MAX_GROUPS and groups_for).
constexpr int kMaxTensors = 3, kMaxAddr = 10;
constexpr uint32_t kMaxGroups = 21845;

uint32_t groups_for(uint32_t n) { return std::clamp(grid_groups(n, 1024), 1u, kMaxGroups); }

template <int OP>
void update_record(NodeCall& c) {
  const recurra_node_desc& n = c.node;
  const int count = static_cast<int>(ip(n, RECURRA_P_N_TENSORS));
  const bool has_gstat = ip(n, RECURRA_P_HAS_GSTAT) != 0;
  const int per = per_tensor(n, OP), first = 1 + (has_gstat ? 1 : 0);
  const int fit = std::min(kMaxTensors, kMaxAddr / per);
  // The tensors go in chunks of up to `fit`, one dispatch each (one for a node of two AdamW
  // tensors). A tensor whose memory a chunk's tensor also touches starts a new chunk, so
  // that the recorder orders the two updates (the CPU runs them one after the other).
  auto touches = [&](int t, int u) {
    for (int k = 0; k < per; ++k)
      for (int l = 0; l < per; ++l)
        if (overlap(c.src[first + t * per + k].range, c.src[first + u * per + l].range)) return true;
    return false;
  };
  bool dummy_written = false;
  for (int t0 = 0; t0 < count;) {
    int t1 = t0 + 1;
    while (t1 < count && t1 - t0 < fit) {
      bool clash = false;
      for (int u = t0; u < t1 && !clash; ++u) clash = touches(t1, u);
      if (clash) break;
      ++t1;
    }
    OptimPC pc{};
    pc.hyper = addr(c.src[0]);
    pc.gstat = has_gstat ? addr(c.src[1]) : 0;
    pc.flags = (has_gstat ? 1u : 0u) | (OP == kSgd && per == 4 ? 2u : 0u);
    pc.flags |= static_cast<uint32_t>(t1 - t0) << 2;
    std::vector<Range> reads = {c.src[0].range}, writes;
    if (has_gstat) reads.push_back(c.src[1].range);
    uint32_t groups = 0;
    for (int t = t0; t < t1; ++t) {
      const int base = first + t * per;
      pc.n[t - t0] = static_cast<uint32_t>(numel(*c.src[base].d));
      groups += groups_for(pc.n[t - t0]);
      for (int k = 0; k < per; ++k) {
        const Tensor& s = c.src[base + k];
        pc.a[(t - t0) * per + k] = addr(s);
        // sources the update only reads: the gradient (grad_clip writes it)
        (OP != kClip && k == 1 ? reads : writes).push_back(s.range);
      }
    }
    if (OP != kClip) {  // the last workgroup to arrive counts the steps (after all read them)
      const Recorder::Scratch word = c.rec.zeroed_word();
      pc.counter = static_cast<uint64_t>(word.addr);
      writes.push_back(word.range);
    }
    if (!dummy_written) {
      pc.dummy = addr(c.dst);
      writes.push_back(c.dst.range);
      dummy_written = true;
    }
    c.rec.dispatch("optim", {OP}, pc, groups, 1, 1, reads, writes);
    t0 = t1;
  }
}

std::string norm_check(const recurra_node_desc& n) {
  if (n.n_fp != 0 || n.n_ip > 1 || (n.n_ip == 1 && n.ip[RECURRA_P_COMBINE] != 0 && n.ip[RECURRA_P_COMBINE] != 1))
    return "grad_norm: bad parameters";
  if (n.n_src < 2) return "grad_norm takes hyper and at least one gradient";
  if (n.src[0].dtype != RECURRA_F32 || !is_vector(n.src[0], kHyperLen)) return "bad hyper-parameter tensor";
  if (n.dst.dtype != RECURRA_F32 || numel(n.dst) != 2) return "grad_norm writes (2,)";
  const bool combine = ip(n, RECURRA_P_COMBINE) == 1;
  for (int i = 1; i < n.n_src; ++i) {
    const recurra_tensor_desc& s = n.src[i];
    if (s.dtype != RECURRA_F32 || !is_dense(s)) return "grad_norm: sources must be dense float32";
    if (combine && numel(s) != 2) return "grad_norm: partial results have shape (2,)";
    if (numel(s) >= (int64_t(1) << 31)) return "tensor too large";
  }
  return "";
}

void norm_record(NodeCall& c) {
  const recurra_node_desc& n = c.node;
  const bool combine = ip(n, RECURRA_P_COMBINE) == 1;
  // Workgroups per gradient fixed by its size: the summation order depends on shapes only.
  std::vector<uint32_t> groups(n.n_src, 0);
  uint32_t total = 0;
  for (int i = 1; i < n.n_src; ++i) {
    groups[i] = combine ? 1u : std::max<uint32_t>(1, std::min<uint32_t>(grid_groups(numel(*c.src[i].d), 2048), 1024));
    total += groups[i];
  }
  const Recorder::Scratch part = c.rec.scratch(static_cast<size_t>(total) * 4);
  uint32_t base = 0;
  for (int i = 1; i < n.n_src; ++i) {
    NormPC pc{addr(c.src[0]), addr(c.src[i]), static_cast<uint64_t>(part.addr), 0,
              static_cast<uint32_t>(numel(*c.src[i].d)), base, combine ? 1u : 0u};
    c.rec.dispatch("grad_norm", {0}, pc, groups[i], 1, 1, {c.src[0].range, c.src[i].range}, {part.range});
    base += groups[i];
  }
  NormPC fin{addr(c.src[0]), 0, static_cast<uint64_t>(part.addr), addr(c.dst), total, 0, 0};
  c.rec.dispatch("grad_norm", {1}, fin, 1, 1, 1, {c.src[0].range, part.range}, {c.dst.range});
}

}  // namespace

void register_optim_ops() {
  add_op("sgd_step", {update_check<kSgd>, update_record<kSgd>});
  add_op("adam_step", {update_check<kAdam>, update_record<kAdam>});
  add_op("adamw_step", {update_check<kAdamW>, update_record<kAdamW>});
  add_op("lion_step", {update_check<kLion>, update_record<kLion>});
  add_op("grad_clip", {update_check<kClip>, update_record<kClip>});
  add_op("grad_norm", {norm_check, norm_record});
}

}  // namespace recurra_vk

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
// Shaders: optim.comp (one dispatch per tensor, then one for the step counts and the dummy),
// grad_norm.comp.
#include <algorithm>
#include <string>

#include "ops.h"

namespace recurra_vk {

namespace {

enum UpdateOp { kSgd = 0, kAdam = 1, kAdamW = 2, kLion = 3, kClip = 4, kBump = 5 };
constexpr int64_t kHyperLen = 2 * RECURRA_HYPER_SLOTS;

struct OptimPC {
  uint64_t hyper, gstat, p, g, s1, s2, step;
  uint32_t n, flags;
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

template <int OP>
void update_record(NodeCall& c) {
  const recurra_node_desc& n = c.node;
  const int64_t count = ip(n, RECURRA_P_N_TENSORS);
  const bool has_gstat = ip(n, RECURRA_P_HAS_GSTAT) != 0;
  const int per = per_tensor(n, OP), first = 1 + (has_gstat ? 1 : 0);
  for (int64_t t = 0; t < count; ++t) {
    const int base = first + static_cast<int>(t) * per;
    OptimPC pc{};
    pc.hyper = addr(c.src[0]);
    pc.gstat = has_gstat ? addr(c.src[1]) : 0;
    pc.flags = (has_gstat ? 1u : 0u) | (OP == kSgd && per == 4 ? 2u : 0u);
    const Range none{};
    Range gst = has_gstat ? c.src[1].range : none;
    if (OP == kClip) {
      pc.g = addr(c.src[base]);
      pc.n = static_cast<uint32_t>(numel(*c.src[base].d));
      if (pc.n) c.rec.dispatch("optim", {kClip}, pc, grid_groups(pc.n, 1024), 1, 1, {c.src[0].range, gst}, {c.src[base].range});
      continue;
    }
    const Tensor& p = c.src[base];
    const Tensor& g = c.src[base + 1];
    const Tensor& step = c.src[base + per - 1];
    const bool has_s1 = per >= 4, has_s2 = per == 5;
    pc.p = addr(p);
    pc.g = addr(g);
    pc.s1 = has_s1 ? addr(c.src[base + 2]) : 0;
    pc.s2 = has_s2 ? addr(c.src[base + 3]) : 0;
    pc.step = addr(step);
    pc.n = static_cast<uint32_t>(numel(*p.d));
    const Range s1r = has_s1 ? c.src[base + 2].range : none, s2r = has_s2 ? c.src[base + 3].range : none;
    if (pc.n)
      c.rec.dispatch("optim", {OP}, pc, grid_groups(pc.n, 1024), 1, 1, {c.src[0].range, gst, g.range, step.range},
                     {p.range, s1r, s2r});
  }
  // After every update of the node (they read the counts before the increment): one
  // dispatch increments up to 4 step counts (OP 5 takes their addresses in step, g, s1, s2)
  // and the last one writes the node's 1-element dummy (0, as the CPU) into p: a node of
  // two AdamW tensors records 3 dispatches, not 2 per tensor and a fill.
  std::vector<const Tensor*> steps;
  if (OP != kClip)
    for (int64_t t = 0; t < count; ++t) steps.push_back(&c.src[first + static_cast<int>(t) * per + per - 1]);
  size_t k = 0;
  do {
    OptimPC pc{};
    uint64_t* slot[4] = {&pc.step, &pc.g, &pc.s1, &pc.s2};
    Range r[4] = {};
    for (int j = 0; j < 4 && k < steps.size(); ++j, ++k) {
      *slot[j] = addr(*steps[k]);
      r[j] = steps[k]->range;
    }
    const bool last = k == steps.size();
    pc.p = last ? addr(c.dst) : 0;
    c.rec.dispatch("optim", {kBump}, pc, 1, 1, 1, {}, {r[0], r[1], r[2], r[3], last ? c.dst.range : Range{}});
  } while (k < steps.size());
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

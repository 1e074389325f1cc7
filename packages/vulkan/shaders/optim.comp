// Optimizer updates, in place, up to 3 tensors per dispatch (csrc/ops/optim.cpp):
//   OP 0 sgd_step, 1 adam_step, 2 adamw_step, 3 lion_step, 4 grad_clip.
// Semantics are the CPU kernels' (packages/core/csrc/ops/optim_kernels.cpp). The workgroups
// form a flat prefix per tensor (groups_for of its size: tensor 0 first), each a grid-stride
// loop over its tensor. The update reads the step count before its increment (t = step + 1):
// thread 0 of each workgroup reads it and, once its workgroup's share is done, arrives at the
// dispatch's counter (a word that is 0 when the dispatch starts); the last to arrive
// increments the step counts of the dispatch's tensors, so no workgroup sees a new count.
// Workgroup 0 writes the node's dummy (0, as the CPU) where the dispatch has one.
//
// Hyper-parameters come as (hi, lo) float pairs. Adam's bias corrections 1 - beta^t need
// more than hi + lo in float: 1 - 0.999f alone is off by 1.3e-5 relative. They are computed
// from d = 1 - beta (exact: 1 - hi is exact by Sterbenz, then - lo) with series for log(1 - d)
// and expm1 where those are small, so they hold ~1e-7 relative accuracy on any conformant
// device (whose log() may have 2^-21 absolute error near 1).
#version 450
#include "common.glsl"
#define RECURRA_GLSL
#include "recurra/op_spec.h"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int OP = 0;

layout(push_constant) uniform PC {
  uvec2 hyper, gstat;
  uvec2 counter;  // 0 when the dispatch starts (grad_clip: none, it counts no steps)
  uvec2 dummy;    // the node's 1-element result (0: another dispatch writes it)
  uvec2 a[10];    // per tensor its sources in the op's order: p, g, [s1], [s2], step; grad_clip: g
  uint n[3];      // the tensors' sizes
  uint flags;     // bit 0: gstat present; bit 1: sgd has a momentum buffer; bits 2-3: tensors
} pc;

// Workgroups per tensor: optim.cpp's groups_for (at least 1: every tensor counts its step).
const uint MAX_GROUPS = 21845u;
uint groups_for(uint n) { return clamp((n + 1023u) / 1024u, 1u, MAX_GROUPS); }

shared int step_before;

// The slots (recurra/op_spec.h).
const int LR = RECURRA_HYPER_LR, GRAD_SCALE = RECURRA_HYPER_GRAD_SCALE, CLIP_VALUE = RECURRA_HYPER_CLIP_VALUE,
          WEIGHT_DECAY = RECURRA_HYPER_WEIGHT_DECAY, A = RECURRA_HYPER_A, B = RECURRA_HYPER_B, C = RECURRA_HYPER_C,
          MAXIMIZE = RECURRA_HYPER_MAXIMIZE;

float hyp(int slot) {
  FBuf h = FBuf(pc.hyper);
  return h.v[2 * slot] + h.v[2 * slot + 1];
}

float clampc(float x, float c) { return min(max(x, -c), c); }

// 1 - beta^t, beta = hi + lo in [0, 1).
float one_minus_pow(int slot, int t) {
  FBuf h = FBuf(pc.hyper);
  const float hi = h.v[2 * slot], lo = h.v[2 * slot + 1];
  const float d = (1.0 - hi) - lo;
  float lnb;
  if (d < 0.25) {  // log(1 - d) = -(d + d^2/2 + d^3/3 + ...)
    float term = d, s = 0.0;
    for (int k = 1; k <= 40; ++k) {
      s += term / float(k);
      term *= d;
    }
    lnb = -s;
  } else {
    lnb = log(hi + lo);
  }
  const float x = float(t) * lnb;
  if (x > -0.25) {  // -expm1(x) by its series
    float term = x, s = x;
    for (int k = 2; k <= 14; ++k) {
      term *= x / float(k);
      s += term;
    }
    return -s;
  }
  return 1.0 - exp(x);
}

void main() {
  const uint count = (pc.flags >> 2) & 3u;
  const int per = OP == 4 ? 1 : OP == 0 ? ((pc.flags & 2u) != 0u ? 4 : 3) : OP == 3 ? 4 : 5;
  // This workgroup's tensor j and its place in the tensor's workgroups.
  uint j = 0u, first = 0u, groups = groups_for(pc.n[0]);
  while (j + 1u < count && gl_WorkGroupID.x >= first + groups) {
    first += groups;
    ++j;
    groups = groups_for(pc.n[j]);
  }
  const uint n = pc.n[j];
  const int at = int(j) * per;
  const bool lead = gl_LocalInvocationID.x == 0u;
  if (lead && gl_WorkGroupID.x == 0u && pc.dummy != uvec2(0u)) UBuf(pc.dummy).v[0] = 0u;
  if (OP != 4) {
    if (lead) step_before = IBuf(pc.a[at + per - 1]).v[0];
    barrier();
  }
  const bool has_gstat = (pc.flags & 1u) != 0u;
  const float pre = hyp(GRAD_SCALE);
  const float cv = hyp(CLIP_VALUE);
  const float clip = cv > 0.0 ? cv : uintBitsToFloat(0x7f800000u);
  float post = has_gstat ? FBuf(pc.gstat).v[1] : 1.0;
  if (OP != 4 && hyp(MAXIMIZE) != 0.0) post = -post;
  const uint stride = groups * 256u;
  const uint i0 = (gl_WorkGroupID.x - first) * 256u + gl_LocalInvocationID.x;
  FBuf g = FBuf(pc.a[at + (OP == 4 ? 0 : 1)]);
  if (OP == 4) {
    for (uint i = i0; i < n; i += stride) g.v[i] = clampc(g.v[i] * pre, clip) * post;
    return;
  }
  FBuf p = FBuf(pc.a[at]), s1 = FBuf(pc.a[at + 2]), s2 = FBuf(pc.a[at + 3]);
  const int t = step_before + 1;
  const float lr = hyp(LR), wd = hyp(WEIGHT_DECAY);
  if (OP == 0) {
    const bool has_buf = (pc.flags & 2u) != 0u;
    const float mom = hyp(A), damp = hyp(B);
    const bool nesterov = hyp(C) != 0.0;
    const float keep = t == 1 ? 0.0 : mom, add = t == 1 ? 1.0 : 1.0 - damp;
    for (uint i = i0; i < n; i += stride) {
      const float pi = p.v[i];
      const float gi = clampc(g.v[i] * pre, clip) * post + wd * pi;
      if (!has_buf) {
        p.v[i] = pi - lr * gi;
        continue;
      }
      const float b = keep * s1.v[i] + add * gi;
      s1.v[i] = b;
      p.v[i] = pi - lr * (nesterov ? gi + mom * b : b);
    }
  } else if (OP == 1 || OP == 2) {
    const float b1 = hyp(A), b2 = hyp(B), eps = hyp(C);
    const float step_size = lr / one_minus_pow(A, t);
    const float inv_bc2_sqrt = 1.0 / sqrt(one_minus_pow(B, t));
    const float l2 = OP == 2 ? 0.0 : wd;
    const float decay = OP == 2 ? 1.0 - lr * wd : 1.0;
    const float ob1 = 1.0 - b1, ob2 = 1.0 - b2;
    for (uint i = i0; i < n; i += stride) {
      const float pi = p.v[i];
      const float gi = clampc(g.v[i] * pre, clip) * post + l2 * pi;
      const float mi = b1 * s1.v[i] + ob1 * gi;
      const float vi = b2 * s2.v[i] + ob2 * gi * gi;
      s1.v[i] = mi;
      s2.v[i] = vi;
      p.v[i] = pi * decay - step_size * mi / (sqrt(vi) * inv_bc2_sqrt + eps);
    }
  } else if (OP == 3) {
    const float b1 = hyp(A), b2 = hyp(B);
    const float decay = 1.0 - lr * wd;
    for (uint i = i0; i < n; i += stride) {
      const float gi = clampc(g.v[i] * pre, clip) * post;
      const float mi = s1.v[i];
      const float u = b1 * mi + (1.0 - b1) * gi;
      p.v[i] = p.v[i] * decay - lr * sign(u);
      s1.v[i] = b2 * mi + (1.0 - b2) * gi;
    }
  }
  // This workgroup's lead read its count (above, its value stored) before it arrives; the
  // last to arrive increments the counts of the dispatch's tensors.
  if (lead) {
    memoryBarrierBuffer();
    if (atomicAdd(UBuf(pc.counter).v[0], 1u) == gl_NumWorkGroups.x - 1u) {
      memoryBarrierBuffer();
      for (uint k = 0u; k < count; ++k) IBuf(pc.a[int(k) * per + per - 1]).v[0] += 1;
    }
  }
}

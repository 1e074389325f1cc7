// gated_linear_attn (GLA) on the CPU, forward and backward.
//
// Shapes (numpy order): k, v, q, g (T, H, S); state (N, H, S, S) indexed [n, h, i key,
// j value]; fp = [scale]; T = N runs of n tokens. The state is updated before it is read:
//
//   S[i, j] = g_t[i] S[i, j] + k_t[i] v_t[j]
//   y_t[j]  = scale * sum_i q_t[i] S[i, j]
//
// Output, packed: y (T, H, S), then the final states (N, H, S, S). The forward is the decay
// recurrence of rwkv.h (decay_forward_task) with c = q g, alpha = q . k, s = scale.
//
// Backward, with lam_t = dL/dS_t from the tokens after t (lam_n = dL/d(final state)),
// mu_t = lam_t + scale q_t gy_t^T the whole gradient of S_t and gv_t = gy_t . v_t:
//   dq_t[i] = scale (g_t[i] sum_j S_{t-1}[i, j] gy_t[j] + k_t[i] gv_t)      (= scale S_t gy_t)
//   dk_t[i] = sum_j mu_t[i, j] v_t[j]      dv_t[j] = sum_i mu_t[i, j] k_t[i]
//   dg_t[i] = sum_j mu_t[i, j] S_{t-1}[i, j]
//   lam_{t-1}[i, j] = g_t[i] mu_t[i, j];   d(state) = lam_0
// The backward is the one of rwkv.h (decay_backward) shared with wkv6.
#include "rwkv.h"

namespace recurra {
namespace rwkv {
namespace {

void gla_forward(KernelCtx& c, const Dims& d) {
  // Sources: k, v, q, g, state; fp = [scale].
  const DecayIn in{c.src[2].f32(), c.src[0].f32(), c.src[1].f32(), c.src[3].f32(), nullptr,
                   static_cast<float>(c.node.fp[RECURRA_P_SCALE])};
  decay_forward(c, d, in, c.src[4].f32());
}

void gla_backward(KernelCtx& c, const Dims& d) {
  // Sources: k, v, q, g, state; fp = [scale]. Packed result, in source order: dk, dv, dq, dg,
  // dstate.
  const int64_t ths = d.ths();
  const DecayBackIn in{c.src[0].f32(), c.src[1].f32(), c.src[2].f32(), c.src[3].f32(), nullptr,
                       static_cast<float>(c.node.fp[RECURRA_P_SCALE]), c.src[4].f32(), c.src[5].f32()};
  float* o = c.dst.f32();
  const DecayGrad out{o, o + ths, o + 2 * ths, o + 3 * ths, nullptr, o + 4 * ths};
  decay_backward(c, d, in, out);
}

}  // namespace
}  // namespace rwkv

void register_gla_ops(OpTable& t) {
  rwkv::RecurrentOp op;
  op.name = "gated_linear_attn";
  op.signature = "(k, v, q, g, state)";
  op.n_src = 5;
  op.tok = {0, 1, 2, 3};
  op.hs = -1;
  op.st = 4;
  op.n_fp = 1;
  op.forward = rwkv::gla_forward;
  op.backward = rwkv::gla_backward;
  rwkv::register_recurrent(t, op);
}

}  // namespace recurra

// Shared by the RWKV-family recurrences (wkv.comp, wkv_back.comp, wkv_reduce.comp):
// rwkv_wkv6 (OP 0), rwkv_wkv7 (OP 1), gated_linear_attn (OP 2), chosen by -DOP at build time.
//
// Notation (see csrc/ops/rwkv.cpp): per (run q, head h) the state is X[kappa, nu] with kappa
// the contracted ("key") axis, the one the per-token vectors r, k, w, a, b index, and nu the
// independent ("value") axis: columns nu never mix. wkv6/GLA store state[h, i = kappa, j = nu];
// wkv7 stores state[h, i = nu, j = kappa] (transposed).
//
// Thread tile: a workgroup owns CW = CWT * CJ columns nu of one (run, head); its WG threads
// are CWT column groups of P lanes (one cluster per column group, P a power of two <= the
// subgroup size); lane p of a cluster holds rows kappa = m * P + p (m < R) of its CJ columns
// in registers. Sums over kappa are lane sums plus a butterfly of subgroup shuffles inside the
// cluster (every lane ends with the same, order-fixed value). Lanes are numbered by subgroup
// (gl_SubgroupID, gl_SubgroupInvocationID) so clusters never straddle subgroups.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint P = 1;    // lanes per column group (cluster)
layout(constant_id = 2) const uint R = 1;    // rows kappa per lane
layout(constant_id = 3) const uint CJ = 1;   // columns nu per lane
layout(constant_id = 4) const uint C = 1;    // tokens staged in shared memory per chunk
layout(constant_id = 5) const uint WG = 64;  // the workgroup size (== local_size_x)
layout(constant_id = 6) const uint SG = 32;  // the subgroup size (the device's, from the host)
const uint SP = P * R;                       // rows kappa padded
const uint CWT = WG / P;                     // column groups per workgroup
const uint CW = CWT * CJ;                    // columns nu per workgroup
const uint NSG = WG / SG;                    // subgroups per workgroup
const uint RC = R * CJ;                      // state elements per lane

#if OP == 0
// rwkv_wkv6: sources k, v, r, tf, td, state. Staged vectors: r, k, w = td. Bonus u = tf.
#define NSRC 6
#define NK 3
#define NX 3  // backward partials over nu: dr, dk, dtd
#define SRC_V 1
#define SRC_U 3
#define SRC_ST 5
#define DV_OFF 1u
#define DS_OFF(ths, hs) (4u * (ths) + (hs))
uint x_off(uint xi, uint ths, uint hs) { return xi == 0u ? 2u * ths : (xi == 1u ? 0u : 3u * ths + hs); }
uint vec_src(uint vi) { return vi == 0u ? 2u : (vi == 1u ? 0u : 4u); }
#elif OP == 1
// rwkv_wkv7: sources r, w, k, v, a, b, state. Staged vectors: r, k, w, a, b.
#define NSRC 7
#define NK 5
#define NX 5  // dr, dw, dk, da, db
#define SRC_V 3
#define SRC_ST 6
#define DV_OFF 3u
#define DS_OFF(ths, hs) (6u * (ths))
uint x_off(uint xi, uint ths, uint hs) { return (xi < 3u ? xi : xi + 1u) * ths; }
uint vec_src(uint vi) { return vi == 0u ? 0u : (vi == 1u ? 2u : (vi == 2u ? 1u : vi + 1u)); }
#else
// gated_linear_attn: sources k, v, q, g, state. Staged vectors: q (as r), k, g (as w).
#define NSRC 5
#define NK 3
#define NX 3  // dq, dk, dg
#define SRC_V 1
#define SRC_ST 4
#define DV_OFF 1u
#define DS_OFF(ths, hs) (4u * (ths))
uint x_off(uint xi, uint ths, uint hs) { return xi == 0u ? 2u * ths : (xi == 1u ? 0u : 3u * ths); }
uint vec_src(uint vi) { return vi == 0u ? 2u : (vi == 1u ? 0u : 3u); }
#endif
// DV_OFF * T*H*S: where dv starts in the packed gradient; DS_OFF: where d(state) starts;
// x_off(xi): where backward row quantity xi (the order of NX above) starts.
// Staged vector slots.
#define VR 0u
#define VK 1u
#define VW 2u
#define VA 3u
#define VB 4u

layout(push_constant) uniform PC {
  uvec2 src[8];  // the sources in order; backward: src[NSRC] is the packed output gradient
  uvec2 dst;     // the packed result
  uvec2 part;    // backward: per column block partial sums over nu, [NB][NX][T*H*S]
  uvec2 ckpt;    // backward: checkpoints [workgroup][nck][RC][WG]; reduce (wkv6): d tf terms
  uvec2 seg;     // backward: the states of one segment [workgroup][K][RC + CJ][WG]
  uint T, H, S, n;  // tokens in all, heads, head size, tokens per run
  uint NB, K, nck;  // column blocks per head, checkpoint interval, checkpoints per run
  float scale;      // GLA's scale (1 otherwise)
} pc;

// The lane's index in the workgroup, numbered by subgroup.
uint lane_id() { return gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID; }

// Sum over the P lanes of a cluster; every lane gets the same value.
float cluster_sum(float v) {
  [[unroll]] for (uint o = 1u; o < P; o <<= 1) v += subgroupShuffleXor(v, o);
  return v;
}

// The address of float a * b after base (64-bit math: the scratch arrays may pass 2^32 bytes).
uvec2 addr_at(uvec2 base, uint a, uint b) {
  uint hi, lo;
  umulExtended(a, b, hi, lo);
  hi = (hi << 2) | (lo >> 30);
  lo <<= 2;
  uint carry;
  lo = uaddCarry(base.x, lo, carry);
  return uvec2(lo, base.y + hi + carry);
}

// Offset of X[kappa, nu] in a head's S * S state.
uint st_off(uint kappa, uint nu) { return OP == 1 ? nu * pc.S + kappa : kappa * pc.S + nu; }

// Offset of token t of run q, head h in a (T, H, S) array.
uint tok_base(uint q, uint t, uint h) { return ((q * pc.n + t) * pc.H + h) * pc.S; }

// Staging: elements each thread loads before it stores any to shared memory.
const uint STG = 8;

// Element i of the staged per-token vectors of tokens [t0, t0 + nc) of run q, head h:
// shk[i] = [vector][token][kappa] (zero past nc, past S and past the array).
float stage_vec(uint q, uint h, uint t0, uint nc, uint i) {
  if (i >= NK * C * SP) return 0.0;
  const uint vi = i / (C * SP), rem = i - vi * (C * SP), tt = rem / SP, kk = rem - tt * SP;
  return (tt < nc && kk < pc.S) ? FBuf(pc.src[vec_src(vi)]).v[tok_base(q, t0 + tt, h) + kk] : 0.0;
}

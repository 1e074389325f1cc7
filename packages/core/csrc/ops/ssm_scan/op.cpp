// ssm_scan: the op definitions (shapes, checks, checkpoint sizes, the gradient) and the
// backward driver, which hands each layout its tasks and reduces their partial sums in a
// fixed order (see scan.h).
#include "scan.h"

namespace recurra {

using namespace ssm;
using namespace ssm::scan;

namespace {

// ---- backward driver ----------------------------------------------------------------

// Tasks are (sequence, group, split); each split covers a fixed range of heads (rows
// layout) or 16-head blocks (heads layout) and owns a slot of partial dB, dC. The split
// count depends on the shapes only, never on the thread count.
int64_t n_splits(const Dims& d, int64_t units_per_group) {
  const int64_t want = (8 + d.S * d.G - 1) / std::max<int64_t>(1, d.S * d.G);
  return std::max<int64_t>(1, std::min(want, units_per_group));
}

void scan_backward(KernelCtx& c) {
  Back b;
  const Dims d = b.d = dims_of(c.src, 1);
  b.gy = c.src[0].f32();
  b.s = c.src[1].f32();
  b.x = c.src[2].f32();
  b.dt = c.src[3].f32();
  b.A = c.src[4].f32();
  b.B = c.src[5].f32();
  b.C = c.src[6].f32();
  const int32_t* ids = b.ids = c.src[7].i32();
  check_ids(ids, d, "ssm_scan_back");
  const float* gs = b.gs = b.gy + d.S * d.T * d.H * d.P;  // dL/d(final states)
  const bool heads = d.P == 1;
  // checkpoints saved by the forward (a 9th source: its packed result), if any
  b.ckf = heads && c.src.size() > 8 ? c.src[8].f32() + d.S * d.T * d.H + d.S * d.H * d.N : nullptr;
  float* o_ds = b.o_ds = c.dst.f32();
  b.o_dx = o_ds + d.R * d.H * d.P * d.N;
  b.o_ddt = b.o_dx + d.S * d.T * d.H * d.P;
  float* o_dA = b.o_ddt + d.S * d.T * d.H;
  float* o_dB = b.o_dB = o_dA + d.H * d.NA;
  float* o_dC = b.o_dC = o_dB + d.S * d.T * d.G * d.N;
  const int64_t nB = b.nB = d.S * d.T * d.G * d.N, nstate = b.nstate = d.H * d.P * d.N;

  // d_s goes straight to row ids[i] when every row is used once; otherwise to a
  // per-sequence buffer summed into the rows in sequence order below.
  std::vector<char> used(d.R, 0);
  bool shared = false;
  for (int64_t i = 0; i < d.S; ++i) {
    shared |= used[ids[i]] != 0;
    used[ids[i]] = 1;
  }
  std::vector<float> ds_seq(shared ? d.S * nstate : 0);
  b.ds_seq = shared ? ds_seq.data() : nullptr;

  const int64_t nbg = (d.hpg + 15) / 16;
  b.units = heads ? nbg : d.hpg;  // per group
  const int64_t nsplit = b.nsplit = n_splits(d, b.units);
  std::vector<float> slots(static_cast<size_t>((nsplit - 1) * 2 * nB));
  b.slots = slots.data();
  std::vector<float> dA_part(static_cast<size_t>(d.S * d.H * d.NA));
  b.dA_part = dA_part.data();
  std::vector<Work> work(c.pool.size());

  if (d.T == 0) {  // no tokens: dB, dC are empty, d_s = dL/d(final state)
    for (int64_t i = 0; i < d.S; ++i) std::memcpy(b.ds_of(i), gs + i * nstate, nstate * sizeof(float));
  } else if (heads) {
    backward_heads(b, c.pool, work);
  } else {
    backward_rows(b, c.pool, work);
  }

  // Fixed-order reductions of the partial sums.
  if (nsplit > 1 && nB > 0) {
    c.pool.parallel_for(nB, kGrainElems, [&](int64_t k0, int64_t e, int) {
      for (int64_t j = 1; j < nsplit; ++j) {
        const float* pb = b.slot_B(j);
        const float* pc = b.slot_C(j);
        for (int64_t k = k0; k < e; ++k) {
          o_dB[k] += pb[k];
          o_dC[k] += pc[k];
        }
      }
    });
  }
  for (int64_t k = 0; k < d.H * d.NA; ++k) {
    float acc = 0.0f;
    for (int64_t i = 0; i < d.S; ++i) acc += dA_part[i * d.H * d.NA + k];
    o_dA[k] = acc;
  }
  if (shared) {
    std::memset(o_ds, 0, static_cast<size_t>(d.R * nstate) * sizeof(float));
    c.pool.parallel_for(nstate, kGrainElems, [&](int64_t k0, int64_t e, int) {
      for (int64_t i = 0; i < d.S; ++i) {
        float* dst = o_ds + ids[i] * nstate;
        const float* src = ds_seq.data() + i * nstate;
        for (int64_t k = k0; k < e; ++k) dst[k] += src[k];
      }
    });
  } else {
    for (int64_t r = 0; r < d.R; ++r)
      if (!used[r]) std::memset(o_ds + r * nstate, 0, static_cast<size_t>(nstate) * sizeof(float));
  }
}

// ---- op definitions -----------------------------------------------------------------

// Validates (s, x, dt, A, B, C, ids) starting at source `off`; returns the dims.
int64_t scan_packed(const Dims& d) { return d.S * d.T * d.H * d.P + d.S * d.H * d.P * d.N; }

// Floats of the checkpoints a forward saves when asked (RECURRA_SSM_SCAN_SAVE_CHECKPOINTS):
// head_dim 1 (heads layout), or one decay per head (rows layout; see kCkChunk).
int64_t ck_floats(const Dims& d) {
  if (d.P == 1) return d.S * heads_n_seg(d.T) * d.H * d.N;
  return d.S * d.H * ((d.T + kCkChunk - 1) / kCkChunk) * d.P * d.N;
}

Dims scan_check(Graph& g, Node& n, int off) {
  for (int i = off; i < off + 6; ++i) require_f32(g, n, i);
  const Node& idn = g.node(n.src[off + 6]);
  if (idn.dtype != DType::i32)
    throw TypeError(OpTable::get().at(n.op).name + ": ids must be int32, got " + dtype_name(idn.dtype));
  const Shape &s = g.node(n.src[off]).shape, &x = g.node(n.src[off + 1]).shape,
              &dt = g.node(n.src[off + 2]).shape, &A = g.node(n.src[off + 3]).shape,
              &B = g.node(n.src[off + 4]).shape, &C = g.node(n.src[off + 5]).shape, &ids = idn.shape;
  if (s.ndim != 4) fail_shape(g, n, "s must be (n_rows, n_head, head_dim, d_state)");
  if (x.ndim != 4) fail_shape(g, n, "x must be (n_seqs, n_tok, n_head, head_dim)");
  if (dt.ndim != 3) fail_shape(g, n, "dt must be (n_seqs, n_tok, n_head)");
  if (A.ndim != 2) fail_shape(g, n, "A must be (n_head, d_state) or (n_head, 1)");
  if (B.ndim != 4) fail_shape(g, n, "B must be (n_seqs, n_tok, n_group, d_state)");
  if (C != B) fail_shape(g, n, "B and C must have the same shape");
  if (ids.ndim != 1) fail_shape(g, n, "ids must be (n_seqs,)");
  const int64_t S = x[0], T = x[1], H = x[2], P = x[3], N = s[3], G = B[2];
  if (H < 1 || P < 1 || N < 1 || G < 1) fail_shape(g, n, "n_head, head_dim, d_state and n_group must be >= 1");
  if (s[1] != H || s[2] != P) fail_shape(g, n, "s must be (n_rows, n_head, head_dim, d_state) matching x");
  if (s[0] < S) fail_shape(g, n, "s needs at least n_seqs state rows");
  if (dt[0] != S || dt[1] != T || dt[2] != H) fail_shape(g, n, "dt must be (n_seqs, n_tok, n_head) matching x");
  if (A[0] != H || (A[1] != N && A[1] != 1)) fail_shape(g, n, "A must be (n_head, d_state) or (n_head, 1)");
  if (B[0] != S || B[1] != T || B[3] != N) fail_shape(g, n, "B and C must be (n_seqs, n_tok, n_group, d_state)");
  if (H % G != 0) fail_shape(g, n, "n_head must be a multiple of n_group");
  if (ids[0] != S) fail_shape(g, n, "ids must have n_seqs entries");
  Dims d;
  d.R = s[0];
  d.S = S;
  d.T = T;
  d.H = H;
  d.P = P;
  d.N = N;
  d.G = G;
  d.NA = A[1];
  d.hpg = H / G;
  d.per_n = d.NA != 1;
  return d;
}

}  // namespace

void register_ssm_ops(OpTable& t) {
  register_ssm_conv_ops(t);
  {
    OpDef d;
    d.name = "ssm_scan";
    d.contiguous_srcs = 0x7f;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 7) fail_shape(g, n, "takes (s, x, dt, A, B, C, ids)");
      const Dims dm = scan_check(g, n, 0);
      constexpr int64_t kFlags = RECURRA_SSM_SCAN_SAVE_CHECKPOINTS | RECURRA_SSM_SCAN_CHECKPOINTS_AUTO |
                                 RECURRA_SSM_SCAN_STATE_IN_PLACE;
      if (n.ip.size() > 1 || (n.ip.size() == 1 && (n.ip[RECURRA_P_SCAN_FLAGS] & ~kFlags) != 0))
        throw ValueError("ssm_scan: the only parameter is a set of RECURRA_SSM_SCAN_* flags");
      const bool ck = saves_checkpoints(n.ip);
      if (ck && dm.P != 1 && dm.per_n)
        throw ValueError("ssm_scan: checkpoints are saved for head_dim 1 or one decay per head only");
      n.dtype = DType::f32;
      if (state_in_place(n.ip)) {
        if (n.ip[RECURRA_P_SCAN_FLAGS] != RECURRA_SSM_SCAN_STATE_IN_PLACE || dm.T != 1)
          fail_shape(g, n, "writes the state in place for one token without checkpoints only");
        if (!g.node(n.src[0]).is_leaf()) fail_shape(g, n, "writes the state in place into a leaf only");
        n.shape = Shape{dm.S * dm.H * dm.P};  // y alone
        return;
      }
      n.shape = Shape{scan_packed(dm) + (ck ? ck_floats(dm) : 0)};
    };
    d.writes_src = [](const Node& n, size_t i) { return i == 0 && state_in_place(n.ip); };
    d.forward = scan_forward;
    // CHECKPOINTS_AUTO is resolved before placement (decompose.cpp); of the checkpoint
    // layouts, the CPU backward reads those of head_dim 1 only (see kCkChunk).
    d.cpu_supports = [](const Graph& g, const Node& n) {
      if (n.ip.size() == 1 && (n.ip[RECURRA_P_SCAN_FLAGS] & RECURRA_SSM_SCAN_CHECKPOINTS_AUTO)) return false;
      return !saves_checkpoints(n.ip) || g.node(n.src[1]).shape[3] == 1;
    };
    d.backward = [](GradSink& k) {
      bool any = false;
      for (int i = 0; i < 6; ++i) any |= k.needs(i);
      if (!any) return;
      if (state_in_place(k.node.ip))
        throw ValueError("ssm_scan: a scan that writes its state in place has no gradient");
      std::vector<int> src{k.grad_out};
      src.insert(src.end(), k.node.src.begin(), k.node.src.end());
      if (saves_checkpoints(k.node.ip)) src.push_back(k.node.id);  // its checkpoints
      const int back = k.g.op("ssm_scan_back", src);
      int64_t off = 0;
      for (int i = 0; i < 6; ++i) {
        const Shape sh = k.g.node(k.node.src[i]).shape;
        if (k.needs(i)) k.add(i, k.g.unpack(back, off, sh));
        off += sh.numel();
      }
    };
    t.add(std::move(d));
  }
  {
    // The gradients of ssm_scan, packed: ds, dx, ddt, dA, dB, dC (shapes of s..C).
    OpDef d;
    d.name = "ssm_scan_back";
    d.contiguous_srcs = 0x1ff;
    d.infer = [](Graph& g, Node& n) {
      if (n.src.size() != 8 && n.src.size() != 9)
        fail_shape(g, n, "takes (grad, s, x, dt, A, B, C, ids[, the forward's result with checkpoints])");
      require_f32(g, n, 0);
      const Dims dm = scan_check(g, n, 1);
      const int64_t ck = n.src.size() == 9 ? ck_floats(dm) : 0;
      if (n.src.size() == 9) {
        require_f32(g, n, 8);
        const Shape& fw = g.node(n.src[8]).shape;
        if ((dm.P != 1 && dm.per_n) || fw.ndim != 1 || fw[0] != scan_packed(dm) + ck)
          fail_shape(g, n, "the 9th source must be the forward's packed result with checkpoints");
      }
      const Shape& gr = g.node(n.src[0]).shape;
      if (gr.ndim != 1 || (gr[0] != scan_packed(dm) && gr[0] != scan_packed(dm) + ck))
        fail_shape(g, n, "grad must be the packed (y, final states) gradient");
      int64_t total = 0;
      for (int i = 1; i < 7; ++i) total += g.node(n.src[i]).numel();
      n.dtype = DType::f32;
      n.shape = Shape{total};
    };
    d.forward = scan_backward;
    t.add(std::move(d));
  }
}

}  // namespace recurra

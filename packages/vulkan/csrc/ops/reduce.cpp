// Reductions: sum and max along one axis (keepdims), sum_to (broadcasting in reverse) and
// max_grad. Shaders: reduce.comp (both reductions, one or two passes), max_grad.comp.
// bfloat16/float16 tensors take their "_h" variants: float32 loads, sums and comparisons,
// one rounding on store (a two-pass reduction's partials stay float32).
//
//   sum / max:  x (..., L, ...) any strides, ip [axis] -> (..., 1, ...)
//   sum_to:     x any strides, ip [target shape] -> target (numpy broadcasting undone)
//   max_grad:   (g, x, m) dense, ip [axis] -> x's shape
#include <algorithm>
#include <cstring>

#include "half_ops.h"
#include "ops.h"

namespace recurra_vk {

namespace {

struct ReducePC {
  uint64_t x, out;
  uint32_t K, S, chunk, nchunks;
  float scale;
  int32_t kshape[4], kst[4], sshape[4], sst[4];
};

// Collapses one operand's axes into reduce.comp's 4 slots; returns the slot count used.
int pack_axes(int n, const int64_t* shape, const int64_t* st, int32_t* out_shape, int32_t* out_st) {
  int64_t stv[1][4];
  for (int i = 0; i < n; ++i) stv[0][i] = st[i];
  const Collapsed c = collapse(1, n, shape, stv);
  std::memcpy(out_shape, c.shape, 4 * sizeof(int32_t));
  std::memcpy(out_st, c.strides[0], 4 * sizeof(int32_t));
  return c.nd;
}

}  // namespace

void record_reduce(Recorder& rec, const ReduceSpec& r, uint64_t x, const Range& x_range, uint64_t out,
                   const Range& out_range) {
  int64_t K = 1, S = 1;
  for (int i = 0; i < r.kn; ++i) K *= r.kshape[i];
  for (int i = 0; i < r.sn; ++i) S *= r.sshape[i];
  if (K == 0) return;
  ReducePC pc{};
  pc.x = x;
  pc.K = static_cast<uint32_t>(K);
  pc.S = static_cast<uint32_t>(S);
  pc.scale = r.scale;
  const int knd = pack_axes(r.kn, r.kshape, r.kst, pc.kshape, pc.kst);
  const int snd = pack_axes(r.sn, r.sshape, r.sst, pc.sshape, pc.sst);
  const int32_t simple_k = knd <= 1, simple_s = snd <= 1;
  // Rows when the summed walk is the dense one (or the longer one), columns otherwise.
  const int32_t k_inner = knd ? std::abs(pc.kst[3]) : 0, s_inner = snd ? std::abs(pc.sst[3]) : 0;
  int mode;
  if (S == 0 || s_inner == 1) mode = 0;
  else if (k_inner == 1) mode = 1;
  else mode = S >= K ? 0 : 1;
  // Enough workgroups to fill a large GPU; long reductions split into chunks.
  constexpr int64_t kWantGroups = 2048;
  int64_t nchunks = 1;
  if (mode == 0) {
    if (K < kWantGroups) nchunks = std::min((kWantGroups + K - 1) / K, (S + 1023) / 1024);
  } else {
    const int64_t gx = (K + 255) / 256;
    if (gx < kWantGroups) nchunks = std::min((kWantGroups + gx - 1) / gx, (S + 63) / 64);
  }
  nchunks = std::max<int64_t>(1, std::min<int64_t>(nchunks, 65535));
  const int64_t chunk = S == 0 ? 1 : (S + nchunks - 1) / nchunks;
  nchunks = S == 0 ? 1 : (S + chunk - 1) / chunk;
  pc.chunk = static_cast<uint32_t>(chunk);
  pc.nchunks = static_cast<uint32_t>(nchunks);

  // xdt, odt: the dtypes of the pass's input and output (2-byte ones: reduce_h).
  auto launch = [&](const ReducePC& p, int m, int32_t sk, int32_t ss, const Range& in, const Range& o,
                    recurra_dtype xdt, recurra_dtype odt) {
    const bool half = is_half(xdt) || is_half(odt);
    std::vector<int32_t> spec{r.op, m, sk, ss};
    if (half) spec.insert(spec.end(), {dt_code(xdt), dt_code(odt)});
    if (m == 0) {
      uint32_t gx, gy;
      grid_2d(static_cast<int64_t>(p.K) * p.nchunks, gx, gy);
      rec.dispatch(variant("reduce", half), spec, p, gx, gy, 1, {in}, {o});
    } else {
      rec.dispatch(variant("reduce", half), spec, p, grid_groups(p.K, 256), p.nchunks, 1, {in}, {o});
    }
  };
  if (nchunks == 1) {
    pc.out = out;
    launch(pc, mode, simple_k, simple_s, x_range, out_range, r.xdt, r.odt);
    return;
  }
  const Recorder::Scratch part = rec.scratch(static_cast<size_t>(K * nchunks) * 4);
  pc.out = part.addr;
  launch(pc, mode, simple_k, simple_s, x_range, part.range, r.xdt, RECURRA_F32);
  // Second pass over the partials: [K][nchunks] (rows) or [nchunks][K] (cols).
  ReducePC p2{};
  p2.x = part.addr;
  p2.out = out;
  p2.K = static_cast<uint32_t>(K);
  p2.S = static_cast<uint32_t>(nchunks);
  p2.chunk = static_cast<uint32_t>(nchunks);
  p2.nchunks = 1;
  p2.scale = r.scale;
  for (int j = 0; j < 4; ++j) p2.kshape[j] = 1, p2.sshape[j] = 1;
  p2.kshape[3] = static_cast<int32_t>(K);
  p2.sshape[3] = static_cast<int32_t>(nchunks);
  p2.kst[3] = mode == 0 ? static_cast<int32_t>(nchunks) : 1;
  p2.sst[3] = mode == 0 ? 1 : static_cast<int32_t>(K);
  launch(p2, mode, 1, 1, part.range, out_range, RECURRA_F32, r.odt);
}

namespace {

// ---- sum / max ------------------------------------------------------------------------

std::string axis_reduce_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 1);
  if (why.empty()) why = require_float(n, 1);
  if (!why.empty()) return why;
  const recurra_tensor_desc &x = n.src[0], &d = n.dst;
  if (n.n_ip != 1 || n.ip[RECURRA_P_AXIS] < 0 || n.ip[RECURRA_P_AXIS] >= x.ndim) return "takes one axis in range";
  if (d.ndim != x.ndim) return "the output keeps the reduced axis";
  for (int i = 0; i < x.ndim; ++i)
    if (d.shape[i] != (i == n.ip[RECURRA_P_AXIS] ? 1 : x.shape[i])) return "the output must be x's shape with the axis set to 1";
  if (std::strcmp(n.op, "max") == 0 && x.shape[n.ip[RECURRA_P_AXIS]] == 0) return "max of an empty axis";
  return "";
}

template <int OP>
void axis_reduce_record(NodeCall& c) {
  const recurra_tensor_desc& x = *c.src[0].d;
  const int ax = static_cast<int>(c.node.ip[RECURRA_P_AXIS]);
  ReduceSpec r;
  r.op = OP;
  r.xdt = x.dtype;
  r.odt = c.dst.d->dtype;
  for (int i = 0; i < x.ndim; ++i) {
    if (i == ax) continue;
    r.kshape[r.kn] = x.shape[i];
    r.kst[r.kn++] = x.strides[i];
  }
  r.sshape[0] = x.shape[ax];
  r.sst[0] = x.strides[ax];
  r.sn = 1;
  record_reduce(c.rec, r, addr(c.src[0]), c.src[0].range, addr(c.dst), c.dst.range);
}

// ---- sum_to ---------------------------------------------------------------------------

std::string sum_to_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 1);
  if (why.empty()) why = require_float(n, 1);
  if (!why.empty()) return why;
  const recurra_tensor_desc &x = n.src[0], &d = n.dst;
  if (n.n_ip != d.ndim || d.ndim > x.ndim) return "sum_to takes the target shape";
  for (int i = 0; i < d.ndim; ++i) {
    const int j = x.ndim - d.ndim + i;
    if (n.ip[i] != d.shape[i] || (d.shape[i] != x.shape[j] && d.shape[i] != 1)) return "cannot sum down to this shape";
  }
  return "";
}

void sum_to_record(NodeCall& c) {
  const recurra_tensor_desc &x = *c.src[0].d, &d = *c.dst.d;
  ReduceSpec r;
  r.xdt = x.dtype;
  r.odt = d.dtype;
  for (int i = 0; i < x.ndim; ++i) {
    const int j = d.ndim - x.ndim + i;
    const bool summed = j < 0 || (d.shape[j] == 1 && x.shape[i] != 1);
    if (summed) {
      r.sshape[r.sn] = x.shape[i];
      r.sst[r.sn++] = x.strides[i];
    } else {
      r.kshape[r.kn] = x.shape[i];
      r.kst[r.kn++] = x.strides[i];
    }
  }
  record_reduce(c.rec, r, addr(c.src[0]), c.src[0].range, addr(c.dst), c.dst.range);
}

// ---- max_grad -------------------------------------------------------------------------

struct MaxGradPC {
  uint64_t g, x, m, d, first;
  uint32_t O, L, I;
};

std::string max_grad_check(const recurra_node_desc& n) {
  std::string why = require_srcs(n, 3);
  if (why.empty()) why = require_float(n, 3);
  if (!why.empty()) return why;
  const recurra_tensor_desc& x = n.src[1];
  if (n.n_ip != 1 || n.ip[RECURRA_P_AXIS] < 0 || n.ip[RECURRA_P_AXIS] >= x.ndim) return "max_grad takes an axis";
  for (int i = 0; i < 3; ++i)
    if (!is_dense(n.src[i])) return "max_grad needs dense sources";
  if (numel(n.dst) != numel(x) || numel(n.src[0]) * std::max<int64_t>(1, x.shape[n.ip[RECURRA_P_AXIS]]) != numel(x) ||
      numel(n.src[2]) != numel(n.src[0]))
    return "max_grad: shapes do not fit";
  return "";
}

void max_grad_record(NodeCall& c) {
  const recurra_tensor_desc& x = *c.src[1].d;
  const int ax = static_cast<int>(c.node.ip[RECURRA_P_AXIS]);
  int64_t O = 1, I = 1;
  for (int i = 0; i < ax; ++i) O *= x.shape[i];
  for (int i = ax + 1; i < x.ndim; ++i) I *= x.shape[i];
  const int64_t L = x.shape[ax];
  if (O * I * L == 0) return;
  // The first matching position of each (o, i), found by all elements at once (see
  // max_grad.comp: no thread walks the axis).
  const Recorder::Scratch first = c.rec.scratch(static_cast<size_t>(O * I) * 4);
  const MaxGradPC pc{addr(c.src[0]), addr(c.src[1]), addr(c.src[2]), addr(c.dst), first.addr,
                     static_cast<uint32_t>(O), static_cast<uint32_t>(L), static_cast<uint32_t>(I)};
  // 2-byte tensors: max_grad_h, the dtypes of g, x, m and dx its specialization constants 1-4.
  const bool half = has_half(c.node, 3);
  const std::string module = variant("max_grad", half);
  auto spec = [&](int32_t pass) {
    std::vector<int32_t> s{pass};
    if (half)
      s.insert(s.end(), {dt_code(c.src[0].d->dtype), dt_code(x.dtype), dt_code(c.src[2].d->dtype), dt_code(c.dst.d->dtype)});
    return s;
  };
  c.rec.dispatch(module, spec(0), pc, grid_groups(O * I, 256), 1, 1, {}, {first.range});
  c.rec.dispatch(module, spec(1), pc, grid_groups(O * L * I, 256), 1, 1, {c.src[1].range, c.src[2].range},
                 {first.range});
  c.rec.dispatch(module, spec(2), pc, grid_groups(O * L * I, 256), 1, 1, {c.src[0].range, first.range},
                 {c.dst.range});
}

}  // namespace

void register_reduce_ops() {
  add_op("sum", {axis_reduce_check, axis_reduce_record<0>});
  add_op("max", {axis_reduce_check, axis_reduce_record<1>});
  add_op("sum_to", {sum_to_check, sum_to_record});
  add_op("max_grad", {max_grad_check, max_grad_record});
}

}  // namespace recurra_vk

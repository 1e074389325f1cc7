// Optimizer update ops. Unlike every other op, these UPDATE THEIR SOURCES IN PLACE (the
// parameter, its moments, its step count, or the gradient for grad_clip) and return a
// 1-element dummy. They must therefore be built on leaves bound to the memory to update
// (infer refuses anything else) and they have no backward. One node updates many tensors:
// the work of all of them is cut into equal ranges of one flat index space, so a step over
// a hundred small tensors costs one parallel region, not a hundred.
//
// Sources (n = ip[RECURRA_P_N_TENSORS] tensors, has_gstat = ip[RECURRA_P_HAS_GSTAT]):
//   hyper  (2*kSlots,) f32   the scalars, each slot a float pair (hi, lo) holding the
//                            double hi + lo (so lr and betas keep ~48 bits, GPU-friendly)
//   gstat  (2,) f32          optional: [global gradient norm, clip coefficient] (grad_norm)
//   then per tensor, all of one shape S (p, m, v, buf: leaves; g: any dense node):
//     sgd_step       p, g, [buf if ip[RECURRA_P_HAS_BUF]], step
//     adam_step      p, g, m, v, step        (L2 weight decay added to the gradient)
//     adamw_step     p, g, m, v, step        (decoupled weight decay)
//     lion_step      p, g, m, step
//   step: (1,) i32 leaf, the number of updates this tensor has had; the op increments it.
// grad_norm(hyper, g...) -> (2,) [norm, coef]: the L2 norm over all gradients of the
//   effective gradient clamp(g * grad_scale, +-clip_value), and min(1, max_norm/(norm+1e-6)).
//   With ip = {1} its sources after hyper are earlier grad_norm results, whose norms it
//   combines (sqrt of the sum of squares) into the same [norm, coef].
// grad_clip(hyper, [gstat], g...) -> dummy: g = clamp(g * grad_scale, +-clip_value) * coef,
//   in place (the gradients must be leaves).
//
// The effective gradient every update uses: ge = clamp(g * grad_scale, +-clip) * coef * sign,
// sign = -1 when maximizing. grad_scale carries 1/k of gradient accumulation.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "../graph.h"
#include "kernel_util.h"

namespace recurra {

namespace {

// Hyper-parameter slots shared by every update op (the Python side packs them; the
// slots are RECURRA_HYPER_* of recurra/op_spec.h).
enum Slot : int {
  kLr = RECURRA_HYPER_LR,
  kGradScale = RECURRA_HYPER_GRAD_SCALE,
  kClipValue = RECURRA_HYPER_CLIP_VALUE,
  kMaxNorm = RECURRA_HYPER_MAX_NORM,
  kWeightDecay = RECURRA_HYPER_WEIGHT_DECAY,
  kA = RECURRA_HYPER_A,
  kB = RECURRA_HYPER_B,
  kC = RECURRA_HYPER_C,
  kMaximize = RECURRA_HYPER_MAXIMIZE,
  kSlots = RECURRA_HYPER_SLOTS,
};

constexpr int64_t kOptimChunk = 1 << 16;  // elements per task: large enough to stream, small to balance

double hyper(const TensorView& h, int slot) {
  const float* p = h.f32();
  return static_cast<double>(p[2 * slot]) + static_cast<double>(p[2 * slot + 1]);
}


[[noreturn]] void fail(const Node& n, const std::string& msg) {
  throw ValueError(op_name(n) + ": " + msg);
}

bool dense(const Node& n) {
  int64_t expect = 1;
  for (int i = n.shape.ndim - 1; i >= 0; --i) {
    if (n.shape.d[i] != 1 && n.strides[i] != expect) return false;
    expect *= n.shape.d[i];
  }
  return true;
}

// ---- source layout and validation -----------------------------------------------------

struct OptimLayout {
  int64_t n = 0;      // tensors
  bool gstat = false;  // a [norm, coef] source follows hyper
  int per = 0;        // sources per tensor
  int first = 0;      // index of the first tensor's first source
};

void check_hyper(const Graph& g, const Node& n) {
  if (n.src.empty()) fail(n, "takes a hyper-parameter tensor first");
  require_f32(g, n, 0);
  const Node& h = g.node(n.src.at(0));
  if (h.shape.ndim != 1 || h.shape.d[0] != 2 * kSlots || !dense(h))
    fail(n, "the hyper-parameter tensor must be dense of shape (" + std::to_string(2 * kSlots) +
                ",), got " + h.shape.str());
}

void check_gstat(const Graph& g, const Node& n, int i) {
  require_f32(g, n, i);
  const Node& s = g.node(n.src.at(i));
  if (s.shape.ndim != 1 || s.shape.d[0] != 2 || !dense(s))
    fail(n, "the gradient-statistics source must have shape (2,), got " + s.shape.str());
}

// Update ops write into these sources: only leaves (memory bound from outside) qualify.
void check_target(const Graph& g, const Node& n, int i, const char* what, int64_t t) {
  const Node& s = g.node(n.src.at(i));
  if (!s.is_leaf())
    fail(n, std::string(what) + " of tensor " + std::to_string(t) +
                " must be a leaf: update ops write into their sources in place");
}

void check_like(const Graph& g, const Node& n, int i, int p, const char* what, int64_t t) {
  require_f32(g, n, i);
  const Node& s = g.node(n.src.at(i));
  const Node& ref = g.node(n.src.at(p));
  if (s.shape != ref.shape)
    fail(n, std::string("shape mismatch: ") + what + " of tensor " + std::to_string(t) +
                " has shape " + s.shape.str() + ", the parameter " + ref.shape.str());
  if (!dense(s)) fail(n, std::string(what) + " of tensor " + std::to_string(t) + " must be dense");
}

void check_step(const Graph& g, const Node& n, int i, int64_t t) {
  const Node& s = g.node(n.src.at(i));
  if (s.dtype != DType::i32)
    throw TypeError(op_name(n) + ": the step count of tensor " + std::to_string(t) +
                    " must be int32, got " + dtype_name(s.dtype));
  if (s.numel() != 1)
    fail(n, "the step count of tensor " + std::to_string(t) + " must have one element, got shape " +
                s.shape.str());
  check_target(g, n, i, "the step count", t);
}

// Reads ip = {n, has_gstat, ...} and checks the source count; `per` sources per tensor.
OptimLayout layout(const Graph& g, const Node& n, size_t n_ip, int per) {
  if (n.ip.size() != n_ip)
    fail(n, "takes " + std::to_string(n_ip) + " integer parameters, got " + std::to_string(n.ip.size()));
  if (!n.fp.empty()) fail(n, "takes no float parameters (they live in the hyper-parameter tensor)");
  OptimLayout L;
  L.n = n.ip.at(RECURRA_P_N_TENSORS);
  L.gstat = n.ip.at(RECURRA_P_HAS_GSTAT) != 0;
  L.per = per;
  L.first = 1 + (L.gstat ? 1 : 0);
  if (L.n < 1) fail(n, "needs at least one tensor, got " + std::to_string(L.n));
  if (n.ip.at(RECURRA_P_HAS_GSTAT) != 0 && n.ip.at(RECURRA_P_HAS_GSTAT) != 1) fail(n, "has_gstat must be 0 or 1");
  const int64_t want = L.first + L.n * per;
  if (static_cast<int64_t>(n.src.size()) != want)
    fail(n, "expected " + std::to_string(want) + " sources for " + std::to_string(L.n) +
                " tensors, got " + std::to_string(n.src.size()));
  check_hyper(g, n);
  if (L.gstat) check_gstat(g, n, 1);
  return L;
}

// writes_src of the update ops: every per-tensor source but the gradient (at offset 1); with
// grad_at < 0 (grad_clip), every per-tensor source. ip = {n, has_gstat, ...} (checked by infer).
std::function<bool(const Node&, size_t)> writes_per_tensor(int per, int grad_at) {
  return [per, grad_at](const Node& n, size_t i) {
    const int64_t first = 1 + (n.ip.size() > 1 && n.ip[RECURRA_P_HAS_GSTAT] != 0 ? 1 : 0);
    const int64_t k = static_cast<int64_t>(i) - first;
    const int64_t per_n = per > 0 ? per : 3 + (n.ip.size() > 2 && n.ip[RECURRA_P_HAS_BUF] != 0 ? 1 : 0);
    return k >= 0 && k % per_n != grad_at;
  };
}

void set_dummy(Node& n) {
  n.dtype = DType::f32;
  n.shape = Shape{1};
}

// Sources of one tensor: `names` in order; "step" is the int32 count, "g" the gradient,
// "p" the parameter; anything else is a state buffer like p.
void check_tensor(const Graph& g, const Node& n, const OptimLayout& L, int64_t t,
                  std::initializer_list<const char*> names) {
  const int base = L.first + static_cast<int>(t) * L.per;
  int k = 0;
  for (const char* nm : names) {
    const int i = base + k++;
    const std::string s(nm);
    if (s == "step") {
      check_step(g, n, i, t);
    } else if (s == "param") {
      require_f32(g, n, i);
      check_target(g, n, i, "the parameter", t);
    } else {
      check_like(g, n, i, base, nm, t);
      if (s != "gradient") check_target(g, n, i, nm, t);
    }
  }
}

// Distinct writable buffers: an update must not read one array through two names.
void check_no_alias(const KernelCtx& c, const Node& n, int64_t t, std::initializer_list<int> idx) {
  for (auto a = idx.begin(); a != idx.end(); ++a)
    for (auto b = a + 1; b != idx.end(); ++b)
      if (c.src[*a].data == c.src[*b].data && c.src[*a].numel() > 0)
        fail(n, "tensor " + std::to_string(t) + ": two of its buffers are the same memory");
}

// ---- the flat index space over all tensors --------------------------------------------

// Runs fn(t, begin, end, chunk) over every tensor t's elements, in chunks of kOptimChunk of the
// concatenation (a chunk may span several small tensors). Chunks are fixed by the sizes
// alone, so per-chunk partial sums do not depend on the thread count or on timing.
template <class F>
void for_chunks(ThreadPool& pool, const std::vector<int64_t>& offs, F&& fn) {
  const int64_t total = offs.back();
  const int64_t n_chunks = (total + kOptimChunk - 1) / kOptimChunk;
  if (n_chunks == 0) return;
  pool.run(n_chunks, [&](int64_t c, int) {
    const int64_t b = c * kOptimChunk, e = std::min(total, b + kOptimChunk);
    int64_t t = std::upper_bound(offs.begin(), offs.end(), b) - offs.begin() - 1;
    for (int64_t pos = b; pos < e; ++t) {
      const int64_t tb = pos - offs[t], te = std::min(e, offs[t + 1]) - offs[t];
      if (te > tb) fn(t, tb, te, c);
      pos = offs[t] + te;
    }
  });
}

std::vector<int64_t> offsets(const KernelCtx& c, const OptimLayout& L) {
  std::vector<int64_t> offs(L.n + 1, 0);
  for (int64_t t = 0; t < L.n; ++t) offs[t + 1] = offs[t] + c.src[L.first + t * L.per].numel();
  return offs;
}

// The gradient transform every op starts with.
struct GradXform {
  float scale;  // grad_scale * clip coefficient * (maximize ? -1 : 1), applied after clamping
  float pre;    // grad_scale, applied before clamping
  float clip;   // +inf when off
};

GradXform grad_xform(const KernelCtx& c, const OptimLayout& L, bool use_maximize) {
  GradXform x;
  const double gs = hyper(c.src[0], kGradScale), cv = hyper(c.src[0], kClipValue);
  x.pre = static_cast<float>(gs);
  x.clip = cv > 0 ? static_cast<float>(cv) : std::numeric_limits<float>::infinity();
  double post = L.gstat ? static_cast<double>(c.src[1].f32()[1]) : 1.0;
  if (use_maximize && hyper(c.src[0], kMaximize) != 0) post = -post;
  x.scale = static_cast<float>(post);
  return x;
}

// Increments tensor t's step count; returns the new count. Throws before overflowing.
int32_t bump_step(const KernelCtx& c, const Node& n, int idx, int64_t t) {
  int32_t* s = c.src[idx].i32();
  if (*s < 0 || *s == std::numeric_limits<int32_t>::max())
    fail(n, "tensor " + std::to_string(t) + " has an invalid step count " + std::to_string(*s));
  return ++*s;
}

// ---- vectorized ranges (free functions so target_clones applies) ----------------------
// std::max/min with the data first keep a NaN gradient NaN (x86 max returns operand 2).

inline float clampf(float x, float c) { return std::min(std::max(x, -c), c); }

RC_SIMD void sgd_range(float* __restrict p, const float* __restrict g, float* __restrict buf,
                       int64_t n, GradXform x, float lr, float wd, float mom_keep, float mom_new,
                       float mom, bool nesterov) {
  if (!buf) {
    for (int64_t i = 0; i < n; ++i) {
      float gi = clampf(g[i] * x.pre, x.clip) * x.scale + wd * p[i];
      p[i] = p[i] - lr * gi;
    }
  } else if (nesterov) {
    for (int64_t i = 0; i < n; ++i) {
      float gi = clampf(g[i] * x.pre, x.clip) * x.scale + wd * p[i];
      float b = mom_keep * buf[i] + mom_new * gi;
      buf[i] = b;
      p[i] = p[i] - lr * (gi + mom * b);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      float gi = clampf(g[i] * x.pre, x.clip) * x.scale + wd * p[i];
      float b = mom_keep * buf[i] + mom_new * gi;
      buf[i] = b;
      p[i] = p[i] - lr * b;
    }
  }
}

// Adam and AdamW: l2 is added to the gradient (Adam), decay multiplies the weight (AdamW).
RC_SIMD void adam_range(float* __restrict p, const float* __restrict g, float* __restrict m,
                        float* __restrict v, int64_t n, GradXform x, float l2, float decay,
                        float b1, float ob1, float b2, float ob2, float step_size,
                        float inv_bc2_sqrt, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    float pi = p[i];
    float gi = clampf(g[i] * x.pre, x.clip) * x.scale + l2 * pi;
    float mi = b1 * m[i] + ob1 * gi;
    float vi = b2 * v[i] + ob2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi * decay - step_size * mi / (std::sqrt(vi) * inv_bc2_sqrt + eps);
  }
}

RC_SIMD void lion_range(float* __restrict p, const float* __restrict g, float* __restrict m,
                        int64_t n, GradXform x, float lr, float decay, float b1, float ob1,
                        float b2, float ob2) {
  for (int64_t i = 0; i < n; ++i) {
    float gi = clampf(g[i] * x.pre, x.clip) * x.scale;
    float mi = m[i];
    float u = b1 * mi + ob1 * gi;
    float sgn = (u > 0.0f ? 1.0f : 0.0f) - (u < 0.0f ? 1.0f : 0.0f);
    p[i] = p[i] * decay - lr * sgn;
    m[i] = b2 * mi + ob2 * gi;
  }
}

RC_SIMD double sumsq_range(const float* __restrict g, int64_t n, float pre, float clip) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) {
      const double x = clampf(g[i + j] * pre, clip);
      acc[j] += x * x;
    }
  for (int j = 0; i < n; ++i, ++j) {
    const double x = clampf(g[i] * pre, clip);
    acc[j] += x * x;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

RC_SIMD void clip_range(float* __restrict g, int64_t n, float pre, float clip, float post) {
  for (int64_t i = 0; i < n; ++i) g[i] = clampf(g[i] * pre, clip) * post;
}

// ---- forwards ---------------------------------------------------------------------------

void sgd_forward(KernelCtx& c) {
  const Node& n = c.node;
  OptimLayout L;
  L.n = n.ip.at(RECURRA_P_N_TENSORS);
  L.gstat = n.ip.at(RECURRA_P_HAS_GSTAT) != 0;
  L.first = 1 + (L.gstat ? 1 : 0);
  const bool has_buf = n.ip.at(RECURRA_P_HAS_BUF) != 0;
  L.per = has_buf ? 4 : 3;
  const GradXform x = grad_xform(c, L, true);
  const TensorView& h = c.src[0];
  const float lr = static_cast<float>(hyper(h, kLr)), wd = static_cast<float>(hyper(h, kWeightDecay));
  const double mom = hyper(h, kA), damp = hyper(h, kB);
  const bool nesterov = hyper(h, kC) != 0;
  // The first step of a tensor copies the gradient into the buffer (PyTorch's rule).
  std::vector<char> first(L.n);
  for (int64_t t = 0; t < L.n; ++t) {
    const int base = L.first + static_cast<int>(t) * L.per;
    if (has_buf) check_no_alias(c, n, t, {base, base + 1, base + 2});
    else check_no_alias(c, n, t, {base, base + 1});
    first[t] = bump_step(c, n, base + L.per - 1, t) == 1;
  }
  const auto offs = offsets(c, L);
  for_chunks(c.pool, offs, [&](int64_t t, int64_t b, int64_t e, int64_t) {
    const int base = L.first + static_cast<int>(t) * L.per;
    float* buf = has_buf ? c.src[base + 2].f32() + b : nullptr;
    const float keep = first[t] ? 0.0f : static_cast<float>(mom);
    const float add = first[t] ? 1.0f : static_cast<float>(1.0 - damp);
    sgd_range(c.src[base].f32() + b, c.src[base + 1].f32() + b, buf, e - b, x, lr, wd, keep, add,
              static_cast<float>(mom), nesterov);
  });
  c.dst.f32()[0] = 0.0f;
}

void adam_forward(KernelCtx& c, bool decoupled) {
  const Node& n = c.node;
  OptimLayout L;
  L.n = n.ip.at(RECURRA_P_N_TENSORS);
  L.gstat = n.ip.at(RECURRA_P_HAS_GSTAT) != 0;
  L.first = 1 + (L.gstat ? 1 : 0);
  L.per = 5;
  const GradXform x = grad_xform(c, L, true);
  const TensorView& h = c.src[0];
  const double lr = hyper(h, kLr), wd = hyper(h, kWeightDecay);
  const double b1 = hyper(h, kA), b2 = hyper(h, kB), eps = hyper(h, kC);
  struct Per { float step_size, inv_bc2_sqrt; };
  std::vector<Per> per(L.n);
  for (int64_t t = 0; t < L.n; ++t) {
    const int base = L.first + static_cast<int>(t) * L.per;
    check_no_alias(c, n, t, {base, base + 1, base + 2, base + 3});
    const int32_t step = bump_step(c, n, base + 4, t);
    const double bc1 = 1.0 - std::pow(b1, step), bc2 = 1.0 - std::pow(b2, step);
    per[t] = {static_cast<float>(lr / bc1), static_cast<float>(1.0 / std::sqrt(bc2))};
  }
  const float l2 = decoupled ? 0.0f : static_cast<float>(wd);
  const float decay = decoupled ? static_cast<float>(1.0 - lr * wd) : 1.0f;
  const auto offs = offsets(c, L);
  for_chunks(c.pool, offs, [&](int64_t t, int64_t b, int64_t e, int64_t) {
    const int base = L.first + static_cast<int>(t) * L.per;
    adam_range(c.src[base].f32() + b, c.src[base + 1].f32() + b, c.src[base + 2].f32() + b,
               c.src[base + 3].f32() + b, e - b, x, l2, decay, static_cast<float>(b1),
               static_cast<float>(1.0 - b1), static_cast<float>(b2), static_cast<float>(1.0 - b2),
               per[t].step_size, per[t].inv_bc2_sqrt, static_cast<float>(eps));
  });
  c.dst.f32()[0] = 0.0f;
}

void lion_forward(KernelCtx& c) {
  const Node& n = c.node;
  OptimLayout L;
  L.n = n.ip.at(RECURRA_P_N_TENSORS);
  L.gstat = n.ip.at(RECURRA_P_HAS_GSTAT) != 0;
  L.first = 1 + (L.gstat ? 1 : 0);
  L.per = 4;
  const GradXform x = grad_xform(c, L, true);
  const TensorView& h = c.src[0];
  const double lr = hyper(h, kLr), wd = hyper(h, kWeightDecay);
  for (int64_t t = 0; t < L.n; ++t) {
    const int base = L.first + static_cast<int>(t) * L.per;
    check_no_alias(c, n, t, {base, base + 1, base + 2});
    bump_step(c, n, base + 3, t);
  }
  const float decay = static_cast<float>(1.0 - lr * wd);
  const double b1 = hyper(h, kA), b2 = hyper(h, kB);
  const auto offs = offsets(c, L);
  for_chunks(c.pool, offs, [&](int64_t t, int64_t b, int64_t e, int64_t) {
    const int base = L.first + static_cast<int>(t) * L.per;
    lion_range(c.src[base].f32() + b, c.src[base + 1].f32() + b, c.src[base + 2].f32() + b, e - b,
               x, static_cast<float>(lr), decay, static_cast<float>(b1), static_cast<float>(1.0 - b1),
               static_cast<float>(b2), static_cast<float>(1.0 - b2));
  });
  c.dst.f32()[0] = 0.0f;
}

void grad_norm_forward(KernelCtx& c) {
  const Node& n = c.node;
  double sum = 0.0;
  if (!n.ip.empty() && n.ip[RECURRA_P_COMBINE] == 1) {  // combine partial results, in source order
    for (size_t i = 1; i < n.src.size(); ++i) {
      const double v = c.src[i].f32()[0];
      sum += v * v;
    }
  } else {
    OptimLayout L;
    L.n = static_cast<int64_t>(n.src.size()) - 1;
    L.first = 1;
    L.per = 1;
    const GradXform x = grad_xform(c, L, false);
    const auto offs = offsets(c, L);
    std::vector<double> part((offs.back() + kOptimChunk - 1) / kOptimChunk, 0.0);
    for_chunks(c.pool, offs, [&](int64_t t, int64_t b, int64_t e, int64_t chunk) {
      part[chunk] += sumsq_range(c.src[1 + t].f32() + b, e - b, x.pre, x.clip);
    });
    for (double s : part) sum += s;  // fixed order: the result does not depend on timing
  }
  const double norm = std::sqrt(sum);
  const double max_norm = hyper(c.src[0], kMaxNorm);
  double coef = 1.0;
  if (max_norm > 0) {
    const double q = max_norm / (norm + 1e-6);
    if (q < 1.0) coef = q;
  }
  c.dst.f32()[0] = static_cast<float>(norm);
  c.dst.f32()[1] = static_cast<float>(coef);
}

void grad_clip_forward(KernelCtx& c) {
  const Node& n = c.node;
  OptimLayout L;
  L.n = n.ip.at(RECURRA_P_N_TENSORS);
  L.gstat = n.ip.at(RECURRA_P_HAS_GSTAT) != 0;
  L.first = 1 + (L.gstat ? 1 : 0);
  L.per = 1;
  const GradXform x = grad_xform(c, L, false);
  std::vector<const void*> ptrs;  // clipping one buffer twice would scale it twice
  for (int64_t t = 0; t < L.n; ++t)
    if (c.src[L.first + t].numel() > 0) ptrs.push_back(c.src[L.first + t].data);
  std::sort(ptrs.begin(), ptrs.end());
  if (std::adjacent_find(ptrs.begin(), ptrs.end()) != ptrs.end())
    fail(n, "two of the gradients are the same memory");
  const auto offs = offsets(c, L);
  for_chunks(c.pool, offs, [&](int64_t t, int64_t b, int64_t e, int64_t) {
    clip_range(c.src[L.first + t].f32() + b, e - b, x.pre, x.clip, x.scale);
  });
  c.dst.f32()[0] = 0.0f;
}

}  // namespace

void register_optim_ops(OpTable& t) {
  {
    OpDef d;
    d.name = "sgd_step";
    d.infer = [](Graph& g, Node& n) {
      if (n.ip.size() != 3) fail(n, "takes 3 integer parameters (n, has_gstat, has_buf)");
      if (n.ip.at(RECURRA_P_HAS_BUF) != 0 && n.ip.at(RECURRA_P_HAS_BUF) != 1) fail(n, "has_buf must be 0 or 1");
      const bool buf = n.ip.at(RECURRA_P_HAS_BUF) != 0;
      const OptimLayout L = layout(g, n, 3, buf ? 4 : 3);
      for (int64_t i = 0; i < L.n; ++i) {
        if (buf) check_tensor(g, n, L, i, {"param", "gradient", "momentum buffer", "step"});
        else check_tensor(g, n, L, i, {"param", "gradient", "step"});
      }
      set_dummy(n);
    };
    d.forward = sgd_forward;
    d.writes_src = writes_per_tensor(0, 1);  // per: 3, or 4 with a momentum buffer
    t.add(std::move(d));
  }
  for (const char* name : {"adam_step", "adamw_step"}) {
    OpDef d;
    d.name = name;
    d.infer = [](Graph& g, Node& n) {
      const OptimLayout L = layout(g, n, 2, 5);
      for (int64_t i = 0; i < L.n; ++i)
        check_tensor(g, n, L, i, {"param", "gradient", "first moment", "second moment", "step"});
      set_dummy(n);
    };
    const bool decoupled = std::string(name) == "adamw_step";
    d.forward = [decoupled](KernelCtx& c) { adam_forward(c, decoupled); };
    d.writes_src = writes_per_tensor(5, 1);
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "lion_step";
    d.infer = [](Graph& g, Node& n) {
      const OptimLayout L = layout(g, n, 2, 4);
      for (int64_t i = 0; i < L.n; ++i)
        check_tensor(g, n, L, i, {"param", "gradient", "momentum", "step"});
      set_dummy(n);
    };
    d.forward = lion_forward;
    d.writes_src = writes_per_tensor(4, 1);
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "grad_norm";
    d.infer = [](Graph& g, Node& n) {
      // ip = {} or {0}: the norm of the gradients; {1}: combine the (2,) results of earlier
      // grad_norm nodes (a norm over more gradients than one node can take).
      if (n.ip.size() > 1 || (n.ip.size() == 1 && n.ip[RECURRA_P_COMBINE] != 0 && n.ip[RECURRA_P_COMBINE] != 1) || !n.fp.empty())
        fail(n, "takes one optional integer parameter (0: gradients, 1: partial norms)");
      const bool combine = n.ip.size() == 1 && n.ip[RECURRA_P_COMBINE] == 1;
      if (n.src.size() < 2) fail(n, "takes the hyper-parameter tensor and at least one gradient");
      check_hyper(g, n);
      for (size_t i = 1; i < n.src.size(); ++i) {
        require_f32(g, n, static_cast<int>(i));
        if (combine) check_gstat(g, n, static_cast<int>(i));
        else if (!dense(g.node(n.src.at(i))))
          fail(n, "gradient " + std::to_string(i - 1) + " must be dense");
      }
      n.dtype = DType::f32;
      n.shape = Shape{2};
    };
    d.forward = grad_norm_forward;
    t.add(std::move(d));
  }
  {
    OpDef d;
    d.name = "grad_clip";
    d.infer = [](Graph& g, Node& n) {
      const OptimLayout L = layout(g, n, 2, 1);
      for (int64_t i = 0; i < L.n; ++i) {
        const int s = L.first + static_cast<int>(i);
        require_f32(g, n, s);
        check_target(g, n, s, "the gradient", i);
      }
      set_dummy(n);
    };
    d.forward = grad_clip_forward;
    d.writes_src = writes_per_tensor(1, -1);
    t.add(std::move(d));
  }
}

}  // namespace recurra

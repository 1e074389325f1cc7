// The forward of the decay-plus-outer-product recurrences (rwkv.h: wkv6 and GLA differ only
// in their inputs, DecayIn), compiled once for both ops: decay_forward_task is a large
// always-inlined kernel, and its avx512f, avx2 and default clones are among the slowest
// code of the core to compile.
#include "rwkv.h"

namespace recurra {
namespace rwkv {
namespace {

RC_SIMD void decay_forward_block(const DecayIn& in, const Dims& d, int64_t q, int64_t h,
                                 int64_t j0, int64_t W, float* st, float* buf, float* y) {
  decay_forward_task(in, d, q, h, j0, W, st, buf, y);
}

}  // namespace

// Tasks: (run, head, block of value lane groups); blocks only when there are few heads.
void decay_forward(KernelCtx& c, const Dims& d, const DecayIn& in, const float* s0) {
  float* y = c.dst.f32();
  float* sN = y + d.ths();
  Scratch scratch(c.pool.size());
  for_each_head_block(c.pool, d, [&](int64_t q, int64_t h, int64_t j0, int64_t W, int64_t jn,
                                      int tid) {
    float* st = scratch.get(tid, static_cast<size_t>(d.S * W + decay_forward_buf(d.S, W)));
    const float* src = s0 + d.state(q, h);
    for (int64_t i = 0; i < d.S; ++i) load_padded(st + i * W, src + i * d.S + j0, jn, W);
    DecayIn head = in;
    if (head.u) head.u += h * d.S;
    decay_forward_block(head, d, q, h, j0, W, st, st + d.S * W, y);
    float* dst = sN + d.state(q, h);
    for (int64_t i = 0; i < d.S; ++i)
      std::memcpy(dst + i * d.S + j0, st + i * W, static_cast<size_t>(jn) * sizeof(float));
  });
}

}  // namespace rwkv
}  // namespace recurra

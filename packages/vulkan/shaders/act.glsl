// Each elementwise unary op of recurra/op_spec.h by its RECURRA_UNARY_* code: f, and f' for
// the activations (act_grad). The formulas are the spec's (RECURRA_UNARY_MATHS and
// RECURRA_ACTIVATIONS, shared with the CPU kernels); this file gives their portable function
// names (rc_*) a GLSL body: GLSL lacks erf, log1p and an overflow-safe tanh.
#define RECURRA_GLSL
#include "recurra/op_spec.h"

#define rc_abs(x) abs(x)
#define rc_sqrt(x) sqrt(x)
#define rc_exp(x) exp(x)
#define rc_log(x) log(x)
#define rc_min(a, b) min(a, b)
#define rc_max(a, b) max(a, b)
#define rc_isnan(x) isnan(x)

// relu decided on the bits: a negative number below -0 (down to -inf) gives 0, anything else
// (NaN, -0, positives) passes through, as on the CPU. NVIDIA's compiler turns the float form
// `x < 0.0 ? 0.0 : x` into max(x, 0.0), which returns 0 for a NaN (seen on the H200).
float rc_relu(float x) {
  const uint b = floatBitsToUint(x);
  return (b > 0x80000000u && b <= 0xff800000u) ? 0.0 : x;
}

float rc_sigmoid(float x) { return 1.0 / (1.0 + exp(-x)); }

// log(1 + u) accurate for small u (Goldberg's trick: the rounding error of 1 + u cancels).
float rc_log1p(float u) {
  const float w = 1.0 + u;
  if (w == 1.0) return u;
  return log(w) * u / (w - 1.0);
}

float rc_softplus(float x) { return x > 20.0 ? x : rc_log1p(exp(x)); }

float rc_tanh(float x) {
  const float t = exp(-2.0 * abs(x));
  const float r = (1.0 - t) / (1.0 + t);
  return x < 0.0 ? -r : r;
}

// erf with |error| < 1.2e-7 (Numerical Recipes' erfc Chebyshev fit).
float rc_erf(float x) {
  const float z = abs(x);
  const float t = 1.0 / (1.0 + 0.5 * z);
  const float r = t * exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
                  t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
                  t * (-0.82215223 + t * 0.17087277)))))))));
  const float e = 1.0 - r;
  return x < 0.0 ? -e : e;
}

// act(code, false, x, y, p0, p1) is f(x), act(code, true, ...) an activation's f'(x) (y =
// f(x)); p0, p1 are the op's float parameters (scale: factor; clamp: min, max). A constant
// `code` and `deriv` (specialization constants) fold the others away.
#define RC_MATHS(NAME, CODE, F) \
  if (code == CODE && !deriv) return (F);
#define RC_ACT(NAME, CODE, F, D) \
  if (code == CODE) return deriv ? (D) : (F);
float act(int code, bool deriv, float x, float y, float p0, float p1) {
  RECURRA_UNARY_MATHS(RC_MATHS)
  RECURRA_ACTIVATIONS(RC_ACT)
  return x;  // not such an op (unary and act_grad's checks refuse such a code)
}
#undef RC_ACT
#undef RC_MATHS

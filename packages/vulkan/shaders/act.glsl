// Scalar maths shared by the unary ops and act_grad (the CPU kernels of elementwise.cpp
// define the semantics; GLSL lacks erf, log1p and an overflow-safe tanh), and each
// activation with its derivative by RECURRA_UNARY_* code.
#define RECURRA_GLSL
#include "recurra/op_spec.h"

float sigmoid_f(float x) { return 1.0 / (1.0 + exp(-x)); }

// log(1 + u) accurate for small u (Goldberg's trick: the rounding error of 1 + u cancels).
float log1p_f(float u) {
  const float w = 1.0 + u;
  if (w == 1.0) return u;
  return log(w) * u / (w - 1.0);
}

float softplus_f(float x) { return x > 20.0 ? x : log1p_f(exp(x)); }

float tanh_f(float x) {
  const float t = exp(-2.0 * abs(x));
  const float r = (1.0 - t) / (1.0 + t);
  return x < 0.0 ? -r : r;
}

// erf with |error| < 1.2e-7 (Numerical Recipes' erfc Chebyshev fit).
float erf_f(float x) {
  const float z = abs(x);
  const float t = 1.0 / (1.0 + 0.5 * z);
  const float r = t * exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
                  t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
                  t * (-0.82215223 + t * 0.17087277)))))))));
  const float e = 1.0 - r;
  return x < 0.0 ? -e : e;
}

const float INV_SQRT2 = 0.70710678118654752;
const float INV_SQRT_2PI = 0.39894228040143268;

// The activations (the unary ops whose backward is act_grad), one line each: code, f(x) and
// f'(x) (y = f(x)); p0, p1 are the op's float parameters (clamp: min, max). act(code, false,
// ...) is f, act(code, true, ...) f' (a constant `deriv` folds the other away). At a NaN
// input a derivative is NaN (x itself), as on the CPU; GLSL's min/max may drop a NaN.
#define ACT(CODE, F, D) \
  if (code == CODE) return deriv ? (D) : (F);
float act(int code, bool deriv, float x, float y, float p0, float p1) {
  ACT(RECURRA_UNARY_ABS, abs(x), x > 0.0 ? 1.0 : (x < 0.0 ? -1.0 : (x == 0.0 ? 0.0 : x)))
  ACT(RECURRA_UNARY_SQRT, sqrt(x), 0.5 / y)
  ACT(RECURRA_UNARY_LOG, log(x), 1.0 / x)
  ACT(RECURRA_UNARY_CLAMP, isnan(x) ? x : min(max(x, p0), p1),
      (x >= p0 && x <= p1) ? 1.0 : (isnan(x) ? x : 0.0))
  ACT(RECURRA_UNARY_RELU, x < 0.0 ? 0.0 : x, x > 0.0 ? 1.0 : (x <= 0.0 ? 0.0 : x))
  ACT(RECURRA_UNARY_SILU, x * sigmoid_f(x), sigmoid_f(x) * (1.0 + x * (1.0 - sigmoid_f(x))))
  ACT(RECURRA_UNARY_GELU, 0.5 * x * (1.0 + erf_f(x * INV_SQRT2)),
      0.5 * (1.0 + erf_f(x * INV_SQRT2)) + x * INV_SQRT_2PI * exp(-0.5 * x * x))
  ACT(RECURRA_UNARY_SIGMOID, sigmoid_f(x), y * (1.0 - y))
  ACT(RECURRA_UNARY_TANH, tanh_f(x), 1.0 - y * y)
  ACT(RECURRA_UNARY_SOFTPLUS, softplus_f(x), x > 20.0 ? 1.0 : sigmoid_f(x))
#define GELU_T tanh_f(0.7978845608 * (x + 0.044715 * x * x * x))  // GELU's tanh approximation
  ACT(RECURRA_UNARY_GELU_TANH, 0.5 * x * (1.0 + GELU_T),
      0.5 * (1.0 + GELU_T) + 0.5 * x * (1.0 - GELU_T * GELU_T) * 0.7978845608 * (1.0 + 0.134145 * x * x))
  return x;  // not an activation (act_grad's check refuses such a code)
}
#undef ACT

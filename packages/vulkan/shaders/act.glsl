// Scalar maths shared by the unary ops and act_grad (the CPU kernels of elementwise.cpp
// define the semantics; GLSL lacks erf, log1p and an overflow-safe tanh).

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

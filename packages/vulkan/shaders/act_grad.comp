// act_grad(g, x, y): g * f'(x) for activation CODE (y = f(x) where cheaper). All dense.
//   CODE (the core's Act enum): 0 abs, 1 sqrt, 2 log, 3 clamp (p0, p1), 4 relu, 5 silu,
//   6 gelu, 7 sigmoid, 8 tanh, 9 softplus
#version 450
#include "common.glsl"
#include "act.glsl"

layout(local_size_x = 256) in;
layout(constant_id = 0) const int CODE = 0;

layout(push_constant) uniform PC {
  uvec2 g, x, y, d;
  uint n;
  float p0, p1;
} pc;

float deriv(float x, float y) {
  // At a NaN input the derivative is NaN (x itself), as on the CPU.
  if (CODE == 0) return x > 0.0 ? 1.0 : (x < 0.0 ? -1.0 : (x == 0.0 ? 0.0 : x));
  if (CODE == 1) return 0.5 / y;
  if (CODE == 2) return 1.0 / x;
  if (CODE == 3) return (x >= pc.p0 && x <= pc.p1) ? 1.0 : (isnan(x) ? x : 0.0);
  if (CODE == 4) return x > 0.0 ? 1.0 : (x <= 0.0 ? 0.0 : x);
  if (CODE == 5) {
    const float s = sigmoid_f(x);
    return s * (1.0 + x * (1.0 - s));
  }
  if (CODE == 6) {
    const float cdf = 0.5 * (1.0 + erf_f(x * INV_SQRT2));
    return cdf + x * INV_SQRT_2PI * exp(-0.5 * x * x);
  }
  if (CODE == 7) return y * (1.0 - y);
  if (CODE == 8) return 1.0 - y * y;
  return x > 20.0 ? 1.0 : sigmoid_f(x);
}

void main() {
  const uint stride = gl_NumWorkGroups.x * 256u;
  FBuf g = FBuf(pc.g), x = FBuf(pc.x), y = FBuf(pc.y), d = FBuf(pc.d);
  for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) d.v[i] = g.v[i] * deriv(x.v[i], y.v[i]);
}

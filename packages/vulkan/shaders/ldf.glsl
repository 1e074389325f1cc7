// Loads of float sources whose dtype is a specialization constant of the caller (the fused
// float32 kernels of RECURRA_OPS_HALF_IN: gated_norm, causal_conv, the scans): in the "_h"
// variant (-DHALF, 16-bit storage) a bfloat16/float16 element converts exactly to float32
// where it is loaded (half.glsl's ld, on the bits), so reading a 2-byte source costs what
// reading its float32 up-cast did, without the cast's dispatch and copy; in the float32
// variant every source is float32 and the dtype argument is ignored. Include after
// common.glsl.
const int DT_F32_ = 0;  // a float32 source (half.glsl's DT_F32, in both variants)
#ifdef HALF
#include "half.glsl"
float ldf(uvec2 a, int i, int dt) { return ld(a, uint(i), dt); }
#else
float ldf(uvec2 a, int i, int dt) { return FBuf(a).v[i]; }
#endif

/* recurra op spec: one declaration per op of the core's op table (plain C).
 *
 * What a node of each op carries across the backend ABI (recurra_node_desc in backend.h):
 * how many sources, how many integer (ip) and float (fp) parameters and what each means,
 * what the output is (multi-output ops pack their results into one flat f32 output, in the
 * order listed), the op(s) its gradient is built from, and the ops it decomposes into when
 * a backend has no kernel for it (the scheduler then builds the decomposition instead).
 *
 * The core checks at start-up that its op table and this spec agree; a backend plugin
 * builds against this header (the codes below are part of RECURRA_BACKEND_ABI_VERSION).
 *
 * The first part (the unary ops with their formulas and codes, parameter indexes, flags) is
 * written so that GLSL shaders can include it too: a shader defines RECURRA_GLSL before
 * including this file.
 */
#ifndef RECURRA_OP_SPEC_H
#define RECURRA_OP_SPEC_H

/* ---- elementwise unary functions ------------------------------------------------------
 * Every elementwise unary op once, with its formula, in two X-macro lists in code order:
 *
 *   RECURRA_UNARY_MATHS(M): M(NAME, code, f)      its gradient is built from other ops (the
 *                                                 backward of its RECURRA_OPS row)
 *   RECURRA_ACTIVATIONS(A): A(NAME, code, f, df)  its gradient is act_grad(grad, x, y) =
 *                                                 grad * df, act_grad's ip[RECURRA_P_ACT] = code
 *
 * RECURRA_UNARY_<NAME> = code below (the codes are part of RECURRA_BACKEND_ABI_VERSION: a new
 * op takes the next free one). f is y = f(x) as an expression of x and of p0, p1, the op's
 * float parameters; df is f'(x) as an expression of x, y = f(x), p0 and p1. At a NaN input f
 * and df are NaN (x itself): a NaN is never hidden by a gradient of 0.
 *
 * These formulas are the only source of the CPU kernels (csrc/ops/elementwise.cpp) and the
 * Vulkan ones (shaders/act.glsl), so they use what C, C++ and GLSL share: float literals with
 * an f suffix, arithmetic, comparisons, ?:, and the functions rc_abs, rc_sqrt, rc_exp,
 * rc_log, rc_erf, rc_tanh, rc_sigmoid, rc_softplus (x above 20), rc_min, rc_max and
 * rc_isnan, which each includer maps onto its own before expanding a list. A new activation
 * is one A line here and its row in RECURRA_OPS; every backend's kernels follow. */
#define RECURRA_UNARY_MATHS(M)                                                                 \
  M(NEG, 0, -x)                                                                                \
  M(SQR, 2, x * x)                                                                             \
  M(EXP, 4, rc_exp(x))                                                                         \
  M(SCALE, 6, x * p0) /* fp: factor */                                                         \
  /* (each list ends here: a new line goes above) */
#define RECURRA_ACTIVATIONS(A)                                                                 \
  A(ABS, 1, rc_abs(x), x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == 0.0f ? 0.0f : x)))          \
  A(SQRT, 3, rc_sqrt(x), 0.5f / y)                                                             \
  A(LOG, 5, rc_log(x), 1.0f / x)                                                               \
  A(CLAMP, 7, rc_isnan(x) ? x : rc_min(rc_max(x, p0), p1), /* fp: min, max */                  \
    (x >= p0 && x <= p1) ? 1.0f : (rc_isnan(x) ? x : 0.0f))                                    \
  A(RELU, 8, rc_relu(x), rc_isnan(x) ? x : (x > 0.0f ? 1.0f : 0.0f))                            \
  A(SILU, 9, x * rc_sigmoid(x), rc_sigmoid(x) * (1.0f + x * (1.0f - rc_sigmoid(x))))           \
  A(GELU, 10, 0.5f * x * (1.0f + rc_erf(x * 0.70710678118654752f)), /* exact: x Phi(x) */      \
    0.5f * (1.0f + rc_erf(x * 0.70710678118654752f)) +                                         \
        x * 0.39894228040143268f * rc_exp(-0.5f * x * x))                                      \
  A(SIGMOID, 11, rc_sigmoid(x), y * (1.0f - y))                                                \
  A(TANH, 12, rc_tanh(x), 1.0f - y * y)                                                        \
  A(SOFTPLUS, 13, rc_softplus(x), rc_sigmoid(x)) /* sigmoid is 1.0f above 20 */                \
  A(GELU_TANH, 14, 0.5f * x * (1.0f + RECURRA_GELU_T_(x)),                                     \
    0.5f * (1.0f + RECURRA_GELU_T_(x)) + 0.5f * x * (1.0f - RECURRA_GELU_T_(x) *               \
        RECURRA_GELU_T_(x)) * 0.7978845608f * (1.0f + 0.134145f * x * x))                      \
  A(RELU_SQR, 15, rc_isnan(x) ? x : (x < 0.0f ? 0.0f : x * x),                                 \
    rc_isnan(x) ? x : (x > 0.0f ? 2.0f * x : 0.0f))                                            \
  /* (each list ends here: a new line goes above) */
/* gelu_tanh's t = tanh(sqrt(2/pi) (x + 0.044715 x^3)): y = 0.5 x (1 + t), and f' = 0.5 (1 + t)
 * + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2). */
#define RECURRA_GELU_T_(x) rc_tanh(0.7978845608f * ((x) + 0.044715f * (x) * (x) * (x)))

/* The codes, RECURRA_UNARY_<NAME> (C: enum constants; GLSL: const int), and their count. */
#ifdef RECURRA_GLSL
#define RECURRA_CODE_(name, value) const int name = value;
#else
#define RECURRA_CODE_(name, value) enum { name = value };
#endif
#define RECURRA_MATHS_CODE_(NAME, code, f) RECURRA_CODE_(RECURRA_UNARY_##NAME, code)
#define RECURRA_ACT_CODE_(NAME, code, f, df) RECURRA_CODE_(RECURRA_UNARY_##NAME, code)
#define RECURRA_MATHS_ONE_(NAME, code, f) +1
#define RECURRA_ACT_ONE_(NAME, code, f, df) +1
RECURRA_UNARY_MATHS(RECURRA_MATHS_CODE_)
RECURRA_ACTIVATIONS(RECURRA_ACT_CODE_)
RECURRA_CODE_(RECURRA_UNARY_COUNT, 0 RECURRA_UNARY_MATHS(RECURRA_MATHS_ONE_)
                                       RECURRA_ACTIVATIONS(RECURRA_ACT_ONE_))

/* ---- parameter indexes (ip: integer parameters, fp: float parameters) ------------------ */
#define RECURRA_P_ACT 0           /* act_grad ip: the RECURRA_UNARY_* code */
#define RECURRA_P_SCALE 0         /* scale fp, gated_linear_attn(_back) fp: the factor */
#define RECURRA_P_MIN 0           /* clamp (and act_grad of clamp) fp */
#define RECURRA_P_MAX 1           /* clamp (and act_grad of clamp) fp */
#define RECURRA_P_AXIS 0          /* sum, max, max_grad, concat, cumsum ip */
#define RECURRA_P_REVERSE 1       /* cumsum ip: 0 from the start, 1 from the end */
#define RECURRA_P_EPS 0           /* rms_norm, layer_norm, gated_rms_norm (and _back) fp */
#define RECURRA_P_GROUP_SIZE 0    /* gated_rms_norm(_back) ip: channels per normalized group */
#define RECURRA_P_OUT_DTYPE 1     /* gated_rms_norm ip (optional): its output's recurra_dtype */
#define RECURRA_P_CONV_OUT_DTYPE 0 /* causal_conv_silu ip (optional): its output's recurra_dtype */
#define RECURRA_P_N_ROWS 0        /* get_rows_back ip: the table's row count V */
#define RECURRA_P_VALUE 0         /* fill, pad fp: the value */
#define RECURRA_P_DTYPE 1         /* fill fp: the output's recurra_dtype code */
#define RECURRA_P_TO_DTYPE 0      /* cast ip: the output's recurra_dtype code */
#define RECURRA_P_SCAN_FLAGS 0    /* ssm_scan ip (optional): RECURRA_SSM_SCAN_* flags */
#define RECURRA_P_N_TENSORS 0     /* sgd/adam/adamw/lion_step, grad_clip ip: tensors updated */
#define RECURRA_P_HAS_GSTAT 1     /* the same: 1 when a grad_norm result follows `hyper` */
#define RECURRA_P_HAS_BUF 2       /* sgd_step ip: 1 with a momentum buffer per tensor */
#define RECURRA_P_COMBINE 0       /* grad_norm ip (optional): 1 combines earlier results */

/* ssm_scan flags (ip[RECURRA_P_SCAN_FLAGS]). */
#define RECURRA_SSM_SCAN_SAVE_CHECKPOINTS 1 /* the packed output ends with the states the
                                               backward reads (head_dim 1 or one decay per
                                               head only); ssm_scan_back then takes the
                                               forward's packed output as a 9th source */
#define RECURRA_SSM_SCAN_CHECKPOINTS_AUTO 2 /* the core replaces it by SAVE_CHECKPOINTS where
                                               the backend placing the scan reads them (the
                                               CPU: head_dim 1), else by no flag: no backend
                                               sees it */
#define RECURRA_SSM_SCAN_STATE_IN_PLACE 4 /* one token (n_tok 1), distinct ids, no checkpoints:
                                             the final states are written into s's rows
                                             ids[i] in place and the output is y alone (the
                                             CPU's generation step; no gradient) */

/* The optimizer ops' hyper-parameter slots: source 0 is a (2 * RECURRA_HYPER_SLOTS,) f32
 * tensor, slot i the float pair (hi, lo) at [2i, 2i + 1] holding the double hi + lo. */
#define RECURRA_HYPER_LR 0
#define RECURRA_HYPER_GRAD_SCALE 1 /* multiplies the gradient first (1/k of k accumulated) */
#define RECURRA_HYPER_CLIP_VALUE 2 /* <= 0: no clipping by value */
#define RECURRA_HYPER_MAX_NORM 3   /* <= 0: no clipping by norm */
#define RECURRA_HYPER_WEIGHT_DECAY 4
#define RECURRA_HYPER_A 5 /* beta1 (adam, lion) or momentum (sgd) */
#define RECURRA_HYPER_B 6 /* beta2 (adam, lion) or dampening (sgd) */
#define RECURRA_HYPER_C 7 /* eps (adam) or nesterov 0/1 (sgd) */
#define RECURRA_HYPER_MAXIMIZE 8
#define RECURRA_HYPER_SLOTS 10

#ifndef RECURRA_GLSL

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Source and parameter counts: [min, max]; max -1: no limit (the optimizer ops take any
 * number of tensors; a device node holds at most RECURRA_MAX_SRC). */
typedef struct recurra_op_spec {
  const char* name;
  int32_t src_min, src_max;
  int32_t ip_min, ip_max;
  int32_t fp_min, fp_max;
  int32_t unary;             /* RECURRA_UNARY_* for an elementwise unary op, else -1 */
  const char* srcs;          /* the sources, in order */
  const char* ip;            /* the meaning of the integer parameters ("" none) */
  const char* fp;            /* the meaning of the float parameters ("" none) */
  const char* output;        /* "packed: a, b": one flat f32 output holding a then b */
  const char* backward;      /* the op(s) its gradient is built from ("" none) */
  const char* decomposition; /* the ops it becomes where a backend lacks it ("" none) */
} recurra_op_spec;

/* X(name, src_min, src_max, ip_min, ip_max, fp_min, fp_max, unary, srcs, ip, fp, output,
 *   backward, decomposition) for every op, in the core's op table order. */
#define RECURRA_OPS(X)                                                                          \
  /* views (no kernel: they look into their base) and memory ops */                             \
  X(reshape, 1, 1, 0, 4, 0, 0, -1, "x", "the new shape", "", "x's elements in the new shape",   \
    "reshape", "")                                                                              \
  X(permute, 1, 1, 0, 4, 0, 0, -1, "x", "the axis order (a permutation)", "",                   \
    "x with axes permuted", "permute", "")                                                      \
  X(slice, 1, 1, 0, 12, 0, 0, -1, "x", "(start, stop, step) per axis, clipped", "",             \
    "a strided window of x", "slice_grad", "")                                                  \
  X(slice_grad, 1, 1, 0, 16, 0, 0, -1, "grad", "the full shape, then (start, stop, step) per axis",\
    "", "zeros of the full shape with grad scattered into the window", "", "")                  \
  X(broadcast_to, 1, 1, 0, 4, 0, 0, -1, "x", "the target shape", "", "x broadcast (a view)",    \
    "sum_to", "")                                                                               \
  X(contiguous, 1, 1, 0, 0, 0, 0, -1, "x", "", "", "a dense copy of x", "contiguous", "")       \
  X(assign, 2, 2, 0, 0, 0, 0, -1, "dst (a leaf), src", "", "",                                  \
    "a (1,) dummy; writes src into dst in place", "", "")                                       \
  X(fill, 0, 0, 0, 4, 2, 2, -1, "", "the shape", "value, dtype code", "a constant tensor", "",  \
    "")                                                                                         \
  X(sum_to, 1, 1, 0, 4, 0, 0, -1, "x", "the target shape", "",                                  \
    "x summed down to the shape (broadcasting in reverse)", "broadcast_to", "")                 \
  X(cast, 1, 1, 1, 1, 0, 0, -1, "x (a float dtype)", "the target recurra_dtype (a float one)", "",\
    "x converted (round to nearest even)", "cast", "")                                          \
  /* elementwise */                                                                             \
  X(add, 2, 2, 0, 0, 0, 0, -1, "a, b", "", "", "a + b (numpy broadcasting)", "sum_to", "")      \
  X(sub, 2, 2, 0, 0, 0, 0, -1, "a, b", "", "", "a - b (numpy broadcasting)", "neg, sum_to", "") \
  X(mul, 2, 2, 0, 0, 0, 0, -1, "a, b", "", "", "a * b (numpy broadcasting)", "mul, sum_to", "") \
  X(div, 2, 2, 0, 0, 0, 0, -1, "a, b", "", "", "a / b (numpy broadcasting)",                    \
    "div, mul, neg, sum_to", "")                                                                \
  X(neg, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_NEG, "x", "", "", "-x", "neg", "")                     \
  X(abs, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_ABS, "x", "", "", "|x|", "act_grad", "")               \
  X(sqr, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_SQR, "x", "", "", "x * x", "mul, scale", "")           \
  X(sqrt, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_SQRT, "x", "", "", "sqrt(x)", "act_grad", "")         \
  X(exp, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_EXP, "x", "", "", "exp(x)", "mul", "")                 \
  X(log, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_LOG, "x", "", "", "log(x)", "act_grad", "")            \
  X(scale, 1, 1, 0, 0, 1, 1, RECURRA_UNARY_SCALE, "x", "", "factor", "x * factor", "scale", "") \
  X(clamp, 1, 1, 0, 0, 2, 2, RECURRA_UNARY_CLAMP, "x", "", "min, max", "min(max(x, min), max)", \
    "act_grad", "")                                                                             \
  X(relu, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_RELU, "x", "", "", "max(x, 0)", "act_grad", "")       \
  X(silu, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_SILU, "x", "", "", "x * sigmoid(x)", "act_grad", "")  \
  X(gelu, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_GELU, "x", "", "", "0.5 x (1 + erf(x / sqrt(2)))",    \
    "act_grad", "")                                                                             \
  X(sigmoid, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_SIGMOID, "x", "", "", "1 / (1 + exp(-x))",         \
    "act_grad", "")                                                                             \
  X(tanh, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_TANH, "x", "", "", "tanh(x)", "act_grad", "")         \
  X(softplus, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_SOFTPLUS, "x", "", "", "log(1 + exp(x))",         \
    "act_grad", "")                                                                             \
  X(gelu_tanh, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_GELU_TANH, "x", "", "",                          \
    "0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))", "act_grad", "")                        \
  X(relu_sqr, 1, 1, 0, 0, 0, 0, RECURRA_UNARY_RELU_SQR, "x", "", "", "max(x, 0)^2", "act_grad",  \
    "")                                                                                         \
  X(act_grad, 3, 3, 1, 1, 0, 2, -1, "grad, x, y = f(x) (dense)",                                \
    "the activation's RECURRA_UNARY_* code", "the activation's own (clamp: min, max)",          \
    "grad * f'(x)", "", "")                                                                     \
  /* reductions */                                                                              \
  X(sum, 1, 1, 1, 1, 0, 0, -1, "x", "axis", "", "x summed over the axis (kept as 1)",           \
    "broadcast_to, contiguous", "")                                                             \
  X(max, 1, 1, 1, 1, 0, 0, -1, "x", "axis", "", "the max over the axis (kept as 1)",            \
    "max_grad", "")                                                                             \
  X(max_grad, 3, 3, 1, 1, 0, 0, -1, "grad, x, out (dense)", "axis", "",                         \
    "grad routed to the first max of each line", "", "")                                        \
  /* products */                                                                                \
  X(matmul, 2, 2, 0, 0, 0, 0, -1, "a (B..., m, k), b (B..., k, n)", "", "", "a @ b (B..., m, n)", \
    "matmul", "")                                                                               \
  X(out_prod, 2, 2, 0, 0, 0, 0, -1, "a (B..., k, m), b (B..., k, n)", "", "",                   \
    "a^T @ b (B..., m, n)", "matmul", "")                                                       \
  /* nn */                                                                                      \
  X(gated_rms_norm, 2, 5, 1, 2, 1, 1, -1, "y, [z], w (C,), [x, D (H,)]",                       \
    "group_size, [output dtype: float32 by default, rounded once]", "eps",                      \
    "rms_norm over groups of (y + x D) silu(z), times w", "gated_rms_norm_back",                \
    "mul, add, silu, reshape, rms_norm")                                                        \
  X(gated_rms_norm_back, 3, 6, 1, 1, 1, 1, -1, "grad, then gated_rms_norm's sources",           \
    "group_size", "eps", "packed: dy, [dz], dw, [dx, dD]", "", "")                              \
  X(softmax, 1, 1, 0, 0, 0, 0, -1, "x", "", "", "softmax over the last axis", "softmax_back", "") \
  X(softmax_back, 2, 2, 0, 0, 0, 0, -1, "grad, y", "", "", "the gradient of x", "", "")         \
  X(log_softmax, 1, 1, 0, 0, 0, 0, -1, "x", "", "", "log_softmax over the last axis",           \
    "log_softmax_back", "")                                                                     \
  X(log_softmax_back, 2, 2, 0, 0, 0, 0, -1, "grad, y", "", "", "the gradient of x", "", "")     \
  X(cross_entropy, 2, 2, 0, 0, 0, 0, -1, "logits (N, V), targets (N,) i32", "", "",             \
    "the mean cross-entropy, shape ()", "cross_entropy_back", "")                               \
  X(cross_entropy_back, 3, 3, 0, 0, 0, 0, -1, "grad, logits, targets", "", "",                  \
    "the gradient of the logits", "", "")                                                       \
  X(rms_norm, 1, 1, 0, 0, 1, 1, -1, "x", "", "eps", "x / sqrt(mean(x^2) + eps), last axis",     \
    "rms_norm_back", "")                                                                        \
  X(rms_norm_back, 2, 2, 0, 0, 1, 1, -1, "grad, x", "", "eps", "the gradient of x", "", "")     \
  X(layer_norm, 1, 1, 0, 0, 1, 1, -1, "x", "", "eps", "(x - mean) / sqrt(var + eps), last axis",\
    "layer_norm_back", "")                                                                      \
  X(layer_norm_back, 2, 2, 0, 0, 1, 1, -1, "grad, x", "", "eps", "the gradient of x", "", "")   \
  X(get_rows, 2, 2, 0, 0, 0, 0, -1, "table (V, D), idx i32", "", "", "table[idx]",              \
    "get_rows_back", "")                                                                        \
  X(get_rows_back, 2, 2, 1, 1, 0, 0, -1, "grad, idx", "V", "", "the table's gradient (V, D)",   \
    "", "")                                                                                     \
  /* shape */                                                                                   \
  X(concat, 2, 2, 1, 1, 0, 0, -1, "a, b", "axis", "", "a and b joined on the axis", "slice", "") \
  X(pad, 1, 1, 0, 8, 1, 1, -1, "x", "(before, after) per axis", "value", "x padded",            \
    "slice", "")                                                                                \
  X(cumsum, 1, 1, 2, 2, 0, 0, -1, "x", "axis, reverse", "", "the running sum along the axis",   \
    "cumsum", "")                                                                               \
  /* state-space models */                                                                      \
  X(ssm_conv, 2, 2, 0, 0, 0, 0, -1, "sx (S, D, L), c (D, W)", "", "",                           \
    "y (S, L - W + 1, D), the depthwise causal convolution", "ssm_conv_back", "")               \
  X(ssm_conv_back, 3, 3, 0, 0, 0, 0, -1, "dy, sx, c", "", "", "packed: dsx, dc", "", "")        \
  X(causal_conv_silu, 2, 3, 0, 1, 0, 0, -1, "x (S, T, D), c (D, K), [bias (D,)]",              \
    "[output dtype: float32 by default, rounded once]", "",                                     \
    "silu(bias + causal conv of x from zeros), x's shape", "causal_conv_silu_back",             \
    "permute, pad, ssm_conv, add, silu")                                                        \
  X(causal_conv_silu_back, 3, 4, 0, 0, 0, 0, -1, "dy, x, c, [bias]", "", "",                    \
    "packed: dx, dc, [dbias]", "", "")                                                          \
  X(conv_step, 3, 4, 0, 0, 0, 0, -1, "state (S, D, K - 1) (a leaf), x (S, 1, D), c (D, K), [bias]",\
    "", "", "silu(bias + conv of [state, x]), x's shape; the state moves on by x in place", "",   \
    "")                                                                                         \
  X(ssm_scan, 7, 7, 0, 1, 0, 0, -1, "s, x, dt, A, B, C, ids", "[flags: RECURRA_SSM_SCAN_*]", "",\
    "packed: y (x's shape), final states (S, H, P, N), [checkpoints]", "ssm_scan_back",         \
    "ssm_scan")                                                                                 \
  X(ssm_scan_back, 8, 9, 0, 0, 0, 0, -1,                                                        \
    "grad, s, x, dt, A, B, C, ids, [the forward's packed output with checkpoints]", "", "",     \
    "packed: ds, dx, ddt, dA, dB, dC", "", "")                                                  \
  /* linear-attention recurrences */                                                           \
  X(rwkv_wkv6, 6, 6, 0, 0, 0, 0, -1, "k, v, r, tf, td, state", "", "",                          \
    "packed: y, final states", "rwkv_wkv6_back", "")                                            \
  X(rwkv_wkv6_back, 7, 7, 0, 0, 0, 0, -1, "k, v, r, tf, td, state, grad", "", "",               \
    "packed: the sources' gradients", "", "")                                                   \
  X(rwkv_wkv7, 7, 7, 0, 0, 0, 0, -1, "r, w, k, v, a, b, state", "", "",                         \
    "packed: y, final states", "rwkv_wkv7_back", "")                                            \
  X(rwkv_wkv7_back, 8, 8, 0, 0, 0, 0, -1, "r, w, k, v, a, b, state, grad", "", "",              \
    "packed: the sources' gradients", "", "")                                                   \
  X(gated_linear_attn, 5, 5, 0, 0, 1, 1, -1, "k, v, q, g, state", "", "scale",                  \
    "packed: y, final states", "gated_linear_attn_back", "")                                    \
  X(gated_linear_attn_back, 6, 6, 0, 0, 1, 1, -1, "k, v, q, g, state, grad", "", "scale",       \
    "packed: the sources' gradients", "", "")                                                   \
  /* optimizer steps: update their sources in place, return a (1,) dummy */                    \
  X(sgd_step, 4, -1, 3, 3, 0, 0, -1, "hyper, [gstat], then per tensor p, g, [buf], step",       \
    "n_tensors, has_gstat, has_buf", "", "a (1,) dummy", "", "")                                \
  X(adam_step, 6, -1, 2, 2, 0, 0, -1, "hyper, [gstat], then per tensor p, g, m, v, step",       \
    "n_tensors, has_gstat", "", "a (1,) dummy", "", "")                                         \
  X(adamw_step, 6, -1, 2, 2, 0, 0, -1, "hyper, [gstat], then per tensor p, g, m, v, step",      \
    "n_tensors, has_gstat", "", "a (1,) dummy", "", "")                                         \
  X(lion_step, 5, -1, 2, 2, 0, 0, -1, "hyper, [gstat], then per tensor p, g, m, step",          \
    "n_tensors, has_gstat", "", "a (1,) dummy", "", "")                                         \
  X(grad_norm, 2, -1, 0, 1, 0, 0, -1, "hyper, gradients (or earlier grad_norm results)",        \
    "[combine]", "", "(2,): the global norm, the clip coefficient", "", "")                     \
  X(grad_clip, 2, -1, 2, 2, 0, 0, -1, "hyper, [gstat], gradients (leaves)",                     \
    "n_tensors, has_gstat", "", "a (1,) dummy; clips the gradients in place", "", "")

/* ---- dtypes ----------------------------------------------------------------------------
 * Every op takes float32 sources (int32 where its sources say so). The ops below also take
 * bfloat16 and float16 ones: all float sources of a node then have one dtype (no implicit
 * promotion: a mix is refused) and the output has it too (fill: its dtype code; cast: its
 * target). The CPU computes them in float32 (float32 accumulation; the inputs converted,
 * the output rounded to nearest even on store), a gradient has its tensor's dtype. Any other
 * op refuses them when the node is made (TypeError: cast with .to(float32) first). */
#define RECURRA_OPS_HALF(X)                                                                  \
  X(reshape) X(permute) X(slice) X(slice_grad) X(broadcast_to) X(contiguous) X(fill)         \
  X(sum_to) X(cast) X(add) X(sub) X(mul) X(div) X(act_grad) X(sum) X(max) X(max_grad)        \
  X(matmul) X(out_prod) X(softmax) X(softmax_back) X(log_softmax) X(log_softmax_back)       \
  X(rms_norm) X(rms_norm_back) X(layer_norm) X(layer_norm_back) X(get_rows) X(get_rows_back) \
  X(concat) X(pad) X(cumsum)
/* ... and every unary op (RECURRA_UNARY_MATHS, RECURRA_ACTIVATIONS) without being listed. */

/* Ops that compute in float32 but read 2-byte float sources as they are (each value converted
 * exactly to float32 where the kernel loads it, so a cast before them would change nothing):
 * their float sources may mix float32, bfloat16 and float16, their output is float32
 * (cross_entropy_back: its logits' dtype, the gradient's; gated_rms_norm: the dtype its
 * RECURRA_P_OUT_DTYPE asks for, which a product after it wants; causal_conv_silu: its
 * RECURRA_P_CONV_OUT_DTYPE's, the autocast dtype the scan reads; rounded once on store). A gradient
 * they give a 2-byte source is cast to its dtype (build_backward), as the gradient of the
 * up-cast they replace was. A backend that has no kernel for a mix refuses the node; its
 * decomposition (gated_rms_norm, causal_conv_silu) then widens the 2-byte sources first. */
#define RECURRA_OPS_HALF_IN(X)                                                              \
  X(gated_rms_norm) X(gated_rms_norm_back) X(causal_conv_silu) X(causal_conv_silu_back)     \
  X(ssm_scan) X(ssm_scan_back) X(cross_entropy) X(cross_entropy_back)

/* The autocast policy (recurra.autocast, docs/ops.md "Mixed precision"): how the frontend
 * casts a node's float sources inside an autocast region. RECURRA_AUTOCAST_LOWER: to the
 * autocast dtype (the ops whose cost is a matmul). RECURRA_AUTOCAST_FLOAT32: 2-byte sources
 * up to float32 (numerically sensitive; so are all ops outside RECURRA_OPS_HALF).
 * RECURRA_AUTOCAST_KEEP: never cast (explicit dtypes, in-place updates). RECURRA_OPS_HALF_IN
 * (class "widen"): sources left as they are, the kernel reads 2-byte ones and computes in
 * float32 (no up-cast node before it). Every other op of
 * RECURRA_OPS_HALF and every unary op not listed: float32 sources cast to the autocast dtype
 * when another float source is 2-byte, else left as they are. */
#define RECURRA_AUTOCAST_LOWER(X) X(matmul) X(out_prod)
#define RECURRA_AUTOCAST_FLOAT32(X)                                                          \
  X(softmax) X(softmax_back) X(log_softmax) X(log_softmax_back) X(rms_norm) X(rms_norm_back) \
  X(layer_norm) X(layer_norm_back) X(sum) X(cumsum) X(exp) X(log) X(softplus)
#define RECURRA_AUTOCAST_KEEP(X)                                                             \
  X(cast) X(fill) X(assign) X(sgd_step) X(adam_step) X(adamw_step) X(lion_step) X(grad_norm) \
  X(grad_clip)

/* The spec as a table, in RECURRA_OPS order; *count gets its length. */
#define RECURRA_OP_SPEC_ROW_(name, s0, s1, i0, i1, f0, f1, un, srcs, ip, fp, out, bw, dec) \
  {#name, s0, s1, i0, i1, f0, f1, un, srcs, ip, fp, out, bw, dec},
static inline const recurra_op_spec* recurra_op_specs(int32_t* count) {
  static const recurra_op_spec table[] = {RECURRA_OPS(RECURRA_OP_SPEC_ROW_)};
  *count = (int32_t)(sizeof table / sizeof table[0]);
  return table;
}

/* The spec of op `name` (name not NULL), else of the elementwise unary op of code `unary`
 * (RECURRA_UNARY_*); NULL when there is none. */
static inline const recurra_op_spec* recurra_op_lookup(const char* name, int64_t unary) {
  int32_t n = 0, i;
  const recurra_op_spec* t = recurra_op_specs(&n);
  for (i = 0; i < n; ++i) {
    const char *a = t[i].name, *b = name;
    if (!name) {
      if (t[i].unary >= 0 && t[i].unary == unary) return &t[i];
      continue;
    }
    while (*a && *a == *b) ++a, ++b;
    if (*a == *b) return &t[i];
  }
  return (const recurra_op_spec*)0;
}

static inline const recurra_op_spec* recurra_op_find(const char* name) {
  return name ? recurra_op_lookup(name, -1) : (const recurra_op_spec*)0;
}

static inline const recurra_op_spec* recurra_unary_op(int64_t code) {
  return recurra_op_lookup((const char*)0, code);
}

/* Whether op `name` takes bfloat16 and float16 sources: a unary op, or one of
 * RECURRA_OPS_HALF. */
#define RECURRA_OP_HALF_NAME_(name) #name,
static inline int recurra_op_takes_half(const char* name) {
  static const char* const ops[] = {RECURRA_OPS_HALF(RECURRA_OP_HALF_NAME_)};
  const recurra_op_spec* spec = recurra_op_find(name);
  size_t i;
  if (spec && spec->unary >= 0) return 1;
  for (i = 0; name && i < sizeof ops / sizeof ops[0]; ++i) {
    const char *a = ops[i], *b = name;
    while (*a && *a == *b) ++a, ++b;
    if (*a == *b) return 1;
  }
  return 0;
}

/* Whether `name` is one of the n names of `list`. */
static inline int recurra_name_in_(const char* name, const char* const* list, size_t n) {
  size_t i;
  for (i = 0; name && i < n; ++i) {
    const char *a = list[i], *b = name;
    while (*a && *a == *b) ++a, ++b;
    if (*a == *b) return 1;
  }
  return 0;
}

/* Whether op `name` reads 2-byte float sources mixed with float32 ones (RECURRA_OPS_HALF_IN). */
static inline int recurra_op_takes_half_in(const char* name) {
  static const char* const ops[] = {RECURRA_OPS_HALF_IN(RECURRA_OP_HALF_NAME_)};
  return recurra_name_in_(name, ops, sizeof ops / sizeof ops[0]);
}
/* The autocast class of op `name`: "lower", "float32", "widen", "keep" or "match" (see
 * RECURRA_AUTOCAST_LOWER above). */
static inline const char* recurra_op_autocast(const char* name) {
  static const char* const lower[] = {RECURRA_AUTOCAST_LOWER(RECURRA_OP_HALF_NAME_)};
  static const char* const f32[] = {RECURRA_AUTOCAST_FLOAT32(RECURRA_OP_HALF_NAME_)};
  static const char* const keep[] = {RECURRA_AUTOCAST_KEEP(RECURRA_OP_HALF_NAME_)};
  if (recurra_name_in_(name, keep, sizeof keep / sizeof keep[0])) return "keep";
  if (recurra_op_takes_half_in(name)) return "widen";
  if (recurra_name_in_(name, lower, sizeof lower / sizeof lower[0])) return "lower";
  if (!recurra_op_takes_half(name) || recurra_name_in_(name, f32, sizeof f32 / sizeof f32[0]))
    return "float32";
  return "match";
}

#ifdef __cplusplus
}
#endif

#endif /* RECURRA_GLSL */

#endif /* RECURRA_OP_SPEC_H */

"""Float64 numpy references of rwkv_wkv6, rwkv_wkv7 and gated_linear_attn (docs/ops.md).

Plain token-by-token loops over the formulas, sharing nothing with the kernels they check.
Shapes are numpy order: per-token inputs (T, H, S), states (n_seqs, H, S, S); the T tokens
are n_seqs runs of T // n_seqs tokens, run q starting from state[q]. Each function returns
(y, final_states) in float64.
"""

from __future__ import annotations

import numpy as np

Array = np.ndarray


def _f64(*arrays: Array) -> list[Array]:
    return [np.asarray(a, np.float64) for a in arrays]


def rwkv_wkv6_ref(
    k: Array, v: Array, r: Array, tf: Array, td: Array, state: Array
) -> tuple[Array, Array]:
    """y_t[h,j] = sum_i r[h,i] (tf[h,i] k[h,i] v[h,j] + S[h,i,j]); then S = td[h,i] S + k v^T."""
    k, v, r, tf, td, state = _f64(k, v, r, tf, td, state)
    n = k.shape[0] // state.shape[0]
    y = np.zeros_like(k)
    final = state.copy()
    for q in range(state.shape[0]):
        S = state[q].copy()  # (H, key i, value j)
        for t in range(q * n, (q + 1) * n):
            kv = k[t][:, :, None] * v[t][:, None, :]
            y[t] = np.einsum("hi,hij->hj", r[t], tf[:, :, None] * kv + S)
            S = td[t][:, :, None] * S + kv
        final[q] = S
    return y, final


def gated_linear_attn_ref(
    k: Array, v: Array, q: Array, g: Array, state: Array, scale: float
) -> tuple[Array, Array]:
    """S = g[h,i] S + k v^T first, then y_t[h,j] = scale sum_i q[h,i] S[h,i,j]."""
    k, v, q, g, state = _f64(k, v, q, g, state)
    n = k.shape[0] // state.shape[0]
    y = np.zeros_like(k)
    final = state.copy()
    for s in range(state.shape[0]):
        S = state[s].copy()
        for t in range(s * n, (s + 1) * n):
            S = g[t][:, :, None] * S + k[t][:, :, None] * v[t][:, None, :]
            y[t] = scale * np.einsum("hi,hij->hj", q[t], S)
        final[s] = S
    return y, final


def rwkv_wkv7_ref(
    r: Array, w: Array, k: Array, v: Array, a: Array, b: Array, state: Array
) -> tuple[Array, Array]:
    """S = S diag(w) + v k^T + (S a) b^T per head (state [h, value i, key j]); y_t = S r."""
    r, w, k, v, a, b, state = _f64(r, w, k, v, a, b, state)
    n = r.shape[0] // state.shape[0]
    y = np.zeros_like(r)
    final = state.copy()
    for s in range(state.shape[0]):
        S = state[s].copy()
        for t in range(s * n, (s + 1) * n):
            sa = np.einsum("hij,hj->hi", S, a[t])
            S = (
                S * w[t][:, None, :]
                + v[t][:, :, None] * k[t][:, None, :]
                + sa[:, :, None] * b[t][:, None, :]
            )
            y[t] = np.einsum("hij,hj->hi", S, r[t])
        final[s] = S
    return y, final

"""Float64 numpy references of ssm_conv and ssm_scan, written straight from docs/ops.md.

They are deliberately plain loops over the formulas (no scaling tricks, no blocking), so
that they share nothing with the kernels they check.
"""

from __future__ import annotations

import numpy as np


def softplus(z: np.ndarray) -> np.ndarray:
    """softplus(z) = z where z > 20, else log1p(exp(z)) (float64)."""
    z = np.asarray(z, np.float64)
    return np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))


def ssm_conv_ref(sx: np.ndarray, c: np.ndarray) -> np.ndarray:
    """y[s, t, ch] = sum_k sx[s, ch, t + k] * c[ch, k]; returns (n_seqs, n_tok, d_inner)."""
    sx = np.asarray(sx, np.float64)
    c = np.asarray(c, np.float64)
    n_seqs, d_inner, length = sx.shape
    d_conv = c.shape[1]
    n_tok = length - (d_conv - 1)
    y = np.zeros((n_seqs, n_tok, d_inner))
    for k in range(d_conv):
        y += np.transpose(sx[:, :, k : k + n_tok], (0, 2, 1)) * c[:, k]
    return y


def ssm_scan_ref(
    s: np.ndarray,
    x: np.ndarray,
    dt: np.ndarray,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The selective scan of ops.md in float64.

    Returns ``(y, states)``: y with the shape of x, and the final states
    (n_seqs, n_head, head_dim, d_state) in sequence order.
    """
    s, x, dt, A, B, C = (np.asarray(v, np.float64) for v in (s, x, dt, A, B, C))
    n_seqs, n_tok, n_head, head_dim = x.shape
    d_state = s.shape[3]
    n_group = B.shape[2]
    hpg = n_head // n_group
    y = np.zeros_like(x)
    states = np.zeros((n_seqs, n_head, head_dim, d_state))
    for i in range(n_seqs):
        S = s[int(ids[i])].copy()  # (n_head, head_dim, d_state)
        for t in range(n_tok):
            for h in range(n_head):
                g = h // hpg
                dtp = softplus(dt[i, t, h])
                a = np.exp(dtp * A[h])  # (d_state,) or (1,)
                S[h] = S[h] * a + np.outer(x[i, t, h] * dtp, B[i, t, g])
                y[i, t, h] = S[h] @ C[i, t, g]
        states[i] = S
    return y, states

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


def ssm_scan_vjp_ref(args: list[np.ndarray], gy: np.ndarray, gs: np.ndarray) -> list[np.ndarray]:
    """Gradients of sum(y * gy) + sum(states * gs) of ssm_scan_ref(*args) in float64, by reverse
    mode over the recurrence S_t = a_t S_{t-1} + (softplus(dt_t) x_t) B_t^T, y_t = S_t C_t
    with every state kept (ids distinct). Returns [ds, dx, ddt, dA, dB, dC], shaped like
    s, x, dt, A, B, C."""
    s, x, dt, A, B, C, gy, gs = (np.asarray(v, np.float64) for v in (*args[:6], gy, gs))
    ids = args[6]
    n_tok, n_head = x.shape[1], x.shape[2]
    n_group, d_state = B.shape[2], B.shape[3]
    grp = np.arange(n_head) // (n_head // n_group)
    dtp = softplus(dt)  # (S, T, H)
    a_hn = np.broadcast_to(A, (n_head, d_state))
    a = np.exp(dtp[..., None] * a_hn)  # (S, T, H, N)
    bh, ch = B[:, :, grp], C[:, :, grp]  # (S, T, H, N)
    u = dtp[..., None] * x  # (S, T, H, P)
    states = [s[np.asarray(ids, np.int64)]]
    for t in range(n_tok):
        states.append(a[:, t, :, None, :] * states[-1] + u[:, t, :, :, None] * bh[:, t, :, None, :])
    lam = gs.copy()  # dL/dS_t
    dx, ddtp = np.zeros_like(x), np.zeros_like(dt)
    dah, dbh, dch = np.zeros(a.shape[:1] + a.shape[2:]), np.zeros_like(bh), np.zeros_like(ch)
    for t in reversed(range(n_tok)):
        lam = lam + gy[:, t, :, :, None] * ch[:, t, :, None, :]
        dch[:, t] = np.einsum("shp,shpn->shn", gy[:, t], states[t + 1])
        dbh[:, t] = np.einsum("shp,shpn->shn", u[:, t], lam)
        du = np.einsum("shpn,shn->shp", lam, bh[:, t])
        dx[:, t] = du * dtp[:, t, :, None]
        g = np.einsum("shpn,shpn->shn", lam, states[t]) * a[:, t]  # dL/d log a_t
        ddtp[:, t] = np.einsum("shp,shp->sh", du, x[:, t]) + (g * a_hn).sum(-1)
        dah += g * dtp[:, t, :, None]
        lam = lam * a[:, t, :, None, :]
    ds = np.zeros_like(s)
    ds[np.asarray(ids, np.int64)] = lam
    dA = dah.sum(0) if A.shape[1] > 1 else dah.sum((0, 2))[:, None]
    dB, dC = np.zeros_like(B), np.zeros_like(C)
    for h in range(n_head):
        dB[:, :, grp[h]] += dbh[:, :, h]
        dC[:, :, grp[h]] += dch[:, :, h]
    sig = np.where(dt > 20.0, 1.0, 1.0 / (1.0 + np.exp(-np.minimum(dt, 20.0))))
    return [ds, dx, ddtp * sig, dA, dB, dC]

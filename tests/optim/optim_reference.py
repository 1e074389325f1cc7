"""Independent float64 numpy references of the optimizers (written from the papers' and
PyTorch's documented formulas, not from recurra's kernels), and comparison helpers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

F64 = np.float64


def sgd(
    p0: np.ndarray,
    grads: Sequence[np.ndarray],
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
) -> np.ndarray:
    """PyTorch's SGD: the buffer starts as the first gradient."""
    p = np.asarray(p0, F64).copy()
    buf = None
    for g in grads:
        g = np.asarray(g, F64)
        if maximize:
            g = -g
        g = g + weight_decay * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def adam(
    p0: np.ndarray,
    grads: Sequence[np.ndarray],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    maximize: bool = False,
    start_step: int = 0,
) -> np.ndarray:
    """Adam (L2 decay) or AdamW (decoupled), with bias correction (Kingma & Ba, alg. 1)."""
    b1, b2 = betas
    p = np.asarray(p0, F64).copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, start_step + 1):
        g = np.asarray(g, F64)
        if maximize:
            g = -g
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


def lion(
    p0: np.ndarray,
    grads: Sequence[np.ndarray],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> np.ndarray:
    """Lion (Chen et al. 2023, algorithm 2)."""
    b1, b2 = betas
    p = np.asarray(p0, F64).copy()
    m = np.zeros_like(p)
    for g in grads:
        g = np.asarray(g, F64)
        if maximize:
            g = -g
        c = b1 * m + (1 - b1) * g
        p = p * (1 - lr * weight_decay) - lr * np.sign(c)
        m = b2 * m + (1 - b2) * g
    return p


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-5) -> None:
    """Relative agreement: |got - want| <= rtol * (|want| + max|want|*1e-2) elementwise."""
    got = np.asarray(got, F64)
    want = np.asarray(want, F64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = np.abs(want) + 1e-2 * max(float(np.max(np.abs(want))), 1e-30)
    err = np.abs(got - want) / scale
    worst = float(np.max(err)) if err.size else 0.0
    assert worst <= rtol, f"max relative error {worst:.3g} > {rtol:g}"

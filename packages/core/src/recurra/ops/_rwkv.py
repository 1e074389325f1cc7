"""RWKV's sequence-mixing operators: RWKV-6 and RWKV-7 time mixing, and gated linear attention.

Semantics (shapes in numpy order) are those of ``docs/ops.md`` (one section per op) and of ggml's
GGML_OP_RWKV_WKV6, GGML_OP_RWKV_WKV7 and GGML_OP_GATED_LINEAR_ATTN. The per-token inputs are
(T, H, S): T tokens of H heads of size S, made of ``n_seqs`` runs of ``T // n_seqs`` tokens,
run q starting from ``state[q]`` of the (n_seqs, H, S, S) state. Each op returns
``(y, state)``: y (T, H, S) and the final state of every run (n_seqs, H, S, S), both
differentiable in every input, the initial state included.
"""

from __future__ import annotations

import typing
from typing import Any

import numpy as np

from recurra.ops import _exports
from recurra.ops._apply import apply_multi


def _shape_of(v: Any) -> tuple[int, ...]:
    shape = getattr(v, "shape", None)
    return tuple(int(d) for d in (shape if shape is not None else np.shape(v)))


def _result_shapes(x: Any, state: Any) -> list[tuple[int, ...]]:
    # Malformed shapes are reported by the op itself (ValueError naming all shapes); here
    # they only must not fail first.
    xs, ss = _shape_of(x), _shape_of(state)
    n_seqs = ss[0] if ss else 1
    return [xs, (n_seqs, *xs[1:], *xs[2:])]


def rwkv_wkv6(k: Any, v: Any, r: Any, tf: Any, td: Any, state: Any) -> tuple[Any, Any]:
    """RWKV-6 time mixing.

    ``k``, ``v``, ``r``, ``td`` are (T, H, S), ``tf`` (the bonus u) is (H, S), ``state`` is
    (n_seqs, H, S, S) indexed [h, key i, value j]; ``td`` is the decay factor itself. Per token:
    ``y[h, j] = sum_i r[h, i] (tf[h, i] k[h, i] v[h, j] + S[h, i, j])``, then
    ``S[h, i, j] = td[h, i] S[h, i, j] + k[h, i] v[h, j]``.

    Returns ``(y, state)``: y (T, H, S) and the final states (n_seqs, H, S, S).
    Raises ValueError for inconsistent shapes (T not a multiple of n_seqs included) and
    TypeError for non-float inputs.
    """
    y, s = apply_multi("rwkv_wkv6", [k, v, r, tf, td, state], _result_shapes(k, state))
    return y, s


def rwkv_wkv7(r: Any, w: Any, k: Any, v: Any, a: Any, b: Any, state: Any) -> tuple[Any, Any]:
    """RWKV-7 time mixing.

    ``r``, ``w``, ``k``, ``v``, ``a``, ``b`` are (T, H, S); ``state`` is (n_seqs, H, S, S)
    indexed [h, value i, key j]. Per token and head, with ``sa = S a``:
    ``S = S diag(w) + v k^T + sa b^T``, then ``y = S r``.

    Returns ``(y, state)``: y (T, H, S) and the final states (n_seqs, H, S, S).
    Raises ValueError for inconsistent shapes and TypeError for non-float inputs.
    """
    y, s = apply_multi("rwkv_wkv7", [r, w, k, v, a, b, state], _result_shapes(r, state))
    return y, s


def gated_linear_attn(k: Any, v: Any, q: Any, g: Any, state: Any, scale: float) -> tuple[Any, Any]:
    """Gated linear attention (GLA).

    ``k``, ``v``, ``q``, ``g`` are (T, H, S); ``state`` is (n_seqs, H, S, S) indexed
    [h, key i, value j]. Per token the state is updated first,
    ``S[h, i, j] = g[h, i] S[h, i, j] + k[h, i] v[h, j]``, then read:
    ``y[h, j] = scale * sum_i q[h, i] S[h, i, j]``.

    Returns ``(y, state)``: y (T, H, S) and the final states (n_seqs, H, S, S).
    Raises ValueError for inconsistent shapes and TypeError for non-float inputs.
    """
    y, s = apply_multi(
        "gated_linear_attn", [k, v, q, g, state], _result_shapes(k, state), fp=(float(scale),)
    )
    return y, s


if not typing.TYPE_CHECKING:  # mypy reads the public names from the module itself
    __all__ = _exports.public_names(globals())

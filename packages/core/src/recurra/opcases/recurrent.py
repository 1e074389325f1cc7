"""Cases of the recurrent ops: ssm_conv, ssm_scan (Mamba-1/2 layouts), rwkv_wkv6,
rwkv_wkv7 and gated_linear_attn, in the ranges the models use."""

from __future__ import annotations

from typing import Any

import numpy as np

from recurra import ops
from recurra.opcases._case import OpCase, f32, normal, uniform


def _conv_inputs(n_seqs: int, d_inner: int, d_conv: int, n_tok: int) -> Any:
    return lambda rng: {
        "sx": normal(rng, n_seqs, d_inner, d_conv - 1 + n_tok),
        "c": normal(rng, d_inner, d_conv, scale=0.5),
    }


def _scan_inputs(
    n_seqs: int, n_tok: int, n_head: int, head_dim: int, d_state: int, n_group: int, per_state: bool
) -> Any:
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        n_rows = n_seqs + 1  # one state row that no sequence reads: its gradient is 0
        return {
            "s": normal(rng, n_rows, n_head, head_dim, d_state),
            "x": normal(rng, n_seqs, n_tok, n_head, head_dim),
            "dt": f32(rng.standard_normal((n_seqs, n_tok, n_head)) - 1.0),
            "A": f32(-np.exp(rng.uniform(-1.0, 1.5, (n_head, d_state if per_state else 1)))),
            "B": normal(rng, n_seqs, n_tok, n_group, d_state),
            "C": normal(rng, n_seqs, n_tok, n_group, d_state),
            "ids": rng.permutation(n_rows)[:n_seqs].astype(np.int32),
        }

    return make


def _wkv_inputs(kind: str, T: int, H: int, S: int, n_seqs: int) -> Any:
    """Inputs in the op's argument order, in the ranges the models use (decays in (0.5, 1))."""

    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        def x() -> np.ndarray:
            return normal(rng, T, H, S, scale=0.5)

        def decay() -> np.ndarray:
            return uniform(rng, 0.5, 0.99, T, H, S)

        state = normal(rng, n_seqs, H, S, S, scale=0.5)
        if kind == "rwkv_wkv6":
            return {
                "k": x(),
                "v": x(),
                "r": x(),
                "tf": normal(rng, H, S, scale=0.5),
                "td": decay(),
                "state": state,
            }
        if kind == "gated_linear_attn":
            return {"k": x(), "v": x(), "q": x(), "g": decay(), "state": state}
        # RWKV-7: a = -kk, b = kk * gate with kk L2-normalised per head, as in the model.
        kk = rng.standard_normal((T, H, S))
        kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
        gate = rng.uniform(0.0, 1.0, (T, H, S))
        return {
            "r": x(),
            "w": decay(),
            "k": x(),
            "v": x(),
            "a": f32(-kk),
            "b": f32(kk * gate),
            "state": state,
        }

    return make


def cases() -> list[OpCase]:
    out = [
        OpCase("ssm_conv", "d_conv4", _conv_inputs(2, 5, 4, 7), ops.ssm_conv),
        OpCase("ssm_conv", "odd_d_conv3", _conv_inputs(3, 7, 3, 5), ops.ssm_conv),
        # n_seqs, n_tok, n_head, head_dim, d_state, n_group, per_state (see docs/ops.md)
        OpCase(
            "ssm_scan",
            "mamba1",
            _scan_inputs(2, 5, 6, 1, 16, 1, True),
            ops.ssm_scan,
            note="Mamba-1 layout: head_dim 1, one decay per state, d_state 16",
        ),
        OpCase(
            "ssm_scan",
            "mamba2",
            _scan_inputs(2, 6, 4, 8, 16, 2, False),
            ops.ssm_scan,
            note="Mamba-2 layout: 4 heads of 8, one decay per head, 2 groups",
        ),
        OpCase("ssm_scan", "odd_sizes", _scan_inputs(3, 4, 3, 5, 17, 3, False), ops.ssm_scan),
    ]
    for kind, fn in (
        ("rwkv_wkv6", ops.rwkv_wkv6),
        ("rwkv_wkv7", ops.rwkv_wkv7),
        ("gated_linear_attn", lambda k, v, q, g, s: ops.gated_linear_attn(k, v, q, g, s, 0.7)),
    ):
        out.append(OpCase(kind, "T8_H2_S8_2seqs", _wkv_inputs(kind, 8, 2, 8, 2), fn))
        out.append(OpCase(kind, "T6_H3_S5_3seqs", _wkv_inputs(kind, 6, 3, 5, 3), fn))
    return out

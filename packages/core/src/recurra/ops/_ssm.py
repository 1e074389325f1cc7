"""Mamba's sequence-mixing operators: the depthwise causal convolution and the selective scan.

Semantics (shapes in numpy order) are those of ``docs/ops.md`` (sections "ssm_conv" and
"ssm_scan") and of ggml's GGML_OP_SSM_CONV and GGML_OP_SSM_SCAN; both ops are
differentiable in every float input.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from recurra._tensor import is_grad_enabled
from recurra.ops._apply import all_on_cpu, apply, apply_multi

__all__ = ["ssm_conv", "ssm_scan"]


def _shape_of(v: Any) -> tuple[int, ...]:
    shape = getattr(v, "shape", None)
    return tuple(int(d) for d in (shape if shape is not None else np.shape(v)))


def ssm_conv(sx: Any, c: Any) -> Any:
    """Mamba's depthwise causal convolution (a correlation, no bias, no activation).

    ``sx`` is (n_seqs, d_inner, d_conv - 1 + n_tok), the d_conv - 1 positions of left
    context first; ``c`` is (d_inner, d_conv). Returns y of shape (n_seqs, n_tok, d_inner)
    with ``y[s, t, ch] = sum_k sx[s, ch, t + k] * c[ch, k]``.

    Raises ValueError for inconsistent shapes and TypeError for non-float inputs.
    """
    return apply("ssm_conv", [sx, c])


def ssm_scan(s: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, ids: Any) -> tuple[Any, Any]:
    """Mamba's selective scan (Mamba-1 and Mamba-2).

    Shapes: ``s`` (n_rows, n_head, head_dim, d_state) initial states; ``x`` (n_seqs, n_tok,
    n_head, head_dim); ``dt`` (n_seqs, n_tok, n_head) raw step sizes (softplus is applied
    inside); ``A`` (n_head, d_state) or (n_head, 1); ``B``, ``C`` (n_seqs, n_tok, n_group,
    d_state); ``ids`` (n_seqs,) integers: sequence i starts from ``s[ids[i]]``. ``ids`` may
    be a numpy integer array, a list, or an int32 tensor.

    Returns ``(y, state)``: y with the shape of x, and the final state of each sequence,
    (n_seqs, n_head, head_dim, d_state), in sequence order. Both are differentiable.

    Raises ValueError for inconsistent shapes or ids outside [0, n_rows) (the latter when
    the graph runs), TypeError for non-float inputs or non-integer ids.
    """
    if getattr(ids, "_frontend", None) is None:
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"ssm_scan: ids must be integers, got dtype {arr.dtype}")
        ids = arr
    xs, ss = _shape_of(x), _shape_of(s)
    n_seqs = xs[0] if xs else 0
    state_shape = (n_seqs, *ss[1:4])
    shapes = [xs, state_shape]
    ckpt = _checkpoint_floats(xs, ss, [s, x, dt, A, B, C])
    if ckpt:  # the forward also saves the backward's checkpoints (cut off here)
        shapes.append((ckpt,))
    y, state, *_ = apply_multi(
        "ssm_scan", [s, x, dt, A, B, C, ids], shapes=shapes, ip=(1,) if ckpt else ()
    )
    return y, state


def _checkpoint_floats(xs: tuple[int, ...], ss: tuple[int, ...], srcs: list[Any]) -> int:
    """How many floats of checkpoints the forward should save for the backward (0: none),
    when a gradient will be taken:

    - Mamba-1 (head_dim 1) with every input on the CPU: the CPU backward then reads the
      states every K tokens instead of recomputing them; saved as (n_seqs, n_seg, n_head,
      d_state), K = max(32, ceil(T / 64)).
    - one decay per head (Mamba-2, A of shape (n_head, 1)) with an input on another device:
      the chunked backward of the Vulkan backend then reads the state entering each
      64-token chunk instead of recomputing it; saved as (n_seqs, n_head, ceil(T / 64),
      head_dim, d_state). (The CPU kernels write the same when the node runs there.)"""
    if len(xs) != 4 or len(ss) != 4 or xs[1] == 0:
        return 0
    if not is_grad_enabled() or not any(getattr(t, "requires_grad", False) for t in srcs):
        return 0
    on_cpu = all_on_cpu(srcs)
    n_seqs, n_tok, n_head, head_dim = xs
    if head_dim == 1:
        if not on_cpu:
            return 0
        seg = max(32, (n_tok + 63) // 64)
        return n_seqs * (-(-n_tok // seg)) * n_head * ss[3]
    if on_cpu:
        return 0
    a_shape = _shape_of(srcs[3])
    if len(a_shape) != 2 or a_shape[1] != 1:
        return 0
    return n_seqs * n_head * (-(-n_tok // 64)) * head_dim * ss[3]

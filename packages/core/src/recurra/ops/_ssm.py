"""Mamba's sequence-mixing operators: the depthwise causal convolution and the selective scan.

Semantics (shapes in numpy order) are those of ``docs/ops.md`` (sections "ssm_conv" and
"ssm_scan") and of ggml's GGML_OP_SSM_CONV and GGML_OP_SSM_SCAN; both ops are
differentiable in every float input.
"""

from __future__ import annotations

import typing
from typing import Any

import numpy as np

from recurra import _autocast
from recurra._tensor import is_grad_enabled
from recurra.ops import _exports
from recurra.ops._apply import apply, apply_multi
from recurra.ops._spec import op_codes


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


def ssm_scan(
    s: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, ids: Any, *, checkpoints: bool | None = None
) -> tuple[Any, Any]:
    """Mamba's selective scan (Mamba-1 and Mamba-2).

    Shapes: ``s`` (n_rows, n_head, head_dim, d_state) initial states; ``x`` (n_seqs, n_tok,
    n_head, head_dim); ``dt`` (n_seqs, n_tok, n_head) raw step sizes (softplus is applied
    inside); ``A`` (n_head, d_state) or (n_head, 1); ``B``, ``C`` (n_seqs, n_tok, n_group,
    d_state); ``ids`` (n_seqs,) integers: sequence i starts from ``s[ids[i]]``. ``ids`` may
    be a numpy integer array, a list, or an int32 tensor.

    Returns ``(y, state)``: y with the shape of x, and the final state of each sequence,
    (n_seqs, n_head, head_dim, d_state), in sequence order. Both are differentiable.

    ``checkpoints``: whether a forward followed by a gradient saves the states its backward
    reads where the backend placing it takes them (head_dim 1, and on a device one decay per
    head: the state entering each 64-token chunk, S*H*P*N floats per chunk, 50 MB per
    Mamba2-130m layer at 8 x 512 tokens). ``None`` (default): saved, except for one decay
    per head under :class:`recurra.autocast`, where the chunked backward recomputes them
    from the kept inputs instead (its chunk-state pass, as mamba-ssm's chunked scan does),
    so that a mixed-precision step keeps no float32 states. ``False`` never saves them
    (the backward recomputes); ``True`` saves them where they apply.

    Raises ValueError for inconsistent shapes or ids outside [0, n_rows) (the latter when
    the graph runs), TypeError for non-float inputs or non-integer ids.
    """
    if getattr(ids, "_frontend", None) is None:
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"ssm_scan: ids must be integers, got dtype {arr.dtype}")
        ids = arr
    srcs = [s, x, dt, A, B, C, ids]
    xs, ss = _shape_of(x), _shape_of(s)
    n_seqs = xs[0] if xs else 0
    shapes = [xs, (n_seqs, *ss[1:4])]
    # Asks for the backward's checkpoints when a gradient will be taken; the core saves them
    # where the backend placing the scan reads them. They follow y and the states in the
    # packed result (cut off here).
    save = checkpoints is not False and _wants_checkpoints(xs, ss, A, srcs)
    if save and checkpoints is None and xs[3] != 1 and _autocast.STATE.dtype is not None:
        save = False  # one decay per head under autocast: recomputed (see the docstring)
    flags = (op_codes()["SSM_SCAN_CHECKPOINTS_AUTO"],) if save else ()
    y, state, *_ = apply_multi("ssm_scan", srcs, shapes=shapes, ip=flags, tail=True)
    return y, state


def _wants_checkpoints(xs: tuple[int, ...], ss: tuple[int, ...], A: Any, srcs: list[Any]) -> bool:
    """Whether the forward should save checkpoints for the backward: when a gradient will be
    taken, for the layouts that have them (head_dim 1, Mamba-1: the states every K tokens;
    one decay per head, Mamba-2: the state entering each 64-token chunk)."""
    if len(xs) != 4 or len(ss) != 4 or xs[1] == 0:
        return False
    if not is_grad_enabled() or not any(getattr(t, "requires_grad", False) for t in srcs[:6]):
        return False
    a_shape = _shape_of(A)
    return xs[3] == 1 or (len(a_shape) == 2 and a_shape[1] == 1)


if not typing.TYPE_CHECKING:  # mypy reads the public names from the module itself
    __all__ = _exports.public_names(globals())

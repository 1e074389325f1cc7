"""Neural-net ops: softmax, log_softmax, losses, normalisations, the embedding lookup."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

from recurra.ops import _exports
from recurra.ops._apply import apply, coerce


def _reshape(x: Any, shape: Sequence[int]) -> Any:
    shape = tuple(int(s) for s in shape)
    return x if tuple(x.shape) == shape else apply("reshape", [x], ip=shape)


def _along_axis(name: str, x: Any, axis: int, fp: Sequence[float] = ()) -> Any:
    """Runs last-axis op ``name`` along ``axis``: a swap of that axis with the last one
    (a view; the op makes it dense) around the op, and the swap back."""
    _, (x,) = coerce([x])
    nd = x.ndim
    if nd == 0 and axis in (0, -1):
        return apply(name, [x], fp=fp)
    if not -nd <= axis < nd:
        raise ValueError(f"{name}: axis {axis} is out of range for a tensor of {nd} axes")
    axis %= nd
    if axis == nd - 1:
        return apply(name, [x], fp=fp)
    perm = list(range(nd))
    perm[axis], perm[-1] = perm[-1], perm[axis]  # a swap is its own inverse
    y = apply(name, [apply("permute", [x], ip=perm)], fp=fp)
    return apply("permute", [y], ip=perm)


def softmax(x: Any, axis: int = -1) -> Any:
    """exp(x) / sum(exp(x)) along ``axis`` (numerically stable: the row maximum is
    subtracted first).

    Returns a float32 tensor of x's shape. Raises ValueError for an axis out of range and
    TypeError for a non-float32 x.
    """
    return _along_axis("softmax", x, axis)


def log_softmax(x: Any, axis: int = -1) -> Any:
    """x - log(sum(exp(x))) along ``axis`` (stable, computed without forming softmax).

    Returns a float32 tensor of x's shape. Raises ValueError for an axis out of range and
    TypeError for a non-float32 x.
    """
    return _along_axis("log_softmax", x, axis)


def cross_entropy(logits: Any, targets: Any) -> Any:
    """The mean over all rows of -log_softmax(logits)[target]: the classification loss.

    ``logits`` has shape (..., C) and ``targets`` the shape (...) with int32 class indices
    in [0, C). Returns a 0-d float32 tensor; its gradient flows into the logits only.
    Raises TypeError when the targets are not int32 (or the logits not float32), ValueError
    for mismatched shapes, and ValueError when the graph runs with a target outside [0, C).
    """
    _, (logits, targets) = coerce([logits, targets])
    if targets.dtype != "int32":
        raise TypeError(f"cross_entropy: targets must be int32 class indices, got {targets.dtype}")
    if logits.ndim < 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"cross_entropy: logits (..., C) need targets of shape (...); got logits "
            f"{tuple(logits.shape)} and targets {tuple(targets.shape)}"
        )
    c = logits.shape[-1]
    n = logits.size // c if c else targets.size
    return apply("cross_entropy", [_reshape(logits, (n, c)), _reshape(targets, (n,))])


def mse_loss(a: Any, b: Any) -> Any:
    """The mean of (a - b)**2 over all elements (a and b broadcast like numpy).

    Returns a 0-d float32 tensor. Raises ValueError when the shapes do not broadcast.
    """
    from recurra.ops._reduce import mean  # another area; imported when first needed

    return mean(apply("sqr", [apply("sub", [a, b])]))


def _out_dtype_ip(dtype: Any) -> tuple[int, ...]:
    """The optional output-dtype parameter (gated_rms_norm's RECURRA_P_OUT_DTYPE,
    causal_conv_silu's RECURRA_P_CONV_OUT_DTYPE) for ``dtype`` (None: none)."""
    if dtype is None:
        return ()
    from recurra._dtype import as_dtype

    return (as_dtype(dtype).code,)


def rms_norm(x: Any, eps: float = 1e-6, weight: Any = None, dtype: Any = None) -> Any:
    """x / sqrt(mean(x**2) + eps) along the last axis, times ``weight`` (C,) when given.

    With a weight this is one op, gated_rms_norm without a gate (the norm, the product and,
    backward, the weight's gradient in one pass where the backend has the fused kernel;
    elsewhere the scheduler builds rms_norm then mul). Returns a float32 tensor of x's
    shape; with a weight and ``dtype`` (e.g. ``recurra.autocast_dtype()`` before a product)
    one of that dtype, the float32 result rounded once by the op (no cast node after it).
    Raises ValueError for a negative eps or a weight that is not (C,).
    """
    if weight is None:
        return apply("rms_norm", [x], fp=(float(eps),))
    _, srcs = coerce([x, weight])
    if srcs[0].ndim:
        ip = (int(srcs[0].shape[-1]), *_out_dtype_ip(dtype))
        return apply("gated_rms_norm", srcs, ip=ip, fp=(float(eps),))
    from recurra.ops._elementwise import mul

    out = mul(apply("rms_norm", [srcs[0]], fp=(float(eps),)), srcs[1])
    return out if dtype is None else out.to(dtype)


def gated_rms_norm(
    y: Any,
    z: Any,
    weight: Any,
    eps: float = 1e-5,
    group_size: int | None = None,
    x: Any = None,
    d: Any = None,
    dtype: Any = None,
) -> Any:
    """Mamba-2's gated output norm: ``h = (y + x * d) * silu(z)``, then
    ``h / sqrt(mean(h**2) + eps) * weight`` with the mean over groups of ``group_size``
    channels of the last axis (default: all of it).

    ``y``, ``z`` (and ``x``) have one shape (..., C); ``weight`` is (C,); ``d`` is (H,) with
    H dividing C, one value per block of C / H channels (the D skip of Mamba-2; give both
    ``x`` and ``d`` or neither). One op: one pass forward and one backward where the backend
    has the fused kernel; elsewhere the scheduler builds it from elementwise ops and
    rms_norm, with the same result. Returns a float32 tensor of y's shape, or one of
    ``dtype`` when given (the float32 result rounded once by the op: what a product after
    it takes under autocast, without a cast node). Raises ValueError
    for mismatched shapes, a group size that does not divide C, or only one of x and d;
    TypeError for non-float32 inputs.
    """
    if (x is None) != (d is None):
        raise ValueError("gated_rms_norm: give both x and d (the D skip) or neither")
    _, srcs = coerce([y, z, weight] if x is None else [y, z, weight, x, d])
    c = int(srcs[0].shape[-1]) if srcs[0].ndim else 0
    gs = c if group_size is None else int(group_size)
    return apply("gated_rms_norm", srcs, ip=(gs, *_out_dtype_ip(dtype)), fp=(float(eps),))


def causal_conv_silu(x: Any, weight: Any, bias: Any = None, dtype: Any = None) -> Any:
    """Mamba's depthwise causal convolution over time followed by SiLU, from zeros (no
    carried state): ``y[s, t, ch] = silu(bias[ch] + sum_k x[s, t - K + 1 + k, ch] *
    weight[ch, k])`` with x = 0 before t = 0.

    ``x`` is (n_seqs, n_tok, channels) (a slice of a wider projection is read in place),
    ``weight`` (channels, K), ``bias`` (channels,) or None. One op (no transposed or padded
    copies where the backend has the fused kernel; elsewhere the scheduler builds pad +
    ssm_conv + bias + silu, with the same result). Returns a float32 tensor of x's shape;
    with ``dtype`` (e.g. ``recurra.autocast_dtype()``) one of that dtype, the float32 result
    rounded once by the op (no cast node after it). Raises ValueError for inconsistent
    shapes, TypeError for non-float inputs or a dtype that is not a float dtype.
    """
    _, srcs = coerce([x, weight] if bias is None else [x, weight, bias])
    return apply("causal_conv_silu", srcs, ip=_out_dtype_ip(dtype))


def layer_norm(x: Any, eps: float = 1e-5) -> Any:
    """(x - mean) / sqrt(var + eps) along the last axis, with the biased variance and no
    affine part.

    Returns a float32 tensor of x's shape. Raises ValueError for a negative eps.
    """
    return apply("layer_norm", [x], fp=(float(eps),))


def get_rows(table: Any, idx: Any) -> Any:
    """Rows of ``table`` (V, D) picked by int32 indices ``idx`` (0 to 3 axes): the embedding
    lookup ``table[idx]``.

    Returns a float32 tensor of shape ``idx.shape + (D,)``; its gradient flows into the
    table (rows picked several times get the sum). Raises TypeError for non-int32 indices,
    ValueError for a table that is not 2-D, and ValueError when the graph runs with an index
    outside [0, V).
    """
    _, (table, idx) = coerce([table, idx])
    if idx.dtype != "int32":
        raise TypeError(f"get_rows: indices must be int32, got {idx.dtype}")
    if idx.ndim == 0:
        rows = apply("get_rows", [table, _reshape(idx, (1,))])
        return _reshape(rows, rows.shape[1:])
    return apply("get_rows", [table, idx])


if not typing.TYPE_CHECKING:  # mypy reads the public names from the module itself
    __all__ = _exports.public_names(globals())

"""Neural-net ops: softmax, log_softmax, losses, normalisations, the embedding lookup."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from recurra.ops._apply import all_on_cpu, apply, coerce

__all__ = [
    "softmax",
    "log_softmax",
    "cross_entropy",
    "mse_loss",
    "rms_norm",
    "gated_rms_norm",
    "causal_conv_silu",
    "layer_norm",
    "get_rows",
]


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


def rms_norm(x: Any, eps: float = 1e-6, weight: Any = None) -> Any:
    """x / sqrt(mean(x**2) + eps) along the last axis, times ``weight`` (C,) when given.

    With a weight on the CPU this is one fused op (the norm, the product and, backward, the
    weight's gradient in one pass); elsewhere rms_norm then mul. Returns a float32 tensor of
    x's shape. Raises ValueError for a negative eps or a weight that is not (C,).
    """
    if weight is None:
        return apply("rms_norm", [x], fp=(float(eps),))
    _, srcs = coerce([x, weight])
    if all_on_cpu(srcs) and srcs[0].ndim:
        return apply("gated_rms_norm", srcs, ip=(int(srcs[0].shape[-1]),), fp=(float(eps),))
    from recurra.ops._elementwise import mul

    return mul(apply("rms_norm", [srcs[0]], fp=(float(eps),)), srcs[1])


def gated_rms_norm(
    y: Any,
    z: Any,
    weight: Any,
    eps: float = 1e-5,
    group_size: int | None = None,
    x: Any = None,
    d: Any = None,
) -> Any:
    """Mamba-2's gated output norm: ``h = (y + x * d) * silu(z)``, then
    ``h / sqrt(mean(h**2) + eps) * weight`` with the mean over groups of ``group_size``
    channels of the last axis (default: all of it).

    ``y``, ``z`` (and ``x``) have one shape (..., C); ``weight`` is (C,); ``d`` is (H,) with
    H dividing C, one value per block of C / H channels (the D skip of Mamba-2; give both
    ``x`` and ``d`` or neither). On the CPU this is one fused op (one pass forward and one
    backward); elsewhere it is built from elementwise ops and rms_norm, with the same result.
    Returns a float32 tensor of y's shape. Raises ValueError for mismatched shapes, a group
    size that does not divide C, or only one of x and d; TypeError for non-float32 inputs.
    """
    if (x is None) != (d is None):
        raise ValueError("gated_rms_norm: give both x and d (the D skip) or neither")
    _, srcs = coerce([y, z, weight] if x is None else [y, z, weight, x, d])
    y, z, weight = srcs[:3]
    c = int(y.shape[-1]) if y.ndim else 0
    gs = c if group_size is None else int(group_size)
    if all_on_cpu(srcs):
        return apply("gated_rms_norm", srcs, ip=(gs,), fp=(float(eps),))
    return _gated_rms_norm_ops(srcs, eps, gs)


def _gated_rms_norm_ops(srcs: Sequence[Any], eps: float, gs: int) -> Any:
    """gated_rms_norm built from elementwise ops and rms_norm (for device backends, which
    have no fused kernel); srcs as in gated_rms_norm, already coerced."""
    from recurra.ops._elementwise import add, mul, silu

    y, z, weight = srcs[:3]
    c = int(y.shape[-1])
    u = y
    if len(srcs) == 5:
        xs, ds = srcs[3], srcs[4]
        if ds.ndim != 1 or ds.shape[0] < 1 or c % ds.shape[0]:
            raise ValueError(f"gated_rms_norm: d must be (H,) with H dividing {c}")
        heads = (*y.shape[:-1], ds.shape[0], c // ds.shape[0])
        skip = mul(_reshape(xs, heads), _reshape(ds, (ds.shape[0], 1)))
        u = add(y, _reshape(skip, y.shape))
    h = mul(u, silu(z))
    if gs < 1 or c % gs:
        raise ValueError(f"gated_rms_norm: group_size {gs} must divide the channels ({c})")
    if gs != c:
        h = _reshape(rms_norm(_reshape(h, (*y.shape[:-1], c // gs, gs)), eps), y.shape)
    else:
        h = rms_norm(h, eps)
    return mul(h, weight)


def causal_conv_silu(x: Any, weight: Any, bias: Any = None) -> Any:
    """Mamba's depthwise causal convolution over time followed by SiLU, from zeros (no
    carried state): ``y[s, t, ch] = silu(bias[ch] + sum_k x[s, t - K + 1 + k, ch] *
    weight[ch, k])`` with x = 0 before t = 0.

    ``x`` is (n_seqs, n_tok, channels) (a slice of a wider projection is read in place),
    ``weight`` (channels, K), ``bias`` (channels,) or None. On the CPU this is one fused op
    (no transposed or padded copies); elsewhere pad + ssm_conv + bias + silu, with the
    same result. Returns a float32 tensor of x's shape. Raises ValueError for inconsistent
    shapes, TypeError for non-float32 inputs.
    """
    _, srcs = coerce([x, weight] if bias is None else [x, weight, bias])
    if all_on_cpu(srcs):
        return apply("causal_conv_silu", srcs)
    return _causal_conv_silu_ops(srcs)


def _causal_conv_silu_ops(srcs: Sequence[Any]) -> Any:
    """causal_conv_silu built from pad, ssm_conv, add and silu (for device backends);
    srcs as in causal_conv_silu, already coerced."""
    from recurra.ops._elementwise import add, permute, silu
    from recurra.ops._shape import pad
    from recurra.ops._ssm import ssm_conv

    x, weight = srcs[:2]
    if x.ndim != 3 or weight.ndim != 2:
        raise ValueError(
            f"causal_conv_silu: x must be (n_seqs, n_tok, channels) and weight (channels, K), "
            f"got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    k = int(weight.shape[-1])
    y = ssm_conv(pad(permute(x, (0, 2, 1)), ((0, 0), (0, 0), (k - 1, 0))), weight)
    return silu(add(y, srcs[2]) if len(srcs) == 3 else y)


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

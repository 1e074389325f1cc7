"""Shape ops that move data: concat, constant pad, cumulative sum."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

import numpy as np

from recurra.ops import _exports
from recurra.ops._apply import apply, coerce, coerce_one


def _axis(op: str, axis: int, nd: int) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{op}: the axis must be an int, got {type(axis).__name__}")
    if not -nd <= axis < nd:
        raise ValueError(f"{op}: axis {axis} is out of range for a tensor of {nd} axes")
    return int(axis) % nd


def concat(tensors: Sequence[Any], axis: int = 0) -> Any:
    """The tensors joined along ``axis`` (all other axes equal, one dtype).

    Returns a tensor of their dtype; float32 inputs get gradients (slices of the output's
    gradient), int32 ones can be joined but not differentiated. Raises ValueError for an
    empty list or mismatched shapes, TypeError for mixed dtypes.
    """
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        raise TypeError("concat: pass a list or tuple of tensors")
    if len(tensors) == 0:
        raise ValueError("concat: needs at least one tensor")
    _, ts = coerce(list(tensors))
    ax = _axis("concat", axis, ts[0].ndim)
    # Pairwise rounds: each element is copied about log2(len) times, not len times.
    while len(ts) > 1:
        nxt = [apply("concat", [ts[i], ts[i + 1]], ip=(ax,)) for i in range(0, len(ts) - 1, 2)]
        if len(ts) % 2:
            nxt.append(ts[-1])
        ts = nxt
    return ts[0]


def pad(x: Any, pad_width: Any, value: float = 0.0) -> Any:
    """x padded with the constant ``value``, like ``numpy.pad(x, pad_width)``.

    ``pad_width`` is an int (the same on both sides of every axis), a (before, after) pair
    (used for every axis) or one pair per axis. Returns a tensor of x's dtype; the gradient
    is the interior slice of the output's gradient. Raises ValueError for negative widths
    or a wrong number of pairs, TypeError for non-integer widths.
    """
    x = coerce_one(x)
    widths = np.asarray(pad_width)
    if widths.dtype.kind not in "iu":
        raise TypeError(f"pad: pad_width must hold integers, got {pad_width!r}")
    try:
        pairs = np.broadcast_to(widths, (x.ndim, 2))
    except ValueError:
        raise ValueError(
            f"pad: pad_width {pad_width!r} does not fit a tensor of {x.ndim} axes: give an int, "
            "a (before, after) pair or one pair per axis"
        ) from None
    if (pairs < 0).any():
        raise ValueError(f"pad: pad widths must be >= 0, got {pad_width!r}")
    return apply("pad", [x], ip=pairs.reshape(-1).tolist(), fp=(float(value),))


def cumsum(x: Any, axis: int = -1, *, reverse: bool = False) -> Any:
    """The inclusive running sum along ``axis`` (from the end when ``reverse``).

    Returns a float32 tensor of x's shape. Raises ValueError for an axis out of range and
    TypeError for a non-float32 x.
    """
    x = coerce_one(x)
    ax = _axis("cumsum", axis, x.ndim)
    return apply("cumsum", [x], ip=(ax, int(bool(reverse))))


if not typing.TYPE_CHECKING:  # mypy reads the public names from the module itself
    __all__ = _exports.public_names(globals())

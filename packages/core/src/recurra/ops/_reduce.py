"""Reductions: sum, mean and max over one axis, several axes or all of them (numpy rules)."""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence
from typing import Any

import numpy as np

from recurra.ops import _exports
from recurra.ops._apply import apply, coerce

_Axis = int | Sequence[int] | None


def _norm_axes(op: str, axis: _Axis, ndim: int) -> list[int]:
    """The axes to reduce, normalised to 0 <= a < ndim, sorted, without repeats."""
    if axis is None:
        return list(range(ndim))
    axes = [axis] if isinstance(axis, (int, np.integer)) else list(axis)
    out = []
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
            raise TypeError(f"{op}: axis must be an int, a sequence of ints or None, got {a!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"{op}: axis {a} is out of range for a tensor of {ndim} axes")
        a = int(a) % ndim
        if a in out:
            raise ValueError(f"{op}: axis {a} is repeated")
        out.append(a)
    return sorted(out)


def _reduce(
    op: str, x: Any, axis: _Axis, keepdims: bool, name: str | None = None
) -> tuple[Any, int]:
    """Applies core op ``op`` (sum or max) over the axes; returns the result and the number
    of elements each result element reduces. ``name`` is the op named in errors."""
    _, (x,) = coerce([x])
    shape = tuple(x.shape)
    axes = _norm_axes(name or op, axis, len(shape))
    count = math.prod(shape[a] for a in axes)
    kept = tuple(1 if i in axes else d for i, d in enumerate(shape))
    final = kept if keepdims else tuple(d for i, d in enumerate(shape) if i not in axes)
    if len(axes) == len(shape):
        # Everything: one row of all elements (a view; a copy only for a strided x).
        flat = x if shape == (1, count) else apply("reshape", [x], ip=(1, count))
        r = apply(op, [flat], ip=(1,))
    else:
        r = x
        for a in axes:
            r = apply(op, [r], ip=(a,))
    if tuple(r.shape) != final:
        r = apply("reshape", [r], ip=final)
    return r, count


def sum(x: Any, axis: _Axis = None, keepdims: bool = False) -> Any:  # noqa: A001 - numpy's name
    """The sum of x over ``axis`` (an int, a sequence of ints, or None for all axes).

    Returns a float32 tensor; reduced axes are dropped, or kept with size 1 when
    ``keepdims``. Accumulates in double precision. Raises ValueError for an axis out of
    range, TypeError for a non-float32 x.
    """
    return _reduce("sum", x, axis, keepdims)[0]


def mean(x: Any, axis: _Axis = None, keepdims: bool = False) -> Any:
    """The mean of x over ``axis`` (see :func:`sum`); NaN where no elements are reduced.

    Raises ValueError for an axis out of range, TypeError for a non-float32 x.
    """
    s, count = _reduce("sum", x, axis, keepdims, "mean")
    return apply("scale", [s], fp=(1.0 / count if count else math.nan,))


def max(x: Any, axis: _Axis = None, keepdims: bool = False) -> Any:  # noqa: A001 - numpy's name
    """The maximum of x over ``axis`` (see :func:`sum`); NaN wins, as in numpy.

    The gradient flows to the first element (in index order along each reduced axis) that
    attains the maximum. Raises ValueError for an axis out of range or a reduction over
    zero elements, TypeError for a non-float32 x.
    """
    return _reduce("max", x, axis, keepdims)[0]


if not typing.TYPE_CHECKING:  # mypy reads the public names from the module itself
    __all__ = _exports.public_names(globals())

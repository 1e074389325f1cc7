"""Cases of the reductions: sum, mean and max over one axis, several axes or all."""

from __future__ import annotations

from typing import Any

import numpy as np

from recurra import ops
from recurra.opcases._case import Node, OpCase, normal, spread

#: Sums accumulate in double precision; float32 rounding of the result remains.
SUM_TOL = (1e-5, 1e-5)


def _x(*shape: int, distinct: bool = False) -> Any:
    if distinct:
        return lambda rng: {"x": spread(rng, *shape)}
    return lambda rng: {"x": normal(rng, *shape)}


def _tag(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _per_axis(op: str, shape: tuple[int, ...], axis: int) -> OpCase:
    """The core node itself: one axis, kept with size 1."""
    np_fn = np.sum if op == "sum" else np.max
    return OpCase(
        op,
        f"{_tag(shape)}_axis{axis}",
        _x(*shape, distinct=op == "max"),
        lambda x: getattr(ops, op)(x, axis=axis, keepdims=True),
        ref=lambda x: np_fn(x, axis=axis, keepdims=True),
        ref_tol=SUM_TOL if op == "sum" else (0.0, 0.0),
        node=Node(op, (axis,)),
    )


def _reduce(op: str, name: str, inputs: Any, axis: Any = None, keepdims: bool = False) -> OpCase:
    """ops.<op>(x, axis, keepdims) against numpy's function of the same name."""
    return OpCase(
        op,
        name,
        inputs,
        lambda x: getattr(ops, op)(x, axis=axis, keepdims=keepdims),
        ref=lambda x: getattr(np, op)(x, axis=axis, keepdims=keepdims),
        ref_tol=(0.0, 0.0) if op == "max" else SUM_TOL,
    )


def cases() -> list[OpCase]:
    x4 = _x(2, 3, 4, 5)
    spread4 = _x(2, 3, 4, 5, distinct=True)
    out = [
        _reduce("sum", "all", x4),
        _reduce("sum", "axis1", x4, 1),
        _reduce("sum", "axes02_keepdims", x4, (0, 2), True),
        _reduce("sum", "long_row_1000", _x(3, 1000), -1),
        _reduce("mean", "last_axis", x4, -1),
        _reduce("mean", "all", x4),
        _reduce("max", "all", spread4),
        _reduce("max", "axis0", spread4, 0),
        _reduce("max", "last_axis", spread4, -1),
    ]
    # Every axis of odd shapes; long rows and columns (split into chunks: two passes).
    shapes = {
        (1,): (0,),
        (17,): (0,),
        (1000,): (0,),
        (3, 17, 5): (0, 1, 2),
        (2, 3, 4, 5): (0, 1, 2, 3),
        (100003,): (0,),  # longer than 65535: lavapipe's loop limit (see max_grad.comp)
        (70001, 3): (0,),
        (1000, 300): (0,),
        (3, 1000, 2): (1,),
    }
    for op in ("sum", "max"):
        out += [_per_axis(op, shape, a) for shape, axes in shapes.items() for a in axes]
    return out

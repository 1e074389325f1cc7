"""Matrix products: matmul (numpy semantics) and out_prod (ggml's sum of outer products)."""

from __future__ import annotations

import typing
from typing import Any

from recurra.ops import _exports
from recurra.ops._apply import apply, coerce


def matmul(a: Any, b: Any) -> Any:
    """The matrix product a @ b with numpy's rules.

    ``a`` (..., m, k) and ``b`` (..., k, n) give (..., m, n), batch axes broadcast; a 1-D
    ``a`` is a row vector and a 1-D ``b`` a column vector, whose axis is dropped from the
    result. Transposed or strided views are read without copies where BLAS allows.
    Returns a float32 tensor. Raises ValueError for scalars, mismatched inner dimensions
    or batch axes that do not broadcast, TypeError for non-float32 operands.
    """
    _, (a, b) = coerce([a, b])
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(
            f"matmul: operands must have at least 1 axis (got shapes {tuple(a.shape)} and "
            f"{tuple(b.shape)}); use mul to scale"
        )
    a2 = apply("reshape", [a], ip=(1, a.shape[0])) if a.ndim == 1 else a
    b2 = apply("reshape", [b], ip=(b.shape[0], 1)) if b.ndim == 1 else b
    r = apply("matmul", [a2, b2])
    if a.ndim > 1 and b.ndim > 1:
        return r
    shape = list(r.shape)
    if b.ndim == 1:
        del shape[-1]
    if a.ndim == 1:
        del shape[-1 if b.ndim == 1 else -2]
    return apply("reshape", [r], ip=tuple(shape))


def out_prod(a: Any, b: Any) -> Any:
    """The sum over k of outer products: a (..., k, m), b (..., k, n) -> a^T @ b (..., m, n).

    Batch axes broadcast like numpy. Returns a float32 tensor. Raises ValueError when the
    k axes differ, an operand has fewer than 2 axes or the batch axes do not broadcast,
    TypeError for non-float32 operands.
    """
    return apply("out_prod", [a, b])


if not typing.TYPE_CHECKING:  # mypy reads the public names from the module itself
    __all__ = _exports.public_names(globals())

"""Elementwise ops (numpy broadcasting), activations, and views."""

from __future__ import annotations

import builtins
import math
import typing
from collections.abc import Sequence
from typing import Any

import numpy as np

from recurra._dtype import as_dtype
from recurra.ops import _exports
from recurra.ops._apply import apply, coerce_one


def cast(x: Any, dtype: Any) -> Any:
    """``x`` converted to the float dtype ``dtype`` (``recurra.float32``, ``bfloat16``,
    ``float16``, or their names): to a 2-byte float it rounds to nearest, ties to even
    (bit for bit as ml_dtypes and numpy); to float32 it is exact. ``x`` itself when it has
    that dtype already. Differentiable: the gradient is cast back to ``x``'s dtype.
    ``Tensor.to(dtype)`` is the same.

    Raises TypeError for an int32 ``x`` or target."""
    d = as_dtype(dtype)
    t = coerce_one(x)
    if t.dtype == d:
        return t
    if not d.is_floating or t.dtype == "int32":
        raise TypeError(
            f"cast: converts between float32, bfloat16 and float16, not {t.dtype} -> {d}"
        )
    return apply("cast", [t], ip=(d.code,))


def _binary(name: str, a: Any, b: Any) -> Any:
    return apply(name, [a, b])


def add(a: Any, b: Any) -> Any:
    """a + b with numpy broadcasting."""
    if isinstance(b, (int, float)) and getattr(a, "_frontend", None) is not None and b == 0:
        return a
    return _binary("add", a, b)


def sub(a: Any, b: Any) -> Any:
    """a - b with numpy broadcasting."""
    return _binary("sub", a, b)


def mul(a: Any, b: Any) -> Any:
    """a * b with numpy broadcasting (a Python number scales without a constant tensor)."""
    if isinstance(b, (int, float)) and not isinstance(b, bool) and hasattr(a, "_frontend"):
        return scale(a, float(b))
    if isinstance(a, (int, float)) and not isinstance(a, bool) and hasattr(b, "_frontend"):
        return scale(b, float(a))
    return _binary("mul", a, b)


def div(a: Any, b: Any) -> Any:
    """a / b with numpy broadcasting."""
    if isinstance(b, (int, float)) and not isinstance(b, bool) and hasattr(a, "_frontend"):
        if b == 0:
            return _binary("div", a, b)
        return scale(a, 1.0 / float(b))
    return _binary("div", a, b)


def _unary(name: str, x: Any, fp: Sequence[float] = ()) -> Any:
    return apply(name, [x], fp=fp)


def neg(x: Any) -> Any:
    """-x."""
    return _unary("neg", x)


def abs(x: Any) -> Any:  # noqa: A001 - numpy's name
    """|x| (gradient 0 at 0)."""
    return _unary("abs", x)


def sqr(x: Any) -> Any:
    """x * x."""
    return _unary("sqr", x)


def sqrt(x: Any) -> Any:
    """Square root."""
    return _unary("sqrt", x)


def exp(x: Any) -> Any:
    """e ** x."""
    return _unary("exp", x)


def log(x: Any) -> Any:
    """Natural logarithm."""
    return _unary("log", x)


def scale(x: Any, s: float) -> Any:
    """x * s for a Python number s."""
    return _unary("scale", x, (float(s),))


def clamp(x: Any, min: float = -np.inf, max: float = np.inf) -> Any:  # noqa: A002
    """x clipped to [min, max]; the gradient is 1 inside and 0 outside."""
    return _unary("clamp", x, (float(min), float(max)))


def pow(x: Any, p: float) -> Any:  # noqa: A001
    """x ** p for a Python number p (p not in {0, 1, 2, 0.5, -1} needs x > 0)."""
    if not isinstance(p, (int, float)):
        raise TypeError("pow: the exponent must be a Python number")
    if p == 1:
        return x
    if p == 2:
        return sqr(x)
    if p == 0.5:
        return sqrt(x)
    if p == -1:
        return div(1.0, x)
    if p == 0:
        return add(scale(x, 0.0), 1.0)
    return exp(scale(log(x), float(p)))


def relu(x: Any) -> Any:
    """max(x, 0)."""
    return _unary("relu", x)


def silu(x: Any) -> Any:
    """x * sigmoid(x)."""
    return _unary("silu", x)


def gelu(x: Any) -> Any:
    """The exact GELU, x * Phi(x) (erf form, like torch's default)."""
    return _unary("gelu", x)


def gelu_tanh(x: Any) -> Any:
    """GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GPT-2's,
    torch's approximate="tanh")."""
    return _unary("gelu_tanh", x)


def relu_sqr(x: Any) -> Any:
    """max(x, 0) ** 2 (RWKV's channel mixing) in one op: sqr(relu(x)) without keeping relu(x)
    for the backward."""
    return _unary("relu_sqr", x)


def sigmoid(x: Any) -> Any:
    """1 / (1 + exp(-x))."""
    return _unary("sigmoid", x)


def tanh(x: Any) -> Any:
    """Hyperbolic tangent."""
    return _unary("tanh", x)


def softplus(x: Any) -> Any:
    """log(1 + exp(x)), and x itself where x > 20 (docs/ops.md, "Conventions")."""
    return _unary("softplus", x)


# ---- views ------------------------------------------------------------------------------


def reshape(x: Any, shape: Sequence[int] | int) -> Any:
    """A view with a new shape (one axis may be -1). Copies only if x is not contiguous."""
    x = coerce_one(x)
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = list(map(int, shape))
    if -1 in shape:
        if shape.count(-1) > 1:
            raise ValueError("reshape: only one axis can be -1")
        n = x.size
        rest = math.prod(s for s in shape if s != -1)
        if rest == 0 or n % rest:
            raise ValueError(f"reshape: cannot reshape {x.shape} to {tuple(shape)}")
        shape[shape.index(-1)] = n // rest
    if tuple(shape) == tuple(x.shape):
        return x
    return apply("reshape", [x], ip=shape)


def permute(x: Any, axes: Sequence[int]) -> Any:
    """A view with the axes reordered (no copy)."""
    return apply("permute", [x], ip=[int(a) for a in axes])


def transpose(x: Any, a: int = -2, b: int = -1) -> Any:
    """A view with axes a and b swapped (no copy)."""
    x = coerce_one(x)
    nd = x.ndim
    if nd < 2:
        return x
    for ax in (a, b):
        if not -nd <= ax < nd:
            raise ValueError(f"transpose: axis {ax} is out of range for {nd} axes")
    perm = list(range(nd))
    perm[a % nd], perm[b % nd] = perm[b % nd], perm[a % nd]
    return permute(x, perm)


def contiguous(x: Any) -> Any:
    """A dense copy of a view."""
    return apply("contiguous", [x])


def broadcast_to(x: Any, shape: Sequence[int]) -> Any:
    """A view of x broadcast to ``shape`` (numpy rules; no copy)."""
    return apply("broadcast_to", [x], ip=[int(s) for s in shape])


def getitem(x: Any, index: Any) -> Any:
    """Basic indexing: integers, slices with positive steps, ``...`` and ``None``."""
    x = coerce_one(x)
    if not isinstance(index, tuple):
        index = (index,)
    nd = x.ndim
    n_real = n_ellipsis = 0
    for i in index:
        if i is Ellipsis:
            n_ellipsis += 1
        elif i is not None:
            n_real += 1
    if n_ellipsis > 1:
        raise IndexError("an index can only have a single ellipsis")
    if n_real > nd:
        raise IndexError(f"too many indices for a tensor of {nd} axes")
    expanded: list[Any] = []
    for i in index:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (nd - n_real))
        else:
            expanded.append(i)
    if not n_ellipsis:
        expanded.extend([slice(None)] * (nd - n_real))
    spec: list[int] = []
    out_shape: list[int] = []
    axis = 0
    for i in expanded:
        if i is None:
            out_shape.append(1)
            continue
        dim = x.shape[axis]
        if isinstance(i, slice):
            start, stop, step = i.indices(dim)
            if step <= 0:
                raise ValueError("slicing with a negative or zero step is not supported")
            stop = builtins.max(stop, start)
            spec += [start, stop, step]
            out_shape.append(len(range(start, stop, step)))
        elif isinstance(i, (int, np.integer)):
            j = int(i)
            if not -dim <= j < dim:
                raise IndexError(f"index {j} is out of bounds for axis {axis} with size {dim}")
            j %= dim
            spec += [j, j + 1, 1]
        else:
            raise TypeError(f"unsupported index {i!r}: use integers, slices, ... or None")
        axis += 1
    shape = x.shape
    trivial = all(
        spec[3 * k] == 0 and spec[3 * k + 1] == shape[k] and spec[3 * k + 2] == 1 for k in range(nd)
    )
    y = x if trivial else apply("slice", [x], ip=spec)
    if tuple(out_shape) != tuple(y.shape):
        y = reshape(y, out_shape)
    return y


if not typing.TYPE_CHECKING:  # mypy reads the public names from the module itself
    __all__ = _exports.public_names(globals())

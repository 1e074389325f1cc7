"""Operators and methods shared by lazy tensors and graph tensors."""

from __future__ import annotations

import functools
import math
from typing import Any


@functools.cache
def _ops() -> Any:
    """recurra.ops (imported on first use: it imports this module)."""
    from recurra import ops

    return ops


class TensorOps:
    """Mixin: numpy-like operators on top of :mod:`recurra.ops`.

    Subclasses provide ``shape`` (tuple), ``dtype`` (a :class:`recurra.DType`, which
    compares equal to its name: ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"int32"``)
    and ``_frontend``.
    """

    __slots__ = ()
    shape: tuple[int, ...]
    dtype: str
    __array_priority__ = 1000  # numpy defers to our operators: `ndarray + tensor` works

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # -- arithmetic ------------------------------------------------------------------
    def __add__(self, o: Any) -> Any:
        ops = _ops()
        return ops.add(self, o)

    def __radd__(self, o: Any) -> Any:
        ops = _ops()
        return ops.add(o, self)

    def __sub__(self, o: Any) -> Any:
        ops = _ops()
        return ops.sub(self, o)

    def __rsub__(self, o: Any) -> Any:
        ops = _ops()
        return ops.sub(o, self)

    def __mul__(self, o: Any) -> Any:
        ops = _ops()
        return ops.mul(self, o)

    def __rmul__(self, o: Any) -> Any:
        ops = _ops()
        return ops.mul(o, self)

    def __truediv__(self, o: Any) -> Any:
        ops = _ops()
        return ops.div(self, o)

    def __rtruediv__(self, o: Any) -> Any:
        ops = _ops()
        return ops.div(o, self)

    def __matmul__(self, o: Any) -> Any:
        ops = _ops()
        return ops.matmul(self, o)

    def __rmatmul__(self, o: Any) -> Any:
        ops = _ops()
        return ops.matmul(o, self)

    def __pow__(self, p: Any) -> Any:
        ops = _ops()
        return ops.pow(self, p)

    def __neg__(self) -> Any:
        ops = _ops()
        return ops.neg(self)

    def __pos__(self) -> Any:
        return self

    def __abs__(self) -> Any:
        ops = _ops()
        return ops.abs(self)

    # -- views -----------------------------------------------------------------------
    def reshape(self, *shape: Any) -> Any:
        ops = _ops()
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return ops.reshape(self, shape)

    def permute(self, *axes: Any) -> Any:
        ops = _ops()
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return ops.permute(self, axes)

    def transpose(self, *axes: Any) -> Any:
        """``transpose()`` reverses the axes (numpy); ``transpose(a, b)`` swaps two axes."""
        ops = _ops()
        if not axes:
            return ops.permute(self, tuple(reversed(range(self.ndim))))
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            return ops.permute(self, tuple(axes[0]))
        if len(axes) == 2:
            return ops.transpose(self, axes[0], axes[1])
        return ops.permute(self, axes)

    @property
    def T(self) -> Any:  # noqa: N802 - numpy's name
        return self.transpose()

    def contiguous(self) -> Any:
        ops = _ops()
        return ops.contiguous(self)

    def broadcast_to(self, shape: Any) -> Any:
        ops = _ops()
        return ops.broadcast_to(self, shape)

    def __getitem__(self, index: Any) -> Any:
        ops = _ops()
        return ops.getitem(self, index)

    # -- reductions --------------------------------------------------------------------
    def sum(self, axis: int | None = None, keepdims: bool = False) -> Any:
        ops = _ops()
        return ops.sum(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: int | None = None, keepdims: bool = False) -> Any:
        ops = _ops()
        return ops.mean(self, axis=axis, keepdims=keepdims)

    def max(self, axis: int | None = None, keepdims: bool = False) -> Any:
        ops = _ops()
        return ops.max(self, axis=axis, keepdims=keepdims)

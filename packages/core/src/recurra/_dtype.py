"""recurra's dtypes: ``float32``, ``bfloat16``, ``float16`` and ``int32``.

A dtype is a :class:`DType`, a ``str`` subclass (``rc.bfloat16 == "bfloat16"``), so the
names the core and older code use keep working. bfloat16 arrays in numpy are
``ml_dtypes.bfloat16`` (a dependency of recurra-core); float16 is numpy's own.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


class DType(str):
    """A recurra dtype (compares equal to its name)."""

    __slots__ = ()

    @property
    def code(self) -> int:
        """The ``recurra_dtype`` code of the backend ABI (backend.h)."""
        return _CODES[str(self)]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return 2 if self in ("bfloat16", "float16") else 4

    @property
    def is_floating(self) -> bool:
        return self != "int32"

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype of arrays holding this dtype (bfloat16: ml_dtypes')."""
        return _NUMPY[str(self)]

    def __repr__(self) -> str:
        return f"recurra.{str(self)}"


float32 = DType("float32")
int32 = DType("int32")
bfloat16 = DType("bfloat16")
float16 = DType("float16")

_CODES = {"float32": 0, "int32": 1, "bfloat16": 2, "float16": 3}
_BY_NAME = {str(d): d for d in (float32, int32, bfloat16, float16)}
_NUMPY: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "int32": np.dtype(np.int32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
#: The 2-byte float dtypes (stored in 2 bytes, computed in float32).
HALF = (bfloat16, float16)


def as_dtype(x: Any) -> DType:
    """The recurra dtype named by ``x``: a :class:`DType`, its name, or a numpy dtype
    (float32, int32, float16, ml_dtypes.bfloat16). Raises TypeError for anything else."""
    if isinstance(x, str):
        d = _BY_NAME.get(x)
        if d is not None:
            return d
        raise TypeError(f"unknown dtype {x!r}: recurra has float32, bfloat16, float16, int32")
    try:
        nd = np.dtype(x)
    except TypeError as e:
        raise TypeError(
            f"unknown dtype {x!r}: recurra has float32, bfloat16, float16, int32"
        ) from e
    for name, v in _NUMPY.items():
        if nd == v:
            return _BY_NAME[name]
    raise TypeError(f"unsupported dtype {nd}: recurra has float32, bfloat16, float16, int32")


def is_dtype(x: Any) -> bool:
    """Whether ``x`` names a recurra dtype (a DType, its name, or one of the numpy dtypes)."""
    try:
        as_dtype(x)
    except TypeError:
        return False
    return True


def dtype_of_array(arr: np.ndarray) -> DType:
    """The recurra dtype of an array already converted by ``to_supported``."""
    return as_dtype(arr.dtype)


def bits_view(arr: np.ndarray) -> np.ndarray:
    """``arr`` as the core binds it: 2-byte floats as their uint16 patterns (a buffer of
    ml_dtypes' bfloat16 has no format the buffer protocol knows)."""
    if arr.dtype.itemsize == 2:
        return arr.view(np.uint16)
    return arr

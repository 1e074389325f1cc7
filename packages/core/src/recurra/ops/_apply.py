"""The one entry point every op wrapper goes through.

An op wrapper normalises its arguments and calls :func:`apply` (or :func:`apply_multi` for
ops with several results). ``apply`` finds the *frontend* of its sources: the lazy tensor
API (:class:`recurra.Tensor`) or an explicit graph (:class:`recurra.Graph`). numpy arrays
and Python scalars become constants of that frontend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from recurra import _autocast
from recurra._dtype import as_dtype, bfloat16

# The lazy tensor class and its frontend, set by recurra._tensor (which imports this module
# first): sources that are all lazy tensors skip coerce()'s search and conversions, the
# common case of recording a model's ops.
LAZY_TENSOR: type | None = None
LAZY_FRONTEND: Any = None


def coerce_one(x: Any) -> Any:
    """``x`` as a tensor of its frontend (coerce() of one source)."""
    if type(x) is LAZY_TENSOR:
        return x
    return coerce([x])[1][0]


def _frontend_of(srcs: Sequence[Any]) -> Any:
    from recurra._tensor import LAZY

    found = None
    for s in srcs:
        fe = getattr(s, "_frontend", None)
        if fe is None:
            continue
        if found is None:
            found = fe
        elif fe is not found:
            raise ValueError(
                "cannot combine tensors of different graphs (or graph tensors with lazy tensors)"
            )
    return found if found is not None else LAZY


def coerce(srcs: Sequence[Any]) -> tuple[Any, list[Any]]:
    """Returns the frontend of ``srcs`` and the sources converted to its tensors."""
    fe = _frontend_of(srcs)
    # Arrays and numbers become constants on the device of the op's first tensor, so that
    # mixing them with device tensors never splits an op across devices.
    device = next(
        (getattr(s, "device", None) for s in srcs if getattr(s, "_frontend", None) is fe), None
    )
    # A Python number takes the dtype of the op's first bfloat16/float16 tensor (as in
    # PyTorch, numbers do not promote): `x * 0.5` keeps x's dtype. Arrays keep their own.
    half = next(
        (
            s.dtype
            for s in srcs
            if getattr(s, "_frontend", None) is fe and s.dtype in ("bfloat16", "float16")
        ),
        None,
    )
    out = []
    for s in srcs:
        if getattr(s, "_frontend", None) is fe:
            out.append(s)
            continue
        arr = _as_array(s)
        if half is not None and isinstance(s, (int, float)) and arr.dtype.kind == "f":
            arr = arr.astype(as_dtype(half).numpy)
        if device is not None and device.backend != "cpu":
            out.append(fe.constant(arr, device))
        else:
            out.append(fe.constant(arr))
    return fe, out


def _as_array(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, (bool, int, float, np.number)):
        arr = np.asarray(x, dtype=np.float32)
    else:
        try:
            arr = np.asarray(x)
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise TypeError(f"cannot convert {type(x).__name__} to a recurra tensor") from e
    return to_supported(arr)


def to_supported(arr: np.ndarray) -> np.ndarray:
    """Converts an array to a dtype of the core, C-contiguous: float16 and bfloat16
    (ml_dtypes) stay as they are, other floats become float32, integers and bools int32."""
    if arr.dtype == np.float16 or arr.dtype == bfloat16.numpy:
        pass
    elif arr.dtype.kind == "f":
        arr = arr.astype(np.float32, copy=False)
    elif arr.dtype.kind in "iub":
        if arr.dtype.kind == "b" or arr.dtype != np.int32:
            info = np.iinfo(np.int32)
            if (
                arr.size
                and arr.dtype.kind != "b"
                and (arr.min() < info.min or arr.max() > info.max)
            ):
                raise ValueError("integer values do not fit in int32")
        arr = arr.astype(np.int32, copy=False)
    else:
        raise TypeError(
            f"unsupported dtype {arr.dtype}: recurra tensors are float32, bfloat16, float16 "
            "or int32"
        )
    if arr.ndim > 4:
        raise ValueError(f"at most 4 axes are supported, got shape {arr.shape}")
    return np.require(arr, requirements="C")


def apply(name: str, srcs: Sequence[Any], ip: Sequence[int] = (), fp: Sequence[float] = ()) -> Any:
    """Records op ``name`` on ``srcs`` with integer params ``ip`` and float params ``fp``.

    Inside :class:`recurra.autocast` the float sources are cast first, as the op's autocast
    class says (``recurra.ops.spec()[name].autocast``). Returns a tensor of the sources'
    frontend. Raises ValueError/TypeError for bad shapes,
    parameters or dtypes (checked now, not when the graph runs).
    """
    lazy = LAZY_TENSOR
    if srcs and all(type(s) is lazy for s in srcs):
        fe, ts = LAZY_FRONTEND, list(srcs)
    else:
        fe, ts = coerce(srcs)
    if _autocast.STATE.dtype is not None:  # inside recurra.autocast: the op's cast policy
        ts = list(_autocast.cast_sources(name, ts))
    return fe.apply(name, ts, tuple(map(int, ip)), tuple(map(float, fp)))


def apply_multi(
    name: str,
    srcs: Sequence[Any],
    shapes: Sequence[Sequence[int]],
    ip: Sequence[int] = (),
    fp: Sequence[float] = (),
    *,
    tail: bool = False,
) -> tuple[Any, ...]:
    """Records an op whose results come packed in one flat output; returns them cut apart.

    Each result is a view (slice + reshape) of the packed output, so each is
    differentiable on its own. With ``tail`` the packed output may end with more (e.g.
    ssm_scan's checkpoints, which the scheduler keeps or drops per backend), cut off here.
    """
    packed = apply(name, srcs, ip, fp)
    sizes = [math.prod(int(d) for d in s) for s in shapes]
    total = sum(sizes)
    if len(packed.shape) != 1 or packed.shape[0] < total or (packed.shape[0] > total and not tail):
        raise ValueError(f"{name}: packed result has shape {packed.shape}, expected ({total},)")
    outs = []
    off = 0
    for s, n in zip(shapes, sizes):
        piece = apply("slice", [packed], ip=(off, off + n, 1))
        outs.append(apply("reshape", [piece], ip=tuple(int(d) for d in s)))
        off += n
    return tuple(outs)

"""Helpers of the optimizer base class (recurra_optim.optimizer): where a tensor's memory
and gradient are, and the checks of constructor arguments."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

import numpy as np

import recurra
from recurra import Tensor


def _is_tensor(x: Any) -> TypeGuard[Tensor]:
    return isinstance(x, Tensor)


def _on_device(t: Any) -> TypeGuard[Tensor]:
    """Whether t is a recurra tensor whose value lives in a device backend's memory."""
    return _device_storage(t) is not None


def _device_storage(t: Any) -> recurra.DeviceBuffer | None:
    """The device memory holding t when t is a recurra tensor on a device backend, else
    None (a host tensor, a pending one, or not a tensor)."""
    s = t.storage if _is_tensor(t) else None
    return s if isinstance(s, recurra.DeviceBuffer) else None


def _host_storages(tensors: list[Tensor]) -> list[np.ndarray] | None:
    """The host arrays holding ``tensors`` (their own memory), or None when any of them is
    not on the host."""
    out = []
    for t in tensors:
        s = t.storage
        if not isinstance(s, np.ndarray):
            return None
        out.append(s)
    return out


def _grad(p: Tensor) -> Tensor | np.ndarray | None:
    """``p.grad`` as the optimizers take it: the tensor ``backward()`` left there, or a
    numpy array a user assigned (accepted, converted to float32 when needed)."""
    g: Tensor | np.ndarray | None = p.grad
    return g


def _download(t: Tensor, out: np.ndarray, name: str, what: str) -> None:
    buf = t.storage
    if isinstance(buf, np.ndarray):
        np.copyto(out, buf)
        return
    if buf is None:  # pending: compute it (where it lives) and copy the result
        np.copyto(out, t.numpy())
        return
    if not getattr(buf, "valid", True):
        raise RuntimeError(
            f"the {what} of {name} lived on {t.device}, whose memory was "
            f"released (its backend closed)"
        )
    buf.download(out)


def _grad_buffer(p: Tensor, *, writable: bool) -> np.ndarray | None:
    """The array behind ``p.grad`` (no copy when it is dense float32), or None. With
    ``writable``, an array that can be written in place and that ``p.grad`` then holds."""
    g = _grad(p)
    if g is None:
        return None
    s = g.storage if isinstance(g, Tensor) else None
    arr = s if isinstance(s, np.ndarray) else np.asarray(g)
    if arr.dtype == np.float32 and arr.flags.c_contiguous and (arr.flags.writeable or not writable):
        return arr
    arr = np.array(arr, np.float32, order="C")
    if writable:  # the in-place users (zero_grad, clipping) must write into p.grad itself
        if isinstance(g, Tensor):
            t = recurra.tensor(arr, device=p.device)
            p.grad = t
            s = t.storage
            return s if isinstance(s, np.ndarray) else arr
        p.grad = arr  # type: ignore[assignment]  # a numpy gradient stays one
    return arr


def _param_list(params: Any, names: dict[int, str]) -> list[Tensor]:
    if _is_tensor(params):
        params = [params]
    elif isinstance(params, Mapping):
        for k, v in params.items():
            if _is_tensor(v):
                names.setdefault(id(v), str(k))
        params = list(params.values())
    else:
        try:
            params = list(params)
        except TypeError:
            raise TypeError(f"params must be tensors, got {type(params).__name__}") from None
    for i, p in enumerate(params):
        if not _is_tensor(p):
            raise TypeError(
                f"optimizer can only optimize recurra tensors, but parameter {i} is "
                f"{type(p).__name__}"
            )
        if not p.is_leaf:
            raise ValueError(f"can't optimize a non-leaf tensor (parameter {i})")
        if not p.dtype.is_floating:
            raise TypeError(
                f"parameter {i} is {p.dtype}; only float tensors (float32, or bfloat16 and "
                f"float16 with a float32 master copy) can be optimized"
            )
    checked: list[Tensor] = params
    return checked


def _as_groups(params: Any, names: dict[int, str]) -> list[dict[str, Any]]:
    if _is_tensor(params):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of tensors "
            "or dicts, but got a single tensor"
        )
    if isinstance(params, Mapping):
        return [{"params": params}]
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    if all(isinstance(x, dict) for x in items):
        return items
    if any(isinstance(x, dict) for x in items):
        raise TypeError("params must be all tensors or all parameter-group dicts")
    return [{"params": items}]


def _check_accumulate(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"accumulate_steps must be a positive integer, got {k!r}")
    if k <= 0:
        raise ValueError(f"accumulate_steps must be >= 1, got {k}")
    return int(k)


def _check_clip(name: str, v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    if not (f > 0 and math.isfinite(f)):
        raise ValueError(f"{name} must be a positive finite number or None, got {f}")
    return f


def _check_nonneg(name: str, v: Any) -> None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"invalid {name}: {v!r}") from None
    if not (f >= 0.0 and math.isfinite(f)):
        raise ValueError(f"invalid {name}: {v} (must be finite and >= 0)")


def _check_beta(name: str, v: Any) -> None:
    f = float(v)
    if not 0.0 <= f < 1.0:
        raise ValueError(f"invalid {name}: {v} (must be in [0, 1))")

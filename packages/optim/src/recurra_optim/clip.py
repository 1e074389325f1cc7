"""Gradient clipping in place, PyTorch-style, computed by native kernels where the gradients
are (recurra's ``grad_norm`` and ``grad_clip`` ops in one small cached graph).

The optimizers can also clip inside their step (``max_grad_norm=``, ``clip_value=``), which
leaves ``p.grad`` untouched and costs no extra pass over the parameters.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from recurra import DeviceBuffer, Tensor
from recurra.ops import FusedStep
from recurra_optim._support import _device_storage, _grad_buffer

__all__ = ["clip_grad_norm_", "clip_grad_value_"]

_cache: OrderedDict[Any, FusedStep] = OrderedDict()
_MAX_CACHED = 8


def _params(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    return [parameters] if isinstance(parameters, Tensor) else list(parameters)


def _run(parameters: Tensor | Iterable[Tensor], hyper: dict[str, float], norm: bool) -> float:
    params = [p for p in _params(parameters) if p.grad is not None]
    if not params:
        return 0.0
    # Host gradients are clipped in their own buffers; device gradients through a host copy
    # written back afterwards (until the backends run grad_clip themselves).
    grads: list[np.ndarray] = []
    uploads: list[tuple[DeviceBuffer, np.ndarray]] = []
    for p in params:
        g = p.grad
        buf = _device_storage(g)
        if g is not None and buf is not None:
            host = g.numpy()
            uploads.append((buf, host))
            grads.append(host)
        else:
            arr = _grad_buffer(p, writable=True)
            assert arr is not None  # p.grad is not None
            grads.append(arr)
    key = (norm, tuple(g.shape for g in grads))
    fs = _cache.get(key)
    if fs is None:
        fs = FusedStep([("grad_clip", (), [(g,) for g in grads])], norm=norm)
        _cache[key] = fs
        if len(_cache) > _MAX_CACHED:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    for t, arr in enumerate(grads):
        fs.bind(0, t, 0, arr)
    fs.set_hyper(0, hyper)
    fs.run()
    for buf, host in uploads:
        buf.upload(host)
    return fs.grad_norm() if norm else 0.0


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0
) -> float:
    """Scales the gradients of ``parameters`` in place so that their global L2 norm is at
    most ``max_norm`` (by ``max_norm / (norm + 1e-6)`` when above it).

    Returns the norm before clipping (0.0 when no parameter has a gradient). Raises
    ValueError for max_norm <= 0 or a norm_type other than 2.
    """
    if norm_type != 2.0:
        raise ValueError(
            f"clip_grad_norm_: only the L2 norm (norm_type=2) is supported, got {norm_type}"
        )
    max_norm = float(max_norm)
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"clip_grad_norm_: max_norm must be positive and finite, got {max_norm}")
    return _run(parameters, {"max_norm": max_norm}, norm=True)


def clip_grad_value_(parameters: Tensor | Iterable[Tensor], clip_value: float) -> None:
    """Clamps every gradient element of ``parameters`` to [-clip_value, clip_value], in
    place. Raises ValueError for clip_value <= 0."""
    clip_value = float(clip_value)
    if not (clip_value > 0 and math.isfinite(clip_value)):
        raise ValueError(
            f"clip_grad_value_: clip_value must be positive and finite, got {clip_value}"
        )
    _run(parameters, {"clip_value": clip_value}, norm=False)

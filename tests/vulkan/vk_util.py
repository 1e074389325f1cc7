"""Helpers shared by the Vulkan tests (the device gate is the suite's `vulkan` marker, in
tests/conftest.py)."""

from __future__ import annotations

import numpy as np

import recurra as rc


def cpu(name: str, srcs: list[np.ndarray], ip=(), fp=()) -> np.ndarray:
    """Returns op `name` (integer params ip, float params fp) computed by the core on the
    CPU through recurra's Python API."""
    ts = [rc.tensor(np.ascontiguousarray(s)) for s in srcs]
    return np.asarray(rc.ops.apply(name, ts, ip=ip, fp=fp).numpy())

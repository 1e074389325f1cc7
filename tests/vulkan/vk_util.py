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


def grouped_tiles(tiles_m: int, tiles_n: int, group_m: int) -> list[tuple[int, int]]:
    """The (tile row, tile column) the coopmat shaders give each workgroup id in turn: bands
    of group_m tile rows, column by column within a band (matmul_coopmat*.comp)."""
    order = []
    for pid in range(tiles_n * tiles_m):
        per_group = group_m * tiles_n
        first_m = (pid // per_group) * group_m
        rows = min(tiles_m - first_m, group_m)
        order.append((first_m + (pid % per_group) % rows, (pid % per_group) // rows))
    return order

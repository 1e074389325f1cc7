"""Type stub of recurra-vulkan's native extension (packages/vulkan/csrc/bindings.cpp).

Kept in step with the bindings by tests/vulkan/test_vulkan_stubs.py. In the bindings
``out_shape`` has no default but follows ``ip`` and ``fp``, which have one (``[]``); a call
that gives ``out_shape`` by position must give ``ip`` and ``fp`` too, so the stub asks for
them (stricter than the bindings: ``run_node(op, srcs, out_shape=...)`` also runs).
"""

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

_R_co = TypeVar("_R_co", covariant=True)

ABI_VERSION: int
MAX_SRC: int
# Tensor-core matmul variants: name -> (BM, BN, BK), the multiples M, N, K must be of.
COOPMAT_TILES: dict[str, tuple[int, int, int]]

def backend_info() -> dict[str, Any]: ...
def op_names() -> list[str]: ...
def run_node(
    op: str,
    srcs: Sequence[np.ndarray],
    ip: Sequence[int],
    fp: Sequence[float],
    out_shape: Sequence[int],
    out_dtype: str = "float32",
    src_offset: int = 0,
    device: int = 0,
) -> np.ndarray: ...

class _Profiler(Protocol[_R_co]):
    """profile_node and profile_dispatches: run_node's arguments, iters and warmup."""

    def __call__(
        self,
        op: str,
        srcs: Sequence[np.ndarray],
        ip: Sequence[int],
        fp: Sequence[float],
        out_shape: Sequence[int],
        out_dtype: str = "float32",
        iters: int = 10,
        warmup: int = 2,
        device: int = 0,
    ) -> _R_co: ...

# The GPU time of each of the last `iters` runs, in seconds.
profile_node: _Profiler[list[float]]
# (label, seconds) of every dispatch of the last `iters` runs.
profile_dispatches: _Profiler[list[tuple[str, float]]]

def memory_info(device: int = 0, reset_peaks: bool = False) -> dict[str, Any]: ...
def replay_info(device: int = 0) -> dict[str, int]: ...
def coopmat_info(device: int = 0) -> dict[str, Any]: ...
def coopmat_op_plan(
    m: int, n: int, k: int, batch: int = 1, a_transposable: bool = False
) -> tuple[str, int, bool]: ...
def coopmat_matmul(
    a: np.ndarray,
    b: np.ndarray,
    dtype: str = "bf16",
    reps: int = 1,
    variant: str = "cm128w4dp2",
    device: int = 0,
) -> tuple[np.ndarray, float]: ...
def shutdown() -> None: ...

from collections.abc import Sequence
from typing import Any

import numpy as np

ABI_VERSION: int

def backend_info() -> dict[str, Any]: ...
def op_names() -> list[str]: ...
def run_node(
    op: str,
    srcs: Sequence[np.ndarray],
    ip: Sequence[int] = ...,
    fp: Sequence[float] = ...,
    out_shape: Sequence[int] = ...,
    out_dtype: str = "float32",
    src_offset: int = 0,
    device: int = 0,
) -> np.ndarray: ...
def profile_node(
    op: str,
    srcs: Sequence[np.ndarray],
    ip: Sequence[int] = ...,
    fp: Sequence[float] = ...,
    out_shape: Sequence[int] = ...,
    out_dtype: str = "float32",
    iters: int = 10,
    warmup: int = 2,
    device: int = 0,
) -> list[float]: ...
def memory_info(device: int = 0, reset_peaks: bool = False) -> dict[str, Any]: ...
def shutdown() -> None: ...

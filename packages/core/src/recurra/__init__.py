"""recurra: train and run Mamba and RWKV models on any machine.

Two ways in:

- the tensor API (lazy, like a numpy with gradients): :func:`tensor`, :func:`param`,
  operators and :mod:`recurra.ops`, ``loss.backward()``, ``.grad``, ``.numpy()``;
- the graph API (explicit, like ggml): :class:`Graph`.
"""

from __future__ import annotations

import os as _os
from importlib import metadata as _metadata

from recurra import _core
from recurra import backends as backends
from recurra import ops as ops
from recurra._autocast import autocast, autocast_dtype, is_autocast_enabled
from recurra._capture import Captured, CaptureError, capture
from recurra._core import DeviceBuffer
from recurra._devices import Device, parse_device
from recurra._dtype import DType, bfloat16, float16, float32, int32
from recurra._files import write_atomic
from recurra._profile import OpTime, Profile, _profile_from_env, profile
from recurra._tensor import (
    GradientListener,
    Tensor,
    add_gradient_listener,
    is_grad_enabled,
    no_grad,
    param,
    plan_cache_info,
    recompute,
    remove_gradient_listener,
    set_strict_placement,
    strict_placement,
    tensor,
)
from recurra.graph import Graph, GraphTensor

try:
    __version__ = _metadata.version("recurra-core")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "Captured",
    "CaptureError",
    "DType",
    "Device",
    "DeviceBuffer",
    "Graph",
    "OpTime",
    "Profile",
    "GradientListener",
    "GraphTensor",
    "Tensor",
    "__version__",
    "add_gradient_listener",
    "autocast",
    "autocast_dtype",
    "backends",
    "bfloat16",
    "blas_info",
    "capture",
    "empty_cache",
    "float16",
    "float32",
    "get_include",
    "get_num_threads",
    "int32",
    "is_autocast_enabled",
    "is_grad_enabled",
    "memory_stats",
    "no_grad",
    "ops",
    "param",
    "parse_device",
    "plan_cache_info",
    "profile",
    "recompute",
    "remove_gradient_listener",
    "reset_peak_memory",
    "set_num_threads",
    "set_strict_placement",
    "strict_placement",
    "tensor",
    "transfer_stats",
    "reset_transfer_stats",
    "write_atomic",
]


def get_include() -> str:
    """The directory holding ``recurra/backend.h``, the C interface for backend plugins."""
    return _os.path.join(_os.path.dirname(__file__), "include")


def set_num_threads(n: int) -> None:
    """Sets the number of CPU threads recurra uses (default: the CPUs this process may run
    on, ``os.sched_getaffinity``).

    Safe while other threads compute: it waits for their running computations, and the ones
    they start next use the new count. If the system cannot start that many threads, recurra
    keeps the threads that did start and warns (RuntimeWarning). Raises ValueError if n < 1."""
    warning = _core.set_num_threads(int(n))
    if warning:
        import warnings

        warnings.warn(warning, RuntimeWarning, stacklevel=2)


def get_num_threads() -> int:
    """The number of CPU threads recurra uses."""
    return _core.get_num_threads()


def memory_stats() -> dict[str, dict[str, int]]:
    """Bytes in use, peak bytes (the high-water mark since the start or since
    :func:`reset_peak_memory`) and allocation counts of the persistent pool (tensors the
    user keeps: weights, optimizer state) and the transient pool (planned graph arenas),
    and under ``"host_cache"`` the bytes of freed large host blocks kept for reuse (see
    :func:`empty_cache`)."""
    return _core.memory_stats()


def reset_peak_memory() -> None:
    """Sets the peak bytes of both pools (``memory_stats()[pool]["peak_bytes"]``) to the
    bytes in use now, to measure the high-water mark of what runs next."""
    _core.reset_peak_memory()


def empty_cache() -> None:
    """Gives the freed large host blocks that recurra keeps for reuse back to the system.

    Freed blocks of 1 MiB and more (at most 1 GiB in all) are kept because a training step
    allocates the same large buffers every time, and fresh memory costs page faults.
    """
    _core.empty_cache()


def transfer_stats() -> dict[str, dict[str, int]]:
    """Counts and bytes of host->device and device->host copies since the start (or since
    :func:`reset_transfer_stats`)."""
    return _core.transfer_stats()


def reset_transfer_stats() -> None:
    """Sets the transfer counters back to zero."""
    _core.reset_transfer_stats()


def blas_info() -> str:
    """The BLAS library matmul uses, or ``"none"`` (recurra's own kernel)."""
    return _core.blas_name()


def _load_blas() -> None:
    if _os.environ.get("RECURRA_NO_BLAS", "") not in ("", "0"):
        return
    # OpenBLAS's worker threads spin for 2^28 cycles (~0.1 s) after each call before they
    # sleep; between the matmuls of a training step they take the cores from recurra's own
    # thread pool (a third of the CPU time of a Mamba-2 step on two cores). 2^4 cycles: they
    # sleep at once. Read when the library loads (importing scipy_openblas32 loads it); a
    # value the user set is kept.
    _os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    try:
        import scipy_openblas32
    except ImportError:
        return
    lib = _os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so")
    if _os.path.exists(lib):
        _core.load_blas(lib)


_load_blas()
if "RECURRA_NUM_THREADS" in _os.environ:
    set_num_threads(int(_os.environ["RECURRA_NUM_THREADS"]))

_profile_from_env()

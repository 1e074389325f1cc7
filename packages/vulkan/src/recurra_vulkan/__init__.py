"""recurra's Vulkan backend.

The core finds this package through its ``recurra.backends`` entry point, which names
:func:`backend_info`. Importing this package never fails because of the machine: without a
Vulkan driver, a usable device or a loadable extension, :func:`backend_info` says why and
offers no devices (the way JAX plugins stay quiet when their driver is missing).

Environment:
    RECURRA_VULKAN_DEVICE   index (or comma list) of the devices to expose, best first
                            (discrete GPUs, integrated, then CPU devices such as lavapipe)
    RECURRA_VULKAN_PROFILE  1: print each node's GPU time to stderr
    RECURRA_VK_TRACE_BLOCKS 1: print each block of device memory made or freed to stderr
    RECURRA_VULKAN_VALIDATE 1: enable the Khronos validation layer (when installed)
    RECURRA_VK_UNFUSED      1: decline causal_conv_silu and gated_rms_norm (and their
                            backwards): the core builds them from other ops, as on a
                            backend without their kernels (comparisons of memory, speed)
"""

from __future__ import annotations

from typing import Any

__all__ = ["backend_info", "memory_info", "op_names", "run_node"]

try:
    from recurra_vulkan import _vk
except ImportError as _e:  # libvulkan.so.1 missing, or a broken build
    _vk = None  # type: ignore[assignment]  # checked as `_vk is None` below
    _IMPORT_ERROR = f"the recurra_vulkan extension could not be loaded: {_e}"
else:
    _IMPORT_ERROR = ""


def backend_info() -> dict[str, Any]:
    """Returns the backend for ``recurra.backends``.

    A dict with ``devices`` (one dict per device: index, name, kind, memory_bytes,
    max_buffer_bytes (the largest buffer; RECURRA_VK_MAX_BUFFER_MB lowers it), memory_budget
    (whether the driver reports free memory), driver, api_version, vk_index), ``reason`` (""
    when there is a device, else why not), perhaps ``skipped`` (devices passed over, and why)
    and, when there is at least one device, ``table``: a PyCapsule named
    ``"recurra.backend_table"`` holding the C backend table of ``recurra/backend.h``. Never
    raises.
    """
    if _vk is None:
        return {"devices": [], "reason": _IMPORT_ERROR}
    try:
        return _vk.backend_info()
    except Exception as e:  # noqa: BLE001 - a plugin must never break recurra
        return {"devices": [], "reason": f"Vulkan backend failed to start: {type(e).__name__}: {e}"}


def op_names() -> list[str]:
    """Names of the ops this backend runs (an empty list when the extension is missing)."""
    return [] if _vk is None else list(_vk.op_names())


def run_node(*args: Any, **kwargs: Any) -> Any:
    """Runs one node on the device (see ``recurra_vulkan._vk.run_node``); for tests.

    Raises RuntimeError when the extension is not loaded.
    """
    if _vk is None:
        raise RuntimeError(_IMPORT_ERROR)
    return _vk.run_node(*args, **kwargs)


def memory_info(device: int = 0, reset_peaks: bool = False) -> dict[str, Any]:
    """Device memory recurra holds on Vulkan device ``device`` (an index of
    ``backend_info()["devices"]``), as the driver sees it.

    ``rc.memory_stats()`` counts the tensors recurra's planner places; this adds what only the
    backend knows: per pool (``"persistent"``, ``"transient"``: graph arenas, ``"internal"``:
    op scratch) ``bytes_in_use`` and ``peak_bytes``; ``reserved_bytes`` (every block of device
    memory held) and ``peak_reserved_bytes`` (what nvidia-smi and the like show, less the
    driver's own); ``idle_bytes`` (empty blocks kept for reuse), ``blocks`` and
    ``blocks_made`` (driver allocations since the start: a steady training loop makes none). With
    ``reset_peaks`` the peaks restart from what is held now (after being read).

    Raises RuntimeError when the extension is not loaded, ValueError for a bad index.
    """
    if _vk is None:
        raise RuntimeError(_IMPORT_ERROR)
    return _vk.memory_info(device, reset_peaks)

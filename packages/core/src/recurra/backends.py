"""Backend discovery.

The CPU backend is built into the core and always present. Other backends are plugins:
separate wheels that register a function under the ``recurra.backends`` entry-point group.
A plugin that cannot start (no driver, no device, wrong ABI) is listed with the reason, and
a plugin recurra knows of that is not installed (recurra-vulkan) is listed with how to
install it; importing recurra never fails because of one. ``RECURRA_BACKENDS=cpu`` (or a comma
separated list) limits which backends load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from recurra import _core
from recurra._install import PLUGINS, install_hint


@dataclass
class BackendInfo:
    """One backend: its name, whether it can be used, its devices, or why not."""

    name: str
    available: bool
    devices: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    source: str = "builtin"  # the entry point of a plugin; "" when it is not installed
    installed: bool = True


def _allowed() -> set[str] | None:
    spec = os.environ.get("RECURRA_BACKENDS", "").strip()
    if not spec:
        return None
    return {s.strip().lower() for s in spec.split(",") if s.strip()}


def _cpu_info() -> BackendInfo:
    import platform

    mem = 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    dev = {
        "index": 0,
        "name": name,
        "threads": _core.get_num_threads(),
        "cores": os.cpu_count() or 1,
        "memory_bytes": mem,
        "blas": _core.blas_name(),
    }
    return BackendInfo("cpu", True, [dev])


_cache: list[BackendInfo] | None = None
_registered: dict[str, str] = {}  # "vulkan:0" -> backend name


def available(refresh: bool = False) -> list[BackendInfo]:
    """Every backend recurra knows of, the CPU last (it is the fallback of the scheduler).

    Plugins are loaded (and their devices registered with the core) on the first call.
    """
    global _cache
    if _cache is None or refresh:
        _cache = _discover()
    return list(_cache)


def registered_devices() -> list[str]:
    """Device names usable in ``device=`` ("vulkan:0", ...), after loading the plugins."""
    available()
    return sorted(_registered)


def release(name: str) -> None:
    """Releases a device backend: its memory is given back, and tensors still on it raise
    RuntimeError when used (they never read freed memory)."""
    _core.close_backend(name if ":" in name else f"{name}:0", True)
    _registered.pop(name if ":" in name else f"{name}:0", None)


def _discover() -> list[BackendInfo]:
    allowed = _allowed()
    found: list[BackendInfo] = []
    try:
        eps = metadata.entry_points(group="recurra.backends")
    except Exception as e:  # noqa: BLE001 - a broken environment must not break recurra
        return [BackendInfo("plugins", False, reason=f"entry points unreadable: {e}"), _cpu_info()]
    for ep in eps:
        name = ep.name.lower()
        if allowed is not None and name not in allowed:
            found.append(
                BackendInfo(name, False, reason="disabled by RECURRA_BACKENDS", source=ep.value)
            )
            continue
        try:
            probe = ep.load()
            info = probe()
            devices = list(info.get("devices", []))
            reason = info.get("reason", "") or ("" if devices else "no devices")
            if devices and info.get("table") is not None:
                for dev_name in _core.register_backend(info["table"]):
                    _registered[dev_name] = name
            elif devices:
                reason = "the plugin gave no backend table"
            ok = bool(devices) and not reason
            found.append(BackendInfo(name, ok, devices, reason, ep.value))
        except Exception as e:  # noqa: BLE001 - report, never crash
            found.append(
                BackendInfo(name, False, reason=f"{type(e).__name__}: {e}", source=ep.value)
            )
    names = {b.name for b in found}
    for name, dist in PLUGINS.items():
        if name not in names:
            why = f"{dist} is not installed (to add it, {install_hint(dist)})"
            found.append(BackendInfo(name, False, reason=why, source="", installed=False))
    found.append(_cpu_info())
    return found

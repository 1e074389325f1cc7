"""Device names: ``"cpu"`` (the native core), ``"vulkan"`` / ``"vulkan:N"`` (a backend plugin)."""

from __future__ import annotations

from dataclasses import dataclass

from recurra._install import PLUGINS, install_hint


@dataclass(frozen=True)
class Device:
    """A backend and a device index on it."""

    backend: str
    index: int = 0

    def __str__(self) -> str:
        return self.backend if self.backend == "cpu" else f"{self.backend}:{self.index}"


CPU = Device("cpu")


def parse_device(spec: str | Device | None) -> Device:
    """Parses ``None``, ``"cpu"``, ``"vulkan"`` or ``"vulkan:N"``.

    Raises ValueError for unknown names, and for a plugin backend that is not available
    (saying why).
    """
    if spec is None:
        return CPU
    if isinstance(spec, Device):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"device must be a string such as 'cpu', got {spec!r}")
    name, _, idx = spec.strip().lower().partition(":")
    if idx:
        try:
            index = int(idx)
        except ValueError:
            raise ValueError(
                f"bad device {spec!r}: the index after ':' must be an integer"
            ) from None
        if index < 0:
            raise ValueError(f"bad device {spec!r}: the index must be >= 0")
    else:
        index = 0
    if name == "cpu":
        if index != 0:
            raise ValueError(f"bad device {spec!r}: there is one CPU device, 'cpu'")
        return CPU
    from recurra import backends

    if f"{name}:{index}" in backends.registered_devices():
        return Device(name, index)
    infos = {b.name: b for b in backends.available()}
    if name in infos:
        b = infos[name]
        why = b.reason if not b.available else f"it has {len(b.devices)} device(s)"
        raise ValueError(f"device {spec!r} is not available: {why}")
    if name in PLUGINS:
        raise ValueError(
            f"device {spec!r} is not available: the {name} backend is not installed "
            f"(to add it, {install_hint(PLUGINS[name])})"
        )
    raise ValueError(f"unknown device {spec!r}: expected 'cpu' or 'vulkan[:N]'")

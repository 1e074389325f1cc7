"""The case record of the op-case registry and the input samplers its case files share."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "FORWARD_NMSE_MAX",
    "GRAD_NMSE_MAX",
    "REF_TOL",
    "FiniteDiff",
    "Node",
    "OpCase",
    "UpdateSpec",
    "away_from_zero",
    "f32",
    "normal",
    "spread",
    "uniform",
]

#: Bounds of the normalized MSE of a device result against the CPU (check-backends).
FORWARD_NMSE_MAX = 1e-7
GRAD_NMSE_MAX = 1e-7

#: (rtol, atol) of a result against the float64 reference, unless a case says otherwise.
REF_TOL = (2e-6, 1e-6)


@dataclass(frozen=True)
class UpdateSpec:
    """How an optimizer case runs: ``FusedStep([(op, extra, tensors)])`` with hyper-parameters
    ``hyper`` (see :func:`recurra.ops.pack_hyper`), run ``steps`` times. The case's inputs
    are the sources of every tensor in the op's source order, one tensor after the other."""

    op: str
    extra: tuple[int, ...]
    hyper: tuple[tuple[str, float], ...]
    sources_per_tensor: int
    steps: int = 3


@dataclass(frozen=True)
class FiniteDiff:
    """Settings of a gradient check against central finite differences: each float input
    element is moved by +-``eps`` in the float32 forward, the loss ``sum(out * R)`` is summed
    in float64, and the analytic gradient must match within ``rtol``/``atol``."""

    eps: float = 1e-3
    rtol: float = 1e-2
    atol: float = 1e-3


@dataclass(frozen=True)
class Node:
    """The case as one node of the core op ``op`` with integer parameters ``ip`` and float
    parameters ``fp`` over the case's inputs in order (``recurra.ops.apply(op, inputs, ip,
    fp)``): lets a backend's own tests run the kernel directly, e.g. on strided or
    misaligned sources."""

    op: str
    ip: tuple[int, ...] = ()
    fp: tuple[float, ...] = ()


@dataclass(frozen=True)
class OpCase:
    """One op at fixed inputs, written once for every harness.

    - ``inputs(rng)`` returns the named inputs in the order ``build`` takes them (float32
      inputs are differentiated, int32 ones are plain inputs).
    - ``build(*tensors)`` applies the op through ``recurra.ops`` (lazy tensors, graph tensors
      or tensors on a device alike) and returns one tensor or a tuple.
    - ``ref(*arrays)``: the float64 numpy reference of ``build`` (inputs as float64, int
      inputs unchanged), or None where the op has none here. ``ref_tol`` is its
      ``(rtol, atol)`` for every backend, ``ref_tols`` per backend name where they differ.
    - ``forward_tol`` / ``grad_tol``: NMSE bounds of a device against the CPU; ``note``
      documents a bound looser than the defaults.
    - ``grad``: whether the harnesses differentiate ``sum(out * R)``; ``fd`` adds a check of
      the CPU gradient against finite differences (small inputs only: two forwards per
      element).
    - ``nonfinite``: the inputs hold NaN/inf; ``nan_grad``: a NaN input must give a NaN
      gradient too.
    - ``node``: the case as one core node (see :class:`Node`), or None.
    - ``update``: an optimizer case (in place, through ``FusedStep``; no ``build``).
    """

    op: str
    name: str
    inputs: Callable[[np.random.Generator], dict[str, np.ndarray]]
    build: Callable[..., Any]
    ref: Callable[..., Any] | None = None
    ref_tol: tuple[float, float] = REF_TOL
    ref_tols: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    forward_tol: float = FORWARD_NMSE_MAX
    grad_tol: float = GRAD_NMSE_MAX
    grad: bool = True
    fd: FiniteDiff | None = None
    nonfinite: bool = False
    nan_grad: bool = False
    node: Node | None = None
    note: str = ""
    update: UpdateSpec | None = None

    @property
    def id(self) -> str:
        return f"{self.op}/{self.name}"

    def seed(self) -> int:
        """A seed that depends on the case's id only (stable across runs and processes)."""
        return zlib.crc32(self.id.encode())

    def make_inputs(self) -> dict[str, np.ndarray]:
        """The case's inputs, from its own seed."""
        return self.inputs(np.random.default_rng(self.seed()))

    def tol_for(self, backend: str) -> tuple[float, float]:
        """(rtol, atol) against the reference on ``backend`` ("cpu", "vulkan:0", ...)."""
        return self.ref_tols.get(backend.partition(":")[0], self.ref_tol)


# ---- input samplers (float32, C-contiguous) ----------------------------------------------
def f32(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return f32(rng.standard_normal(shape) * scale)


def away_from_zero(rng: np.random.Generator, *shape: int, gap: float = 0.25) -> np.ndarray:
    """Normal values pushed out of (-gap, gap): inputs of kinks (relu, abs) and of divisors."""
    x = rng.standard_normal(shape)
    return f32(np.where(np.abs(x) < gap, np.copysign(gap, x) + x, x))


def uniform(rng: np.random.Generator, lo: float, hi: float, *shape: int) -> np.ndarray:
    return f32(rng.uniform(lo, hi, shape))


def spread(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Distinct values (a shuffled grid plus a little noise): max has a unique argmax, and
    clamp has no element on a bound."""
    n = int(np.prod(shape))
    grid = np.linspace(-2.0, 2.0, n + 2)[1:-1] + rng.uniform(-0.3, 0.3, n) * (4.0 / (n + 1))
    return f32(rng.permutation(grid).reshape(shape))

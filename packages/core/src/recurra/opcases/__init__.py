"""One registry of op cases (like ggml's test-backend-ops or PyTorch's OpInfo).

Each op's cases are written once, here, and drive every harness:

- the CPU tests (``tests/core/test_opcases.py``): the forward against the case's float64
  numpy reference, the gradient against finite differences (cases with ``fd``), NaN
  propagation (cases with ``nonfinite``), and that a case's ``node`` is the op it builds;
- the device tests (``tests/vulkan/test_vulkan_ops.py``): the same cases on
  ``device="vulkan"`` against the same references, through the scheduler against the CPU
  (forward, gradients, placement), and each ``node`` straight on the backend's kernels with
  dense, strided and misaligned sources;
- ``recurra check-backends`` (:mod:`recurra.check_backends`): every case on every device
  backend against the CPU.

A case is an :class:`OpCase`: the op, a case name, a function of a ``numpy.random.Generator``
that makes the named inputs (seeded from the case id), ``build`` (the op through
``recurra.ops``), ``ref`` (float64 numpy), gradient-check settings (``grad``, ``fd``),
tolerances (``ref_tol``, per backend ``ref_tols``; NMSE bounds against the CPU
``forward_tol``/``grad_tol``) and, where it is one core node, ``node``.

Case files, one per family of ops: :mod:`.elementwise`, :mod:`.shape`, :mod:`.reduce`,
:mod:`.linalg`, :mod:`.nn`, :mod:`.recurrent`, :mod:`.optim`. Each has ``cases()``.

Adding a case
-------------
- A unary op with a backward (say ``erf``): one line in ``unary_cases()`` of
  :mod:`.elementwise`::

      *unary("erf", ops.erf, _erf, _n(2.0)),

  (the op name, its wrapper, the float64 reference, the input sampler; ``fp=`` the core op's
  float parameters, ``fp=None`` when the wrapper is no single node). That gives it every
  shape of ``UNARY_SHAPES``, a finite-difference case, two NaN cases, the Vulkan node and
  layout checks and its check-backends rows; no test file changes.
- A binary op: one line in ``binary_cases()`` (``binary(op, wrapper, numpy_ufunc)``).
- Any other op: an ``OpCase(...)`` (or a small helper making several) in the family's
  ``cases()``; a new family is a module with ``cases()`` named in ``FAMILIES`` below.
- An op with no case yet: its name and why in ``NOT_COVERED`` (check-backends lists it).

Ids (``op/name``) are unique; inputs depend only on the id (:meth:`OpCase.seed`).
"""

from __future__ import annotations

from importlib import import_module

from recurra.opcases._case import (
    FORWARD_NMSE_MAX,
    GRAD_NMSE_MAX,
    REF_TOL,
    FiniteDiff,
    Node,
    OpCase,
    UpdateSpec,
)
from recurra.opcases._run import (
    HALF_ULP,
    evaluate,
    fd_errors,
    half_errors,
    half_grad_errors,
    nan_grad_errors,
    reference,
    reference_errors,
)

__all__ = [
    "FAMILIES",
    "FORWARD_NMSE_MAX",
    "GRAD_NMSE_MAX",
    "HALF_ULP",
    "NOT_COVERED",
    "REF_TOL",
    "FiniteDiff",
    "Node",
    "OpCase",
    "UpdateSpec",
    "cases",
    "evaluate",
    "fd_errors",
    "half_errors",
    "half_grad_errors",
    "nan_grad_errors",
    "op_names",
    "reference",
    "reference_errors",
]

#: The case files, in listing order.
FAMILIES = ("elementwise", "shape", "reduce", "linalg", "nn", "recurrent", "optim")

#: Public names of recurra.ops without a case, and why (none today; helpers such as
#: ``apply`` and ``pack_hyper`` are not ops).
NOT_COVERED: dict[str, str] = {}

_CASES: list[OpCase] | None = None


def _collect() -> list[OpCase]:
    out: list[OpCase] = []
    for fam in FAMILIES:
        out += import_module(f"recurra.opcases.{fam}").cases()
    # grouped by op, in the order each op first appears
    order = {op: i for i, op in reversed(list(enumerate(c.op for c in out)))}
    out.sort(key=lambda c: order[c.op])
    seen: set[str] = set()
    for c in out:
        if c.id in seen:
            raise ValueError(f"op case {c.id} is registered twice")
        seen.add(c.id)
    return out


def cases() -> list[OpCase]:
    """Every case, grouped by op (built once)."""
    global _CASES
    if _CASES is None:
        _CASES = _collect()
    return list(_CASES)


def op_names() -> list[str]:
    """The ops that have cases, in case order."""
    return list(dict.fromkeys(c.op for c in cases()))

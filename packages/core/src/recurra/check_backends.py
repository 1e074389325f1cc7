"""Every op on every device backend against the CPU: ``python -m recurra.check_backends``.

Like ggml's test-backend-ops. The cases are those of the op-case registry
(:mod:`recurra.opcases`, which the CPU and Vulkan tests run too); the text output and the
command line are in :mod:`recurra._check_report`. Each case is built twice with the
explicit graph API: once for the CPU (the reference) and once with the backend under test
preferred (``recurra.Graph(backends=[name])``). Both graphs get the same inputs and a loss
``sum(out * R)`` with a fixed random ``R`` per output, and are differentiated with respect to
every float input. The check compares

- the forward results and the gradients with the normalized MSE
  ``sum((x - ref)**2) / sum(ref**2)`` (integer results: exact), against ``FORWARD_NMSE_MAX`` /
  ``GRAD_NMSE_MAX`` unless the case documents a looser bound;
- the placement: the scheduler reports which backend computed each node
  (``Graph.placement()``); a case whose nodes all ran on the backend under test is ``ok``, a
  case with nodes that fell back to the CPU is ``unsupported`` (its numbers are still
  compared: the nodes that did run on the device must agree).

Verdicts: ``ok``, ``unsupported``, ``MISMATCH`` (a result beyond its bound), ``ERROR`` (an
exception while building or running). Exit codes of :func:`main`: 0 when every case is
``ok`` or ``unsupported`` (with ``--strict`` only ``ok``), 1 on any mismatch or error, 2 for
bad arguments (an unknown op or backend), 3 when no backend other than the CPU is available
(0 with ``--allow-cpu-only``). ``--backend cpu`` compares the CPU with itself: a self-test of
the cases, not of a backend.

The optimizer update ops (sgd_step, adam_step, adamw_step, lion_step, grad_clip) write into
their sources, so they run through :class:`recurra.ops.FusedStep` on tensors that live on the
backend under test (``recurra.tensor(x, device=...)``), and the updated parameters, moments
and step counts are compared. Their placement needs no count: the core runs an in-place op
where the memory it writes lives and raises when that backend has no kernel for it (never a
silent CPU fallback), so a run that completes ran on the device; the "no kernel" error is
reported as ``unsupported``. ``grad_norm`` is an ordinary node and gets a graph case.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import recurra as rc
from recurra import ops
from recurra._install import PLUGINS, install_hint
from recurra.opcases import (
    FORWARD_NMSE_MAX,
    GRAD_NMSE_MAX,
    NOT_COVERED,
    OpCase,
    UpdateSpec,
    cases,
    op_names,
)
from recurra.opcases._case import f32 as _f32

__all__ = [
    "EXIT_MISMATCH",
    "EXIT_NO_BACKEND",
    "EXIT_OK",
    "EXIT_USAGE",
    "FORWARD_NMSE_MAX",
    "GRAD_NMSE_MAX",
    "NOT_COVERED",
    "BackendUnavailableError",
    "Case",
    "CaseResult",
    "UnknownBackendError",
    "UnknownOpError",
    "UpdateSpec",
    "cases",
    "check",
    "check_case",
    "compare",
    "device_backends",
    "exit_code",
    "format_row",
    "format_table",
    "main",
    "nmse",
    "no_device_message",
    "op_names",
    "resolve_backends",
    "select_cases",
    "summary",
    "to_json",
]


#: A case of the op-case registry (:mod:`recurra.opcases`), where the cases live.
Case = OpCase

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_NO_BACKEND = 0, 1, 2, 3

OK, UNSUPPORTED, MISMATCH, ERROR = "ok", "unsupported", "MISMATCH", "ERROR"

# Ops that only re-describe memory (no computation) when their source is dense: a CPU
# location reported for them is the location of the leaf they view, not a fallback.
_VIEW_OPS = frozenset({"reshape", "permute", "slice", "broadcast_to"})


class UnknownOpError(ValueError):
    """An op name without cases."""


class UnknownBackendError(ValueError):
    """A backend name recurra does not know."""


class BackendUnavailableError(RuntimeError):
    """A known backend that cannot run here (no device, no driver, disabled)."""


def select_cases(op_filter: Iterable[str] | None = None) -> list[Case]:
    """The cases of the named ops (exact names; all cases for None or an empty list).

    Raises UnknownOpError naming the unknown ops (and, for an uncovered op, why).
    """
    wanted = list(dict.fromkeys(op_filter or ()))
    if not wanted:
        return cases()
    known = set(op_names())
    bad = [w for w in wanted if w not in known]
    if bad:
        why = "; ".join(f"{b}: {NOT_COVERED[b]}" for b in bad if b in NOT_COVERED)
        raise UnknownOpError(
            f"no cases for op(s) {', '.join(bad)}"
            + (f" ({why})" if why else "")
            + f"; ops with cases: {', '.join(op_names())}"
        )
    return [c for c in cases() if c.op in wanted]


# ------------------------------------------------------------------------------------------
# backends
# ------------------------------------------------------------------------------------------
def device_backends() -> list[str]:
    """The device names of every usable backend other than the CPU (``["vulkan:0"]``...)."""
    from recurra import backends

    backends.available()
    return backends.registered_devices()


def resolve_backends(names: Iterable[str] | None = None) -> list[str]:
    """Device names to check: every non-CPU device for None/empty; ``"vulkan"`` means each
    Vulkan device, ``"vulkan:1"`` that one, ``"cpu"`` the CPU itself (a self-test).

    Raises UnknownBackendError for a name recurra does not know and BackendUnavailableError
    for a known backend without a usable device (the message says why).
    """
    from recurra import backends

    infos = {b.name: b for b in backends.available()}
    registered = device_backends()
    wanted = [n.strip().lower() for n in (names or ()) if n.strip()]
    if not wanted:
        return registered
    out: list[str] = []
    for spec in wanted:
        base, _, idx = spec.partition(":")
        if base == "cpu":
            if idx not in ("", "0"):
                raise UnknownBackendError(f"unknown backend {spec!r}: there is one CPU, 'cpu'")
            found = ["cpu"]
        elif idx:
            found = [spec] if spec in registered else []
        else:
            found = [d for d in registered if d.partition(":")[0] == base]
        if not found:
            if base in infos or base in PLUGINS:
                info = infos.get(base)
                if info is not None and info.available:
                    why = f"it has no device {spec!r} (devices: {', '.join(registered)})"
                elif info is not None:
                    why = info.reason or "no usable device"
                else:
                    hint = install_hint(PLUGINS[base])
                    why = f"the {base} backend is not installed (to add it, {hint})"
                raise BackendUnavailableError(f"backend {spec!r} is unavailable: {why}")
            known = sorted(set(infos) | {"cpu"})
            raise UnknownBackendError(
                f"unknown backend {spec!r}; known backends: {', '.join(known)}"
            )
        out += [d for d in found if d not in out]
    return out


def no_device_message() -> str:
    """Why there is nothing to compare: each device backend and why it cannot start (a
    backend that is installed but has no driver or device says so; one that is not installed
    says how to install it)."""
    from recurra import backends

    whys = [f"{b.name}: {b.reason}" for b in backends.available() if b.name != "cpu"]
    return (
        "no backend other than the CPU is available, so there is nothing to compare ("
        + ("; ".join(whys) or "no backend plugin is known")
        + ")"
    )


# ------------------------------------------------------------------------------------------
# the comparison
# ------------------------------------------------------------------------------------------
def nmse(got: np.ndarray, ref: np.ndarray) -> float:
    """Normalized mean squared error sum((got - ref)**2) / sum(ref**2), in float64.

    When ref is all zeros the plain sum of squares is returned (0 only for an exact match).
    Raises ValueError when the shapes differ.
    """
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"nmse: shapes differ: {got.shape} vs {ref.shape}")
    num = float(np.sum((got - ref) ** 2))
    den = float(np.sum(ref * ref))
    return num / den if den > 0 else num


def compare(got: np.ndarray | None, ref: np.ndarray | None) -> float:
    """The error of one result against its reference: the NMSE over the non-NaN positions
    for floats, 0 or inf for integers (exact), inf for a shape/dtype mismatch, a NaN pattern
    that differs, a non-finite value where the reference is finite, or a result on only one
    side. Two missing results compare as 0."""
    if got is None or ref is None:
        return 0.0 if got is None and ref is None else math.inf
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        return math.inf
    if ref.dtype.kind in "iu" or got.dtype.kind in "iu":
        return 0.0 if got.dtype == ref.dtype and np.array_equal(got, ref) else math.inf
    ref_nan, got_nan = np.isnan(ref), np.isnan(got)
    if not np.array_equal(ref_nan, got_nan):
        return math.inf
    keep = ~ref_nan
    g, r = got[keep], ref[keep]
    if not np.array_equal(np.isinf(g), np.isinf(r)) or not np.array_equal(
        g[np.isinf(g)], r[np.isinf(r)]
    ):
        return math.inf
    fin = np.isfinite(r)
    return nmse(g[fin], r[fin])


@dataclass
class _Run:
    outputs: list[np.ndarray]
    grads: dict[str, np.ndarray | None]
    placement: dict[str, int]
    fallback: list[str]


def _run_case(case: Case, data: dict[str, np.ndarray], backend: str | None) -> _Run:
    """Builds ``case`` as one graph (preferring ``backend``; None: the plain CPU graph),
    differentiates sum(out * R) and computes it. Returns results, gradients and placement."""
    g = rc.Graph(backends=[backend] if backend not in (None, "cpu") else None)
    leaves = []
    for name, arr in data.items():
        if arr.dtype == np.float32 and case.grad:
            leaves.append(g.param(arr.shape, name=name))
        else:
            dtype = "float32" if arr.dtype == np.float32 else "int32"
            leaves.append(g.input(arr.shape, dtype=dtype, name=name))
    res = case.build(*leaves)
    outs = list(res) if isinstance(res, tuple) else [res]
    for o in outs:
        if o.op != "leaf":
            g.set_output(o)
    grads: dict[str, Any] = {}
    floats = [o for o in outs if o.dtype == "float32"]
    if case.grad and floats:
        rng = np.random.default_rng(case.seed() + 1)
        loss = None
        for o in floats:
            r = g.constant(_f32(rng.standard_normal(o.shape)))
            term = ops.sum(ops.mul(o, r))
            loss = term if loss is None else ops.add(loss, term)
        assert loss is not None
        g.set_loss(loss)
        g.build_backward(loss)
        for leaf in leaves:
            if leaf.dtype == "float32":
                gr = leaf.grad
                if gr is not None and gr.op != "leaf":
                    g.set_output(gr)
                grads[leaf.name] = gr
    for leaf, arr in zip(leaves, data.values()):
        g.set_data(leaf, arr)
    g.compute()
    placement = g.placement()
    fallback: list[str] = []
    if backend not in (None, "cpu") and placement.get("cpu", 0):
        for i in range(g.n_nodes):
            t = rc.GraphTensor(g, i, (), "float32")
            op = t.op
            if op != "leaf" and op not in _VIEW_OPS and g.backend_of(t) == "cpu":
                fallback.append(op)
    return _Run(
        outputs=[o.numpy() for o in outs],
        grads={k: (v.numpy() if v is not None else None) for k, v in grads.items()},
        placement=placement,
        fallback=list(dict.fromkeys(fallback)),
    )


def _run_update(case: Case, data: dict[str, np.ndarray], backend: str | None) -> _Run:
    """Runs an optimizer case through FusedStep on host arrays (backend None or "cpu") or on
    tensors in ``backend``'s memory; returns every source after the steps."""
    spec = case.update
    assert spec is not None
    on_device = backend not in (None, "cpu")
    srcs: list[Any] = [
        rc.tensor(a.copy(), device=backend) if on_device else a.copy() for a in data.values()
    ]
    n = spec.sources_per_tensor
    rows = [tuple(srcs[i : i + n]) for i in range(0, len(srcs), n)]
    step = ops.FusedStep([(spec.op, spec.extra, rows)])
    step.set_hyper(0, dict(spec.hyper))
    for _ in range(spec.steps):
        step.run()
    where = backend if on_device and backend is not None else "cpu"
    return _Run(
        outputs=[np.asarray(s) for s in srcs],
        grads={},
        placement={where: len(rows)},
        fallback=[],
    )


def _no_kernel(exc: BaseException) -> bool:
    """Whether an exception says that the device has no kernel for an in-place update."""
    return "no kernel" in str(exc)


@dataclass
class CaseResult:
    """The outcome of one case on one backend."""

    op: str
    case: str
    backend: str
    verdict: str
    forward_nmse: float | None = None
    grad_nmse: float | None = None
    forward_tol: float = FORWARD_NMSE_MAX
    grad_tol: float = GRAD_NMSE_MAX
    placement: dict[str, int] = field(default_factory=dict)
    fallback_ops: list[str] = field(default_factory=list)
    worst_grad: str = ""
    message: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.verdict in (MISMATCH, ERROR)

    def placement_text(self) -> str:
        """E.g. ``"vulkan:0 7"`` or ``"vulkan:0 5, cpu 2 (ssm_scan_back)"``."""
        if not self.placement:
            return "-"
        parts = [f"{b} {n}" for b, n in self.placement.items()]
        text = ", ".join(parts)
        return text + (f" ({', '.join(self.fallback_ops)})" if self.fallback_ops else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "case": self.case,
            "backend": self.backend,
            "verdict": self.verdict,
            "forward_nmse": _json_num(self.forward_nmse),
            "grad_nmse": _json_num(self.grad_nmse),
            "forward_tol": self.forward_tol,
            "grad_tol": self.grad_tol,
            "placement": self.placement,
            "fallback_ops": self.fallback_ops,
            "worst_grad": self.worst_grad or None,
            "message": self.message or None,
            "seconds": round(self.seconds, 4),
        }


def _json_num(v: float | None) -> float | str | None:
    if v is None or math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else "inf"


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:300]


def check_case(case: Case, backend: str) -> CaseResult:
    """Runs one case on the CPU and on ``backend`` and compares them; never raises (an
    exception becomes an ERROR verdict with the message)."""
    t0 = time.perf_counter()
    res = CaseResult(
        case.op, case.name, backend, ERROR, forward_tol=case.forward_tol, grad_tol=case.grad_tol
    )
    data = case.inputs(np.random.default_rng(case.seed()))
    run = _run_update if case.update is not None else _run_case
    try:
        ref = run(case, data, None)
    except Exception as e:  # noqa: BLE001 - reported as a verdict
        res.message = f"the CPU reference failed: {_short(e)}"
        res.seconds = time.perf_counter() - t0
        return res
    try:
        got = run(case, data, backend)
    except Exception as e:  # noqa: BLE001 - reported as a verdict
        if case.update is not None and _no_kernel(e):
            res.verdict = UNSUPPORTED
            res.message = f"no kernel on {backend}: {_short(e)}"
        else:
            res.message = _short(e)
        res.seconds = time.perf_counter() - t0
        return res
    res.placement, res.fallback_ops = got.placement, got.fallback
    res.forward_nmse = max((compare(a, b) for a, b in zip(got.outputs, ref.outputs)), default=0.0)
    if len(got.outputs) != len(ref.outputs):
        res.forward_nmse = math.inf
    if case.grad and ref.grads:
        worst, worst_name = -1.0, ""
        for name, want in ref.grads.items():
            err = compare(got.grads.get(name), want)
            if err > worst or math.isnan(err):
                worst, worst_name = err, name
        res.grad_nmse, res.worst_grad = worst, worst_name
    bad = []
    if not res.forward_nmse <= case.forward_tol:
        bad.append(f"forward NMSE {res.forward_nmse:.3g} > {case.forward_tol:g}")
    if res.grad_nmse is not None and not res.grad_nmse <= case.grad_tol:
        bad.append(f"gradient of {res.worst_grad} NMSE {res.grad_nmse:.3g} > {case.grad_tol:g}")
    if bad:
        res.verdict, res.message = MISMATCH, "; ".join(bad)
    elif backend != "cpu" and set(res.placement) - {backend}:
        res.verdict = UNSUPPORTED
        where = ", ".join(res.fallback_ops) or "some nodes"
        res.message = f"ran on the CPU: {where}"
    else:
        res.verdict = OK
    res.seconds = time.perf_counter() - t0
    return res


def check(
    op_filter: Iterable[str] | None = None,
    backends: Iterable[str] | None = None,
    *,
    on_result: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Runs the selected cases on the selected backends (see :func:`select_cases` and
    :func:`resolve_backends`; default: all cases on every non-CPU device). Calls
    ``on_result`` after each case. Returns the results in run order (backend-major).

    Raises UnknownOpError, UnknownBackendError or BackendUnavailableError for bad
    selections; returns an empty list when no backend is selected or available.
    """
    selected = select_cases(op_filter)
    devices = resolve_backends(backends)
    out: list[CaseResult] = []
    for dev in devices:
        for case in selected:
            r = check_case(case, dev)
            out.append(r)
            if on_result is not None:
                on_result(r)
    return out


def exit_code(results: Sequence[CaseResult], strict: bool = False) -> int:
    """EXIT_MISMATCH when a case failed (or, with ``strict``, was unsupported), else 0."""
    if any(r.failed for r in results):
        return EXIT_MISMATCH
    if strict and any(r.verdict == UNSUPPORTED for r in results):
        return EXIT_MISMATCH
    return EXIT_OK


def summary(results: Sequence[CaseResult]) -> dict[str, int]:
    """Counts per verdict (every verdict present, 0 when absent)."""
    counts = {OK: 0, UNSUPPORTED: 0, MISMATCH: 0, ERROR: 0}
    for r in results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    return counts


def to_json(results: Sequence[CaseResult], backends: Sequence[str], code: int) -> dict[str, Any]:
    """The JSON document of a run: backends, per-case results, counts and the exit code."""
    return {
        "backends": list(backends),
        "results": [r.as_dict() for r in results],
        "summary": summary(results),
        "exit_code": code,
    }


# The text output and the command line (imported last: they use this module).
from recurra._check_report import format_row, format_table, main  # noqa: E402

if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the reader went away (`| head`): not an error of the check
        sys.stderr.close()
        sys.exit(EXIT_OK)

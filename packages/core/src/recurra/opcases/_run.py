"""Runs an op case with lazy tensors (on the CPU or a device) against its float64
reference, its gradient against finite differences, and its NaN propagation. Each check
returns a list of problems (empty: it passed), so tests and tools can report them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from recurra.opcases._case import OpCase

__all__ = ["evaluate", "fd_errors", "nan_grad_errors", "reference", "reference_errors"]


def _as_list(res: Any) -> list[Any]:
    return list(res) if isinstance(res, (tuple, list)) else [res]


def _where(device: str | None) -> str:
    return device or "cpu"


def _tensors(
    case: OpCase, data: dict[str, np.ndarray], device: str | None, grad: bool
) -> list[Any]:
    import recurra as rc

    dev = None if device in (None, "cpu") else device
    out = []
    for arr in data.values():
        if grad and arr.dtype == np.float32:
            out.append(rc.param(arr, device=dev))
        else:
            out.append(rc.tensor(arr, device=dev))
    return out


def evaluate(
    case: OpCase, data: dict[str, np.ndarray] | None = None, device: str | None = None
) -> list[np.ndarray]:
    """The case's results computed by recurra on ``device`` (None: the CPU)."""
    data = case.make_inputs() if data is None else data
    res = case.build(*_tensors(case, data, device, False))
    return [np.asarray(r.numpy()) for r in _as_list(res)]


def reference(case: OpCase, data: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
    """The case's float64 reference results (float inputs widened to float64)."""
    if case.ref is None:
        raise ValueError(f"op case {case.id} has no reference")
    data = case.make_inputs() if data is None else data
    args = [a.astype(np.float64) if a.dtype.kind == "f" else a for a in data.values()]
    with np.errstate(all="ignore"):
        return [np.asarray(r, dtype=np.float64) for r in _as_list(case.ref(*args))]


def _close(got: np.ndarray, want: np.ndarray, rtol: float, atol: float, nonfinite: bool) -> str:
    """'' when got matches want, else what differs."""
    if got.shape != want.shape:
        return f"shape {got.shape}, want {want.shape}"
    if got.dtype.kind in "iu":
        return "" if np.array_equal(got, want) else "integer results differ"
    g = got.astype(np.float64)
    if nonfinite:
        if not np.array_equal(np.isnan(g), np.isnan(want)):
            where = [np.flatnonzero(np.isnan(v))[:8] for v in (g, want)]
            return f"NaN at {where[0]}, want NaN at {where[1]}"
        inf = np.isinf(want) | np.isinf(g)
        if not np.array_equal(g[inf], want[inf]):
            return f"infinities differ: {g[inf][:8]} vs {want[inf][:8]}"
        keep = np.isfinite(want) & np.isfinite(g)
        g, want = g[keep], want[keep]
    elif not np.all(np.isfinite(g)):
        return "non-finite values where the reference is finite"
    bad = np.abs(g - want) > atol + rtol * np.abs(want)
    if not bad.any():
        return ""
    i = int(np.flatnonzero(bad)[0])
    worst = float(np.max(np.abs(g - want)))
    return (
        f"{int(bad.sum())} of {bad.size} elements beyond rtol {rtol:g}, atol {atol:g} "
        f"(first: {g.reshape(-1)[i]!r} vs {want.reshape(-1)[i]!r}; max abs error {worst:.3g})"
    )


def reference_errors(case: OpCase, device: str | None = None) -> list[str]:
    """The forward on ``device`` against the float64 reference, with the case's tolerance
    for that backend. Returns the problems (none: it matches)."""
    data = case.make_inputs()
    want = reference(case, data)
    got = evaluate(case, data, device)
    if len(got) != len(want):
        return [f"{case.id} on {_where(device)}: {len(got)} results, want {len(want)}"]
    rtol, atol = case.tol_for(_where(device))
    out = []
    for k, (g, w) in enumerate(zip(got, want)):
        why = _close(g, w, rtol, atol, case.nonfinite)
        if why:
            out.append(f"{case.id} on {_where(device)}, result {k}: {why}")
    return out


def _weights(outs: Sequence[Any], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(tuple(o.shape)).astype(np.float32) for o in outs]


def _grads(case: OpCase, data: dict[str, np.ndarray], device: str | None) -> dict[str, Any]:
    """The gradients of sum(out * R) for each float input (R fixed by the case's seed)."""
    from recurra import ops

    leaves = _tensors(case, data, device, True)
    outs = [o for o in _as_list(case.build(*leaves)) if o.dtype == "float32"]
    loss = None
    for o, w in zip(outs, _weights(outs, case.seed() + 1)):
        term = ops.sum(ops.mul(o, w))
        loss = term if loss is None else ops.add(loss, term)
    if loss is None:
        return {}
    loss.backward()
    return {
        name: (None if t.grad is None else np.asarray(t.grad.numpy()))
        for (name, arr), t in zip(data.items(), leaves)
        if arr.dtype == np.float32
    }


def fd_errors(case: OpCase) -> list[str]:
    """The CPU gradient against central finite differences (``case.fd`` settings): each
    float input element moved by +-eps in the float32 forward, the loss summed in float64."""
    fd = case.fd
    if fd is None:
        raise ValueError(f"op case {case.id} has no finite-difference settings")
    data = case.make_inputs()
    analytic = _grads(case, data, None)
    weights: list[np.ndarray] | None = None

    def loss(values: dict[str, np.ndarray]) -> float:
        nonlocal weights
        outs = [o for o in evaluate(case, values) if o.dtype == np.float32]
        if weights is None:
            weights = _weights(outs, case.seed() + 1)
        return float(sum(np.sum(o.astype(np.float64) * w) for o, w in zip(outs, weights)))

    loss(data)
    out = []
    for name, g in analytic.items():
        work = {k: v.copy() for k, v in data.items()}
        flat = work[name].reshape(-1)
        numeric = np.zeros(flat.size)
        for j in range(flat.size):
            orig = flat[j]
            flat[j] = orig + np.float32(fd.eps)
            up = loss(work)
            flat[j] = orig - np.float32(fd.eps)
            down = loss(work)
            flat[j] = orig
            numeric[j] = (up - down) / (2 * fd.eps)
        got = np.zeros(flat.size) if g is None else g.reshape(-1).astype(np.float64)
        bad = np.abs(got - numeric) > fd.atol + fd.rtol * np.abs(numeric)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            out.append(
                f"{case.id}: gradient of {name} differs from finite differences at "
                f"{int(bad.sum())} of {bad.size} elements (first [{i}]: {got[i]:.6g} vs "
                f"{numeric[i]:.6g})"
            )
    return out


def nan_grad_errors(case: OpCase, device: str | None = None) -> list[str]:
    """For a case with NaN inputs and ``nan_grad``: the gradient is NaN wherever its input
    is NaN (a NaN is never hidden as 0)."""
    data = case.make_inputs()
    out = []
    for name, g in _grads(case, data, device).items():
        nan_in = np.isnan(data[name])
        if g is None or not np.isnan(g[nan_in]).all():
            out.append(
                f"{case.id} on {_where(device)}: gradient of {name} at NaN inputs is "
                f"{None if g is None else g[nan_in][:8]}"
            )
    return out

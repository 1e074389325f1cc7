"""Runs an op case with lazy tensors (on the CPU or a device) against its float64
reference, its gradient against finite differences, and its NaN propagation. Each check
returns a list of problems (empty: it passed), so tests and tools can report them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from recurra.opcases._case import OpCase

__all__ = [
    "HALF_ULP",
    "evaluate",
    "fd_errors",
    "half_errors",
    "half_grad_errors",
    "nan_grad_errors",
    "reference",
    "reference_errors",
]


def _as_list(res: Any) -> list[Any]:
    return list(res) if isinstance(res, (tuple, list)) else [res]


def _where(device: str | None) -> str:
    return device or "cpu"


def _tensors(
    case: OpCase,
    data: dict[str, np.ndarray],
    device: str | None,
    grad: bool,
    dtype: str | None = None,
) -> list[Any]:
    import recurra as rc

    dev = None if device in (None, "cpu") else device
    out = []
    for arr in data.values():
        if grad and arr.dtype.kind not in "iub":
            out.append(rc.param(arr, device=dev, dtype=dtype))
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


def _grads(
    case: OpCase, data: dict[str, np.ndarray], device: str | None, dtype: str | None = None
) -> dict[str, Any]:
    """The gradients of sum(out * R) for each float input (R fixed by the case's seed); with
    ``dtype``, the float inputs are parameters of that dtype (R multiplies in float32)."""
    import recurra as rc
    from recurra import ops

    leaves = _tensors(case, data, device, True, dtype)
    outs = [o for o in _as_list(case.build(*leaves)) if o.dtype == (dtype or "float32")]
    loss = None
    for o, w in zip(outs, _weights(outs, case.seed() + 1)):
        term = ops.sum(ops.mul(o if dtype is None else o.to(rc.float32), w))
        loss = term if loss is None else ops.add(loss, term)
    if loss is None:
        return {}
    loss.backward()
    return {
        name: (None if t.grad is None else np.asarray(t.grad.numpy()))
        for (name, arr), t in zip(data.items(), leaves)
        if arr.dtype.kind not in "iub"
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


# ---- bfloat16 / float16 -------------------------------------------------------------------
#: Half a unit in the last place, relative: what rounding one float32 result to the dtype may
#: cost (8 significant bits in bfloat16, 11 in float16).
HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def _in_dtype(data: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The case's inputs with every float32 one rounded to ``dtype`` (int inputs as they are)."""
    from recurra._dtype import as_dtype

    want = as_dtype(dtype).numpy
    return {k: v.astype(want) if v.dtype == np.float32 else v for k, v in data.items()}


def _widened(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """2-byte float inputs as float32 (exactly)."""
    return {k: v if v.dtype.kind in "iub" else v.astype(np.float32) for k, v in data.items()}


def half_errors(case: OpCase, dtype: str) -> list[str]:
    """The case run in ``dtype`` ("bfloat16" or "float16") against its float64 reference on
    the same (rounded) inputs: each result within half an ulp of the dtype plus the case's
    own float32 tolerance, or equal to the reference rounded to the dtype (where that
    overflows to infinity or underflows to zero)."""
    from recurra._dtype import as_dtype

    data = _in_dtype(case.make_inputs(), dtype)
    want = reference(case, _widened(data))
    got = evaluate(case, data)
    rtol, atol = case.tol_for("cpu")
    tol = HALF_ULP[dtype] + rtol
    out = []
    for k, (g, w) in enumerate(zip(got, want)):
        if g.dtype != as_dtype(dtype).numpy:
            out.append(f"{case.id} in {dtype}, result {k}: dtype {g.dtype}")
            continue
        g64 = g.astype(np.float64)
        w_r = w.astype(as_dtype(dtype).numpy).astype(np.float64)
        same = (g64 == w_r) | (np.isnan(g64) & np.isnan(w))
        with np.errstate(invalid="ignore"):
            near = np.abs(g64 - w) <= atol + tol * np.abs(w)
        bad = ~(same | near)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            out.append(
                f"{case.id} in {dtype}, result {k}: {int(bad.sum())} of {bad.size} elements "
                f"beyond rtol {tol:.3g} (first: {g64.reshape(-1)[i]!r} vs {w.reshape(-1)[i]!r})"
            )
    return out


def half_grad_errors(case: OpCase, dtype: str, ulps: float = 8.0) -> list[str]:
    """The gradients of ``sum(out * R)`` computed in ``dtype`` (parameters of that dtype,
    gradients of it) against the same computed in float32 from the same rounded inputs:
    within ``ulps`` half-ulps of max(1, the gradient's largest magnitude). A backward rule
    chains a few ops, each rounding its result, and may cancel: tanh's ``1 - y^2`` from a
    rounded ``y`` is off by about 2^-8 absolute in bfloat16 (R is of order 1)."""
    from recurra._dtype import as_dtype

    half = _in_dtype(case.make_inputs(), dtype)
    want = _grads(case, _widened(half), None)
    got = _grads(case, half, None, dtype)
    out = []
    for name, w in want.items():
        g = got.get(name)
        if w is None or g is None:
            if (w is None) != (g is None):
                out.append(f"{case.id} in {dtype}: gradient of {name}: {g!r} vs {w!r}")
            continue
        if g.dtype != as_dtype(dtype).numpy:
            out.append(f"{case.id} in {dtype}: gradient of {name} has dtype {g.dtype}")
            continue
        scale = max(1.0, float(np.max(np.abs(w))) if w.size else 0.0)
        err = np.abs(g.astype(np.float64) - w.astype(np.float64))
        if err.size and not np.all(err <= ulps * HALF_ULP[dtype] * scale + 1e-30):
            out.append(
                f"{case.id} in {dtype}: gradient of {name} off by {float(err.max()):.3g} "
                f"(scale {scale:.3g}, bound {ulps * HALF_ULP[dtype] * scale:.3g})"
            )
    return out

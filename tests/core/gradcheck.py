"""Gradient checks against central finite differences.

``check_grads(fn, arrays)`` makes each float array a recurra parameter, evaluates
``L = sum_k sum(out_k * R_k)`` for fixed random R (so every output element matters with a
different weight), and compares recurra's gradient of L with central differences of L.
The differences perturb each element by ±eps in the float32 forward of recurra itself and
accumulate L in float64, so their error is about 1e-7 * |L| / eps: with the default
eps = 1e-3 a relative tolerance of 1e-2 leaves a wide margin above float32 rounding while
still catching any wrong term of a gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

import recurra as rc


def _outputs(res: Any) -> list[Any]:
    return list(res) if isinstance(res, (tuple, list)) else [res]


def _weights(outs: list[Any], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(o.shape).astype(np.float32) for o in outs]


def check_grads(
    fn: Callable[..., Any],
    arrays: Sequence[np.ndarray],
    *,
    eps: float = 1e-3,
    rtol: float = 1e-2,
    atol: float = 1e-3,
    seed: int = 0,
    skip: Sequence[int] = (),
) -> list[np.ndarray]:
    """Asserts that recurra's gradients of ``fn`` match central differences.

    ``fn`` takes recurra tensors (one per array) and returns a tensor or a tuple of
    tensors. Float arrays become parameters (except indices in ``skip``); integer arrays
    are passed as constant int32 tensors. Returns the analytic gradients.
    """
    arrays = [np.asarray(a) for a in arrays]
    is_float = [a.dtype.kind == "f" and i not in skip for i, a in enumerate(arrays)]

    def make(vals: Sequence[np.ndarray], as_param: bool) -> list[Any]:
        out = []
        for v, f in zip(vals, is_float):
            out.append(rc.param(v) if (f and as_param) else rc.tensor(v))
        return out

    ps = make(arrays, True)
    outs = _outputs(fn(*ps))
    weights = _weights(outs, seed)
    loss = None
    for o, w in zip(outs, weights):
        term = rc.ops.apply("sum_to", [o * rc.tensor(w)], ip=())  # the sum of all elements
        loss = term if loss is None else loss + term
    loss.backward()
    analytic = []
    for p, f, a in zip(ps, is_float, arrays):
        if not f:
            analytic.append(None)
            continue
        g = p.grad.numpy() if p.grad is not None else np.zeros(a.shape, np.float32)
        analytic.append(g)

    def value(vals: Sequence[np.ndarray]) -> float:
        res = _outputs(fn(*make(vals, False)))
        return float(sum(np.sum(r.numpy().astype(np.float64) * w) for r, w in zip(res, weights)))

    work = [a.astype(np.float32) if f else a for a, f in zip(arrays, is_float)]
    for i, f in enumerate(is_float):
        if not f:
            continue
        numeric = np.zeros(work[i].shape, np.float64)
        flat = work[i].reshape(-1)
        for j in range(flat.size):
            orig = flat[j]
            flat[j] = orig + eps
            up = value(work)
            flat[j] = orig - eps
            down = value(work)
            flat[j] = orig
            numeric.reshape(-1)[j] = (up - down) / (2 * eps)
        np.testing.assert_allclose(
            analytic[i],
            numeric,
            rtol=rtol,
            atol=atol,
            err_msg=f"gradient of input {i} (shape {work[i].shape}) differs from finite "
            "differences",
        )
    return analytic


def assert_grads_thread_independent(
    fn: Callable[..., Any], arrays: Sequence[np.ndarray], threads: Sequence[int] = (1, 2, 3)
) -> None:
    """Asserts that the gradients of sum(fn(*params) ** 2) are bitwise the same for every
    thread count in ``threads`` (kernels must sum in a fixed order)."""
    before = rc.get_num_threads()
    grads = []
    try:
        for n in threads:
            rc.set_num_threads(n)
            ps = [rc.param(a) for a in arrays]
            (fn(*ps) ** 2).sum().backward()
            grads.append([p.grad.numpy() for p in ps])
    finally:
        rc.set_num_threads(before)
    for g in grads[1:]:
        for u, v in zip(grads[0], g):
            np.testing.assert_array_equal(u, v)


@contextlib.contextmanager
def cpu_refuses(*names: str) -> Iterator[None]:
    """Within: the CPU kernels of ops ``names`` refuse every node, so the graphs built here
    use the ops' decompositions (recurra/op_spec.h) as a backend without them would. The
    lazy frontend's cached plans are dropped on the way in and out."""
    from recurra import _core
    from recurra._tensor import LAZY

    _core.set_cpu_refused_ops(list(names))
    LAZY.clear()
    try:
        yield
    finally:
        _core.set_cpu_refused_ops([])
        LAZY.clear()


def fused_and_decomposed(op: str, fn: Callable[..., Any]) -> Any:
    """A pytest fixture ``impl`` giving ``fn`` (which calls op ``op``) twice: as the CPU runs
    it (the fused kernel), and with the CPU refusing ``op``, so that ``fn`` runs the
    decomposition a backend without the fused kernel gets."""

    @pytest.fixture(params=["fused", "decomposed"])
    def impl(request: Any) -> Iterator[Callable[..., Any]]:
        if request.param == "fused":
            yield fn
        else:
            with cpu_refuses(op):
                yield fn

    return impl


def graph_ops(g: Any) -> list[str]:
    """The op of every node of explicit graph ``g`` (leaves: "leaf"), in order."""
    return [g._g.info(i)["op"] for i in range(len(g._g))]

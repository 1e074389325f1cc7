"""Step capture (``recurra.capture``): a later call runs the traced plan without the
function's Python. Results and gradients must be the bits of the uncaptured calls (the same
plan on the same data), over several optimizer steps, and the checks must notice what they
promise to notice (new signatures, replaced parameters, values read while tracing)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import recurra as rc
from recurra import ops
from recurra._tensor import LAZY

D = 8


def _params(seed: int = 0) -> list[rc.Tensor]:
    rng = np.random.default_rng(seed)
    return [
        rc.param(rng.standard_normal((D, 2 * D)).astype(np.float32) * 0.3),
        rc.param(rng.standard_normal((D, 1)).astype(np.float32) * 0.3),
    ]


def _loss(ps: list[rc.Tensor], x: rc.Tensor, y: rc.Tensor, recompute: bool = False) -> rc.Tensor:
    w, v = ps
    with rc.recompute() if recompute else contextlib.nullcontext():
        a = x @ w
        h = ops.tanh(a[:, :D]) * ops.sigmoid(a[:, D:]) + 0.5
    return ops.mean(ops.sqr(h @ v - y))


def _batches(n: int, rows: int = 4, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (
            rng.standard_normal((rows, D)).astype(np.float32),
            rng.standard_normal((rows, 1)).astype(np.float32),
        )
        for _ in range(n)
    ]


def _train(captured: bool, steps: int = 5, recompute: bool = False, autocast: bool = False):
    ps = _params()
    step = rc.capture(lambda x, y: _loss(ps, x, y, recompute), backward=True, params=lambda: ps)
    losses = []
    for x, y in _batches(steps):
        with rc.autocast(rc.bfloat16) if autocast else contextlib.nullcontext():
            if captured:
                loss = step(x, y)
            else:
                loss = _loss(ps, rc.tensor(x), rc.tensor(y), recompute)
                loss.backward()
        losses.append(loss.numpy())
        for p in ps:  # SGD in place (the core alone: this file runs in the sanitize session)
            assert p.grad is not None
            p.assign_(p.numpy() - np.float32(1e-2) * p.grad.numpy())
            p.grad = None
    return losses, [p.numpy() for p in ps], step


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_captured_training_is_bitwise_the_uncaptured_one(recompute: bool, autocast: bool) -> None:
    ref_losses, ref_params, _ = _train(False, recompute=recompute, autocast=autocast)
    losses, params, step = _train(True, recompute=recompute, autocast=autocast)
    assert step.traces == 1 and step.replays == 4
    for a, b in zip(ref_losses, losses):
        assert a.tobytes() == b.tobytes()
    for a, b in zip(ref_params, params):
        assert a.tobytes() == b.tobytes()
    assert ref_losses[0] != ref_losses[-1]  # the parameters did change between the steps


def test_gradients_accumulate_like_backward() -> None:
    (x0, y0), (x1, y1) = _batches(2)
    ref = _params()
    for x, y in ((x0, y0), (x1, y1), (x0, y0)):
        _loss(ref, rc.tensor(x), rc.tensor(y)).backward()
    ps = _params()
    step = rc.capture(lambda x, y: _loss(ps, x, y), backward=True)
    for x, y in ((x0, y0), (x1, y1), (x0, y0)):
        step(x, y)
    assert step.replays == 2
    for p, q in zip(ref, ps):
        assert q.grad is not None and p.grad is not None
        assert p.grad.numpy().tobytes() == q.grad.numpy().tobytes()
    # against float64 numpy: three batches' gradients summed (finite differences of w's first
    # element through the float64 loss)
    w, v = (p.numpy().astype(np.float64) for p in _params())

    def f64(w: np.ndarray) -> float:
        total = 0.0
        for x, y in ((x0, y0), (x1, y1), (x0, y0)):
            a = x.astype(np.float64) @ w
            h = np.tanh(a[:, :D]) / (1 + np.exp(-a[:, D:])) + 0.5
            total += float(np.mean((h @ v - y) ** 2))
        return total

    eps = 1e-6
    wp, wm = w.copy(), w.copy()
    wp[0, 0] += eps
    wm[0, 0] -= eps
    fd = (f64(wp) - f64(wm)) / (2 * eps)
    assert ps[0].grad is not None
    np.testing.assert_allclose(ps[0].grad.numpy()[0, 0], fd, rtol=1e-3, atol=1e-6)


def test_forward_capture_returns_the_values_and_structure() -> None:
    ps = _params()
    fn = rc.capture(lambda x: {"h": x @ ps[0], "n": (ops.sum(x), 3)})
    rng = np.random.default_rng(5)
    for _ in range(3):
        x = rng.standard_normal((2, D)).astype(np.float32)
        out = fn(x)
        np.testing.assert_array_equal(out["h"].numpy(), (rc.tensor(x) @ ps[0]).numpy())
        assert out["n"][1] == 3
        np.testing.assert_allclose(out["n"][0].item(), x.astype(np.float64).sum(), rtol=1e-5)
        assert not out["h"].requires_grad
    assert (fn.traces, fn.replays) == (1, 2)


def test_a_new_signature_traces_again() -> None:
    ps = _params()
    step = rc.capture(lambda x, y: _loss(ps, x, y), backward=True)
    x, y = _batches(1)[0]
    x2, y2 = _batches(1, rows=3)[0]
    step(x, y)
    step(x2, y2)  # another batch size
    with rc.autocast(rc.bfloat16):
        step(x, y)  # another autocast state
    step(x, y)
    assert (step.traces, step.replays) == (3, 1)
    with rc.no_grad(), pytest.raises(RuntimeError, match="no_grad"):
        step(x, y)


def test_a_replaced_parameter_traces_again() -> None:
    ps = _params()
    step = rc.capture(lambda x, y: _loss(ps, x, y), backward=True, params=lambda: ps)
    (x, y), (x1, y1) = _batches(2)
    step(x, y)
    old = ps[1]
    ps[1] = rc.param(np.full((D, 1), 0.25, np.float32))
    loss = step(x1, y1)
    assert step.retraces == 1 and step.traces == 2
    np.testing.assert_array_equal(loss.numpy(), _loss(ps, rc.tensor(x1), rc.tensor(y1)).numpy())
    assert ps[1].grad is not None and old.grad is not None
    # a frozen parameter (requires_grad off) changes the graph: traced again, no gradient
    ps[0].requires_grad_(False)
    ps[0].grad = None
    step(x, y)
    assert step.retraces == 2 and ps[0].grad is None


def test_parameters_changed_in_place_are_seen() -> None:
    ps = _params()
    fn = rc.capture(lambda x: x @ ps[0])
    x = np.ones((1, D), np.float32)
    a = fn(x).numpy()
    ps[0].assign_(ps[0].numpy() * 2)
    b = fn(x).numpy()
    assert fn.replays == 1
    np.testing.assert_array_equal(b, (rc.tensor(x) @ ps[0]).numpy())
    assert not np.array_equal(a, b)


def test_what_cannot_be_captured_raises() -> None:
    ps = _params()

    def reads(x: rc.Tensor) -> rc.Tensor:
        return x * float((x @ ps[0]).sum().item())

    with pytest.raises(rc.CaptureError, match="computed values"):
        rc.capture(reads)(np.ones((1, D), np.float32))
    with pytest.raises(rc.CaptureError, match="argument 1"):
        rc.capture(lambda x, y: x @ ps[0])(np.ones((1, D), np.float32), np.ones(3, np.float32))
    with pytest.raises(rc.CaptureError, match="requires grad"):
        rc.capture(lambda x: ops.sum(x), backward=True)(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="hashable"):
        rc.capture(lambda x, n: x)(np.ones(3, np.float32), [1, 2])
    # a failed trace keeps nothing: the plan cache still works for the normal path
    assert LAZY.cache_info()["plans"] >= 0


def test_non_tensor_arguments_are_part_of_the_signature() -> None:
    fn = rc.capture(lambda x, k: x * k)
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(fn(x, 2.0).numpy(), x * 2)
    np.testing.assert_array_equal(fn(x, 3.0).numpy(), x * 3)
    np.testing.assert_array_equal(fn(x + 1, 3.0).numpy(), (x + 1) * 3)
    assert (fn.traces, fn.replays) == (2, 1)

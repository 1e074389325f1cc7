"""The graph API: build, differentiate, allocate, feed, compute, read (ggml style)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import recurra as rc
from recurra import ops


def test_graph_train_linear_regression():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((32, 3)).astype(np.float32)
    w_true = np.array([[1.5], [-2.0], [0.5]], np.float32)
    Y = X @ w_true
    g = rc.Graph()
    x = g.input((32, 3), name="x")
    y = g.input((32, 1), name="y")
    w = g.param((3, 1), name="w")
    d = ops.sub(ops.mul(ops.broadcast_to(x, (32, 3)), ops.reshape(w, (1, 3))), 0.0)
    pred = ops.apply("sum_to", [d], ip=(32, 1))
    loss = ops.scale(ops.apply("sum_to", [ops.sqr(pred - y)], ip=()), 1.0 / 32)
    g.set_loss(loss)
    g.build_backward(loss)
    assert w.grad is not None and w.grad.shape == (3, 1)
    assert x.grad is None  # inputs get no gradient
    wv = np.zeros((3, 1), np.float32)
    g.set_data(x, X)
    g.set_data(y, Y)
    losses = []
    for _ in range(200):
        g.set_data(w, wv)
        g.compute()
        losses.append(loss.item())
        wv = wv - 0.1 * w.grad.numpy()
    assert losses[-1] < 1e-6 * losses[0] + 1e-8
    np.testing.assert_allclose(wv, w_true, atol=1e-3)


def test_graph_errors():
    g = rc.Graph()
    a = g.input((2, 2))
    b = g.param((2, 2))
    c = a * b
    with pytest.raises(RuntimeError, match="has no data"):
        g.compute()
    with pytest.raises(ValueError, match="elements"):
        g.set_data(a, np.ones(3))
    with pytest.raises(ValueError, match="scalar"):
        g.build_backward(c)
    other = rc.Graph()
    with pytest.raises(ValueError, match="different graphs"):
        ops.add(a, other.input((2, 2)))
    with pytest.raises(TypeError):
        g.input((2,), dtype="float64")


def test_memory_planner_reuses_dead_buffers():
    g = rc.Graph()
    x = g.input((1 << 18,))
    h = x
    for _ in range(40):  # a deep chain: each intermediate dies right after its consumer
        h = ops.tanh(h * 1.01)
    g.set_output(h)
    plan = g.memory()
    one = (1 << 18) * 4
    assert plan["unplanned_bytes"] >= 80 * one
    assert plan["arena_bytes"] <= 3 * one  # reuse: a few live buffers at a time
    g.set_data(x, np.full(1 << 18, 0.5, np.float32))
    g.compute()
    ref = np.float64(0.5)
    for _ in range(40):
        ref = np.tanh(ref * 1.01)
    np.testing.assert_allclose(h.numpy()[:3], [ref] * 3, rtol=1e-5)
    stats = rc.memory_stats()
    assert stats["transient"]["bytes"] >= plan["arena_bytes"]


def test_memory_plan_reports_the_peak_and_what_is_live_there():
    # x -> a = exp(x) (n floats) -> b = a * a -> s = sum(b) + sum(a): a lives until the last
    # sum, so the peak is a and b together (2 n floats), at the node making b.
    n = 1 << 16
    g = rc.Graph()
    x = g.input((n,))
    a = ops.exp(x)
    b = ops.mul(a, a)
    s = ops.add(ops.sum(b), ops.sum(a))
    g.set_output(s)
    plan = g.memory()
    # plus the first sum's 0-d result (one aligned slot)
    assert 2 * n * 4 < plan["peak_live_bytes"] <= 2 * n * 4 + 256
    assert plan["peak_live_bytes"] <= plan["arena_bytes"] <= plan["unplanned_bytes"]
    live = dict(plan["live_at_peak"])
    assert live["exp"] == n * 4 and live["mul"] == n * 4
    assert sum(live.values()) == plan["peak_live_bytes"]
    g.set_data(x, np.full(n, 0.5, np.float32))
    g.compute()
    want = n * np.exp(1.0) + n * np.exp(0.5)
    np.testing.assert_allclose(s.numpy(), want, rtol=1e-5)


def test_large_host_blocks_are_kept_for_reuse_and_can_be_freed():
    rc.empty_cache()
    assert rc.memory_stats()["host_cache"]["bytes"] == 0
    a = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    t = rc.tensor(a) * 2.0
    np.testing.assert_array_equal(t.numpy(), a * 2.0)
    del t
    gc.collect()
    kept = rc.memory_stats()["host_cache"]["bytes"]
    if os.environ.get("ASAN_OPTIONS"):  # the sanitizer build keeps nothing (use-after-free)
        assert kept == 0
        return
    assert kept >= a.nbytes
    # the next result of the same size reuses a kept block, and its values are its own
    t2 = rc.tensor(a) + 1.0
    np.testing.assert_array_equal(t2.numpy(), a + 1.0)
    assert rc.memory_stats()["host_cache"]["bytes"] < kept
    del t2
    gc.collect()
    rc.empty_cache()
    assert rc.memory_stats()["host_cache"]["bytes"] == 0


def test_weight_gradient_of_x_at_w_transposed_is_one_product():
    # x @ W.T (a linear layer): W's gradient is computed as G.T @ x in W's layout. The
    # backward first builds x.T @ G for W.T; that product is then unread and not planned.
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((6, 5)).astype(np.float32)
    wv = rng.standard_normal((4, 5)).astype(np.float32)
    rv = rng.standard_normal((6, 4)).astype(np.float32)
    g = rc.Graph()
    x = g.input((6, 5))
    w = g.param((4, 5))
    r = g.input((6, 4))
    loss = ops.apply("sum_to", [ops.mul(ops.matmul(x, ops.transpose(w)), r)], ip=())
    g.set_loss(loss)
    n_forward = g.memory()["n_planned"]
    g.build_backward(loss)
    # matmul, mul, sum_to forward; backward: fill, broadcast copy, mul in the arena, and
    # the weight product with memory of its own (a parameter's gradient: 4 x 5 floats)
    assert g.memory()["n_planned"] == n_forward + 3
    assert g.memory()["own_bytes"] == 128
    for t, v in ((x, xv), (w, wv), (r, rv)):
        g.set_data(t, v)
    g.compute()
    np.testing.assert_allclose(w.grad.numpy(), rv.T @ xv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss.item(), np.sum((xv @ wv.T) * rv), rtol=1e-5)


def test_assign_writes_a_leaf_in_place_across_computes() -> None:
    # A carried state: s <- 0.5 s + x, written back into the leaf by `assign` after the
    # node that reads it; two computes advance it twice (float64 reference).
    rng = np.random.default_rng(0)
    s0 = rng.standard_normal((3, 5)).astype(np.float32)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    g = rc.Graph()
    s = g.input((3, 5), name="s")
    xt = g.input((3, 5), name="x")
    y = ops.sum(s * xt)  # reads the old state
    new = s * 0.5 + xt
    g.set_output(y)
    g.set_output(g.apply("assign", [s, new], (), ()))
    state = s0.copy()
    g._g.bind(s.id, state)  # caller-owned memory: assign writes it
    g.set_data(xt, x)
    want = s0.astype(np.float64)
    for _ in range(2):
        g.compute()
        np.testing.assert_allclose(g.get_data(y), (want * x).sum(), rtol=1e-5)
        want = want * 0.5 + x
        np.testing.assert_allclose(state, want, rtol=1e-6)


def test_assign_refuses_computed_targets_and_mismatches() -> None:
    g = rc.Graph()
    a = g.input((2, 2))
    b = g.input((2, 3))
    with pytest.raises(ValueError, match="assign"):
        g.apply("assign", [a, b], (), ())
    with pytest.raises(ValueError, match="leaf"):
        g.apply("assign", [a * 2.0, a], (), ())


_DERIVS = {  # f'(a) in float64, and whether it is a function of y = f(a) only
    "sigmoid": (lambda a: np.exp(-a) / (1 + np.exp(-a)) ** 2, True),
    "tanh": (lambda a: 1 - np.tanh(a) ** 2, True),
    "sqrt": (lambda a: 0.5 / np.sqrt(a), True),
    "silu": (lambda a: (1 + np.exp(-a) + a * np.exp(-a)) / (1 + np.exp(-a)) ** 2, False),
    "relu": (lambda a: (a > 0).astype(np.float64), True),  # relu'(relu(x)) = relu'(x)
    "softplus": (lambda a: 1 / (1 + np.exp(-a)), False),
    "gelu": (None, False),
}


@pytest.mark.parametrize("act", list(_DERIVS))
def test_activation_backward_keeps_only_what_its_derivative_reads(act):
    # w -> a = 1.5 w (scale) -> y = act(a) -> loss = sum(y). The backward of act reads a
    # or y, never both (act_grad's two value slots hold the same one), so the other is dead
    # after the forward. The step's peak is 2 n floats: a and y in the forward; the backward
    # holds the one act_grad reads, and the loss's gradient broadcast to n, which act_grad
    # and then w's gradient (scale) write over, in w's gradient buffer (memory of its own).
    # Half the inputs are negative (relu's gradient 0 there; sqrt's inputs stay positive).
    deriv, reads_y = _DERIVS[act]
    n = 1 << 14
    g = rc.Graph()
    w = g.param((n,))
    a = ops.scale(w, 1.5)
    y = getattr(ops, act)(a)
    loss = ops.apply("sum_to", [y], ip=())
    g.set_loss(loss)
    g.build_backward(loss)
    plan = g.memory()
    kept = y if reads_y else a
    act_grads = [i for i in range(len(g._g)) if g._g.info(i)["op"] == "act_grad"]
    assert len(act_grads) == 1
    assert g._g.info(act_grads[0])["src"][1:] == [kept.id, kept.id]
    assert plan["peak_live_bytes"] <= 2 * n * 4 + 256, plan
    wv = np.random.default_rng(0).uniform(0.05, 2.0, n).astype(np.float32)
    wv[: n // 2] *= -1 if act != "sqrt" else 1
    g.set_data(w, wv)
    g.compute()
    if deriv is not None:
        want = 1.5 * deriv(1.5 * wv.astype(np.float64))
        np.testing.assert_allclose(w.grad.numpy(), want, rtol=2e-5, atol=1e-6)

"""Recomputation segments (``rc.recompute()``, ``Graph.recompute()``): the backward runs a
segment's forward again instead of keeping it. Gradients must be those of the run without
(bitwise on the CPU: the same ops on the same data), match an independent float64 numpy
backward and finite differences, the arena must shrink, and the plan cache must still hit.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from gradcheck import check_grads

import recurra as rc
from recurra import ops
from recurra._tensor import LAZY

B, D = 16, 8


def _block(h, w):
    """h + tanh(u) * sigmoid(v) with [u, v] = h @ w: a matmul, two views, three
    elementwise ops and a residual add."""
    a = h @ w
    return h + ops.tanh(a[:, :D]) * ops.sigmoid(a[:, D:])


def _net(x, ws, recompute: bool):
    h = x
    for w in ws:
        with rc.recompute() if recompute else contextlib.nullcontext():
            h = _block(h, w)
    return ops.mean(ops.sqr(h))


def _numpy_grads(x: np.ndarray, ws: list[np.ndarray]) -> tuple[float, list[np.ndarray]]:
    """The loss and d(loss)/d(w) of _net in float64, backpropagated by hand."""
    x = x.astype(np.float64)
    ws = [w.astype(np.float64) for w in ws]
    hs, saved = [x], []
    for w in ws:
        h = hs[-1]
        a = h @ w
        t, s = np.tanh(a[:, :D]), 1 / (1 + np.exp(-a[:, D:]))
        saved.append((t, s))
        hs.append(h + t * s)
    loss = float(np.mean(hs[-1] ** 2))
    dh = 2 * hs[-1] / hs[-1].size
    grads = []
    for w, h, (t, s) in reversed(list(zip(ws, hs, saved))):
        da = np.concatenate([dh * s * (1 - t * t), dh * t * s * (1 - s)], axis=1)
        grads.append(h.T @ da)
        dh = dh + da @ w.T
    return loss, grads[::-1]


def _data(n_blocks: int, seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, D)).astype(np.float32)
    ws = [(0.5 * rng.standard_normal((D, 2 * D))).astype(np.float32) for _ in range(n_blocks)]
    return x, ws


def _lazy_grads(x, ws, recompute: bool) -> tuple[float, list[np.ndarray]]:
    ps = [rc.param(w) for w in ws]
    loss = _net(rc.tensor(x), ps, recompute)
    loss.backward()
    return loss.item(), [p.grad.numpy() for p in ps]


def test_lazy_gradients_equal_the_run_without_and_numpy():
    x, ws = _data(3)
    loss0, g0 = _lazy_grads(x, ws, recompute=False)
    loss1, g1 = _lazy_grads(x, ws, recompute=True)
    assert loss0 == loss1
    for a, b in zip(g0, g1):
        np.testing.assert_array_equal(a, b)  # the same ops on the same data
    ref_loss, ref = _numpy_grads(x, ws)
    assert loss1 == pytest.approx(ref_loss, rel=1e-5)
    for a, r in zip(g1, ref):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6)


def test_lazy_gradients_match_finite_differences():
    x, ws = _data(2, seed=1)
    check_grads(lambda x, w0, w1: _net(x, [w0, w1], recompute=True), [x, *ws], skip=[0])


def test_input_gradient_flows_through_segments():
    # x is a parameter too: its gradient leaves the first segment through the checkpoint.
    x, ws = _data(2, seed=2)
    out = []
    for recompute in (False, True):
        px = rc.param(x)
        _net(px, [rc.tensor(w) for w in ws], recompute).backward()
        out.append(px.grad.numpy())
    np.testing.assert_array_equal(out[0], out[1])


def test_plan_cache_hits_across_steps():
    x, ws = _data(3)
    ps = [rc.param(w) for w in ws]

    def step(recompute: bool) -> None:
        for p in ps:
            p.grad = None
        _net(rc.tensor(x), ps, recompute).backward()

    LAZY.clear()
    step(True)
    before = rc.plan_cache_info()
    for _ in range(2):
        step(True)  # fresh segment ids, the same plan
    after = rc.plan_cache_info()
    assert after["misses"] == before["misses"]
    assert after["hits"] == before["hits"] + 2
    # ...and the plan without recomputation is another plan.
    step(False)
    assert rc.plan_cache_info()["misses"] == before["misses"] + 1


def test_nested_recompute_joins_the_outer_segment():
    x, ws = _data(2)
    ps = [rc.param(w) for w in ws]
    with rc.recompute():
        h = _block(rc.tensor(x), ps[0])
        with rc.recompute():
            h2 = _block(h, ps[1])
        h3 = h2 * 2.0
    assert h._seg == h2._seg == h3._seg != 0
    loss = ops.mean(ops.sqr(h3))
    loss.backward()
    _, ref = _numpy_grads(x, ws)
    for p, r in zip(ps, ref):
        np.testing.assert_allclose(p.grad.numpy(), 4 * r, rtol=1e-4, atol=1e-6)  # (2h)^2


def test_forward_only_and_no_grad_ignore_segments():
    x, ws = _data(2)
    with rc.recompute():
        y = _block(rc.tensor(x), rc.tensor(ws[0]))
    z = _block(rc.tensor(x), rc.tensor(ws[0]))
    np.testing.assert_array_equal(y.numpy(), z.numpy())


def _explicit(n_blocks: int, recompute: bool, x: np.ndarray, ws: list[np.ndarray]):
    g = rc.Graph()
    xt = g.input((B, D), name="x")
    wt = [g.param((D, 2 * D), name=f"w{i}") for i in range(n_blocks)]
    h = xt
    for w in wt:
        with g.recompute() if recompute else contextlib.nullcontext():
            h = _block(h, w)
    loss = ops.mean(ops.sqr(h))
    g.build_backward(loss)
    g.set_data(xt, x)
    for w, v in zip(wt, ws):
        g.set_data(w, v)
    g.compute()
    return g, loss.item(), [w.grad.numpy() for w in wt]


def test_explicit_graph_recompute_same_gradients_smaller_arena():
    x, ws = _data(6)
    g0, l0, grads0 = _explicit(6, False, x, ws)
    g1, l1, grads1 = _explicit(6, True, x, ws)
    assert l0 == l1
    for a, b in zip(grads0, grads1):
        np.testing.assert_array_equal(a, b)
    assert g1.n_nodes > g0.n_nodes  # the copies of the segments
    segs = {g1._g.info(i)["segment"] for i in range(g1.n_nodes)}
    assert segs == set(range(7))  # six segments, and the nodes outside (0)
    m0, m1 = g0.memory(), g1.memory()
    assert m1["arena_bytes"] < 0.75 * m0["arena_bytes"], (m0, m1)


def test_in_place_op_in_a_segment_is_refused():
    g = rc.Graph()
    x = g.input((B, D))
    w = g.param((D, 2 * D))
    p = g.param((4,))
    with g.recompute():
        h = _block(x, w)
        ops.sgd_step(
            g.constant(np.zeros(ops.HYPER_LEN, np.float32)),
            [p],
            [g.constant(np.zeros(4, np.float32))],
            [g.constant(np.zeros(1, np.int32))],
        )
    loss = ops.mean(ops.sqr(h))
    n = g.n_nodes
    with pytest.raises(ValueError, match="sgd_step.*in place"):
        g.build_backward(loss)
    assert g.n_nodes == n  # refused before anything was appended


def test_segment_binding_rejects_negative():
    g = rc.Graph()
    with pytest.raises(ValueError, match="segment"):
        g._g.set_segment(-1)


def test_peak_memory_is_reported_and_resettable():
    x, ws = _data(2)
    rc.reset_peak_memory()
    s0 = rc.memory_stats()["transient"]
    assert s0["peak_bytes"] == s0["bytes"]
    g, _, _ = _explicit(2, False, x, ws)
    s1 = rc.memory_stats()["transient"]
    assert s1["peak_bytes"] >= s0["bytes"] + g.memory()["arena_bytes"]
    del g
    rc.reset_peak_memory()
    s2 = rc.memory_stats()["transient"]
    assert s2["peak_bytes"] == s2["bytes"] < s1["peak_bytes"]


def test_loss_inside_a_segment():
    x, ws = _data(2)
    ps = [rc.param(w) for w in ws]
    with rc.recompute():
        loss = _net(rc.tensor(x), ps, recompute=False)
    loss.backward()
    _, ref = _numpy_grads(x, ws)
    for p, r in zip(ps, ref):
        np.testing.assert_allclose(p.grad.numpy(), r, rtol=1e-4, atol=1e-6)


def test_segment_without_parameters_is_not_copied():
    x, ws = _data(2)
    sizes = []
    for recompute in (False, True):
        g = rc.Graph()
        xt = g.constant(x)
        w = g.param((D, 2 * D))
        with g.recompute() if recompute else contextlib.nullcontext():
            h = _block(xt, g.constant(ws[0]))  # no parameter flows into it
        loss = ops.mean(ops.sqr(_block(h, w)))
        g.build_backward(loss)
        sizes.append(g.n_nodes)
    assert sizes[0] == sizes[1]

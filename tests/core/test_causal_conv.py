"""causal_conv_silu (Mamba's causal depthwise conv + bias + SiLU of a training step): the
fused CPU op and the decomposition the scheduler builds for a backend without it (here: the
CPU made to refuse the fused op), forward against float64 numpy, gradients against finite
differences, strided inputs, thread independence, errors."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import (
    assert_grads_thread_independent,
    check_grads,
    cpu_refuses,
    fused_and_decomposed,
    graph_ops,
)

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(5)


def ref(x, w, b=None):
    x, w = x.astype(np.float64), w.astype(np.float64)
    s, t, d = x.shape
    k = w.shape[1]
    xp = np.concatenate([np.zeros((s, k - 1, d)), x], axis=1)
    pre = sum(xp[:, j : j + t, :] * w[:, j] for j in range(k))
    if b is not None:
        pre = pre + b.astype(np.float64)
    return pre / (1 + np.exp(-pre))


def fused(*a):
    return ops.causal_conv_silu(*a)


impl = fused_and_decomposed("causal_conv_silu", fused)


SIZES = [(1, 1, 1, 1), (2, 3, 5, 4), (2, 9, 17, 4), (3, 20, 70, 3), (1, 40, 130, 2)]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("s,t,d,k", SIZES, ids=str)
def test_forward(impl, bias, s, t, d, k):
    x = RNG.standard_normal((s, t, d)).astype(np.float32)
    w = RNG.standard_normal((d, k)).astype(np.float32)
    b = RNG.standard_normal(d).astype(np.float32) if bias else None
    args = [rc.tensor(x), rc.tensor(w)] + ([rc.tensor(b)] if bias else [])
    np.testing.assert_allclose(impl(*args).numpy(), ref(x, w, b), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_grads(impl, bias):
    s, t, d, k = 2, 6, 5, 4
    arrays = [RNG.standard_normal((s, t, d)), RNG.standard_normal((d, k)) * 0.5]
    if bias:
        arrays.append(RNG.standard_normal(d))
    check_grads(impl, arrays)


@pytest.mark.parametrize(
    "t,d,k",
    [(33, 130, 4), (70, 600, 4), (37, 300, 3)],  # 600, 300: channel blocks of 256 and a rest
    ids=str,
)
def test_wide_channels_gradient_matches_decomposition(t, d, k):
    # More channels than one backward task holds (64) and than one channel block of the
    # kernels (256), tokens over several blocks of 32, a slice of a wider projection as x.
    proj = RNG.standard_normal((2, t, d + 20)).astype(np.float32)
    w = RNG.standard_normal((d, k)).astype(np.float32)
    b = RNG.standard_normal(d).astype(np.float32)
    g = RNG.standard_normal((2, t, d)).astype(np.float32)
    grads = []
    for refused in ([], ["causal_conv_silu"]):
        with cpu_refuses(*refused):
            ps = [rc.param(proj), rc.param(w), rc.param(b)]
            out = fused(ps[0][:, :, 7 : 7 + d], ps[1], ps[2])
            want = ref(proj[:, :, 7 : 7 + d], w, b)
            np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-6)
            (out * rc.tensor(g)).sum().backward()
            grads.append([p.grad.numpy() for p in ps])
    for u, v in zip(*grads):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-4)
    assert np.all(grads[0][0][:, :, :7] == 0) and np.all(grads[0][0][:, :, 7 + d :] == 0)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_decomposition_where_the_op_is_refused(bias):
    # One op in Python; the core keeps it where the backend takes it and otherwise builds
    # the ops the spec names (the node counts the Python decomposition had).
    spec = ops.spec()["causal_conv_silu"]
    pieces = (
        ["permute", "pad", "ssm_conv", "add", "silu"]
        if bias
        else ["permute", "pad", "ssm_conv", "silu"]
    )
    assert [p.strip() for p in spec.decomposition.split(",")] == [
        "permute",
        "pad",
        "ssm_conv",
        "add",
        "silu",
    ]
    for refused in (False, True):
        with cpu_refuses(*(["causal_conv_silu"] if refused else [])):
            g = rc.Graph()
            ts = [g.input((2, 7, 5)), g.input((5, 3))] + ([g.input((5,))] if bias else [])
            n = len(graph_ops(g))
            g.apply("causal_conv_silu", ts, (), ())
            assert graph_ops(g)[n:] == (pieces if refused else ["causal_conv_silu"])


def test_results_do_not_depend_on_threads():
    x = RNG.standard_normal((2, 30, 140)).astype(np.float32)
    w = RNG.standard_normal((140, 4)).astype(np.float32)
    b = RNG.standard_normal(140).astype(np.float32)
    assert_grads_thread_independent(fused, [x, w, b])


def test_errors():
    x = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="causal_conv_silu"):
        fused(x, np.zeros((5, 4), np.float32)).numpy()
    with pytest.raises(ValueError, match="causal_conv_silu"):
        fused(x[0], np.zeros((4, 4), np.float32)).numpy()
    with pytest.raises(ValueError, match="bias"):
        fused(x, np.zeros((4, 4), np.float32), np.zeros(3, np.float32)).numpy()
    with pytest.raises(TypeError):
        fused(x.astype(np.int32), np.zeros((4, 4), np.float32)).numpy()


# ---- conv_step: one token with the state shifted in place (generation) -------------------


def _step_graph(state, x, w, b):
    g = rc.Graph()
    leaves = []
    for a in [state, x, w] + ([] if b is None else [b]):
        t = g.input(a.shape)
        g.set_data(t, a)
        leaves.append(t)
    y = g.apply("conv_step", leaves, (), ())
    g.set_output(y)
    return g, leaves, y


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("s,d,k", [(1, 37, 4), (2, 19, 4), (2, 5, 2), (3, 16, 3)], ids=str)
def test_conv_step_against_the_whole_sequence(bias, s, d, k):
    # Three steps from a random state: each y equals the causal conv of the full history
    # (float64), and the state after each is the last k - 1 inputs.
    hist = RNG.standard_normal((s, k - 1, d)).astype(np.float32)
    w = RNG.standard_normal((d, k)).astype(np.float32)
    b = RNG.standard_normal(d).astype(np.float32) if bias else None
    xs = RNG.standard_normal((s, 3, d)).astype(np.float32)
    g, leaves, y = _step_graph(np.ascontiguousarray(hist.transpose(0, 2, 1)), xs[:, :1], w, b)
    for t in range(3):
        g.set_data(leaves[1], np.ascontiguousarray(xs[:, t : t + 1]))
        g.compute()
        seq = np.concatenate([hist, xs[:, : t + 1]], axis=1)  # (s, k - 1 + t + 1, d)
        want = ref(seq, w, b)[:, -1:]  # zeros before hist do not reach the last output
        np.testing.assert_allclose(g.get_data(y), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(g.get_data(leaves[0]), seq[:, -(k - 1) :].transpose(0, 2, 1))


def test_conv_step_errors():
    st = np.zeros((1, 4, 3), np.float32)
    w = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match="x must be"):
        _step_graph(st, np.zeros((1, 2, 4), np.float32), w, None)
    with pytest.raises(ValueError, match="c must be"):
        _step_graph(st, np.zeros((1, 1, 4), np.float32), np.zeros((4, 3), np.float32), None)
    with pytest.raises(ValueError, match="bias"):
        _step_graph(st, np.zeros((1, 1, 4), np.float32), w, np.zeros(3, np.float32))
    g = rc.Graph()
    a = g.input((1, 4, 3))
    with pytest.raises(ValueError, match="leaf"):
        g.apply("conv_step", [rc.ops.exp(a), g.input((1, 1, 4)), g.input((4, 4))], (), ())
    p = rc.param(st)
    y = rc.ops.apply("conv_step", [p, rc.tensor(np.ones((1, 1, 4), np.float32)), rc.tensor(w)])
    with pytest.raises(ValueError, match="no gradient"):
        y.sum().backward()

"""Elementwise ops beyond the op-case registry: views as sources, Python operators, errors,
and the gradients of broadcast sources. The per-op cases (every unary and binary op at odd
shapes, broadcasting, finite-difference gradients, NaN propagation) are in recurra.opcases
and run in tests/core/test_opcases.py."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_grads

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(1234)


def test_binary_on_views():
    a = RNG.standard_normal((4, 6)).astype(np.float32)
    b = RNG.standard_normal((6, 4)).astype(np.float32)
    ta, tb = rc.tensor(a), rc.tensor(b)
    got = (ta[:, ::2] + tb.T[:, 1::2]).numpy()
    np.testing.assert_allclose(got, a[:, ::2] + b.T[:, 1::2], rtol=1e-6)
    check_grads(lambda x, y: x[:, ::2] * y.T[:, 1::2], [a, b])


def test_scale_clamp_pow_and_operators():
    x = RNG.uniform(0.5, 2.0, (3, 4)).astype(np.float32)
    t = rc.tensor(x)
    np.testing.assert_allclose(ops.scale(t, -2.5).numpy(), x * -2.5, rtol=1e-6)
    np.testing.assert_allclose(ops.clamp(t, 0.8, 1.5).numpy(), np.clip(x, 0.8, 1.5))
    np.testing.assert_allclose((t**3).numpy(), x.astype(np.float64) ** 3, rtol=1e-5)
    np.testing.assert_allclose((2.0 / t - 1).numpy(), 2.0 / x - 1, rtol=1e-6)
    np.testing.assert_allclose((-t + x).numpy(), np.zeros_like(x))
    np.testing.assert_allclose((x * t).numpy(), x * x, rtol=1e-6)  # ndarray on the left
    check_grads(lambda a: a**3 + ops.clamp(a, 0.8, 1.5), [np.array([0.6, 1.0, 1.2, 1.9])])


def test_value_errors_name_the_op():
    with pytest.raises(ValueError, match=r"add: shapes \(2, 3\) and \(4,\)"):
        ops.add(rc.tensor(np.ones((2, 3))), rc.tensor(np.ones(4)))
    with pytest.raises(ValueError, match="clamp"):
        ops.clamp(rc.tensor(np.ones(3)), 2.0, 1.0)


def test_int_inputs_raise_type_error():
    with pytest.raises(TypeError, match="mul: input 0 must be float32"):
        ops.mul(rc.tensor(np.arange(3)), rc.tensor(np.ones(3)))


@pytest.mark.parametrize(
    "big,small",
    [
        ((4, 37, 300), (300,)),  # a bias gradient: the last axis kept, two blocks of columns
        ((3, 5, 7, 9), (5, 1, 1)),  # the last axis summed, interleaved kept axes
        ((2, 300, 70), ()),  # to a scalar: several chunks of rows
        ((6, 1, 11), (6, 4, 1)),  # broadcast both ways: only some axes summed
        ((5, 3, 1000), (5, 1, 1000)),  # a middle axis summed
        ((1000, 1), (1,)),
    ],
)
def test_broadcast_gradients_sum_back_exactly(big, small):
    # The gradient of a broadcast source is the sum over the broadcast axes (sum_to),
    # checked against float64 numpy on values whose float32 sum would drift.
    rng = np.random.default_rng(5)
    r = rng.standard_normal(np.broadcast_shapes(big, small)).astype(np.float32) + 100.0
    p = rc.param(np.zeros(small, np.float32))
    x = rc.tensor(np.zeros(big, np.float32))
    ((p + x) * rc.tensor(r)).sum().backward()
    full = np.broadcast_shapes(big, small)
    want = r.astype(np.float64)
    lead = len(full) - len(small)
    want = want.sum(axis=tuple(range(lead))) if lead else want
    axes = tuple(i for i, d in enumerate(small) if d == 1 and want.shape[i] != 1)
    want = want.sum(axis=axes, keepdims=True) if axes else want
    np.testing.assert_allclose(p.grad.numpy(), want.reshape(small), rtol=1e-6)

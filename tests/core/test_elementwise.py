"""Elementwise ops: forward against float64 numpy, gradients against finite differences."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradcheck import check_grads

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(1234)


def erf64(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(x)


UNARY = {
    # name: (float64 reference, input sampler)
    "neg": (lambda x: -x, lambda s: RNG.standard_normal(s)),
    "abs": (np.abs, lambda s: RNG.standard_normal(s)),
    "sqr": (np.square, lambda s: RNG.standard_normal(s)),
    "sqrt": (np.sqrt, lambda s: RNG.uniform(0.1, 3.0, s)),
    "exp": (np.exp, lambda s: RNG.uniform(-3, 3, s)),
    "log": (np.log, lambda s: RNG.uniform(0.1, 3.0, s)),
    "relu": (lambda x: np.maximum(x, 0), lambda s: RNG.standard_normal(s)),
    "silu": (lambda x: x / (1 + np.exp(-x)), lambda s: RNG.standard_normal(s) * 3),
    "gelu": (lambda x: 0.5 * x * (1 + erf64(x / np.sqrt(2))), lambda s: RNG.standard_normal(s) * 2),
    "gelu_tanh": (
        lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))),
        lambda s: RNG.standard_normal(s) * 2,
    ),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), lambda s: RNG.standard_normal(s) * 3),
    "tanh": (np.tanh, lambda s: RNG.standard_normal(s) * 2),
    "softplus": (
        lambda x: np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))),
        lambda s: RNG.standard_normal(s) * 8,
    ),
}

BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}

SIZES = [(1,), (3,), (17,), (2, 3, 5), (1000003,)]


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("shape", SIZES, ids=str)
def test_unary_forward(name, shape):
    ref, sample = UNARY[name]
    x = sample(shape).astype(np.float32)
    got = getattr(ops, name)(rc.tensor(x)).numpy()
    np.testing.assert_allclose(got, ref(x.astype(np.float64)), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_grad(name):
    _, sample = UNARY[name]
    x = sample((2, 3))
    if name in ("abs", "relu"):  # keep away from the kink
        x = np.where(np.abs(x) < 0.05, 0.3, x)
    check_grads(lambda t: getattr(ops, name)(t), [x])


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize(
    "sa,sb",
    [((17,), (17,)), ((3, 4), (4,)), ((3, 1), (1, 5)), ((2, 1, 4), (3, 1)), ((1,), (1000003,))],
    ids=str,
)
def test_binary_forward_broadcast(name, sa, sb):
    a = RNG.standard_normal(sa).astype(np.float32)
    b = RNG.uniform(0.5, 2, sb).astype(np.float32)
    got = getattr(ops, name)(rc.tensor(a), rc.tensor(b)).numpy()
    want = BINARY[name](a.astype(np.float64), b.astype(np.float64))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_grad_broadcast(name):
    a = RNG.standard_normal((2, 1, 3))
    b = RNG.uniform(0.5, 2, (4, 1))
    check_grads(lambda x, y: getattr(ops, name)(x, y), [a, b])


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


# Each activation on [nan, -inf, -1, 0.5, 2, inf] and clamp to [-0.5, 1]: NaN in, NaN out
# (numpy's semantics), forward and gradient. A NaN gradient (relu, clamp, abs at a NaN input)
# is not hidden as 0 either.
NAN_ROW = np.array([np.nan, -np.inf, -1.0, 0.5, 2.0, np.inf], np.float32)


@pytest.mark.parametrize("name", sorted(set(UNARY) | {"clamp"}))
def test_nan_propagates(name):
    x = np.tile(NAN_ROW, 3)  # longer than a vector lane: the SIMD path too
    if name == "clamp":
        ref, fn = (lambda v: np.clip(v, -0.5, 1.0)), (lambda t: ops.clamp(t, -0.5, 1.0))
    else:
        ref, fn = UNARY[name][0], getattr(ops, name)
    with np.errstate(all="ignore"):
        want = ref(x.astype(np.float64))
    p = rc.param(x)
    y = fn(p)
    got = y.numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{name}: {got} vs {want}")
    if name == "neg":  # d(-x)/dx is -1 everywhere
        return
    ops.sum(y).backward()
    g = p.grad.numpy()
    assert np.isnan(g[::6]).all(), f"{name}: gradient at NaN input is {g[::6]}"

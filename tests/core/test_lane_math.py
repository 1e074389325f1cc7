"""The vectorized maths behind exp, sigmoid, silu, softplus, tanh and their gradients
(csrc/ops/lane_math.h): errors in float32 ulps against float64 numpy over the whole float
range, the special values (infinities, NaN, denormal inputs and results, the overflow and
underflow edges), strided inputs, and act_grad against float64 derivatives."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
from recurra import ops


def _all_floats(step: int = 4099) -> np.ndarray:
    """Finite float32 values spread over every exponent (bit patterns step apart), plus the
    special values and edges."""
    bits = np.arange(0, 2**32, step, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    edges = np.array(
        [0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.1754944e-38, 1e-30, -1e-30, 1e-8, -1e-8,
         0.34657, -0.34657, 20.0, 20.000002, 19.999998, 88.3, 88.72283, 88.72284, 88.7229, 89.0,
         -87.0, -87.3365, -88.0, -88.7229, -100.0, -103.27893, -103.97, -103.98, -104.0, -150.0,
         np.inf, -np.inf, np.nan],
        dtype=np.float32,
    )  # fmt: skip
    return np.concatenate([x[np.isfinite(x)], edges])


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units of the float32 spacing at want (the smallest denormal for
    results below the normal range); 0 where both are the same infinity or both NaN."""
    with np.errstate(over="ignore"):
        w32 = want.astype(np.float32)
    spacing = np.maximum(np.spacing(np.abs(w32)).astype(np.float64), 2.0**-149)
    with np.errstate(invalid="ignore"):
        err = np.abs(got.astype(np.float64) - want) / spacing
    same = (np.isnan(got) & np.isnan(want)) | (np.isinf(want) & (got == w32))
    # A finite result that rounds to infinity in float32 may come out as infinity.
    same |= np.isinf(w32) & (got == w32)
    return np.where(same, 0.0, np.where(np.isnan(err), np.inf, err))


def _sigmoid64(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _softplus64(x: np.ndarray) -> np.ndarray:
    return np.where(x > 20, x, np.logaddexp(0.0, np.minimum(x, 20.0)))


REFS = {
    # name: (float64 reference, max error in ulps)
    "exp": (np.exp, 2.0),
    "sigmoid": (_sigmoid64, 3.0),
    "silu": (lambda x: x * _sigmoid64(x), 4.0),
    "softplus": (_softplus64, 4.0),
    "tanh": (np.tanh, 3.0),
}


@pytest.mark.parametrize("name", sorted(REFS))
def test_ulp_error_over_the_float_range(name):
    ref, tol = REFS[name]
    x = _all_floats()
    with np.errstate(over="ignore", invalid="ignore"):
        want = ref(x.astype(np.float64))
    got = getattr(ops, name)(rc.tensor(x)).numpy()
    err = _ulps(got, want)
    if name == "silu":
        # Where sigmoid(x) is denormal (x < -87.3), x * sigmoid(x) scales its rounding by |x|.
        err = np.where(x < -87.3, err / np.maximum(np.abs(x), 1.0), err)
    worst = int(np.argmax(err))
    assert err[worst] <= tol, f"{name}({x[worst]!r}) = {got[worst]!r}, want {want[worst]!r}"


def test_special_values():
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    t = rc.tensor(x)
    np.testing.assert_array_equal(ops.exp(t).numpy(), [np.inf, 0.0, np.nan, 1.0, 1.0])
    np.testing.assert_array_equal(ops.sigmoid(t).numpy(), [1.0, 0.0, np.nan, 0.5, 0.5])
    np.testing.assert_array_equal(ops.softplus(t).numpy()[[0, 1, 2]], [np.inf, 0.0, np.nan])
    np.testing.assert_array_equal(ops.tanh(t).numpy(), [1.0, -1.0, np.nan, 0.0, -0.0])
    assert np.signbit(ops.tanh(t).numpy()[4])
    np.testing.assert_array_equal(ops.silu(t).numpy()[[0, 2, 3]], [np.inf, np.nan, 0.0])


def test_exp_denormal_results_and_edges():
    x = np.array([-87.5, -95.0, -100.0, -103.0, -103.9, -104.5, 88.72, 88.723, 100.0], np.float32)
    got = ops.exp(rc.tensor(x)).numpy()
    want = np.exp(x.astype(np.float64))
    assert got[1] > 0 and got[3] > 0  # denormal results, not flushed to zero
    assert np.all(_ulps(got, want) <= 2.0)
    assert got[5] == 0.0 and np.isinf(got[8]) and np.isfinite(got[6])


@pytest.mark.parametrize("name", sorted(REFS))
def test_strided_input_matches_dense(name):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((37, 29)) * 6).astype(np.float32)
    t = rc.tensor(x)
    fn = getattr(ops, name)
    dense = fn(rc.tensor(np.ascontiguousarray(x.T))).numpy()
    np.testing.assert_array_equal(fn(t.T).numpy(), dense)  # last-axis stride 29
    np.testing.assert_array_equal(fn(t[:, 3:20]).numpy(), fn(rc.tensor(x[:, 3:20].copy())).numpy())


DERIVS = {
    # name: (float64 derivative, input scale, absolute tolerance)
    "silu": (lambda x: _sigmoid64(x) * (1 + x * (1 - _sigmoid64(x))), 10.0, 2e-7),
    "sigmoid": (lambda x: _sigmoid64(x) * (1 - _sigmoid64(x)), 10.0, 2e-7),
    "softplus": (_sigmoid64, 30.0, 2e-7),
    # 1 - y^2 from the float32 y = tanh(x) keeps ~1e-7 absolute where |y| is near 1.
    "tanh": (lambda x: 1 - np.tanh(x) ** 2, 4.0, 2e-6),
    "exp": (np.exp, 10.0, 2e-7),
}


@pytest.mark.parametrize("name", sorted(DERIVS))
def test_act_grad_against_float64_derivative(name):
    deriv, scale, atol = DERIVS[name]
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(4099) * scale).astype(np.float32)
    g = rng.standard_normal(4099).astype(np.float32)
    p = rc.param(x)
    (getattr(ops, name)(p) * rc.tensor(g)).sum().backward()
    want = g * deriv(x.astype(np.float64))
    np.testing.assert_allclose(p.grad.numpy(), want, rtol=3e-6, atol=atol)

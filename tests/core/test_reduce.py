"""Reductions (sum, mean, max): forward against float64 numpy, gradients against finite
differences, strided views, the tie rule of max, determinism, and errors."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_grads

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(2024)

REFS = {"sum": np.sum, "mean": np.mean, "max": np.max}
SHAPES = [(1,), (3,), (17,), (3, 17), (17, 1, 3), (2, 3, 5, 17)]


def _axes(ndim: int) -> list:
    return [None, *range(ndim), -1, (0, ndim - 1) if ndim > 1 else (0,)]


@pytest.mark.parametrize("name", sorted(REFS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("keepdims", [False, True])
def test_forward_matches_numpy(name, shape, keepdims):
    x = RNG.standard_normal(shape).astype(np.float32)
    t = rc.tensor(x)
    for axis in _axes(len(shape)):
        got = getattr(ops, name)(t, axis=axis, keepdims=keepdims).numpy()
        want = REFS[name](x.astype(np.float64), axis=axis, keepdims=keepdims)
        assert got.shape == want.shape, (axis, got.shape, want.shape)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"axis={axis}")


@pytest.mark.parametrize("name", sorted(REFS))
def test_tensor_methods(name):
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    got = getattr(rc.tensor(x), name)(axis=0).numpy()
    np.testing.assert_allclose(got, REFS[name](x.astype(np.float64), axis=0), rtol=1e-6, atol=1e-6)


def test_large_sum_is_accurate():
    # 1000003 elements: float32 accumulation would be off by ~1e-4 relative; we accumulate in
    # double, so only the final rounding to float32 remains.
    x = RNG.uniform(0.0, 1.0, 1000003).astype(np.float32)
    want = x.astype(np.float64).sum()
    np.testing.assert_allclose(ops.sum(rc.tensor(x)).numpy(), want, rtol=2e-7)
    np.testing.assert_allclose(ops.mean(rc.tensor(x)).numpy(), want / x.size, rtol=2e-7)
    assert ops.max(rc.tensor(x)).numpy() == x.max()


@pytest.mark.parametrize(
    "shape,axis", [((3, 333335), 1), ((333335, 3), 0), ((7, 50000, 3), 1)], ids=str
)
def test_long_axes_split_across_tasks(shape, axis):
    x = RNG.uniform(-1.0, 1.0, shape).astype(np.float32)
    t = rc.tensor(x)
    np.testing.assert_allclose(
        ops.sum(t, axis=axis).numpy(), x.astype(np.float64).sum(axis), rtol=1e-5, atol=1e-4
    )
    np.testing.assert_array_equal(ops.max(t, axis=axis).numpy(), x.max(axis))


def test_sum_does_not_depend_on_thread_count():
    x = RNG.standard_normal((5, 300007)).astype(np.float32)
    before = rc.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            rc.set_num_threads(n)
            t = rc.tensor(x)
            results.append(
                (ops.sum(t).numpy(), ops.sum(t, axis=0).numpy(), ops.sum(t, axis=1).numpy())
            )
    finally:
        rc.set_num_threads(before)
    for r in results[1:]:
        for got, first in zip(r, results[0]):
            np.testing.assert_array_equal(got, first)


@pytest.mark.parametrize("name", sorted(REFS))
def test_views(name):
    x = RNG.standard_normal((6, 7, 9)).astype(np.float32)
    x64 = x.astype(np.float64)
    t = rc.tensor(x)
    ref = REFS[name]
    cases = [
        (t.permute(2, 0, 1), x64.transpose(2, 0, 1)),
        (t.transpose(0, 2), x64.transpose(2, 1, 0)),
        (t[:, ::2, 1::3], x64[:, ::2, 1::3]),
        (t[1:5, :, 2].T, x64[1:5, :, 2].T),
        (rc.tensor(x[0, 0]).broadcast_to((4, 9)), np.broadcast_to(x64[0, 0], (4, 9))),
    ]
    for view, want in cases:
        for axis in [None, *range(want.ndim)]:
            got = getattr(ops, name)(view, axis=axis).numpy()
            np.testing.assert_allclose(got, ref(want, axis=axis), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("axis", [None, 0, 1, 2, (0, 2)])
def test_sum_mean_grads(axis):
    x = RNG.standard_normal((2, 3, 4))
    check_grads(lambda t: ops.sum(t, axis=axis), [x])
    check_grads(lambda t: ops.mean(t, axis=axis, keepdims=True), [x])


@pytest.mark.parametrize("axis", [None, 0, 1, 2])
def test_max_grads(axis):
    # Distinct values, at least 0.1 apart, so finite differences never cross a tie.
    x = RNG.permutation(24).reshape(2, 3, 4) * 0.1
    check_grads(lambda t: ops.max(t, axis=axis), [x])


def test_max_grad_of_a_view():
    x = RNG.permutation(30).reshape(5, 6) * 0.1
    check_grads(lambda t: ops.max(t.T[::2], axis=1), [x])


def test_max_gradient_goes_to_the_first_maximum():
    x = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, -1.0, 2.0], [5.0, 5.0, 5.0, 5.0]], np.float32)
    p = rc.param(x)
    ops.sum(ops.max(p, axis=1)).backward()
    want = np.array([[0, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]], np.float32)
    np.testing.assert_array_equal(p.grad.numpy(), want)

    p = rc.param(x)
    ops.sum(ops.max(p, axis=0)).backward()
    want = np.array([[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    np.testing.assert_array_equal(p.grad.numpy(), want)

    p = rc.param(x)
    ops.max(p).backward()  # all axes: the first 5.0 in index order
    want = np.zeros_like(x)
    want[2, 0] = 1
    np.testing.assert_array_equal(p.grad.numpy(), want)


def test_max_propagates_nan():
    x = np.array([[1.0, np.nan, 3.0], [0.0, 1.0, 2.0]], np.float32)
    got = ops.max(rc.tensor(x), axis=1).numpy()
    assert np.isnan(got[0]) and got[1] == 2.0
    long = RNG.standard_normal(1000).astype(np.float32)
    long[517] = np.nan
    assert np.isnan(ops.max(rc.tensor(long)).numpy())


def test_empty_axes():
    x = np.zeros((3, 0), np.float32)
    np.testing.assert_array_equal(ops.sum(rc.tensor(x), axis=1).numpy(), np.zeros(3))
    assert np.isnan(ops.mean(rc.tensor(x), axis=1).numpy()).all()
    y = np.zeros((2, 0, 3), np.float32)  # an empty axis that is not the last one
    np.testing.assert_array_equal(
        ops.sum(rc.tensor(y), axis=1, keepdims=True).numpy(), np.zeros((2, 1, 3))
    )
    assert ops.sum(rc.tensor(y), axis=2).numpy().shape == (2, 0)
    with pytest.raises(ValueError, match="max: cannot reduce an axis of length 0"):
        ops.max(rc.tensor(x), axis=1)


def test_bad_axes_raise_value_error():
    t = rc.tensor(np.ones((2, 3), np.float32))
    for name in REFS:
        with pytest.raises(ValueError, match=f"{name}: axis 2 is out of range"):
            getattr(ops, name)(t, axis=2)
        with pytest.raises(ValueError, match=f"{name}: axis -3 is out of range"):
            getattr(ops, name)(t, axis=-3)
        with pytest.raises(ValueError, match="repeated"):
            getattr(ops, name)(t, axis=(1, -1))
    # The core op validates its parameter too.
    with pytest.raises(ValueError, match=r"sum: axis 5 is out of range.*\(2, 3\)"):
        ops.apply("sum", [t], ip=(5,))
    with pytest.raises(ValueError, match="max: takes one axis"):
        ops.apply("max", [t], ip=(0, 1))


def test_int_inputs_raise_type_error():
    t = rc.tensor(np.arange(6, dtype=np.int32).reshape(2, 3))
    for name in REFS:
        op = "sum" if name == "mean" else name
        with pytest.raises(TypeError, match=f"{op}: input 0 must be float32"):
            getattr(ops, name)(t, axis=0)
        with pytest.raises(TypeError, match=f"{op}: input 0 must be float32"):
            getattr(ops, name)(t)

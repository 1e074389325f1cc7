"""The lazy tensor API: creation, numpy interop, autodiff semantics, plan reuse, devices."""

from __future__ import annotations

import os

import numpy as np
import pytest

import recurra as rc
from recurra import ops


def test_creation_and_dtypes():
    assert rc.tensor([1.0, 2.0]).dtype == "float32"
    assert rc.tensor(np.arange(3)).dtype == "int32"
    assert rc.tensor(np.float64(2.5)).shape == ()
    assert rc.tensor([[1, 2], [3, 4]], dtype=np.float32).dtype == "float32"
    with pytest.raises(TypeError, match="unsupported dtype"):
        rc.tensor(np.array(["a"]))
    with pytest.raises(TypeError):
        rc.tensor(np.array([1 + 2j]))
    with pytest.raises(ValueError, match="int32"):
        rc.tensor(np.array([2**40]))


def test_numpy_interop_and_copy_keyword():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = rc.tensor(x)
    x[0, 0] = 100  # the tensor holds its own copy
    assert t.numpy()[0, 0] == 0
    a = np.asarray(t)
    assert not a.flags.writeable  # a view of the tensor's data: read-only
    b = np.asarray(t, copy=True)
    b[0, 0] = 5
    assert t.numpy()[0, 0] == 0
    np.testing.assert_array_equal(
        np.asarray(t, dtype=np.float64), x.astype(np.float64) * (x != 100)
    )
    with pytest.raises(ValueError):
        np.asarray(t, dtype=np.float64, copy=False)
    n = t.numpy()
    n[0, 1] = 42  # numpy() returns a copy
    assert t.numpy()[0, 1] == 1
    assert rc.tensor(3.5).item() == 3.5
    with pytest.raises(ValueError, match="item"):
        t.item()


def test_gradients_sum_when_used_twice_and_accumulate():
    x = rc.param(np.array([1.0, -2.0, 3.0]))
    y = ops.sum(x * x + x)  # d/dx = 2x + 1
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0, -3.0, 7.0])
    ops.sum(x).backward()  # accumulates like PyTorch
    np.testing.assert_allclose(x.grad.numpy(), [4.0, -2.0, 8.0])


def test_backward_rules():
    x = rc.param(np.ones((2, 2)))
    with pytest.raises(RuntimeError, match="scalar"):
        (x * 2.0).backward()
    (x * 2.0).backward(np.full((2, 2), 0.5, np.float32))
    np.testing.assert_allclose(x.grad.numpy(), np.ones((2, 2)))
    with pytest.raises(RuntimeError, match="does not require grad"):
        ops.sum(rc.tensor(np.ones(2))).backward()
    with rc.no_grad():
        z = x * 3.0
    assert not z.requires_grad
    assert rc.is_grad_enabled()


def test_lazy_until_needed_and_plan_reuse():
    w = rc.param(np.full((4,), 0.5))
    before = rc.plan_cache_info()

    def step(v):
        loss = ops.sum(ops.sqr(w * rc.tensor(v) - 1.0))
        loss.backward()
        g = w.grad.numpy()
        w.grad = None
        return g

    g1 = step(np.arange(4, dtype=np.float32))
    mid = rc.plan_cache_info()
    g2 = step(np.arange(4, dtype=np.float32) + 1)
    after = rc.plan_cache_info()
    assert mid["misses"] == before["misses"] + 1
    assert after["misses"] == mid["misses"]  # the second identical step planned nothing
    assert after["hits"] == mid["hits"] + 1
    v1, v2 = np.arange(4.0), np.arange(4.0) + 1
    np.testing.assert_allclose(g1, 2 * (0.5 * v1 - 1) * v1, rtol=1e-6)
    np.testing.assert_allclose(g2, 2 * (0.5 * v2 - 1) * v2, rtol=1e-6)


def test_devices():
    assert rc.tensor([1.0], device="cpu").device == rc.parse_device("cpu")
    with pytest.raises(ValueError, match="vulkan"):
        rc.tensor([1.0], device="vulkan:99")
    with pytest.raises(ValueError, match="unknown device"):
        rc.tensor([1.0], device="tpu")
    with pytest.raises(ValueError):
        rc.tensor([1.0], device="cpu:x")


def test_threads_and_package_info():
    n = rc.get_num_threads()
    assert n >= 1
    try:
        rc.set_num_threads(1)
        assert rc.get_num_threads() == 1
        x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
        one = ops.exp(rc.tensor(x)).numpy()
        rc.set_num_threads(2)
        two = ops.exp(rc.tensor(x)).numpy()
        np.testing.assert_array_equal(one, two)
    finally:
        rc.set_num_threads(n)
    with pytest.raises(ValueError):
        rc.set_num_threads(0)
    assert os.path.exists(os.path.join(rc.get_include(), "recurra", "backend.h"))
    assert rc.__version__

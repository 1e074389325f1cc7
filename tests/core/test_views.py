"""Views (reshape, permute/transpose, slicing, broadcast_to) share memory until copied."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_grads

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(7)


def test_reshape_permute_slice_forward():
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    t = rc.tensor(x)
    np.testing.assert_array_equal(t.reshape(6, -1).numpy(), x.reshape(6, -1))
    np.testing.assert_array_equal(t.permute(3, 1, 0, 2).numpy(), x.transpose(3, 1, 0, 2))
    np.testing.assert_array_equal(t.transpose(0, 2).numpy(), x.swapaxes(0, 2))
    np.testing.assert_array_equal(t.T.numpy(), x.T)
    np.testing.assert_array_equal(t[1, :, 1:4:2, ...].numpy(), x[1, :, 1:4:2, ...])
    np.testing.assert_array_equal(t[..., -1].numpy(), x[..., -1])
    np.testing.assert_array_equal(t[:, None, 0].numpy(), x[:, None, 0])
    # reshape of a non-contiguous view copies first (like numpy), with the right values
    np.testing.assert_array_equal(t.T.reshape(-1).numpy(), x.T.reshape(-1))
    np.testing.assert_array_equal(
        ops.broadcast_to(rc.tensor(x[0, 0, :, :1]), (3, 4, 5)).numpy(),
        np.broadcast_to(x[0, 0, :, :1], (3, 4, 5)),
    )


def test_view_gradients():
    x = RNG.standard_normal((3, 4))
    check_grads(lambda t: t.T[1:, ::2].reshape(-1) * 2.0, [x])
    check_grads(lambda t: t.permute(1, 0).contiguous()[2], [x])
    check_grads(lambda t: ops.broadcast_to(t[:, :1], (2, 3, 4)) * t, [x])


def test_view_errors():
    t = rc.tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="reshape"):
        t.reshape(4, 2)
    with pytest.raises(ValueError, match="permute"):
        t.permute(0, 0)
    with pytest.raises(ValueError, match="broadcast"):
        t.broadcast_to((3, 3))
    with pytest.raises(IndexError):
        t[2]
    with pytest.raises(IndexError):
        t[0, 0, 0]
    with pytest.raises(ValueError, match="at most 4 axes"):
        rc.tensor(np.zeros((1, 1, 1, 1, 1)))

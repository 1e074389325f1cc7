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


@pytest.mark.parametrize(
    "shape,perm",
    [
        ((1, 1), (1, 0)),
        ((3, 17), (1, 0)),
        ((33, 65), (1, 0)),
        ((2, 31, 40), (0, 2, 1)),
        ((2, 3, 5, 70), (1, 0, 3, 2)),
        ((4, 5, 6), (2, 0, 1)),  # last axis strided, the one before not unit: the gather path
    ],
    ids=str,
)
def test_contiguous_of_permuted_views(shape, perm):
    # Copies of transposed matrices go through tiles of 32 x 32: sizes across tile edges.
    x = RNG.standard_normal(shape).astype(np.float32)
    got = rc.tensor(x).permute(*perm).contiguous().numpy()
    np.testing.assert_array_equal(got, x.transpose(perm))
    # and the permute's gradient (a copy of the permuted gradient) lands where it belongs
    p = rc.param(x)
    g = RNG.standard_normal(x.transpose(perm).shape).astype(np.float32)
    (p.permute(*perm) * rc.tensor(g)).sum().backward()
    np.testing.assert_array_equal(p.grad.numpy(), g.transpose(np.argsort(perm)))


@pytest.mark.parametrize(
    "shape,index",
    [
        ((7,), np.s_[2:5]),
        ((7,), np.s_[1::3]),
        ((5, 9), np.s_[1:4, 2:7]),
        ((5, 9), np.s_[::2, 8:]),
        ((2, 6, 11), np.s_[:, 1:6:2, 3:10:3]),
        ((2, 3, 4, 21), np.s_[1:, :, 1:3, 5:16]),
        ((4, 5), np.s_[2:2, :]),  # empty
    ],
    ids=str,
)
def test_slice_gradient_scatters_into_zeros(shape, index):
    x = RNG.standard_normal(shape).astype(np.float32)
    p = rc.param(x)
    s = p[index]
    g = RNG.standard_normal(s.shape).astype(np.float32)
    (s * rc.tensor(g)).sum().backward()
    want = np.zeros(shape, np.float32)
    want[index] = g
    np.testing.assert_array_equal(p.grad.numpy(), want)


def test_gradients_of_disjoint_slices_add_up():
    # The Mamba-2 pattern: one projection cut into pieces along the last axis.
    x = RNG.standard_normal((2, 3, 10)).astype(np.float32)
    p = rc.param(x)
    gs = [RNG.standard_normal((2, 3, w)).astype(np.float32) for w in (4, 5, 1)]
    parts = [p[:, :, 0:4], p[:, :, 4:9], p[:, :, 9:]]
    sum(((a * rc.tensor(g)).sum() for a, g in zip(parts, gs)), rc.tensor(np.float32(0))).backward()
    np.testing.assert_allclose(p.grad.numpy(), np.concatenate(gs, axis=-1), rtol=0, atol=0)


def _split_graph(cuts):
    """A graph-API loss over slices p[..., a:b] of one parameter, and its backward."""
    g = rc.Graph()
    p = g.param((2, 3, 10))
    r = g.input((2, 3, 10))
    terms = [ops.mul(p[:, :, a:b], r[:, :, a:b]) for a, b in cuts]
    loss = ops.apply("sum_to", [terms[0]], ip=())
    for t in terms[1:]:
        loss = ops.add(loss, ops.apply("sum_to", [t], ip=()))
    g.set_loss(loss)
    g.build_backward(loss)
    return g, p, r


@pytest.mark.parametrize(
    "cuts,merged",
    [
        ([(0, 4), (4, 9), (9, 10)], True),  # a projection cut into pieces: one scatter
        ([(6, 10), (0, 2)], True),  # not covering everything, in any order
        ([(0, 5), (3, 10)], False),  # overlapping: the gradients add up
        ([(0, 4), (0, 4)], False),
    ],
    ids=str,
)
def test_gradients_of_last_axis_slices_merge_into_one_scatter(cuts, merged):
    g, p, r = _split_graph(cuts)
    pv = RNG.standard_normal((2, 3, 10)).astype(np.float32)
    rv = RNG.standard_normal((2, 3, 10)).astype(np.float32)
    g.set_data(p, pv)
    g.set_data(r, rv)
    g.compute()
    want = np.zeros_like(rv)
    for a, b in cuts:
        want[:, :, a:b] += rv[:, :, a:b]
    np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-6, atol=1e-6)
    # Merged: the zero-padded slice_grads and the inner adds are not planned. Unmerged,
    # the first slice_grad and the inner adds are computed into the gradient's own buffer
    # (an own chain), not planned in the arena either: len(cuts) - 1 nodes.
    n_grad_nodes = 2 * len(cuts) - 1  # slice_grads and adds
    skipped = n_grad_nodes - 1 - (len(cuts) - 1) if merged else 0
    assert g.memory()["n_planned"] == _planned_without_merge(cuts) - skipped


def _planned_without_merge(cuts):
    """Planned nodes of the same graph with the slices taken on the first axis instead
    (which never merge): the same op count."""
    g = rc.Graph()
    p = g.param((10, 3, 2))
    r = g.input((10, 3, 2))
    terms = [ops.mul(p[a:b], r[a:b]) for a, b in cuts]
    loss = ops.apply("sum_to", [terms[0]], ip=())
    for t in terms[1:]:
        loss = ops.add(loss, ops.apply("sum_to", [t], ip=()))
    g.set_loss(loss)
    g.build_backward(loss)
    return g.memory()["n_planned"]

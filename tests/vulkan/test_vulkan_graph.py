"""Explicit graphs on the Vulkan device: host data a device node reads is copied in (a
mirror) before each compute, except a graph constant's, which is copied once."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
from recurra import ops

pytestmark = pytest.mark.vulkan


def test_a_constant_is_uploaded_once_and_inputs_every_compute(vulkan: str) -> None:
    rng = np.random.default_rng(0)
    c = rng.standard_normal((4, 8)).astype(np.float32)
    g = rc.Graph(backends=[vulkan], strict=True)
    x = g.input((4, 8), name="x")
    y = ops.exp(x) * g.constant(c)
    g.set_output(y)
    for k in range(3):
        xv = rng.standard_normal((4, 8)).astype(np.float32)
        g.set_data(x, xv)
        rc.reset_transfer_stats()
        g.compute()
        up = rc.transfer_stats()["host_to_device"]
        np.testing.assert_allclose(g.get_data(y), np.exp(xv.astype(np.float64)) * c, rtol=1e-5)
        # the first compute copies x and the constant; later ones x alone
        assert up["count"] == (2 if k == 0 else 1), (k, up)
        assert up["bytes"] == (2 if k == 0 else 1) * xv.nbytes, (k, up)


def test_a_replayed_recording_sees_new_data_and_new_buffers(vulkan: str) -> None:
    # A node list seen before is replayed, not recorded again: the data it reads may change
    # between computes (new inputs, a leaf bound to another buffer) and the results follow.
    rng = np.random.default_rng(1)
    g = rc.Graph(backends=[vulkan], strict=True)
    x = g.input((3, 7), name="x")
    w = g.tensor((3, 7), name="w")
    h = x
    for _ in range(12):  # a chain of 24 nodes: long enough to be kept for replay
        h = ops.tanh(h * 0.9 + w)
    g.set_output(h)

    def want(xv: np.ndarray, wv: np.ndarray) -> np.ndarray:
        r = xv.astype(np.float64)
        for _ in range(12):
            r = np.tanh(r * 0.9 + wv)
        return r

    bufs = []
    for k in range(4):
        xv = rng.standard_normal((3, 7)).astype(np.float32)
        if k in (0, 2):  # the second buffer changes the node list: recorded anew
            wv = rng.standard_normal((3, 7)).astype(np.float32)
            bufs.append(rc.tensor(wv, device=vulkan))
            g._g.bind_device(w.id, bufs[-1]._value)
        g.set_data(x, xv)
        g.compute()
        np.testing.assert_allclose(g.get_data(h), want(xv, wv), rtol=1e-5, atol=1e-6)
    # the first buffer again: its recording may be replayed; the buffer's data changed
    wv0 = rng.standard_normal((3, 7)).astype(np.float32)
    bufs[0].assign_(wv0)
    g._g.bind_device(w.id, bufs[0]._value)
    g.compute()
    np.testing.assert_allclose(g.get_data(h), want(xv, wv0), rtol=1e-5, atol=1e-6)


def _split_graph(device: str | None, cuts, dtype: str, axis: int = 2):
    """loss = sum_i sum(p[a_i:b_i] * r[a_i:b_i]) over slices of one parameter p along `axis`
    (the last: a projection cut into pieces, as Mamba-2's; the first: never merged), on
    `device` with strict placement."""
    shape = (3, 5, 12) if axis == 2 else (12, 5, 3)
    g = rc.Graph(backends=[device], strict=True) if device else rc.Graph()
    p = g.param(shape)
    r = g.input(shape, dtype=dtype)
    q = p if dtype == "float32" else ops.cast(p, dtype)  # the chain in the dtype

    def cut(t, a, b):
        return t[:, :, a:b] if axis == 2 else t[a:b]

    terms = [ops.mul(cut(q, a, b), cut(r, a, b)) for a, b in cuts]
    loss = ops.apply("sum_to", [ops.cast(terms[0], "float32")], ip=())
    for t in terms[1:]:
        loss = ops.add(loss, ops.apply("sum_to", [ops.cast(t, "float32")], ip=()))
    g.set_loss(loss)
    g.build_backward(loss)
    return g, p, r


@pytest.mark.parametrize(
    "cuts,merged",
    [
        ([(0, 4), (4, 11), (11, 12)], True),  # covering the last axis: one copy per piece
        ([(7, 12), (0, 7)], True),  # in any order
        ([(0, 4), (6, 12)], False),  # a gap: a device writes no zeros, so slice_grads run
        ([(0, 6), (3, 12)], False),  # overlapping: the gradients add up
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradients_of_last_axis_slices_are_copied_into_their_windows(
    vulkan: str, cuts, merged: bool, dtype: str
) -> None:
    # The zero-padded slice_grads and the adds of them are not run on the device when the
    # pieces cover the gradient (each piece copied into its window instead): fewer nodes
    # planned than the same graph cut along the first axis (never merged), and the same
    # gradient as the CPU's, bit for bit.
    import ml_dtypes

    npdt = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(len(cuts))
    pv = rng.standard_normal((3, 5, 12)).astype(npdt).astype(np.float32)
    rv = rng.standard_normal((3, 5, 12)).astype(npdt)
    grads = []
    for device in (vulkan, None):
        g, p, r = _split_graph(device, cuts, dtype)
        g.set_data(p, pv)
        g.set_data(r, rv)
        g.compute()
        grads.append(np.asarray(p.grad.numpy()))
        if device:
            planned = g.memory()["n_planned"]
    want = np.zeros((3, 5, 12), np.float64)
    for a, b in cuts:
        want[:, :, a:b] += rv[:, :, a:b].astype(np.float64)
    np.testing.assert_array_equal(grads[0], want.astype(npdt).astype(np.float32))
    np.testing.assert_array_equal(grads[0].view(np.uint8), grads[1].view(np.uint8))
    baseline = _split_graph(vulkan, cuts, dtype, axis=0)[0].memory()["n_planned"]
    if merged:
        assert planned < baseline, (planned, baseline)
    else:
        assert planned == baseline, (planned, baseline)

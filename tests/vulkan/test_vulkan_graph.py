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

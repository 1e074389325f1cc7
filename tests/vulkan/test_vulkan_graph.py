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

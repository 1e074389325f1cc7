"""bfloat16/float16 on a Vulkan device: the backend has no 2-byte kernels yet, so its
supports_op answers no for such nodes; the scheduler runs them on the CPU (the result is the
CPU's, bit for bit), and strict placement refuses them with a clear error, never a wrong
result."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import recurra as rc
from recurra import ops

pytestmark = pytest.mark.vulkan

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_2_byte_nodes_fall_back_to_the_cpu(vulkan: str, dtype: np.dtype) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 16)).astype(dtype)
    b = rng.standard_normal((16, 4)).astype(dtype)
    want = ops.silu(ops.matmul(rc.tensor(a), rc.tensor(b))).numpy()
    g = rc.Graph(backends=[vulkan])
    x, w = g.input((8, 16), dtype=str(rc.tensor(a).dtype)), g.constant(b)
    h = ops.exp(g.constant(np.ones((8, 4), np.float32)))  # float32: on the device
    y = ops.silu(ops.matmul(x, w))
    g.set_output(y)
    g.set_output(h)
    g.set_data(x, a)
    g.compute()
    assert g.backend_of(y) == "cpu" and g.backend_of(h).startswith("vulkan")
    got = g.get_data(y)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    # a lazy tensor on the device: the same, the result back on the device
    t = rc.tensor(a, device=vulkan)
    assert t.dtype == rc.tensor(a).dtype and t.is_on_device
    np.testing.assert_array_equal(t.numpy().view(np.uint16), a.view(np.uint16))
    r = ops.silu(ops.matmul(t, rc.tensor(b, device=vulkan)))
    np.testing.assert_array_equal(r.numpy().view(np.uint16), want.view(np.uint16))


def test_strict_placement_refuses_2_byte_nodes(vulkan: str) -> None:
    g = rc.Graph(backends=[vulkan], strict=True)
    x = g.input((4, 4), dtype="bfloat16")
    y = ops.exp(x)
    g.set_output(y)
    with pytest.raises(RuntimeError, match="bfloat16"):
        g.set_data(x, np.ones((4, 4), BF16))
        g.compute()

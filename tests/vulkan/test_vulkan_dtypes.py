"""bfloat16/float16 on a Vulkan device: ops with 2-byte kernels (the elementwise ones here,
test_vulkan_half_elementwise.py; the shape, reduction and row ops, test_vulkan_half_shape.py)
run there. An op without one answers no in supports_op: the scheduler runs its node on the
CPU (the result is the CPU's, bit for bit), and strict placement refuses it with a clear
error, never a wrong result."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import recurra as rc
from recurra import ops

pytestmark = pytest.mark.vulkan

BF16 = np.dtype(ml_dtypes.bfloat16)
#: Ops that take 2-byte tensors in the core (RECURRA_OPS_HALF) and may still lack a 2-byte
#: Vulkan kernel (issue 18 brings them one by one).
CANDIDATES = {"matmul": lambda x: ops.matmul(x, ops.transpose(x))}


def no_kernel_op(vulkan: str):
    """The first candidate whose bfloat16 node strict placement refuses (with a reason that
    names bfloat16), else None."""
    for build in CANDIDATES.values():
        g = rc.Graph(backends=[vulkan], strict=True)
        x = g.input((8, 16), dtype="bfloat16")
        g.set_output(build(x))
        g.set_data(x, np.ones((8, 16), BF16))
        try:
            g.compute()
        except RuntimeError as e:
            assert "bfloat16" in str(e)
            return build
    return None


@pytest.fixture
def no_kernel(vulkan: str):
    build = no_kernel_op(vulkan)
    if build is None:
        pytest.skip("every candidate op has a 2-byte Vulkan kernel: nothing falls back")
    return build


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_2_byte_nodes_run_on_the_device_or_fall_back(
    vulkan: str, no_kernel, dtype: np.dtype
) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 16)).astype(dtype)
    b = rng.standard_normal((8, 16)).astype(dtype)

    def build(x, w):
        # relu and mul are exact in float32: the device's values equal the CPU's bit for bit
        y = ops.relu(ops.mul(x, w))
        return y, no_kernel(y)

    want_y, want_s = (t.numpy() for t in build(rc.tensor(a), rc.tensor(b)))
    g = rc.Graph(backends=[vulkan])
    x, w = g.input((8, 16), dtype=str(rc.tensor(a).dtype)), g.constant(b)
    h = ops.exp(g.constant(np.ones((8, 4), np.float32)))  # float32: on the device
    y, s = build(x, w)
    for t in (y, s, h):
        g.set_output(t)
    g.set_data(x, a)
    g.compute()
    assert g.backend_of(y).startswith("vulkan") and g.backend_of(h).startswith("vulkan")
    assert g.backend_of(s) == "cpu"
    for got, want in ((g.get_data(y), want_y), (g.get_data(s), want_s)):
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    # a lazy tensor on the device: the same, the results back on the device
    t = rc.tensor(a, device=vulkan)
    assert t.dtype == rc.tensor(a).dtype and t.is_on_device
    np.testing.assert_array_equal(t.numpy().view(np.uint16), a.view(np.uint16))
    ry, rs = build(t, rc.tensor(b, device=vulkan))
    np.testing.assert_array_equal(ry.numpy().view(np.uint16), want_y.view(np.uint16))
    np.testing.assert_array_equal(rs.numpy().view(np.uint16), want_s.view(np.uint16))


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)])
def test_strict_placement_runs_2_byte_elementwise_nodes(vulkan: str, dtype: np.dtype) -> None:
    g = rc.Graph(backends=[vulkan], strict=True)
    x = g.input((4, 4), dtype=str(rc.tensor(np.zeros(1, dtype)).dtype))
    y = ops.add(ops.exp(x), ops.cast(ops.cast(x, "float32"), x.dtype))
    g.set_output(y)
    g.set_data(x, np.full((4, 4), 0.5, dtype))
    g.compute()
    assert g.backend_of(y).startswith("vulkan")
    # exp(0.5) rounded to the dtype, + 0.5 rounded again
    e = np.float32(np.exp(np.float32(0.5))).astype(dtype).astype(np.float32)
    want = np.full((4, 4), e + np.float32(0.5), np.float32).astype(dtype)
    np.testing.assert_array_equal(g.get_data(y).view(np.uint16), want.view(np.uint16))

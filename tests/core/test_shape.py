"""Shape ops that move data: concat, pad, cumsum. Forward against numpy (exact for the
copies, float64 for cumsum), gradients against finite differences (gradcheck defaults)."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_grads

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(11)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


# ---- concat -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sa,sb,axis",
    [
        ((1,), (1,), 0),
        ((3,), (17,), 0),
        ((3, 1), (3, 17), 1),
        ((1, 5), (17, 5), 0),
        ((2, 3, 5), (2, 1, 5), 1),
        ((2, 3, 5), (2, 3, 3), -1),
        ((2, 1, 3, 4), (2, 1, 3, 1), 3),
        ((2, 3), (0, 3), 0),
    ],
    ids=str,
)
def test_concat_forward(sa, sb, axis):
    a, b = randn(*sa), randn(*sb)
    got = ops.concat([rc.tensor(a), rc.tensor(b)], axis=axis).numpy()
    np.testing.assert_array_equal(got, np.concatenate([a, b], axis=axis))


def test_concat_many_and_int32():
    parts = [randn(2, n) for n in (1, 3, 17, 2, 5)]
    got = ops.concat([rc.tensor(p) for p in parts], axis=1).numpy()
    np.testing.assert_array_equal(got, np.concatenate(parts, axis=1))
    ints = [np.arange(6, dtype=np.int32).reshape(2, 3), np.full((1, 3), -7, np.int32)]
    got = ops.concat(ints, axis=0)
    assert got.dtype == "int32"
    np.testing.assert_array_equal(got.numpy(), np.concatenate(ints, axis=0))
    single = randn(3, 2)
    np.testing.assert_array_equal(ops.concat([single]).numpy(), single)


def test_concat_strided_inputs():
    a, b = randn(5, 4), randn(3, 8)
    ta, tb = rc.tensor(a).T, rc.tensor(b)[:, ::2].T  # (4, 5) transposed, (4, 3) sliced + transposed
    np.testing.assert_array_equal(
        ops.concat([ta, tb], axis=1).numpy(), np.concatenate([a.T, b[:, ::2].T], 1)
    )
    np.testing.assert_array_equal(
        ops.concat([ta[1:, ::2], tb[::3]], axis=0).numpy(),
        np.concatenate([a.T[1:, ::2], b[:, ::2].T[::3]], 0),
    )


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_concat_grad(axis):
    sa, sb = [2, 3, 2], [2, 3, 2]
    sb[axis] = 1
    check_grads(
        lambda x, y: ops.concat([x, y], axis=axis),
        [RNG.standard_normal(sa), RNG.standard_normal(sb)],
    )


def test_concat_grad_three_with_reuse_and_views():
    a, b = RNG.standard_normal((2, 3)), RNG.standard_normal((3, 2))
    check_grads(lambda x, y: ops.concat([x, y.T, x], axis=0), [a, b])
    check_grads(lambda x, y: ops.concat([x[:, 1:], y.T[:, ::2]], axis=1), [a, b])


def test_concat_errors():
    a = rc.tensor(randn(2, 3))
    with pytest.raises(ValueError, match="concat"):
        ops.concat([a, randn(3, 3)], axis=1)
    with pytest.raises(ValueError, match="concat"):
        ops.concat([a, randn(2, 3, 1)], axis=0)
    with pytest.raises(ValueError, match="concat"):
        ops.concat([a, randn(2, 3)], axis=2)
    with pytest.raises(ValueError, match="concat"):
        ops.concat([])
    with pytest.raises(TypeError, match="concat"):
        ops.concat([a, np.ones((2, 3), np.int32)])
    with pytest.raises(ValueError, match="concat"):
        ops.apply("concat", [randn(2, 3), randn(2, 4)], ip=(0,))
    with pytest.raises(ValueError, match="concat"):
        ops.apply("concat", [randn(2, 3), randn(2, 4)])  # no axis


# ---- pad ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,width",
    [
        ((1,), 0),
        ((3,), 2),
        ((17,), (0, 3)),
        ((3, 1), ((1, 0), (2, 5))),
        ((2, 3, 5), 1),
        ((2, 3, 5), ((0, 0), (3, 1), (0, 2))),
        ((1, 2, 1, 3), ((1, 1), (0, 0), (2, 0), (1, 17))),
        ((0, 3), ((1, 1), (1, 0))),
    ],
    ids=str,
)
@pytest.mark.parametrize("value", [0.0, -2.5])
def test_pad_forward(shape, width, value):
    x = randn(*shape)
    got = ops.pad(rc.tensor(x), width, value=value).numpy()
    np.testing.assert_array_equal(got, np.pad(x, width, constant_values=value))


def test_pad_strided_and_int32():
    x = randn(6, 5)
    view = rc.tensor(x).T[1:, ::2]
    np.testing.assert_array_equal(
        ops.pad(view, ((2, 1), (0, 3)), 9.0).numpy(),
        np.pad(x.T[1:, ::2], ((2, 1), (0, 3)), constant_values=9.0),
    )
    xi = np.arange(6, dtype=np.int32).reshape(2, 3)
    got = ops.pad(xi, 1, value=-4)
    assert got.dtype == "int32"
    np.testing.assert_array_equal(got.numpy(), np.pad(xi, 1, constant_values=-4))


@pytest.mark.parametrize("width", [1, ((0, 2), (1, 0)), ((2, 0), (0, 0))], ids=str)
def test_pad_grad(width):
    check_grads(lambda t: ops.pad(t, width, value=3.0), [RNG.standard_normal((2, 3))])


def test_pad_grad_through_view():
    check_grads(
        lambda t: ops.pad(t.T[::2], ((1, 0), (0, 1), (2, 1))[1:]), [RNG.standard_normal((2, 3))]
    )


def test_pad_errors():
    x = rc.tensor(randn(2, 3))
    with pytest.raises(ValueError, match="pad"):
        ops.pad(x, -1)
    with pytest.raises(ValueError, match="pad"):
        ops.pad(x, ((1, 1), (1, 1), (1, 1)))
    with pytest.raises(TypeError, match="pad"):
        ops.pad(x, 1.5)
    with pytest.raises(ValueError, match="pad"):
        ops.apply("pad", [randn(2, 3)], ip=(1, 1), fp=(0.0,))
    with pytest.raises(ValueError, match="pad"):
        ops.apply("pad", [randn(2, 3)], ip=(1, 1, -1, 0), fp=(0.0,))
    with pytest.raises(ValueError, match="pad"):
        ops.apply("pad", [randn(2, 3)], ip=(1, 1, 1, 0))  # no value


# ---- cumsum -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,axis",
    [
        ((1,), 0),
        ((3,), -1),
        ((17,), 0),
        ((3, 17), 1),
        ((3, 17), 0),
        ((2, 3, 5), 1),
        ((2, 3, 5), -3),
        ((2, 1, 3, 4), 2),
        ((2, 3, 1030), 1),
        ((2, 0, 3), 2),
    ],
    ids=str,
)
@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum_forward(shape, axis, reverse):
    x = randn(*shape)
    got = ops.cumsum(rc.tensor(x), axis=axis, reverse=reverse).numpy()
    x64 = x.astype(np.float64)
    want = np.flip(np.cumsum(np.flip(x64, axis), axis), axis) if reverse else np.cumsum(x64, axis)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cumsum_strided_input():
    x = randn(5, 8)
    got = ops.cumsum(rc.tensor(x).T[::3], axis=1).numpy()
    np.testing.assert_allclose(
        got, np.cumsum(x.T[::3].astype(np.float64), axis=1), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum_grad(axis, reverse):
    check_grads(
        lambda t: ops.cumsum(t, axis=axis, reverse=reverse), [RNG.standard_normal((3, 2, 4))]
    )


def test_cumsum_grad_through_view():
    check_grads(lambda t: ops.cumsum(t.T[1:], axis=0), [RNG.standard_normal((3, 4))])


def test_cumsum_errors():
    with pytest.raises(ValueError, match="cumsum"):
        ops.cumsum(rc.tensor(randn(2, 3)), axis=2)
    with pytest.raises(TypeError, match="cumsum"):
        ops.cumsum(rc.tensor(np.ones(3, np.int32)))
    with pytest.raises(ValueError, match="cumsum"):
        ops.apply("cumsum", [randn(2, 3)], ip=(0, 2))
    with pytest.raises(ValueError, match="cumsum"):
        ops.apply("cumsum", [randn(2, 3)], ip=(-3, 0))
    with pytest.raises(ValueError, match="cumsum"):
        ops.apply("cumsum", [randn(2, 3)], ip=(0,))


# ---- sizes past int64 -------------------------------------------------------------------
# Element or byte counts that overflow int64 are refused where the shape is made, with the
# op and the shape in the message (they used to wrap around and crash); a countable size
# that cannot be allocated is a MemoryError naming the largest node. In a subprocess:
# a regression is a crash, which must not take the test run with it.
OVERFLOW = """
import sys
import numpy as np
import recurra as rc
from recurra import ops
dev = sys.argv[1]
cases = {
    "broadcast_to": lambda: ops.exp(
        rc.tensor(np.ones((1, 1), np.float32), device=dev).broadcast_to((2**31, 2**31))
    ).numpy(),
    "reshape": lambda: rc.tensor(np.zeros(0, np.float32), device=dev)
    .reshape(2**62, 4).sum(axis=1).numpy(),
    "leaf": lambda: rc.Graph().input((2**40, 2**40)),
    "huge": lambda: ops.exp(  # 2**62 bytes: countable, but no machine has them
        rc.tensor(np.ones((1, 1), np.float32), device=dev).broadcast_to((2**30, 2**30))
    ).numpy(),
}
for op, fn in cases.items():
    try:
        fn()
        print(op, "no error")
    except (ValueError, MemoryError) as e:
        print(op, type(e).__name__, e)
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_sizes_past_int64_raise(device):
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", OVERFLOW, device], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines())
    assert lines["broadcast_to"].startswith(
        "ValueError broadcast_to: shape (2147483648, 2147483648)"
    )
    assert lines["reshape"].startswith("ValueError reshape: shape (4611686018427387904, 4)")
    assert lines["leaf"].startswith("ValueError leaf: shape (1099511627776, 1099511627776)")
    assert lines["huge"].startswith("MemoryError recurra:")
    # the host names the largest intermediate, a device the node it cannot hold
    assert "exp" in lines["huge"] and "shape (1073741824, 1073741824)" in lines["huge"]

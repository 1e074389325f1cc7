"""Random shapes, dtypes (bfloat16 and float16 too) and parameters thrown at every op of
the native op table.

Whatever comes in, only Python exceptions may come out (ValueError, TypeError,
IndexError, MemoryError, RuntimeError): never a crash or an abort. When an op accepts its
inputs, running it must give a result of the shape that was inferred.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recurra as rc
from recurra import _core, ops

OPS = sorted(_core.op_names())
ALLOWED = (ValueError, TypeError, IndexError, MemoryError, RuntimeError)

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
dtypes = st.sampled_from(["float32", "float32", "float32", "int32", "bfloat16", "float16"])


@st.composite
def arrays(draw):
    shape = draw(shapes)
    dtype = draw(dtypes)
    if dtype == "int32":
        return np.asarray(
            draw(
                st.lists(
                    st.integers(-3, 6), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))
                )
            ),
            np.int32,
        ).reshape(shape)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    return rng.standard_normal(shape).astype(rc.DType(dtype).numpy)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(OPS),
    srcs=st.lists(arrays(), min_size=0, max_size=8),
    ip=st.lists(st.integers(-3, 6), min_size=0, max_size=12),
    fp=st.lists(st.floats(-4, 4, allow_nan=False), min_size=0, max_size=3),
)
def test_any_op_with_any_arguments_raises_cleanly(name, srcs, ip, fp):
    try:
        out = ops.apply(name, [rc.tensor(a) for a in srcs], ip=ip, fp=fp)
    except ALLOWED:
        return
    try:
        value = out.numpy()
    except ALLOWED:
        return
    assert value.shape == out.shape


@settings(max_examples=150, deadline=None)
@given(
    a=shapes,
    b=shapes,
    name=st.sampled_from(["add", "sub", "mul", "div"]),
)
def test_binary_broadcasting_matches_numpy_or_raises(a, b, name):
    x = np.ones(a, np.float32)
    y = np.full(b, 2.0, np.float32)
    try:
        want = getattr(
            np, {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide"}[name]
        )(x, y)
    except ValueError:
        try:
            getattr(ops, name)(rc.tensor(x), rc.tensor(y))
        except ValueError:
            return
        raise AssertionError(f"{name} accepted shapes {a} and {b} that numpy rejects") from None
    got = getattr(ops, name)(rc.tensor(x), rc.tensor(y)).numpy()
    np.testing.assert_array_equal(got, want)

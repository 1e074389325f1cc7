"""bfloat16 and float16 tensors on the CPU: conversions bit for bit against ml_dtypes and
numpy, casts with their gradients, ops computed in float32 against float64 references,
refusals, and memory (2 bytes an element).

Tolerances (results against float64 numpy on inputs already rounded to the dtype): one op
rounds its float32 result once, so it is within half a unit in the last place: relative
2^-8 for bfloat16 (8 significant bits), 2^-11 for float16 (11 bits). Chains of ops
round after each and get a few units."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import recurra as rc
from recurra import ops

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
NP = {"bfloat16": BF16, "float16": F16}
#: Half an ulp, relative: what rounding one float32 result to the dtype may cost.
HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
DTYPES = ["bfloat16", "float16"]


@pytest.fixture(autouse=True)
def _quiet_overflow():
    with np.errstate(over="ignore"):  # numpy's own casts to float16 overflow on purpose here
        yield


#: float32 mantissas at and around the rounding points of bfloat16 (16 dropped bits) and
#: float16 (13 dropped bits): ties, one below, one above, odd and even kept bits.
MANTISSAS = [0, 1, 0x7FFF, 0x8000, 0x8001, 0x17FFF, 0x18000, 0x18001, 0xFFF, 0x1000]
MANTISSAS += [0x1001, 0x2FFF, 0x3000, 0x3001, 0x7FFFFF, 0x7F8000, 0x400000]


def _edge_floats() -> np.ndarray:
    """float32 values where rounding to 2-byte floats is delicate: ties, near-ties, both
    sides of every exponent boundary, subnormals of all three formats, overflow, NaN, inf."""
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0, 65504.0, 65505.0, 65519.0]
    vals += [65519.996, 65520.0, 65536.0, 1e38, 3.4028235e38, -3.4028235e38]
    bits = []
    for e in range(0, 255):
        base = e << 23
        bits += [base | m for m in MANTISSAS]
    arr = np.array(bits, dtype=np.uint32).view(np.float32)
    rng = np.random.default_rng(0)
    rand = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    rand = rand[~np.isnan(rand)]
    out = np.concatenate([np.array(vals, np.float32), arr, -arr, rand])
    return np.ascontiguousarray(out, dtype=np.float32)


def _same_bits_or_nan(got: np.ndarray, want: np.ndarray) -> None:
    g, w = got.view(np.uint16), want.view(np.uint16)
    nan_w = np.isnan(want.astype(np.float32))
    nan_g = np.isnan(got.astype(np.float32))
    np.testing.assert_array_equal(nan_g, nan_w)
    # NaN: quiet, with the sign kept; everything else: the same bits
    np.testing.assert_array_equal(g[nan_w] & 0x8000, w[nan_w] & 0x8000)
    bad = np.flatnonzero(g[~nan_w] != w[~nan_w])
    assert bad.size == 0, (bad.size, g[~nan_w][bad[:5]], w[~nan_w][bad[:5]])


@pytest.mark.parametrize("name", DTYPES)
def test_float32_to_2_byte_float_rounds_like_ml_dtypes_and_numpy(name):
    x = _edge_floats()
    got = rc.tensor(x).to(getattr(rc, name)).numpy()
    assert got.dtype == NP[name]
    _same_bits_or_nan(got, x.astype(NP[name]))
    # the numbers at a tie round to even (bf16: 1 + 2^-8 is halfway between 1 and 1 + 2^-7)
    if name == "bfloat16":
        ties = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8)], np.float32)
        want = np.array([1.0, 1 + 2.0**-6, -1.0])
    else:
        ties = np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-25, 3 * 2.0**-25], np.float32)
        want = np.array([1.0, 1 + 2.0**-9, 0.0, 2.0**-23])
    np.testing.assert_array_equal(rc.tensor(ties).to(name).numpy().astype(np.float64), want)


@pytest.mark.parametrize("name", DTYPES)
def test_2_byte_float_to_float32_is_exact_for_every_pattern(name):
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(NP[name])
    got = rc.tensor(every).to(rc.float32).numpy()
    want = every.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    keep = ~np.isnan(want)
    np.testing.assert_array_equal(got[keep].view(np.uint32), want[keep].view(np.uint32))


def test_bfloat16_and_float16_convert_through_float32():
    x = _edge_floats()
    x = x[np.isfinite(x)]
    got = rc.tensor(x.astype(BF16)).to(rc.float16).numpy()
    want = x.astype(BF16).astype(np.float32).astype(F16)
    _same_bits_or_nan(got, want)


def test_dtype_objects_numpy_round_trip_and_storage():
    assert rc.bfloat16 == "bfloat16" and rc.float16.itemsize == 2 and rc.float32.itemsize == 4
    assert rc.bfloat16.numpy == BF16 and rc.int32.numpy == np.int32
    assert repr(rc.bfloat16) == "recurra.bfloat16"
    for name in DTYPES:
        a = np.array([[1.5, -2.25], [3e-3, 7.0]], dtype=NP[name])
        t = rc.tensor(a)
        assert t.dtype == name and t.dtype is getattr(rc, name)
        out = t.numpy()
        assert out.dtype == NP[name]
        np.testing.assert_array_equal(out.view(np.uint16), a.view(np.uint16))
        assert t.storage.nbytes == 8  # 2 bytes an element
        # tensor(..., dtype=) rounds to nearest even
        x = np.float32(1 + 2.0**-8 + 2.0**-12)
        assert rc.tensor([x], dtype=name).numpy()[0] == np.array([x]).astype(NP[name])[0]
    assert rc.tensor(np.ones(3)).dtype == rc.float32  # float64 still becomes float32
    assert rc.tensor([1, 2]).to(rc.int32).dtype == rc.int32  # same dtype: the same tensor
    with pytest.raises(TypeError, match="cast: converts between float32"):
        rc.tensor([1, 2]).to(rc.bfloat16)
    # the graph API casts with ops.cast (Tensor.to is the same op)
    g = rc.Graph()
    x = g.input((3,))
    y = ops.cast(x, rc.float16)
    g.set_output(y)
    g.set_data(x, np.array([1 + 2.0**-11, 65520.0, -0.1], np.float32))
    g.compute()
    got = g.get_data(y)
    assert y.dtype == rc.float16 and got.dtype == F16
    np.testing.assert_array_equal(got, np.array([1.0, np.inf, -0.1], np.float16))


@pytest.mark.parametrize("name", DTYPES)
def test_cast_gradient_is_cast_back_to_the_source_dtype(name):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    w = rng.standard_normal((3, 5)).astype(np.float32)
    p = rc.param(x)
    y = p.to(name)
    assert y.dtype == name and y.requires_grad
    loss = ops.sum(ops.mul(y.to(rc.float32), w))
    loss.backward()
    assert p.grad.dtype == rc.float32
    # d loss / d p = w, passing through y's dtype: w rounded to it, then widened exactly
    np.testing.assert_array_equal(p.grad.numpy(), w.astype(NP[name]).astype(np.float32))
    # a half parameter: its gradient is half, the float32 gradient rounded
    q = rc.param(x, dtype=name)
    loss = ops.sum(ops.mul(q.to(rc.float32), w))
    loss.backward()
    assert q.grad.dtype == name
    np.testing.assert_array_equal(
        q.grad.numpy().view(np.uint16), w.astype(NP[name]).view(np.uint16)
    )


def _close(got: np.ndarray, want: np.ndarray, name: str, ulps: float = 1.0, scale: bool = False):
    """got (dtype `name`) against the float64 reference: within `ulps` half-ulps relative
    (or of the result's largest magnitude with `scale`, for sums that cancel)."""
    assert got.dtype == NP[name], got.dtype
    g = got.astype(np.float64)
    tol = HALF_ULP[name] * ulps * 1.01
    ref = np.max(np.abs(want)) if scale else np.abs(want)
    err = np.abs(g - want)
    bad = err > tol * ref + 1e-30
    assert not bad.any(), (name, float(np.max(err / np.maximum(ref, 1e-30))), tol)


def _rounded(rng, name, *shape, scale=1.0):
    """A float32 array of values that the dtype holds exactly, and the same in float64."""
    a = (rng.standard_normal(shape) * scale).astype(np.float32).astype(NP[name])
    return a, a.astype(np.float64)


UNARY = [
    ("neg", ops.neg, np.negative, 1.0),
    ("abs", ops.abs, np.abs, 1.0),
    ("sqr", ops.sqr, np.square, 1.0),
    ("exp", ops.exp, np.exp, 1.0),
    ("relu", ops.relu, lambda x: np.maximum(x, 0), 1.0),
    ("silu", ops.silu, lambda x: x / (1 + np.exp(-x)), 1.0),
    ("sigmoid", ops.sigmoid, lambda x: 1 / (1 + np.exp(-x)), 1.0),
    ("tanh", ops.tanh, np.tanh, 1.0),
    ("softplus", ops.softplus, lambda x: np.log1p(np.exp(x)), 1.0),
    ("scale", lambda t: ops.scale(t, 0.37), lambda x: x * 0.37, 1.0),
]


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("op", UNARY, ids=[u[0] for u in UNARY])
def test_unary_ops_compute_in_float32_and_round_once(name, op):
    _, fn, ref, _ = op
    rng = np.random.default_rng(2)
    a, a64 = _rounded(rng, name, 7, 33)
    out = fn(rc.tensor(a))
    assert out.dtype == name
    _close(out.numpy(), ref(a64), name)


@pytest.mark.parametrize("name", DTYPES)
def test_binary_ops_and_python_numbers_keep_the_dtype(name):
    rng = np.random.default_rng(3)
    a, a64 = _rounded(rng, name, 4, 9)
    b, b64 = _rounded(rng, name, 9)  # broadcast
    ta, tb = rc.tensor(a), rc.tensor(b)
    _close((ta + tb).numpy(), a64 + b64, name)
    _close((ta - tb).numpy(), a64 - b64, name)
    _close((ta * tb).numpy(), a64 * b64, name)
    _close((ta / tb).numpy(), a64 / b64, name)
    # a Python number keeps the tensor's dtype; x * number is `scale`, whose factor is
    # applied in float32 (not rounded to the dtype first: as PyTorch's opmath)
    assert (ta * 0.3).dtype == name and (2.0 - ta).dtype == name
    _close((ta * 0.3).numpy(), a64 * np.float32(0.3), name)
    _close((2.0 - ta).numpy(), 2.0 - a64, name)
    _close((ta + 0.5).numpy(), a64 + 0.5, name)


@pytest.mark.parametrize("name", DTYPES)
def test_matmul_and_out_prod_accumulate_in_float32(name):
    rng = np.random.default_rng(4)
    a, a64 = _rounded(rng, name, 2, 48, 200)
    b, b64 = _rounded(rng, name, 2, 200, 40)
    out = ops.matmul(rc.tensor(a), rc.tensor(b))
    assert out.dtype == name and out.shape == (2, 48, 40)
    # one rounding of a float32 sum of 200 products (float32 error ~ 1e-6 of the scale)
    want = a64 @ b64
    err = np.abs(out.numpy().astype(np.float64) - want)
    assert np.all(err <= HALF_ULP[name] * 1.01 * np.abs(want) + 1e-5 * np.abs(want).max())
    c, c64 = _rounded(rng, name, 2, 200, 48)
    out = ops.out_prod(rc.tensor(c), rc.tensor(b))
    want = np.swapaxes(c64, -1, -2) @ b64
    err = np.abs(out.numpy().astype(np.float64) - want)
    assert np.all(err <= HALF_ULP[name] * 1.01 * np.abs(want) + 1e-5 * np.abs(want).max())
    # bfloat16 inputs, a float32 result: cast the result... or the inputs, never both mixed
    with pytest.raises(TypeError, match="does not promote"):
        ops.matmul(rc.tensor(a), rc.tensor(b.astype(np.float32)))


@pytest.mark.parametrize("name", DTYPES)
def test_sums_accumulate_in_float32(name):
    # 4096 ones and a large value: a bfloat16 accumulator would stall at 256
    a = np.ones((3, 4096), dtype=NP[name])
    out = ops.sum(rc.tensor(a), axis=-1)
    assert out.dtype == name
    np.testing.assert_array_equal(out.numpy().astype(np.float64).reshape(-1), [4096.0] * 3)
    rng = np.random.default_rng(5)
    x, x64 = _rounded(rng, name, 5, 300)
    got = ops.sum(rc.tensor(x), axis=1).numpy().astype(np.float64).reshape(-1)
    want = x64.sum(axis=1)
    assert np.all(np.abs(got - want) <= HALF_ULP[name] * 1.01 * np.abs(want) + 1e-5 * 300)


@pytest.mark.parametrize("name", DTYPES)
def test_gradients_have_the_parameters_dtype_and_match_float64(name):
    """loss = sum(silu(x @ w) * r): the gradients of x and w, in the dtype, against float64
    (each gradient passes several roundings: a few units)."""
    rng = np.random.default_rng(6)
    x, x64 = _rounded(rng, name, 6, 16)
    w, w64 = _rounded(rng, name, 16, 8, scale=0.25)
    r, r64 = _rounded(rng, name, 6, 8)
    px, pw = rc.param(x, dtype=name), rc.param(w, dtype=name)
    y = ops.silu(ops.matmul(px, pw))
    loss = ops.sum(ops.sum(ops.mul(y, rc.tensor(r)), axis=1), axis=0)
    assert loss.dtype == name
    loss.backward()
    assert px.grad.dtype == name and pw.grad.dtype == name
    h = x64 @ w64
    s = 1 / (1 + np.exp(-h))
    dh = r64 * (s + h * s * (1 - s))
    for got, want in ((px.grad.numpy(), dh @ w64.T), (pw.grad.numpy(), x64.T @ dh)):
        err = np.abs(got.astype(np.float64) - want)
        assert np.all(err <= 8 * HALF_ULP[name] * np.abs(want).max()), (name, err.max())


def test_ops_without_2_byte_kernels_refuse_at_node_creation():
    x = rc.tensor(np.ones((2, 8, 4), dtype=BF16))
    why = r"ssm_conv: input 0 is bfloat16.*float32 only.*to\(recurra.float32\)"
    with pytest.raises(TypeError, match=why):
        ops.apply("ssm_conv", [x, rc.tensor(np.ones((8, 4), dtype=np.float32))])
    with pytest.raises(TypeError, match="float32 only"):
        ops.apply("ssm_conv", [x, rc.tensor(np.ones((8, 4), dtype=BF16))])
    # the float32 ops that read 2-byte sources as they are (RECURRA_OPS_HALF_IN) take them
    y = ops.causal_conv_silu(x.permute(0, 2, 1), rc.tensor(np.ones((8, 4), dtype=BF16)))
    assert y.dtype == rc.float32
    # mixed float dtypes: refused, naming both
    with pytest.raises(TypeError, match="bfloat16 and float32; recurra does not promote"):
        rc.tensor(np.ones(3, BF16)) + rc.tensor(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="bfloat16 and float16"):
        rc.tensor(np.ones(3, BF16)) * rc.tensor(np.ones(3, F16))
    # the op works once cast
    got = ops.cross_entropy(
        rc.tensor(np.zeros((4, 8), dtype=BF16)).to(rc.float32), rc.tensor(np.zeros(4, np.int32))
    )
    np.testing.assert_allclose(got.numpy(), np.log(8.0), rtol=1e-6)


def test_op_spec_lists_the_ops_that_take_2_byte_floats():
    spec = ops.spec()
    half = {name for name, s in spec.items() if "bfloat16" in s.dtypes}
    assert {"cast", "matmul", "out_prod", "add", "mul", "sum", "silu", "act_grad"} <= half
    assert "cross_entropy" not in half and "ssm_scan" not in half and "adamw_step" not in half
    assert all(s.dtypes[0] == "float32" for s in spec.values())
    # every op outside the list refuses a bfloat16 source when the node is made, except the
    # float32 ones that read 2-byte sources as they are (RECURRA_OPS_HALF_IN)
    x = rc.tensor(np.ones((2, 3), dtype=BF16))
    with pytest.raises(TypeError, match="float32 only") as e:
        ops.apply("ssm_conv", [x.reshape(1, 2, 3), rc.tensor(np.ones((2, 2), BF16))])
    assert "ssm_conv: input 0 is bfloat16" in str(e.value)
    assert spec["gated_rms_norm"].reads_half and not spec["ssm_conv"].reads_half
    out = ops.apply("gated_rms_norm", [x, x, rc.tensor(np.ones(3, BF16))], (3,), (1e-5,))
    assert out.dtype == rc.float32


def test_memory_plan_gives_2_bytes_an_element():
    def arena(dtype: str) -> int:
        g = rc.Graph()
        a = g.input((256, 512), dtype=dtype)
        b = g.input((512, 128), dtype=dtype)
        y = ops.silu(ops.matmul(a, b))
        g.set_output(y)
        return g.memory()["arena_bytes"]

    f32 = arena("float32")
    assert f32 >= 256 * 128 * 4
    for name in DTYPES:
        assert arena(name) * 2 == f32, name

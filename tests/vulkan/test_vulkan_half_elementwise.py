"""bfloat16/float16 elementwise kernels on Vulkan (issue 18): cast, the unary maths and
activations, add/sub/mul/div, act_grad.

Each runs in a strict graph on the device (a node that fell back to the CPU would raise, and
every output is asserted to live on the device) and is compared with the CPU's result and with
an independent reference:

- cast: every 16-bit pattern of the source dtype and float32 edge cases (ties, subnormals,
  NaN, infinities, overflow), bit for bit against the CPU and against numpy/ml_dtypes'
  conversions (NaN: the positions);
- add/sub/mul/div: bit for bit against the CPU and against numpy's float32 arithmetic on the
  widened inputs, rounded once to the dtype (both are IEEE float32 operations);
- unary ops: every 16-bit pattern as input; bit for bit against the CPU where the float32
  formula is exact IEEE arithmetic, within one unit in the last place of the dtype where it
  calls exp/log/tanh/erf (GLSL's and the C library's float32 functions differ by a few
  float32 ulps, which moves a result across a rounding boundary of the 2-byte dtype now and
  then); against float64 numpy within the dtype's rounding plus the float32 kernel's error;
- gradients through the lazy API on the device, with strict placement.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np
import pytest

import recurra as rc
from recurra import opcases, ops
from recurra.opcases import _run

# NaN and overflowing values are converted on purpose (numpy warns about them)
pytestmark = [
    pytest.mark.vulkan,
    pytest.mark.filterwarnings("ignore:(invalid|overflow):RuntimeWarning"),
]

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
NP = {"float32": np.dtype(np.float32), "bfloat16": BF16, "float16": F16}
HALF = ["bfloat16", "float16"]
#: A unit in the last place relative to the value: 2^-7 (bfloat16), 2^-10 (float16).
ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10}
#: The smallest positive subnormal.
TINY = {"bfloat16": 2.0**-133, "float16": 2.0**-24}
RNG = np.random.default_rng(20261201)


# ---- helpers ----------------------------------------------------------------------------


def on_device(vulkan: str, build: Callable[..., Sequence], arrays: Sequence[np.ndarray]) -> list:
    """``build`` on graph inputs holding ``arrays``, in a strict graph on the device; returns
    its results, each asserted to be computed there."""
    g = rc.Graph(backends=[vulkan], strict=True)
    xs = [g.input(a.shape, dtype=rc.tensor(a[:0]).dtype) for a in arrays]
    outs = list(build(*xs))
    for o in outs:
        g.set_output(o)
    for x, a in zip(xs, arrays):
        g.set_data(x, a)
    g.compute()
    for o in outs:
        assert g.backend_of(o).startswith("vulkan"), g.placement()
    return [g.get_data(o) for o in outs]


def on_cpu(build: Callable[..., Sequence], arrays: Sequence[np.ndarray]) -> list:
    """The same on the CPU (lazy tensors)."""
    return [np.asarray(o.numpy()) for o in build(*[rc.tensor(a) for a in arrays])]


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def assert_bitwise(
    got: np.ndarray, want: np.ndarray, what: str = "", nan_payload: bool = True
) -> None:
    """Equal bit for bit; with nan_payload=False any NaN matches any NaN (arithmetic on a
    NaN may return the device's canonical NaN: the H200 does, lavapipe keeps the payload;
    Vulkan leaves it open). Copies and casts keep payloads everywhere."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape)
    same = bits(got) == bits(want)
    if not nan_payload:
        same |= np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
    diff = np.flatnonzero(~same)
    assert diff.size == 0, (
        f"{what}: {diff.size} of {got.size} differ, first at {diff[:4]}: "
        f"{got.reshape(-1)[diff[:4]]} vs {want.reshape(-1)[diff[:4]]}"
    )


def ordered(a: np.ndarray) -> np.ndarray:
    """2-byte floats as integers in the order of their values (-0 and +0 adjacent)."""
    u = bits(a).astype(np.int64)
    return np.where(u & 0x8000, 0x8000 - (u & 0x7FFF), 0x8000 + u)


def ulp_diff(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """The distance in units in the last place of two 2-byte arrays (NaN pairs: 0; a NaN
    against a number: a large value)."""
    nan_g, nan_w = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    d = np.abs(ordered(got) - ordered(want))
    d[nan_g & nan_w] = 0
    d[nan_g ^ nan_w] = 1 << 20
    return d


def all_patterns(dtype: str) -> np.ndarray:
    """Every value of the 2-byte dtype, (256, 256)."""
    return np.arange(1 << 16, dtype=np.uint16).view(NP[dtype]).reshape(256, 256)


def f32_edges() -> np.ndarray:
    """float32 values at the edges of the 2-byte dtypes' rounding: ties (to even, both
    ways, for bfloat16 and float16), subnormals of all three, NaN (quiet, signalling, with
    payloads, negative), infinities, overflow of float16 (65504, 65519.99, 65520) and of
    bfloat16 (past its largest finite value), zeros; then random bit patterns."""
    u = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001]
    u += [0x7FA00000, 0xFF812345, 0x7FFFFFFF, 0x00000001, 0x807FFFFF, 0x00400000, 0x7F7FFFFF]
    u += [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000, 0xBF818000]  # bf16 ties
    u += [0x7F7F8000, 0x7F7F7FFF, 0x7F7FC000, 0x00008000, 0x00018000, 0x0000C000]  # bf16 edges
    u += [0x3F801000, 0x3F803000, 0x3F801001, 0x3F800FFF, 0xBF803000]  # f16 ties at 1
    u += [0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0xC77FF000]  # f16 max
    u += [0x38800000, 0x387FFFFF, 0x387FE000, 0x33800000, 0x33000000, 0x33000001]  # f16 subn.
    u += [0x32FFFFFF, 0x33400000, 0x33C00000, 0x34200000, 0x34400000, 0x38000000, 0xB3400000]
    edges = np.array(u, dtype=np.uint32)
    rand = RNG.integers(0, 1 << 32, size=(1 << 16) - edges.size, dtype=np.uint64).astype(np.uint32)
    # values in float16's range too, not only the random exponents
    rand[: 1 << 14] = (RNG.standard_normal(1 << 14) * 1000).astype(np.float32).view(np.uint32)
    return np.concatenate([edges, rand]).view(np.float32).reshape(256, 256)


def reference_cast(x: np.ndarray, to: str) -> np.ndarray:
    """numpy's and ml_dtypes' conversion (through float32, exact from a 2-byte dtype)."""
    return x.astype(np.float32).astype(NP[to])


def assert_cast_matches_reference(got: np.ndarray, x: np.ndarray, to: str) -> None:
    want = reference_cast(x, to)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    assert_bitwise(got[~nan], want[~nan], f"cast to {to} against numpy")


# ---- cast -------------------------------------------------------------------------------

PAIRS = [(a, b) for a in NP for b in NP if a != b]


@pytest.mark.parametrize("src,to", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_cast_every_pattern_and_edge(vulkan: str, src: str, to: str) -> None:
    x = f32_edges() if src == "float32" else all_patterns(src)
    (got,) = on_device(vulkan, lambda t: [ops.cast(t, to)], [x])
    (cpu,) = on_cpu(lambda t: [ops.cast(t, to)], [x])
    assert got.dtype == NP[to]
    assert_bitwise(got, cpu, f"cast {src} -> {to} against the CPU")
    assert_cast_matches_reference(got, x, to)


@pytest.mark.parametrize("src,to", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
@pytest.mark.parametrize("n", [1, 3, 6, 1001])
def test_cast_sizes_and_views(vulkan: str, src: str, to: str, n: int) -> None:
    """Odd sizes (the four-element path's tail), a source at an odd element offset (the
    one-element path) and a transposed one (the core hands cast a dense copy of it, made by
    `contiguous`, which may run on the CPU: the cast itself must run on the device)."""
    x = (RNG.standard_normal((n, 3)) * 10).astype(NP[src])
    (got,) = on_device(vulkan, lambda t: [ops.cast(t, to)], [x])
    assert_cast_matches_reference(got, x, to)
    (got,) = on_device(vulkan, lambda t: [ops.cast(ops.reshape(t, (-1,))[1:], to)], [x])
    assert_cast_matches_reference(got, x.reshape(-1)[1:], to)
    g = rc.Graph(backends=[vulkan])
    t = g.input(x.shape, dtype=src)
    y = ops.cast(ops.transpose(t), to)
    g.set_output(y)
    g.set_data(t, x)
    g.compute()
    assert g.backend_of(y).startswith("vulkan")
    assert_cast_matches_reference(g.get_data(y), x.T, to)


# ---- unary ------------------------------------------------------------------------------

#: name -> (float parameters, float64 reference)
UNARY: dict[str, tuple[tuple[float, ...], Callable[[np.ndarray], np.ndarray]]] = {
    "neg": ((), lambda x: -x),
    "abs": ((), np.abs),
    "sqr": ((), lambda x: x * x),
    "sqrt": ((), np.sqrt),
    "exp": ((), np.exp),
    "log": ((), np.log),
    "scale": ((0.3,), lambda x: x * np.float64(np.float32(0.3))),
    "clamp": ((-1.5, 2.25), lambda x: np.where(np.isnan(x), x, np.clip(x, -1.5, 2.25))),
    "relu": ((), lambda x: np.maximum(x, 0.0)),
    "silu": ((), lambda x: x / (1.0 + np.exp(-x))),
    "gelu": ((), lambda x: 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))),
    "sigmoid": ((), lambda x: 1.0 / (1.0 + np.exp(-x))),
    "tanh": ((), np.tanh),
    "softplus": ((), lambda x: np.logaddexp(0.0, x)),
    "gelu_tanh": (
        (),
        lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    ),
    "relu_sqr": ((), lambda x: np.maximum(x, 0.0) ** 2),
}
#: Ops whose float32 formula is exact IEEE arithmetic (and sqrt, correctly rounded on
#: lavapipe): the device equals the CPU bit for bit. The others call exp/log/tanh/erf.
EXACT = {"neg", "abs", "sqr", "sqrt", "scale", "clamp", "relu", "relu_sqr"}
#: The others agree with the CPU within one unit in the last place of the dtype plus the
#: absolute error of their float32 formulas (GLSL's exp/log and act.glsl's tanh/erf against
#: the C library's: a few float32 ulps of 1, which the cancellation in gelu_tanh's 1 + tanh
#: and softplus's log1p, and tanh's 1 - exp(-2|x|) near 0, turn into many ulps of small
#: results), measured over every 16-bit input on lavapipe: 2.98e-7 at most (gelu_tanh near
#: x = -4), below F32_ATOL. Results in float32's subnormal range (exp, sigmoid and silu
#: below -87) differ by less than 2^-126; the logarithm of a float32 subnormal (bfloat16's
#: subnormal inputs) is off by up to 8 bfloat16 ulps on lavapipe and is left out.
F32_ATOL = 4e-7 + 2.0**-126


_FLUSHES: dict[str, bool] = {}


def flushes_subnormals(vulkan: str) -> bool:
    """Whether the device's float32 arithmetic flushes subnormals to zero (NVIDIA's does by
    default; lavapipe keeps them): abs of bfloat16's 2^-130 comes back 0."""
    if vulkan not in _FLUSHES:
        x = np.array([2.0**-130], NP["bfloat16"])
        (got,) = on_device(vulkan, _unary("abs"), [x])
        _FLUSHES[vulkan] = float(got[0]) == 0.0
    return _FLUSHES[vulkan]


def subnormal(a: np.ndarray) -> np.ndarray:
    """Where ``a`` is a nonzero float32 subnormal (all of bfloat16's subnormals are)."""
    v = np.abs(a.astype(np.float64))
    return (v > 0) & (v < 2.0**-126)


def close_to_cpu(
    name: str,
    x: np.ndarray | None,
    got: np.ndarray,
    cpu: np.ndarray,
    exact: set[str] = EXACT,
    atol=F32_ATOL,
    flush: bool = False,
) -> np.ndarray:
    """Where got agrees with the CPU's result, by the rules above. flush: the device flushes
    float32 subnormals (flushes_subnormals), so a subnormal input may act as zero (any result
    there is taken) and a subnormal result may come back as zero."""
    g, c = got.astype(np.float64), cpu.astype(np.float64)
    if name in exact:  # NaN results: any NaN (see assert_bitwise)
        ok = (bits(got) == bits(cpu)) | (np.isnan(g) & np.isnan(c))
    else:
        with np.errstate(invalid="ignore"):
            ok = ulp_diff(got, cpu) <= 1
            ok |= np.abs(g - c) <= np.abs(c) * ULP[str(rc.tensor(got[:0]).dtype)] + atol
    if name == "log" and x is not None:
        ok |= np.abs(x.astype(np.float64)) < 2.0**-126
    if flush:
        # (a subnormal float32 result that rounds up to the dtype's smallest normal too)
        ok |= (np.abs(c) <= 2.0**-126) & (np.abs(g) < 2.0**-126)
        if x is not None:
            ok |= np.abs(x.astype(np.float64)) < 2.0**-126
    return ok


def test_the_unary_table_is_every_unary_op() -> None:
    assert {name for name, s in rc.ops.spec().items() if s.unary >= 0} == set(UNARY)


def _unary(name: str) -> Callable[..., list]:
    fp = UNARY[name][0]
    return lambda t: [ops.apply(name, [t], fp=fp)]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_every_input(vulkan: str, name: str, dtype: str) -> None:
    x = all_patterns(dtype)
    (got,) = on_device(vulkan, _unary(name), [x])
    (cpu,) = on_cpu(_unary(name), [x])
    assert got.dtype == NP[dtype]
    bad = np.flatnonzero(~close_to_cpu(name, x, got, cpu, flush=flushes_subnormals(vulkan)))
    xs, gs, cs = (a.reshape(-1)[bad[:4]] for a in (x, got, cpu))
    assert bad.size == 0, f"{name} {dtype}: {bad.size} differ from the CPU: x {xs}, {gs} vs {cs}"
    # float64 numpy: within rounding to the dtype (half an ulp) plus the float32 kernel's
    # error (relative 2^-20 for the exact ops' double rounding, 1e-5 with an absolute 1e-6
    # for the transcendental ones); NaN and infinities where the reference has them.
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        want = UNARY[name][1](x64)
    if flushes_subnormals(vulkan):  # subnormal inputs act as zero, subnormal results flush
        keep = ~subnormal(x) & ~(subnormal(want) & (got.astype(np.float64) == 0))
        x, x64, got, want = x[keep], x64[keep], got[keep], want[keep]
    elif name == "log":  # lavapipe's log of float32 subnormals (see F32_ATOL): below -80
        sub = (x64 > 0) & (x64 < 2.0**-126)
        assert np.all(got.astype(np.float64)[sub] < -80) and np.all(np.isfinite(got[sub]))
        want = np.where(sub, got.astype(np.float64), want)
    g = got.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(want))
    big = np.abs(want) > float(np.finfo(NP[dtype]).max)  # overflows the dtype: infinity
    fin = np.isfinite(want) & ~big
    inf = ~fin & ~np.isnan(want)
    np.testing.assert_array_equal(g[inf], np.sign(want[inf]) * np.inf)
    rel, atol = (2.0**-20, 0.0) if name in EXACT else (1e-5, 1e-6)
    err = np.abs(g[fin] - want[fin])
    tol = (ULP[dtype] / 2 + rel) * np.abs(want[fin]) + TINY[dtype] + atol
    bad = np.flatnonzero(err > tol)
    assert bad.size == 0, (name, dtype, x64[fin][bad[:4]], g[fin][bad[:4]], want[fin][bad[:4]])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["silu", "scale", "exp"])
def test_unary_views_and_sizes(vulkan: str, name: str, dtype: str) -> None:
    """Transposed (the general path), at an odd offset (one element an invocation) and odd
    sizes (the four-element path's tail)."""
    for shape in [(1,), (3,), (7, 5), (33, 65)]:
        x = (RNG.standard_normal(shape) * 3).astype(NP[dtype])
        views = {
            "dense": lambda t: t,
            "transposed": ops.transpose if len(shape) == 2 else (lambda t: t),
            "offset": lambda t: ops.reshape(t, (-1,))[1:],
        }
        for how, view in views.items():

            def build(t, view=view):
                return _unary(name)(view(t))

            (got,) = on_device(vulkan, build, [x])
            (cpu,) = on_cpu(build, [x])
            assert close_to_cpu(name, None, got, cpu).all(), (name, dtype, shape, how, got, cpu)


# ---- binary -----------------------------------------------------------------------------

BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}


def half_values(shape: tuple[int, ...], dtype: str, specials: bool = True) -> np.ndarray:
    """Normal values with a sprinkling of zeros, subnormals, infinities and NaN."""
    x = (RNG.standard_normal(shape) * 4).astype(np.float32)
    if specials:
        flat = x.reshape(-1)
        pick = RNG.integers(0, flat.size, size=max(1, flat.size // 16))
        sub = float(TINY[dtype]) * 3
        choices = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, sub, -sub, 1e30, 60000.0])
        flat[pick] = RNG.choice(choices, size=pick.size)
    return x.astype(NP[dtype])


def numpy_binary(name: str, a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    """numpy's float32 operation on the widened inputs, rounded once to the dtype."""
    with np.errstate(all="ignore"):
        return BINARY[name](a.astype(np.float32), b.astype(np.float32)).astype(NP[dtype])


def assert_binary(
    got: np.ndarray,
    cpu: np.ndarray,
    want: np.ndarray,
    what: str,
    inputs: tuple[np.ndarray, ...] = (),
    flush: bool = False,
) -> None:
    """Bitwise against the CPU and numpy; with ``flush`` (the device flushes float32
    subnormals) the elements with a subnormal operand, and the subnormal results that came
    back as zero, are left out."""
    if flush:
        keep = ~np.logical_or.reduce([subnormal(np.broadcast_to(x, got.shape)) for x in inputs])
        keep &= ~((subnormal(cpu) | subnormal(want)) & (got.astype(np.float64) == 0))
        got, cpu, want = got[keep], cpu[keep], want[keep]
    assert_bitwise(got, cpu, what + " against the CPU", nan_payload=False)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    assert_bitwise(got[~nan], want[~nan], what + " against numpy")


#: (shape of a, shape of b): same shapes (the four-element path and its tail), broadcasting
#: both ways (the general path), a scalar-like operand.
SHAPES = [((1003,), (1003,)), ((64, 32), (64, 32)), ((5, 1, 7), (3, 7)), ((4, 3, 1), (1, 5))]
SHAPES += [((2, 3, 4, 5), (5,)), ((1,), (6, 9))]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("sa,sb", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
def test_binary_broadcasting(vulkan: str, name: str, dtype: str, sa, sb) -> None:
    a, b = half_values(sa, dtype), half_values(sb, dtype)
    build = lambda x, y: [ops.apply(name, [x, y])]  # noqa: E731
    (got,) = on_device(vulkan, build, [a, b])
    (cpu,) = on_cpu(build, [a, b])
    want = numpy_binary(name, a, b, dtype)
    flush = flushes_subnormals(vulkan)
    assert_binary(got, cpu, want, f"{name} {dtype} {sa} {sb}", (a, b), flush)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_strided_sources(vulkan: str, name: str, dtype: str) -> None:
    """A transposed source with a dense one, both at odd offsets, a transposed one broadcast
    against a column."""
    a, b = half_values((37, 21), dtype), half_values((21, 37), dtype)
    c = half_values((21, 1), dtype)

    def build(x, y, z):
        xt = ops.transpose(x)
        flat_x, flat_y = ops.reshape(x, (-1,))[1:], ops.reshape(y, (-1,))[:-1]
        return [
            ops.apply(name, [xt, y]),
            ops.apply(name, [flat_x, flat_y]),
            ops.apply(name, [xt, z]),
        ]

    got = on_device(vulkan, build, [a, b, c])
    cpu = on_cpu(build, [a, b, c])
    wants = [
        numpy_binary(name, a.T, b, dtype),
        numpy_binary(name, a.reshape(-1)[1:], b.reshape(-1)[:-1], dtype),
        numpy_binary(name, a.T, c, dtype),
    ]
    operands = [(a.T, b), (a.reshape(-1)[1:], b.reshape(-1)[:-1]), (a.T, c)]
    flush = flushes_subnormals(vulkan)
    for k, (g_, c_, w_, xs) in enumerate(zip(got, cpu, wants, operands)):
        assert_binary(g_, c_, w_, f"{name} {dtype} result {k}", xs, flush)


# ---- act_grad ---------------------------------------------------------------------------

ACTIVATIONS = ["abs", "sqrt", "log", "clamp", "relu", "silu", "gelu", "sigmoid", "tanh"]
ACTIVATIONS += ["softplus", "gelu_tanh", "relu_sqr"]
#: f'(x) in float64 from x and y = f(x) (y where the op's formula uses it: the rounded y the
#: node is given)
DERIV: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "abs": lambda x, y: np.sign(x),
    "sqrt": lambda x, y: 0.5 / y,
    "log": lambda x, y: 1.0 / x,
    "clamp": lambda x, y: ((x >= -1.5) & (x <= 2.25)).astype(np.float64),
    "relu": lambda x, y: (x > 0).astype(np.float64),
    "silu": lambda x, y: (1 / (1 + np.exp(-x))) * (1 + x * (1 - 1 / (1 + np.exp(-x)))),
    "gelu": lambda x, y: (
        0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
        + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    ),
    "sigmoid": lambda x, y: y * (1 - y),
    "tanh": lambda x, y: 1 - y * y,
    "softplus": lambda x, y: 1 / (1 + np.exp(-x)),
    "gelu_tanh": lambda x, y: (
        0.5 * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x**3)))
        + 0.5
        * x
        * (1 - np.tanh(0.7978845608 * (x + 0.044715 * x**3)) ** 2)
        * 0.7978845608
        * (1 + 0.134145 * x * x)
    ),
    "relu_sqr": lambda x, y: 2 * np.maximum(x, 0),
}


def act_inputs(name: str, dtype: str, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """g, x, y = f(x) (the CPU's, in the dtype) for act_grad; x positive for sqrt and log."""
    x = (RNG.standard_normal(n) * 3).astype(np.float32)
    if name in ("sqrt", "log"):
        x = np.abs(x) + 0.05
    x = x.astype(NP[dtype])
    g = RNG.standard_normal(n).astype(NP[dtype])
    (y,) = on_cpu(_unary(name), [x])
    return g, x, y


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("n", [5, 4099])
def test_act_grad(vulkan: str, name: str, dtype: str, n: int) -> None:
    assert set(DERIV) == set(ACTIVATIONS)
    g, x, y = act_inputs(name, dtype, n)
    code, fp = rc.ops.spec()[name].unary, UNARY[name][0]
    build = lambda *t: [ops.apply("act_grad", list(t), ip=(code,), fp=fp)]  # noqa: E731
    (got,) = on_device(vulkan, build, [g, x, y])
    (cpu,) = on_cpu(build, [g, x, y])
    # exact arithmetic of x, y for these; FMA contraction on the device (y * (1 - y),
    # 1 - y * y) and the transcendental functions of the others: F32_ATOL times |g|
    exact = {"abs", "sqrt", "log", "clamp", "relu", "relu_sqr"}
    # (gelu_tanh's derivative cancels 0.5 (1 + t) against 0.5 x (1 - t^2)(...) for negative
    # x, where t is near -1: its float32 error grows as |x|^3)
    x64 = np.abs(x.astype(np.float64))
    atol = F32_ATOL * np.maximum(1.0, np.abs(g.astype(np.float64)))
    if name == "gelu_tanh":
        atol *= 1 + x64**3
    flush = flushes_subnormals(vulkan)
    bad = np.flatnonzero(~close_to_cpu(name, x, got, cpu, exact, atol, flush))
    assert bad.size == 0, (name, dtype, x[bad[:4]], got[bad[:4]], cpu[bad[:4]])
    want = g.astype(np.float64) * DERIV[name](x.astype(np.float64), y.astype(np.float64))
    # the dtype's rounding of the result plus the float32 derivative's error
    rel = ULP[dtype] / 2 + 2e-5
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= rel * np.abs(want) + atol / F32_ATOL * 1e-6 + TINY[dtype]), (
        name,
        dtype,
        float(err.max()),
    )


def test_act_grad_misaligned_sources(vulkan: str) -> None:
    """Sources at an odd element offset: the one-element path."""
    g, x, y = act_inputs("silu", "bfloat16", 1001)
    code = rc.ops.spec()["silu"].unary

    def build(*t):
        return [ops.apply("act_grad", [ops.reshape(v, (-1,))[1:] for v in t], ip=(code,))]

    (got,) = on_device(vulkan, build, [g, x, y])
    (cpu,) = on_cpu(build, [g, x, y])
    assert close_to_cpu("silu", None, got, cpu, set(), F32_ATOL * 4).all()


# ---- gradients through the lazy API on the device -----------------------------------------


@pytest.fixture
def strict():
    before = rc.strict_placement()
    rc.set_strict_placement(True)
    yield
    rc.set_strict_placement(before)


@pytest.mark.parametrize("dtype", HALF)
def test_gradients_on_the_device(vulkan: str, dtype: str, strict) -> None:
    """Parameters of the dtype on the device; loss = sum(cast(f(a, b), float32) * R): the
    forward and backward elementwise nodes (silu, mul, div, sub, act_grad, cast) run there
    (strict placement: a fallback raises)."""
    a = (RNG.standard_normal((33, 17)) * 2).astype(NP[dtype])
    b = (RNG.uniform(0.5, 2.0, (33, 17)) * np.sign(RNG.standard_normal((33, 17)))).astype(NP[dtype])
    r = RNG.standard_normal((33, 17)).astype(np.float32)

    def run(device: str | None):
        pa, pb = rc.param(a, device=device, dtype=dtype), rc.param(b, device=device, dtype=dtype)
        h = ops.sub(ops.div(ops.silu(pa), pb), ops.mul(pa, pb))
        loss = ops.sum(ops.mul(h.to(rc.float32), rc.tensor(r, device=device)))
        loss.backward()
        assert pa.grad is not None and pb.grad is not None
        return np.asarray(pa.grad.numpy()), np.asarray(pb.grad.numpy())

    ga, gb = run(vulkan)
    assert ga.dtype == NP[dtype] and gb.dtype == NP[dtype]
    rc.set_strict_placement(False)
    ca, cb = run(None)
    # against the CPU: the same nodes, silu's sigmoid through exp (one ulp at most)
    assert ulp_diff(ga, ca).max() <= 2 and ulp_diff(gb, cb).max() <= 2
    # against float64: d/da = (silu'(a) / b - b) R, d/db = (-silu(a) / b^2 - a) R, each node
    # rounded to the dtype (a few of its ulps relative to the terms' size)
    a64, b64, r64 = a.astype(np.float64), b.astype(np.float64), r.astype(np.float64)
    s = 1 / (1 + np.exp(-a64))
    want_a = (s * (1 + a64 * (1 - s)) / b64 - b64) * r64
    want_b = (-(a64 * s) / b64**2 - a64) * r64
    scale_a = (np.abs(s * (1 + a64 * (1 - s)) / b64) + np.abs(b64)) * np.abs(r64)
    scale_b = (np.abs(a64 * s / b64**2) + np.abs(a64)) * np.abs(r64)
    assert np.all(np.abs(ga.astype(np.float64) - want_a) <= 4 * ULP[dtype] * scale_a + 1e-6)
    assert np.all(np.abs(gb.astype(np.float64) - want_b) <= 4 * ULP[dtype] * scale_b + 1e-6)


@pytest.mark.parametrize("dtype", HALF)
def test_cast_gradient_on_the_device(vulkan: str, dtype: str, strict) -> None:
    """A float32 parameter cast to the dtype and back: its gradient is the float32 weight
    cast to the dtype and back (the backward casts), every node on the device."""
    w = RNG.standard_normal(1001).astype(np.float32)
    r = RNG.standard_normal(1001).astype(np.float32)
    p = rc.param(w, device=vulkan)
    y = ops.gelu(p.to(dtype)).to(rc.float32)
    ops.sum(ops.mul(y, rc.tensor(r, device=vulkan))).backward()
    got = np.asarray(p.grad.numpy())
    assert got.dtype == np.float32
    # act_grad in the dtype of (R cast to the dtype), cast back exactly
    rd = r.astype(NP[dtype])
    x = w.astype(NP[dtype]).astype(np.float64)
    want = rd.astype(np.float64) * DERIV["gelu"](x, x)
    assert np.all(np.abs(got - want) <= (ULP[dtype] / 2 + 2e-5) * np.abs(want) + 1e-6)


# ---- the op-case registry in 2-byte floats ------------------------------------------------

#: The ops with 2-byte kernels here.
HALF_KERNELS = {"cast", "add", "sub", "mul", "div", "act_grad", *UNARY}
HALF_CASES = [
    c
    for c in opcases.cases()
    if c.node is not None
    and c.update is None
    and c.node.op in HALF_KERNELS - {"cast"}  # cast's dtype is its own: tested above
    and any(v.dtype == np.float32 for v in c.make_inputs().values())
]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", HALF_CASES, ids=[c.id for c in HALF_CASES])
def test_registry_cases_in_2_byte_floats(vulkan: str, monkeypatch, case, dtype: str) -> None:
    """Every registry case of these ops in the dtype on the device, under strict placement
    (no fallback), against its float64 reference (opcases.half_errors, as the CPU's
    test_opcases does); its gradients (forward and backward on the device, not strict)
    against float32 on the CPU (opcases.half_grad_errors)."""
    real_eval, real_grads = _run.evaluate, _run._grads
    monkeypatch.setattr(_run, "evaluate", lambda c, data=None: real_eval(c, data, vulkan))
    before = rc.strict_placement()
    rc.set_strict_placement(True)
    try:
        assert opcases.half_errors(case, dtype) == []
    finally:
        rc.set_strict_placement(before)
    if case.grad and not case.nonfinite:

        def grads(c, data, device, dt=None):
            return real_grads(c, data, vulkan if dt is not None else device, dt)

        monkeypatch.setattr(_run, "_grads", grads)
        assert opcases.half_grad_errors(case, dtype) == []

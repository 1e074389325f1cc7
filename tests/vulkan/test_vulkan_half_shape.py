"""bfloat16/float16 shape ops, reductions and lookups on a Vulkan device (issue 18).

contiguous, concat, pad, fill, slice_grad, sum (mean), sum_to, max, max_grad, cumsum,
get_rows and get_rows_back run their 2-byte shader variants ("_h", shaders/half.glsl):
graphs built with strict placement prove every such node runs on the device. Each result is
checked against the CPU's (bit for bit where the maths is the same: copies, max, lookups,
the in-order scatter-add) and against a float64 numpy reference with a per-dtype tolerance:
one rounding to the dtype (relative EPS: 2^-8 bfloat16, 2^-11 float16; one subnormal step
near zero) plus the float32
accumulation of the sums (2e-6 of the sum of magnitudes). Odd sizes (1, 3, 257, 65537: the
16-bit halves of 32-bit words), transposed and sliced views (offsets at odd elements) and
gradients through the lazy tensor API on the device are covered.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import recurra as rc
from recurra import opcases, ops
from recurra._tensor import LAZY
from recurra.opcases import _run

pytestmark = pytest.mark.vulkan

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
DTYPES = [BF16, F16]
EPS = {BF16: 2.0**-8, F16: 2.0**-11}
TINY = {BF16: 2.0**-133, F16: 2.0**-24}  # the subnormal step: the error floor near zero
CODE = {BF16: 2, F16: 3}
SIZES = [1, 3, 257, 65537]


def ids(dt: np.dtype) -> str:
    return "bf16" if dt == BF16 else "f16"


def rand(shape, dtype: np.dtype, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def run(build, arrays, device: str | None, strict: bool = True):
    """build(graph, *constants) -> output, computed on `device` with strict placement (or on
    the CPU alone for None). Returns (result, ops that ran on the device)."""
    g = rc.Graph(backends=[device], strict=strict) if device else rc.Graph()
    out = build(g, *[g.constant(a) for a in arrays])
    g.set_output(out)
    g.compute()
    core = g._g
    on_device = {core.info(i)["op"] for i in range(len(core)) if core.backend_of(i) != "cpu"}
    return g.get_data(out), on_device


def both(build, arrays, device: str, op: str):
    """The result on the device (asserting that op ran there) and on the CPU."""
    got, placed = run(build, arrays, device)
    assert op in placed, f"{op} did not run on the device: {placed}"
    want, _ = run(build, arrays, None)
    assert got.dtype == want.dtype
    return got, want


def assert_close(got: np.ndarray, ref: np.ndarray, dtype: np.dtype, mag=0.0) -> None:
    """got (dtype) within one rounding of float64 ref plus 2e-6 of `mag` (float32 sums)."""
    assert got.dtype == dtype
    err = np.abs(got.astype(np.float64) - ref)
    bound = EPS[dtype] * np.abs(ref) + TINY[dtype] + 2e-6 * np.asarray(mag)
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else ()
    assert np.all(err <= bound), (
        f"at {worst}: got {got[worst]}, want {ref[worst]} (bound {bound[worst]})"
    )


def specials(dtype: np.dtype) -> np.ndarray:
    """Values whose bits must survive a copy: signed zeros, infinities, quiet NaNs with
    payloads, subnormals."""
    raw = (
        [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFE5, 0x0001, 0x807F]
        if dtype == BF16
        else [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0xFE2A, 0x0001, 0x83FF]
    )
    return np.array(raw, np.uint16).view(dtype)


# ---- copies -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("n", SIZES)
def test_contiguous_of_a_transposed_view_moves_bits(vulkan: str, dtype: np.dtype, n: int) -> None:
    x = rand((3, n), dtype, seed=n)
    x.reshape(-1)[: min(8, x.size)] = specials(dtype)[: min(8, x.size)]
    got, want = both(lambda g, a: ops.contiguous(ops.permute(a, (1, 0))), [x], vulkan, "contiguous")
    np.testing.assert_array_equal(bits(got), bits(x.T))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("n", SIZES)
def test_contiguous_of_a_slice_at_odd_elements(vulkan: str, dtype: np.dtype, n: int) -> None:
    x = rand((5, n + 2), dtype, seed=n + 1)
    got, want = both(lambda g, a: ops.contiguous(a[1::2, 1:]), [x], vulkan, "contiguous")
    np.testing.assert_array_equal(bits(got), bits(x[1::2, 1:]))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", [*DTYPES, np.dtype(np.float32)], ids=lambda d: str(d))
def test_copies_and_fills_four_elements_at_a_time(vulkan: str, dtype: np.dtype) -> None:
    """A strided copy whose innermost axis is a multiple of 4 elements long moves runs of 4
    per invocation (copy.comp's RUN); a dense copy and a fill whose ends are aligned to 4
    elements move 4 at a time (MODE 2, fill.comp's VEC). Other lengths and odd offsets take
    one element at a time. Every path moves each element's bits (specials included)."""
    x = rand((6, 8, 12), dtype, seed=11)
    if dtype != np.float32:
        x.reshape(-1)[:8] = specials(dtype)
    for perm in [(1, 0, 2), (2, 0, 1), (0, 2, 1), (2, 1, 0)]:  # innermost 12, 8, 8, 6
        got, want = both(
            lambda g, a, p=perm: ops.contiguous(ops.permute(a, p)), [x], vulkan, "contiguous"
        )
        np.testing.assert_array_equal(bits(got), bits(np.transpose(x, perm)))
        np.testing.assert_array_equal(bits(got), bits(want))
    y = rand((70,), dtype, seed=12)
    for lo in (0, 4, 1, 2):  # aligned to 4 elements, and not
        got, want = both(
            lambda g, a, o=lo: ops.concat([a[o : o + 32], a[o + 1 : o + 33]], axis=0),
            [y],
            vulkan,
            "concat",
        )
        ref = np.concatenate([y[lo : lo + 32], y[lo + 1 : lo + 33]])
        np.testing.assert_array_equal(bits(got), bits(ref))
        np.testing.assert_array_equal(bits(got), bits(want))
    code = CODE.get(dtype, 0)
    for shape in [(4, 16), (3, 5)]:
        got, want = both(lambda g, s=shape: g.apply("fill", [], s, (0.1, code)), [], vulkan, "fill")
        ref = np.full(shape, np.float32(0.1)).astype(dtype)
        np.testing.assert_array_equal(bits(got), bits(ref))
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_a_signalling_nan_is_copied_unchanged(vulkan: str, dtype: np.dtype) -> None:
    snan = 0x7F81 if dtype == BF16 else 0x7C01  # no quiet bit: a float round trip sets it
    x = np.full((3, 5), snan, np.uint16).view(dtype)
    got, _ = run(lambda g, a: ops.contiguous(ops.permute(a, (1, 0))), [x], vulkan)
    assert (bits(got) == snan).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("n", [1, 3, 257])
def test_concat(vulkan: str, dtype: np.dtype, axis: int, n: int) -> None:
    a = rand((3, n), dtype, seed=1)
    b = rand((n, 3), dtype, seed=2).T  # transposed: a strided source
    b = b if axis == 0 else np.ascontiguousarray(rand((3, n + 2), dtype, seed=3)[:, 1:])
    got, want = both(lambda g, p, q: ops.concat([p, q], axis=axis), [a, b], vulkan, "concat")
    np.testing.assert_array_equal(bits(got), bits(np.concatenate([a, b], axis=axis)))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("value", [0.0, 1.5, 0.1, -70000.0])
def test_pad_rounds_its_value_once(vulkan: str, dtype: np.dtype, value: float) -> None:
    x = rand((4, 257), dtype, seed=4)
    width = ((1, 2), (0, 3))
    got, want = both(lambda g, a: ops.pad(ops.permute(a, (1, 0)), width, value), [x], vulkan, "pad")
    ref = np.pad(x.T.astype(np.float32), width, constant_values=np.float32(value))
    with np.errstate(over="ignore"):  # -70000: -infinity in float16
        ref = ref.astype(dtype)
    np.testing.assert_array_equal(bits(got), bits(ref))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("n", SIZES)
def test_fill(vulkan: str, dtype: np.dtype, n: int) -> None:
    value = 0.1 + n  # not representable: rounded once (float32, then the dtype, as the CPU)
    got, want = both(
        lambda g: g.apply("fill", [], (3, n), (value, CODE[dtype])), [], vulkan, "fill"
    )
    with np.errstate(over="ignore"):  # past float16's range: infinity, as on the device
        ref = np.full((3, n), np.float32(value)).astype(dtype)
    np.testing.assert_array_equal(bits(got), bits(ref))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_slice_grad(vulkan: str, dtype: np.dtype) -> None:
    grad = rand((3, 85), dtype, seed=5)
    full = (7, 257)
    ip = (*full, 1, 7, 2, 3, 257, 3)  # rows 1, 3, 5; columns 3, 6, ..., 255
    got, want = both(
        lambda g, gr: g.apply("slice_grad", [gr], ip, ()), [grad], vulkan, "slice_grad"
    )
    ref = np.zeros(full, dtype)
    ref[1:7:2, 3:257:3] = grad
    np.testing.assert_array_equal(bits(got), bits(ref))
    np.testing.assert_array_equal(bits(got), bits(want))


# ---- reductions -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", [(1, 1), (3, 257), (257, 3), (2, 65537)])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("transposed", [False, True])
def test_sum_along_an_axis(vulkan: str, dtype, shape, axis: int, transposed: bool) -> None:
    x = rand(shape[::-1] if transposed else shape, dtype, seed=sum(shape) + axis)

    def build(g, a):
        return ops.sum(ops.permute(a, (1, 0)) if transposed else a, axis=axis, keepdims=True)

    got, want = both(build, [x], vulkan, "sum")
    x64 = (x.T if transposed else x).astype(np.float64)
    mag = np.abs(x64).sum(axis=axis, keepdims=True)
    assert_close(got, x64.sum(axis=axis, keepdims=True), dtype, mag)
    assert_close(want, x64.sum(axis=axis, keepdims=True), dtype, mag)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_mean_of_everything(vulkan: str, dtype: np.dtype) -> None:
    x = rand((5, 13, 1001), dtype, seed=6)
    # the sums on the device; the scale (elementwise) may run on the CPU here
    got, placed = run(lambda g, a: ops.mean(a[:, 1:, :]), [x], vulkan, strict=False)
    assert "sum" in placed
    x64 = x[:, 1:, :].astype(np.float64)
    assert_close(got.reshape(()), np.float64(x64.mean()), dtype, np.abs(x64).mean())


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize(
    ("shape", "target"),
    [((4, 5, 257), (5, 1)), ((3, 65537), (1, 65537)), ((257, 3), (3,)), ((2, 3), (2, 3))],
)
def test_sum_to(vulkan: str, dtype: np.dtype, shape, target) -> None:
    x = rand(shape, dtype, seed=len(shape))
    got, want = both(lambda g, a: g.apply("sum_to", [a], target, ()), [x], vulkan, "sum_to")
    x64 = x.astype(np.float64)
    lead = len(shape) - len(target)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, t in enumerate(target) if t == 1 and shape[lead + i] != 1
    )
    ref = x64.sum(axis=axes, keepdims=True).reshape(target)
    mag = np.abs(x64).sum(axis=axes, keepdims=True).reshape(target)
    assert_close(got, ref, dtype, mag)
    assert_close(want, ref, dtype, mag)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", [(3, 257), (65537, 2), (1, 1)])
@pytest.mark.parametrize("axis", [0, 1])
def test_max_is_exact(vulkan: str, dtype: np.dtype, shape, axis: int) -> None:
    x = rand(shape, dtype, seed=7)
    if x.size > 4:
        x.reshape(-1)[3] = np.nan  # NaN wins, as in numpy
    got, want = both(lambda g, a: ops.max(a, axis=axis, keepdims=True), [x], vulkan, "max")
    ref = x.astype(np.float32).max(axis=axis, keepdims=True).astype(dtype)
    np.testing.assert_array_equal(bits(got), bits(ref))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_max_grad_picks_the_first_maximum(vulkan: str, dtype: np.dtype, axis: int) -> None:
    x = np.round(rand((3, 257, 5), dtype, seed=8).astype(np.float32) * 2).astype(dtype)  # ties
    m = x.astype(np.float32).max(axis=axis, keepdims=True).astype(dtype)
    grad = rand(m.shape, dtype, seed=9)
    got, want = both(
        lambda g, gr, a, mm: g.apply("max_grad", [gr, a, mm], (axis,), ()),
        [grad, x, m],
        vulkan,
        "max_grad",
    )
    first = np.argmax(x.astype(np.float32) == m.astype(np.float32), axis=axis)
    ref = np.zeros(x.shape, dtype)
    np.put_along_axis(ref, np.expand_dims(first, axis), grad, axis=axis)
    np.testing.assert_array_equal(bits(got), bits(ref))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize(("shape", "axis"), [((3, 257), 1), ((257, 3), 0), ((2, 20000), 1)])
@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum(vulkan: str, dtype: np.dtype, shape, axis: int, reverse: bool) -> None:
    x = rand(shape, dtype, seed=10)
    got, want = both(lambda g, a: ops.cumsum(a, axis, reverse=reverse), [x], vulkan, "cumsum")
    x64 = x.astype(np.float64)
    flip = (lambda a: np.flip(a, axis)) if reverse else (lambda a: a)
    ref = flip(np.cumsum(flip(x64), axis=axis))
    mag = flip(np.cumsum(flip(np.abs(x64)), axis=axis))
    assert_close(got, ref, dtype, mag)
    assert_close(want, ref, dtype, mag)
    if shape[1] == 3:  # a short axis across columns: one thread walks it in the CPU's order
        np.testing.assert_array_equal(bits(got), bits(want))


# ---- lookups ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("d", [1, 3, 257])
def test_get_rows_moves_bits(vulkan: str, dtype: np.dtype, d: int) -> None:
    table = rand((37, d), dtype, seed=d)
    table[5, 0] = specials(dtype)[4]  # a NaN with a payload
    idx = np.array([[5, 0, 36], [5, 5, 17]], np.int32)
    got, want = both(lambda g, t, i: ops.get_rows(t, i), [table, idx], vulkan, "get_rows")
    np.testing.assert_array_equal(bits(got), bits(table[idx]))
    np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("d", [1, 3, 257])
def test_get_rows_back_sums_in_float32_and_rounds_once(vulkan: str, dtype, d: int) -> None:
    rng = np.random.default_rng(11)
    idx = rng.integers(0, 9, (4, 50)).astype(np.int32)  # many repeats
    grad = rand((4, 50, d), dtype, seed=12)
    got, want = both(
        lambda g, gr, i: g.apply("get_rows_back", [gr, i], (11,), ()),
        [grad, idx],
        vulkan,
        "get_rows_back",
    )
    ref = np.zeros((11, d))
    mag = np.zeros((11, d))
    np.add.at(ref, idx.reshape(-1), grad.reshape(-1, d).astype(np.float64))
    np.add.at(mag, idx.reshape(-1), np.abs(grad.reshape(-1, d).astype(np.float64)))
    assert_close(got, ref, dtype, mag)
    # one float32 sum per row in increasing n, then one rounding: the CPU's answer
    np.testing.assert_array_equal(bits(got), bits(want))


# ---- gradients through the lazy API on the device ------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_gradients_of_lookups_and_reductions_on_the_device(vulkan: str, dtype) -> None:
    table = rand((40, 65), dtype, seed=13)
    idx = np.random.default_rng(14).integers(0, 40, (3, 33)).astype(np.int32)

    def grads(device: str) -> tuple[np.ndarray, np.ndarray]:
        t = rc.param(table, device=device, dtype=str(rc.tensor(table).dtype))
        x = ops.get_rows(t, rc.tensor(idx, device=device))  # (3, 33, 65)
        y = ops.concat([ops.max(x, axis=2, keepdims=True), x[:, :, 1::2]], axis=2)
        loss = ops.sum(ops.cumsum(ops.pad(y, ((0, 0), (1, 0), (2, 1))), axis=1))
        loss.backward()
        return np.asarray(loss.numpy()), t.grad.numpy()

    LAZY.clear()
    loss, grad = grads(vulkan)
    g = next(reversed(LAZY._plans.values())).graph
    nodes = [(g.info(i)["op"], g.backend_of(i)) for i in range(len(g)) if g.info(i)["op"] != "leaf"]
    on_cpu = {op for op, b in nodes if b == "cpu"}
    assert on_cpu <= {"add"}, nodes  # add (the elementwise ops) is not this file's slice
    mine = {"get_rows", "get_rows_back", "max", "max_grad", "concat", "pad", "slice_grad", "cumsum"}
    assert mine | {"sum", "fill", "contiguous"} <= {op for op, _ in nodes}
    loss_cpu, grad_cpu = grads("cpu")
    assert grad.dtype == dtype
    # float64 reference: each looked-up row weighs (its position's cumsum count) on its
    # odd columns and on its first maximum
    x = table.astype(np.float64)[idx]
    w = (33 - np.arange(33))[None, :, None] * np.ones((3, 1, 1))  # cumsum along axis 1
    want = np.zeros(table.shape)
    dx = np.zeros(x.shape)
    dx[:, :, 1::2] += w
    first = np.argmax(x == x.max(axis=2, keepdims=True), axis=2)
    np.put_along_axis(dx, first[..., None], np.take_along_axis(dx, first[..., None], 2) + w, 2)
    np.add.at(want, idx.reshape(-1), dx.reshape(-1, 65))
    assert_close(grad, want, dtype, np.abs(want))
    assert_close(grad_cpu, want, dtype, np.abs(want))
    np.testing.assert_allclose(
        float(loss), float(loss_cpu), rtol=4 * EPS[dtype], atol=1e-3 * np.abs(x).sum()
    )


# ---- ops along the last axis ---------------------------------------------------------------


def _rows_ref(op: str, x: np.ndarray, g: np.ndarray, eps: float):
    """float64 references of the row ops (the formulas of the core's nn.cpp): the value and
    the magnitude of its terms (what float32 rounding in the sums is relative to)."""
    a = np.abs
    if op == "softmax":
        y = np.exp(x - x.max(-1, keepdims=True))
        y /= y.sum(-1, keepdims=True)
        return y, y
    if op == "softmax_back":  # x holds y = softmax
        return x * (g - (g * x).sum(-1, keepdims=True)), x * (
            a(g) + a(g * x).sum(-1, keepdims=True)
        )
    if op == "log_softmax":
        m = x.max(-1, keepdims=True)
        lse = np.log(np.exp(x - m).sum(-1, keepdims=True))
        return x - m - lse, a(x - m) + lse
    if op == "log_softmax_back":  # x holds y = log_softmax
        e = np.exp(x)
        return g - e * g.sum(-1, keepdims=True), a(g) + e * a(g).sum(-1, keepdims=True)
    c = x.shape[-1]
    if op.startswith("rms_norm"):
        r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        if op == "rms_norm":
            return x * r, a(x * r)
        s = (g * x).sum(-1, keepdims=True) / c
        return r * g - x * r**3 * s, r * a(g) + a(x) * r**3 * a(g * x).sum(-1, keepdims=True) / c
    mu = x.mean(-1, keepdims=True)
    d = x - mu
    r = 1.0 / np.sqrt((d * d).mean(-1, keepdims=True) + eps)
    if op == "layer_norm":
        return d * r, (a(x) + a(mu)) * r
    gd = (g * d).mean(-1, keepdims=True)
    ref = r * (g - g.mean(-1, keepdims=True) - d * r * r * gd)
    mag = r * (
        a(g) + a(g).mean(-1, keepdims=True) + a(d) * r * r * a(g * d).mean(-1, keepdims=True)
    )
    return ref, mag


ROW_OPS = [
    "softmax",
    "log_softmax",
    "rms_norm",
    "layer_norm",
    "softmax_back",
    "log_softmax_back",
    "rms_norm_back",
    "layer_norm_back",
]


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("op", ROW_OPS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 257), (2, 3, 1000)])
def test_row_ops(vulkan: str, dtype: np.dtype, op: str, shape) -> None:
    x = rand(shape, dtype, seed=len(op))
    if op in ("softmax_back", "log_softmax_back"):  # their x is the forward's output
        x = _rows_ref(op[: -len("_back")], x.astype(np.float64), x, 0.0)[0].astype(dtype)
    g = rand(shape, dtype, seed=99)
    eps = 1e-5 if "norm" in op else None
    fp = () if eps is None else (eps,)
    srcs = [g, x] if op.endswith("_back") else [x]
    got, want = both(lambda gr, *t: gr.apply(op, list(t), (), fp), srcs, vulkan, op)
    ref, mag = _rows_ref(op, x.astype(np.float64), g.astype(np.float64), eps or 0.0)
    assert_close(got, ref, dtype, 5 * mag)  # float32 maths: exp, log, sqrt, sums of C terms
    assert_close(want, ref, dtype, 5 * mag)


# ---- the op-case registry's one-node cases, in 2-byte floats on the device -----------------

MINE = {
    "contiguous", "fill", "concat", "pad", "slice_grad", "sum", "sum_to", "max", "max_grad",
    "cumsum", "get_rows", "get_rows_back", *ROW_OPS,
}  # fmt: skip
REGISTRY = [
    c
    for c in opcases.cases()
    if c.node is not None
    and c.update is None
    and c.node.op in MINE
    and any(v.dtype == np.float32 for v in c.make_inputs().values())
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", REGISTRY, ids=[c.id for c in REGISTRY])
def test_registry_cases_on_the_device(vulkan: str, monkeypatch, case, dtype: str) -> None:
    """opcases.half_errors (inputs rounded to the dtype, the result within half an ulp of the
    float64 reference plus the case's tolerance) with the case evaluated on the device; its
    node placed there."""
    real = _run.evaluate
    monkeypatch.setattr(_run, "evaluate", lambda c, data=None: real(c, data, vulkan))
    LAZY.clear()
    assert opcases.half_errors(case, dtype) == []
    g = next(reversed(LAZY._plans.values())).graph
    placed = {(g.info(i)["op"], g.backend_of(i)) for i in range(len(g))}
    assert any(op == case.node.op and b != "cpu" for op, b in placed), placed


GRAD_REGISTRY = [c for c in REGISTRY if c.grad and not c.nonfinite]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", GRAD_REGISTRY, ids=[c.id for c in GRAD_REGISTRY])
def test_registry_gradients_on_the_device(vulkan: str, monkeypatch, case, dtype: str) -> None:
    """opcases.half_grad_errors with the 2-byte forward and backward on the device (the
    float32 gradients it is compared with on the CPU)."""
    real = _run._grads

    def on_device(c, data, device, dt=None):
        return real(c, data, vulkan if dt is not None else device, dt)

    monkeypatch.setattr(_run, "_grads", on_device)
    LAZY.clear()
    assert opcases.half_grad_errors(case, dtype) == []
    g = next(reversed(LAZY._plans.values())).graph
    placed = {(g.info(i)["op"], g.backend_of(i)) for i in range(len(g))}
    assert any(op == case.node.op and b != "cpu" for op, b in placed), placed

"""bfloat16/float16 matmul and out_prod on a Vulkan device (issue 18).

Both sources and the output of one 2-byte float type; the device accumulates in float32 and
rounds each output element once (round to nearest even), as the CPU does through the BLAS in
float32. Where the device has cooperative matrices for the type (an H200) the node runs
shaders/matmul_coopmat_op.comp on tensor cores, elsewhere (lavapipe) the "_h" modules of
matmul_reg.comp; RECURRA_VK_COOPMAT=off forces the latter on a coopmat device, and the
coopmat tests skip with the reason where there are none.

References: the float64 product of the same (already rounded) inputs. Tolerance per element,
from the float32 accumulation over K and the one rounding of the output:
    |got - ref| <= u * |ref| + 2 K 2^-24 (|A| @ |B|) + s
with u the type's unit roundoff (bfloat16 2^-8, float16 2^-11) and s the smallest float16
subnormal (0 for bfloat16). Against the CPU's result: at most one unit in the last place
apart everywhere (both round float32 sums that differ by the accumulation order alone) and
bit-identical almost everywhere (>= 99% of the elements).

Placement is strict (a node the device refuses raises), so every product below runs on the
device. Shapes: odd sizes (1, 7, 33, 129, 257) that leave partial tiles and K steps,
transposed views (x^T @ dy, dy @ W^T: the backward's products), batch axes broadcast from
either side, sliced operands with general strides.

The coopmat shader's schedule, transliterated to numpy, and the op's plan are checked without
a device in test_vulkan_half_matmul_schedule.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from vk_util import op_tiles

import recurra as rc
from recurra import ops

recurra_vulkan = pytest.importorskip("recurra_vulkan")

pytestmark = pytest.mark.vulkan

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
DTYPES = [BF16, F16]
UNIT = {BF16: 2.0**-8, F16: 2.0**-11}
SUBNORMAL = {BF16: 0.0, F16: 2.0**-24}


def rounded(shape: tuple[int, ...], dtype: np.dtype, seed: int) -> np.ndarray:
    """Standard normal samples of `shape` rounded to `dtype`."""
    rng = np.random.default_rng([seed, *shape])
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def product64(op: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a @ b, |a| @ |b|) in float64 (out_prod: a^T @ b)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if op == "out_prod":
        a64 = np.swapaxes(a64, -1, -2)
    return a64 @ b64, np.abs(a64) @ np.abs(b64)


def assert_close(op: str, got: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Asserts `got` (the device's op(a, b)) is within the module's tolerance of float64."""
    dtype = a.dtype
    assert got.dtype == dtype
    ref, mag = product64(op, a, b)
    assert got.shape == ref.shape
    k = a.shape[-2] if op == "out_prod" else a.shape[-1]
    tol = UNIT[dtype] * np.abs(ref) + 2 * k * 2.0**-24 * mag + SUBNORMAL[dtype]
    err = np.abs(got.astype(np.float64) - ref)
    bad = err > tol
    assert not bad.any(), (
        f"{op} {a.shape} {b.shape} {dtype}: {int(bad.sum())} elements out of tolerance, "
        f"worst {float(np.max(err - tol)):.3g} past it"
    )


def assert_matches_cpu(
    got: np.ndarray, cpu: np.ndarray, op: str, a: np.ndarray, b: np.ndarray
) -> None:
    """Within one unit in the last place of the CPU's result plus what two float32 sums of
    the products in different orders may differ by (2 k 2^-24 |a| @ |b|: a result that
    cancels can round to neighbours two units apart), and equal almost everywhere."""
    assert got.dtype == cpu.dtype and got.shape == cpu.shape
    g = got.astype(np.float64)
    c = cpu.astype(np.float64)
    k = a.shape[-2] if op == "out_prod" else a.shape[-1]
    ulp = np.spacing(np.abs(cpu).astype(cpu.dtype)).astype(np.float64)
    tol = ulp + 2 * k * 2.0**-24 * product64(op, a, b)[1]
    assert np.all(np.abs(g - c) <= tol), f"{op} {a.shape} {b.shape}: {np.abs(g - c).max()}"
    assert np.mean(got.view(np.uint16) == cpu.view(np.uint16)) >= 0.99


def cpu_op(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    fn = ops.matmul if op == "matmul" else ops.out_prod
    return fn(rc.tensor(a), rc.tensor(b)).numpy()


def device_op(vulkan: str, op: str, a: np.ndarray, b: np.ndarray, ta=False, tb=False):
    """op(a', b') on the device in a strict graph, where a' is a transposed view of an input
    holding a^T when `ta` (likewise b'); returns (result, the backend that ran it)."""
    g = rc.Graph(backends=[vulkan], strict=True)
    xs = []
    for arr, t in ((a, ta), (b, tb)):
        host = np.ascontiguousarray(np.swapaxes(arr, -1, -2) if t else arr)
        x = g.input(host.shape, dtype="bfloat16" if host.dtype == BF16 else "float16")
        xs.append((x, host, ops.transpose(x) if t else x))
    fn = ops.matmul if op == "matmul" else ops.out_prod
    y = fn(xs[0][2], xs[1][2])
    g.set_output(y)
    for x, host, _ in xs:
        g.set_data(x, host)
    g.compute()
    return g.get_data(y), g.backend_of(y)


def coopmat_reason(dtype: np.dtype) -> str:
    """ "" when the device runs the coopmat path for `dtype`, else why not."""
    info = recurra_vulkan.coopmat_info()
    name = "bf16" if dtype == BF16 else "f16"
    if not info[name]:
        return info[f"{name}_reason"]
    return ""


@pytest.fixture(params=["default", "fallback"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The device's own choice (coopmat where it has it), and the fallback shader forced."""
    if request.param == "fallback":
        monkeypatch.setenv("RECURRA_VK_COOPMAT", "off")
    return request.param


SHAPES = [  # (M, K, N)
    (1, 7, 33),
    (7, 33, 1),
    (33, 129, 7),
    (129, 257, 33),
    (257, 33, 129),
    (64, 64, 64),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_odd_sizes(vulkan: str, dtype: np.dtype, path: str) -> None:
    for m, k, n in SHAPES:
        a, b = rounded((m, k), dtype, 1), rounded((k, n), dtype, 2)
        got, where = device_op(vulkan, "matmul", a, b)
        assert where.startswith("vulkan")
        assert_close("matmul", got, a, b)
        assert_matches_cpu(got, cpu_op("matmul", a, b), "matmul", a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_transposed_operands(vulkan: str, dtype: np.dtype, path: str) -> None:
    # x^T @ dy (A m-contiguous) and dy @ W^T (B k-contiguous), and both; aligned (multiples
    # of 8: the coopmat path's vector loads) and odd
    for m, k, n in [(40, 72, 24), (33, 129, 7), (7, 9, 130)]:
        a, b = rounded((m, k), dtype, 3), rounded((k, n), dtype, 4)
        cpu = cpu_op("matmul", a, b)
        for ta, tb in [(True, False), (False, True), (True, True)]:
            got, where = device_op(vulkan, "matmul", a, b, ta, tb)
            assert where.startswith("vulkan")
            assert_close("matmul", got, a, b)
            assert_matches_cpu(got, cpu, "matmul", a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_out_prod(vulkan: str, dtype: np.dtype, path: str) -> None:
    for k, m, n in [(33, 7, 129), (64, 48, 16), (1, 5, 3)]:
        a, b = rounded((k, m), dtype, 5), rounded((k, n), dtype, 6)
        got, where = device_op(vulkan, "out_prod", a, b)
        assert where.startswith("vulkan")
        assert_close("out_prod", got, a, b)
        assert_matches_cpu(got, cpu_op("out_prod", a, b), "out_prod", a, b)
        # out_prod of a transposed view: A k-contiguous, B k-contiguous
        got, _ = device_op(vulkan, "out_prod", a, b, True, True)
        assert_close("out_prod", got, a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_batched_and_broadcast(vulkan: str, dtype: np.dtype, path: str) -> None:
    cases = [
        ((3, 1, 33, 17), (4, 17, 9)),  # both sides broadcast
        ((33, 16), (2, 16, 40)),  # a shared by the batch
        ((2, 3, 8, 24), (2, 3, 24, 8)),  # two batch axes, aligned
    ]
    for sa, sb in cases:
        a, b = rounded(sa, dtype, 7), rounded(sb, dtype, 8)
        got, where = device_op(vulkan, "matmul", a, b)
        assert where.startswith("vulkan")
        assert_close("matmul", got, a, b)
        assert_matches_cpu(got, cpu_op("matmul", a, b), "matmul", a, b)
    a, b = rounded((2, 17, 5), dtype, 9), rounded((17, 6), dtype, 10)
    got, _ = device_op(vulkan, "out_prod", a, b)
    assert_close("out_prod", got, a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_sliced_operands_with_general_strides(vulkan: str, dtype: np.dtype, path: str) -> None:
    # a column slice of a wider tensor: row stride 40, neither axis of B unit-strided
    a_full, b_full = rounded((21, 40), dtype, 11), rounded((30, 26), dtype, 12)
    name = "bfloat16" if dtype == BF16 else "float16"
    g = rc.Graph(backends=[vulkan], strict=True)
    xa, xb = g.input(a_full.shape, dtype=name), g.input(b_full.shape, dtype=name)
    y = ops.matmul(xa[:, 3:20], xb[:17, ::2])  # (21, 17) @ (17, 13), B column stride 2
    g.set_output(y)
    g.set_data(xa, a_full)
    g.set_data(xb, b_full)
    g.compute()
    assert g.backend_of(y).startswith("vulkan")
    got = g.get_data(y)
    want_a, want_b = a_full[:, 3:20], b_full[:17, ::2]
    assert_close("matmul", got, want_a, want_b)
    assert_matches_cpu(got, cpu_op("matmul", want_a, want_b), "matmul", want_a, want_b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_gradients_on_the_device(vulkan: str, dtype: np.dtype, path: str) -> None:
    # y = x @ w with an upstream gradient dy: the backward's dx = dy @ w^T (B a transposed
    # view, k-contiguous) and dw = x^T @ dy (A a transposed view, m-contiguous), all on the
    # device (strict graph)
    from recurra import _core

    x_np, w_np = rounded((33, 24), dtype, 13), rounded((24, 17), dtype, 14)
    dy_np = rounded((33, 17), dtype, 15)
    name = "bfloat16" if dtype == BF16 else "float16"
    g = rc.Graph(backends=[vulkan], strict=True)
    x = g._leaf(x_np.shape, name, _core.FLAG_PARAM, "x")
    w = g._leaf(w_np.shape, name, _core.FLAG_PARAM, "w")
    dy = g.input(dy_np.shape, dtype=name)
    g.build_backward(ops.matmul(x, w), dy)
    gx, gw = g.grad(x), g.grad(w)
    assert gx is not None and gw is not None
    g.set_output(gx)
    g.set_output(gw)
    for t, v in ((x, x_np), (w, w_np), (dy, dy_np)):
        g.set_data(t, v)
    g.compute()
    assert g.backend_of(gx).startswith("vulkan") and g.backend_of(gw).startswith("vulkan")
    assert_close("matmul", g.get_data(gx), dy_np, np.ascontiguousarray(w_np.T))
    assert_close("matmul", g.get_data(gw), np.ascontiguousarray(x_np.T), dy_np)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_gradients_through_the_lazy_api(vulkan: str, dtype: np.dtype) -> None:
    from recurra._tensor import LAZY

    x_np, w_np = rounded((40, 24), dtype, 16), rounded((24, 9), dtype, 17)
    dy_np = rounded((40, 9), dtype, 18)
    rc.set_strict_placement(True)
    try:
        x = rc.tensor(x_np, device=vulkan).requires_grad_()
        w = rc.tensor(w_np, device=vulkan).requires_grad_()
        y = ops.matmul(x, w)
        y.backward(rc.tensor(dy_np, device=vulkan))
        dx, dw = x.grad.numpy(), w.grad.numpy()
        g = next(reversed(LAZY._plans.values())).graph
        nodes = [(g.info(i)["op"], g.backend_of(i)) for i in range(len(g))]
    finally:
        rc.set_strict_placement(False)
    products = [where for op, where in nodes if op in ("matmul", "out_prod")]
    assert len(products) >= 2 and all(where.startswith("vulkan") for where in products)
    assert_close("matmul", dx, dy_np, np.ascontiguousarray(w_np.T))
    assert_close("matmul", dw, np.ascontiguousarray(x_np.T), dy_np)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_coopmat_path_on_tensor_core_devices(
    vulkan: str, dtype: np.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    why = coopmat_reason(dtype)
    if why:
        pytest.skip(f"no cooperative matrices for {dtype}: {why}")
    # every tiling, odd sizes past several tiles, every staging layout and load path
    shapes = [(257, 129, 300), (130, 72, 136), (1, 33, 7), (300, 1000, 50)]
    for tile in op_tiles():
        monkeypatch.setenv("RECURRA_VK_COOPMAT", tile)
        for m, k, n in shapes:
            a, b = rounded((m, k), dtype, m), rounded((k, n), dtype, n)
            cpu = cpu_op("matmul", a, b)
            for ta, tb in [(False, False), (True, False), (False, True), (True, True)]:
                got, where = device_op(vulkan, "matmul", a, b, ta, tb)
                assert where.startswith("vulkan")
                assert_close("matmul", got, a, b)
                assert_matches_cpu(got, cpu, "matmul", a, b)
        a, b = rounded((3, 1, 40, 24), dtype, 1), rounded((2, 24, 136), dtype, 2)
        got, _ = device_op(vulkan, "matmul", a, b)
        assert_close("matmul", got, a, b)


def test_an_unknown_tiling_raises(vulkan: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if coopmat_reason(BF16):
        pytest.skip("the tiling is read on devices with cooperative matrices only")
    monkeypatch.setenv("RECURRA_VK_COOPMAT", "op7")
    a = rounded((8, 8), BF16, 0)
    with pytest.raises((ValueError, RuntimeError), match="RECURRA_VK_COOPMAT"):
        device_op(vulkan, "matmul", a, a)


def test_mixed_dtypes_are_refused_by_the_device(vulkan: str) -> None:
    # a bfloat16 @ float16 product is not one of the op's forms: the core refuses it before
    # any backend sees it, or the strict graph says why the device cannot run it
    g = rc.Graph(backends=[vulkan], strict=True)
    x = g.input((4, 4), dtype="bfloat16")
    w = g.input((4, 4), dtype="float16")
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        y = ops.matmul(x, w)
        g.set_output(y)
        g.set_data(x, np.ones((4, 4), BF16))
        g.set_data(w, np.ones((4, 4), F16))
        g.compute()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize(
    ("op", "m", "k", "n"),
    [("matmul", 33, 2000, 40), ("out_prod", 20, 1500, 70), ("matmul", 130, 1100, 9)],
)
def test_split_k_for_few_tiles_and_long_k(
    vulkan: str, dtype: np.dtype, path: str, op: str, m: int, k: int, n: int
) -> None:
    """Few tiles of C and a long K (the weight gradients, a chunked LM head's input gradient)
    run as slices of K with float32 partial sums in op scratch (the internal pool), summed in
    order and rounded once: values against float64 and the CPU, also with B k-contiguous."""
    a = rounded((k, m) if op == "out_prod" else (m, k), dtype, 11)
    b = rounded((k, n), dtype, 12)
    index = int(vulkan.partition(":")[2] or 0)
    recurra_vulkan._vk.memory_info(index, reset_peaks=True)
    got, where = device_op(vulkan, op, a, b)
    scratch = recurra_vulkan._vk.memory_info(index)["internal"]["peak_bytes"]
    assert where.startswith("vulkan")
    assert_close(op, got, a, b)
    assert_matches_cpu(got, cpu_op(op, a, b), op, a, b)
    # at least two slices of m x n float32 partial sums
    assert scratch >= 2 * m * n * 4, scratch
    got, _ = device_op(vulkan, op, a, b, False, True)  # B k-contiguous (x @ W^T)
    assert_close(op, got, a, b)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_forced_split_k_slices(
    vulkan: str, path: str, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RECURRA_VK_SPLITK=S runs a single product as S slices of K (16-aligned, the rest in
    one more dispatch: K 300 is no multiple of 16 S), on the coopmat path and the fallback:
    values against float64 and the CPU, the slices' partial sums in scratch."""
    monkeypatch.setenv("RECURRA_VK_SPLITK", str(splits))
    m, k, n = 40, 300, 72
    a, b = rounded((m, k), BF16, 21), rounded((k, n), BF16, 22)
    index = int(vulkan.partition(":")[2] or 0)
    recurra_vulkan._vk.memory_info(index, reset_peaks=True)
    got, where = device_op(vulkan, "matmul", a, b, True, False)
    scratch = recurra_vulkan._vk.memory_info(index)["internal"]["peak_bytes"]
    assert where.startswith("vulkan")
    assert_close("matmul", got, a, b)
    assert_matches_cpu(got, cpu_op("matmul", a, b), "matmul", a, b)
    assert scratch >= splits * m * n * 4, scratch


def test_a_bad_split_count_raises(vulkan: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECURRA_VK_SPLITK", "33")
    a = rounded((8, 64), BF16, 0)
    with pytest.raises((ValueError, RuntimeError), match="RECURRA_VK_SPLITK"):
        device_op(vulkan, "matmul", a, a.T.copy())
    with pytest.raises(ValueError, match="RECURRA_VK_SPLITK"):
        recurra_vulkan._vk.coopmat_op_plan(8, 8, 64)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
def test_a_transposed_first(
    vulkan: str, dtype: np.dtype, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RECURRA_VK_TRANSPOSE=on copies a row-major A transposed (transpose_h.comp: K rows of M
    rounded up to 8, zeros past M, in op scratch) before the product, which then stages an
    m-contiguous A: values against float64 and the CPU on the coopmat path and the fallback,
    with B row-major and k-contiguous; the copy's scratch in the internal pool. An A the op
    cannot transpose (K not a multiple of 8: no 16-byte loads) is used as it is, no scratch."""
    monkeypatch.setenv("RECURRA_VK_TRANSPOSE", "on")
    index = int(vulkan.partition(":")[2] or 0)

    def scratch_of(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
        """The product on the device and the op scratch it took above what was held before
        (earlier tests' pools stay in the internal pool)."""
        held = recurra_vulkan._vk.memory_info(index, reset_peaks=True)["internal"]["bytes_in_use"]
        got, where = device_op(vulkan, "matmul", a, b)
        assert where.startswith("vulkan")
        return got, recurra_vulkan._vk.memory_info(index)["internal"]["peak_bytes"] - held

    for m, k, n in [(7, 8, 5), (129, 64, 65), (130, 72, 200), (300, 40, 9), (65, 136, 64)]:
        a, b = rounded((m, k), dtype, 31), rounded((k, n), dtype, 32)
        got, scratch = scratch_of(a, b)
        assert_close("matmul", got, a, b)
        assert_matches_cpu(got, cpu_op("matmul", a, b), "matmul", a, b)
        assert scratch >= k * -(-m // 8) * 8 * 2, (m, k, n, scratch)
        got, _ = device_op(vulkan, "matmul", a, b, False, True)  # B k-contiguous (x @ W^T)
        assert_close("matmul", got, a, b)
    a, b = rounded((33, 129), dtype, 33), rounded((129, 7), dtype, 34)
    got, scratch = scratch_of(a, b)
    assert scratch == 0
    assert_close("matmul", got, a, b)


def test_a_bad_transpose_setting_raises(vulkan: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECURRA_VK_TRANSPOSE", "maybe")
    a = rounded((16, 64), BF16, 0)
    with pytest.raises((ValueError, RuntimeError), match="RECURRA_VK_TRANSPOSE"):
        device_op(vulkan, "matmul", a, a.T.copy())


def test_single_nodes_of_2_byte_arrays(vulkan: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's single-node entries (_vk.run_node, _vk.profile_dispatches: the GPU time of
    each dispatch, as bench/coopmat.py's profiles use) take bfloat16 and float16 arrays; a
    2-byte output comes back as its bits (uint16), a float32 one as the float32 sums. With A
    transposed first, the transpose is the node's first dispatch."""
    vk = recurra_vulkan._vk
    index = int(vulkan.partition(":")[2] or 0)
    for dtype in DTYPES:
        a, b = rounded((40, 24), dtype, 41), rounded((24, 16), dtype, 42)
        name = "bfloat16" if dtype == BF16 else "float16"
        bits = vk.run_node("matmul", [a, b], out_shape=(40, 16), out_dtype=name, device=index)
        assert bits.dtype == np.uint16
        assert_close("matmul", bits.view(dtype), a, b)
        sums = vk.run_node("matmul", [a, b], out_shape=(40, 16), out_dtype="float32", device=index)
        ref, mag = product64("matmul", a, b)
        assert sums.dtype == np.float32
        assert np.all(np.abs(sums - ref) <= 2 * 24 * 2.0**-24 * mag)
    monkeypatch.setenv("RECURRA_VK_TRANSPOSE", "on")
    recs = vk.profile_dispatches(
        "matmul", [a, b], out_shape=(40, 16), out_dtype="float16", iters=1, warmup=0, device=index
    )
    assert [op.split("/")[1].split("[")[0] for op, _ in recs][0] == "transpose_h"
    assert len(recs) == 2 and all(sec > 0 for _, sec in recs)
    with pytest.raises(TypeError, match="float16"):
        vk.run_node("matmul", [a.view(np.int16), b], out_shape=(40, 16), device=index)

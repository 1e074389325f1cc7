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

The schedule and indexing of the coopmat shader are transliterated to numpy (no device) and
checked against A @ B for every tiling in meson.build, every staging layout, both load paths
and odd sizes: this runs everywhere and catches a masked-edge or layout bug before the H200.
"""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from vk_util import compile_coopmat, find_coopmat_compiler, grouped_tiles

import recurra as rc
from recurra import ops

recurra_vulkan = pytest.importorskip("recurra_vulkan")

pytestmark = pytest.mark.vulkan

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
DTYPES = [BF16, F16]
UNIT = {BF16: 2.0**-8, F16: 2.0**-11}
SUBNORMAL = {BF16: 0.0, F16: 2.0**-24}
VK_DIR = Path(__file__).resolve().parents[2] / "packages" / "vulkan"


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


# ---- the coopmat shader's schedule and indexing, transliterated (no device) ------------------

GROUP_M = 8


def op_tiles() -> dict[str, dict[str, int]]:
    """The op's tilings in meson.build: name -> BM BN BK WM WN."""
    text = (VK_DIR / "meson.build").read_text()
    start = text.index("coopmat_op_tiles = [")
    block = text[start : text.index("\n]", start)]
    return {
        m.group(1): {k: int(v) for k, v in re.findall(r"'-D(\w+)=(\d+)'", m.group(2))}
        for m in re.finditer(r"\['(\w+)', \[([^\]]*)\]", block)
    }


class Operand:
    """An operand staged as the shader does: X(row, col) = x[base + row * rs + col * cs]."""

    def __init__(self, x: np.ndarray, base: int, rs: int, cs: int, rows: int, cols: int):
        self.x, self.base, self.rs, self.cs, self.rows, self.cols = x, base, rs, cs, rows, cols

    def item(self, r0: int, c0: int, row: np.ndarray, cg: np.ndarray, vec: bool) -> np.ndarray:
        """load_item for every (row, cg): (items, 8) elements, zero outside."""
        r, c = r0 + row, c0 + cg * 8
        out = np.zeros((len(row), 8))
        if vec:
            ok = (r < self.rows) & (c < self.cols)
            idx = (self.base + r * self.rs + c) >> 3
            assert np.all((self.base + r[ok] * self.rs + c[ok]) % 8 == 0)
            out[ok] = self.x.reshape(-1, 8)[idx[ok]]
            return out
        for e in range(8):
            ok = (r < self.rows) & (c + e < self.cols)
            out[ok, e] = self.x[self.base + r[ok] * self.rs + (c[ok] + e) * self.cs]
        return out


def slab_item(q: np.ndarray, cols: int, rot: int) -> tuple[np.ndarray, np.ndarray]:
    """The shader's item(q, cols): (row, uvec4 column) of item q of a slab of `cols` columns;
    with ROT and fewer than 8 uvec4 a row, the 8 items of a store phase take the columns of
    rows C apart in a group of 8 rows (C = cols / 8)."""
    c = cols // 8
    if rot and c < 8:
        return (q // (8 * c)) * 8 + (q % (8 * c)) // 8 + (q % 8) // c * c, q % c
    return q // c, q % c


def test_the_rotated_item_order_is_a_conflict_free_permutation() -> None:
    for cols in (16, 32, 64, 128):
        q = np.arange(64 * cols // 8)
        row, cg = slab_item(q, cols, 1)
        # every (row, column) once; 8 consecutive items (a 16-byte store phase) in 8 different
        # 16-byte bank groups of the padded rows (cols / 8 + 1 uvec4)
        assert len(set(zip(row.tolist(), cg.tolist()))) == len(q)
        assert row.max() == 63 and cg.max() == cols // 8 - 1
        units = (row * (cols // 8 + 1) + cg) % 8
        assert all(len(set(units[i : i + 8].tolist())) == 8 for i in range(0, len(q), 8))
        # the plain order: two items of a phase share a bank group where a row is short
        plain = slab_item(q, cols, 0)
        units0 = (plain[0] * (cols // 8 + 1) + plain[1]) % 8
        assert all(len(set(units0[i : i + 8].tolist())) == 8 for i in range(0, len(q), 8)) == (
            cols >= 64
        )


def frag(x: np.ndarray, start: int, stride: int) -> np.ndarray:
    """coopMatLoad row-major from an array of uvec4 rows (8 elements): a 16 x 16 matrix."""
    rows = start + np.arange(16) * stride
    return np.concatenate([x[rows], x[rows + 1]], axis=1)


def _op_tile(
    t: dict[str, int],
    oa: Operand,
    ob: Operand,
    layout: tuple[int, int, int, int],
    m0: int,
    n0: int,
    K: int,
) -> np.ndarray:
    """The accumulators (subgroup, i, j, 16, 16) of the workgroup whose C tile is at (m0, n0),
    by matmul_coopmat_op.comp's K loop: the staging, the fragment loads, the double buffering
    (which step each buffer holds when read; no buffer read and written between barriers)."""
    bm, bn, bk, wm_, wn_ = t["BM"], t["BN"], t["BK"], t["WM"], t["WN"]
    stages = 2
    a_t, b_t, vec_a, vec_b = layout
    nw = (bm // wm_) * (bn // wn_)
    a_stage = max(bm * (bk + 8), bk * (bm + 8)) // 8
    b_stage = max(bk * (bn + 8), bn * (bk + 8)) // 8
    a_cols, b_cols = (bm if a_t else bk), (bk if b_t else bn)
    sa, sb = a_cols // 8 + 1, b_cols // 8 + 1
    qa, qb = np.arange(bm * bk // 8), np.arange(bk * bn // 8)
    a_s = np.full((stages * a_stage, 8), np.nan)
    b_s = np.full((stages * b_stage, 8), np.nan)
    holds = [-1] * stages
    access: set[tuple[int, int, str]] = set()
    acc = np.zeros((nw, wm_ // 16, wn_ // 16, 16, 16))
    steps = -(-K // bk)
    interval = 0  # barriers passed

    rot = t.get("ROT", 0)
    a_row, a_cg = slab_item(qa, a_cols, rot)
    b_row, b_cg = slab_item(qb, b_cols, rot)

    def load(s: int) -> tuple[np.ndarray, np.ndarray, int]:
        k0 = s * bk
        ra = oa.item(k0 if a_t else m0, m0 if a_t else k0, a_row, a_cg, bool(vec_a))
        rb = ob.item(n0 if b_t else k0, k0 if b_t else n0, b_row, b_cg, bool(vec_b))
        return ra, rb, s

    def store(regs: tuple[np.ndarray, np.ndarray, int], buf: int) -> None:
        ra, rb, s = regs
        a_s[buf * a_stage + a_row * sa + a_cg] = ra
        b_s[buf * b_stage + b_row * sb + b_cg] = rb
        holds[buf] = s
        access.add((interval, buf, "w"))

    def frags_a(cur: int, w: int, kk: int) -> np.ndarray:
        access.add((interval, cur, "r"))
        ab, wm = cur * a_stage, (w // (bn // wn_)) * wm_
        return np.array(
            [
                frag(a_s, ab + kk * sa + (wm + i * 16) // 8, sa).T
                if a_t
                else frag(a_s, ab + (wm + i * 16) * sa + kk // 8, sa)
                for i in range(wm_ // 16)
            ]
        )

    def frags_b(cur: int, w: int, kk: int, js: range) -> np.ndarray:
        access.add((interval, cur, "r"))
        bb, wn = cur * b_stage, (w % (bn // wn_)) * wn_
        return np.array(
            [
                frag(b_s, bb + (wn + j * 16) * sb + kk // 8, sb).T
                if b_t
                else frag(b_s, bb + kk * sb + (wn + j * 16) // 8, sb)
                for j in js
            ]
        )

    def math(cur: int, s: int) -> None:
        assert holds[cur] == s
        for w in range(nw):
            for kk in range(0, bk, 16):
                fa, fb = frags_a(cur, w, kk), frags_b(cur, w, kk, range(wn_ // 16))
                acc[w] += np.einsum("iab,jbc->ijac", fa, fb)

    tn = wn_ // 16
    first, second = range(tn // 2), range(tn // 2, tn)
    if t.get("MB", 0):
        # DEFER and NC with the barrier in the middle of a step's products: a subgroup holds
        # step s's A fragments and first B fragments (j < TN/2) from behind the barrier that
        # ended the first half of step s - 1, loads the other B fragments before its own
        # first half, and step s + 1's first fragments behind its barrier (the last step's
        # from a buffer no step reads, never used)
        assert bk == 16 and t["DEFER"] and t["NC"] and tn % 2 == 0
        store(load(0), 0)
        regs = load(1)
        interval += 1
        held = [(frags_a(0, w, 0), frags_b(0, w, 0, first)) for w in range(nw)]
        for s in range(steps):
            assert regs[2] == s + 1
            store(regs, (s + 1) & 1)
            regs = load(s + 2)
            assert holds[s & 1] == s
            rest = [frags_b(s & 1, w, 0, second) for w in range(nw)]
            for w in range(nw):
                acc[w][:, first] += np.einsum("iab,jbc->ijac", held[w][0], held[w][1])
            interval += 1  # the barrier
            b2 = (s + 1) & 1
            nxt = [(frags_a(b2, w, 0), frags_b(b2, w, 0, first)) for w in range(nw)]
            assert s + 1 == steps or holds[(s + 1) & 1] == s + 1
            for w in range(nw):
                acc[w][:, second] += np.einsum("iab,jbc->ijac", held[w][0], rest[w])
            held = nxt
        interval += 1  # the barrier before the epilogue
    elif t.get("DEFER", 0):
        # step s reads buffer s & 1; first the slabs of step s + 1 (loaded during
        # step s - 1) go to buffer (s + 1) & 1, then those of step s + 2 are loaded
        # (NC: unconditionally; past K the loads are zeros, stored where no step reads)
        nc = t.get("NC", 0)
        store(load(0), 0)
        regs = load(1) if steps > 1 or nc else None
        interval += 1
        for s in range(steps):
            if s + 1 < steps or nc:
                assert regs is not None and regs[2] == s + 1
                store(regs, (s + 1) & 1)
            if s + 2 < steps or nc:
                regs = load(s + 2)
            math(s & 1, s)
            interval += 1
    else:
        for s in range(steps + 1):
            regs = load(s) if s < steps else None
            if s > 0:
                math((s - 1) & 1, s - 1)
            if regs is not None:
                store(regs, s & 1)
            interval += 1
    reads = {(i, x) for i, x, rw in access if rw == "r"}
    writes = {(i, x) for i, x, rw in access if rw == "w"}
    assert not reads & writes
    return acc


def simulate_op(
    t: dict[str, int],
    sg: int,
    pc: dict[str, int],
    a: np.ndarray,
    b: np.ndarray,
    a_t: int,
    b_t: int,
    vec_a: int,
    vec_b: int,
    batch: int,
) -> np.ndarray:
    """C computed the way matmul_coopmat_op.comp does (float64, no rounding): tile order,
    staging of each layout and load path, padded shared rows, fragment loads, the double
    buffering (which step each buffer holds when read; no buffer read and written between two
    barriers) and the masked epilogue through each subgroup's scratch."""
    bm, bn, bk, wm_, wn_ = t["BM"], t["BN"], t["BK"], t["WM"], t["WN"]
    M, N, K = pc["M"], pc["N"], pc["K"]
    nw = (bm // wm_) * (bn // wn_)
    wg = nw * sg
    a_stage = max(bm * (bk + 8), bk * (bm + 8)) // 8
    assert (bm * bk // 8) % wg == 0 and (bk * bn // 8) % wg == 0
    assert 2 * a_stage >= nw * 64  # the epilogue's scratch in the two A buffers
    tiles_n, tiles_m = -(-N // bn), -(-M // bm)
    c = np.full(batch * M * N, np.nan)
    written = np.zeros(batch * M * N, int)
    for z in range(batch):
        zo, zi = z // pc["nb1"], z % pc["nb1"]
        oa = Operand(
            a,
            zo * pc["a_b0"] + zi * pc["a_b1"],
            pc["a_cs"] if a_t else pc["a_rs"],
            pc["a_rs"] if a_t else pc["a_cs"],
            K if a_t else M,
            M if a_t else K,
        )
        ob = Operand(
            b,
            zo * pc["b_b0"] + zi * pc["b_b1"],
            pc["b_cs"] if b_t else pc["b_rs"],
            pc["b_rs"] if b_t else pc["b_cs"],
            N if b_t else K,
            K if b_t else N,
        )
        done = set()
        for tm, tn in grouped_tiles(tiles_m, tiles_n, GROUP_M):
            done.add((tm, tn))
            m0, n0 = tm * bm, tn * bn
            acc = _op_tile(t, oa, ob, (a_t, b_t, vec_a, vec_b), m0, n0, K)
            for w in range(nw):
                wm, wn = (w // (bn // wn_)) * wm_, (w % (bn // wn_)) * wn_
                for i in range(wm_ // 16):
                    for j in range(wn_ // 16):
                        e = np.arange(256)
                        row = m0 + wm + i * 16 + e // 16
                        col = n0 + wn + j * 16 + e % 16
                        ok = (row < M) & (col < N)
                        at = z * M * N + row[ok] * N + col[ok]
                        c[at] = acc[w, i, j].reshape(-1)[ok]
                        written[at] += 1
        assert len(done) == tiles_m * tiles_n
    assert np.all(written == 1)
    return c.reshape(batch, M, N)


def host_pc(a_shape, a_strides, b_shape, b_strides, out_prod=False):
    """The push constants and layout choices csrc/ops/matmul.cpp makes (one batch axis)."""
    m = a_shape[-1] if out_prod else a_shape[-2]
    k = a_shape[-2] if out_prod else a_shape[-1]
    n = b_shape[-1]
    pc = {"M": m, "N": n, "K": k, "nb1": 1, "a_b0": 0, "b_b0": 0}
    pc["a_rs"] = a_strides[-1] if out_prod else a_strides[-2]
    pc["a_cs"] = a_strides[-2] if out_prod else a_strides[-1]
    pc["b_rs"], pc["b_cs"] = b_strides[-2], b_strides[-1]
    if m == 1:
        pc["a_rs"] = 0
    if k == 1:
        pc["a_cs"] = pc["b_rs"] = 0
    if n == 1:
        pc["b_cs"] = 0
    batch = a_shape[0] if len(a_shape) == 3 else (b_shape[0] if len(b_shape) == 3 else 1)
    pc["nb1"] = batch
    pc["a_b1"] = a_strides[0] if len(a_shape) == 3 and a_shape[0] > 1 else 0
    pc["b_b1"] = b_strides[0] if len(b_shape) == 3 and b_shape[0] > 1 else 0
    a_t = int(pc["a_rs"] == 1 and pc["a_cs"] != 1)
    b_t = int(pc["b_rs"] == 1 and pc["b_cs"] != 1)

    def vec8(unit, extent, strides):
        return int(unit == 1 and extent % 8 == 0 and all(s % 8 == 0 for s in strides))

    sa, sb = [pc["a_b1"]], [pc["b_b1"]]
    vec_a = (
        vec8(pc["a_rs"], m, [pc["a_cs"], *sa]) if a_t else vec8(pc["a_cs"], k, [pc["a_rs"], *sa])
    )
    vec_b = (
        vec8(pc["b_rs"], k, [pc["b_cs"], *sb]) if b_t else vec8(pc["b_cs"], n, [pc["b_rs"], *sb])
    )
    return pc, a_t, b_t, vec_a, vec_b, batch


def _strided(x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """The flat buffer under view x (its base at element 0) and x's strides in elements."""
    base = x
    while base.base is not None and isinstance(base.base, np.ndarray):
        base = base.base
    flat = np.ascontiguousarray(base).reshape(-1)
    strides = tuple(s // x.itemsize for s in x.strides)
    off = (x.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // x.itemsize
    return flat[off:], strides


@pytest.mark.parametrize("tile", sorted(op_tiles()))
def test_the_op_shader_schedule_computes_a_at_b(tile: str) -> None:
    t = op_tiles()[tile]
    rng = np.random.default_rng(len(tile))
    m, k, n = t["BM"] + 9, 2 * t["BK"] + 3, 2 * t["BN"] + 5  # partial tiles and K step
    m8, k8, n8 = t["BM"] + 8, 2 * t["BK"] + 16, t["BN"] + 24  # multiples of 8: vector loads
    cases = []
    for mm, kk, nn in ((m, k, n), (m8, k8, n8)):
        a, b = rng.standard_normal((mm, kk)), rng.standard_normal((kk, nn))
        cases += [
            (a, b, False),  # row-major
            (np.ascontiguousarray(a.T).T, b, False),  # x^T: A m-contiguous
            (a, np.ascontiguousarray(b.T).T, False),  # W^T: B k-contiguous
            (np.ascontiguousarray(a.T), b, True),  # out_prod
        ]
    # general strides, a batch of 2 with B broadcast
    wide = rng.standard_normal((2, m, 2 * k))
    cases.append((wide[:, :, ::2], rng.standard_normal((k, n)), False))
    nw = (t["BM"] // t["WM"]) * (t["BN"] // t["WN"])
    for a, b, out_prod in cases:
        want = (np.swapaxes(a, -1, -2) if out_prod else a) @ b
        if want.ndim == 2:
            want = want[None]
        fa, sa = _strided(a)
        fb, sb = _strided(b)
        pc, a_t, b_t, vec_a, vec_b, batch = host_pc(a.shape, sa, b.shape, sb, out_prod)
        # the slabs divide among the invocations for every subgroup size the host accepts
        # (8 to 32); the items' values do not depend on which invocation loads them, so one
        # simulation covers them all
        for sg in (32, 16, 8):
            assert (t["BM"] * t["BK"] // 8) % (nw * sg) == 0
            assert (t["BK"] * t["BN"] // 8) % (nw * sg) == 0
        got = simulate_op(t, 32, pc, fa, fb, a_t, b_t, vec_a, vec_b, batch)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.max(np.abs(want)) * k)


def test_the_layout_choices_cover_every_staging() -> None:
    # the transliteration above runs each staging layout and both load paths
    seen = set()
    a, b = np.zeros((16, 24)), np.zeros((24, 32))
    for aa, bb, op in [
        (a, b, False),
        (a.T.copy().T, b, False),
        (a, b.T.copy().T, False),
        (a[:, ::2], b, False),
        (a[:, 1:17], b, False),
        (a.T.copy(), b, True),
    ]:
        fa, sa = _strided(aa)
        fb, sb = _strided(bb)
        _, a_t, b_t, va, vb, _ = host_pc(aa.shape, sa, bb.shape, sb, op)
        seen |= {("a", a_t, va), ("b", b_t, vb)}
    assert {("a", 0, 1), ("a", 1, 1), ("a", 0, 0), ("b", 0, 1), ("b", 1, 1)} <= seen


def test_the_op_shaders_compile_without_function_storage(tmp_path: Path) -> None:
    tools = find_coopmat_compiler()
    if not tools[0]:
        pytest.skip(f"no cooperative-matrix compiler here: {tools[4]}")
    for name, dt in [(n, dt) for n in ("op64", "op128x256drnf") for dt in ("f16", "bf16")]:
        tile = op_tiles()[name]  # op128x256drnf: the DEFER schedule with ROT, NC, FS
        spv = tmp_path / f"{name}_{dt}.spv"
        flags = [f"-D{k}={v}" for k, v in tile.items()]
        flags += [f"-I{VK_DIR / 'shaders'}", f"-I{VK_DIR.parent / 'core/src/recurra/include'}"]
        src = VK_DIR / "shaders" / "matmul_coopmat_op.comp"
        p = compile_coopmat(tools, src, spv, flags, dt == "bf16")
        assert p.returncode == 0, p.stderr
        words = np.frombuffer(spv.read_bytes(), dtype="<u4")
        # OpVariable (59) with storage class Function (7): none (local memory on NVIDIA)
        i, found = 5, []
        while i < len(words):
            n, op = int(words[i] >> 16), int(words[i] & 0xFFFF)
            if op == 59 and words[i + 3] == 7:
                found.append(int(words[i + 2]))
            i += n
        assert not found


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


# The Mamba2-130M step's products at batch 8 x 512 (M, N, K): in_proj, out_proj (forward,
# dW, dX) and the tied LM head over 315-row chunks of the loss.
STEP_PRODUCTS = [
    (4096, 3352, 768),
    (768, 3352, 4096),
    (4096, 768, 3352),
    (4096, 768, 1536),
    (1536, 768, 4096),
    (4096, 1536, 768),
    (315, 50288, 768),
    (768, 50288, 315),
    (315, 768, 50288),
]
OP_TILE_SIZES = {name: (t["BM"], t["BN"]) for name, t in op_tiles().items()}
PER_SM = {"op128x256drnf": 1, "op128m": 2, "op128": 2, "op64": 4}  # csrc/coopmat.cpp


def test_the_plan_keeps_split_k_products_in_whole_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The op's plan (a cost model, no device needed): the step's products split only where
    the slices' workgroups leave no short last round on the H200's 132 SMs (the LM head's input
    gradient in 15 slices of op128 was one round and 6 workgroups more: twice the time);
    slices of at least 128 of K, at most 32, none for a batch of products; the environment's
    tiling and slice count honoured (forced slices of at least 16 of K)."""
    monkeypatch.delenv("RECURRA_VK_COOPMAT", raising=False)
    monkeypatch.delenv("RECURRA_VK_SPLITK", raising=False)
    plan = recurra_vulkan._vk.coopmat_op_plan
    for m, n, k in STEP_PRODUCTS:
        tile, s = plan(m, n, k)
        bm, bn = OP_TILE_SIZES[tile]
        assert 1 <= s <= min(32, k // 128), (m, n, k, tile, s)
        groups = -(-m // bm) * -(-n // bn) * s
        slots = PER_SM[tile] * 132
        if s > 1:  # the last round at least a third full
            assert groups % slots == 0 or groups % slots >= slots // 3, (m, n, k, tile, s)
    assert plan(315, 768, 50288)[1] > 1  # 18 128x128 tiles, K 50288: split
    assert plan(4096, 4096, 4096) == ("op128m", 1)
    assert plan(768, 3352, 4096, 4)[1] == 1
    assert plan(8, 8, 8)[1] == 1
    monkeypatch.setenv("RECURRA_VK_COOPMAT", "op128")
    assert plan(315, 768, 50288)[0] == "op128"
    monkeypatch.setenv("RECURRA_VK_SPLITK", "5")
    assert plan(315, 768, 50288) == ("op128", 5)
    assert plan(315, 768, 300) == ("op128", 5)  # forced: at most K / 16 slices
    assert plan(315, 768, 40) == ("op128", 2)
    monkeypatch.setenv("RECURRA_VK_COOPMAT", "off")
    assert plan(315, 768, 50288) == ("off", 1)

"""The bfloat16/float16 matmul op's coopmat shader and plan, without a device (issue 18).

The schedule and indexing of shaders/matmul_coopmat_op.comp are transliterated to numpy and
checked against A @ B for every tiling in meson.build, every staging layout, both load paths
and odd sizes: this runs everywhere and catches a masked-edge, layout or barrier bug before
the H200 (the schedule records which shared buffer each step reads and writes between two
barriers). The op's plan (a cost model of an H200) is checked on the Mamba2-130M step's
products. The device tests of the op are in test_vulkan_half_matmul.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from vk_util import VK_DIR, compile_coopmat, find_coopmat_compiler, grouped_tiles, op_tiles

recurra_vulkan = pytest.importorskip("recurra_vulkan")

pytestmark = pytest.mark.vulkan

# ---- the coopmat shader's schedule and indexing, transliterated (no device) ------------------

GROUP_M = 8


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
    tiling and slice count honoured (forced slices of at least 16 of K); A transposed first
    only under RECURRA_VK_TRANSPOSE=on, for a transposable A and no slices."""
    monkeypatch.delenv("RECURRA_VK_COOPMAT", raising=False)
    monkeypatch.delenv("RECURRA_VK_SPLITK", raising=False)
    monkeypatch.delenv("RECURRA_VK_TRANSPOSE", raising=False)
    plan = recurra_vulkan._vk.coopmat_op_plan
    for m, n, k in STEP_PRODUCTS:
        tile, s, transposed = plan(m, n, k, a_transposable=True)
        assert not transposed  # only RECURRA_VK_TRANSPOSE=on transposes A
        bm, bn = OP_TILE_SIZES[tile]
        assert 1 <= s <= min(32, k // 128), (m, n, k, tile, s)
        groups = -(-m // bm) * -(-n // bn) * s
        slots = PER_SM[tile] * 132
        if s > 1:  # the last round at least a third full
            assert groups % slots == 0 or groups % slots >= slots // 3, (m, n, k, tile, s)
    assert plan(315, 768, 50288)[1] > 1  # 18 128x128 tiles, K 50288: split
    assert plan(4096, 4096, 4096) == ("op128m", 1, False)
    assert plan(768, 3352, 4096, 4)[1] == 1
    assert plan(8, 8, 8)[1] == 1
    monkeypatch.setenv("RECURRA_VK_TRANSPOSE", "on")
    assert plan(4096, 4096, 4096) == ("op128m", 1, False)  # A not transposable
    assert plan(4096, 4096, 4096, a_transposable=True) == ("op128m", 1, True)
    assert plan(768, 3352, 4096, 4, a_transposable=True)[2] is False  # a batch: never
    for m, n, k in STEP_PRODUCTS:  # transposed exactly when the plan takes no slices
        _, s, transposed = plan(m, n, k, a_transposable=True)
        assert transposed == (s == 1), (m, n, k, s)
    monkeypatch.setenv("RECURRA_VK_TRANSPOSE", "maybe")
    with pytest.raises(ValueError, match="RECURRA_VK_TRANSPOSE"):
        plan(4096, 4096, 4096, a_transposable=True)
    monkeypatch.setenv("RECURRA_VK_TRANSPOSE", "off")
    assert plan(4096, 4096, 4096, a_transposable=True) == ("op128m", 1, False)
    monkeypatch.setenv("RECURRA_VK_COOPMAT", "op128")
    assert plan(315, 768, 50288)[0] == "op128"
    monkeypatch.setenv("RECURRA_VK_SPLITK", "5")
    assert plan(315, 768, 50288) == ("op128", 5, False)
    assert plan(315, 768, 300) == ("op128", 5, False)  # forced: at most K / 16 slices
    assert plan(315, 768, 40) == ("op128", 2, False)
    monkeypatch.setenv("RECURRA_VK_COOPMAT", "off")
    assert plan(315, 768, 50288) == ("off", 1, False)

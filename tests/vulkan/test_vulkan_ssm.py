"""The Vulkan kernels of Mamba's recurrent ops (ssm_conv, ssm_conv_back, ssm_scan,
ssm_scan_back) against the core's CPU kernels, and a Mamba block training step placed on
Vulkan by the graph scheduler in strict mode.

Each op runs as one node through ``recurra_vulkan.run_node`` and is compared with the same
op on the CPU (``recurra.ops.apply``): forward results and every part of the packed
gradients of the ``*_back`` ops (ds, dx, ddt, dA, dB, dC; d_sx, d_c) separately.
Metric: normalized mean squared error sum((vk - cpu)^2) / sum(cpu^2) <= 1e-7.

Layouts: Mamba-1 (P = 1, A (H, N)) and Mamba-2 (A (H, 1), head_dim 64, d_state 128,
groups), odd sizes (N 1/3/17, P 1/3/64, H 5/6/7, G 1/2/3/5), 1-3 sequences, ids with
repeats and more state rows than sequences, T from 1 to 200 (past the backward's
checkpoint interval: 64 tokens with one decay per head, ~sqrt(T) with one per state).

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


# ---- helpers ----------------------------------------------------------------------------


def vk(name: str, srcs: list[np.ndarray], out_shape: tuple[int, ...]) -> np.ndarray:
    """Returns the op's result computed on the Vulkan device."""
    return recurra_vulkan.run_node(name, srcs, [], [], tuple(out_shape), "float32", 0)


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    """Returns sum((got - want)^2) / sum(want^2) in float64 (the plain sum when want is 0)."""
    want64 = want.astype(np.float64)
    den = float(np.sum(want64 * want64))
    num = float(np.sum((got.astype(np.float64) - want64) ** 2))
    return num / den if den > 0 else num


def assert_parts(name: str, got: np.ndarray, want: np.ndarray, parts: dict[str, int]) -> None:
    """Asserts that each named consecutive part of the packed results agrees."""
    assert got.shape == want.shape
    off = 0
    for part, size in parts.items():
        g, w = got[off : off + size], want[off : off + size]
        assert np.all(np.isfinite(g)), f"{name}/{part}: not finite"
        err = nmse(g, w)
        assert err <= NMSE_MAX, f"{name}/{part}: normalized MSE {err:.3g} > {NMSE_MAX}"
        off += size
    assert off == want.size


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return np.asarray(rng.standard_normal(shape) * scale, dtype=np.float32)


# ---- ssm_conv ---------------------------------------------------------------------------

CONV_CASES = [  # (S, D, W, T)
    (1, 1, 1, 1),
    (2, 3, 4, 1),
    (3, 17, 4, 45),
    (2, 37, 4, 200),
    (1, 5, 9, 7),  # more taps than a tile chunk
    (2, 40, 1, 33),
    (1, 4, 3, 0),  # only context positions
]


@pytest.mark.parametrize("S,D,W,T", CONV_CASES, ids=str)
def test_ssm_conv(S, D, W, T):
    rng = np.random.default_rng(S * 1000 + D * 10 + W + T)
    sx, c = rand(rng, S, D, W - 1 + T), rand(rng, D, W)
    want = cpu("ssm_conv", [sx, c])
    got = vk("ssm_conv", [sx, c], want.shape)
    assert got.shape == (S, T, D)
    if want.size:
        assert nmse(got, want) <= NMSE_MAX
    dy = rand(rng, S, T, D)
    want = cpu("ssm_conv_back", [dy, sx, c])
    got = vk("ssm_conv_back", [dy, sx, c], want.shape)
    assert_parts("ssm_conv_back", got, want, {"d_sx": sx.size, "d_c": c.size})


# ---- ssm_scan ---------------------------------------------------------------------------


def scan_inputs(
    R: int, S: int, T: int, H: int, P: int, N: int, G: int, per_state: bool, ids, seed: int
) -> list[np.ndarray]:
    """(s, x, dt, A, B, C, ids) with decays in Mamba's range (softplus(dt) ~ 0.1..3)."""
    rng = np.random.default_rng(seed)
    s = rand(rng, R, H, P, N, scale=0.5)
    x = rand(rng, S, T, H, P)
    dt = rand(rng, S, T, H, scale=1.5) - 1.0
    A = -np.exp(rand(rng, H, N if per_state else 1, scale=0.7)).astype(np.float32)
    B = rand(rng, S, T, G, N, scale=0.5)
    C = rand(rng, S, T, G, N, scale=0.5)
    ids_arr = np.arange(S, dtype=np.int32) if ids is None else np.asarray(ids, np.int32)
    return [s, x, dt.astype(np.float32), A, B, C, ids_arr]


SCAN_CASES = [  # (R, S, T, H, P, N, G, per_state, ids)
    # Mamba-1: head_dim 1, one decay per state
    (1, 1, 1, 16, 1, 16, 1, True, None),
    (2, 2, 37, 24, 1, 16, 1, True, None),
    (3, 3, 150, 7, 1, 3, 1, True, [2, 0, 1]),
    (4, 2, 60, 5, 1, 17, 1, True, [3, 3]),
    (2, 2, 90, 4, 3, 17, 2, True, [1, 0]),
    (1, 1, 9, 3, 1, 1, 1, True, None),
    # Mamba-2: one decay per head, head_dim 64, d_state 128, groups
    (1, 1, 3, 2, 64, 128, 1, False, None),
    (2, 2, 70, 4, 64, 128, 2, False, None),
    # odd sizes, several sequences, ids with repeats and R > S
    (4, 3, 200, 6, 3, 17, 2, False, [3, 3, 1]),
    (2, 2, 5, 3, 17, 1, 3, False, None),
    (3, 1, 13, 5, 3, 3, 5, False, [2]),
    (2, 2, 1, 7, 1, 16, 7, False, [1, 1]),
    (1, 1, 130, 2, 2, 4, 1, False, None),
    (3, 2, 0, 2, 3, 4, 1, False, [2, 0]),  # no tokens: the states pass through
    # long: the anchor interval doubles past 1024 tokens; many recomputed segments
    (1, 1, 1100, 2, 2, 8, 1, False, None),
    (1, 1, 1100, 3, 1, 16, 1, True, None),
]


@pytest.mark.parametrize("R,S,T,H,P,N,G,per_state,ids", SCAN_CASES, ids=str)
def test_ssm_scan(R, S, T, H, P, N, G, per_state, ids):
    srcs = scan_inputs(R, S, T, H, P, N, G, per_state, ids, seed=R + 10 * T + 100 * H + N)
    want = cpu("ssm_scan", srcs)
    got = vk("ssm_scan", srcs, want.shape)
    assert_parts("ssm_scan", got, want, {"y": S * T * H * P, "state": S * H * P * N})

    rng = np.random.default_rng(T + N)
    grad = rand(rng, want.size)
    bsrcs = [grad, *srcs]
    want_b = cpu("ssm_scan_back", bsrcs)
    got_b = vk("ssm_scan_back", bsrcs, want_b.shape)
    names = ["ds", "dx", "ddt", "dA", "dB", "dC"]
    assert_parts("ssm_scan_back", got_b, want_b, {n: a.size for n, a in zip(names, srcs[:6])})
    if ids is not None:  # rows no sequence starts from get a zero gradient
        ds = got_b[: srcs[0].size].reshape(srcs[0].shape)
        unused = sorted(set(range(R)) - set(ids))
        assert np.all(ds[unused] == 0)


def test_ssm_scan_softplus_branches():
    """Raw dt past 20 (softplus is the identity, sigmoid 1) and far below 0."""
    srcs = scan_inputs(2, 2, 11, 3, 2, 5, 1, False, None, seed=3)
    dt = srcs[2]
    dt[0, ::3, :] = 25.0
    dt[1, ::4, :] = -30.0
    srcs[3] = (srcs[3] * 0.01).astype(np.float32)  # keep exp(dtp * A) away from 0
    want = cpu("ssm_scan", srcs)
    assert_parts("ssm_scan", vk("ssm_scan", srcs, want.shape), want, {"all": want.size})
    grad = rand(np.random.default_rng(4), want.size)
    want_b = cpu("ssm_scan_back", [grad, *srcs])
    got_b = vk("ssm_scan_back", [grad, *srcs], want_b.shape)
    names = ["ds", "dx", "ddt", "dA", "dB", "dC"]
    assert_parts("ssm_scan_back", got_b, want_b, {n: a.size for n, a in zip(names, srcs[:6])})


@pytest.mark.parametrize("per_state", [False, True])
def test_ssm_scan_back_is_deterministic(per_state):
    """Sums over heads, channels and sequences are reduced in a fixed order: bitwise equal
    results from run to run."""
    srcs = scan_inputs(3, 3, 70, 4, 8, 6, 2, per_state, [0, 2, 0], seed=9)
    n_out = 3 * 70 * 4 * 8 + 3 * 4 * 8 * 6
    grad = rand(np.random.default_rng(10), n_out)
    total = sum(a.size for a in srcs[:6])
    first = vk("ssm_scan_back", [grad, *srcs], (total,))
    for _ in range(2):
        np.testing.assert_array_equal(vk("ssm_scan_back", [grad, *srcs], (total,)), first)


def test_ssm_scan_bad_ids_raise():
    srcs = scan_inputs(2, 2, 4, 2, 2, 3, 1, False, [0, 2], seed=1)
    with pytest.raises(ValueError, match="ssm_scan"):
        vk("ssm_scan", srcs, (2 * 4 * 2 * 2 + 2 * 2 * 2 * 3,))
    grad = np.ones(2 * 4 * 2 * 2 + 2 * 2 * 2 * 3, np.float32)
    with pytest.raises(ValueError, match="ssm_scan_back"):
        vk("ssm_scan_back", [grad, *srcs], (sum(a.size for a in srcs[:6]),))
    # The device is usable afterwards.
    ok = scan_inputs(2, 2, 4, 2, 2, 3, 1, False, [0, 1], seed=1)
    want = cpu("ssm_scan", ok)
    assert nmse(vk("ssm_scan", ok, want.shape), want) <= NMSE_MAX


def test_ssm_ops_refuse_bad_shapes():
    """Shapes the core refuses are refused by the backend too (NotImplementedError from
    run_node, never a crash)."""
    srcs = scan_inputs(2, 2, 4, 3, 2, 3, 1, False, None, seed=2)
    bad = list(srcs)
    bad[4] = np.zeros((2, 4, 2, 3), np.float32)  # G = 2 does not divide H = 3
    bad[5] = bad[4]
    with pytest.raises(NotImplementedError):
        vk("ssm_scan", bad, (2 * 4 * 3 * 2 + 2 * 3 * 2 * 3,))
    with pytest.raises(NotImplementedError):
        vk("ssm_conv", [np.zeros((1, 3, 5), np.float32), np.zeros((4, 2), np.float32)], (1, 4, 3))


# ---- a Mamba block training step, placed on Vulkan by the scheduler ----------------------


def _mamba_step(backends: list[str] | None) -> dict:
    """One training step of a Mamba block (ssm_conv -> ssm_scan -> MSE vs a target, built
    as a graph like the CLI demo, then SGD p - lr * g) on `backends` (strict placement)."""
    S, T, H, P, N, K, lr = 2, 21, 3, 4, 5, 3, 0.5
    D = H * P
    rng = np.random.default_rng(7)
    g = rc.Graph(backends=backends, strict=True) if backends else rc.Graph()
    sx = g.tensor((S, D, K - 1 + T), name="sx")
    params = {
        "conv": g.param((D, K), name="conv"),
        "dt": g.param((S, T, H), name="dt"),
        "A": g.param((H, 1), name="A"),
        "B": g.param((S, T, 1, N), name="B"),
        "C": g.param((S, T, 1, N), name="C"),
    }
    s0 = g.tensor((S, H, P, N), name="s0")
    ids = g.tensor((S,), dtype="int32", name="ids")
    target = g.tensor((S, T, H, P), name="target")
    conv = rc.ops.ssm_conv(sx, params["conv"])
    y, _ = rc.ops.ssm_scan(
        s0, conv.reshape(S, T, H, P), params["dt"], params["A"], params["B"], params["C"], ids
    )
    loss = rc.ops.scale(rc.ops.sum(rc.ops.sqr(y - target)), 1.0 / (S * T * H * P))
    g.set_loss(loss)
    g.build_backward(loss)
    grads = {k: g.grad(t) for k, t in params.items()}
    new = {k: rc.ops.sub(params[k], rc.ops.scale(grads[k], lr)) for k in params}
    for t in new.values():
        g.set_output(t)
    values = {
        "conv": rng.uniform(-0.3, 0.3, (D, K)),
        "dt": rng.uniform(0.01, 0.1, (S, T, H)),
        "A": -rng.uniform(0.2, 1.0, (H, 1)),
        "B": rng.uniform(-0.3, 0.3, (S, T, 1, N)),
        "C": rng.uniform(-0.3, 0.3, (S, T, 1, N)),
    }
    for k, v in values.items():
        g.set_data(params[k], v)
    g.set_data(sx, rng.uniform(-1, 1, (S, D, K - 1 + T)))
    g.set_data(s0, rng.uniform(-0.5, 0.5, (S, H, P, N)))
    g.set_data(ids, np.arange(S))
    g.set_data(target, rng.uniform(-1, 1, (S, T, H, P)))
    g.compute()
    where = {
        "ssm_conv": g.backend_of(conv),
        "ssm_scan": g.backend_of(y),
        "loss": g.backend_of(loss),
    }
    # every computed node (the backward ones included), by op name
    for nid in range(g.n_nodes):
        info = g._g.info(nid)
        if info["op"] != "leaf" and not info["is_view"]:
            where.setdefault(info["op"], g._g.backend_of(nid))
            if g._g.backend_of(nid) == "cpu":
                where[info["op"]] = "cpu"
    return {
        "loss": loss.item(),
        "grads": {k: t.numpy() for k, t in grads.items()},
        "new": {k: t.numpy() for k, t in new.items()},
        "where": where,
        "n_splits": g.n_splits,
    }


def test_mamba_block_training_step_on_vulkan():
    try:
        rc.parse_device("vulkan")
    except ValueError as e:
        pytest.skip(f"the core does not offer the vulkan device yet: {e}")
    want = _mamba_step(None)
    got = _mamba_step(["vulkan"])
    # nothing ran on the CPU: forward, loss, backward (ssm_scan_back, ssm_conv_back) and SGD
    for op in ("ssm_conv", "ssm_scan", "loss", "ssm_scan_back", "ssm_conv_back", "sub", "scale"):
        assert op in got["where"], op
    assert all(b.startswith("vulkan") for b in got["where"].values()), got["where"]
    assert got["n_splits"] == 1
    assert abs(got["loss"] - want["loss"]) <= 1e-6 * max(1.0, abs(want["loss"]))
    for k, w in want["grads"].items():
        assert nmse(got["grads"][k], w) <= NMSE_MAX, k
        assert np.any(w != 0), k  # every parameter gets a gradient
        assert nmse(got["new"][k], want["new"][k]) <= NMSE_MAX, k

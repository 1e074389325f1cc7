"""rwkv_wkv6, rwkv_wkv7 and gated_linear_attn: forward against float64 numpy references,
gradients of every input (the initial state included) against finite differences, long
sequences and wide heads against directional derivatives of the float64 reference, thread
count independence, and error handling.

Tolerances: forward results are float32 recurrences over at most a few hundred tokens with
decays below 1, compared with rtol 1e-4 / atol 1e-4 (values of order 1); small gradients use
the finite-difference helper's defaults (float32 differences, rtol 1e-2, atol 1e-3). For long
sequences a random directional derivative of the float64 reference (central differences, eps
1e-4, truncation error ~1e-8 relative) is compared with the projected analytic gradient at a
relative 1e-4, far above float32 rounding and far below the effect of any wrong term.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from gradcheck import check_grads
from reference_rwkv import gated_linear_attn_ref, rwkv_wkv6_ref, rwkv_wkv7_ref

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(20261129)
GLA_SCALE = 0.7
OPS = ("rwkv_wkv6", "rwkv_wkv7", "gated_linear_attn")


def op_fn(name: str) -> Callable[..., tuple]:
    """The recurra op with its arguments in input order (GLA's scale fixed)."""
    if name == "rwkv_wkv6":
        return ops.rwkv_wkv6
    if name == "rwkv_wkv7":
        return ops.rwkv_wkv7
    return lambda k, v, q, g, s: ops.gated_linear_attn(k, v, q, g, s, GLA_SCALE)


def ref_fn(name: str) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    if name == "rwkv_wkv6":
        return rwkv_wkv6_ref
    if name == "rwkv_wkv7":
        return rwkv_wkv7_ref
    return lambda k, v, q, g, s: gated_linear_attn_ref(k, v, q, g, s, GLA_SCALE)


def make_inputs(name: str, T: int, H: int, S: int, n_seqs: int) -> list[np.ndarray]:
    """Float64 inputs in the op's argument order, in the ranges the models use."""

    def x() -> np.ndarray:
        return RNG.standard_normal((T, H, S)) * 0.5

    def decay() -> np.ndarray:
        return RNG.uniform(0.5, 0.99, (T, H, S))

    state = RNG.standard_normal((n_seqs, H, S, S)) * 0.5
    if name == "rwkv_wkv6":  # k, v, r, tf, td, state
        return [x(), x(), x(), RNG.standard_normal((H, S)) * 0.5, decay(), state]
    if name == "gated_linear_attn":  # k, v, q, g, state
        return [x(), x(), x(), decay(), state]
    # r, w, k, v, a, b, state with RWKV-7's a = -kk, b = kk * gate, kk L2-normalised
    kk = RNG.standard_normal((T, H, S))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    return [x(), decay(), x(), x(), -kk, kk * RNG.uniform(0.0, 1.0, (T, H, S)), state]


def f32(arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(a, np.float32) for a in arrays]


@pytest.fixture
def restore_threads():
    n = rc.get_num_threads()
    yield
    rc.set_num_threads(n)


# ---- forward ---------------------------------------------------------------------------

FORWARD_SIZES = [
    (5, 2, 3, 1),  # T, H, S, n_seqs
    (6, 1, 1, 2),  # head size 1
    (8, 2, 17, 4),  # odd head size, several sequences
    (4, 3, 3, 4),  # one-token sequences
    (48, 4, 64, 1),  # RWKV's head size
    (12, 1, 64, 3),  # few heads: heads split into blocks
    (7, 1, 80, 1),  # more lanes than one register block
]


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("T,H,S,n_seqs", FORWARD_SIZES)
def test_forward(name, T, H, S, n_seqs):
    xs = f32(make_inputs(name, T, H, S, n_seqs))
    y, state = op_fn(name)(*(rc.tensor(a) for a in xs))
    y_ref, state_ref = ref_fn(name)(*xs)
    assert y.shape == (T, H, S) and state.shape == (n_seqs, H, S, S)
    np.testing.assert_allclose(y.numpy(), y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(state.numpy(), state_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", OPS)
def test_numpy_inputs_and_graph_api(name):
    xs = f32(make_inputs(name, 6, 2, 5, 2))
    y_ref, state_ref = ref_fn(name)(*xs)
    y, state = op_fn(name)(*xs)  # numpy arrays are converted
    np.testing.assert_allclose(y.numpy(), y_ref, rtol=1e-4, atol=1e-4)
    g = rc.Graph()
    leaves = [g.input(a.shape) for a in xs]
    gy, gstate = op_fn(name)(*leaves)
    g.set_output(gy)
    g.set_output(gstate)
    for leaf, a in zip(leaves, xs):
        g.set_data(leaf, a)
    g.compute()
    np.testing.assert_allclose(gy.numpy(), y_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gstate.numpy(), state_ref, rtol=1e-4, atol=1e-4)


# ---- gradients ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("T,H,S,n_seqs", [(5, 2, 3, 1), (4, 1, 1, 2), (2, 2, 3, 2)])
def test_grads(name, T, H, S, n_seqs):
    check_grads(op_fn(name), make_inputs(name, T, H, S, n_seqs))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("which", [0, 1])
def test_grads_of_one_result(name, which):
    # Only y, or only the final state, reaches the loss: the other half of the packed
    # gradient is zero.
    check_grads(lambda *a: op_fn(name)(*a)[which], make_inputs(name, 3, 1, 2, 1))


def analytic_grads(name: str, xs: list[np.ndarray], wy: np.ndarray, ws: np.ndarray) -> list:
    ps = [rc.param(a) for a in f32(xs)]
    y, state = op_fn(name)(*ps)
    ((y * rc.tensor(wy)).sum() + (state * rc.tensor(ws)).sum()).backward()
    return [p.grad.numpy() for p in ps]


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize(
    "T,H,S,n_seqs",
    [(300, 1, 64, 1), (120, 2, 33, 2), (40, 1, 80, 1)],  # several checkpoint chunks, blocks
)
def test_grads_long_directional(name, T, H, S, n_seqs):
    xs = [a.astype(np.float64) for a in f32(make_inputs(name, T, H, S, n_seqs))]
    wy = RNG.standard_normal((T, H, S))
    ws = RNG.standard_normal((n_seqs, H, S, S))
    grads = analytic_grads(name, xs, wy.astype(np.float32), ws.astype(np.float32))
    ref = ref_fn(name)

    def loss(args: list[np.ndarray]) -> float:
        y, state = ref(*args)
        return float(np.sum(y * wy) + np.sum(state * ws))

    eps = 1e-4
    for i, (a, g) in enumerate(zip(xs, grads)):
        d = RNG.standard_normal(a.shape)
        up = [*xs[:i], a + eps * d, *xs[i + 1 :]]
        down = [*xs[:i], a - eps * d, *xs[i + 1 :]]
        numeric = (loss(up) - loss(down)) / (2 * eps)
        projected = float(np.sum(g.astype(np.float64) * d))
        assert abs(projected - numeric) <= 1e-4 * abs(numeric) + 1e-4, (
            f"input {i}: directional derivative {projected} vs {numeric}"
        )


# ---- threads -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("T,H,S,n_seqs", [(40, 1, 64, 1), (24, 3, 17, 2)])
def test_threads_agree(name, T, H, S, n_seqs, restore_threads):
    xs = make_inputs(name, T, H, S, n_seqs)
    wy = RNG.standard_normal((T, H, S)).astype(np.float32)
    ws = RNG.standard_normal((n_seqs, H, S, S)).astype(np.float32)
    results = []
    for n in (1, 2):
        rc.set_num_threads(n)
        y, state = op_fn(name)(*(rc.tensor(a) for a in f32(xs)))
        results.append([y.numpy(), state.numpy(), *analytic_grads(name, xs, wy, ws)])
    for one, two in zip(*results):
        np.testing.assert_allclose(two, one, rtol=1e-6, atol=0)


# One token per sequence (a generation step): rwkv_wkv7 updates the state rows where they
# lie; head sizes with vector tails (17, 20, 80) and none (64); the 2 x 12 x 64 x 64 state
# is past the size computed on the calling thread alone, so it goes over the pool.
@pytest.mark.parametrize(
    "H,S,n_seqs", [(2, 17, 3), (3, 20, 1), (12, 64, 1), (12, 64, 2), (1, 80, 2)]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_wkv7_one_token(H, S, n_seqs, threads, restore_threads):
    rc.set_num_threads(threads)
    xs = f32(make_inputs("rwkv_wkv7", n_seqs, H, S, n_seqs))
    y, state = ops.rwkv_wkv7(*(rc.tensor(a) for a in xs))
    y_ref, state_ref = rwkv_wkv7_ref(*xs)
    np.testing.assert_allclose(y.numpy(), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.numpy(), state_ref, rtol=1e-5, atol=1e-5)


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPS)
def test_errors(name):
    fn = op_fn(name)
    good = f32(make_inputs(name, 6, 2, 3, 2))

    def with_input(i: int, a: np.ndarray) -> list[np.ndarray]:
        return [*good[:i], a, *good[i + 1 :]]

    fn(*good)  # the baseline is valid
    with pytest.raises(ValueError, match="multiple of n_seqs"):
        fn(*with_input(len(good) - 1, np.zeros((4, 2, 3, 3), np.float32)))  # T = 6, 4 runs
    with pytest.raises(ValueError):
        fn(*with_input(1, np.zeros((6, 2, 4), np.float32)))  # S differs
    with pytest.raises(ValueError):
        fn(*with_input(0, np.zeros((6, 3, 3), np.float32)))  # H differs
    with pytest.raises(ValueError):
        fn(*with_input(0, np.zeros((6, 6), np.float32)))  # not (T, H, S)
    with pytest.raises(ValueError):
        fn(*with_input(len(good) - 1, np.zeros((2, 2, 3, 4), np.float32)))  # state not S x S
    with pytest.raises(ValueError):
        fn(*with_input(len(good) - 1, np.zeros((2, 3, 3, 3), np.float32)))  # state's H
    with pytest.raises(TypeError):
        fn(*with_input(1, np.zeros((6, 2, 3), np.int32)))
    with pytest.raises(TypeError):
        fn(*with_input(len(good) - 1, np.zeros((2, 2, 3, 3), np.int32)))
    if name == "rwkv_wkv6":
        with pytest.raises(ValueError):
            fn(*with_input(3, np.zeros((2, 4), np.float32)))  # tf not (H, S)

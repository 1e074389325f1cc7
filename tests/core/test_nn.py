"""Neural-net ops: softmax, log_softmax, cross_entropy, mse_loss, rms_norm, layer_norm and
get_rows. Forward against float64 numpy, gradients against finite differences.

Tolerances: the kernels work in float32 with a polynomial exp (< 2 ulp), so forward
results are held to rtol 1e-5 / atol 1e-6 against float64 (rtol 1e-4 for long reductions);
gradients use gradcheck's defaults (rtol 1e-2, atol 1e-3; see gradcheck.py for why).
"""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_grads

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(7)

ROW_SHAPES = [(1,), (3,), (17,), (1, 1), (4, 1), (3, 17), (2, 3, 5), (2, 1, 3, 17), (2, 1000)]


def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


# ---- float64 references -------------------------------------------------------------------


def softmax_ref(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax_ref(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def cross_entropy_ref(logits: np.ndarray, targets: np.ndarray) -> float:
    lp = log_softmax_ref(logits.reshape(-1, logits.shape[-1]))
    t = targets.reshape(-1)
    return float(-lp[np.arange(t.size), t].mean())


def rms_norm_ref(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def layer_norm_ref(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    mu = x.mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)


# ---- softmax / log_softmax ----------------------------------------------------------------


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_softmax_forward(shape):
    x = randn(*shape, scale=3.0)
    np.testing.assert_allclose(
        ops.softmax(rc.tensor(x)).numpy(), softmax_ref(x), rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(
        ops.log_softmax(rc.tensor(x)).numpy(), log_softmax_ref(x), rtol=1e-5, atol=2e-6
    )


@pytest.mark.parametrize("axis", [0, 1, -3, 2])
def test_softmax_other_axes(axis):
    x = randn(3, 17, 5, scale=2.0)
    got = ops.softmax(rc.tensor(x), axis=axis).numpy()
    np.testing.assert_allclose(got, softmax_ref(x, axis), rtol=1e-5, atol=1e-7)
    got = ops.log_softmax(rc.tensor(x), axis=axis).numpy()
    np.testing.assert_allclose(got, log_softmax_ref(x, axis), rtol=1e-5, atol=2e-6)


def test_softmax_strided_inputs():
    x = randn(17, 6)
    t = rc.tensor(x)
    np.testing.assert_allclose(ops.softmax(t.T).numpy(), softmax_ref(x.T), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        ops.log_softmax(t[1::2, ::3]).numpy(), log_softmax_ref(x[1::2, ::3]), rtol=1e-5, atol=2e-6
    )


def test_softmax_is_stable_for_large_logits():
    x = np.array(
        [[1000.0, 1001.0, 999.0], [-1000.0, -1001.0, -1002.0], [88.0, -88.0, 0.0]], np.float32
    )
    np.testing.assert_allclose(
        ops.softmax(rc.tensor(x)).numpy(), softmax_ref(x), rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(
        ops.log_softmax(rc.tensor(x)).numpy(), log_softmax_ref(x), rtol=1e-5, atol=1e-5
    )


def test_softmax_masked_entries_are_exactly_zero():
    x = np.array([[-np.inf, 0.0, 1.0, -np.inf], [2.0, -np.inf, -200.0, 0.5]], np.float32)
    got = ops.softmax(rc.tensor(x)).numpy()
    assert got[0, 0] == 0.0 and got[0, 3] == 0.0 and got[1, 1] == 0.0
    np.testing.assert_allclose(got, softmax_ref(x), rtol=1e-5, atol=1e-30)
    assert np.isneginf(ops.log_softmax(rc.tensor(x)).numpy()[0, 0])


def test_exp_accuracy_over_its_range():
    # softmax of (0, v) is 1 / (1 + exp(-v)): sweeps the kernel's exp over [-87, 0].
    v = np.linspace(-87, 0, 4001, dtype=np.float32)
    x = np.stack([np.zeros_like(v), v], axis=1)
    got = ops.softmax(rc.tensor(x)).numpy()[:, 1]
    np.testing.assert_allclose(got, softmax_ref(x)[:, 1], rtol=4e-7, atol=0)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize(
    "shape,axis", [((2, 3), -1), ((1,), -1), ((3, 2, 4), 1), ((3, 4), 0)], ids=str
)
def test_softmax_grad(name, shape, axis):
    x = RNG.standard_normal(shape) * 2
    check_grads(lambda t: getattr(ops, name)(t, axis=axis), [x])


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_grad_through_views(name):
    x = RNG.standard_normal((5, 3))
    check_grads(lambda t: getattr(ops, name)(t.T[:, 1:]), [x])


def test_softmax_errors():
    with pytest.raises(ValueError, match="softmax"):
        ops.softmax(rc.tensor(randn(2, 3)), axis=2)
    with pytest.raises(TypeError, match="softmax"):
        ops.softmax(rc.tensor(np.arange(6, dtype=np.int32)))
    with pytest.raises(ValueError, match="softmax_back"):
        ops.apply("softmax_back", [randn(2, 3), randn(3, 2)])
    with pytest.raises(ValueError, match="log_softmax"):
        ops.apply("log_softmax", [randn(2, 3), randn(2, 3)])


# ---- cross_entropy ------------------------------------------------------------------------


@pytest.mark.parametrize("n,c", [(1, 1), (1, 3), (3, 1), (17, 3), (3, 17), (5, 1000)], ids=str)
def test_cross_entropy_forward(n, c):
    logits = randn(n, c, scale=3.0)
    targets = RNG.integers(0, c, n).astype(np.int32)
    got = ops.cross_entropy(rc.tensor(logits), rc.tensor(targets)).numpy()
    assert got.shape == ()
    np.testing.assert_allclose(got, cross_entropy_ref(logits, targets), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 3, 5), (17,), (2, 2, 2, 3)], ids=str)
def test_cross_entropy_batched_shapes(shape):
    logits = randn(*shape, scale=2.0)
    targets = RNG.integers(0, shape[-1], shape[:-1]).astype(np.int32)
    got = ops.cross_entropy(logits, targets).numpy()
    np.testing.assert_allclose(got, cross_entropy_ref(logits, targets), rtol=1e-5, atol=1e-6)


def test_cross_entropy_strided_logits_and_large_values():
    logits = randn(7, 4, scale=500.0)  # used transposed: (4, 7)
    targets = np.array([6, 0, 3, 3], np.int32)
    got = ops.cross_entropy(rc.tensor(logits).T, rc.tensor(targets)).numpy()
    np.testing.assert_allclose(got, cross_entropy_ref(logits.T.copy(), targets), rtol=1e-5)
    assert np.isfinite(got)


@pytest.mark.parametrize("n,c", [(1, 1), (3, 4), (5, 2)], ids=str)
def test_cross_entropy_grad(n, c):
    logits = RNG.standard_normal((n, c)) * 2
    targets = RNG.integers(0, c, n).astype(np.int32)
    check_grads(lambda x, t: ops.cross_entropy(x, t), [logits, targets])


def test_cross_entropy_grad_batched_and_strided():
    logits = RNG.standard_normal((3, 2, 4))
    targets = np.array([[1, 3], [0, 0], [2, 1]], np.int32)
    check_grads(lambda x, t: ops.cross_entropy(x, t), [logits, targets])
    check_grads(
        lambda x, t: ops.cross_entropy(x.T, t), [RNG.standard_normal((4, 3)), targets[:, 0]]
    )


def test_cross_entropy_grad_matches_closed_form():
    logits = randn(17, 5)
    targets = RNG.integers(0, 5, 17).astype(np.int32)
    p = rc.param(logits)
    ops.cross_entropy(p, targets).backward()
    want = softmax_ref(logits)
    want[np.arange(17), targets] -= 1.0
    np.testing.assert_allclose(p.grad.numpy(), want / 17, rtol=1e-5, atol=1e-7)


def test_cross_entropy_grad_takes_the_logits_memory():
    # Logits computed in the graph die at the backward, which writes their gradient over
    # them row by row: one (N, C) tensor less in the arena, the same gradient.
    n, c, d = 13, 37, 6
    g = rc.Graph()
    w, h, t = g.param((d, c)), g.input((n, d)), g.input((n,), "int32")
    loss = ops.cross_entropy(ops.matmul(h, w), t)
    g.set_loss(loss)
    g.build_backward(loss)
    wv, hv, tv = randn(d, c), randn(n, d), RNG.integers(0, c, n).astype(np.int32)
    for leaf, v in ((w, wv), (h, hv), (t, tv)):
        g.set_data(leaf, v)
    g.compute()
    dlogits = softmax_ref((hv @ wv).astype(np.float64))
    dlogits[np.arange(n), tv] -= 1.0
    want = hv.astype(np.float64).T @ (dlogits / n)
    np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-5, atol=1e-6)
    assert g.memory()["in_place_bytes"] >= n * c * 4


def test_cross_entropy_type_and_shape_errors():
    logits = rc.tensor(randn(3, 4))
    with pytest.raises(TypeError, match="int32"):
        ops.cross_entropy(logits, rc.tensor(np.array([0.0, 1.0, 2.0], np.float32)))
    with pytest.raises(TypeError, match="cross_entropy"):
        ops.cross_entropy(rc.tensor(np.ones((3, 4), np.int32)), np.array([0, 1, 2], np.int32))
    with pytest.raises(ValueError, match="cross_entropy"):
        ops.cross_entropy(logits, np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="cross_entropy"):
        ops.apply("cross_entropy", [randn(2, 3, 4), np.zeros(2, np.int32)])
    with pytest.raises(ValueError, match="cross_entropy"):
        ops.apply("cross_entropy", [randn(0, 4), np.zeros(0, np.int32)])
    with pytest.raises(ValueError, match="cross_entropy_back"):
        ops.apply("cross_entropy_back", [randn(2), randn(3, 4), np.zeros(3, np.int32)])


@pytest.mark.parametrize("bad", [4, -1, 1 << 30])
def test_cross_entropy_target_out_of_range(bad):
    logits = randn(3, 4)
    with pytest.raises(ValueError, match=r"cross_entropy: target .* out of range \[0, 4\)"):
        ops.cross_entropy(rc.tensor(logits), rc.tensor(np.array([0, bad, 1], np.int32))).numpy()
    # The process and the library keep working.
    ok = ops.cross_entropy(rc.tensor(logits), rc.tensor(np.array([0, 3, 1], np.int32))).numpy()
    np.testing.assert_allclose(ok, cross_entropy_ref(logits, np.array([0, 3, 1])), rtol=1e-5)


def test_cross_entropy_back_checks_targets_too():
    with pytest.raises(ValueError, match="cross_entropy_back"):
        ops.apply(
            "cross_entropy_back", [np.ones((), np.float32), randn(2, 3), np.array([0, 3], np.int32)]
        ).numpy()


# ---- mse_loss -----------------------------------------------------------------------------


def test_mse_loss():
    a, b = randn(3, 17), randn(3, 17)
    got = ops.mse_loss(rc.tensor(a), rc.tensor(b)).numpy()
    want = ((a.astype(np.float64) - b) ** 2).mean()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    got = ops.mse_loss(rc.tensor(a), rc.tensor(b[0])).numpy()  # broadcasting
    np.testing.assert_allclose(got, ((a.astype(np.float64) - b[0]) ** 2).mean(), rtol=1e-5)
    check_grads(
        lambda x, y: ops.mse_loss(x, y), [RNG.standard_normal((2, 3)), RNG.standard_normal(3)]
    )


# ---- rms_norm / layer_norm ----------------------------------------------------------------


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_norms_forward(shape, eps):
    x = randn(*shape, scale=2.0) + 0.5
    np.testing.assert_allclose(
        ops.rms_norm(rc.tensor(x), eps=eps).numpy(), rms_norm_ref(x, eps), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(
        ops.layer_norm(rc.tensor(x), eps=eps).numpy(), layer_norm_ref(x, eps), rtol=1e-4, atol=1e-4
    )


def test_norms_default_eps_and_strided_inputs():
    x = randn(6, 17)
    view = rc.tensor(x).T[::2]  # (9, 6), strided
    np.testing.assert_allclose(
        ops.rms_norm(view).numpy(), rms_norm_ref(x.T[::2], 1e-6), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        ops.layer_norm(view).numpy(), layer_norm_ref(x.T[::2], 1e-5), rtol=1e-4, atol=1e-5
    )


def test_layer_norm_is_stable_with_a_large_mean():
    x = randn(4, 64) + 1000.0
    np.testing.assert_allclose(
        ops.layer_norm(rc.tensor(x)).numpy(), layer_norm_ref(x, 1e-5), atol=2e-3
    )


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("shape", [(2, 3), (3,), (2, 2, 5)], ids=str)
def test_norms_grad(name, shape):
    x = RNG.standard_normal(shape)
    check_grads(lambda t: getattr(ops, name)(t, eps=0.1), [x])


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
def test_norms_grad_through_views(name):
    x = RNG.standard_normal((4, 3))
    check_grads(lambda t: getattr(ops, name)(t.T, eps=1e-3), [x], rtol=2e-2)


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
def test_norms_errors(name):
    fn = getattr(ops, name)
    with pytest.raises(ValueError, match=name):
        fn(rc.tensor(randn(2, 3)), eps=-1.0)
    with pytest.raises(ValueError, match=name):
        fn(rc.tensor(randn(2, 3)), eps=float("nan"))
    with pytest.raises(TypeError, match=name):
        fn(rc.tensor(np.ones((2, 3), np.int32)))
    with pytest.raises(ValueError, match=name):
        ops.apply(name, [randn(2, 3)])  # no eps
    with pytest.raises(ValueError, match=f"{name}_back"):
        ops.apply(f"{name}_back", [randn(2, 3), randn(2, 4)], fp=(1e-5,))


# ---- get_rows -----------------------------------------------------------------------------


@pytest.mark.parametrize("idx_shape", [(1,), (3,), (17,), (2, 3), (2, 1, 3), ()], ids=str)
@pytest.mark.parametrize("d", [1, 3, 17])
def test_get_rows_forward(idx_shape, d):
    table = randn(5, d)
    idx = RNG.integers(0, 5, idx_shape).astype(np.int32)
    got = ops.get_rows(rc.tensor(table), rc.tensor(idx)).numpy()
    assert got.shape == idx_shape + (d,)
    np.testing.assert_array_equal(got, table[idx])


def test_get_rows_strided_table():
    table = randn(6, 5)
    idx = np.array([[4, 0], [2, 2]], np.int32)
    got = ops.get_rows(rc.tensor(table).T, idx).numpy()  # a (5, 6) table
    np.testing.assert_array_equal(got, table.T[idx])


@pytest.mark.parametrize("idx", [[0, 2, 2, 1, 2], [[3, 0], [3, 3]], [[[1]]]], ids=str)
def test_get_rows_grad(idx):
    idx = np.array(idx, np.int32)
    check_grads(lambda t, i: ops.get_rows(t, i), [RNG.standard_normal((4, 3)), idx])


def test_get_rows_grad_is_a_deterministic_scatter_add():
    # Many repeats of a few rows, wide enough for several column blocks: the result must
    # be the sums in index order, identical for every thread count.
    v, d, n = 7, 600, 4000
    idx = RNG.integers(0, v, n).astype(np.int32)
    g = randn(n, d)
    want = np.zeros((v, d), np.float64)
    np.add.at(want, idx, g.astype(np.float64))
    results = []
    old = rc.get_num_threads()
    try:
        for threads in (1, 2, 3):
            rc.set_num_threads(threads)
            results.append(ops.apply("get_rows_back", [g, idx], ip=(v,)).numpy())
    finally:
        rc.set_num_threads(old)
    np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=1e-4)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    unused = np.setdiff1d(np.arange(v), idx)
    assert (results[0][unused] == 0).all()


def test_get_rows_errors():
    table = rc.tensor(randn(5, 3))
    with pytest.raises(TypeError, match="int32"):
        ops.get_rows(table, rc.tensor(np.array([0.0, 1.0], np.float32)))
    with pytest.raises(ValueError, match="get_rows"):
        ops.get_rows(rc.tensor(randn(2, 5, 3)), np.array([0], np.int32))
    with pytest.raises(ValueError, match="get_rows"):
        ops.get_rows(table, np.zeros((1, 1, 1, 1), np.int32))
    with pytest.raises(TypeError, match="get_rows"):
        ops.get_rows(rc.tensor(np.ones((5, 3), np.int32)), np.array([0], np.int32))
    with pytest.raises(ValueError, match="get_rows_back"):
        ops.apply("get_rows_back", [randn(2, 3), np.array([0, 1], np.int32)], ip=(-1,))
    with pytest.raises(ValueError, match="get_rows_back"):
        ops.apply("get_rows_back", [randn(3, 3), np.array([0, 1], np.int32)], ip=(4,))


@pytest.mark.parametrize("bad", [5, -1, 2**31 - 1])
def test_get_rows_index_out_of_range(bad):
    table = randn(5, 3)
    with pytest.raises(ValueError, match=r"get_rows: index .* out of range \[0, 5\)"):
        ops.get_rows(rc.tensor(table), rc.tensor(np.array([[0, 1], [bad, 2]], np.int32))).numpy()
    with pytest.raises(ValueError, match="get_rows_back"):
        ops.apply("get_rows_back", [randn(2, 3), np.array([0, bad], np.int32)], ip=(5,)).numpy()
    ok = ops.get_rows(rc.tensor(table), rc.tensor(np.array([4, 0], np.int32))).numpy()
    np.testing.assert_array_equal(ok, table[[4, 0]])


# ---- a small model end to end -------------------------------------------------------------


def test_embedding_norm_softmax_chain_grad():
    # get_rows -> layer_norm -> rms_norm -> log_softmax -> cross_entropy, gradient into the table.
    idx = np.array([[0, 2], [2, 1]], np.int32)
    targets = np.array([[1, 0], [3, 3]], np.int32)

    def model(table, i, t):
        h = ops.layer_norm(ops.get_rows(table, i), eps=1e-3)
        return ops.cross_entropy(ops.log_softmax(ops.rms_norm(h, eps=1e-3) * 2.0), t)

    check_grads(model, [RNG.standard_normal((3, 4)), idx, targets])

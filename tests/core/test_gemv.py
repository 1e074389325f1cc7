"""One-row (and one-column) products on the core's own matrix-vector kernel (ops/gemv.cpp):
x (1, k) @ W.T with W stored (n, k), and W (m, k) @ x (k, 1), against float64 numpy for
sizes around the kernel's steps (16 and 8 columns, a masked tail, groups of four rows, a
split over the pool), strided operands, a batch of products, and thread counts 1 to 3; and
the same result bit for bit whatever the thread count."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
from recurra import ops


@pytest.fixture
def threads():
    """Sets the pool size for a test and restores it afterwards."""
    before = rc.get_num_threads()
    yield rc.set_num_threads
    rc.set_num_threads(before)


def _want(x: np.ndarray, w_t: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ w_t.astype(np.float64)


def _check(got: np.ndarray, want: np.ndarray, k: int) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    # k float32 products of size ~1 each: the error grows like sqrt(k) * 6e-8.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=3e-6 * max(1.0, np.sqrt(k)))


# k: below one vector, each remainder mod 16 around the 16-column step; n: each remainder
# mod 4, and products big enough (>= 96 KiB of W) to be split over the threads.
KS = [1, 3, 7, 8, 9, 15, 16, 17, 23, 24, 31, 33, 48, 768, 1541]
NS = [1, 2, 3, 4, 5, 7, 64, 1001]


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("k", KS)
def test_row_times_transposed_weight(threads, n_threads, k):
    threads(n_threads)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((1, k)).astype(np.float32)
    for n in NS:
        w = rng.standard_normal((n, k)).astype(np.float32)
        got = ops.matmul(rc.tensor(x), rc.tensor(w).T).numpy()
        _check(got, _want(x, w.T), k)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("m,k", [(1, 5), (3, 17), (4, 768), (1001, 37), (3001, 100)])
def test_matrix_times_column(threads, n_threads, m, k):
    threads(n_threads)
    rng = np.random.default_rng(m + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    x = rng.standard_normal((k, 1)).astype(np.float32)
    _check(ops.matmul(rc.tensor(a), rc.tensor(x)).numpy(), _want(a, x), k)


@pytest.mark.parametrize("n_threads", [1, 2])
def test_strided_operands(threads, n_threads):
    threads(n_threads)
    rng = np.random.default_rng(5)
    n, k = 1003, 131
    wide = rng.standard_normal((n, k + 9)).astype(np.float32)  # rows of W longer than k
    cols = rng.standard_normal((k, 3)).astype(np.float32)  # x a column: element stride 3
    x = cols[:, 1:2].T
    w = wide[:, 4 : 4 + k]
    tx = rc.tensor(cols)[:, 1:2].T
    tw = rc.tensor(wide)[:, 4 : 4 + k]
    _check(ops.matmul(tx, tw.T).numpy(), _want(x, w.T), k)
    # W @ x with W's rows longer than k and x a strided column of a wider matrix
    xc = rc.tensor(cols)[:, 1:2]  # (k, 1) with row stride 3
    _check(ops.matmul(tw, xc).numpy(), _want(w, cols[:, 1:2]), k)
    # a batch of products, each its own W (batch axes not folded into rows)
    ws = rng.standard_normal((3, 70, k)).astype(np.float32)
    xs = rng.standard_normal((3, 1, k)).astype(np.float32)
    got = ops.matmul(rc.tensor(xs), rc.tensor(ws).transpose(-1, -2)).numpy()
    _check(got, _want(xs, ws.swapaxes(-1, -2)), k)


def test_same_bits_for_every_thread_count(threads):
    rng = np.random.default_rng(9)
    k, n = 777, 3001  # 9 MB of W: several tasks per thread, n % 4 rows at the end
    x = rng.standard_normal((1, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    outs = []
    for t in (1, 2, 3):
        threads(t)
        outs.append(ops.matmul(rc.tensor(x), rc.tensor(w).T).numpy())
    _check(outs[0], _want(x, w.T), k)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_same_bits_with_adjacent_rows(threads, monkeypatch):
    # The kernel groups rows a quarter of a task apart; RECURRA_GEMV_ADJACENT=1 groups
    # adjacent rows (the layout before, kept for A/B timings). A row's sum does not depend
    # on its group, nor on whether it is read alone (the rows left over): same bits.
    threads(2)
    rng = np.random.default_rng(10)
    x = rng.standard_normal((1, 777)).astype(np.float32)
    for n in (7, 1001, 3001):  # one task with rows left over; several tasks of the pool
        w = rng.standard_normal((n, 777)).astype(np.float32)
        far = ops.matmul(rc.tensor(x), rc.tensor(w).T).numpy()
        monkeypatch.setenv("RECURRA_GEMV_ADJACENT", "1")
        adjacent = ops.matmul(rc.tensor(x), rc.tensor(w).T).numpy()
        monkeypatch.delenv("RECURRA_GEMV_ADJACENT")
        _check(far, _want(x, w.T), 777)
        np.testing.assert_array_equal(far, adjacent)


def test_graph_step_product(threads):
    # As in a token step: an explicit graph, x bound per call, the weight a bound leaf.
    threads(2)
    rng = np.random.default_rng(11)
    k, n = 768, 3072
    w = rng.standard_normal((n, k)).astype(np.float32)
    g = rc.Graph()
    xi = g.input((1, k))
    wl = g.tensor((n, k))
    g.set_data(wl, w)
    y = ops.matmul(xi, wl.T)
    g.set_output(y)
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((1, k)).astype(np.float32)
        g.set_data(xi, x)
        g.compute()
        _check(g.get_data(y), _want(x, w.T), k)


def test_chain_of_products_computed_again(threads):
    # A token step's pattern: the same products in the same order, computed again and
    # again (each call records its successor's weights and offers them to the idle worker
    # for prefetching), then a weight bound to a new array (the recorded address is stale)
    # and a product of another size between them. Every result against float64.
    threads(2)
    rng = np.random.default_rng(13)
    sizes = [(1536, 768), (80, 1536), (1536, 48), (768, 1536), (5000, 768)]
    ws = [rng.standard_normal(s).astype(np.float32) * 0.05 for s in sizes]
    g = rc.Graph()
    xi = g.input((1, 768))
    leaves, h, outs = [], xi, []
    for w in ws:
        leaf = g.tensor(w.shape)
        g.set_data(leaf, w)
        leaves.append(leaf)
        if h.shape[1] != w.shape[1]:  # the 80 -> 48 step: take the first 48 columns
            h = h[:, : w.shape[1]]
        h = ops.matmul(h, leaf.T)
        outs.append(h)
        g.set_output(h)
    for step in range(4):
        if step == 2:  # a new array for the largest weight: the old one is freed
            ws[-1] = rng.standard_normal(sizes[-1]).astype(np.float32) * 0.05
            g.set_data(leaves[-1], ws[-1])
        x = rng.standard_normal((1, 768)).astype(np.float32)
        g.set_data(xi, x)
        g.compute()
        want = x.astype(np.float64)
        for w, out in zip(ws, outs):
            want = want[:, : w.shape[1]] @ w.T.astype(np.float64)
            _check(g.get_data(out), want, w.shape[1])
        _check(ops.matmul(rc.tensor(x), rc.tensor(ws[0]).T).numpy(), _want(x, ws[0].T), 768)

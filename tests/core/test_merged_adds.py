"""Gradient adds the CPU plan runs merged into their neighbours (see Scatter and RowsAdd in
packages/core/csrc/schedule.h): the same values, without the intermediate tensors."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(13)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _ran(prof: rc.Profile, op: str) -> list[str]:
    """The by-shape profile keys of op `op` that ran."""
    return [o.key for o in prof.ops if o.key.split(" ")[0] == op]


def test_a_slice_used_twice_is_summed_inside_the_scatter():
    # The Mamba-2 x: one piece of a projection read twice (the scan and the D skip), its
    # gradient add(g1, g2) a piece of the projection's gradient.
    x = randn(3, 5, 11)
    r1, r2, r3 = randn(3, 5, 4), randn(3, 5, 4), randn(3, 5, 7)
    p = rc.param(x)
    a, b = p[:, :, :4], p[:, :, 4:]
    loss = (a * rc.tensor(r1)).sum() + (a * rc.tensor(r2)).sum() + (b * rc.tensor(r3)).sum()
    with rc.profile(by_shape=True) as prof:
        loss.backward()
        got = p.grad.numpy()
    # float32 r1 + r2 is exactly what the add computed
    np.testing.assert_array_equal(got, np.concatenate([r1 + r2, r3], axis=-1))
    assert _ran(prof, "scatter"), prof.table()
    assert not [k for k in _ran(prof, "add") if k.startswith("add (3, 5, 4), (3, 5, 4)")], (
        prof.table()
    )


def _tied(v: int, d: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, rc.Profile]:
    """A tied embedding: rows of W looked up at idx, and W.T as an output projection.
    Returns (W's gradient, its float64 reference, the profile of the backward)."""
    w, h = randn(v, d), randn(*idx.shape, d)
    r1, r2 = randn(*idx.shape, d), randn(*idx.shape, v)
    wt = rc.param(w)
    emb = ops.get_rows(wt, idx)
    logits = ops.matmul(rc.tensor(h), wt.T)
    loss = (emb * rc.tensor(r1)).sum() + (logits * rc.tensor(r2)).sum()
    with rc.profile(by_shape=True) as prof:
        loss.backward()
        got = wt.grad.numpy()
    want = r2.reshape(-1, v).T.astype(np.float64) @ h.reshape(-1, d).astype(np.float64)
    np.add.at(want, idx.reshape(-1), r1.reshape(-1, d).astype(np.float64))
    return got, want, prof


@pytest.mark.parametrize(
    "v,d,idx",
    [
        (17, 19, [[3, 0, 3, 16], [3, 5, 0, 1]]),  # repeats, odd sizes
        (5, 1, [[4]]),
        (40, 33, [list(range(40))]),  # every row
    ],
    ids=str,
)
def test_tied_embedding_gradient_adds_rows_into_the_products(v, d, idx):
    idx = np.array(idx, np.int32)
    got, want, prof = _tied(v, d, idx)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert _ran(prof, "add_rows_back"), prof.table()
    assert not _ran(prof, "get_rows_back"), prof.table()  # no zeroed (V, D) scatter
    assert not [k for k in _ran(prof, "add") if f"({v}, {d})" in k], prof.table()


def test_rows_add_over_a_kept_tensor_copies_it_first():
    # add(A, get_rows_back(g, idx)) with A a leaf (kept): written into a new tensor, A
    # untouched; each row's sum taken in index order, then added (bit for bit).
    v, d = 9, 37
    idx = np.array([[2, 7, 2], [2, 0, 7]], np.int32)
    a, g = randn(v, d), randn(2, 3, d)
    at = rc.tensor(a)
    want_rows = np.zeros((v, d), np.float32)
    for i, row in zip(idx.reshape(-1), g.reshape(-1, d)):
        want_rows[i] += row
    results = []
    old = rc.get_num_threads()
    try:
        for threads in (1, 2, 3):
            rc.set_num_threads(threads)
            with rc.profile() as prof:
                out = ops.add(at, ops.apply("get_rows_back", [g, idx], ip=(v,))).numpy()
            assert _ran(prof, "add_rows_back"), prof.table()
            results.append(out)
    finally:
        rc.set_num_threads(old)
    np.testing.assert_array_equal(results[0], a + want_rows)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])
    np.testing.assert_array_equal(at.numpy(), a)


def test_rows_add_refuses_an_index_out_of_range():
    g, idx = randn(2, 4), np.array([1, 9], np.int32)
    with pytest.raises(ValueError, match="get_rows_back: index 9"):
        ops.add(rc.tensor(randn(5, 4)), ops.apply("get_rows_back", [g, idx], ip=(5,))).numpy()


def _mixer_grad(refused: list[str]) -> tuple[np.ndarray, int]:
    """The gradient of a Mamba-2-like projection split into z | xBC | dt, z gating the norm
    and xBC through the conv (graph API), and the plan's n_redirected."""
    from gradcheck import cpu_refuses

    b, t, di, cd, nh = 2, 37, 40, 52, 4
    rng = np.random.default_rng(5)
    with cpu_refuses(*refused):
        g = rc.Graph()
        proj = g.param((b, t, di + cd + nh))
        y, w, nw, d = g.input((b, t, di)), g.input((cd, 4)), g.input((di,)), g.input((nh,))
        r1, r2, r3 = g.input((b, t, di)), g.input((b, t, cd)), g.input((b, t, nh))
        xc = ops.causal_conv_silu(proj[:, :, di : di + cd], w)
        out = ops.gated_rms_norm(y, proj[:, :, :di], nw, 1e-5, di, x=xc[:, :, :di], d=d)
        terms = [ops.mul(out, r1), ops.mul(xc, r2), ops.mul(proj[:, :, di + cd :], r3)]
        loss = ops.apply("sum_to", [terms[0]], ip=())
        for term in terms[1:]:
            loss = ops.add(loss, ops.apply("sum_to", [term], ip=()))
        g.set_loss(loss)
        g.build_backward(loss)
        for leaf in (proj, y, w, nw, d, r1, r2, r3):
            g.set_data(leaf, rng.standard_normal(leaf.shape).astype(np.float32))
        g.compute()
        return proj.grad.numpy(), int(g.memory()["n_redirected"])


def test_norm_and_conv_write_their_pieces_into_the_projection_gradient():
    # gated_rms_norm_back's dz and causal_conv_silu_back's dx go straight into their windows
    # of the projection's gradient; the decomposed ops (no such kernels) give the reference.
    got, redirected = _mixer_grad([])
    want, none = _mixer_grad(["gated_rms_norm", "causal_conv_silu"])
    assert (redirected, none) == (2, 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _scan_norm_grads(refused: list[str]) -> tuple[list[np.ndarray], int]:
    """Gradients of a scan whose y feeds the gated norm (Mamba-2's order), graph API, and
    the plan's n_redirected."""
    from gradcheck import cpu_refuses

    rng = np.random.default_rng(9)
    shapes = {
        "x": (2, 7, 3, 4),
        "dt": (2, 7, 3),
        "b": (2, 7, 1, 5),
        "c": (2, 7, 1, 5),
        "z": (2, 7, 12),
    }
    with cpu_refuses(*refused):
        g = rc.Graph()
        p = {k: g.param(s) for k, s in shapes.items()}
        s0, a, w = g.input((2, 3, 4, 5)), g.input((3, 1)), g.input((12,))
        ids, r = g.input((2,), "int32"), g.input((2, 7, 12))
        y, _ = ops.ssm_scan(s0, p["x"], p["dt"], a, p["b"], p["c"], ids)
        out = ops.gated_rms_norm(y.reshape(2, 7, 12), p["z"], w, 1e-5, 12)
        loss = ops.apply("sum_to", [ops.mul(out, r)], ip=())
        g.set_loss(loss)
        g.build_backward(loss)
        for leaf in (*p.values(), s0, w, r):
            g.set_data(leaf, rng.standard_normal(leaf.shape).astype(np.float32))
        g.set_data(a, -np.abs(rng.standard_normal((3, 1))).astype(np.float32))
        g.set_data(ids, np.arange(2, dtype=np.int32))
        g.compute()
        return [t.grad.numpy() for t in p.values()], int(g.memory()["n_redirected"])


def test_norm_writes_its_dy_into_the_scans_padded_gradient():
    # The scan's packed result's gradient is y's gradient zero-padded (slice_grad): the
    # norm's backward writes dy into it, the slice_grad only the zeros.
    got, redirected = _scan_norm_grads([])
    want, none = _scan_norm_grads(["gated_rms_norm"])
    assert (redirected, none) == (1, 0)
    for u, v in zip(got, want):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)

"""ssm_conv and ssm_scan: forward against float64 numpy references, gradients against
finite differences, thread-count independence, and error handling.

Tolerances: forward results are float32 sums of a few hundred terms at most, compared with
rtol 1e-4 / atol 1e-5 (relative to values of order 1); gradients use the finite-difference
helper's defaults (rtol 1e-2, atol 1e-3), which float32 rounding stays well inside while a
wrong term of a gradient does not.
"""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_grads
from reference_ssm import ssm_conv_ref, ssm_scan_ref, ssm_scan_vjp_ref

import recurra as rc
from recurra import ops

RNG = np.random.default_rng(20261129)


def f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32)


@pytest.fixture
def restore_threads():
    n = rc.get_num_threads()
    yield
    rc.set_num_threads(n)


# ---- ssm_conv --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n_seqs,d_inner,d_conv,n_tok",
    [(2, 37, 4, 19), (1, 16, 4, 64), (3, 5, 1, 7), (2, 33, 3, 1), (1, 48, 4, 131), (2, 17, 2, 40)],
)
def test_ssm_conv_forward(n_seqs, d_inner, d_conv, n_tok):
    sx = f32(RNG.standard_normal((n_seqs, d_inner, d_conv - 1 + n_tok)))
    c = f32(RNG.standard_normal((d_inner, d_conv)))
    y = ops.ssm_conv(rc.tensor(sx), rc.tensor(c)).numpy()
    assert y.shape == (n_seqs, n_tok, d_inner)
    np.testing.assert_allclose(y, ssm_conv_ref(sx, c), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_seqs,d_inner,d_conv,n_tok", [(2, 3, 4, 5), (1, 17, 2, 3), (2, 2, 1, 4)])
def test_ssm_conv_grads(n_seqs, d_inner, d_conv, n_tok):
    sx = RNG.standard_normal((n_seqs, d_inner, d_conv - 1 + n_tok))
    c = RNG.standard_normal((d_inner, d_conv))
    check_grads(lambda a, b: ops.ssm_conv(a, b), [sx, c])


def test_ssm_conv_grad_large_tiles():
    # Exercises the 16x16 transposes of the backward (full channel blocks, > 64 positions)
    # against the closed-form gradient, checked in float64.
    sx = f32(RNG.standard_normal((2, 32, 3 + 100)))
    c = f32(RNG.standard_normal((32, 4)))
    dy = f32(RNG.standard_normal((2, 100, 32)))
    ps, pc = rc.param(sx), rc.param(c)
    y = ops.ssm_conv(ps, pc)
    (y * rc.tensor(dy)).sum().backward()
    d_sx = np.zeros(sx.shape)
    for k in range(4):
        d_sx[:, :, k : k + 100] += np.transpose(dy, (0, 2, 1)) * c[:, k][None, :, None]
    d_c = np.stack([np.einsum("stc,sct->c", dy, sx[:, :, k : k + 100]) for k in range(4)], axis=1)
    np.testing.assert_allclose(ps.grad.numpy(), d_sx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pc.grad.numpy(), d_c, rtol=1e-4, atol=1e-3)


def test_ssm_conv_errors():
    with pytest.raises(ValueError):
        ops.ssm_conv(np.zeros((2, 4, 6), np.float32), np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError):
        ops.ssm_conv(np.zeros((2, 4, 2), np.float32), np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError):
        ops.ssm_conv(np.zeros((4, 6), np.float32), np.zeros((4, 4), np.float32))
    with pytest.raises(TypeError):
        ops.ssm_conv(np.zeros((2, 4, 6), np.int32), np.zeros((4, 4), np.float32))


# ---- ssm_scan --------------------------------------------------------------------------


def scan_inputs(
    n_seqs,
    n_tok,
    n_head,
    head_dim,
    d_state,
    n_group,
    *,
    per_state,
    n_rows=None,
    ids=None,
    dt_scale=1.0,
    rng=RNG,
):
    n_rows = n_seqs + 1 if n_rows is None else n_rows
    s = rng.standard_normal((n_rows, n_head, head_dim, d_state))
    x = rng.standard_normal((n_seqs, n_tok, n_head, head_dim))
    dt = rng.standard_normal((n_seqs, n_tok, n_head)) * dt_scale - 1.0
    A = -np.exp(rng.uniform(-1.0, 1.5, (n_head, d_state if per_state else 1)))
    B = rng.standard_normal((n_seqs, n_tok, n_group, d_state))
    C = rng.standard_normal((n_seqs, n_tok, n_group, d_state))
    if ids is None:
        ids = rng.permutation(n_rows)[:n_seqs]
    return [s, x, dt, A, B, C, np.asarray(ids, np.int32)]


def run_scan(args):
    ts = [rc.tensor(f32(a)) if a.dtype.kind == "f" else a for a in args]
    y, st = ops.ssm_scan(*ts)
    return y.numpy(), st.numpy()


SCAN_LAYOUTS = [
    # n_seqs, n_tok, n_head, head_dim, d_state, n_group, per_state
    (2, 9, 4, 16, 128, 2, False),  # Mamba-2
    (2, 7, 3, 64, 256, 1, False),  # Mamba-2, d_state 256, n_head not a power of two
    (3, 5, 6, 17, 17, 3, False),  # odd head_dim and d_state, 3 groups
    (2, 6, 5, 5, 1, 5, False),  # d_state 1
    (2, 8, 37, 1, 16, 1, True),  # Mamba-1 (head_dim 1), a partial 16-head block
    (2, 6, 6, 1, 17, 3, True),  # Mamba-1 layout, groups of 2 heads, d_state 17
    (2, 5, 4, 1, 16, 2, False),  # head_dim 1 with one decay per head
    (2, 6, 4, 3, 16, 2, True),  # head_dim 3 with one decay per state
    (3, 1, 8, 8, 16, 4, False),  # one-token sequences (the generation step kernel)
    (2, 1, 3, 5, 17, 1, True),  # one token, one decay per state, d_state past 16
    (2, 1, 150, 1, 16, 1, True),  # one token of Mamba-1: 300 heads in tasks of 64
    (1, 1, 70, 1, 17, 2, True),  # one token, head_dim 1, d_state 17, 2 groups
    (2, 1, 9, 1, 16, 3, False),  # one token, head_dim 1, one decay per head
    (1, 1, 2100, 1, 16, 1, True),  # one token of Mamba-1 split over the pool (> 32K states)
    (3, 1, 12, 1, 16, 4, True),  # one token, d_state 16: groups of 3 heads, 36 = 4 x 8 + 4
    (2, 1, 3, 5, 24, 3, False),  # one token, one decay per head, d_state 16 + 8, 30 rows
    (1, 1, 5, 72, 48, 1, False),  # one token of Mamba-2 split over the pool, 72 rows a head
    (1, 40, 2, 32, 33, 1, True),  # 40 tokens, per-state decay in the rows kernel
]


@pytest.mark.parametrize("layout", SCAN_LAYOUTS)
def test_ssm_scan_forward(layout):
    args = scan_inputs(*layout[:6], per_state=layout[6])
    y, st = run_scan(args)
    y_ref, st_ref = ssm_scan_ref(*args)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=2e-5 * np.abs(y_ref).max())
    np.testing.assert_allclose(st, st_ref, rtol=1e-4, atol=2e-5 * np.abs(st_ref).max())


@pytest.mark.parametrize("per_state", [False, True])
@pytest.mark.parametrize("head_dim", [1, 8])
def test_ssm_scan_strong_decay_and_long_sequence(per_state, head_dim):
    # Decays down to exp(-80) per token and 300 tokens: exercises the renormalisation of
    # the scaled state, underflowing decay factors and the checkpoint segments.
    args = scan_inputs(2, 300, 4, head_dim, 16, 1, per_state=per_state, dt_scale=3.0)
    args[2][0, 5:9] = 5.0  # softplus ~ 5 with A down to -16: a ~ exp(-80)
    args[3] *= np.where(np.arange(args[3].size).reshape(args[3].shape) % 2 == 0, 1.0, 4.0)
    y, st = run_scan(args)
    y_ref, st_ref = ssm_scan_ref(*args)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=5e-5 * np.abs(y_ref).max())
    np.testing.assert_allclose(st, st_ref, rtol=1e-4, atol=5e-5 * np.abs(st_ref).max())


def test_ssm_scan_one_token_underflowing_decays():
    # One token of Mamba-1's shape (head_dim 1, d_state 16; its own AVX2 kernel) with
    # decays down to exp(-270), past float32's range (exactly 0 there), and mild ones.
    args = scan_inputs(2, 1, 40, 1, 16, 1, per_state=True)
    args[2][:, :, ::3] = 12.0  # softplus ~ 12
    args[3][::2] *= 5.0  # A down to -22
    assert (np.log1p(np.exp(args[2])).max() * args[3].min()) < -200
    y, st = run_scan(args)
    y_ref, st_ref = ssm_scan_ref(*args)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=2e-5 * np.abs(y_ref).max())
    np.testing.assert_allclose(st, st_ref, rtol=1e-4, atol=2e-5 * np.abs(st_ref).max())


def test_ssm_scan_large_dt_and_growth():
    # dt > 20 (softplus is the identity) and a positive A (growing state).
    args = scan_inputs(1, 12, 2, 4, 8, 1, per_state=False)
    args[2][0, 3] = 25.0
    args[3][:] = np.array([[-0.3], [0.05]])
    args[2] = np.clip(args[2], -5, None)
    y, st = run_scan(args)
    y_ref, st_ref = ssm_scan_ref(*args)
    np.testing.assert_allclose(y, y_ref, rtol=2e-4, atol=1e-5 * np.abs(y_ref).max())
    np.testing.assert_allclose(st, st_ref, rtol=2e-4, atol=1e-5 * np.abs(st_ref).max())


def _scan_fn(ids):
    def fn(s, x, dt, A, B, C):
        return ops.ssm_scan(s, x, dt, A, B, C, ids)

    return fn


GRAD_LAYOUTS = [
    # n_seqs, n_tok, n_head, head_dim, d_state, n_group, per_state, n_rows, ids
    (2, 4, 4, 3, 5, 2, False, 3, [2, 0]),  # Mamba-2 style, permuted ids, spare row 1
    (2, 3, 3, 2, 4, 1, True, 2, [1, 1]),  # per-state decay, two sequences share row 1
    (2, 4, 5, 1, 3, 1, True, 3, [0, 2]),  # Mamba-1 (head_dim 1)
    (1, 3, 4, 1, 2, 2, False, 1, [0]),  # head_dim 1, one decay per head, 2 groups
    (2, 1, 2, 2, 1, 2, False, 2, [1, 0]),  # one token, d_state 1
]


@pytest.mark.parametrize("layout", GRAD_LAYOUTS)
def test_ssm_scan_grads(layout):
    *dims, per_state, n_rows, ids = layout
    args = scan_inputs(*dims, per_state=per_state, n_rows=n_rows, ids=ids)
    args[2] = args[2] * 0.5  # keep softplus away from its flat region: larger gradients
    check_grads(_scan_fn(args[6]), args[:6], rtol=1e-2, atol=2e-3)


def test_ssm_scan_grad_d_state_16_and_17():
    for d_state, head_dim, per_state in [(16, 2, False), (17, 1, True)]:
        args = scan_inputs(1, 3, 2, head_dim, d_state, 1, per_state=per_state, n_rows=1, ids=[0])
        check_grads(_scan_fn(args[6]), args[:6], rtol=1e-2, atol=2e-3)


def _grads(args, threads, only_state=False):
    rc.set_num_threads(threads)
    ps = [rc.param(f32(a)) for a in args[:6]]
    y, st = ops.ssm_scan(*ps, args[6])
    r1 = rc.tensor(f32(np.random.default_rng(7).standard_normal(y.shape)))
    r2 = rc.tensor(f32(np.random.default_rng(8).standard_normal(st.shape)))
    loss = (st * r2).sum() if only_state else (y * r1).sum() + (st * r2).sum()
    loss.backward()
    return [y.numpy(), st.numpy()] + [p.grad.numpy() for p in ps]


@pytest.mark.parametrize(
    "layout",
    [(3, 70, 8, 16, 32, 2, False), (2, 70, 40, 1, 16, 1, True), (2, 40, 4, 24, 20, 1, True)],
)
def test_ssm_scan_threads_agree(layout, restore_threads):
    args = scan_inputs(*layout[:6], per_state=layout[6])
    one = _grads(args, 1)
    two = _grads(args, 2)
    for a, b in zip(one, two):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * np.abs(a).max())


def _assert_grads_match_vjp(args):
    """The op's gradients (on all threads) for random output and final-state cotangents
    against the float64 reverse-mode reference that keeps every state."""
    got = _grads(args, rc.get_num_threads())
    gy = np.random.default_rng(7).standard_normal(got[0].shape)
    gs = np.random.default_rng(8).standard_normal(got[1].shape)
    want = ssm_scan_vjp_ref(args, f32(gy).astype(np.float64), f32(gs).astype(np.float64))
    for name, g, w in zip(["ds", "dx", "ddt", "dA", "dB", "dC"], got[2:], want):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=3e-5 * np.abs(w).max(), err_msg=name)


@pytest.mark.parametrize("per_state,d_state", [(False, 128), (True, 20)])
def test_ssm_scan_backward_mamba2_size_matches_float64_vjp(per_state, d_state):
    # Mamba-2's head size (64 x 128 states): the rows backward's full-size units (the
    # 8-lane sweeps without AVX-512), two tokens per sweep, anchors past the first K = 64
    # tokens and renormalisations (dt up to ~5 with A down to -e^1.5: decays to e^-22 a token),
    # against a float64 reverse-mode reference that keeps every state.
    args = scan_inputs(2, 150, 3, 64, d_state, 1, per_state=per_state, n_rows=2, ids=[1, 0])
    args[2][:, 40:44] = 5.0
    _assert_grads_match_vjp(args)


@pytest.mark.parametrize(
    "head_dim,d_state,n_head,n_group",
    [
        (20, 48, 6, 1),  # whole 16-float rows (AVX-512), channels 16 + 4
        (24, 40, 8, 2),  # d_state 40 = 2 x 16 + 8: the 8-float rows with a tail, 2 groups
        (64, 16, 6, 1),  # d_state 16: one 16-float row per state row
    ],
)
def test_ssm_scan_backward_rows_per_head_remainders_match_float64_vjp(
    head_dim, d_state, n_head, n_group
):
    # The per-token steps of the rows backward with one decay per head (ssm_scan/back_rows.cpp):
    # whole 16-float rows where d_state is a multiple of 16, 8-float rows with a tail
    # otherwise; channel counts that are not a multiple of 16; anchors past K = 64 tokens and
    # renormalisations (strong decays at tokens 40..43). With 2 sequences the heads of a
    # group are split 4 ways (op.cpp, n_splits), so a task adds several heads into its dB, dC.
    args = scan_inputs(2, 150, n_head, head_dim, d_state, n_group, per_state=False, n_rows=2)
    args[2][:, 40:44] = 5.0
    _assert_grads_match_vjp(args)


def test_ssm_scan_backward_matches_float64_gradient():
    # The analytic backward against a float64 gradient of the reference (central differences
    # in float64, so the tolerance can be much tighter than gradcheck's float32 one).
    args = scan_inputs(2, 6, 4, 3, 4, 2, per_state=False, n_rows=3, ids=[2, 0])
    r1 = np.random.default_rng(3).standard_normal(args[1].shape)
    r2 = np.random.default_rng(4).standard_normal((2, 4, 3, 4))

    def loss64(vals):
        y, st = ssm_scan_ref(*vals, args[6])
        return float(np.sum(y * r1) + np.sum(st * r2))

    ps = [rc.param(f32(a)) for a in args[:6]]
    y, st = ops.ssm_scan(*ps, args[6])
    ((y * rc.tensor(f32(r1))).sum() + (st * rc.tensor(f32(r2))).sum()).backward()
    vals = [a.astype(np.float64) for a in args[:6]]
    vals = [f32(v).astype(np.float64) for v in vals]
    for k in range(6):
        num = np.zeros(vals[k].shape)
        flat = vals[k].reshape(-1)
        for j in range(flat.size):
            o = flat[j]
            flat[j] = o + 1e-6
            up = loss64(vals)
            flat[j] = o - 1e-6
            down = loss64(vals)
            flat[j] = o
            num.reshape(-1)[j] = (up - down) / 2e-6
        got = ps[k].grad.numpy()
        np.testing.assert_allclose(
            got, num, rtol=2e-4, atol=2e-4 * np.abs(num).max(), err_msg=f"input {k}"
        )


@pytest.mark.parametrize(
    "n_seqs,n_tok,n_head,d_state,n_group,n_rows,ids",
    [
        (2, 200, 20, 16, 1, 3, [2, 0]),  # 7 segments of 32 tokens, the last one partial
        (1, 64, 5, 17, 5, 1, [0]),  # exactly two segments, one head per group
        (3, 33, 16, 3, 2, 3, [1, 2, 0]),  # a one-token last segment
        (2, 5, 3, 16, 1, 2, [1, 0]),  # shorter than one segment
    ],
)
def test_ssm_scan_saved_checkpoints_match_recompute(
    n_seqs, n_tok, n_head, d_state, n_group, n_rows, ids, monkeypatch
):
    # Mamba-1 on the CPU: with a gradient ahead, the forward saves the state every K tokens
    # and the backward reads them instead of recomputing; without, it recomputes. Both must
    # give the same gradients (the same float32 arithmetic in either order).
    from recurra.ops import _ssm

    args = scan_inputs(
        n_seqs, n_tok, n_head, 1, d_state, n_group, per_state=True, n_rows=n_rows, ids=ids
    )
    xs, ss = args[1].shape, args[0].shape
    assert _ssm._wants_checkpoints(xs, ss, args[3], [rc.param(f32(args[1]))])
    saved = _grads(args, rc.get_num_threads())
    monkeypatch.setattr(_ssm, "_wants_checkpoints", lambda *a: False)
    recomputed = _grads(args, rc.get_num_threads())
    for a, b in zip(recomputed, saved):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * np.abs(a).max())
    y, st = ssm_scan_ref(*args)
    np.testing.assert_allclose(saved[0], y, rtol=1e-4, atol=1e-4 * np.abs(y).max())
    np.testing.assert_allclose(saved[1], st, rtol=1e-4, atol=1e-4 * np.abs(st).max())


def test_ssm_scan_checkpoints_only_where_a_gradient_follows_and_the_cpu_reads_them():
    from recurra.ops import _ssm

    x = np.zeros((2, 100, 4, 1), np.float32)
    s = np.zeros((2, 4, 1, 16), np.float32)
    a1, a_head = np.zeros((4, 16), np.float32), np.zeros((4, 1), np.float32)
    assert not _ssm._wants_checkpoints(x.shape, s.shape, a1, [x])  # nothing requires a gradient
    p = rc.param(x)
    assert _ssm._wants_checkpoints(x.shape, s.shape, a1, [p])
    with rc.no_grad():
        assert not _ssm._wants_checkpoints(x.shape, s.shape, a1, [p])
    x2 = np.zeros((2, 100, 4, 2), np.float32)  # head_dim 2, one decay per state: no layout
    assert not _ssm._wants_checkpoints(x2.shape, (2, 4, 2, 16), a1, [rc.param(x2)])
    # One decay per head: asked for (a device's chunked backward reads them), but the CPU
    # backward would not, so on the CPU the scheduler builds the scan without them.
    assert _ssm._wants_checkpoints(x2.shape, (2, 4, 2, 16), a_head, [rc.param(x2)])
    flag = ops.op_codes()["SSM_SCAN_CHECKPOINTS_AUTO"]
    for head_dim, a, kept in ((1, a1, True), (2, a_head, False)):
        g = rc.Graph()
        srcs = [g.input((2, 4, head_dim, 16)), g.input((2, 100, 4, head_dim))]
        srcs += [g.input((2, 100, 4)), g.input(a.shape), g.input((2, 100, 1, 16))]
        srcs += [g.input((2, 100, 1, 16)), g.input((2,), "int32")]
        out = g.apply("ssm_scan", srcs, (flag,), ())
        packed = 2 * 100 * 4 * head_dim + 2 * 4 * head_dim * 16
        info = g._g.info(out.id)
        assert info["op"] == "ssm_scan"
        assert (info["shape"][0] > packed) == kept, head_dim


@pytest.mark.parametrize("n_tok", [1, 64, 150])
def test_ssm_scan_mamba2_checkpoints_are_the_chunk_states(n_tok):
    # One decay per head, asked to save checkpoints (ip 1, what the Python API does when a
    # gradient follows on another device): the packed result gains the state entering each
    # 64-token chunk, (n_seqs, n_head, ceil(T / 64), head_dim, d_state), equal to the final
    # state of the scan cut at that token (float64 reference); y and the final states are
    # unchanged, and the backward given the checkpoints (a 9th source) is unchanged too.
    args = scan_inputs(2, n_tok, 3, 5, 17, 1, per_state=False, n_rows=3, ids=[2, 0])
    srcs = [f32(a) if a.dtype.kind == "f" else a for a in args]
    plain = rc.ops.apply("ssm_scan", [rc.tensor(a) for a in srcs]).numpy()
    saved = rc.ops.apply("ssm_scan", [rc.tensor(a) for a in srcs], ip=(1,)).numpy()
    nc = -(-n_tok // 64)
    assert saved.size == plain.size + 2 * 3 * nc * 5 * 17
    np.testing.assert_array_equal(saved[: plain.size], plain)
    ck = saved[plain.size :].reshape(2, 3, nc, 5, 17)
    s, x, dt, A, B, C, ids = args
    for c in range(nc):
        if c == 0:
            want = s[ids]
        else:
            t = 64 * c
            want = ssm_scan_ref(s, x[:, :t], dt[:, :t], A, B[:, :t], C[:, :t], ids)[1]
        np.testing.assert_allclose(ck[:, :, c], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    grad = f32(RNG.standard_normal(saved.size))

    def back(*a):
        return rc.ops.apply("ssm_scan_back", [rc.tensor(v) for v in a]).numpy()

    np.testing.assert_array_equal(back(grad, *srcs, saved), back(grad[: plain.size], *srcs))


def test_ssm_scan_checkpoints_refused_for_per_state_decay_rows():
    args = scan_inputs(1, 8, 2, 3, 16, 1, per_state=True)
    srcs = [rc.tensor(f32(a) if a.dtype.kind == "f" else a) for a in args]
    with pytest.raises(ValueError, match="one decay per head"):
        rc.ops.apply("ssm_scan", srcs, ip=(1,))


def test_ssm_scan_only_state_gradient():
    args = scan_inputs(2, 5, 4, 4, 8, 1, per_state=False)
    g = _grads(args, rc.get_num_threads(), only_state=True)
    assert np.abs(g[3]).max() > 0  # dx is reached through the state alone


def test_ssm_scan_accepts_int32_tensor_ids():
    args = scan_inputs(2, 3, 2, 4, 8, 1, per_state=False)
    ts = [rc.tensor(f32(a)) for a in args[:6]]
    y, st = ops.ssm_scan(*ts, rc.tensor(args[6]))
    y_ref, st_ref = ssm_scan_ref(*args)
    np.testing.assert_allclose(y.numpy(), y_ref, rtol=1e-4, atol=1e-5 * np.abs(y_ref).max())
    np.testing.assert_allclose(st.numpy(), st_ref, rtol=1e-4, atol=1e-5 * np.abs(st_ref).max())


def _bad(args, k, shape):
    out = list(args)
    out[k] = np.zeros(shape, np.float32)
    return out


def test_ssm_scan_errors():
    args = [
        f32(a) if a.dtype.kind == "f" else a for a in scan_inputs(2, 3, 4, 2, 8, 2, per_state=False)
    ]
    bad = [
        _bad(args, 0, (1, 4, 2, 8)),  # fewer state rows than sequences
        _bad(args, 0, (3, 4, 3, 8)),  # head_dim mismatch
        _bad(args, 1, (2, 3, 4)),  # x not 4-D
        _bad(args, 2, (2, 3, 5)),  # dt n_head mismatch
        _bad(args, 3, (4, 3)),  # A neither (H, N) nor (H, 1)
        _bad(args, 4, (2, 3, 3, 8)),  # n_head % n_group != 0 (B and C differ too)
        _bad(args, 5, (2, 3, 2, 7)),  # C differs from B
    ]
    for b in bad:
        with pytest.raises(ValueError):
            ops.ssm_scan(*b)
    with pytest.raises(ValueError):
        ops.ssm_scan(*args[:6], np.array([0, 1, 2], np.int32))  # wrong number of ids
    with pytest.raises(TypeError):
        ops.ssm_scan(*args[:6], np.array([0.0, 1.0]))
    with pytest.raises(TypeError):
        ops.ssm_scan(rc.tensor(args[0].astype(np.int32)), *args[1:])
    y, _ = ops.ssm_scan(*args[:6], np.array([0, 3], np.int32))  # row 3 of 3
    with pytest.raises(ValueError, match="ids"):
        y.numpy()
    y, _ = ops.ssm_scan(*args[:6], np.array([-1, 0], np.int32))
    with pytest.raises(ValueError, match="ids"):
        y.numpy()


@pytest.mark.parametrize(
    "layout",
    [
        (2, 1, 150, 1, 16, 1, True),  # Mamba-1's step
        (3, 1, 4, 16, 32, 2, False),  # Mamba-2's step
        (2, 1, 3, 5, 17, 1, True),
    ],
)
def test_ssm_scan_state_in_place(layout):
    # RECURRA_SSM_SCAN_STATE_IN_PLACE: y alone as the result, the final states written into
    # s's rows ids[i] (the other rows untouched), against the reference.
    args = scan_inputs(*layout[:6], per_state=layout[6], n_rows=layout[0] + 2)
    y_ref, st_ref = ssm_scan_ref(*args)
    flag = rc.ops.op_codes()["SSM_SCAN_STATE_IN_PLACE"]
    g = rc.Graph()
    leaves = []
    for a in args:
        t = g.input(a.shape, "int32" if a.dtype.kind == "i" else "float32")
        g.set_data(t, a)
        leaves.append(t)
    y = g.apply("ssm_scan", leaves, (flag,), ())
    g.set_output(y)
    for _ in range(2):  # twice: the second step starts from the first one's states
        g.compute()
        s_now = g.get_data(leaves[0])
        np.testing.assert_allclose(
            g.get_data(y).reshape(y_ref.shape), y_ref, rtol=1e-4, atol=2e-5 * np.abs(y_ref).max()
        )
        ids = args[6]
        np.testing.assert_allclose(s_now[ids], st_ref, rtol=1e-4, atol=2e-5 * np.abs(st_ref).max())
        rest = np.setdiff1d(np.arange(args[0].shape[0]), ids)
        np.testing.assert_array_equal(s_now[rest], f32(args[0][rest]))
        args[0] = s_now.astype(np.float64)
        y_ref, st_ref = ssm_scan_ref(*args)


def test_ssm_scan_state_in_place_errors():
    flag = rc.ops.op_codes()["SSM_SCAN_STATE_IN_PLACE"]
    args = scan_inputs(2, 3, 4, 2, 8, 1, per_state=False)
    g = rc.Graph()
    leaves = [g.input(a.shape, "int32" if a.dtype.kind == "i" else "float32") for a in args]
    with pytest.raises(ValueError, match="one token"):
        g.apply("ssm_scan", leaves, (flag,), ())
    one = scan_inputs(2, 1, 4, 2, 8, 1, per_state=False, ids=[1, 1])
    g = rc.Graph()
    leaves = [g.input(a.shape, "int32" if a.dtype.kind == "i" else "float32") for a in one]
    for t, a in zip(leaves, one):
        g.set_data(t, a)
    with pytest.raises(ValueError, match="into a leaf only"):
        g.apply("ssm_scan", [rc.ops.exp(leaves[0]), *leaves[1:]], (flag,), ())
    y = g.apply("ssm_scan", leaves, (flag,), ())
    g.set_output(y)
    with pytest.raises(ValueError, match="distinct ids"):
        g.compute()
    # no gradient through a scan that overwrites its state
    g = rc.Graph()
    xs = g.param(one[1].shape)
    leaves = [g.input(a.shape, "int32" if a.dtype.kind == "i" else "float32") for a in one]
    y = g.apply("ssm_scan", [leaves[0], xs, *leaves[2:]], (flag,), ())
    with pytest.raises(ValueError, match="no gradient"):
        g.build_backward(rc.ops.sum(y))

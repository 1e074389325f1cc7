"""recurra.autocast: the per-op cast policy of the op spec, the cast cache of leaves, the
dtypes of forward and gradient, errors.

References are float64 numpy on the same 2-byte-rounded inputs the autocast graph sees
(ml_dtypes rounds to nearest even, as the core's cast does)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest
from gradcheck import cpu_refuses

import recurra as rc
from recurra import _core, ops
from recurra._tensor import LAZY
from recurra.ops import spec

BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(7)


def _rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _bf(a: np.ndarray) -> np.ndarray:
    """a rounded to bfloat16, as float64."""
    return np.asarray(a).astype(BF16).astype(np.float64)


# -- the policy table --------------------------------------------------------------------


def test_policy_column_of_the_op_spec() -> None:
    s = spec()
    assert s["matmul"].autocast == "lower" and s["out_prod"].autocast == "lower"
    for name in ("softmax", "log_softmax", "rms_norm", "layer_norm", "sum", "cumsum", "exp"):
        assert s[name].autocast == "float32", name
    for name in ("add", "mul", "silu", "reshape", "slice", "concat", "get_rows", "max"):
        assert s[name].autocast == "match", name
    for name in ("cast", "fill", "assign", "adamw_step", "grad_clip"):
        assert s[name].autocast == "keep", name
    for name in ("gated_rms_norm", "causal_conv_silu", "ssm_scan", "cross_entropy"):
        assert s[name].autocast == "widen" and s[name].reads_half, name
        assert s[name + "_back"].autocast == "widen" and s[name + "_back"].reads_half, name
    # every op without 2-byte kernels runs in float32 (or is never touched); those reading
    # 2-byte sources as they are are left as they are
    for name, op in s.items():
        assert op.autocast in ("lower", "float32", "widen", "match", "keep"), name
        assert (op.autocast == "widen") == op.reads_half, name
        if op.dtypes == ("float32",):
            assert op.autocast in ("float32", "widen", "keep"), name
        if op.autocast in ("lower", "match"):
            assert "bfloat16" in op.dtypes, name


# -- which dtype each node gets ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [rc.bfloat16, rc.float16])
def test_node_dtypes(dtype: rc.DType) -> None:
    x = rc.tensor(_rand(4, 8))
    w = rc.param(_rand(8, 6))
    b = rc.param(_rand(6))
    with rc.autocast(dtype):
        assert rc.autocast_dtype() == dtype and rc.is_autocast_enabled()
        y = x @ w
        assert y.dtype == dtype  # lower: the matmul runs on 2-byte sources
        assert [s.dtype for s in y._src] == [dtype, dtype]
        assert all(s._op == "cast" for s in y._src)
        z = y + b  # match: the float32 bias follows the 2-byte activation
        assert z.dtype == dtype and z._src[1]._op == "cast"
        a = ops.silu(z)
        assert a.dtype == dtype  # uniform sources stay as they are
        p = ops.softmax(a)
        assert p.dtype == rc.float32  # float32: numerically sensitive
        n = ops.rms_norm(a)
        assert n.dtype == rc.float32
        e = ops.exp(a)
        assert e.dtype == rc.float32
        s = ops.sum(a, axis=1)
        assert s.dtype == rc.float32 and s._src[0]._src[0]._op == "cast"
        f = x * 2.0  # all float32: stays float32
        assert f.dtype == rc.float32
        idx = rc.tensor(np.array([0, 2], np.int32))
        rows = ops.get_rows(w, idx)  # the int32 index is never cast
        assert rows.dtype == rc.float32 and rows._src[1].dtype == rc.int32
        h = y.to(rc.float32)  # an explicit cast is kept
        assert h.dtype == rc.float32
    assert rc.autocast_dtype() is None and not rc.is_autocast_enabled()
    assert (x @ w).dtype == rc.float32  # outside: as before
    # the values: the matmul of the rounded sources, rounded once; softmax in float32
    ref = _bf(x.numpy()) @ _bf(w.numpy()) if dtype == rc.bfloat16 else None
    if ref is not None:
        got = y.numpy().astype(np.float64)
        np.testing.assert_allclose(got, ref, rtol=2.0**-8, atol=1e-6)


def test_ops_without_half_kernels_get_float32() -> None:
    """A recurrent scan fed by a 2-byte activation gets float32 sources (cast up)."""
    T, H, N = 5, 2, 4
    xs = rc.tensor(_rand(T, H * N))
    w = rc.param(_rand(H * N, H * N) * 0.3)
    with rc.autocast():
        k = (xs @ w).reshape(T, H, N)
        assert k.dtype == rc.bfloat16
        r, v = rc.tensor(_rand(T, H, N)), rc.tensor(_rand(T, H, N))
        decay = rc.tensor(np.exp(-np.exp(_rand(T, H, N) * 0.5 - 1.0)).astype(np.float32))
        a = rc.tensor(_rand(T, H, N) * 0.1)
        bb = rc.tensor(_rand(T, H, N) * 0.1)
        st = rc.tensor(np.zeros((1, H, N, N), np.float32))
        y, _ = ops.rwkv_wkv7(r, decay, k, v, a, bb, st)
        assert y.dtype == rc.float32
        loss = ops.sum(y * y)
    assert loss.dtype == rc.float32
    loss.backward()
    assert w.grad is not None and w.grad.dtype == rc.float32
    assert np.isfinite(w.grad.numpy()).all() and np.abs(w.grad.numpy()).max() > 0


# -- gradients ---------------------------------------------------------------------------


def test_gradients_are_float32_and_match_the_rounded_reference() -> None:
    """loss = sum(softmax(silu(x @ W + b)) * t): W and b get float32 gradients equal to the
    float64 gradient of the same computation with bf16 rounding where autocast rounds."""
    xv, wv, bv, tv = _rand(6, 8), _rand(8, 5) * 0.5, _rand(5) * 0.1, _rand(6, 5)
    x, t = rc.tensor(xv), rc.tensor(tv)
    w, b = rc.param(wv), rc.param(bv)
    with rc.autocast():
        h = ops.silu(x @ w + b)
        p = ops.softmax(h)
        loss = ops.sum(p * t)
    assert h.dtype == rc.bfloat16 and p.dtype == rc.float32 and loss.dtype == rc.float32
    loss.backward()
    assert w.grad.dtype == rc.float32 and b.grad.dtype == rc.float32

    # float64 reference: forward with the roundings autocast makes
    xb, wb, bb = _bf(xv), _bf(wv), _bf(bv)
    m = _bf(xb @ wb)
    z = _bf(m + bb)
    sg = 1 / (1 + np.exp(-z))
    hh = _bf(z * sg)
    e = np.exp(hh - hh.max(1, keepdims=True))
    pp = e / e.sum(1, keepdims=True)
    assert abs(loss.item() - (pp * tv).sum()) < 1e-5 * max(1.0, abs((pp * tv).sum()))
    # backward in float64 (the gradient of a bf16 node is bf16: its error is relative 2^-8
    # per rounding; three roundings in the chain -> 2^-6 relative of the gradient's scale)
    dp = tv.astype(np.float64)
    dh = pp * (dp - (dp * pp).sum(1, keepdims=True))
    dz = dh * (sg * (1 + z * (1 - sg)))
    dw = xb.T @ dz
    db = dz.sum(0)
    scale_w, scale_b = np.abs(dw).max(), np.abs(db).max()
    np.testing.assert_allclose(w.grad.numpy(), dw, atol=2.0**-6 * scale_w)
    np.testing.assert_allclose(b.grad.numpy(), db, atol=2.0**-6 * scale_b)
    # and the gradient is not simply the float32 one's: autocast's rounding is visible
    # against float64 at 2^-6, but far from a wrong gradient (sign, factor)
    assert np.corrcoef(w.grad.numpy().ravel(), dw.ravel())[0, 1] > 0.999


def test_backward_runs_in_the_forward_dtypes() -> None:
    """In the graph API the gradient nodes of a 2-byte forward node are 2-byte, those of a
    float32 one float32, and the parameters' gradients float32."""
    g = rc.Graph()
    x = g.input((4, 8))
    w = g.param((8, 3))
    with rc.autocast():
        y = x @ w
        s = ops.softmax(y)
        loss = ops.sum(s * s)
    g.build_backward(loss)
    assert y.dtype == rc.bfloat16 and s.dtype == rc.float32
    assert w.grad is not None and w.grad.dtype == rc.float32
    nodes = [g._g.info(i) for i in range(g.n_nodes)]
    products = [n["dtype"] for n in nodes if n["op"] in ("matmul", "out_prod")]
    # the forward matmul and the backward's product (dW = x^T dy) run in bf16
    assert len(products) >= 2 and set(products) == {"bfloat16"}
    backs = [n["dtype"] for n in nodes if n["op"] == "softmax_back"]
    assert backs == ["float32"]


# -- the cast cache ----------------------------------------------------------------------


def test_a_tied_weight_is_cast_once_per_region() -> None:
    w = rc.param(_rand(8, 8))
    x = rc.tensor(_rand(2, 8))
    with rc.autocast():
        a = x @ w
        b = a.to(rc.float32) @ w  # w again: the same pending cast
        assert a._src[1] is b._src[1]
        with rc.autocast():  # nested, same dtype: shares the casts
            c = x @ w
            assert c._src[1] is a._src[1]
        with rc.autocast(rc.float16):  # another dtype: its own cast
            d = x @ w
            assert d.dtype == rc.float16 and d._src[1] is not a._src[1]
        e = x @ w
        assert e._src[1] is a._src[1]
    with rc.autocast():
        f = x @ w
    assert f._src[1] is not a._src[1]  # the cache ends with its region


def test_a_computed_cast_is_not_reused_after_the_leaf_changes() -> None:
    w = rc.param(np.ones((4, 4), np.float32))
    x = rc.tensor(np.ones((1, 4), np.float32))
    with rc.autocast():
        y1 = x @ w
        assert float(y1.numpy()[0, 0]) == 4.0
        w.assign_(np.full((4, 4), 2.0, np.float32))  # an optimizer step, in place
        y2 = x @ w
        assert float(y2.numpy()[0, 0]) == 8.0


def test_no_grad_and_grad_casts_are_cached_apart() -> None:
    w = rc.param(_rand(4, 4))
    x = rc.tensor(_rand(2, 4))
    with rc.autocast():
        with rc.no_grad():
            a = x @ w
        b = x @ w
        assert not a.requires_grad and b.requires_grad
        ops.sum(b.to(rc.float32)).backward()
    assert w.grad is not None and w.grad.dtype == rc.float32


# -- the context manager -----------------------------------------------------------------


def test_disabled_nested_decorator_and_threads() -> None:
    w = rc.param(_rand(4, 4))
    x = rc.tensor(_rand(2, 4))
    with rc.autocast():
        with rc.autocast(enabled=False):
            assert rc.autocast_dtype() is None
            assert (x @ w).dtype == rc.float32
        assert (x @ w).dtype == rc.bfloat16
        seen: list[object] = []
        th = threading.Thread(target=lambda: seen.append(rc.autocast_dtype()))
        th.start()
        th.join()
        assert seen == [None]  # per thread

    @rc.autocast(rc.float16)
    def f() -> rc.DType:
        return (x @ w).dtype

    assert f() == rc.float16 and rc.autocast_dtype() is None
    with pytest.raises(ZeroDivisionError):
        with rc.autocast():
            raise ZeroDivisionError
    assert rc.autocast_dtype() is None  # restored after an exception


@pytest.mark.parametrize("bad", [rc.float32, rc.int32, "float32", "int32", "float64", np.int8])
def test_bad_dtypes_raise(bad: object) -> None:
    with pytest.raises(TypeError, match="autocast|dtype"):
        rc.autocast(bad)


def test_a_transposed_parameter_is_cast_before_its_view() -> None:
    """x @ W.T (nn.Linear): the parameter itself is cast (cached) and viewed; no dense
    float32 copy of W.T is made. Values and gradients as without the shortcut."""
    wv, xv = _rand(6, 8), _rand(3, 8)
    w, x = rc.param(wv), rc.tensor(xv)
    with rc.autocast():
        wt = w.T
        y = x @ wt
        view = y._src[1]
        assert view._op == "permute" and view._src[0]._op == "cast"
        assert view._src[0]._src[0] is w
        y2 = x @ wt  # the parameter's cast is shared
        assert y2._src[1]._src[0] is view._src[0]
        loss = ops.sum(y.to(rc.float32))
    np.testing.assert_allclose(
        y.numpy().astype(np.float64), _bf(_bf(xv) @ _bf(wv).T), rtol=2.0**-8, atol=1e-6
    )
    loss.backward()
    assert w.grad.dtype == rc.float32 and w.grad.shape == (6, 8)
    # d loss / d W = ones(3, 6)^T @ x rounded to bf16 (out_prod in bf16)
    np.testing.assert_allclose(w.grad.numpy(), np.ones((6, 3)) @ _bf(xv), rtol=2.0**-8, atol=1e-6)


# -- casts recomputed for the backward ---------------------------------------------------


@contextlib.contextmanager
def _recompute_casts(on: bool) -> Iterator[None]:
    """Backward graphs built inside recompute the casts (on) or keep them (off); the lazy
    plans are dropped on both sides (the setting is not part of a plan's key)."""
    prev = _core.recompute_casts()
    _core.set_recompute_casts(on)
    LAZY.clear()
    try:
        yield
    finally:
        _core.set_recompute_casts(prev)
        LAZY.clear()


def _two_layers(x, w1, w2, t):
    """rms_norm(softplus(x @ W1^T) @ W2) . t under autocast: softplus and rms_norm read
    float32 up-casts of bf16 products in their backward; W1^T is a view of a parameter's
    cast, W2's cast is a parameter's too."""
    with rc.autocast():
        h = x @ w1.T
        a = ops.softplus(h)
        y = a @ w2
        n = ops.rms_norm(y, 1e-6)
        return h, a, y, ops.sum(n * t)


def test_recomputed_casts_give_the_same_gradients() -> None:
    """Bitwise the gradients of the graph that keeps its casts, and the float64 gradient of
    the same computation with bf16 rounding where autocast rounds."""
    xv, w1v, w2v, tv = _rand(16, 8), _rand(12, 8) * 0.5, _rand(12, 6) * 0.5, _rand(16, 6)
    got = {}
    for on in (False, True):
        with _recompute_casts(on):
            w1, w2 = rc.param(w1v), rc.param(w2v)
            h, a, y, loss = _two_layers(rc.tensor(xv), w1, w2, rc.tensor(tv))
            assert (h.dtype, a.dtype, y.dtype) == (rc.bfloat16, rc.float32, rc.bfloat16)
            loss.backward()
            got[on] = (loss.numpy(), w1.grad.numpy(), w2.grad.numpy())
    for kept, recomputed in zip(got[False], got[True]):
        assert kept.dtype == recomputed.dtype and np.array_equal(kept, recomputed)

    xb, w1b, w2b = _bf(xv), _bf(w1v), _bf(w2v)
    hb = _bf(xb @ w1b.T)
    sp = np.log1p(np.exp(hb))
    ab = _bf(sp)
    yb = _bf(ab @ w2b)
    inv = 1 / np.sqrt((yb * yb).mean(1, keepdims=True) + 1e-6)
    r = yb * inv
    assert abs(float(got[True][0]) - (r * tv).sum()) < 1e-4 * max(1.0, abs((r * tv).sum()))
    dy = inv * (tv - r * (tv * r).mean(1, keepdims=True))
    dw2 = ab.T @ dy
    dh = (dy @ w2b.T) / (1 + np.exp(-hb))
    dw1 = dh.T @ xb
    for g, ref in ((got[True][1], dw1), (got[True][2], dw2)):
        np.testing.assert_allclose(g, ref, atol=2.0**-6 * np.abs(ref).max())


def _peak_copies(on: bool, n_layers: int) -> tuple[int, list[tuple[str, str, tuple[int, ...]]]]:
    """The planned peak of a graph-API stack of _two_layers-like layers, and the casts and
    dense copies made by the forward that are live there (op, dtype, shape)."""
    with _recompute_casts(on):
        g = rc.Graph()
        h = g.input((64, 32))
        ws = [(g.param((32, 32)), g.param((32, 32))) for _ in range(n_layers)]
        with rc.autocast():
            for w1, w2 in ws:
                h = ops.rms_norm(ops.softplus(h @ w1.T) @ w2, 1e-6)
            loss = ops.sum(h * h)
        g.build_backward(loss)
        plan = g.memory()
    copies = [
        (op, dt, tuple(shape))
        for _, op, dt, shape, _, fwd in plan["live_nodes_at_peak"]
        if op in ("cast", "contiguous") and fwd
    ]
    return plan["peak_live_bytes"], copies


def test_recomputed_casts_are_not_kept_for_the_backward() -> None:
    """Kept, each layer's float32 up-casts (softplus's and rms_norm's inputs) and the bf16
    copies of its weights (W1^T through a dense float32 copy) are alive when the backward
    starts; recomputed, only the bf16 casts of the float32 activations that the matmuls'
    backward reads are (their float32 sources are not kept), and the planned peak is
    smaller by at least the up-casts' extra half (2 of their 4 bytes an element)."""
    n = 4
    kept_peak, kept = _peak_copies(False, n)
    peak, copies = _peak_copies(True, n)
    assert kept.count(("cast", "float32", (64, 32))) == 2 * n
    assert kept.count(("cast", "bfloat16", (32, 32))) >= 2 * n - 1
    assert copies == [("cast", "bfloat16", (64, 32))] * len(copies) and len(copies) <= 2 * n
    assert peak <= kept_peak - 2 * n * 64 * 32 * 2


def test_recomputed_casts_inside_recompute_segments() -> None:
    """A parameter's cast made in one recompute() segment and read in others (a tied
    weight, as the chunked LM head's): the same gradients as when the casts are kept."""
    xv, wv = _rand(12, 8), _rand(10, 8) * 0.5
    got = {}
    for on in (False, True):
        with _recompute_casts(on):
            w = rc.param(wv)
            x = rc.tensor(xv)
            with rc.autocast():
                total = None
                for lo in range(0, 12, 4):
                    with rc.recompute():
                        part = ops.sum(ops.log_softmax(x[lo : lo + 4] @ w.T))
                    total = part if total is None else total + part
            total.backward()
            got[on] = (total.numpy(), w.grad.numpy())
    assert all(np.array_equal(a, b) for a, b in zip(got[False], got[True]))
    xb, wb = _bf(xv), _bf(wv)
    z = _bf(xb @ wb.T)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dz = 1 - z.shape[1] * p  # d sum(log_softmax(z)) / dz
    ref = dz.T @ xb
    np.testing.assert_allclose(got[True][1], ref, atol=2.0**-6 * np.abs(ref).max())


@pytest.mark.parametrize("chunks", [1, 3, 6])
def test_a_weight_read_in_several_segments_is_cast_once_in_the_backward(chunks: int) -> None:
    """The chunked LM head's pattern: a parameter's cast read in several recompute()
    segments is made again once in the backward (shared by the segments' copies), not once
    per segment (1 + chunks casts before): two casts of the weight in the step (the
    forward's, made in the first segment, and its copy), as when the casts are kept, for any
    number of chunks, and the gradients of the casts kept, bit for bit."""
    n = 4 * chunks
    xv, wv = _rand(n, 8), _rand(10, 8) * 0.5
    got, casts = {}, {}
    for on in (False, True):
        with _recompute_casts(on):
            w, x = rc.param(wv), rc.tensor(xv)
            with rc.autocast():
                parts = []
                for lo in range(0, n, 4):
                    with rc.recompute():
                        parts.append(ops.sum(ops.softplus(x[lo : lo + 4] @ w.T)))
                total = parts[0]
                for part in parts[1:]:
                    total = total + part
            total.backward()
            got[on] = (total.numpy(), w.grad.numpy())
            g = next(reversed(LAZY._plans.values())).graph
            infos = [g.info(i) for i in range(len(g))]
            casts[on] = sum(
                d["op"] == "cast" and d["dtype"] == "bfloat16" and tuple(d["shape"]) == (10, 8)
                for d in infos
            )
    assert casts == {False: 2, True: 2}
    assert all(np.array_equal(a, b) for a, b in zip(got[False], got[True]))
    xb, wb = _bf(xv), _bf(wv)
    dz = 1 / (1 + np.exp(-_bf(xb @ wb.T)))  # d sum(softplus(z)) / dz, z rounded to bf16
    ref = _bf(dz).T @ xb
    np.testing.assert_allclose(got[True][1], ref, atol=2.0**-6 * np.abs(ref).max())


# -- norms that return the dtype of the product after them ---------------------------------


def _conv_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """silu(b + causal depthwise conv of x (B, T, C) with w (C, K)) in float64."""
    k = w.shape[1]
    xp = np.concatenate([np.zeros((x.shape[0], k - 1, x.shape[2])), x], axis=1)
    pre = sum(xp[:, j : j + x.shape[1], :] * w[:, j] for j in range(k)) + b
    return pre / (1 + np.exp(-pre))


@pytest.mark.parametrize("dtype", [rc.bfloat16, rc.float16])
@pytest.mark.parametrize("half_x", [False, True])
def test_causal_conv_output_in_a_2_byte_dtype_is_the_float32_result_rounded(dtype, half_x) -> None:
    """causal_conv_silu with ``dtype``: the float32 result rounded once by the op (no cast
    node after it), bitwise the conv followed by a cast, and the same gradients bit for bit
    (the backward reads the 2-byte gradient as it is); the values against float64."""
    rng = np.random.default_rng(6)
    B, T, C, K = 2, 7, 5, 4
    xv = rng.standard_normal((B, T, C)).astype(np.float32)
    wv = (rng.standard_normal((C, K)) * 0.5).astype(np.float32)
    bv = (rng.standard_normal(C) * 0.1).astype(np.float32)
    r = rng.standard_normal((B, T, C)).astype(np.float32)
    got = []
    for fused, refused in ((True, False), (False, False), (True, True)):
        w, b = rc.param(wv), rc.param(bv)
        x = rc.param(xv.astype(dtype.numpy) if half_x else xv)
        # refused: the CPU refuses the fused op, so its decomposition (a cast last) runs
        ctx = cpu_refuses("causal_conv_silu") if refused else contextlib.nullcontext()
        with ctx:
            out = ops.causal_conv_silu(x, w, b, dtype=dtype if fused else None)
            if not fused:
                assert out.dtype == rc.float32
                out = out.to(dtype)
            assert out.dtype == dtype and (out._op == "causal_conv_silu") == fused
            loss = ops.sum(out.to(rc.float32) * rc.tensor(r))
            loss.backward()
            got.append((out.numpy(), [p.grad.numpy() for p in (x, w, b)]))
    for other in got[1:]:
        assert got[0][0].tobytes() == other[0].tobytes()
    for a, c, d in zip(got[0][1], got[1][1], got[2][1]):
        assert a.dtype == c.dtype == d.dtype and a.tobytes() == c.tobytes()
        # the decomposed backward (pad, ssm_conv, add, silu) sums in another order
        np.testing.assert_allclose(
            d.astype(np.float32), a.astype(np.float32), rtol=2.0**-7, atol=1e-5
        )
    xs = xv.astype(dtype.numpy).astype(np.float64) if half_x else xv.astype(np.float64)
    ref = _conv_ref(xs, wv.astype(np.float64), bv.astype(np.float64))
    np.testing.assert_allclose(got[0][0].astype(np.float64), ref, rtol=2.0**-7, atol=1e-6)
    with pytest.raises(TypeError, match="output dtype"):
        ops.causal_conv_silu(rc.tensor(xv), rc.tensor(wv), dtype=rc.int32)


@pytest.mark.parametrize("dtype", [rc.bfloat16, rc.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_output_in_a_2_byte_dtype_is_the_float32_result_rounded(dtype, gated) -> None:
    """gated_rms_norm / rms_norm with ``dtype``: the float32 result rounded once (no cast
    node); the gradients equal those of the float32 norm followed by a cast, bit for bit
    (the 2-byte gradient the backward reads converts exactly)."""
    rng = np.random.default_rng(5)
    B, T, H, P = 2, 3, 2, 4
    C = H * P
    data = [rng.standard_normal(s).astype(np.float32) for s in [(B, T, C)] * 3 + [(C,), (H,)]]
    r = rng.standard_normal((B, T, C)).astype(np.float32)
    got = []
    for fused in (True, False):
        y, z, x, w, d = (rc.param(a) for a in data)
        if gated:
            out = ops.gated_rms_norm(y, z, w, 1e-5, P, x=x, d=d, dtype=dtype if fused else None)
        else:
            out = ops.rms_norm(y, 1e-5, w, dtype=dtype if fused else None)
        if not fused:
            out = out.to(dtype)
        assert out.dtype == dtype
        assert (out._op == "gated_rms_norm") == fused
        loss = ops.sum(out.to(rc.float32) * rc.tensor(r))
        loss.backward()
        used = (y, z, x, w, d) if gated else (y, w)
        got.append((out.numpy(), [p.grad.numpy() for p in used]))
    assert got[0][0].tobytes() == got[1][0].tobytes()
    for a, b in zip(got[0][1], got[1][1]):
        assert a.tobytes() == b.tobytes()

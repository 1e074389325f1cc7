"""gated_rms_norm (Mamba-2's gated output norm with the D skip): the fused CPU op and the
decomposition that device backends get, forward against float64 numpy, gradients against
finite differences, strided inputs, errors."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import assert_grads_thread_independent, check_grads

import recurra as rc
from recurra import ops
from recurra.ops._apply import coerce
from recurra.ops._nn import _gated_rms_norm_ops

RNG = np.random.default_rng(77)


def ref(y, z, w, eps, gs, x=None, d=None):
    y, z, w = (a.astype(np.float64) for a in (y, z, w))
    u = y
    if x is not None:
        c, h = y.shape[-1], d.shape[0]
        u = y + x.astype(np.float64) * np.repeat(d.astype(np.float64), c // h)
    hv = u * z / (1 + np.exp(-z))
    g = hv.reshape(*hv.shape[:-1], -1, gs)
    n = g / np.sqrt(np.mean(g * g, axis=-1, keepdims=True) + eps)
    return n.reshape(hv.shape) * w


def fused(y, z, w, eps, gs, x=None, d=None):
    return ops.gated_rms_norm(y, z, w, eps, gs, x=x, d=d)


def decomposed(y, z, w, eps, gs, x=None, d=None):
    _, srcs = coerce([y, z, w] if x is None else [y, z, w, x, d])
    return _gated_rms_norm_ops(srcs, eps, gs)


def inputs(lead, c, heads, skip):
    arr = [RNG.standard_normal((*lead, c)).astype(np.float32) for _ in range(2)]
    arr.append((1 + 0.3 * RNG.standard_normal(c)).astype(np.float32))
    if skip:
        arr.append(RNG.standard_normal((*lead, c)).astype(np.float32))
        arr.append(RNG.standard_normal(heads).astype(np.float32))
    return arr


CASES = [  # (leading axes, C, heads, group size)
    ((1,), 1, 1, 1),
    ((3,), 6, 3, 3),
    ((2, 17), 40, 5, 40),
    ((2, 5), 48, 4, 16),
]


@pytest.mark.parametrize("impl", [fused, decomposed], ids=["fused", "decomposed"])
@pytest.mark.parametrize("skip", [False, True], ids=["plain", "skip"])
@pytest.mark.parametrize("lead,c,heads,gs", CASES, ids=str)
def test_forward(impl, skip, lead, c, heads, gs):
    a = inputs(lead, c, heads, skip)
    want = ref(*a[:3], 1e-5, gs, *a[3:])
    got = impl(*(rc.tensor(v) for v in a[:3]), 1e-5, gs, *(rc.tensor(v) for v in a[3:])).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("impl", [fused, decomposed], ids=["fused", "decomposed"])
@pytest.mark.parametrize("skip", [False, True], ids=["plain", "skip"])
@pytest.mark.parametrize("lead,c,heads,gs", [((3,), 6, 3, 3), ((2, 2), 8, 2, 8)], ids=str)
def test_grads(impl, skip, lead, c, heads, gs):
    a = [v.astype(np.float64) for v in inputs(lead, c, heads, skip)]

    def fn(*t):
        return impl(*t[:3], 1e-5, gs, *t[3:])

    check_grads(fn, a)


def test_strided_inputs_match_dense():
    # z and x as slices of wider rows (a projection's output), as in the Mamba-2 mixer.
    b, t, c, h = 2, 9, 32, 4
    proj = RNG.standard_normal((b, t, 3 * c + 5)).astype(np.float32)
    y, w = RNG.standard_normal((b, t, c)).astype(np.float32), np.ones(c, np.float32)
    d = RNG.standard_normal(h).astype(np.float32)
    p = rc.param(proj)
    out = ops.gated_rms_norm(y, p[:, :, c : 2 * c], w, 1e-5, x=p[:, :, 5 : 5 + c], d=d)
    want = ref(y, proj[:, :, c : 2 * c], w, 1e-5, c, proj[:, :, 5 : 5 + c], d)
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-6)
    # The gradient reaches both slices of the shared projection (they overlap here).
    gw = RNG.standard_normal(out.shape).astype(np.float32)
    (out * rc.tensor(gw)).sum().backward()
    q = rc.param(proj)
    ref_out = decomposed(y, q[:, :, c : 2 * c], w, 1e-5, c, q[:, :, 5 : 5 + c], d)
    (ref_out * rc.tensor(gw)).sum().backward()
    np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_results_do_not_depend_on_threads():
    a = inputs((4, 37), 64, 8, True)
    assert_grads_thread_independent(lambda *t: fused(*t[:3], 1e-5, 16, *t[3:]), a)


def test_errors():
    y = np.zeros((2, 6), np.float32)
    w = np.ones(6, np.float32)
    with pytest.raises(ValueError, match="gated_rms_norm"):
        ops.gated_rms_norm(y, np.zeros((2, 5), np.float32), np.ones(5, np.float32)).numpy()
    with pytest.raises(ValueError, match="group_size"):
        ops.gated_rms_norm(y, y, w, group_size=4).numpy()
    with pytest.raises(ValueError, match="both x and d"):
        ops.gated_rms_norm(y, y, w, x=y)
    with pytest.raises(ValueError, match="D must be"):
        ops.gated_rms_norm(y, y, w, x=y, d=np.ones(4, np.float32)).numpy()
    with pytest.raises(ValueError, match="w must be"):
        ops.gated_rms_norm(y, y, np.ones(5, np.float32)).numpy()
    with pytest.raises(TypeError):
        ops.gated_rms_norm(y, y.astype(np.int32), w).numpy()


# rms_norm with a weight: the same fused op without the gate (sources (y, w)).


@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 5, 33)], ids=str)
def test_weighted_rms_norm_forward_and_grads(shape):
    x = RNG.standard_normal(shape).astype(np.float32)
    w = (1 + 0.3 * RNG.standard_normal(shape[-1])).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5) * w
    got = ops.rms_norm(rc.tensor(x), 1e-5, rc.tensor(w)).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    check_grads(lambda a, b: ops.rms_norm(a, 1e-5, b), [x.astype(np.float64), w.astype(np.float64)])


def test_weighted_rms_norm_matches_the_decomposition_and_threads():
    x = RNG.standard_normal((3, 40, 24)).astype(np.float32)
    w = RNG.standard_normal(24).astype(np.float32)
    g = RNG.standard_normal(x.shape).astype(np.float32)
    grads = []
    for fn in (
        lambda a, b: ops.rms_norm(a, 1e-5, b),
        lambda a, b: ops.rms_norm(a, 1e-5) * b,
    ):
        ps = [rc.param(x), rc.param(w)]
        (fn(*ps) * rc.tensor(g)).sum().backward()
        grads.append([p.grad.numpy() for p in ps])
    for u, v in zip(*grads):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)
    assert_grads_thread_independent(lambda a, b: ops.rms_norm(a, 1e-5, b), [x, w])
    with pytest.raises(ValueError, match="w must be"):
        ops.rms_norm(x, 1e-5, np.ones(5, np.float32)).numpy()

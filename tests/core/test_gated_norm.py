"""gated_rms_norm (Mamba-2's gated output norm with the D skip): the fused CPU op and the
decomposition the scheduler builds for a backend without it (here: the CPU made to refuse
the fused op), forward against float64 numpy, gradients against finite differences, strided
inputs, errors."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import (
    assert_grads_thread_independent,
    check_grads,
    cpu_refuses,
    fused_and_decomposed,
    graph_ops,
)

import recurra as rc
from recurra import ops

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


impl = fused_and_decomposed("gated_rms_norm", fused)


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
    ((2, 3), 600, 6, 600),  # the kernels' channel blocks (256): 256 + 256 + 88
    ((3,), 1200, 4, 300),  # groups of 256 + 44
]


@pytest.mark.parametrize("skip", [False, True], ids=["plain", "skip"])
@pytest.mark.parametrize("lead,c,heads,gs", CASES, ids=str)
def test_forward(impl, skip, lead, c, heads, gs):
    a = inputs(lead, c, heads, skip)
    want = ref(*a[:3], 1e-5, gs, *a[3:])
    got = impl(*(rc.tensor(v) for v in a[:3]), 1e-5, gs, *(rc.tensor(v) for v in a[3:])).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


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
    with cpu_refuses("gated_rms_norm"):
        ref_out = fused(y, q[:, :, c : 2 * c], w, 1e-5, c, q[:, :, 5 : 5 + c], d)
        (ref_out * rc.tensor(gw)).sum().backward()
    np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("c,gs", [(600, 600), (1200, 300)], ids=str)
def test_wide_groups_gradients_match_the_decomposition(c, gs):
    # Groups over several channel blocks of the kernels, sizes no multiple of 16.
    arrays = inputs((2, 3), c, 4, True)
    gw = RNG.standard_normal((2, 3, c)).astype(np.float32)
    grads = []
    for refused in ([], ["gated_rms_norm"]):
        with cpu_refuses(*refused):
            ps = [rc.param(a) for a in arrays]
            out = fused(*ps[:3], 1e-5, gs, *ps[3:])
            (out * rc.tensor(gw)).sum().backward()
            grads.append([p.grad.numpy() for p in ps])
    for u, v in zip(*grads):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "n_src,gs,ops_of_decomposition",
    [
        (2, 8, ["rms_norm", "mul"]),  # rms_norm with a weight
        (3, 8, ["silu", "mul", "rms_norm", "mul"]),
        (3, 4, ["silu", "mul", "reshape", "rms_norm", "reshape", "mul"]),
        (5, 8, ["reshape", "reshape", "mul", "reshape", "add", "silu", "mul", "rms_norm", "mul"]),
    ],
)
def test_decomposition_where_the_op_is_refused(n_src, gs, ops_of_decomposition):
    # One op in Python; the core keeps it where the backend takes it and otherwise builds
    # the decomposition (the ops the spec names), with the same values and gradients.
    spec = ops.spec()["gated_rms_norm"]
    arrays = inputs((2, 3), 8, 2, n_src == 5)
    if n_src == 2:
        arrays = [arrays[0], arrays[2]]
    assert set(ops_of_decomposition) <= {p.strip() for p in spec.decomposition.split(",")}

    results = []
    for refused in (False, True):
        with cpu_refuses(*(["gated_rms_norm"] if refused else [])):
            g = rc.Graph()
            ts = [g.param(a.shape) for a in arrays]
            n_leaves = len(graph_ops(g))
            out = g.apply("gated_rms_norm", ts, ip=(gs,), fp=(1e-5,))
            built = graph_ops(g)[n_leaves:]
            g.set_output(out)
            loss = ops.apply("sum_to", [ops.mul(out, out)], ip=())
            g.set_loss(loss)
            g.build_backward(loss)
        if refused:
            assert built == ops_of_decomposition
        else:
            assert built == ["gated_rms_norm"]
        for t, a in zip(ts, arrays):
            g.set_data(t, a)
        g.compute()
        results.append([g.get_data(out)] + [g.get_data(g.grad(t)) for t in ts])
    for u, v in zip(*results):
        np.testing.assert_allclose(v, u, rtol=1e-4, atol=1e-5)


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

"""Memory of a training step: gradients handed over instead of copied, and elementwise nodes
that write over a source dying there.

- A parameter's gradient is an output with memory of its own (FLAG_OWN_MEMORY): not planned
  in the arena, where it would stay until the end of the step and then be copied out (both
  alive during the copy), but a buffer of its own that the tensor API takes as ``p.grad``.
- The planner lets an elementwise node (add, sub, mul, div, the unary ops, act_grad) take
  over the memory of a source that dies at it (same size and dtype, read element for
  element): the chain below needs one buffer of its size, not two.

References: numpy in float64 (values) and the same graph with every intermediate kept
(outputs are never reused), whose results must be bitwise equal.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import recurra as rc
from recurra import _core, ops
from recurra._tensor import LAZY

RNG = np.random.default_rng(7)
N = 1 << 16  # 256 KiB of float32 per tensor: the plan's sizes are exact multiples of 64


def input_leaf(
    g: _core.Graph, a: np.ndarray, device: str | None, flags: int = _core.FLAG_INPUT
) -> int:
    """A leaf (an input unless ``flags`` say otherwise) bound to (a device copy of) ``a``."""
    nid = g.leaf("float32", list(a.shape), flags)
    if device:
        buf = _core.DeviceBuffer(device, a.nbytes)
        buf.upload(a)
        g.bind_device(nid, buf)
    else:
        g.bind(nid, a)
    return nid


def elementwise_chain(
    x: np.ndarray, y: np.ndarray, keep: bool, device: str | None
) -> tuple[_core.Graph, int, list[int]]:
    """t4 = ((exp(x) + y) * y - x) * 0.5 as a graph; with ``keep`` every intermediate is an
    output (nothing is reused)."""
    g = _core.Graph()
    if device:
        g.set_backends([device], True)
    xi, yi = (input_leaf(g, a, device) for a in (x, y))
    t1 = g.op("exp", [xi])
    t2 = g.op("add", [t1, yi])
    t3 = g.op("mul", [t2, yi])
    t4 = g.op("sub", [t3, xi])
    t5 = g.op("scale", [t4], [], [0.5])
    inner = [t1, t2, t3, t4]
    g.set_flags(t5, _core.FLAG_OUTPUT)
    if keep:
        for t in inner:
            g.set_flags(t, _core.FLAG_OUTPUT)
    return g, t5, inner


def chain_reference(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    return ((np.exp(x64) + y64) * y64 - x64) * 0.5


@pytest.mark.parametrize("device", [None, pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_elementwise_chain_runs_in_one_buffer(device: str | None) -> None:
    x = RNG.standard_normal(N).astype(np.float32)
    y = RNG.standard_normal(N).astype(np.float32)
    g, out, _ = elementwise_chain(x, y, False, device)
    plan = g.plan()
    # Each of add, mul, sub and scale writes over the source that dies at it: one buffer.
    assert plan["n_in_place"] == 4, plan
    assert plan["arena_bytes"] == N * 4, plan
    g.compute()
    got = g.read(out)
    kept, kout, inner = elementwise_chain(x, y, True, device)
    assert kept.plan()["n_in_place"] == 0  # outputs are never written over
    assert kept.plan()["arena_bytes"] == 5 * N * 4
    kept.compute()
    np.testing.assert_array_equal(got, kept.read(kout))  # bitwise: the same kernels
    np.testing.assert_allclose(got, chain_reference(x, y), rtol=2e-6, atol=1e-6)
    # The kept intermediates are what they should be (none was overwritten).
    np.testing.assert_allclose(kept.read(inner[0]), np.exp(x.astype(np.float64)), rtol=2e-6)


@pytest.mark.parametrize("device", [None, pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_no_in_place_through_a_view_that_reorders(device: str | None) -> None:
    # t2 = t1 + t1.T reads t1 at two places per element: writing t2 over t1 would corrupt
    # it. t3 = t2 * row broadcasts the smaller source and may write over t2.
    n = 64
    x = RNG.standard_normal((n, n)).astype(np.float32)
    row = RNG.standard_normal(n).astype(np.float32)
    g = _core.Graph()
    if device:
        g.set_backends([device], True)
    ids = [input_leaf(g, a, device) for a in (x, row)]
    t1 = g.op("tanh", [ids[0]])
    t2 = g.op("add", [t1, g.op("permute", [t1], [1, 0])])
    t3 = g.op("mul", [t2, ids[1]])
    g.set_flags(t3, _core.FLAG_OUTPUT)
    plan = g.plan()
    assert plan["n_in_place"] == 1, plan  # only the mul
    g.compute()
    t = np.tanh(x.astype(np.float64))
    np.testing.assert_allclose(g.read(t3), (t + t.T) * row, rtol=2e-6, atol=2e-6)


def test_a_reshaped_dense_source_is_written_over() -> None:
    x = RNG.standard_normal((32, 64)).astype(np.float32)
    g = _core.Graph()
    xi = g.leaf("float32", [32, 64], _core.FLAG_INPUT)
    g.bind(xi, x)
    t1 = g.op("exp", [xi])
    t2 = g.op("neg", [g.op("reshape", [t1], [64, 32])])
    g.set_flags(t2, _core.FLAG_OUTPUT)
    assert g.plan()["n_in_place"] == 1
    g.compute()
    np.testing.assert_allclose(g.read(t2), -np.exp(x.astype(np.float64)).reshape(64, 32), rtol=2e-6)


def exp_loss_graph(x: np.ndarray) -> tuple[_core.Graph, int, int]:
    g = _core.Graph()
    p = g.leaf("float32", list(x.shape), _core.FLAG_PARAM)
    g.bind(p, x)
    loss = g.op("sum", [g.op("exp", [p])], [0], [])
    g.build_backward(loss)
    return g, p, g.grad(p)


def test_a_parameter_gradient_has_memory_of_its_own() -> None:
    x = (RNG.standard_normal(N) * 0.1).astype(np.float32)
    g, _, gid = exp_loss_graph(x)
    plan = g.plan()
    assert g.owns_memory(gid)
    assert plan["own_bytes"] == N * 4
    # exp(x) and the sum's gradient (made dense) are the large intermediates; the
    # parameter's gradient is not in the arena (there it would make 3 of them).
    assert plan["arena_bytes"] < 2.5 * N * 4, plan
    g.compute()
    first = g.read(gid)
    np.testing.assert_allclose(first, np.exp(x.astype(np.float64)), rtol=2e-6)
    taken = g.take(gid)  # handed over: the same value, and the graph holds it no more
    np.testing.assert_array_equal(taken, first)
    with pytest.raises(RuntimeError, match="handed over"):
        g.read(gid)
    g.compute()  # a fresh buffer: the taken array is not written again
    taken_before = taken.copy()
    np.testing.assert_array_equal(g.read(gid), first)
    again = g.take(gid)
    assert again.ctypes.data != taken.ctypes.data
    np.testing.assert_array_equal(taken, taken_before)


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_tensor_api_gradients_are_handed_over(device: str) -> None:
    x = (RNG.standard_normal(N) * 0.1).astype(np.float32)
    p = rc.param(x, device=device)
    ops.sum(ops.exp(p)).backward()
    plan = next(reversed(LAZY._plans.values()))
    assert plan.graph.owns_memory(plan.grad_ids[0])
    assert plan.graph.plan()["own_bytes"] == N * 4
    # The same value as the graph API's read (a copy), bit for bit.
    g, _, gid = exp_loss_graph(x)
    if device != "cpu":
        g.set_backends([device], True)
    g.compute()
    assert p.grad is not None
    np.testing.assert_array_equal(p.grad.numpy(), g.read(gid))
    # A second step gets a new buffer; the first gradient is untouched.
    first = p.grad
    p.grad = None
    ops.sum(ops.exp(p * 2.0)).backward()
    assert p.grad.storage is not first.storage
    np.testing.assert_array_equal(first.numpy(), g.read(gid))
    np.testing.assert_allclose(p.grad.numpy(), 2 * np.exp(2 * x.astype(np.float64)), rtol=2e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_two_parameters_sharing_a_gradient_node_get_separate_buffers(device: str) -> None:
    # d/da and d/db of sum((a + b) * c) are the same node: one parameter takes its buffer,
    # the other gets a copy, so changing one gradient in place leaves the other alone.
    a = rc.param(RNG.standard_normal(N).astype(np.float32), device=device)
    b = rc.param(RNG.standard_normal(N).astype(np.float32), device=device)
    c_np = RNG.standard_normal(N).astype(np.float32)
    c = rc.tensor(c_np, device=device)
    ops.sum((a + b) * c).backward()
    plan = next(reversed(LAZY._plans.values()))
    assert plan.grad_ids[0] == plan.grad_ids[1]
    assert a.grad is not None and b.grad is not None
    assert a.grad.storage is not b.grad.storage
    np.testing.assert_array_equal(a.grad.numpy(), c_np)
    np.testing.assert_array_equal(b.grad.numpy(), c_np)
    a.grad.assign_(np.zeros(N, np.float32))
    np.testing.assert_array_equal(b.grad.numpy(), c_np)


def test_a_step_holds_each_gradient_once() -> None:
    # What a backward() holds: its arena (exp(x) and the sum's dense gradient here) and the
    # parameter's gradient, once. Planned in the arena and copied out, that gradient was
    # held twice (arena + copy): 4x, not 3x.
    x = (RNG.standard_normal(4 * N) * 0.1).astype(np.float32)
    p = rc.param(x)
    LAZY.clear()
    gc.collect()
    transient = rc.memory_stats()["transient"]["bytes"]
    persistent = rc.memory_stats()["persistent"]["bytes"]
    ops.sum(ops.exp(p)).backward()
    arena = rc.memory_stats()["transient"]["bytes"] - transient
    grad = rc.memory_stats()["persistent"]["bytes"] - persistent
    assert grad == x.nbytes
    assert arena + grad < 3.5 * x.nbytes, (arena, grad)


@pytest.mark.parametrize("device", [None, pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_a_gradient_summed_over_uses_grows_in_its_own_buffer(device: str | None) -> None:
    # p used three times: its gradient is (m2 + m1) + m0, m_i = c_i times the loss's
    # gradient. The sum's first term and the inner add are computed straight into the
    # gradient's own buffer (an own chain): the arena holds one term at a time, not the
    # running sum and a term.
    x = RNG.standard_normal(N).astype(np.float32)
    cs = [RNG.standard_normal(N).astype(np.float32) for _ in range(3)]
    g = _core.Graph()
    if device:
        g.set_backends([device], True)
    p = input_leaf(g, x, device, _core.FLAG_PARAM)
    terms = [g.op("sum", [g.op("mul", [p, input_leaf(g, c, device)])], [0], []) for c in cs]
    loss = g.op("add", [g.op("add", [terms[0], terms[1]]), terms[2]])
    g.build_backward(loss)
    plan = g.plan()
    assert plan["own_bytes"] == N * 4
    assert plan["arena_bytes"] < 1.5 * N * 4, plan
    g.compute()
    np.testing.assert_array_equal(g.read(g.grad(p)), (cs[2] + cs[1]) + cs[0])


@pytest.mark.vulkan
def test_a_device_step_arena_has_no_mirror_of_its_parameters() -> None:
    # The first run of a graph plans it once its leaves are bound. Planned earlier (strict
    # placement), the device parameter counted as host memory and was mirrored into the
    # arena: exp(p) and p's mirror, 2 n floats at the first step's peak, not 1 (the sum's
    # dense gradient is computed into p's gradient buffer).
    x = (RNG.standard_normal(4 * N) * 0.1).astype(np.float32)
    p = rc.param(x, device="vulkan")
    LAZY.clear()
    gc.collect()
    transient = rc.memory_stats()["transient"]["bytes"]
    rc.reset_peak_memory()
    rc.set_strict_placement(True)
    try:
        ops.sum(ops.exp(p)).backward()
    finally:
        rc.set_strict_placement(False)
    arena = rc.memory_stats()["transient"]["peak_bytes"] - transient
    assert arena < 1.5 * x.nbytes, arena
    np.testing.assert_allclose(p.grad.numpy(), np.exp(x.astype(np.float64)), rtol=2e-6)

"""ggmlR's test-ag-resident-adam.R in Python: the Adam step updates weights and moments in
place where they live, computes exactly Adam, and does not grow the persistent pool.

The property that matters is equality, not speed: a step that computed something subtly
different from Adam would still train, just worse. Every test is an equality against an
independent path or an invariant that a broken in-place update would violate. The CPU
versions run everywhere; the device versions (marked ``vulkan``) compare a device run with
the CPU run and skip without a Vulkan backend (in the Vulkan session they fail:
tests/conftest.py).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from optim_reference import adam, assert_close

import recurra
import recurra_optim as optim
from recurra.ops import FusedStep, pack_hyper

RNG = np.random.default_rng(3)


def ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def persistent() -> dict[str, int]:
    return recurra.memory_stats()["persistent"]


# -- run_op(out=) writes in place and returns the same handle / refuses a shape mismatch --


def test_update_op_writes_in_place_into_the_same_buffer() -> None:
    w = recurra.param(np.zeros((4, 4), np.float32))
    buf = w._value
    before = ptr(buf)
    a = (np.arange(1, 17, dtype=np.float32) / 16).reshape(4, 4)
    fs = FusedStep([("sgd_step", (0,), [(buf, a, np.zeros(1, np.int32))])])
    fs.set_hyper(0, {"lr": -2.0})  # w = 0 - (-2) * a = 2a: the R test's ggml_scale(a, 2)
    fs.run()
    # Same buffer, new contents: an allocation here would grow a pool that cannot be reset
    # while the weights in it are live.
    assert w._value is buf and ptr(w._value) == before
    np.testing.assert_allclose(w.numpy(), 2 * a, rtol=1e-6)


def test_update_op_refuses_a_shape_mismatch() -> None:
    w = recurra.param(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="shape mismatch"):
        FusedStep(
            [("sgd_step", (0,), [(w._value, np.ones((3, 3), np.float32), np.zeros(1, np.int32))])]
        )
    opt = optim.Adam([w], lr=0.01)
    w.grad = recurra.tensor(np.ones((3, 3), np.float32))
    with pytest.raises(ValueError, match="shape mismatch"):
        opt.step()
    np.testing.assert_array_equal(w.numpy(), np.zeros((2, 2)))  # nothing was touched


# -- adam moments are resident when the parameters are / stay host-side on the cpu --------


def test_adam_moments_stay_host_side_on_the_cpu() -> None:
    w = recurra.param(RNG.standard_normal((2, 2)).astype(np.float32))
    opt = optim.Adam({"w": w}, lr=0.01)
    assert opt.resident is False
    st = opt.state[w]
    for k in ("exp_avg", "exp_avg_sq"):
        assert isinstance(st[k], recurra.Tensor)
        assert st[k].device == w.device
        assert st[k].shape == w.shape
        assert isinstance(st[k]._value, np.ndarray)  # host memory
        np.testing.assert_array_equal(st[k].numpy(), np.zeros((2, 2)))
    assert st["step"].device == w.device and int(st["step"].numpy()[0]) == 0


def test_adam_moments_are_resident_when_the_parameters_are(vulkan: str) -> None:
    w = recurra.param(RNG.standard_normal((3, 3)).astype(np.float32), device=vulkan)
    opt = optim.Adam([w], lr=0.01)
    assert opt.resident is True
    for k in ("exp_avg", "exp_avg_sq", "step"):
        assert opt.state[w][k].device == w.device
    np.testing.assert_array_equal(opt.state[w]["exp_avg"].numpy(), np.zeros((3, 3)))


# -- the device step matches the host step numerically ------------------------------------

W0 = np.linspace(-0.4, 0.4, 12).reshape(3, 4).astype(np.float32)
GS = [(np.sin(np.arange(1, 13) + i) * 0.1).reshape(3, 4).astype(np.float32) for i in range(1, 5)]


def four_adam_steps(device: str) -> np.ndarray:
    w = recurra.param(W0, device=device)
    opt = optim.Adam([w], lr=0.05)
    for g in GS:
        w.grad = recurra.tensor(g, device=device)
        opt.step()
    return w.numpy()


def test_the_host_step_is_adam() -> None:
    # Four steps of bias-corrected Adam: the correction, the square root and the epsilon all
    # have to be in the right places for these to agree.
    assert_close(four_adam_steps("cpu"), adam(W0, GS, 0.05, (0.9, 0.999), 1e-8))


def test_the_device_step_matches_the_host_step(vulkan: str) -> None:
    np.testing.assert_allclose(
        four_adam_steps(vulkan), four_adam_steps("cpu"), rtol=1e-4, atol=1e-6
    )


# -- the weight stays resident across steps --------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_the_weight_stays_resident_across_steps(device: str) -> None:
    w = recurra.param(RNG.standard_normal((4, 4)).astype(np.float32), device=device)
    opt = optim.Adam([w], lr=0.01)
    buf, m, v = w._value, opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"]
    m_buf, v_buf = m._value, v._value
    on_host = isinstance(buf, np.ndarray)
    where = ptr(buf) if on_host else buf.handle  # the address / the device handle
    before = w.numpy()
    for i in range(6):
        w.grad = recurra.tensor(RNG.standard_normal((4, 4)).astype(np.float32), device=device)
        opt.step()
        # See the diagnosis note of ggmlR's test if this fails: same buffer every step.
        assert w._value is buf
        assert (ptr(w._value) if on_host else w._value.handle) == where
        assert on_host or (w._value.valid and m._value.valid)
        assert opt.state[w]["exp_avg"] is m and m._value is m_buf
        assert opt.state[w]["exp_avg_sq"] is v and v._value is v_buf
        assert int(opt.state[w]["step"].numpy()[0]) == i + 1
    assert not np.isnan(w.numpy()).any()
    assert not np.array_equal(w.numpy(), before)
    assert m.numpy().any() and (v.numpy() > 0).all()


# -- steps do not grow the persistent pool ----------------------------------------------------


@pytest.mark.parametrize(
    "device,n_steps",
    [("cpu", 10), ("cpu", 1000), pytest.param("vulkan", 10, marks=pytest.mark.vulkan)],
)
def test_steps_do_not_grow_the_persistent_pool(device: str, n_steps: int) -> None:
    w = recurra.param(RNG.standard_normal((8, 8)).astype(np.float32), device=device)
    b = recurra.param(RNG.standard_normal(8).astype(np.float32), device=device)
    opt = optim.AdamW([w, b], lr=0.01, max_grad_norm=1.0)
    grads = [
        (
            recurra.tensor(RNG.standard_normal((8, 8)).astype(np.float32), device=device),
            recurra.tensor(RNG.standard_normal(8).astype(np.float32), device=device),
        )
        for _ in range(4)
    ]
    w.grad, b.grad = grads[0]
    opt.step()
    gc.collect()
    held = persistent()
    transient = recurra.memory_stats()["transient"]["bytes"]
    for i in range(n_steps):
        w.grad, b.grad = grads[i % 4]
        opt.step()
    # The persistent pool has no collector -- it cannot be reset while the weights in it are
    # live -- so any per-step allocation here is a leak that only shows on long runs.
    after = persistent()
    assert after["bytes"] == held["bytes"]
    assert after["n_allocs"] == held["n_allocs"]
    assert recurra.memory_stats()["transient"]["bytes"] == transient
    assert np.isfinite(w.numpy()).all()


# -- the weight survives resets between steps ---------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_the_weight_survives_other_graphs_between_steps(device: str) -> None:
    # The analogue of the per-step tape reset: unrelated graphs run (and their plans are
    # evicted) between steps; the optimizer's weights and moments must stay valid and the
    # result must be what an undisturbed run gives.
    w0 = RNG.standard_normal((3, 3)).astype(np.float32)
    gs = [RNG.standard_normal((3, 3)).astype(np.float32) for _ in range(4)]
    w = recurra.param(w0, device=device)
    opt = optim.Adam([w], lr=0.01)
    for i, g in enumerate(gs):
        other = recurra.param(RNG.standard_normal((5, 2)).astype(np.float32), device=device)
        ones = recurra.tensor(np.ones((2, 7), np.float32), device=device)
        loss = recurra.ops.mean((other * float(i + 1)) @ ones)
        loss.backward()
        del other, loss
        gc.collect()
        w.grad = recurra.tensor(g, device=device)
        opt.step()
        assert np.isfinite(opt.state[w]["exp_avg"].numpy()).all()
    assert_close(w.numpy(), adam(w0, gs, 0.01, (0.9, 0.999), 1e-8))


# -- a real training loop converges ---------------------------------------------------------


def train_loop(device: str, steps: int = 25) -> tuple[float, float]:
    rng = np.random.default_rng(3)
    W = recurra.param((rng.standard_normal((8, 4)) * 0.1).astype(np.float32), device=device)
    x = recurra.tensor(rng.standard_normal((16, 8)).astype(np.float32), device=device)
    y = recurra.tensor((rng.standard_normal((16, 4)) * 0.1).astype(np.float32), device=device)
    opt = optim.Adam({"W": W}, lr=0.05)
    first = last = float("nan")
    for i in range(steps):
        d = x @ W - y
        loss = recurra.ops.mean(d * d)
        loss.backward()
        opt.step()
        opt.zero_grad()
        val = loss.item()
        if i == 0:
            first = val
        last = val
    return first, last


def test_a_real_training_loop_converges() -> None:
    # The end-to-end check: an in-place update that wrote to the wrong buffer, or a moment
    # that reset every step, would leave the loss flat rather than error.
    first, last = train_loop("cpu")
    assert np.isfinite(last)
    assert last < 0.5 * first


def test_a_real_training_loop_converges_on_the_device(vulkan: str) -> None:
    first, last = train_loop(vulkan)
    assert np.isfinite(last) and last < 0.5 * first


# -- gradient accumulation still averages correctly -----------------------------------------


def accumulate(device: str, average: bool) -> np.ndarray:
    g1 = np.full((2, 2), 0.2, np.float32)
    g2 = np.full((2, 2), 0.6, np.float32)
    w = recurra.param(np.full((2, 2), 0.5, np.float32), device=device)
    opt = optim.Adam([w], lr=0.1, accumulate_steps=2, average=average)
    w.grad = recurra.tensor(g1, device=device)
    opt.step()
    np.testing.assert_array_equal(w.numpy(), np.full((2, 2), 0.5))  # no update yet
    w.grad = recurra.tensor(g1 + g2, device=device)  # what backward() accumulates
    opt.step()
    assert opt.step_count == 1 and int(opt.state[w]["step"].numpy()[0]) == 1
    return w.numpy()


@pytest.mark.parametrize("average", [True, False])
def test_gradient_accumulation_averages_correctly(average: bool) -> None:
    g = np.full((2, 2), 0.8 / (2 if average else 1))
    want = adam(np.full((2, 2), 0.5), [g], 0.1, (0.9, 0.999), 1e-8)
    assert_close(accumulate("cpu", average), want)


def test_gradient_accumulation_averages_on_the_device(vulkan: str) -> None:
    np.testing.assert_allclose(accumulate(vulkan, True), accumulate("cpu", True), rtol=1e-4)


# -- an optimizer outliving its parameter's buffer ------------------------------------------


def test_a_replaced_parameter_buffer_is_followed_not_written_stale() -> None:
    # ggmlR: releasing the device frees the pool the moments point into; the step must notice
    # rather than read freed memory. Here: the parameter's data array is replaced (as a
    # device release that falls back to the host would); the step must update the new
    # array, keep the state, and never write into the old one.
    w = recurra.param(np.full((2, 2), 1.0, np.float32))
    opt = optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = recurra.tensor(np.full((2, 2), 0.1, np.float32))
    opt.step()
    old = w._value
    old_copy = old.copy()
    fresh = recurra.tensor(old.copy())._value
    w._value = fresh
    w.grad = recurra.tensor(np.full((2, 2), 0.1, np.float32))
    opt.step()
    np.testing.assert_array_equal(old, old_copy)  # the stale buffer was not written
    assert w._value is fresh
    want = 1.0 - 0.1 * 0.1 - 0.1 * (0.9 * 0.1 + 0.1)
    np.testing.assert_allclose(w.numpy(), np.full((2, 2), want), rtol=1e-6)
    w._value = np.zeros((3, 3), np.float32)  # a buffer that no longer fits: refused
    with pytest.raises(ValueError, match="writable C-contiguous float32"):
        opt.step()


def test_an_optimizer_outliving_the_device_falls_back_to_the_host(vulkan: str) -> None:
    w = recurra.param(RNG.standard_normal((2, 2)).astype(np.float32), device=vulkan)
    opt = optim.Adam([w], lr=0.01)
    w.grad = recurra.tensor(np.full((2, 2), 0.1, np.float32), device=vulkan)
    opt.step()
    assert opt.resident
    w_host = recurra.param(w.numpy())
    opt2 = optim.Adam([w_host], lr=0.01)
    opt2.load_state_dict(opt.state_dict())
    w_host.grad = recurra.tensor(np.full((2, 2), 0.1, np.float32))
    opt2.step()
    assert not opt2.resident and np.isfinite(w_host.numpy()).all()


# -- resident means resident: a device step moves only the hyper-parameters and the norm --


@pytest.mark.parametrize("cls", [optim.SGD, optim.Adam, optim.AdamW, optim.Lion])
def test_a_device_step_moves_no_tensor_data(vulkan: str, cls: type) -> None:
    """Twenty parameters (more than one device node takes: the update is cut into several
    nodes and the norm is a tree of grad_norm nodes) with clipping by norm: the step equals
    the CPU step, and in the steady state nothing crosses to the device (the hyper-parameters
    live there and change only with the learning rate) and only the 8-byte [norm, coef]
    comes back."""
    shapes = [(3, 5), (7,), (1,), (4, 4)] * 5
    init = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
    kw = {"lr": 0.05, "max_grad_norm": 0.5}
    if cls is optim.SGD:
        kw["momentum"] = 0.9

    def run(device: str) -> tuple[list[np.ndarray], float, dict]:
        ws = [recurra.param(a, device=device) for a in init]
        opt = cls(ws, **kw)
        stats: dict = {}
        for step in range(3):
            for w, g in zip(ws, grads):
                w.grad = recurra.tensor(g * (step + 1), device=device)
            recurra.reset_transfer_stats()
            opt.step()
            stats = recurra.transfer_stats()
        return [w.numpy() for w in ws], opt.last_grad_norm, stats

    dev_w, dev_norm, stats = run(vulkan)
    cpu_w, cpu_norm, _ = run("cpu")
    # float32 on the device vs double-rounded scalars on the host: each step may differ by
    # ~1e-4 of its size (lr = 0.05), where cancellation leaves a weight near zero.
    for a, b in zip(dev_w, cpu_w):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=3 * 0.05 * 1e-4)
    assert dev_norm == pytest.approx(cpu_norm, rel=1e-5)
    assert stats["host_to_device"]["bytes"] == 0, stats
    assert stats["device_to_host"]["bytes"] <= 8, stats


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
        (optim.Adam, {"lr": 1e-3, "weight_decay": 1e-2}),
        (optim.AdamW, {"lr": 1e-3, "weight_decay": 1e-2}),
        (optim.Lion, {"lr": 1e-4, "weight_decay": 1e-2}),
    ],
)
def test_ten_device_steps_equal_ten_host_steps(vulkan: str, cls: type, kw: dict) -> None:
    """The issue's bar: after 10 steps the device weights equal the host weights within 1e-5
    relative (weights kept away from zero, so the relative measure means something)."""
    rng = np.random.default_rng(11)
    init = rng.uniform(0.5, 1.5, (6, 7)).astype(np.float32)
    grads = [rng.standard_normal((6, 7)).astype(np.float32) for _ in range(10)]

    def run(device: str) -> np.ndarray:
        w = recurra.param(init, device=device)
        opt = cls([w], **kw)
        for g in grads:
            w.grad = recurra.tensor(g, device=device)
            opt.step()
        return w.numpy()

    np.testing.assert_allclose(run(vulkan), run("cpu"), rtol=1e-5, atol=0)


# -- a step lets go of the gradients it was bound to ------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("vulkan", marks=pytest.mark.vulkan)])
def test_a_cached_step_keeps_no_gradient_alive(device: str) -> None:
    # The cached fused step binds this step's gradients; holding them until the next step
    # kept a model's worth of gradient memory alive through the next forward and backward.
    # After step() + zero_grad() the gradient's memory must be free, and the plan reused.
    n = 1 << 18  # 1 MiB: a host gradient of this size lives in the persistent pool
    w0 = RNG.standard_normal(n).astype(np.float32)
    gs = [RNG.standard_normal(n).astype(np.float32) for _ in range(3)]
    w = recurra.param(w0, device=device)
    opt = optim.Adam([w], lr=0.01)
    steps = []
    for i, g in enumerate(gs):
        w.grad = recurra.tensor(g, device=device)
        gc.collect()
        with_grad = persistent()["bytes"]
        opt.step()
        opt.zero_grad()
        gc.collect()
        freed = with_grad - persistent()["bytes"]
        # (the first step builds the plan: a device keeps its hyper-parameters beside it)
        assert freed == 4 * n if i else 4 * n - 4096 <= freed <= 4 * n, (i, freed)
        steps.append(next(iter(opt._plans.values())).step)
    assert len(opt._plans) == 1 and steps[0] is steps[1] is steps[2]
    assert_close(w.numpy(), adam(w0, gs, 0.01, (0.9, 0.999), 1e-8))


# -- several tensors per device node: every update and every step count -------------------

SHAPES = [(3, 4), (5,), (2, 2), (7, 3), (1,), (4, 4), (6,)]


def _three_steps(device: str, make: object, clip: float | None) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    ws = [recurra.param(rng.standard_normal(s).astype(np.float32), device=device) for s in SHAPES]
    opt = make(ws, max_grad_norm=clip)  # type: ignore[operator]
    for _ in range(3):
        for w in ws:
            w.grad = recurra.tensor(rng.standard_normal(w.shape).astype(np.float32), device=device)
        opt.step()
    steps = [int(opt.state[w]["step"].numpy()[0]) for w in ws]
    assert steps == [3] * len(ws), steps
    return [w.numpy() for w in ws]


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize(
    "make",
    [
        lambda ps, **k: optim.SGD(ps, lr=0.1, **k),  # 3 sources a tensor: 3 tensors a node
        lambda ps, **k: optim.SGD(ps, lr=0.1, momentum=0.9, **k),
        lambda ps, **k: optim.Adam(ps, lr=0.05, **k),
        lambda ps, **k: optim.AdamW(ps, lr=0.05, weight_decay=0.1, **k),
        lambda ps, **k: optim.Lion(ps, lr=0.01, **k),
    ],
    ids=["sgd", "sgd-momentum", "adam", "adamw", "lion"],
)
def test_device_nodes_of_several_tensors_update_each_and_count_each_step(
    vulkan: str, make: object, clip: float | None
) -> None:
    """Seven parameters stepped three times on the device, where a node holds up to 12
    sources (two AdamW tensors, three SGD ones; with clipping the grad_norm tree too) and
    one dispatch counts the steps of all its tensors: every step count is 3 and every
    parameter is the CPU's."""
    got = _three_steps(vulkan, make, clip)
    want = _three_steps("cpu", make, clip)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# -- one dispatch a device node: workgroups of tensors of different sizes and step counts ----

ADAMW = {"lr": 1e-3, "weight_decay": 0.1, "a": 0.9, "b": 0.999, "c": 1e-8}


def test_device_adamw_nodes_match_float64_adamw_over_replayed_steps(vulkan: str) -> None:
    """36 tensors (18 device nodes of two, so the step's recording is replayed) whose sizes
    differ within a node (300001 elements: 293 workgroups beside a 3-element tensor) and whose
    step counts differ: a device node updates both tensors in one dispatch and its last
    workgroup counts their steps, which every workgroup must have read first. Six steps equal
    float64 AdamW from each tensor's own step count, and every count moves by exactly 6."""
    from recurra_vulkan import _vk

    rng = np.random.default_rng(5)
    sizes = [300_001, 3, 70_000, 1, 1025, 4096] + [int(k) for k in rng.integers(1, 3000, 30)]
    starts = [int(k) for k in rng.integers(0, 50, len(sizes))]
    p0 = [rng.uniform(0.5, 1.5, n).astype(np.float32) for n in sizes]
    g = [rng.standard_normal(n).astype(np.float32) for n in sizes]

    def dev(a: np.ndarray) -> recurra.Tensor:
        return recurra.tensor(a, device=vulkan)

    ps, gs = [dev(a) for a in p0], [dev(a) for a in g]
    steps = [dev(np.array([k], np.int32)) for k in starts]
    rows = [
        (p, gr, dev(np.zeros(n, np.float32)), dev(np.zeros(n, np.float32)), s)
        for p, gr, n, s in zip(ps, gs, sizes, steps)
    ]
    fs = FusedStep([("adamw_step", (), rows)])
    fs.set_hyper(0, ADAMW)
    replayed = _vk.replay_info(0)["replayed"]
    for _ in range(6):
        fs.run()
    assert _vk.replay_info(0)["replayed"] >= replayed + 5  # the fill re-zeroes each counter
    assert [int(s.numpy()[0]) for s in steps] == [k + 6 for k in starts]
    for p, a, gr, k in zip(ps, p0, g, starts):
        want = adam(a, [gr] * 6, 1e-3, (0.9, 0.999), 1e-8, 0.1, decoupled=True, start_step=k)
        assert_close(p.numpy(), want, rtol=1e-5)


def test_a_device_node_of_two_tensors_records_one_update_dispatch(vulkan: str) -> None:
    """A node of two AdamW tensors of different sizes is one optim dispatch (the step counts
    and the dummy included), not one per tensor and another for the counts."""
    from recurra_vulkan import _vk

    rng = np.random.default_rng(6)
    srcs: list[np.ndarray] = [pack_hyper(ADAMW)]
    for n, k in ((5000, 3), (7, 40)):
        zeros = np.zeros(n, np.float32)
        srcs += [rng.standard_normal(n).astype(np.float32)] * 2 + [zeros, zeros]
        srcs.append(np.array([k], np.int32))
    recs = _vk.profile_dispatches("adamw_step", srcs, [2, 0], [], (1,), "float32", 3, 0, 0)
    labels = [lab for lab, _ in recs]
    assert labels.count("adamw_step/optim[2]") == 3, labels  # one per run
    assert set(labels) <= {"adamw_step/optim[2]", "adamw_step/fill"}, labels
    dummy = _vk.run_node("adamw_step", srcs, [2, 0], [], (1,), "float32")
    np.testing.assert_array_equal(dummy, np.zeros(1, np.float32))

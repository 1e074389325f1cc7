"""Learning-rate schedules (against torch.optim.lr_scheduler when installed, else against
their formulas), gradient accumulation counters, and clipping by norm and by value."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from optim_reference import adam, assert_close, sgd

import recurra
import recurra_optim as optim

RNG = np.random.default_rng(5)


def one_param(cls: type = optim.SGD, **kw: Any) -> tuple[Any, Any]:
    p = recurra.param(np.zeros(3, np.float32))
    kw.setdefault("lr", 0.1)
    return cls([p], **kw), p


# ---- schedules ------------------------------------------------------------------------------


def test_step_lr() -> None:
    opt, _ = one_param(lr=0.1)
    s = optim.StepLR(opt, step_size=3, gamma=0.5)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(9):
        opt.step()
        s.step()
        lrs.append(s.get_last_lr()[0])
    want = [0.1 * 0.5 ** (e // 3) for e in range(10)]
    np.testing.assert_allclose(lrs, want, rtol=1e-12)
    with pytest.raises(ValueError):
        optim.StepLR(opt, step_size=0)


def test_step_lr_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    opt, _ = one_param(lr=0.3)
    tp = torch.nn.Parameter(torch.zeros(3))
    topt = torch.optim.SGD([tp], lr=0.3)
    s = optim.StepLR(opt, 4, 0.3)
    ts = torch.optim.lr_scheduler.StepLR(topt, 4, 0.3)
    for _ in range(12):
        opt.step()
        s.step()
        topt.step()
        ts.step()
        assert s.get_last_lr() == pytest.approx(ts.get_last_lr(), rel=1e-12)


def test_cosine_with_warmup() -> None:
    opt, _ = one_param(optim.Adam, lr=1.0)
    s = optim.CosineWarmupLR(opt, warmup_steps=4, total_steps=14, min_lr=0.1)
    lrs = [s.get_last_lr()[0]]
    for _ in range(16):
        s.step()
        lrs.append(s.get_last_lr()[0])
    np.testing.assert_allclose(lrs[:4], [0.25, 0.5, 0.75, 1.0])  # linear warmup from step 0
    assert lrs[4] == pytest.approx(1.0)  # the peak
    assert lrs[9] == pytest.approx(0.55)  # halfway down the cosine: (1 + 0.1) / 2
    for t in range(4, 15):
        want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 4) / 10))
        assert lrs[t] == pytest.approx(want, rel=1e-12)
    assert lrs[14] == pytest.approx(0.1) and lrs[15] == lrs[16] == 0.1
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # monotone after the peak
    with pytest.raises(ValueError):
        optim.CosineWarmupLR(opt, warmup_steps=5, total_steps=5)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(three_phase=True),
        dict(anneal_strategy="linear", pct_start=0.4, div_factor=10.0),
        dict(cycle_momentum=False),
    ],
)
@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_one_cycle_matches_torch(kind: str, kw: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    extra = {"momentum": 0.9} if kind == "SGD" else {}
    p = recurra.param(np.zeros(3, np.float32))
    opt = getattr(optim, kind)([p], lr=0.1, **extra)
    tp = torch.nn.Parameter(torch.zeros(3))
    topt = getattr(torch.optim, kind)([tp], lr=0.1, **extra)
    total = 20
    s = optim.OneCycleLR(opt, max_lr=0.5, total_steps=total, **kw)
    ts = torch.optim.lr_scheduler.OneCycleLR(topt, max_lr=0.5, total_steps=total, **kw)
    key = "momentum" if kind == "SGD" else "betas"
    for _ in range(total - 1):
        assert opt.param_groups[0]["lr"] == pytest.approx(topt.param_groups[0]["lr"], rel=1e-12)
        mine, theirs = opt.param_groups[0][key], topt.param_groups[0][key]
        assert np.allclose(mine, theirs, rtol=1e-12)
        opt.step()
        topt.step()
        s.step()
        ts.step()
    s.step()  # step == total_steps is still allowed (as in PyTorch) ...
    with pytest.raises(ValueError, match="total number of steps"):
        s.step()  # ... one more is not


def test_one_cycle_needs_momentum_to_cycle_it() -> None:
    opt, _ = one_param(optim.SGD)
    opt.defaults.pop("momentum")
    with pytest.raises(ValueError, match="momentum"):
        optim.OneCycleLR(opt, max_lr=1.0, total_steps=10)
    with pytest.raises(ValueError, match="total_steps"):
        optim.OneCycleLR(optim.SGD([recurra.param(np.zeros(1, np.float32))], lr=0.1), 1.0)


def test_schedulers_advance_only_on_real_updates() -> None:
    opt, p = one_param(optim.SGD, lr=1.0, accumulate_steps=3)
    s = optim.StepLR(opt, step_size=1, gamma=0.5)
    for _i in range(9):
        p.grad = recurra.tensor(np.ones(3, np.float32))
        opt.step()
        s.step()
    assert opt.step_count == 3
    assert s.last_epoch == 3
    assert s.get_last_lr() == [0.125]


def test_scheduler_state_dict_round_trip() -> None:
    opt, _ = one_param(optim.Adam)
    s = optim.OneCycleLR(opt, max_lr=1.0, total_steps=30)
    for _ in range(7):
        s.step()
    opt2, _ = one_param(optim.Adam)
    opt2.load_state_dict(opt.state_dict())
    s2 = optim.OneCycleLR(opt2, max_lr=1.0, total_steps=30, last_epoch=6)
    s2.load_state_dict(s.state_dict())
    s.step()
    s2.step()
    assert s.get_last_lr() == s2.get_last_lr()
    assert opt.param_groups[0]["betas"] == opt2.param_groups[0]["betas"]
    with pytest.raises(ValueError):
        s2.load_state_dict({"last_epoch": 3})


# ---- gradient accumulation ------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, -2])
def test_accumulate_steps_must_be_positive(k: int) -> None:
    with pytest.raises(ValueError, match="accumulate_steps"):
        one_param(optim.Adam, accumulate_steps=k)


def test_accumulate_steps_must_be_an_integer() -> None:
    with pytest.raises(ValueError, match="accumulate_steps"):
        one_param(optim.Adam, accumulate_steps=1.5)


@pytest.mark.parametrize("average", [True, False])
def test_accumulation_with_backward_and_zero_grad_in_the_loop(average: bool) -> None:
    # The ordinary loop: backward(); step(); zero_grad(). backward() sums the micro-batch
    # gradients into p.grad; zero_grad() keeps them while the window is open.
    w0 = RNG.standard_normal((3, 2)).astype(np.float32)
    xs = [RNG.standard_normal((4, 3)).astype(np.float32) for _ in range(6)]
    w = recurra.param(w0)
    opt = optim.SGD([w], lr=0.1, accumulate_steps=3, average=average)
    counts = []
    for x in xs:
        loss = recurra.ops.sum(recurra.tensor(x) @ w)
        loss.backward()
        opt.step()
        opt.zero_grad()
        counts.append((opt.step_count, opt.micro_step, opt.updated))
    assert counts == [
        (0, 1, False),
        (0, 2, False),
        (1, 0, True),
        (1, 1, False),
        (1, 2, False),
        (2, 0, True),
    ]
    assert w.grad is None
    div = 3 if average else 1
    g1 = sum(x.sum(0, dtype=np.float64) for x in xs[:3])[:, None] * np.ones((1, 2)) / div
    g2 = sum(x.sum(0, dtype=np.float64) for x in xs[3:])[:, None] * np.ones((1, 2)) / div
    assert_close(w.numpy(), sgd(w0, [g1, g2], 0.1))
    assert int(opt.state[w]["step"].numpy()[0]) == 2


def test_zero_grad_force_clears_inside_a_window() -> None:
    opt, p = one_param(optim.Adam, accumulate_steps=2)
    p.grad = recurra.tensor(np.ones(3, np.float32))
    opt.step()
    assert opt.accumulating
    opt.zero_grad()
    assert p.grad is not None
    opt.zero_grad(force=True)
    assert p.grad is None


# ---- clipping -------------------------------------------------------------------------------


def grads_for(shapes: list[tuple[int, ...]], scale: float) -> list[np.ndarray]:
    return [(RNG.standard_normal(s) * scale).astype(np.float32) for s in shapes]


def test_clip_by_global_norm_inside_the_step() -> None:
    shapes = [(4, 3), (7,)]
    p0 = grads_for(shapes, 1.0)
    ps = [recurra.param(a) for a in p0]
    opt = optim.SGD(ps, lr=0.1, max_grad_norm=0.5)
    gs = grads_for(shapes, 2.0)
    for p, g in zip(ps, gs):
        p.grad = recurra.tensor(g)
    opt.step()
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in gs))
    assert opt.last_grad_norm == pytest.approx(norm, rel=1e-6)
    coef = 0.5 / (norm + 1e-6)
    for p, a, g in zip(ps, p0, gs):
        assert_close(p.numpy(), a - 0.1 * coef * g.astype(np.float64))
        np.testing.assert_array_equal(p.grad.numpy(), g)  # p.grad is left as it was


def test_clip_norm_below_the_limit_changes_nothing() -> None:
    p0 = grads_for([(5,)], 1.0)[0]
    p = recurra.param(p0)
    opt = optim.SGD([p], lr=0.1, max_grad_norm=100.0)
    g = grads_for([(5,)], 1.0)[0]
    p.grad = recurra.tensor(g)
    opt.step()
    assert_close(p.numpy(), p0 - 0.1 * g.astype(np.float64))


def test_clip_by_value_then_norm_with_accumulation() -> None:
    p0 = grads_for([(6,)], 1.0)[0]
    p = recurra.param(p0)
    opt = optim.SGD([p], lr=0.1, clip_value=0.3, max_grad_norm=0.4, accumulate_steps=2)
    g = grads_for([(6,)], 1.0)[0]
    p.grad = recurra.tensor(g)
    opt.step()
    opt.step()
    eff = np.clip(g.astype(np.float64) / 2, -0.3, 0.3)
    norm = float(np.linalg.norm(eff))
    assert opt.last_grad_norm == pytest.approx(norm, rel=1e-6)
    eff = eff * min(1.0, 0.4 / (norm + 1e-6))
    assert_close(p.numpy(), p0 - 0.1 * eff)


def test_adam_with_clipping_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    shapes = [(4, 3), (7,), (1,)]
    p0 = grads_for(shapes, 1.0)
    ps = [recurra.param(a) for a in p0]
    opt = optim.AdamW(ps, lr=0.01, max_grad_norm=1.0)
    tps = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in p0]
    topt = torch.optim.AdamW(tps, lr=0.01)
    for _ in range(10):
        gs = grads_for(shapes, 1.0)
        for p, t, g in zip(ps, tps, gs):
            p.grad = recurra.tensor(g)
            t.grad = torch.from_numpy(g.copy())
        opt.step()
        tn = torch.nn.utils.clip_grad_norm_(tps, 1.0)
        topt.step()
        assert opt.last_grad_norm == pytest.approx(float(tn), rel=1e-5)
    for p, t in zip(ps, tps):
        assert_close(p.numpy(), t.detach().numpy())


def test_standalone_clip_functions_work_in_place() -> None:
    shapes = [(3, 3), (10,)]
    gs = grads_for(shapes, 3.0)
    ps = [recurra.param(np.zeros(s, np.float32)) for s in shapes]
    for p, g in zip(ps, gs):
        p.grad = recurra.tensor(g)
    bufs = [p.grad._value for p in ps]
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in gs))
    got = optim.clip_grad_norm_(ps, 1.0)
    assert got == pytest.approx(norm, rel=1e-6)
    for p, b, g in zip(ps, bufs, gs):
        assert p.grad._value is b  # in place
        assert_close(p.grad.numpy(), g * (1.0 / (norm + 1e-6)), rtol=1e-6)
    total = math.sqrt(sum(float(np.sum(p.grad.numpy().astype(np.float64) ** 2)) for p in ps))
    assert total <= 1.0 + 1e-6
    optim.clip_grad_value_(ps, 0.1)
    for p in ps:
        assert np.abs(p.grad.numpy()).max() <= np.float32(0.1)
    assert optim.clip_grad_norm_([recurra.param(np.zeros(2, np.float32))], 1.0) == 0.0
    with pytest.raises(ValueError):
        optim.clip_grad_norm_(ps, 1.0, norm_type=1.0)
    with pytest.raises(ValueError):
        optim.clip_grad_value_(ps, 0.0)


def test_standalone_clip_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    gs = grads_for([(5, 4), (9,)], 2.0)
    ps = [recurra.param(np.zeros(g.shape, np.float32)) for g in gs]
    tps = [torch.nn.Parameter(torch.zeros(g.shape)) for g in gs]
    for p, t, g in zip(ps, tps, gs):
        p.grad = recurra.tensor(g)
        t.grad = torch.from_numpy(g.copy())
    assert optim.clip_grad_norm_(ps, 0.7) == pytest.approx(
        float(torch.nn.utils.clip_grad_norm_(tps, 0.7)), rel=1e-6
    )
    for p, t in zip(ps, tps):
        np.testing.assert_allclose(p.grad.numpy(), t.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_adam_bias_correction_uses_each_parameters_own_steps() -> None:
    # A parameter added later starts at step 1 (its own count), as in PyTorch.
    a0, b0 = grads_for([(4,), (4,)], 1.0)
    pa, pb = recurra.param(a0), recurra.param(b0)
    opt = optim.Adam([pa], lr=0.01)
    ga = grads_for([(4,)] * 3, 1.0)
    for g in ga:
        pa.grad = recurra.tensor(g)
        opt.step()
    opt.add_param_group({"params": [pb]})
    gb = grads_for([(4,)], 1.0)[0]
    pa.grad, pb.grad = None, recurra.tensor(gb)
    opt.step()
    assert_close(pb.numpy(), adam(b0, [gb], 0.01, (0.9, 0.999), 1e-8))
    assert_close(pa.numpy(), adam(a0, ga, 0.01, (0.9, 0.999), 1e-8))

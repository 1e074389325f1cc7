"""Every optimizer against float64 numpy references and, when installed, torch.optim: 10
steps, 1e-5 relative. Also parameter groups, skipped parameters, hyper-parameter checks and
the PyTorch-shaped API."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from optim_reference import adam, assert_close, lion, sgd

import recurra
import recurra_optim as optim

RNG = np.random.default_rng(7)
SHAPES = [(1,), (3,), (17,), (5, 7), (70001,)]
STEPS = 10


def f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def run_ours(
    cls: type, inits: list[np.ndarray], grads: list[list[np.ndarray]], **kw: Any
) -> list[np.ndarray]:
    ps = [recurra.param(a) for a in inits]
    opt = cls(ps, **kw)
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = recurra.tensor(g)
        opt.step()
    return [p.numpy() for p in ps]


def make_case() -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    inits = [f32(*s) for s in SHAPES]
    grads = [[f32(*s) for s in SHAPES] for _ in range(STEPS)]
    return inits, grads


SGD_CASES = [
    dict(lr=0.05),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(lr=0.05, momentum=0.5, maximize=True),
]
ADAM_CASES = [
    dict(lr=0.01),
    dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
    dict(lr=0.01, maximize=True),
]


@pytest.mark.parametrize("kw", SGD_CASES)
def test_sgd_matches_numpy(kw: dict[str, Any]) -> None:
    inits, grads = make_case()
    got = run_ours(optim.SGD, inits, grads, **kw)
    for t in range(len(SHAPES)):
        assert_close(got[t], sgd(inits[t], [g[t] for g in grads], **kw))


@pytest.mark.parametrize("kw", ADAM_CASES)
@pytest.mark.parametrize("cls", [optim.Adam, optim.AdamW])
def test_adam_and_adamw_match_numpy(cls: type, kw: dict[str, Any]) -> None:
    inits, grads = make_case()
    got = run_ours(cls, inits, grads, **kw)
    kw = dict(kw)
    decoupled = cls is optim.AdamW
    kw.setdefault("weight_decay", 1e-2 if decoupled else 0.0)
    for t in range(len(SHAPES)):
        want = adam(
            inits[t],
            [g[t] for g in grads],
            kw["lr"],
            kw.get("betas", (0.9, 0.999)),
            kw.get("eps", 1e-8),
            kw["weight_decay"],
            decoupled,
            kw.get("maximize", False),
        )
        assert_close(got[t], want)


@pytest.mark.parametrize(
    "kw", [dict(lr=1e-3), dict(lr=3e-3, betas=(0.95, 0.98), weight_decay=0.1, maximize=True)]
)
def test_lion_matches_numpy(kw: dict[str, Any]) -> None:
    inits, grads = make_case()
    got = run_ours(optim.Lion, inits, grads, **kw)
    for t in range(len(SHAPES)):
        want = lion(
            inits[t],
            [g[t] for g in grads],
            kw["lr"],
            kw.get("betas", (0.9, 0.99)),
            kw.get("weight_decay", 0.0),
            kw.get("maximize", False),
        )
        assert_close(got[t], want)


# ---- torch.optim ----------------------------------------------------------------------------

TORCH_CASES = (
    [(optim.SGD, "SGD", kw) for kw in SGD_CASES]
    + [(optim.Adam, "Adam", kw) for kw in ADAM_CASES]
    + [(optim.AdamW, "AdamW", kw) for kw in ADAM_CASES]
)


@pytest.mark.parametrize("cls,tname,kw", TORCH_CASES)
def test_matches_torch_optim(cls: type, tname: str, kw: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    inits, grads = make_case()
    got = run_ours(cls, inits, grads, **kw)
    tp = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in inits]
    topt = getattr(torch.optim, tname)(tp, **kw)
    for step in grads:
        for p, g in zip(tp, step):
            p.grad = torch.from_numpy(g.copy())
        topt.step()
    for t in range(len(SHAPES)):
        assert_close(got[t], tp[t].detach().numpy())


def test_param_groups_and_parameters_without_gradients_match_torch() -> None:
    torch = pytest.importorskip("torch")
    a0, b0, c0 = f32(4, 3), f32(6), f32(2, 2)
    grads = [(f32(4, 3), f32(6), f32(2, 2)) for _ in range(STEPS)]
    pa, pb, pc = (recurra.param(x) for x in (a0, b0, c0))
    opt = optim.Adam(
        [{"params": [pa, pb]}, {"params": [pc], "lr": 0.05, "weight_decay": 0.1}], lr=0.01
    )
    ta, tb, tc = (torch.nn.Parameter(torch.from_numpy(x.copy())) for x in (a0, b0, c0))
    topt = torch.optim.Adam(
        [{"params": [ta, tb]}, {"params": [tc], "lr": 0.05, "weight_decay": 0.1}], lr=0.01
    )
    for i, (ga, gb, gc) in enumerate(grads):
        # b has no gradient on even steps: it must neither move nor count those steps.
        for p, t, g in ((pa, ta, ga), (pb, tb, gb if i % 2 else None), (pc, tc, gc)):
            p.grad = None if g is None else recurra.tensor(g)
            t.grad = None if g is None else torch.from_numpy(g.copy())
        opt.step()
        topt.step()
    for p, t in ((pa, ta), (pb, tb), (pc, tc)):
        assert_close(p.numpy(), t.detach().numpy())
    assert int(opt.state[pb]["step"].numpy()[0]) == STEPS // 2
    assert int(opt.state[pa]["step"].numpy()[0]) == STEPS
    assert opt.step_count == STEPS


def test_add_param_group_and_per_group_lr_changes() -> None:
    a0, b0 = f32(5), f32(3)
    pa, pb = recurra.param(a0), recurra.param(b0)
    opt = optim.SGD([pa], lr=0.1, momentum=0.9)
    opt.add_param_group({"params": pb, "lr": 0.2})
    assert opt.param_groups[1]["momentum"] == 0.9  # defaults fill the group
    ga, gb = f32(5), f32(3)
    pa.grad, pb.grad = recurra.tensor(ga), recurra.tensor(gb)
    opt.step()
    opt.param_groups[1]["lr"] = 0.05  # takes effect on the next step, no rebuild needed
    opt.step()
    assert_close(pa.numpy(), sgd(a0, [ga, ga], 0.1, 0.9))
    assert_close(pb.numpy(), b0 - 0.2 * gb.astype(np.float64) - 0.05 * (0.9 * gb + gb))
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [pa]})


def test_closure_and_return_value() -> None:
    p = recurra.param(np.ones(2, np.float32))
    opt = optim.SGD([p], lr=0.1)

    def closure() -> float:
        p.grad = recurra.tensor(np.ones(2, np.float32))
        return 3.5

    assert opt.step(closure) == 3.5
    np.testing.assert_allclose(p.numpy(), [0.9, 0.9], rtol=1e-6)
    assert opt.step() is None


def test_zero_grad() -> None:
    p = recurra.param(np.ones(3, np.float32))
    opt = optim.Adam([p])
    p.grad = recurra.tensor(np.ones(3, np.float32))
    buf = p.grad._value
    opt.zero_grad(set_to_none=False)
    assert p.grad is not None and p.grad._value is buf and not buf.any()
    opt.zero_grad()
    assert p.grad is None
    opt.step()  # no gradient anywhere: nothing moves, nothing counts
    assert opt.step_count == 0 and not opt.updated
    np.testing.assert_array_equal(p.numpy(), np.ones(3))


def test_numpy_gradients_are_accepted() -> None:
    p = recurra.param(np.zeros(4, np.float32))
    opt = optim.SGD([p], lr=0.5)
    p.grad = np.arange(4, dtype=np.float64)  # converted to float32, no error
    opt.step()
    np.testing.assert_allclose(p.numpy(), -0.5 * np.arange(4), rtol=1e-6)


def test_named_parameters_name_the_culprit() -> None:
    w = recurra.param(np.zeros((2, 2), np.float32))
    opt = optim.Adam({"w": w}, lr=0.01)
    w.grad = recurra.tensor(np.ones((3, 3), np.float32))
    with pytest.raises(ValueError, match="shape mismatch.*w"):
        opt.step()


@pytest.mark.parametrize(
    "cls,kw,msg",
    [
        (optim.SGD, dict(lr=-0.1), "lr"),
        (optim.SGD, dict(momentum=-1.0), "momentum"),
        (optim.SGD, dict(nesterov=True), "Nesterov"),
        (optim.SGD, dict(momentum=0.9, nesterov=True, dampening=0.1), "Nesterov"),
        (optim.Adam, dict(betas=(1.0, 0.999)), "beta"),
        (optim.Adam, dict(betas=(0.9, -0.1)), "beta"),
        (optim.Adam, dict(eps=-1e-8), "epsilon"),
        (optim.AdamW, dict(weight_decay=-1.0), "weight_decay"),
        (optim.Lion, dict(betas=(0.9,)), "betas"),
        (optim.Adam, dict(max_grad_norm=0.0), "max_grad_norm"),
        (optim.Adam, dict(clip_value=-1.0), "clip_value"),
    ],
)
def test_bad_hyper_parameters_raise(cls: type, kw: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        cls([recurra.param(np.zeros(2, np.float32))], **kw)


def test_hyper_parameters_changed_later_are_checked_at_step() -> None:
    p = recurra.param(np.zeros(2, np.float32))
    opt = optim.Adam([p])
    opt.param_groups[0]["betas"] = (1.5, 0.9)
    p.grad = recurra.tensor(np.ones(2, np.float32))
    with pytest.raises(ValueError, match="beta"):
        opt.step()


def test_bad_params_raise() -> None:
    with pytest.raises(ValueError, match="empty"):
        optim.SGD([])
    with pytest.raises(TypeError, match="single tensor"):
        optim.SGD(recurra.param(np.zeros(2, np.float32)))
    with pytest.raises(TypeError, match="recurra tensors"):
        optim.SGD([np.zeros(2, np.float32)])
    with pytest.raises(TypeError, match="float32"):
        optim.SGD([recurra.tensor(np.zeros(2, np.int32))])
    x = recurra.param(np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="non-leaf"):
        optim.SGD([x * 2.0])
    with pytest.raises(ValueError, match="more than one"):
        optim.SGD([x, x])


def test_repr_lists_the_groups() -> None:
    opt = optim.AdamW([recurra.param(np.zeros(2, np.float32))], lr=0.5)
    r = repr(opt)
    assert r.startswith("AdamW (") and "lr: 0.5" in r and "weight_decay: 0.01" in r

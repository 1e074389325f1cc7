"""End to end on the CPU: linear regression and a 2-layer MLP converge with every
optimizer; memory stays flat over 1,000 training steps."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import recurra
import recurra_optim as optim
from recurra import ops

OPTIMIZERS = [
    (optim.SGD, dict(lr=0.1, momentum=0.9)),
    (optim.Adam, dict(lr=0.05)),
    (optim.AdamW, dict(lr=0.05, weight_decay=1e-4)),
    (optim.Lion, dict(lr=0.01)),
]


def regression_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 5)).astype(np.float32)
    w_true = rng.standard_normal((5, 1)).astype(np.float32)
    y = (x @ w_true + 0.5).astype(np.float32)
    return x, y, w_true


@pytest.mark.parametrize("cls,kw", OPTIMIZERS)
def test_linear_regression_converges(cls: type, kw: dict[str, Any]) -> None:
    x, y, w_true = regression_data()
    w = recurra.param(np.zeros((5, 1), np.float32))
    b = recurra.param(np.zeros(1, np.float32))
    opt = cls([w, b], **kw)
    xt, yt = recurra.tensor(x), recurra.tensor(y)
    losses = []
    for _ in range(300):
        d = xt @ w + b - yt
        loss = ops.mean(d * d)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 1e-3 * losses[0]
    np.testing.assert_allclose(w.numpy(), w_true, atol=0.05)
    np.testing.assert_allclose(b.numpy(), [0.5], atol=0.05)


def mlp_setup(seed: int = 1) -> tuple[list[Any], Any, Any]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, (128, 2)).astype(np.float32)
    y = (np.sin(x[:, :1]) * np.cos(x[:, 1:])).astype(np.float32)  # needs the hidden layer
    params = [
        recurra.param((rng.standard_normal((2, 32)) * 0.7).astype(np.float32)),
        recurra.param(np.zeros(32, np.float32)),
        recurra.param((rng.standard_normal((32, 1)) * 0.2).astype(np.float32)),
        recurra.param(np.zeros(1, np.float32)),
    ]
    return params, recurra.tensor(x), recurra.tensor(y)


def mlp_loss(params: list[Any], x: Any, y: Any) -> Any:
    w1, b1, w2, b2 = params
    h = ops.tanh(x @ w1 + b1)
    d = h @ w2 + b2 - y
    return ops.mean(d * d)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS)
def test_two_layer_mlp_converges(cls: type, kw: dict[str, Any]) -> None:
    params, x, y = mlp_setup()
    kw = dict(kw, lr=kw["lr"] * (0.2 if cls is optim.SGD else 0.4))
    opt = cls(params, **kw)
    first = None
    for _ in range(300):
        loss = mlp_loss(params, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if first is None:
            first = loss.item()
    last = mlp_loss(params, x, y).item()
    baseline = float(np.var(y.numpy()))  # the best constant predictor
    assert last < 0.1 * baseline, (first, last, baseline)


def test_mlp_with_accumulation_schedule_and_clipping_converges() -> None:
    params, x, y = mlp_setup()
    opt = optim.AdamW(params, lr=0.03, accumulate_steps=2, max_grad_norm=1.0)
    sched = optim.CosineWarmupLR(opt, warmup_steps=10, total_steps=250, min_lr=1e-3)
    for _ in range(500):
        loss = mlp_loss(params, x, y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.step_count == 250 and sched.last_epoch == 250
    assert mlp_loss(params, x, y).item() < 0.1 * float(np.var(y.numpy()))


def test_memory_is_flat_over_1000_training_steps() -> None:
    params, x, y = mlp_setup()
    opt = optim.Adam(params, lr=0.01, max_grad_norm=5.0)
    bufs = [p._value for p in params]

    def train_step() -> None:
        loss = mlp_loss(params, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        train_step()
    gc.collect()
    stats = recurra.memory_stats()
    for _ in range(1000):
        train_step()
    gc.collect()
    after = recurra.memory_stats()
    assert after["persistent"]["bytes"] == stats["persistent"]["bytes"]
    assert after["transient"]["bytes"] == stats["transient"]["bytes"]
    assert all(p._value is b for p, b in zip(params, bufs))
    assert opt.step_count == 1003

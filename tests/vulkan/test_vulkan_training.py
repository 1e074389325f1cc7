"""Training steps that stay on the GPU: under strict placement (a node the device cannot run
raises instead of falling back to the CPU) a 2-layer MLP step (forward, backward, optimizer
update) runs whole on Vulkan, moves nothing but the hyper-parameters and the loss between
host and device, and computes what the same step computes on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
import recurra_optim as optim
from recurra import ops

pytestmark = pytest.mark.vulkan


def mlp_steps(device: str, opt_cls: type, n_steps: int = 3, **kw) -> tuple[list, list, dict]:
    rng = np.random.default_rng(7)
    B, D, H = 9, 5, 17
    x, y = rng.standard_normal((B, D)), rng.standard_normal((B, 2))
    ps = [
        rc.param(rng.standard_normal((D, H)) / np.sqrt(D), device=device),
        rc.param(np.zeros(H), device=device),
        rc.param(rng.standard_normal((H, 2)) / np.sqrt(H), device=device),
        rc.param(np.zeros(2), device=device),
    ]
    xt = rc.tensor(x, device=device, dtype=np.float32)
    yt = rc.tensor(y, device=device, dtype=np.float32)
    opt = opt_cls(ps, **kw)
    losses, traffic = [], {}
    for _ in range(n_steps):
        rc.reset_transfer_stats()
        loss = ops.mse_loss(ops.relu(xt @ ps[0] + ps[1]) @ ps[2] + ps[3], yt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        traffic = rc.transfer_stats()
    return losses, [p.numpy() for p in ps], traffic


@pytest.mark.parametrize(
    ("opt_cls", "kw"),
    [(optim.SGD, {"lr": 0.1, "momentum": 0.9}), (optim.AdamW, {"lr": 0.01, "max_grad_norm": 1.0})],
)
def test_mlp_training_step_runs_whole_on_vulkan(vulkan: str, opt_cls: type, kw: dict) -> None:
    rc.set_strict_placement(True)
    try:
        losses, weights, traffic = mlp_steps(vulkan, opt_cls, **kw)
    finally:
        rc.set_strict_placement(False)
    cpu_losses, cpu_weights, _ = mlp_steps("cpu", opt_cls, **kw)
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-5)
    for a, b in zip(weights, cpu_weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert losses[-1] < losses[0]
    # a steady-state step: nothing up; the loss (and the norm when clipping) down
    assert traffic["host_to_device"]["bytes"] == 0, traffic
    assert traffic["device_to_host"]["bytes"] <= 4 + 8, traffic


def test_trainer_steps_replay_their_recording(vulkan: str) -> None:
    """Trainer's steps on a device after the first name the same buffers (the batch is
    written into input tensors kept from step to step, a Mamba layer's zero initial state is
    made once), so the device resubmits the step's recorded work instead of recording ~100
    dispatches again; and the losses are those of a model trained on the CPU."""
    import recurra_models as rm
    from recurra_optim import AdamW
    from recurra_vulkan import _vk

    index = int(vulkan.partition(":")[2] or 0)
    data = np.random.default_rng(3).integers(0, 64, 4000).astype(np.int32)

    def fit(device: str) -> list[float]:
        model = rm.create("mamba2", vocab_size=64, d_model=32, head_dim=16, n_layer=2, seed=1)
        model = model.to(device)
        opt = AdamW(list(model.parameters()), lr=1e-3)
        tr = rm.Trainer(model, opt, data, batch_size=2, seq_len=16, steps=5, seed=2, log_every=0)
        return [float(h["loss"]) for h in tr.fit() if "loss" in h]

    rc.set_strict_placement(True)
    try:
        before = _vk.replay_info(index)
        losses = fit(vulkan)
        after = _vk.replay_info(index)
    finally:
        rc.set_strict_placement(False)
    # the forward + backward graph is recorded once, then replayed by the four later steps
    assert after["replayed"] - before["replayed"] >= 4, (before, after)
    np.testing.assert_allclose(losses, fit("cpu"), rtol=1e-4)

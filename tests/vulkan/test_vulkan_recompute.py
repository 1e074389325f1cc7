"""Gradient checkpointing on a device: the recomputed copies of each block run on Vulkan as
the originals do; the gradients equal those of the device run without recomputation and
match the CPU, and the device arena (transient pool) peaks lower."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
import recurra_models as rm
from recurra._tensor import LAZY

pytestmark = pytest.mark.vulkan

TINY = {
    "mamba2": {"d_model": 16, "d_state": 4, "head_dim": 8},
    "rwkv7": {"n_embd": 16, "head_size": 8},
}


def _step(model, x, y) -> tuple[float, dict[str, np.ndarray], int]:
    """Loss, gradients and the transient peak of one freshly planned step."""
    LAZY.clear()
    rc.reset_peak_memory()
    base = rc.memory_stats()["transient"]["bytes"]
    model.zero_grad()
    loss = model.loss(x, y)
    loss.backward()
    peak = rc.memory_stats()["transient"]["peak_bytes"] - base
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, peak


@pytest.mark.parametrize("arch", list(TINY))
def test_checkpointed_gradients_on_vulkan(vulkan: str, arch: str) -> None:
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 64, size=(2, 17)).astype(np.int32)
    x, y = tok[:, :-1], tok[:, 1:]
    model = rm.create(arch, vocab_size=64, n_layer=3, seed=2, **TINY[arch])
    cpu_loss, cpu_grads, _ = _step(model, x, y)
    model.to(vulkan)
    loss0, g0, peak0 = _step(model, x, y)
    model.gradient_checkpointing(True)
    loss1, g1, peak1 = _step(model, x, y)
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert loss1 == pytest.approx(cpu_loss, rel=1e-4)
    for name in g0:
        np.testing.assert_allclose(g1[name], g0[name], rtol=1e-5, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(g1[name], cpu_grads[name], rtol=2e-3, atol=2e-5, err_msg=name)
    assert peak1 < peak0, (peak0, peak1)

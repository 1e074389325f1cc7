"""The fused Mamba ops on Vulkan (causal_conv_silu, gated_rms_norm and their backwards): a
Mamba-2 LM training step places them on the device as single nodes (no pad / contiguous /
silu / rms_norm decomposition), its gradients equal the CPU's, and the planned arena holds
fewer live bytes than the same step with the decompositions (RECURRA_VK_UNFUSED=1, which
makes the backend decline the four ops as it did before it had their kernels). The op
values and gradients on odd shapes are the op-case registry's (test_vulkan_ops.py)."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
from recurra._tensor import LAZY

rm = pytest.importorskip("recurra_models")

pytestmark = pytest.mark.vulkan

FUSED = {"causal_conv_silu", "causal_conv_silu_back", "gated_rms_norm", "gated_rms_norm_back"}
TOKENS = np.random.default_rng(3).integers(0, 256, (2, 65)).astype(np.int32)


def lm_step(device: str) -> tuple[float, dict[str, np.ndarray], dict, list[tuple[str, str]]]:
    """Loss, gradients, memory plan and (op, backend) of every node of one fresh step."""
    LAZY.clear()
    model = rm.create("mamba2", vocab_size=256, d_model=64, n_layer=2, seed=1).to(device)
    x = rc.tensor(TOKENS[:, :-1], device=device)
    y = rc.tensor(TOKENS[:, 1:], device=device)
    loss = model.loss(x, y)
    loss.backward()
    grads = {k: p.grad.numpy() for k, p in model.named_parameters()}
    g = next(reversed(LAZY._plans.values())).graph
    nodes = [(g.info(i)["op"], g.backend_of(i)) for i in range(len(g))]
    return loss.item(), grads, dict(g.plan()), nodes


def test_mamba2_step_runs_the_fused_ops_on_vulkan(vulkan: str, monkeypatch) -> None:
    want_loss, want, _, _ = lm_step("cpu")
    rc.set_strict_placement(True)
    try:
        loss, got, plan, nodes = lm_step(vulkan)
        monkeypatch.setenv("RECURRA_VK_UNFUSED", "1")
        loss_u, got_u, plan_u, nodes_u = lm_step(vulkan)
    finally:
        rc.set_strict_placement(False)
    ops = [op for op, _ in nodes]
    # each layer: one conv, one gated norm; the weighted rms_norms (pre-norms, final norm)
    # are gated_rms_norm (y, w) too
    assert ops.count("causal_conv_silu") == 2 and ops.count("causal_conv_silu_back") == 2
    assert ops.count("gated_rms_norm") >= 2 and ops.count("gated_rms_norm_back") >= 2
    for op, backend in nodes:
        if op in FUSED:
            assert backend.partition(":")[0] == "vulkan", (op, backend)
    # no decomposition: the conv's pad and the norm's rms_norm/silu do not appear
    assert not {"pad", "ssm_conv", "rms_norm", "silu"} & set(ops), sorted(set(ops))
    # the unfused step is the decomposition (the check of the knob itself)
    ops_u = {op for op, _ in nodes_u}
    assert not FUSED & ops_u and {"pad", "ssm_conv", "rms_norm"} <= ops_u
    assert len(nodes) < len(nodes_u)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(loss_u, want_loss, rtol=1e-5)
    for k, ref in want.items():
        tol = {"rtol": 1e-3, "atol": 1e-5 * np.abs(ref).max(), "err_msg": k}
        np.testing.assert_allclose(got[k], ref, **tol)
        np.testing.assert_allclose(got_u[k], ref, **tol)
    for key in ("peak_live_bytes", "arena_bytes"):
        assert plan[key] < plan_u[key], (key, plan[key], plan_u[key])

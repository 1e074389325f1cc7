"""RWKV-7's training memory: the cheap elementwise chains of a block run in their own
recomputation segments (``recurra_models.rwkv7.RECOMPUTE_CHAINS``). The gradients must be
those of the plan that keeps every intermediate (bitwise: the same ops on the same data),
and the planned peak of a step must fall."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import recurra_models as rm
from recurra._tensor import LAZY
from recurra_models import rwkv7

SIZES = {"n_embd": 64, "head_size": 16}


def _model(n_layer: int, vocab: int, seed: int = 0):
    """A model whose zero-initialised LoRA matrices are perturbed, so that every path of
    the block carries a gradient."""
    model = rm.create("rwkv7", vocab_size=vocab, n_layer=n_layer, seed=seed, **SIZES)
    rng = np.random.default_rng(seed + 1)
    model.load_state_dict(
        {
            n: p.numpy() + rng.normal(0, 0.1, p.shape).astype(np.float32)
            for n, p in model.named_parameters()
        }
    )
    return model


def _batch(b: int, t: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    tok = np.random.default_rng(7).integers(0, vocab, size=(b, t + 1)).astype(np.int32)
    return tok[:, :-1], tok[:, 1:]


def _step(model, x, y) -> tuple[float, dict[str, np.ndarray], int]:
    """Loss, gradients and the planned peak (peak_live_bytes) of one fresh step."""
    LAZY.clear()
    model.zero_grad()
    loss = model.loss(x, y)
    loss.backward()
    plan = next(reversed(LAZY._plans.values()))
    peak = int(plan.graph.plan()["peak_live_bytes"])
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, peak


@pytest.mark.parametrize("checkpointing", [False, True])
def test_chains_keep_the_gradients_and_lower_the_peak(monkeypatch, checkpointing):
    model = _model(n_layer=3, vocab=64)
    model.gradient_checkpointing(checkpointing)
    x, y = _batch(2, 48, 64)
    monkeypatch.setattr(rwkv7, "RECOMPUTE_CHAINS", False)
    loss0, g0, peak0 = _step(model, x, y)
    monkeypatch.setattr(rwkv7, "RECOMPUTE_CHAINS", True)
    loss1, g1, peak1 = _step(model, x, y)
    assert loss0 == loss1
    assert g0.keys() == g1.keys()
    for name in g0:
        np.testing.assert_array_equal(g0[name], g1[name], err_msg=name)
    # every parameter of layers 1.. and the LoRA matrices get a nonzero gradient
    assert all(np.abs(g1[f"blocks.1.att.{k}"]).max() > 0 for k in ("w1", "a1", "v1", "g1"))
    if checkpointing:  # the segments join the blocks': the plan is no worse
        assert peak1 <= peak0
    else:  # the blocks keep fewer (B, T, C) tensors (here 0.82 of the peak)
        assert peak1 < 0.9 * peak0, (peak1, peak0)


def test_checkpointing_recomputes_each_half_of_a_block_on_its_own(monkeypatch):
    """Under gradient checkpointing the time and the channel mixing of a block are two
    segments: the backward holds one half's intermediates at a time. Against the whole
    block as one segment (nn.Module's recompute_): the same gradients, a lower peak."""
    model = _model(n_layer=3, vocab=64)
    model.gradient_checkpointing(True)
    x, y = _batch(2, 48, 64)
    loss1, g1, peak1 = _step(model, x, y)
    with monkeypatch.context() as m:  # the whole block in one segment
        m.setattr(rwkv7.RWKV7Block, "__call__", rm.nn.Module.__call__)
        m.setattr(rwkv7.RWKV7Block, "_half", lambda self: contextlib.nullcontext())
        loss0, g0, peak0 = _step(model, x, y)
    assert loss0 == loss1
    assert g0.keys() == g1.keys()
    for name in g0:
        np.testing.assert_array_equal(g0[name], g1[name], err_msg=name)
    assert peak1 < 0.95 * peak0, (peak1, peak0)

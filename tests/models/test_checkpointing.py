"""Gradient checkpointing (``model.gradient_checkpointing()``, ``Trainer(...,
gradient_checkpointing=True)``): each block's forward is recomputed in the backward. The
gradients must equal those of the run without (bitwise: the same ops on the same data), the
transient memory peak must be lower, and the plan cache must still hit every step."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
import recurra_models as rm
from recurra._tensor import LAZY
from recurra_optim import AdamW

TINY = {
    "mamba": {"d_model": 16, "d_state": 4},
    "mamba2": {"d_model": 16, "d_state": 4, "head_dim": 8},
    "rwkv6": {"n_embd": 16, "head_size": 8, "d_mix_lora": 4, "d_decay_lora": 4},
    "rwkv7": {"n_embd": 16, "head_size": 8},
}


def _batch(b: int, t: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, 64, size=(b, t + 1)).astype(np.int32)
    return tok[:, :-1], tok[:, 1:]


def _grads(model, x, y) -> tuple[float, dict[str, np.ndarray]]:
    model.zero_grad()
    loss = model.loss(x, y)
    loss.backward()
    # (RWKV-7's layer 0 has parameters that do not reach the loss: no gradient)
    return loss.item(), {
        n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("arch", list(TINY))
def test_gradients_equal_the_run_without(arch):
    model = rm.create(arch, vocab_size=64, n_layer=3, seed=3, **TINY[arch])
    x, y = _batch(2, 12)
    loss0, g0 = _grads(model, x, y)
    assert model.gradient_checkpointing() is model and model.is_gradient_checkpointing
    loss1, g1 = _grads(model, x, y)
    assert loss0 == loss1
    assert g0.keys() == g1.keys()
    for name in g0:
        np.testing.assert_array_equal(g0[name], g1[name], err_msg=name)
    assert any(np.abs(g).max() > 0 for g in g1.values())
    model.gradient_checkpointing(False)
    assert not model.is_gradient_checkpointing


def _peak_transient(model, x, y) -> int:
    """The transient pool's high-water mark of one fresh (planned) training step."""
    LAZY.clear()
    rc.reset_peak_memory()
    base = rc.memory_stats()["transient"]["bytes"]
    model.zero_grad()
    model.loss(x, y).backward()
    return rc.memory_stats()["transient"]["peak_bytes"] - base


def test_peak_memory_is_lower_and_the_plan_cache_hits():
    model = rm.create("mamba", vocab_size=64, d_model=32, d_state=8, n_layer=6, seed=0)
    x, y = _batch(4, 64)
    plain = _peak_transient(model, x, y)
    model.gradient_checkpointing(True)
    ckpt = _peak_transient(model, x, y)
    assert ckpt < 0.7 * plain, (plain, ckpt)
    before = rc.plan_cache_info()
    for _ in range(2):
        model.zero_grad()
        model.loss(x, y).backward()
    after = rc.plan_cache_info()
    assert (after["hits"], after["misses"]) == (before["hits"] + 2, before["misses"])


def test_trainer_option_trains_the_same_run():
    data = rm.ByteTokenizer().encode("the quick brown fox jumps over the lazy dog. " * 20)
    runs = []
    for flag in (None, True):
        model = rm.create("rwkv7", vocab_size=256, n_layer=2, seed=1, **TINY["rwkv7"])
        opt = AdamW(list(model.parameters()), lr=3e-3)
        tr = rm.Trainer(
            model, opt, data, batch_size=2, seq_len=16, steps=3, gradient_checkpointing=flag
        )
        assert model.is_gradient_checkpointing == bool(flag)
        runs.append([r["loss"] for r in tr.fit()])
    assert runs[0] == runs[1]


def test_trainer_option_needs_a_model_that_supports_it():
    class Bare:
        pass

    data = np.zeros(64, np.int32)
    with pytest.raises(TypeError, match="gradient_checkpointing"):
        rm.Trainer(Bare(), None, data, seq_len=8, gradient_checkpointing=True)

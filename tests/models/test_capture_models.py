"""Captured training steps of the models (``recurra.capture`` and ``Trainer(capture=...)``):
the losses and the weights after several AdamW steps are the bits of the uncaptured run,
for Mamba-2 and RWKV-7, with and without recomputation segments and bf16 autocast."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import recurra as rc
import recurra_models as rm
from recurra_optim import AdamW

MODELS = {
    "mamba2": dict(vocab_size=64, d_model=32, n_layer=2, d_state=8, head_dim=8),
    "rwkv7": dict(vocab_size=64, n_embd=32, n_layer=2, head_size=16),
}


def _batches(n: int, b: int = 2, t: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for _ in range(n):
        d = rng.integers(0, 64, (b, t + 1)).astype(np.int32)
        out.append((d[:, :-1].copy(), d[:, 1:].copy()))
    return out


def run_steps(
    arch: str,
    captured: bool,
    *,
    recompute: bool = False,
    autocast: bool = False,
    device: str = "cpu",
    steps: int = 4,
    chunk_bytes: int | None = None,
) -> tuple[list[bytes], list[bytes], object]:
    """Losses and final weights (as bytes) of ``steps`` AdamW steps, and the capture."""
    model = rm.create(arch, seed=0, **MODELS[arch]).to(device)
    model.gradient_checkpointing(recompute)
    opt = AdamW(list(model.parameters()), lr=1e-2)
    step = rc.capture(model.loss, backward=True, params=model.parameters, device=device)
    losses = []
    for x, y in _batches(steps):
        with rc.autocast(rc.bfloat16) if autocast else contextlib.nullcontext():
            if captured:
                loss = step(x, y, chunk_bytes=chunk_bytes)
            else:
                loss = model.loss(x, y, chunk_bytes=chunk_bytes)
                loss.backward()
        losses.append(loss.numpy().tobytes())
        opt.step()
        opt.zero_grad()
    return losses, [p.numpy().tobytes() for p in model.parameters()], step


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize(
    "recompute,autocast", [(False, False), (True, False), (False, True), (True, True)]
)
def test_captured_model_steps_are_bitwise_uncaptured(
    arch: str, recompute: bool, autocast: bool
) -> None:
    ref_losses, ref_weights, _ = run_steps(arch, False, recompute=recompute, autocast=autocast)
    losses, weights, step = run_steps(arch, True, recompute=recompute, autocast=autocast)
    assert step.traces == 1 and step.replays == 3  # type: ignore[attr-defined]
    assert losses == ref_losses
    assert weights == ref_weights
    assert len(set(losses)) > 1  # the weights changed between the steps


def test_captured_chunked_loss_is_bitwise_uncaptured() -> None:
    # the LM head and loss over 4 chunks of token rows, each in its own recompute segment
    kw = dict(chunk_bytes=4 * 64 * 4, recompute=True)
    ref_losses, ref_weights, _ = run_steps("mamba2", False, **kw)  # type: ignore[arg-type]
    losses, weights, step = run_steps("mamba2", True, **kw)  # type: ignore[arg-type]
    assert step.replays == 3  # type: ignore[attr-defined]
    assert (losses, weights) == (ref_losses, ref_weights)


def _trainer(capture: bool, **kw: object) -> rm.Trainer:
    model = rm.create("mamba2", seed=0, **MODELS["mamba2"])
    data = np.random.default_rng(0).integers(0, 64, 400).astype(np.int32)
    opt = AdamW(list(model.parameters()), lr=1e-2)
    return rm.Trainer(
        model,
        opt,
        data,
        batch_size=2,
        seq_len=8,
        steps=4,
        eval_data=data,
        eval_every=2,
        eval_batches=2,
        log_every=0,
        capture=capture,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("precision", ["fp32", "f16"])
def test_trainer_captures_by_default_with_the_same_history(precision: str) -> None:
    ref = _trainer(False, precision=precision)
    got = _trainer(True, precision=precision)
    assert got.captured and not ref.captured
    h_ref, h_got = ref.fit(), got.fit()
    for a, b in zip(h_ref, h_got):
        assert a["loss"] == b["loss"] and a.get("eval_loss") == b.get("eval_loss")
    assert [p.numpy().tobytes() for p in ref.model.parameters()] == [
        p.numpy().tobytes() for p in got.model.parameters()
    ]
    assert got._train_fn.traces == 1 and got._train_fn.replays == 3
    # gradient checkpointing switched on between steps: the capture traces again
    got.model.gradient_checkpointing(True)
    got.steps = 5
    got.fit()
    assert got._train_fn.traces == 2


def test_trainer_does_not_capture_what_it_cannot_vouch_for() -> None:
    # a loss scale of another kind (its scale() may do anything on the host)
    assert not _trainer(True, loss_scale=object()).captured


@pytest.mark.parametrize(
    "arch,recompute,autocast",
    [
        ("mamba2", False, False),
        ("mamba2", True, True),
        ("rwkv7", False, True),
        ("rwkv7", True, False),
    ],
)
def test_captured_model_steps_on_vulkan(
    vulkan: str, arch: str, recompute: bool, autocast: bool
) -> None:
    kw = dict(recompute=recompute, autocast=autocast, device=vulkan, steps=3)
    ref_losses, ref_weights, _ = run_steps(arch, False, **kw)  # type: ignore[arg-type]
    losses, weights, step = run_steps(arch, True, **kw)  # type: ignore[arg-type]
    assert step.traces == 1 and step.replays == 2  # type: ignore[attr-defined]
    assert losses == ref_losses
    assert weights == ref_weights
    assert len(set(losses)) > 1

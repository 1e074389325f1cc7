"""The chunked LM head + cross-entropy of ``CausalLM.loss``: when the logits (B*T, vocab)
would pass ``loss_chunk_bytes`` the head and the loss run over chunks of token rows, each in
its own recomputation segment. The loss and every gradient must be those of the unchunked
loss (float32 rounding apart), the head's against a float64 numpy reference, and the
planned peak must fall."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
import recurra_models as rm
from recurra._tensor import LAZY
from recurra_models.lm import CHUNK_ROW_ALIGN, LOSS_CHUNK_ABOVE, LOSS_CHUNK_BYTES, chunk_rows

TINY = {
    "mamba": {"d_model": 16, "d_state": 4, "tie_embeddings": False},  # the head's own gradient
    "mamba2": {"d_model": 16, "d_state": 4, "head_dim": 8},
    "rwkv6": {"n_embd": 16, "head_size": 8, "d_mix_lora": 4, "d_decay_lora": 4},
    "rwkv7": {"n_embd": 16, "head_size": 8},
}
VOCAB = 64


def _batch(b: int, t: int, vocab: int = VOCAB) -> tuple[np.ndarray, np.ndarray]:
    tok = np.random.default_rng(1).integers(0, vocab, size=(b, t + 1)).astype(np.int32)
    return tok[:, :-1], tok[:, 1:]


def _run(model, x, y, chunk) -> tuple[float, dict[str, np.ndarray]]:
    model.zero_grad()
    loss = model.loss(x, y, chunk_bytes=chunk)
    loss.backward()
    return loss.item(), {
        n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None
    }


def _reference(model, x, y) -> tuple[float, np.ndarray, np.ndarray]:
    """float64 numpy: the loss from the model's hidden states and the head weight, and its
    gradients with respect to the head weight and the hidden states."""
    with rc.no_grad():
        h = model.features_with_state(x, None)[0].numpy().astype(np.float64)
    w = model.lm_head_module().weight.numpy().astype(np.float64)
    hf = h.reshape(-1, h.shape[-1])
    logits = hf @ w.T
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
    t = y.reshape(-1)
    n = t.size
    loss = float(np.mean(lse - logits[np.arange(n), t]))
    d = np.exp(logits - lse[:, None])
    d[np.arange(n), t] -= 1.0
    d /= n
    return loss, d.T @ hf, d @ w


@pytest.mark.parametrize("arch", list(TINY))
@pytest.mark.parametrize("recompute", [False, True])
def test_chunked_loss_and_gradients_equal_the_unchunked(arch, recompute):
    model = rm.create(arch, vocab_size=VOCAB, n_layer=2, seed=3, **TINY[arch])
    model.gradient_checkpointing(recompute)
    x, y = _batch(2, 13)  # 26 rows
    chunk = 5 * VOCAB * 4  # at most 5 rows a chunk: 6 chunks, the last of 1 row
    assert chunk_rows(26, VOCAB, chunk) == 5
    loss0, g0 = _run(model, x, y, 0)
    loss1, g1 = _run(model, x, y, chunk)
    ref_loss, ref_dw, _ = _reference(model, x, y)
    assert loss0 == pytest.approx(ref_loss, rel=1e-5)
    assert loss1 == pytest.approx(ref_loss, rel=1e-5)
    assert g0.keys() == g1.keys()
    for name in g0:
        scale = max(np.abs(g0[name]).max(), 1e-30)
        np.testing.assert_allclose(g1[name], g0[name], rtol=1e-4, atol=1e-5 * scale, err_msg=name)
    head = next(n for n, p in model.named_parameters() if p is model.lm_head_module().weight)
    np.testing.assert_allclose(g1[head], ref_dw, rtol=1e-4, atol=1e-6 * np.abs(ref_dw).max())
    assert np.abs(g1[head]).max() > 0


def test_hidden_state_gradient_matches_float64():
    """The gradient reaching the hidden states through the chunk slices, checked on a model
    whose only parameter below the head is the final norm: dL/d(norm weight) =
    sum over rows of dL/dh * normalised x."""
    model = rm.create("mamba2", vocab_size=VOCAB, n_layer=1, seed=5, **TINY["mamba2"])
    x, y = _batch(3, 7)
    _, g = _run(model, x, y, 4 * VOCAB * 4)
    _, g_ref = _run(model, x, y, 0)
    _, _, dh = _reference(model, x, y)
    w = model.backbone.norm_f.weight.numpy().astype(np.float64)
    with rc.no_grad():
        h = model.features_with_state(x, None)[0].numpy().astype(np.float64)
    xn = h.reshape(-1, h.shape[-1]) / w  # the normalised input of norm_f (weight nonzero)
    want = (dh * xn).sum(axis=0)
    np.testing.assert_allclose(g["backbone.norm_f.weight"], want, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(
        g["backbone.norm_f.weight"], g_ref["backbone.norm_f.weight"], rtol=1e-5, atol=1e-8
    )


def test_chunk_rows_rule():
    assert chunk_rows(100, 10, 0) == 100  # off
    assert chunk_rows(100, 10, 4000) == 100  # fits: one chunk
    assert chunk_rows(100, 10, 3999) == 50  # two equal chunks
    # 8 x 512 at the 130M vocabulary: 16 chunks of 256 rows (333 fit), not 13 of 316
    assert chunk_rows(4096, 50288, 64 << 20) == 256
    assert chunk_rows(4000, 50288, 64 << 20) == 256  # 15 x 256 + 160
    assert chunk_rows(1000, 10, 130 * 40) == 128  # 130 fit: aligned down to 128
    assert chunk_rows(1000, 10, 127 * 40) == 125  # fewer than 128 fit: equal chunks (8 x 125)
    for n, v, lim in [
        (4096, 50288, 64 << 20),
        (1000, 7, 333),
        (5, 1000, 1),
        (4000, 50288, 64 << 20),
    ]:
        rows = chunk_rows(n, v, lim)
        assert 1 <= rows <= n
        assert rows * v * 4 <= lim or rows == 1
        if lim // (v * 4) >= CHUNK_ROW_ALIGN:
            assert rows % CHUNK_ROW_ALIGN == 0
    # 2-byte logits (autocast): twice the rows in the same bytes (667 fit): 6 x 640 + 256
    assert chunk_rows(4096, 50288, 64 << 20, 2) == 640
    assert chunk_rows(100, 10, 3999, 2) == 100  # 2000 bytes: one chunk
    assert chunk_rows(100, 10, 1999, 2) == 50
    with pytest.raises(ValueError, match="itemsize"):
        chunk_rows(100, 10, 1999, 3)
    m = rm.create("mamba2", **TINY["mamba2"])
    assert (m.loss_chunk_bytes, m.loss_chunk_above) == (LOSS_CHUNK_BYTES, LOSS_CHUNK_ABOVE)
    # the 130M presets at 8 x 512 tokens are chunked, at 4 x 256 (the CPU's batch) not
    assert 8 * 512 * 50288 * 4 > LOSS_CHUNK_ABOVE > 4 * 256 * 65536 * 4


def _planned_peak(model, x, y, chunk) -> int:
    """peak_live_bytes of the step's plan (forward, loss, backward), built as it runs."""
    LAZY.clear()
    model.zero_grad()
    model.loss(x, y, chunk_bytes=chunk).backward()
    plan = next(reversed(LAZY._plans.values()))
    return int(plan.graph.plan()["peak_live_bytes"])


@pytest.mark.parametrize("recompute", [False, True])
def test_peak_falls_on_large_logits(recompute):
    vocab = 4096
    model = rm.create("rwkv7", vocab_size=vocab, n_layer=2, seed=0, **TINY["rwkv7"])
    model.gradient_checkpointing(recompute)
    x, y = _batch(2, 64, vocab)  # logits 128 x 4096 floats: 2 MiB
    logits = 128 * vocab * 4
    whole = _planned_peak(model, x, y, 0)
    model.loss_chunk_bytes = logits // 8
    assert _planned_peak(model, x, y, None) == whole  # below loss_chunk_above: whole
    model.loss_chunk_above = logits - 1
    chunked = _planned_peak(model, x, y, None)  # the model's settings
    # the unchunked plan holds the logits (on the CPU their gradient is written over them,
    # cross_entropy_back in place); chunks of an eighth hold much less
    assert whole >= logits
    assert chunked < whole - logits * 3 // 4, (whole, chunked)
    model.loss_chunk_bytes = 0  # off: the plan of the whole loss again
    assert _planned_peak(model, x, y, None) == whole


def test_forward_only_loss_equals_unchunked():
    model = rm.create("mamba", vocab_size=VOCAB, n_layer=2, seed=2, d_model=16, d_state=4)
    x, y = _batch(2, 9)
    with rc.no_grad():
        a = model.loss(x, y, chunk_bytes=3 * VOCAB * 4).item()
        b = model.loss(x, y, chunk_bytes=0).item()
    assert a == pytest.approx(b, rel=1e-6)  # tied embeddings (Mamba's default) too
    assert a == pytest.approx(_reference(model, x, y)[0], rel=1e-5)


def test_autocast_chunks_count_two_byte_logits(monkeypatch):
    """Under autocast the head's logits are bfloat16: a chunk of chunk_bytes holds twice the
    rows of a float32 one (the same bytes alive), and the loss and the head's gradient stay
    those of the unchunked autocast loss."""
    from recurra_models import lm

    seen: list[int] = []
    real = lm.chunked_cross_entropy

    def spy(h, head, targets, rows):
        seen.append(rows)
        return real(h, head, targets, rows)

    monkeypatch.setattr(lm, "chunked_cross_entropy", spy)
    model = rm.create("mamba2", vocab_size=VOCAB, n_layer=1, seed=4, **TINY["mamba2"])
    x, y = _batch(2, 13)  # 26 rows
    chunk = 5 * VOCAB * 4  # 5 float32 rows fit, 10 bfloat16 rows: 3 chunks of 9
    model.loss(x, y, chunk_bytes=chunk)
    assert seen == [5]
    with rc.autocast(rc.bfloat16):
        loss0, g0 = _run(model, x, y, 0)
        assert seen == [5]  # unchunked: no chunks
        loss1, g1 = _run(model, x, y, chunk)
    assert seen == [5, 9]
    assert loss1 == pytest.approx(loss0, rel=1e-2)
    head = next(n for n, p in model.named_parameters() if p is model.lm_head_module().weight)
    scale = np.abs(g0[head]).max()
    assert scale > 0
    np.testing.assert_allclose(g1[head], g0[head], rtol=0, atol=2e-2 * scale)

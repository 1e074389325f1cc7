"""Generation: greedy decoding against recomputing the whole sequence, seeded sampling,
the sampling filters, the traced step graph against the lazy path, ByteTokenizer."""

from __future__ import annotations

import numpy as np
import pytest

import recurra as rc
import recurra_models as rm
from recurra_models import nn
from recurra_models.generation import StepGraph, sample_token


def _model(arch: str) -> object:
    if arch == "mamba":
        return rm.create("mamba", vocab_size=40, d_model=16, n_layer=2, d_state=4, seed=7)
    return rm.create("mamba2", vocab_size=40, d_model=16, n_layer=2, d_state=4, head_dim=8, seed=8)


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_greedy_equals_full_sequence_argmax(arch: str) -> None:
    model = _model(arch)
    prompt = [3, 1, 4, 1, 5]
    got = rm.generate(model, prompt, max_tokens=8, temperature=0.0)
    seq = list(prompt)
    for _ in range(8):  # the independent way: the parallel path over the whole sequence
        logits = model(np.array([seq], np.int32)).numpy()[0, -1]
        seq.append(int(np.argmax(logits)))
    assert got == seq[len(prompt) :]


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_step_graph_equals_lazy_path(arch: str) -> None:
    model = _model(arch)
    assert StepGraph.build(model) is not None
    kw = dict(max_tokens=12, temperature=0.9, top_k=10, top_p=0.95, seed=123)
    a = rm.generate(model, [1, 2, 3], use_graph=True, **kw)
    b = rm.generate(model, [1, 2, 3], use_graph=False, **kw)
    assert a == b
    assert a == rm.generate(model, np.array([[1, 2, 3]]), **kw)  # seeded: reproducible
    assert len(a) == 12 and all(0 <= t < 40 for t in a)
    # the step graph sees parameter updates made after it was built
    g = StepGraph.build(model)
    state = [np.zeros(s.shape, np.float32) for layer in model.init_state(1) for s in layer]
    before, _ = g(np.array([[5]], np.int32), state)
    for p in model.parameters():
        p.assign_(p.numpy() * 1.1)
    after, _ = g(np.array([[5]], np.int32), state)
    ref = model(np.array([[5]], np.int32)).numpy()
    np.testing.assert_allclose(after, ref, rtol=1e-5, atol=1e-5)
    assert not np.allclose(before, after)


def _lazy_greedy(model: object, prompt: list[int], n: int) -> list[int]:
    return rm.generate(model, prompt, max_tokens=n, temperature=0.0, use_graph=False)


def test_step_graph_kept_between_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    # generate() keeps its traced step graph on the model for the next call; a new value of
    # a parameter is seen, a replaced parameter means a new trace, and two streams at once
    # each have a graph of their own.
    model = _model("mamba")
    builds = []
    real = StepGraph.build.__func__

    def counting(cls, m, batch=1, carry=False):  # type: ignore[no-untyped-def]
        builds.append(1)
        return real(cls, m, batch, carry)

    monkeypatch.setattr(StepGraph, "build", classmethod(counting))
    prompt = [3, 1, 4]
    first = rm.generate(model, prompt, max_tokens=6, temperature=0.0)
    assert first == rm.generate(model, prompt, max_tokens=6, temperature=0.0)
    assert len(builds) == 1
    w = model.lm_head.weight
    w.assign_(w.numpy()[::-1].copy())  # new values, same tensor: no new trace
    got = rm.generate(model, prompt, max_tokens=6, temperature=0.0)
    assert len(builds) == 1 and got == _lazy_greedy(model, prompt, 6)
    model.lm_head.weight = nn.Parameter(w.numpy() * -1.0)  # a new tensor in the slot: traced again
    got = rm.generate(model, prompt, max_tokens=6, temperature=0.0)
    assert len(builds) == 2 and got == _lazy_greedy(model, prompt, 6)
    a = rm.stream(model, prompt, max_tokens=6, temperature=0.0)
    b = rm.stream(model, prompt, max_tokens=6, temperature=0.0)
    pairs = list(zip(a, b))  # interleaved steps: a second graph for the second stream
    assert len(builds) == 3 and [x for x, _ in pairs] == [y for _, y in pairs] == got
    # b is left suspended after its last token: no gradient mode leaks out of it
    assert rc.is_grad_enabled()
    b.close()
    assert rc.is_grad_enabled()


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_step_graph_takes_weight_only_values_as_inputs(arch: str) -> None:
    # -exp(A_log) is computed from the weights once per start(), not in every step: the
    # traced step has no exp node, and a new A_log is seen after the next start().
    model = _model(arch)
    step = StepGraph.build(model, carry=True)
    assert step is not None and len(step.constants) == 2  # one per layer
    ops = [step.graph._g.info(i)["op"] for i in range(step.graph.n_nodes)]
    assert "exp" not in ops and "neg" not in ops
    tok = np.array([[5]], np.int32)
    with rc.no_grad():
        step.start(model.init_state(1))
    np.testing.assert_allclose(step.step(tok), model(tok).numpy(), rtol=1e-5, atol=1e-6)
    for layer in model.backbone.layers:
        a = layer.mixer.A_log
        a.assign_(a.numpy() * 0.5 - 1.0)
    with rc.no_grad():
        step.start(model.init_state(1))
    step.step(np.array([[7]], np.int32))  # a state that depends on A before the token read
    after = step.step(tok)
    _, st = model.forward_with_state(np.array([[7]], np.int32))
    ref, _ = model.forward_with_state(tok, st)
    np.testing.assert_allclose(after, ref.numpy(), rtol=1e-5, atol=1e-6)
    lazy = rm.generate(model, [7, 5], max_tokens=3, temperature=0.0, use_graph=False)
    assert rm.generate(model, [7, 5], max_tokens=3, temperature=0.0) == lazy


def test_carried_state_copied_only_when_it_views_itself() -> None:
    from recurra_models.generation import _views

    g = rc.Graph()
    a = g.input((2, 3))
    b = rc.ops.exp(a)
    assert _views(g, a.reshape(3, 2).T.id, a.id) and _views(g, a.id, a.id)
    assert not _views(g, b.id, a.id) and not _views(g, b.reshape(6).id, a.id)
    # Mamba-2's conv states are shifted in place by conv_step nodes and its scan states
    # written in place by the scans: no assign, concat or contiguous copy.
    step = StepGraph.build(_model("mamba2"), carry=True)
    assert step is not None and step.carry
    infos = [step.graph._g.info(i) for i in range(step.graph.n_nodes)]
    ops = [i["op"] for i in infos]
    assert not {"assign", "concat", "contiguous"} & set(ops)
    carried = {t.id for t in step.st_in}
    for op in ("ssm_scan", "conv_step"):
        nodes = [i for i in infos if i["op"] == op]
        assert len(nodes) == 2 and all(i["src"][0] in carried for i in nodes)


def test_stream_stops_and_zero_tokens() -> None:
    model = _model("mamba")
    first = rm.generate(model, [1], max_tokens=5, temperature=0.0)
    stop = first[2]
    want = first[: first.index(stop) + 1]
    assert rm.generate(model, [1], max_tokens=5, temperature=0.0, stop_ids=[stop]) == want
    assert rm.generate(model, [1], max_tokens=0) == []
    it = rm.stream(model, [1, 2], max_tokens=3, temperature=0.0)
    assert [next(it) for _ in range(3)] == rm.generate(model, [1, 2], max_tokens=3, temperature=0)


def test_sampling_filters() -> None:
    logits = np.array([0.0, 3.0, 1.0, 2.0, -1.0])
    assert sample_token(logits, temperature=0.0) == 1
    rng = np.random.default_rng(0)
    draws = [sample_token(logits, 1.0, top_k=2, rng=rng) for _ in range(300)]
    assert set(draws) == {1, 3}
    # top_p: p(1) = 0.64 >= 0.5, so only token 1 survives; 0.9 keeps {1, 3, 2}
    assert {sample_token(logits, 1.0, top_p=0.5, rng=rng) for _ in range(100)} == {1}
    assert {sample_token(logits, 1.0, top_p=0.9, rng=rng) for _ in range(400)} == {1, 2, 3}
    assert sample_token(logits, 5.0, top_k=1, rng=rng) == 1
    # the frequencies follow softmax(logits / T)
    t = 2.0
    p = np.exp(logits / t) / np.exp(logits / t).sum()
    n = 4000
    counts = np.bincount([sample_token(logits, t, rng=rng) for _ in range(n)], minlength=5)
    assert np.all(np.abs(counts / n - p) < 4 * np.sqrt(p * (1 - p) / n) + 1e-3)


def test_greedy_edge_cases() -> None:
    # greedy takes the first maximum; NaN counts as -inf; no finite logit at all raises
    f32 = np.float32
    assert sample_token(np.array([1, 3, 3, 2], f32), temperature=0.0) == 1
    assert sample_token(np.array([np.nan, 1, 3, 3], f32), temperature=0.0) == 2
    assert sample_token(np.array([1, np.inf, 2]), temperature=0.0) == 1
    assert sample_token(np.array([[0.5, -2.0]], f32), temperature=0.0) == 0
    assert sample_token([0, 2, 1], temperature=0.0) == 1  # integers, a list
    for bad in ([np.nan, np.nan], [-np.inf, -np.inf], []):
        with pytest.raises(ValueError, match="empty or all non-finite"):
            sample_token(np.array(bad, f32), temperature=0.0)


def test_bad_arguments_raise() -> None:
    model = _model("mamba")
    with pytest.raises(ValueError, match="temperature"):
        rm.generate(model, [1], temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        rm.generate(model, [1], top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        rm.generate(model, [1], top_p=1.5)
    with pytest.raises(ValueError, match="at least one token"):
        rm.generate(model, [])
    with pytest.raises(ValueError, match=r"prompt ids must be in \[0, 40\)"):
        rm.generate(model, [40])
    with pytest.raises(ValueError, match="max_tokens"):
        rm.generate(model, [1], max_tokens=-2)
    with pytest.raises(ValueError, match="all non-finite"):
        sample_token(np.full(3, np.nan))


def test_byte_tokenizer() -> None:
    tok = rm.ByteTokenizer()
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text and tok.decode(list(ids)) == text
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multi-byte character
    assert tok.decode([]) == ""
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([256])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]

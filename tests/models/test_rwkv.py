"""RWKV6LM / RWKV7LM against the float64 references of reference_rwkv_models.py.

- logits of models loaded from random official state dicts equal the token-by-token float64
  reference within 1e-4 of the largest logit (float32 through a few layers of size 32-64 is
  ~1e-6 off; any wrong term is off by >1e-2), and so do the carried states;
- the recurrent path (T=1 steps through forward_with_state, and chunked prefill) equals the
  full-sequence logits within 1e-4;
- gradients of a whole block (every parameter, the input, the carried state, v_first)
  against central finite differences (tests/core/gradcheck.py, tiny sizes);
- official key names and shapes round-trip through state_dict(); bad dicts raise ValueError
  naming the key.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reference_rwkv_models as ref
from gradcheck import check_grads  # tests/core, put on sys.path by this folder's conftest

import recurra as rc
import recurra_models
from recurra_models.lm import realize
from recurra_models.rwkv6 import RWKV6LM, RWKV6Block, RWKV6Config
from recurra_models.rwkv7 import RWKV7LM, RWKV7Block, RWKV7Config

TOL = 1e-4


def rel_err(got: Any, want: np.ndarray) -> float:
    """max |got - want| / max |want|."""
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def tokens(b: int, t: int, seed: int = 0, vocab: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


V6_CASES = {
    "c32-h8": dict(n_embd=32, head_size=8),
    "c48-h16-flat-faaaa": dict(n_embd=48, head_size=16, flat_faaaa=True, dim_ffn=64),
}
V7_CASES = {
    "c32-h8": dict(n_embd=32, head_size=8),
    "c64-h16-no-layer0-v": dict(n_embd=64, head_size=16, layer0_v_lora=False, dim_ffn=96),
}


def load(version: int, case: dict[str, Any], seed: int = 1) -> tuple[Any, dict, Any]:
    """(model, official state dict, reference forward) for a case."""
    if version == 6:
        sd = ref.random_rwkv6_state_dict(**case, seed=seed)
        hs = case["head_size"] if case.get("flat_faaaa") else None
        return RWKV6LM.from_official(sd, head_size=hs), sd, ref.rwkv6_forward
    sd = ref.random_rwkv7_state_dict(**case, seed=seed)
    return RWKV7LM.from_official(sd), sd, ref.rwkv7_forward


ALL_CASES = [(6, k) for k in V6_CASES] + [(7, k) for k in V7_CASES]


def case_of(version: int, name: str) -> dict[str, Any]:
    return (V6_CASES if version == 6 else V7_CASES)[name]


@pytest.mark.parametrize("version,name", ALL_CASES)
def test_logits_and_state_match_reference(version: int, name: str) -> None:
    case = case_of(version, name)
    model, sd, fwd = load(version, case)
    toks = tokens(2, 7, seed=version)
    hs = case["head_size"]
    want, want_state = fwd(sd, toks, head_size=hs)
    logits, state = model.forward_with_state(toks)
    assert logits.shape == (2, 7, 64)
    assert rel_err(logits.numpy(), want) < TOL
    for got_layer, want_layer in zip(state, want_state):
        for got, w in zip(got_layer, want_layer):
            assert got.shape == w.shape
            np.testing.assert_allclose(got.numpy(), w, rtol=0, atol=TOL * np.abs(w).max())
    # forward() is the zero-state path
    np.testing.assert_array_equal(model.forward(toks).numpy(), logits.numpy())


@pytest.mark.parametrize("version,name", ALL_CASES)
def test_steps_and_chunks_equal_full_sequence(version: int, name: str) -> None:
    model, sd, fwd = load(version, case_of(version, name), seed=2)
    toks = tokens(2, 6, seed=11)
    full = model.forward(toks).numpy()
    state = None
    steps = []
    with rc.no_grad():
        for t in range(toks.shape[1]):
            logits, state = model.forward_with_state(toks[:, t : t + 1], state)
            realize([logits, *(z for layer in state for z in layer)])
            steps.append(logits.numpy())
    assert rel_err(np.concatenate(steps, axis=1), full) < TOL
    # chunked prefill (4 tokens, then 2) from a non-zero state
    l1, s1 = model.forward_with_state(toks[:, :4])
    l2, _ = model.forward_with_state(toks[:, 4:], s1)
    assert rel_err(np.concatenate([l1.numpy(), l2.numpy()], axis=1), full) < TOL
    # and the reference agrees when it also starts from the carried state
    _, ref_state = fwd(sd, toks[:, :4], head_size=case_of(version, name)["head_size"])
    want2, _ = fwd(sd, toks[:, 4:], ref_state, head_size=case_of(version, name)["head_size"])
    assert rel_err(l2.numpy(), want2) < TOL


@pytest.mark.parametrize("version,name", ALL_CASES)
def test_state_dict_round_trips_official_layout(version: int, name: str) -> None:
    case = case_of(version, name)
    model, sd, _ = load(version, case, seed=3)
    out = model.state_dict()
    assert set(out) == set(sd)
    for key, value in sd.items():
        if key.endswith(".time_faaaa"):  # flat (A,) is read as (H, S), the official layout
            assert out[key].shape == (value.size // case["head_size"], case["head_size"])
        else:
            assert out[key].shape == value.shape, key
        np.testing.assert_array_equal(out[key].reshape(value.shape), value)
    # the official layout loads back into a fresh model of the same class
    again = type(model).from_official(out)
    assert again.config == model.config
    toks = tokens(1, 3)
    np.testing.assert_array_equal(again.forward(toks).numpy(), model.forward(toks).numpy())


def test_config_inferred_from_official_keys() -> None:
    sd6 = ref.random_rwkv6_state_dict(
        vocab=40, n_embd=32, head_size=16, n_layer=3, dim_ffn=96, d_mix=4, d_decay=6
    )
    c6 = RWKV6LM.from_official(sd6).config
    assert (c6.vocab_size, c6.n_embd, c6.n_layer, c6.head_size, c6.n_head) == (40, 32, 3, 16, 2)
    assert (c6.ffn_dim, c6.d_mix_lora, c6.d_decay_lora) == (96, 4, 6)
    sd7 = ref.random_rwkv7_state_dict(
        vocab=40,
        n_embd=32,
        head_size=8,
        n_layer=3,
        d_decay=4,
        d_aaa=5,
        d_mv=6,
        d_gate=7,
        layer0_v_lora=False,
    )
    c7 = RWKV7LM.from_official(sd7).config
    assert (c7.vocab_size, c7.n_embd, c7.n_layer, c7.head_size, c7.n_head) == (40, 32, 3, 8, 4)
    assert c7.sizes() == dict(ffn=128, decay=4, aaa=5, mv=6, gate=7)
    assert c7.layer0_v_lora is False


def test_squeezed_vectors_are_accepted() -> None:
    sd = ref.random_rwkv7_state_dict(seed=4)
    squeezed = {
        k: (v.reshape(-1) if v.ndim == 3 or k.endswith("r_k") else v) for k, v in sd.items()
    }
    with pytest.raises(ValueError, match="r_k"):  # flat r_k: the default head size 64 misfits
        RWKV7LM.from_official(squeezed)
    model = RWKV7LM.from_official(squeezed, head_size=8)
    toks = tokens(1, 5)
    want, _ = ref.rwkv7_forward(sd, toks)
    assert rel_err(model.forward(toks).numpy(), want) < TOL
    assert model.state_dict()["blocks.0.att.x_r"].shape == (1, 1, 32)


@pytest.mark.parametrize(
    "version,edit,key",
    [
        (6, "drop", "blocks.1.att.time_decay_w2"),
        (6, "shape", "blocks.0.ffn.value.weight"),
        (6, "shape", "blocks.1.att.time_faaaa"),
        (6, "extra", "blocks.0.att.time_state"),
        (7, "drop", "blocks.1.att.v0"),
        (7, "drop", "emb.weight"),
        (7, "shape", "blocks.1.att.w1"),
        (7, "shape", "blocks.0.att.r_k"),
        (7, "extra", "blocks.0.att.bogus"),
        (7, "text", "blocks.0.att.k_a"),
    ],
)
def test_bad_official_dict_raises_naming_the_key(version: int, edit: str, key: str) -> None:
    if version == 6:
        sd, cls = ref.random_rwkv6_state_dict(), RWKV6LM
    else:
        sd, cls = ref.random_rwkv7_state_dict(), RWKV7LM
    if edit == "drop":
        del sd[key]
    elif edit == "shape":
        sd[key] = np.zeros((3, 5), np.float32)
    elif edit == "extra":
        sd[key] = np.zeros(4, np.float32)
    else:
        sd[key] = np.array(["x"] * 32)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        cls.from_official(sd)


def test_wrong_version_and_bad_inputs_raise() -> None:
    sd6, sd7 = ref.random_rwkv6_state_dict(), ref.random_rwkv7_state_dict()
    with pytest.raises(ValueError, match="RWKV-6"):
        RWKV7LM.from_official(sd6)
    with pytest.raises(ValueError, match="RWKV-7"):
        RWKV6LM.from_official(sd7)
    with pytest.raises(ValueError, match="head_size"):
        RWKV7LM.from_official(sd7, head_size=16)
    model = RWKV7LM.from_official(sd7)
    with pytest.raises(ValueError, match="token ids"):
        model.forward(np.array([[1, 64]], np.int32))
    with pytest.raises(ValueError, match="state"):
        model.forward_with_state(tokens(2, 3), model.init_state(1))
    with pytest.raises(ValueError, match="head_size"):
        RWKV6Config(n_embd=48, head_size=32)
    with pytest.raises(ValueError, match="unknown field"):
        RWKV7LM.from_config({"n_embd": 32, "heads": 4})


# --------------------------------------------------------------------------------------------
# gradients of one whole block
# --------------------------------------------------------------------------------------------
def _set(module: Any, name: str, value: Any) -> None:
    *path, leaf = name.split(".")
    for p in path:
        module = getattr(module, p)
    setattr(module, leaf, value)


@pytest.mark.parametrize("version", [6, 7])
def test_block_gradients_match_finite_differences(version: int) -> None:
    b, t, c, s = 1, 3, 8, 4
    if version == 6:
        cfg = RWKV6Config(
            vocab_size=8, n_embd=c, n_layer=2, head_size=s, dim_ffn=8, d_mix_lora=2, d_decay_lora=2
        )
        block = RWKV6Block(cfg, 1, np.random.default_rng(0))
    else:
        cfg = RWKV7Config(
            vocab_size=8,
            n_embd=c,
            n_layer=2,
            head_size=s,
            dim_ffn=8,
            d_decay_lora=2,
            d_aaa_lora=2,
            d_mv_lora=2,
            d_gate_lora=2,
        )
        block = RWKV7Block(cfg, 1, np.random.default_rng(0))
    rng = np.random.default_rng(5)
    names = [n for n, _ in block.named_parameters()]
    # Random values instead of the official init (which zeroes several matrices, hiding
    # terms), small enough that the outputs stay O(1): the finite differences' float32 noise
    # grows with |L|.
    params = []
    for n, p in block.named_parameters():
        scale = 1.0 if n.endswith(("ln1.weight", "ln2.weight", "ln_x.weight")) else 0.0
        params.append((scale + 0.3 * rng.standard_normal(p.shape)).astype(np.float32))
    if version == 6:  # decays exp(-exp(w)) with w around -1: well inside (0, 1)
        params[names.index("att.time_decay")] -= 1.0
    x = rng.standard_normal((b, t, c)).astype(np.float32)
    state = [
        rng.standard_normal((b, c)).astype(np.float32),
        (0.5 * rng.standard_normal((b, c // s, s, s))).astype(np.float32),
        rng.standard_normal((b, c)).astype(np.float32),
    ]
    extra = [rng.standard_normal((b, t, c)).astype(np.float32)] if version == 7 else []

    def fn(*arrays: Any) -> tuple[Any, ...]:
        for n, a in zip(names, arrays[: len(names)]):
            _set(block, n, a)
        xx, st0, st1, st2, *vf = arrays[len(names) :]
        if version == 6:
            y, st = block(xx, [st0, st1, st2])
        else:
            y, st, _ = block(xx, [st0, st1, st2], vf[0])
        return (y, *st)

    arrays = [*params, x, *state, *extra]
    # Every element of the small arrays by finite differences; the plain linear layers'
    # (out, in) weights (half the elements, ordinary matmul gradients) by one random
    # directional derivative each, which keeps the test at a few hundred evaluations.
    dense = [i for i, n in enumerate(names) if n.endswith(".weight") and params[i].ndim == 2]
    check_grads(fn, arrays, skip=dense)
    directional_check(fn, arrays, dense)


def directional_check(fn: Any, arrays: list[np.ndarray], indices: list[int]) -> None:
    """For each array i in ``indices``: <dL/da_i, d> of recurra's backward equals the central
    difference of L along a random direction d, L = sum_k sum(out_k * R_k) as in
    check_grads (float32 forward, eps 1e-3, rtol 1e-2 + 1e-3 * |grad| * |d|)."""
    rng = np.random.default_rng(7)
    ps = [rc.param(a) for a in arrays]
    outs = fn(*ps)
    weights = [rng.standard_normal(o.shape).astype(np.float32) for o in outs]

    def loss(tensors: list[Any]) -> Any:
        res = fn(*tensors)
        total = None
        for o, w in zip(res, weights):
            term = rc.ops.sum(o * rc.tensor(w))
            total = term if total is None else total + term
        return total

    loss(ps).backward()
    eps = 1e-3
    for i in indices:
        grad = ps[i].grad.numpy().astype(np.float64)
        d = rng.standard_normal(arrays[i].shape)
        vals = []
        for sign in (1.0, -1.0):
            moved = [rc.tensor(a) for a in arrays]
            moved[i] = rc.tensor((arrays[i] + sign * eps * d).astype(np.float32))
            vals.append(float(loss(moved).item()))
        numeric = (vals[0] - vals[1]) / (2 * eps)
        analytic = float((grad * d).sum())
        tol = 1e-2 * abs(numeric) + 1e-3 * np.linalg.norm(grad) * np.linalg.norm(d)
        assert abs(analytic - numeric) <= tol, (i, analytic, numeric)


# --------------------------------------------------------------------------------------------
# fresh models through the registry
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["rwkv6", "rwkv7"])
def test_registry_models_train(arch: str) -> None:
    model = recurra_models.create(arch, vocab_size=32, n_embd=32, n_layer=2, head_size=8, seed=3)
    assert model.arch == arch
    cfg = type(model).Config.from_dict(model.config.to_dict())
    assert cfg == model.config
    toks = tokens(2, 5, vocab=32)
    loss = model.loss(toks[:, :-1], toks[:, 1:])
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    unused = {"blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2"}
    assert all(g is not None for n, g in grads.items() if n not in unused)
    assert all(np.isfinite(g.numpy()).all() for g in grads.values() if g is not None)
    # a state-dict round trip through the official loader keeps the logits
    again = type(model).from_official(model.state_dict())
    np.testing.assert_array_equal(again.forward(toks).numpy(), model.forward(toks).numpy())


# --------------------------------------------------------------------------------------------
# the PyTorch eager peer of bench/ (an independent implementation with autograd)
# --------------------------------------------------------------------------------------------
def _torch_peer() -> Any:
    torch = pytest.importorskip("torch")
    path = Path(__file__).resolve().parents[2] / "bench" / "torch_rwkv.py"
    spec = importlib.util.spec_from_file_location("bench_torch_rwkv", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return torch, mod


@pytest.mark.parametrize("version,name", [(6, "c32-h8"), (7, "c64-h16-no-layer0-v")])
def test_torch_peer_logits_and_full_model_gradients(version: int, name: str) -> None:
    """The bench peer matches the float64 reference; recurra's gradients of the LM loss with
    respect to every parameter match torch autograd in float64 (rel. 1e-3 of the largest)."""
    torch, peer = _torch_peer()
    case = case_of(version, name)
    model, sd, fwd = load(version, case, seed=6)
    toks = tokens(2, 6, seed=12)
    tm = peer.torch_rwkv_from_official(sd, dtype=torch.float64, head_size=case["head_size"])
    want, _ = fwd(sd, toks, head_size=case["head_size"])
    t_logits, t_state = tm(torch.from_numpy(toks[:, :4].astype(np.int64)))
    t_logits2, _ = tm(torch.from_numpy(toks[:, 4:].astype(np.int64)), t_state)
    got = torch.cat([t_logits, t_logits2], 1).detach().numpy()
    assert rel_err(got, want) < 1e-10
    # gradients of the next-token loss
    inp, tgt = toks[:, :-1], toks[:, 1:]
    model.loss(inp, tgt).backward()
    t_out, _ = tm(torch.from_numpy(inp.astype(np.int64)))
    loss = torch.nn.functional.cross_entropy(
        t_out.reshape(-1, t_out.shape[-1]), torch.from_numpy(tgt.astype(np.int64)).reshape(-1)
    )
    loss.backward()
    for key, p in model.named_parameters():
        want_g = tm.w(key).grad
        if want_g is None:  # layer 0's v0/v1/v2: unused by both
            assert p.grad is None or not np.asarray(p.grad.numpy()).any(), key
            continue
        want_g = want_g.numpy().reshape(p.shape)
        scale = max(np.abs(want_g).max(), 1e-6)
        assert np.abs(p.grad.numpy() - want_g).max() <= 1e-3 * scale, key

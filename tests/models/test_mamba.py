"""MambaLM / Mamba2LM: logits against transformers (loaded through load_pretrained from a
save_pretrained folder), step mode against the parallel path, gradients of whole blocks
against central finite differences, and the loader's errors.

Tolerances: logits within 1e-4 of the largest logit (float32 through 2 small layers is
~1e-6 off; a wrong term is off by > 1e-2); gradients as in tests/core/gradcheck.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gradcheck import check_grads

import recurra as rc
import recurra_models as rm
from recurra_models.mamba import MambaBlock, MambaConfig, MambaLM
from recurra_models.mamba2 import Mamba2Block, Mamba2Config, Mamba2LM


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def _perturb(hf_model: Any, seed: int) -> None:
    """Moves the parameters that transformers initialises to constants (norm weights,
    D, A_log rows) away from them, so that a wrong term cannot hide behind a 1 or a 0."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name or name.endswith((".D", "A_log", "conv1d.bias")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


# -- against transformers --------------------------------------------------------------------

MAMBA_CASES = [
    dict(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        state_size=8,
        expand=2,
        conv_kernel=4,
        tie_word_embeddings=True,
    ),
    dict(
        vocab_size=64,
        hidden_size=48,
        num_hidden_layers=2,
        state_size=4,
        expand=1,
        conv_kernel=3,
        time_step_rank=5,
        use_bias=True,
        tie_word_embeddings=False,
    ),
]


@pytest.mark.parametrize("hf_cfg", MAMBA_CASES)
def test_mamba_logits_equal_transformers(tmp_path: Path, hf_cfg: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref_model = transformers.MambaForCausalLM(transformers.MambaConfig(**hf_cfg)).eval()
    _perturb(ref_model, 1)
    ref_model.save_pretrained(tmp_path)
    model = rm.load_pretrained(tmp_path)
    assert isinstance(model, MambaLM)
    assert model.config.tie_embeddings == hf_cfg["tie_word_embeddings"]
    tokens = np.random.default_rng(0).integers(0, hf_cfg["vocab_size"], (2, 11))
    with torch.no_grad():
        ref = ref_model(torch.tensor(tokens)).logits.numpy()
    out = model(tokens.astype(np.int32)).numpy()
    assert out.shape == ref.shape
    assert rel_err(out, ref) < 1e-4


MAMBA2_CASES = [
    dict(
        vocab_size=80,
        hidden_size=32,
        num_hidden_layers=2,
        state_size=8,
        expand=2,
        conv_kernel=4,
        head_dim=16,
        num_heads=4,
        n_groups=2,
        chunk_size=8,
    ),
    dict(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        state_size=4,
        expand=2,
        conv_kernel=3,
        head_dim=4,
        num_heads=8,
        n_groups=1,
        chunk_size=4,
        tie_word_embeddings=True,
        use_bias=True,
        time_step_limit=(0.01, 0.08),
    ),
]


@pytest.mark.parametrize("hf_cfg", MAMBA2_CASES)
def test_mamba2_logits_equal_transformers(tmp_path: Path, hf_cfg: dict[str, Any]) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref_model = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**hf_cfg)).eval()
    _perturb(ref_model, 2)
    ref_model.save_pretrained(tmp_path)
    model = rm.load_pretrained(tmp_path)
    assert isinstance(model, Mamba2LM)
    tokens = np.random.default_rng(1).integers(0, hf_cfg["vocab_size"], (2, 13))
    with torch.no_grad():
        ref = ref_model(torch.tensor(tokens)).logits.numpy()
    out = model(tokens.astype(np.int32)).numpy()
    assert out.shape == ref.shape
    assert rel_err(out, ref) < 1e-4


# -- shapes, step mode ---------------------------------------------------------------------


def _models() -> list[Any]:
    return [
        rm.create("mamba", vocab_size=50, d_model=16, n_layer=2, d_state=4, seed=3),
        rm.create(
            "mamba2",
            vocab_size=50,
            d_model=16,
            n_layer=2,
            d_state=4,
            head_dim=8,
            n_groups=2,
            seed=4,
        ),
    ]


@pytest.mark.parametrize("idx", [0, 1])
def test_step_mode_equals_parallel(idx: int) -> None:
    model = _models()[idx]
    tokens = np.random.default_rng(5).integers(0, 50, (2, 9)).astype(np.int32)
    full = model(tokens)
    assert full.shape == (2, 9, 50) and full.dtype == "float32"
    full = full.numpy()
    # prefill 3 tokens through the parallel path, then one token per step
    logits, state = model.forward_with_state(tokens[:, :3])
    parts = [logits.numpy()]
    for t in range(3, 9):
        logits, state = model.forward_with_state(tokens[:, t : t + 1], state)
        parts.append(logits.numpy())
    assert rel_err(np.concatenate(parts, axis=1), full) < 1e-4
    # the state has a fixed size (O(1) per token) and an explicit zero state equals None
    shapes = [[tuple(s.shape) for s in layer] for layer in state]
    assert shapes == [[tuple(s.shape) for s in layer] for layer in model.init_state(2)]
    z, _ = model.forward_with_state(tokens, model.init_state(2))
    assert rel_err(z.numpy(), full) < 1e-6


def test_bad_tokens_and_states_raise() -> None:
    model = _models()[0]
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 50\)"):
        model(np.array([[1, 50]]))
    with pytest.raises(TypeError, match="integers"):
        model(np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match=r"\(batch, time\)"):
        model(np.zeros((1, 2, 3), np.int32))
    with pytest.raises(ValueError, match="state of layer 0"):
        model.forward_with_state(np.zeros((1, 2), np.int32), model.init_state(3))
    with pytest.raises(ValueError, match="unknown field"):
        rm.create("mamba", d_modle=8)
    with pytest.raises(ValueError, match="n_heads"):
        Mamba2Config(d_model=16, head_dim=8, n_heads=3)
    with pytest.raises(ValueError, match="unknown architecture 'gpt'"):
        rm.create("gpt")
    assert set(rm.architectures()) >= {"mamba", "mamba2", "rwkv6", "rwkv7"}


def test_training_reduces_loss_with_gradients_everywhere() -> None:
    from recurra_optim import AdamW

    model = rm.create("mamba2", vocab_size=16, d_model=16, n_layer=1, d_state=4, head_dim=8)
    opt = AdamW(list(model.parameters()), lr=1e-2)
    x = np.tile(np.arange(8, dtype=np.int32), (2, 2))[:, :15]
    y = np.tile(np.arange(1, 9, dtype=np.int32) % 8, (2, 2))[:, :15]
    first = None
    for _ in range(15):
        loss = model.loss(x, y)
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and np.isfinite(p.grad.numpy()).all(), name
        v = loss.item()
        first = v if first is None else first
        opt.step()
        opt.zero_grad()
    assert v < 0.7 * first


# -- gradients of whole blocks against finite differences -------------------------------------


def _block_grad_check(block: Any, names: list[str], x: np.ndarray, state: list[np.ndarray]) -> None:
    mods = dict(block.named_modules())
    params = dict(block.named_parameters())
    arrays = [params[n].numpy().astype(np.float64) for n in names]

    def fn(*ts: Any) -> Any:
        for n, t in zip(names, ts[: len(names)]):
            owner, _, attr = n.rpartition(".")
            setattr(mods[owner], attr, t)
        y, st = block(ts[len(names)], list(ts[len(names) + 1 :]))
        return (y, *st)

    check_grads(fn, [*arrays, x, *state])


def test_mamba_block_gradients_match_finite_differences() -> None:
    cfg = MambaConfig(
        vocab_size=8, d_model=4, n_layer=1, d_state=3, d_conv=3, expand=2, dt_rank=2, bias=True
    )
    rng = np.random.default_rng(0)
    block = MambaBlock(cfg, rng)
    p = dict(block.named_parameters())
    p["norm.weight"].assign_(1 + 0.3 * rng.standard_normal(4))
    p["mixer.D"].assign_(1 + 0.3 * rng.standard_normal(8))
    p["mixer.dt_proj.bias"].assign_(0.5 * rng.standard_normal(8))
    names = list(p)
    x = rng.standard_normal((1, 3, 4))
    state = [rng.standard_normal((1, 8, 2)), 0.5 * rng.standard_normal((1, 8, 1, 3))]
    _block_grad_check(block, names, x, state)


def test_mamba2_block_gradients_match_finite_differences() -> None:
    cfg = Mamba2Config(
        vocab_size=8,
        d_model=4,
        n_layer=1,
        d_state=2,
        d_conv=3,
        expand=2,
        head_dim=2,
        n_groups=2,
        bias=True,
    )
    rng = np.random.default_rng(1)
    block = Mamba2Block(cfg, rng)
    p = dict(block.named_parameters())
    p["norm.weight"].assign_(1 + 0.3 * rng.standard_normal(4))
    p["mixer.norm.weight"].assign_(1 + 0.3 * rng.standard_normal(8))
    p["mixer.D"].assign_(1 + 0.3 * rng.standard_normal(4))
    p["mixer.dt_bias"].assign_(0.5 * rng.standard_normal(4))
    names = list(p)
    x = rng.standard_normal((1, 3, 4))
    state = [rng.standard_normal((1, 16, 2)), 0.5 * rng.standard_normal((1, 4, 2, 2))]
    _block_grad_check(block, names, x, state)


# -- loader errors -----------------------------------------------------------------------------


def _save_small(tmp_path: Path) -> Path:
    """A Hugging Face style folder written by us (no torch needed)."""
    from recurra_models.loading import save_safetensors

    tmp_path.mkdir(parents=True)
    model = rm.create("mamba", vocab_size=32, d_model=16, n_layer=1, d_state=4)
    cfg = {
        "architectures": ["MambaForCausalLM"],
        "model_type": "mamba",
        "vocab_size": 32,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "state_size": 4,
        "expand": 2,
        "conv_kernel": 4,
        "intermediate_size": 32,
        "time_step_rank": 1,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_safetensors(tmp_path / "model.safetensors", model.state_dict())
    return tmp_path


def test_load_pretrained_round_trip_and_errors(tmp_path: Path) -> None:
    folder = _save_small(tmp_path / "ok")
    model = rm.load_pretrained(folder)
    ref = rm.create("mamba", vocab_size=32, d_model=16, n_layer=1, d_state=4)
    t = np.array([[1, 2, 3]], np.int32)
    np.testing.assert_array_equal(model(t).numpy(), ref(t).numpy())

    with pytest.raises(FileNotFoundError, match="nope"):
        rm.load_pretrained(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        rm.load_pretrained(empty)

    bad = _save_small(tmp_path / "badjson")
    (bad / "config.json").write_text('{"model_type": "mamba",,}')
    with pytest.raises(ValueError, match=r"config.json: invalid JSON at line 1"):
        rm.load_pretrained(bad)

    unk = _save_small(tmp_path / "unknown")
    (unk / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"config.json: unknown architecture.*LlamaForCausalLM"):
        rm.load_pretrained(unk)

    from recurra_models.loading import load_safetensors, save_safetensors

    miss = _save_small(tmp_path / "missing")
    sd, _ = load_safetensors(miss / "model.safetensors")
    del sd["backbone.layers.0.mixer.D"]
    save_safetensors(miss / "model.safetensors", sd)
    with pytest.raises(
        ValueError, match=r"model.safetensors: .*missing keys: 'backbone.layers.0.mixer.D'"
    ):
        rm.load_pretrained(miss)

    shape = _save_small(tmp_path / "shape")
    sd, _ = load_safetensors(shape / "model.safetensors")
    sd["backbone.norm_f.weight"] = np.ones(17, np.float32)
    save_safetensors(shape / "model.safetensors", sd)
    with pytest.raises(ValueError, match=r"'backbone.norm_f.weight' has shape \(17,\)"):
        rm.load_pretrained(shape)

    trunc = _save_small(tmp_path / "trunc")
    blob = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(blob[: len(blob) - 100])
    with pytest.raises(ValueError, match=r"model.safetensors: truncated"):
        rm.load_pretrained(trunc)

    nomodel = _save_small(tmp_path / "nomodel")
    (nomodel / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        rm.load_pretrained(nomodel)

    weird = tmp_path / "w.safetensors"
    save_safetensors(weird, {"a.weight": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="not an RWKV-6 or RWKV-7"):
        rm.load_pretrained(weird)


def test_safetensors_reader_widens_bf16_and_f16(tmp_path: Path) -> None:
    from recurra_models.loading import load_safetensors

    vals = np.array([1.5, -2.25, 3.0e-3, 65504.0], np.float32)
    bf16 = (vals.view(np.uint32) >> 16).astype("<u2")
    f16 = vals.astype("<f2")
    header = {
        "a": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
        "b": {"dtype": "F16", "shape": [4], "data_offsets": [8, 16]},
        "__metadata__": {"k": "v"},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bf16.tobytes() + f16.tobytes())
    out, meta = load_safetensors(path)
    assert meta == {"k": "v"} and out["a"].dtype == np.float32 and out["a"].shape == (2, 2)
    np.testing.assert_array_equal(
        out["a"].reshape(-1), (bf16.astype(np.uint32) << 16).view(np.float32)
    )
    np.testing.assert_array_equal(out["b"], f16.astype(np.float32))
    header["b"]["data_offsets"] = [6, 14]  # overlaps "a"
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bf16.tobytes() + f16.tobytes())
    with pytest.raises(ValueError, match="overlap"):
        load_safetensors(path)
    path.write_bytes(b"\x10\x00")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_safetensors(path)


_ = rc


def test_load_pretrained_keeps_bf16_weights_in_bf16(tmp_path: Path) -> None:
    import ml_dtypes

    from recurra_models.loading import (
        load_safetensors,
        read_safetensors_header,
        save_safetensors,
    )

    bf16 = np.dtype(ml_dtypes.bfloat16)
    folder = _save_small(tmp_path / "bf16")
    path = folder / "model.safetensors"
    sd, _ = load_safetensors(path)
    half = {k: v.astype(bf16) for k, v in sd.items()}
    save_safetensors(path, half)
    header, _ = read_safetensors_header(path)
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    raw, _ = load_safetensors(path, float32=False)  # as stored: no float32 copy
    for k, v in raw.items():
        assert v.dtype == bf16
        np.testing.assert_array_equal(v.view(np.uint16), half[k].view(np.uint16))

    model = rm.load_pretrained(folder, dtype=rc.bfloat16)
    params = dict(model.named_parameters())
    assert params and all(p.dtype == rc.bfloat16 for p in params.values())
    for name, p in params.items():
        assert p.storage.nbytes == p.size * 2
        np.testing.assert_array_equal(p.numpy().view(np.uint16), half[name].view(np.uint16))
    # saved again, the weights stay bfloat16 bit for bit
    again = tmp_path / "again.safetensors"
    save_safetensors(again, model.state_dict())
    back, _ = load_safetensors(again, float32=False)
    for k, v in back.items():
        np.testing.assert_array_equal(v.view(np.uint16), half[k].view(np.uint16))
    # by default the same file loads as float32 (exactly widened)
    wide = rm.load_pretrained(folder)
    for name, p in wide.named_parameters():
        assert p.dtype == rc.float32
        np.testing.assert_array_equal(p.numpy(), half[name].astype(np.float32))
    # the bf16 model cannot run yet (no autocast): a clear TypeError, not a wrong result (the
    # norm reads its 2-byte weight as it is; the product after it refuses the mix)
    with pytest.raises(TypeError, match="float32 only; cast it with|does not promote dtypes"):
        model(np.array([[1, 2, 3]], np.int32)).numpy()
    with pytest.raises(TypeError, match="float dtype"):
        rm.load_pretrained(folder, dtype="int32")

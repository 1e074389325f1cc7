"""Tokenizers (tokenizer.json, RWKV World, bytes), token files, streaming text, evaluation
and export (transformers folder / official RWKV file) of recurra_models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from text_fixtures import CORPUS, SAMPLE, hf_mamba_folder, make_bpe, make_world

import recurra_models as rm

pytest.importorskip("tokenizers")


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# -- tokenizer.json ------------------------------------------------------------------------


def test_bpe_ids_equal_tokenizers_and_transformers(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    folder = make_bpe(tmp_path / "tok")
    tok = rm.load_tokenizer(folder)
    assert isinstance(tok, rm.HFTokenizer)
    ref = Tokenizer.from_file(str(folder / "tokenizer.json"))
    texts = [SAMPLE, *CORPUS[:5], "", " leading space", "x" * 50]
    for t in texts:
        ids = tok.encode(t)
        assert ids.dtype == np.int32
        assert ids.tolist() == ref.encode(t, add_special_tokens=False).ids
        assert tok.decode(ids) == t  # byte-level BPE is lossless
    batch = tok.encode_batch(texts)
    assert [b.tolist() for b in batch] == [tok.encode(t).tolist() for t in texts]
    assert tok.encode_concat(texts).tolist() == np.concatenate(batch).tolist()
    assert tok.eos_id == ref.token_to_id("<|endoftext|>") == 0
    assert tok.pad_id == 1 and tok.vocab_size == ref.get_vocab_size()
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    for t in texts:
        assert tok.encode(t).tolist() == hf(t, add_special_tokens=False)["input_ids"]
        assert tok.encode(t, add_special_tokens=True).tolist() == hf(t)["input_ids"]
    assert hf.eos_token_id == tok.eos_id and hf.pad_token_id == tok.pad_id


def test_bpe_special_tokens_from_config_json_and_errors(tmp_path: Path) -> None:
    folder = make_bpe(tmp_path / "tok", with_config=False)
    assert rm.load_tokenizer(folder).eos_id is None
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 1, "pad_token_id": 0}))
    tok = rm.load_tokenizer(folder / "tokenizer.json")
    assert (tok.eos_id, tok.pad_id) == (1, 0)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        rm.load_tokenizer(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        rm.load_tokenizer(tmp_path)
    assert isinstance(rm.load_tokenizer("bytes"), rm.ByteTokenizer)


# -- RWKV World ----------------------------------------------------------------------------


def _greedy_reference(vocab: dict[int, bytes], data: bytes) -> list[int]:
    by_bytes = {v: k for k, v in vocab.items()}
    longest = max(map(len, by_bytes))
    out, i = [], 0
    while i < len(data):
        for n in range(min(longest, len(data) - i), 0, -1):
            if data[i : i + n] in by_bytes:
                out.append(by_bytes[data[i : i + n]])
                i += n
                break
    return out


def test_world_tokenizer_greedy_longest_match_and_round_trip(tmp_path: Path) -> None:
    from recurra_models.tokenizers import parse_world_vocab

    path = make_world(tmp_path / "rwkv_vocab_v20230424.txt")
    tok = rm.load_tokenizer(tmp_path)
    assert isinstance(tok, rm.WorldTokenizer) and tok.eos_id == 0
    vocab = parse_world_vocab(path)
    assert vocab[257] == b"the" and vocab[257 + 5] == "é".encode()
    for text in [SAMPLE, "the quick fox\n\nabcab", "日本語", "", *CORPUS[:5]]:
        ids = tok.encode(text)
        assert ids.tolist() == _greedy_reference(vocab, text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.encode(" quick").tolist() == [257 + 4]  # the longest match wins
    assert tok.encode("abcab").tolist() == [257 + 11, 257 + 10]
    assert [x.tolist() for x in tok.encode_batch(["ab", "the"])] == [[267], [257]]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("300 __import__('os').system('true') 4", "line 257"),
        ("300 'abc' 4", "3 bytes"),
        ("300 123 3", "not str or bytes"),
        ("1 'x' 1", "twice"),
        ("nonsense", "line 257"),
    ],
)
def test_world_vocab_parser_refuses_bad_lines(tmp_path: Path, line: str, needle: str) -> None:
    path = make_world(tmp_path / "v.txt", extra=[])
    lines = path.read_text(encoding="utf-8").splitlines()
    lines.insert(256, line)
    path.write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(ValueError, match=needle):
        rm.WorldTokenizer(path)


# -- streaming text ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bytes", "bpe", "world"])
def test_text_streamer_prints_only_complete_characters(tmp_path: Path, kind: str) -> None:
    if kind == "bytes":
        tok: Any = rm.ByteTokenizer()
    elif kind == "bpe":
        tok = rm.load_tokenizer(make_bpe(tmp_path / "t"))
    else:
        tok = rm.load_tokenizer(make_world(tmp_path / "rwkv_vocab_v20230424.txt"))
    text = "naïve 日本語 🙂🚀 done\n" * 6
    pieces = list(rm.TextStreamer(tok).stream(tok.encode(text).tolist()))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # a token that ends inside a character prints nothing until the character is complete
    if kind == "world":
        s, b = rm.TextStreamer(tok), "日本".encode()
        assert s.push(257 + 12) == ""  # the first 4 bytes of 日本語
        assert s.push(b[4] + 1) == ""
        assert s.push(b[5] + 1) == "日本"


# -- token files ---------------------------------------------------------------------------


def test_tokenize_files_caches_a_memmap_and_appends_eos(tmp_path: Path, monkeypatch) -> None:
    tok = rm.load_tokenizer(make_bpe(tmp_path / "tok"))
    txt = tmp_path / "a.txt"
    txt.write_text("\n".join(CORPUS) + "\n", encoding="utf-8")
    jl = tmp_path / "b.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(CORPUS[:4])))
    cache = tmp_path / "cache"
    seen: list[tuple[int, int]] = []
    arr = rm.tokenize_files([txt, jl], tok, cache, progress=lambda d, t: seen.append((d, t)))
    assert isinstance(arr, np.memmap) and arr.dtype == np.uint16
    want = [*tok.encode(txt.read_text(encoding="utf-8")).tolist(), 0]
    for t in CORPUS[:4]:
        want += [*tok.encode(t).tolist(), 0]
    assert arr.tolist() == want
    assert seen[-1][0] == seen[-1][1] == txt.stat().st_size + jl.stat().st_size
    assert len(list(cache.glob("tokens-*.uint16.bin"))) == 1
    # the Trainer keeps the mapped file (no int32 copy); its batches are int32
    from recurra_models.training import data_hash
    from recurra_optim import SGD

    net = rm.create("mamba", vocab_size=tok.vocab_size, d_model=8, n_layer=1)
    trainer = rm.Trainer(net, SGD(net.parameters(), lr=0.1), arr, batch_size=2, seq_len=8)
    assert np.shares_memory(trainer.data, arr) and trainer.data.dtype == np.uint16
    x, y = rm.batch_at(arr, 2, 8, 0, 0)
    assert x.dtype == y.dtype == np.int32
    assert trainer._data_hash == data_hash(np.asarray(arr, np.int32))
    # the second run reads the cache instead of tokenizing
    monkeypatch.setattr(type(tok), "encode_concat", lambda *a: 1 / 0)
    again = rm.tokenize_files([txt, jl], tok, cache)
    assert again.tolist() == want
    # another text field is another key; a record without it names the file and line
    with pytest.raises(ValueError, match=r"b.jsonl, line 1: no string field 'body'"):
        rm.tokenize_files([jl], tok, cache, text_field="body")
    assert len(list(cache.glob("*.tmp"))) == 0
    # bytes, without a cache: in memory, small chunks cut at newlines only
    b = rm.tokenize_files([txt], rm.ByteTokenizer(), None, chunk_bytes=64)
    assert bytes(b.astype(np.uint8)) == txt.read_bytes()


# -- evaluation and export against transformers --------------------------------------------


def _hf_mamba(kind: str, tmp_path: Path, vocab: int) -> tuple[Any, Path]:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return hf_mamba_folder(kind, tmp_path / f"hf-{kind}", vocab)


def _hf_logits(folder: Path, kind: str, tokens: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    cls = transformers.MambaForCausalLM if kind == "mamba" else transformers.Mamba2ForCausalLM
    ref = cls.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        return ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_export_hf_loads_in_transformers_with_equal_logits(tmp_path: Path, kind: str) -> None:
    _, folder = _hf_mamba(kind, tmp_path, 400)
    model = rm.load_pretrained(folder)
    assert isinstance(model.tokenizer, rm.HFTokenizer) and model.tokenizer.eos_id == 0
    # change the weights so that the export is not the input folder again
    model.load_state_dict({k: v * 1.01 for k, v in model.state_dict().items()})
    out = rm.save_pretrained(model, tmp_path / "export")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    tokens = rm.load_tokenizer(out).encode(SAMPLE)[None, :]
    ours = model(tokens).numpy()
    assert rel_err(_hf_logits(out, kind, tokens), ours) < 1e-4
    back = rm.load_pretrained(out)
    assert back.config == model.config
    assert rel_err(back(tokens).numpy(), ours) < 1e-6
    # refuses to overwrite a non-empty folder, replaces it with overwrite=True
    with pytest.raises(FileExistsError, match="not empty"):
        rm.save_pretrained(model, out)
    rm.save_pretrained(model, out, overwrite=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]
    import transformers

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf_tok(SAMPLE, add_special_tokens=False)["input_ids"] == tokens[0].tolist()


def test_evaluate_tokens_equals_transformers_perplexity(tmp_path: Path) -> None:
    import torch

    ref, folder = _hf_mamba("mamba", tmp_path, 400)
    model = rm.load_pretrained(folder)
    data = model.tokenizer.encode(" ".join(CORPUS[:6]))
    seq = 37
    res = rm.evaluate_tokens(model, data, seq_len=seq, batch_size=3)
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, data.size, seq):
            w = torch.tensor(data[i : i + seq], dtype=torch.long)[None]
            if w.shape[1] < 2:
                continue
            total += float(ref(w, labels=w).loss) * (w.shape[1] - 1)
            count += w.shape[1] - 1
    assert data.size % seq > 1  # the partial window is included
    assert res["tokens"] == count
    assert abs(res["loss"] - total / count) <= 1e-4 * abs(total / count)
    assert abs(res["perplexity"] - np.exp(total / count)) <= 1e-3 * np.exp(total / count)


@pytest.mark.parametrize("arch", ["rwkv6", "rwkv7"])
def test_export_rwkv_loads_back_equal(tmp_path: Path, arch: str) -> None:
    sizes = {
        "rwkv6": dict(n_embd=32, n_layer=2, head_size=16),
        "rwkv7": dict(n_embd=32, n_layer=2, head_size=16),
    }
    model = rm.create(arch, vocab_size=300, seed=3, **sizes[arch])
    world = rm.WorldTokenizer(make_world(tmp_path / "rwkv_vocab_v20230424.txt"))
    out = rm.save_pretrained(model, tmp_path / "out", world)
    assert (out / "rwkv_vocab_v20230424.txt").is_file()
    back = rm.load_pretrained(out)
    assert type(back) is type(model) and isinstance(back.tokenizer, rm.WorldTokenizer)
    sd, sd2 = model.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(np.array_equal(sd[k], sd2[k]) for k in sd)
    with pytest.raises(ValueError, match="format='rwkv'"):
        rm.save_pretrained(model, tmp_path / "hf", format="hf")

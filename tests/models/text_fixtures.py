"""Small tokenizer files built by the tests themselves (nothing is downloaded): a GPT-NeoX
style byte-level BPE trained with the tokenizers library, and an RWKV World vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "The five boxing wizards jump quickly; naïve café owners sip crème brûlée.",
    "Mamba and RWKV are recurrent language models with a constant-size state.",
    "日本語のテキストも少し。 emoji: 🙂🚀, numbers 12345 67.89",
    "she sells sea shells by the sea shore\n\nnew paragraph\ttabbed   spaces",
] * 20

SAMPLE = "The quick brown fox: naïve café, 日本語 🙂 and  two  spaces\nnew line 42"


def make_bpe(folder: Path, vocab_size: int = 400, with_config: bool = True) -> Path:
    """Trains a byte-level BPE (GPT-NeoX's layout: ByteLevel pre-tokenizer and decoder,
    <|endoftext|> = 0, <|padding|> = 1) on CORPUS and writes tokenizer.json (and
    tokenizer_config.json / special_tokens_map.json) into ``folder``; returns it."""
    from recurra_models.tokenizers import train_byte_bpe

    train_byte_bpe(CORPUS, vocab_size, folder)
    if not with_config:
        (folder / "tokenizer_config.json").unlink()
    else:
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|endoftext|>",
            "bos_token": "<|endoftext|>",
            "pad_token": "<|padding|>",
            "model_max_length": 2048,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        (folder / "special_tokens_map.json").write_text(
            json.dumps({"eos_token": {"content": "<|endoftext|>"}, "pad_token": "<|padding|>"})
        )
    return folder


WORLD_EXTRA = [
    "the",
    " the",
    "qu",
    "quick",
    " quick",
    "é",
    "日本",
    "語",
    " fox",
    "\n\n",
    "ab",
    "abc",
]


def make_world(path: Path, extra: list[str] | bytes | None = None) -> Path:
    """An RWKV World vocabulary file: ids 1..256 the single bytes (bytes literals), then
    WORLD_EXTRA as str literals and one partial UTF-8 byte pair as a bytes literal."""
    lines = [f"{i + 1} {bytes([i])!r} 1" for i in range(256)]
    tokens: list[str | bytes] = list(extra if extra is not None else WORLD_EXTRA)
    tokens.append("日本語".encode()[:4])  # a token that ends inside a character
    for j, t in enumerate(tokens):
        n = len(t.encode("utf-8")) if isinstance(t, str) else len(t)
        lines.append(f"{257 + j} {t!r} {n}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def hf_mamba_folder(kind: str, folder: Path, vocab: int = 400) -> tuple[Any, Path]:
    """A tiny random transformers Mamba ("mamba") or Mamba-2 ("mamba2") model saved with
    save_pretrained into ``folder``, with make_bpe's tokenizer; returns (model, folder)."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2)
    common.update(conv_kernel=4, eos_token_id=0, pad_token_id=1, bos_token_id=0)
    if kind == "mamba":
        cfg = transformers.MambaConfig(time_step_rank=4, **common)
        ref = transformers.MambaForCausalLM(cfg).eval()
    else:
        sizes = dict(head_dim=16, num_heads=4, n_groups=1, chunk_size=8)
        ref = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**sizes, **common)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D")):
                p.add_(0.1 * torch.randn_like(p))
    ref.save_pretrained(folder)
    make_bpe(folder)
    return ref, folder

"""Tokenizers of pretrained checkpoints behind one interface, and text streaming.

- :class:`HFTokenizer`: a transformers folder's ``tokenizer.json`` run by the ``tokenizers``
  library (the GPT-NeoX byte-level BPE of the Mamba checkpoints, or any other), with the
  special tokens of the folder's ``tokenizer_config.json`` / ``special_tokens_map.json`` /
  ``config.json``;
- :class:`WorldTokenizer`: the RWKV "World" vocabulary (``rwkv_vocab_v20230424.txt``:
  one ``<id> <python str or bytes literal> <byte length>`` per line), greedy longest match;
- :class:`~recurra_models.tokenizer.ByteTokenizer`: one token per UTF-8 byte.

Each has ``encode(text) -> int32 array``, ``encode_batch(texts)``, ``decode(ids) -> str``,
``vocab_size``, ``eos_id`` (None when there is none), ``fingerprint`` (a digest of what
decides the ids) and ``save(folder)``. :func:`load_tokenizer` picks one for a path.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from recurra._install import install_hint
from recurra_models.loading import read_json
from recurra_models.tokenizer import ByteTokenizer

__all__ = [
    "HFTokenizer",
    "TextStreamer",
    "WorldTokenizer",
    "find_tokenizer",
    "load_tokenizer",
    "train_byte_bpe",
]

WORLD_VOCAB = "rwkv_vocab_v20230424.txt"
# What transformers writes next to tokenizer.json; copied along on save.
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _ids_array(ids: Iterable[int] | np.ndarray | Any) -> np.ndarray:
    arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids)).reshape(-1)
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {arr.dtype}")
    return arr


def _token_name(v: Any) -> str | None:
    """A special token as written in tokenizer_config.json (a str, or {"content": str})."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _flat_ids(encodings: Sequence[Any]) -> np.ndarray:
    """The ids of a list of ``tokenizers.Encoding`` concatenated, as int32 (no Python loop
    per token)."""
    lists = [e.ids for e in encodings]
    total = sum(map(len, lists))
    return np.fromiter(itertools.chain.from_iterable(lists), np.int32, count=total)


class HFTokenizer:
    """A ``tokenizer.json`` (``tokenizers`` library) with the folder's special tokens.

    ``eos_id`` / ``pad_id`` / ``bos_id`` come from tokenizer_config.json, then
    special_tokens_map.json, then config.json's ``eos_token_id`` / ``pad_token_id`` /
    ``bos_token_id``. Raises FileNotFoundError / ValueError naming the file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(
                "reading tokenizer.json needs the tokenizers library: " + install_hint("tokenizers")
            ) from None
        p = Path(os.fspath(path))
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"{file}: tokenizer.json not found")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception
            raise ValueError(f"{file}: not a tokenizers tokenizer.json ({e})") from None
        self.path, self.folder = file, file.parent
        self.special: dict[str, str] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later wins
            f = self.folder / name
            if f.is_file():
                cfg = read_json(f, name)
                for key in ("eos_token", "pad_token", "bos_token", "unk_token"):
                    tok = _token_name(cfg.get(key)) if isinstance(cfg, dict) else None
                    if tok is not None:
                        self.special[key] = tok
        model_cfg: dict[str, Any] = {}
        if (self.folder / "config.json").is_file():
            c = read_json(self.folder / "config.json", "config.json")
            model_cfg = c if isinstance(c, dict) else {}

        def pick(key: str) -> int | None:
            name = self.special.get(f"{key}_token")
            tid = self._tok.token_to_id(name) if name is not None else None
            if tid is not None:
                return int(tid)
            v = model_cfg.get(f"{key}_token_id")
            if isinstance(v, list):
                v = v[0] if v else None
            return int(v) if isinstance(v, int) else None

        self.eos_id, self.pad_id, self.bos_id = pick("eos"), pick("pad"), pick("bos")
        self._fast = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        h = hashlib.sha256(b"hf\0" + file.read_bytes())
        self.fingerprint = h.hexdigest()

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """The ids of ``text`` (int32). ``add_special_tokens`` runs the tokenizer's
        post-processor (a BOS, where it has one), as transformers does by default."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return np.asarray(
            self._tok.encode(text, add_special_tokens=add_special_tokens).ids, dtype=np.int32
        )

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[np.ndarray]:
        """``encode`` of each text, in parallel (the library's batch encoding)."""
        encs = self._fast(list(texts), add_special_tokens=add_special_tokens)
        return [np.asarray(e.ids, dtype=np.int32) for e in encs]

    def encode_concat(self, texts: Sequence[str]) -> np.ndarray:
        """The ids of all texts, concatenated into one int32 array (batch encoding)."""
        return _flat_ids(self._fast(list(texts), add_special_tokens=False))

    def decode(
        self, ids: Iterable[int] | np.ndarray | Any, skip_special_tokens: bool = False
    ) -> str:
        arr = _ids_array(ids)
        return str(self._tok.decode(arr.tolist(), skip_special_tokens=skip_special_tokens))

    def save(self, folder: str | os.PathLike[str]) -> None:
        """Copies tokenizer.json and the folder's tokenizer configs into ``folder`` (a
        tokenizer_config.json is written when there was none, so that transformers'
        AutoTokenizer can read the folder)."""
        out = Path(os.fspath(folder))
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path, out / "tokenizer.json")
        for name in _HF_FILES[1:]:
            if (self.folder / name).is_file():
                shutil.copyfile(self.folder / name, out / name)
        if not (out / "tokenizer_config.json").is_file():
            cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
            cfg.update(self.special)
            (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))

    def __repr__(self) -> str:
        return (
            f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"
        )


def parse_world_vocab(path: str | os.PathLike[str]) -> dict[int, bytes]:
    """id -> bytes of an RWKV World vocabulary file. Each line is ``<id> <literal> <len>``
    where the literal is a Python str or bytes literal (read with ``ast.literal_eval``,
    never executed) and len its UTF-8 byte length.

    Raises FileNotFoundError, or ValueError naming the file and the line."""
    p = Path(os.fspath(path))
    if not p.is_file():
        raise FileNotFoundError(f"{p}: RWKV vocabulary file not found")
    out: dict[int, bytes] = {}
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            first, last = line.find(" "), line.rfind(" ")
            try:
                if first <= 0 or last <= first:
                    raise ValueError("expected '<id> <literal> <length>'")
                idx, length = int(line[:first]), int(line[last + 1 :])
                lit = ast.literal_eval(line[first + 1 : last])
                if isinstance(lit, str):
                    lit = lit.encode("utf-8")
                if not isinstance(lit, bytes):
                    raise ValueError(f"the literal is a {type(lit).__name__}, not str or bytes")
                if len(lit) != length:
                    raise ValueError(f"the token has {len(lit)} bytes, the line says {length}")
                if idx in out:
                    raise ValueError(f"id {idx} appears twice")
            except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
                raise ValueError(f"{p}, line {n}: {e}") from None
            out[idx] = lit
    if not out:
        raise ValueError(f"{p}: the vocabulary is empty")
    return out


class WorldTokenizer:
    """The RWKV World tokenizer: greedy longest match of the UTF-8 bytes over a trie of the
    vocabulary (the official ``TRIE_TOKENIZER``). Id 0 is the end-of-text token."""

    eos_id: int | None = 0
    pad_id: int | None = 0

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(os.fspath(path))
        self.path = p / WORLD_VOCAB if p.is_dir() else p
        self.idx2bytes = parse_world_vocab(self.path)
        self.vocab_size = max(self.idx2bytes) + 1
        self._table = [b""] * self.vocab_size
        root: dict[int, Any] = {}
        for idx, tok in self.idx2bytes.items():
            self._table[idx] = tok
            node = root
            for byte in tok:
                node = node.setdefault(byte, {})
            node[-1] = idx
        self._root = root
        self.fingerprint = hashlib.sha256(b"world\0" + self.path.read_bytes()).hexdigest()

    def _encode_bytes(self, src: bytes) -> list[int]:
        root, out, i, n = self._root, [], 0, len(src)
        while i < n:
            node, j, best, end = root, i, -1, i
            while j < n:
                child = node.get(src[j])
                if child is None:
                    break
                node = child
                j += 1
                tid = node.get(-1)
                if tid is not None:
                    best, end = tid, j
            if best < 0:
                raise ValueError(f"WorldTokenizer: byte {src[i]:#04x} is not in the vocabulary")
            out.append(best)
            i = end
        return out

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return np.asarray(self._encode_bytes(text.encode("utf-8")), dtype=np.int32)

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = False
    ) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_concat(self, texts: Sequence[str]) -> np.ndarray:
        return self.encode("".join(texts))

    def decode_bytes(self, ids: Iterable[int] | np.ndarray | Any) -> bytes:
        arr = _ids_array(ids)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        table = self._table
        return b"".join(table[i] for i in arr.tolist())

    def decode(self, ids: Iterable[int] | np.ndarray | Any) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, folder: str | os.PathLike[str]) -> None:
        out = Path(os.fspath(folder))
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path, out / self.path.name)

    def __repr__(self) -> str:
        return f"WorldTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def _world_file(folder: Path) -> Path | None:
    if (folder / WORLD_VOCAB).is_file():
        return folder / WORLD_VOCAB
    cands = sorted(folder.glob("rwkv_vocab*.txt"))
    return cands[0] if len(cands) == 1 else None


def find_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer stored with a checkpoint, or None: ``tokenizer.json`` in a transformers
    folder, an RWKV World vocabulary (``rwkv_vocab*.txt``) in the folder (or next to the
    checkpoint file), a ``tokenizer/`` subfolder (a ``recurra train`` run)."""
    p = Path(os.fspath(path))
    folder = p if p.is_dir() else p.parent
    for d in (folder, folder / "tokenizer"):
        if (d / "tokenizer.json").is_file():
            return HFTokenizer(d)
        w = _world_file(d) if d.is_dir() else None
        if w is not None:
            return WorldTokenizer(w)
        if (d / "bytes.json").is_file():
            return ByteTokenizer()
    return None


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A tokenizer: ``"bytes"`` (:class:`ByteTokenizer`), a ``tokenizer.json`` or a folder
    holding one (:class:`HFTokenizer`), an RWKV World vocabulary file or a folder holding
    one (:class:`WorldTokenizer`).

    Raises FileNotFoundError when the path holds no tokenizer, ValueError naming the file
    for a damaged one."""
    if str(path) in ("bytes", "byte"):
        return ByteTokenizer()
    p = Path(os.fspath(path))
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such tokenizer file or folder")
    if p.is_file():
        if p.suffix == ".json":
            return HFTokenizer(p)
        if p.suffix == ".txt":
            return WorldTokenizer(p)
        raise ValueError(
            f"{p}: not a tokenizer file (expected tokenizer.json or a .txt vocabulary)"
        )
    tok = find_tokenizer(p)
    if tok is None:
        raise FileNotFoundError(
            f"{p}: no tokenizer in this folder (expected tokenizer.json or {WORLD_VOCAB})"
        )
    return tok


def train_byte_bpe(
    texts: Iterable[str],
    vocab_size: int,
    folder: str | os.PathLike[str],
    special_tokens: Sequence[str] = ("<|endoftext|>", "<|padding|>"),
) -> HFTokenizer:
    """Trains a GPT-NeoX-style byte-level BPE (ByteLevel pre-tokenizer and decoder, the
    special tokens first: ``<|endoftext|>`` = 0) on ``texts`` with the tokenizers library,
    writes ``tokenizer.json`` and a ``tokenizer_config.json`` (EOS = the first special
    token, padding = the second) into ``folder`` and returns it loaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out = Path(os.fspath(folder))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, name in zip(("eos_token", "pad_token"), special_tokens):
        cfg[key] = name
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return HFTokenizer(out)


def save_tokenizer(tokenizer: Any, folder: str | os.PathLike[str]) -> None:
    """Writes ``tokenizer``'s files into ``folder`` (for a ByteTokenizer, a ``bytes.json``
    marker that :func:`find_tokenizer` reads back)."""
    if isinstance(tokenizer, ByteTokenizer):
        out = Path(os.fspath(folder))
        out.mkdir(parents=True, exist_ok=True)
        (out / "bytes.json").write_text(json.dumps({"tokenizer": "bytes", "vocab_size": 256}))
    else:
        tokenizer.save(folder)


class TextStreamer:
    """Turns token ids, one at a time, into printable text: :meth:`push` returns the new
    complete characters (a piece that ends inside a multi-byte UTF-8 character is held back
    until the character is complete), :meth:`flush` the rest.

    Works with any tokenizer whose ``decode`` of a run of ids is the concatenation of
    their bytes decoded with replacement characters (byte-level BPE, World, bytes)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._ids: list[int] = []
        self._printed = self._held = 0

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text: str = self.tok.decode(self._ids)
        if text.endswith("\ufffd") and self._held < 4:
            self._held += 1  # maybe an incomplete character (at most 4 bytes): wait
            return ""
        self._held = 0
        new = text[self._printed :]
        if text.endswith(("\n", " ")) or len(self._ids) > 64:
            self._ids, self._printed = [], 0  # start a new window (keeps decode O(1))
        else:
            self._printed = len(text)
        return new

    def flush(self) -> str:
        text = self.tok.decode(self._ids) if self._ids else ""
        new = text[self._printed :]
        self._ids, self._printed = [], 0
        return new

    def stream(self, ids: Iterable[int]) -> Iterator[str]:
        for i in ids:
            piece = self.push(i)
            if piece:
                yield piece
        tail = self.flush()
        if tail:
            yield tail

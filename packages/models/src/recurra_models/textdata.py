"""Text files to token files: tokenized once, cached, read back memory-mapped.

:func:`tokenize_files` reads plain text (``.txt`` or anything not ``.jsonl``) or JSON
lines (``.jsonl``: the ``text_field`` of every record), encodes chunks of lines with the
tokenizer's batch encoding (the ``tokenizers`` library's parallel ``encode_batch`` for a
``tokenizer.json``; for a byte-level BPE the ids equal those of the whole text), appends
the EOS token after every document (each .jsonl record, each plain file) when the
tokenizer has one, and writes the ids as ``uint16`` (vocabularies up
to 65536) or ``int32`` into ``<cache_dir>/tokens-<key>.<dtype>.bin``. The key is a hash of
the files' contents, the text field and the tokenizer's fingerprint, so a second run on the
same inputs reads the file back instead of tokenizing again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["token_dtype", "tokenize_files"]

CHUNK_BYTES = 1 << 20
# Plain text is cut into pieces before a line that starts with a non-space character: a
# byte-level BPE's pre-tokenizer (GPT-2 / GPT-NeoX regex) never joins "\n" with what
# follows such a line start, so encoding the pieces apart gives the ids of the whole text.
_PIECES = re.compile(r"(?<=\n)(?=\S)")
Progress = Callable[[int, int], Any]  # (bytes done, bytes total)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def _chunks(path: Path, size: int) -> Iterator[tuple[str, int]]:
    """(text, bytes read) pieces of a file, cut after a newline that a non-space byte
    follows (never inside a UTF-8 character, nor where the cut could change the BPE's
    pre-tokens); invalid UTF-8 becomes U+FFFD."""
    carry = b""
    with open(path, "rb") as f:
        while True:
            block = f.read(size)
            if not block:
                break
            block = carry + block
            cut = _cut(block)
            if cut == 0:
                carry = block
                continue
            carry = block[cut:]
            yield block[:cut].decode("utf-8", errors="replace"), cut
    if carry:
        yield carry.decode("utf-8", errors="replace"), len(carry)


def _cut(block: bytes) -> int:
    """The offset after the last newline of ``block`` that a non-space byte follows, 0 for
    none."""
    i = block.rfind(b"\n", 0, len(block) - 1)
    while i >= 0 and block[i + 1 : i + 2].isspace():
        i = block.rfind(b"\n", 0, i)
    return i + 1


def _documents(path: Path, text_field: str, size: int) -> Iterator[tuple[list[str], bool, int]]:
    """(texts, ends_documents, bytes read) batches of a file. Plain text gives chunks of
    lines (one document per file); .jsonl gives the ``text_field`` of each record, each
    record one document."""
    jsonl = path.suffix.lower() == ".jsonl"
    line_no = 0
    for text, nbytes in _chunks(path, size):
        if not jsonl:
            yield _PIECES.split(text), False, nbytes
            continue
        docs = []
        for line in text.splitlines():
            line_no += 1
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {line_no}: invalid JSON ({e.msg})") from None
            value = rec.get(text_field) if isinstance(rec, dict) else None
            if not isinstance(value, str):
                raise ValueError(
                    f"{path}, line {line_no}: no string field {text_field!r} (use --text-field)"
                )
            docs.append(value)
        yield docs, True, nbytes


def _key(paths: Sequence[Path], tokenizer: Any, text_field: str) -> str:
    h = hashlib.sha256()
    h.update(f"v1\0{getattr(tokenizer, 'fingerprint', type(tokenizer).__name__)}\0".encode())
    h.update(f"{text_field}\0{getattr(tokenizer, 'eos_id', None)}\0".encode())
    for p in paths:
        h.update(f"{p.suffix.lower()}\0{p.stat().st_size}\0".encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()[:24]


def tokenize_files(
    paths: Sequence[str | os.PathLike[str]],
    tokenizer: Any,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    text_field: str = "text",
    progress: Progress | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> np.ndarray:
    """The token ids of the text files, memory-mapped from the cache (``cache_dir``) or,
    without a cache folder, in memory. See the module docstring.

    Raises FileNotFoundError naming a missing file, ValueError naming the file (and line)
    for an empty input or a .jsonl record without ``text_field``."""
    files = [Path(os.fspath(p)) for p in paths]
    if not files:
        raise ValueError("no data files given")
    for p in files:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: data file not found")
        if p.stat().st_size == 0:
            raise ValueError(f"{p}: the file is empty")
    dtype = token_dtype(int(tokenizer.vocab_size))
    key = _key(files, tokenizer, text_field)
    total = sum(p.stat().st_size for p in files)
    if cache_dir is not None:
        cache = Path(os.fspath(cache_dir))
        final = cache / f"tokens-{key}.{dtype.name}.bin"
        if final.is_file() and final.stat().st_size > 0:
            if progress is not None:
                progress(total, total)
            return np.memmap(final, dtype=dtype, mode="r")
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=cache)
    else:
        final = None
        fd, tmp_name = tempfile.mkstemp(prefix="recurra-tokens-", suffix=".bin")
    eos = getattr(tokenizer, "eos_id", None)
    eos_arr = np.array([eos] if eos is not None else [], dtype=dtype)
    done = count = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for p in files:
                for texts, per_doc, nbytes in _documents(p, text_field, chunk_bytes):
                    if per_doc and eos is not None:
                        for ids in tokenizer.encode_batch(texts):
                            out.write(ids.astype(dtype).tobytes())
                            out.write(eos_arr.tobytes())
                            count += ids.size + 1
                    elif texts:
                        ids = tokenizer.encode_concat(texts).astype(dtype, copy=False)
                        out.write(ids.tobytes())
                        count += ids.size
                    done += nbytes
                    if progress is not None:
                        progress(done, total)
                if not (p.suffix.lower() == ".jsonl") and eos is not None:
                    out.write(eos_arr.tobytes())
                    count += 1
            out.flush()
            if final is not None:
                os.fsync(out.fileno())
        if count == 0:
            raise ValueError(f"{', '.join(map(str, files))}: no text to train on")
        if final is None:
            arr = np.fromfile(tmp_name, dtype=dtype)
            os.unlink(tmp_name)
            return arr
        os.replace(tmp_name, final)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return np.memmap(final, dtype=dtype, mode="r")

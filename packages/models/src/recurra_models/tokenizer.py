"""Byte-level tokenization: every UTF-8 byte is a token (vocabulary 256), nothing to
download."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """Text <-> token ids, one id per UTF-8 byte (``vocab_size = 256``)."""

    vocab_size = 256
    eos_id: int | None = None
    pad_id: int | None = None
    fingerprint = "bytes"

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """The UTF-8 bytes of ``text`` as an int32 array. Raises TypeError for non-str."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode takes a str, got {type(text).__name__}")
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(
        self, texts: Iterable[str], add_special_tokens: bool = False
    ) -> list[np.ndarray]:
        """``encode`` of each text."""
        return [self.encode(t) for t in texts]

    def encode_concat(self, texts: Iterable[str]) -> np.ndarray:
        """The bytes of all texts, concatenated (int32)."""
        return self.encode("".join(texts))

    def decode(self, ids: Iterable[int] | np.ndarray | Any) -> str:
        """The text of the byte ids (invalid UTF-8 becomes U+FFFD).

        Raises ValueError for ids outside [0, 256)."""
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1)
        if arr.size == 0:
            return ""
        if arr.dtype.kind not in "iu":
            raise ValueError(f"ByteTokenizer.decode: ids must be integers, got {arr.dtype}")
        if int(arr.min()) < 0 or int(arr.max()) > 255:
            raise ValueError(
                f"ByteTokenizer.decode: ids must be in [0, 256), got min {int(arr.min())}, "
                f"max {int(arr.max())}"
            )
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def encode_file(self, path: str | os.PathLike[str]) -> np.ndarray:
        """The bytes of a file as int32 token ids (for training on a text file).

        Raises FileNotFoundError naming the file, ValueError for an empty file."""
        p = os.fspath(path)
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p}: text file not found")
        data = np.fromfile(p, dtype=np.uint8)
        if data.size == 0:
            raise ValueError(f"{p}: the file is empty")
        return data.astype(np.int32)

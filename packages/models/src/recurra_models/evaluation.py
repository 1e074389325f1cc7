"""Held-out loss and perplexity of a language model on a token array."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import recurra as rc

__all__ = ["evaluate_tokens"]


def evaluate_tokens(
    model: Any, tokens: Any, seq_len: int = 256, batch_size: int = 8
) -> dict[str, float]:
    """Next-token cross-entropy of ``model`` over ``tokens`` (1-D ints).

    The tokens are cut into non-overlapping windows of ``seq_len`` (the last, shorter one
    included); each window is scored on its own (from the zero state) on its ``len - 1``
    next-token predictions, and the loss is the mean over all predictions (a mean over
    windows weighted by their number of tokens). This is what transformers computes with
    ``model(window, labels=window).loss`` per window weighted by ``len(window) - 1``.

    Returns ``{"loss", "perplexity", "tokens"}`` (tokens: the number of predictions).
    Raises ValueError for fewer than 2 tokens or a bad seq_len / batch_size."""
    data = np.asarray(tokens).reshape(-1)
    if data.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got {data.dtype}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an integer >= 2, got {seq_len!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if data.size < 2:
        raise ValueError(f"need at least 2 tokens to evaluate, got {data.size}")
    n_full = data.size // seq_len
    full = np.asarray(data[: n_full * seq_len], dtype=np.int32).reshape(n_full, seq_len)
    rest = np.asarray(data[n_full * seq_len :], dtype=np.int32)
    total, count = 0.0, 0
    was = model.training
    model.eval()
    try:
        with rc.no_grad():
            for i in range(0, n_full, batch_size):
                w = full[i : i + batch_size]
                loss = float(model.loss(w[:, :-1], w[:, 1:]).item())
                n = w.shape[0] * (seq_len - 1)
                total, count = total + loss * n, count + n
            if rest.size >= 2:
                loss = float(model.loss(rest[None, :-1], rest[None, 1:]).item())
                total, count = total + loss * (rest.size - 1), count + rest.size - 1
    finally:
        model.train(was)
    mean = total / count
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "tokens": float(count)}

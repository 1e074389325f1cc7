"""Pieces shared by the language models: the CausalLM base class, token checks, configs,
running several lazy tensors in one graph."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

import recurra as rc
from recurra import ops
from recurra_models import nn

__all__ = [
    "CausalLM",
    "ConfigBase",
    "State",
    "as_tokens",
    "chunk_rows",
    "chunked_cross_entropy",
    "realize",
]

State = list[list[Any]]  # one list of recurra tensors per layer

# CausalLM.loss: logits (batch * time * vocab float32) past LOSS_CHUNK_ABOVE bytes are made
# in chunks of at most LOSS_CHUNK_BYTES (of the logits as the head computes them: 2-byte
# under autocast, twice the rows of float32 chunks). Below, a step keeps its speed: chunks
# cost one more head product each in the backward (at 4 x 256 tokens, vocab 50k, 2 cores: a
# 2-layer step 37% slower, the 130M model ~8%) for memory that does not matter there.
LOSS_CHUNK_BYTES = 64 << 20
LOSS_CHUNK_ABOVE = 512 << 20


def realize(tensors: Sequence[Any]) -> None:
    """Computes every pending tensor of ``tensors`` in one graph run (one plan), so that
    results that share work (logits and the recurrent states of a step) are computed once
    and later graphs do not reach back into this one."""
    pending = [t for t in tensors if isinstance(t, rc.Tensor) and t.storage is None]
    if pending:
        pending[0]._frontend.run(pending)


def detach_state(state: State) -> State:
    """The state with every tensor computed and cut from the gradient history (truncated
    backpropagation, or stepping without building an ever longer graph)."""
    realize([t for layer in state for t in layer])
    return [[t.detach() for t in layer] for layer in state]


def as_tokens(tokens: Any, vocab_size: int, device: Any = None) -> tuple[Any, int, int]:
    """Checks a (batch, time) token array and returns (int32 tensor, batch, time).

    Accepts numpy arrays, nested lists and int32 recurra tensors. A 1-D input is taken as
    one sequence. Raises TypeError for non-integer tokens, ValueError for a wrong number of
    axes, an empty sequence, or (numpy input) ids outside [0, vocab_size)."""
    if not isinstance(tokens, rc.Tensor) and getattr(tokens, "_frontend", None) is not None:
        # a node of an explicit recurra.Graph (the traced step graph of generation)
        if tokens.dtype != "int32" or len(tokens.shape) != 2:
            raise TypeError(
                f"tokens must be int32 (batch, time), got {tokens.dtype} {tokens.shape}"
            )
        return tokens, int(tokens.shape[0]), int(tokens.shape[1])
    if isinstance(tokens, rc.Tensor):
        if tokens.dtype != "int32":
            raise TypeError(f"tokens must be an int32 tensor, got {tokens.dtype}")
        if tokens.ndim == 1:
            tokens = tokens.reshape(1, tokens.shape[0])
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape (batch, time), got {tokens.shape}")
        b, t = tokens.shape
        if b == 0 or t == 0:
            raise ValueError(f"tokens must not be empty, got shape {tokens.shape}")
        return (tokens.to(device) if device is not None else tokens), int(b), int(t)
    arr = np.asarray(tokens)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise ValueError(f"tokens must have shape (batch, time), got {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"tokens must not be empty, got shape {arr.shape}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got min {lo}, max {hi}")
    return rc.tensor(arr.astype(np.int32), device=device), int(arr.shape[0]), int(arr.shape[1])


class ConfigBase:
    """Mixin for config dataclasses: ``to_dict()`` and a checked ``from_dict()``."""

    # Other spellings accepted by from_dict (e.g. Hugging Face config.json names).
    _aliases: ClassVar[dict[str, str]] = {}

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        out = dataclasses.asdict(self)  # type: ignore[call-overload]
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, ignore_unknown: bool = False) -> Any:
        """A config from a dict (aliases accepted).

        Raises ValueError for unknown fields (unless ``ignore_unknown``) and for values the
        config's checks refuse."""
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kw: dict[str, Any] = {}
        unknown = []
        for k, v in d.items():
            key = cls._aliases.get(k, k)
            if key in names:
                kw[key] = v
            else:
                unknown.append(k)
        if unknown and not ignore_unknown:
            raise ValueError(
                f"{cls.__name__}: unknown field(s) {', '.join(map(repr, unknown))}; known: "
                f"{', '.join(sorted(names))}"
            )
        try:
            return cls(**kw)
        except TypeError as e:
            raise ValueError(f"{cls.__name__}: {e}") from None


def _positive(cls: str, **values: Any) -> None:
    for k, v in values.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{cls}: {k} must be a positive integer, got {v!r}")


class CausalLM(nn.Module):
    """Base class of the language models: ``forward(tokens) -> logits``,
    ``forward_with_state(tokens, state) -> (logits, state)``, ``init_state(batch)``.

    Subclasses set ``arch``, ``Config`` and implement ``forward_with_state`` and
    ``init_state``."""

    arch: ClassVar[str] = ""
    Config: ClassVar[type] = object
    config: Any

    @classmethod
    def from_config(cls, cfg: dict[str, Any] | Any, seed: int = 0) -> Any:
        """A freshly initialised model from a config dict (or Config instance).

        Raises ValueError for unknown fields or invalid values."""
        if not isinstance(cfg, cls.Config):
            cfg = cls.Config.from_dict(dict(cfg))  # type: ignore[attr-defined]
        return cls(cfg, seed=seed)  # type: ignore[call-arg]

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def residual_blocks(self) -> list[nn.Module]:
        """The residual blocks, in order."""
        raise NotImplementedError

    def gradient_checkpointing(self, flag: bool = True) -> Any:
        """Activation checkpointing: with ``flag``, the forward of each block runs inside its
        own ``recurra.recompute()`` segment, so the backward recomputes a block's
        intermediates right before its gradients instead of keeping those of every block
        through the step (less memory, about one more forward per step). Gradients are the
        same. Returns self."""
        for blk in self.residual_blocks():
            blk.recompute_(flag)
        return self

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether :meth:`gradient_checkpointing` is on."""
        return any(blk.__dict__.get("_recompute", False) for blk in self.residual_blocks())

    def forward(self, tokens: Any) -> Any:
        """Logits (batch, time, vocab) of int32 tokens (batch, time), from the zero state."""
        return self.forward_with_state(tokens, None)[0]

    def forward_with_state(self, tokens: Any, state: State | None = None) -> tuple[Any, State]:
        """Logits (B, T, vocab) of int32 tokens (B, T) starting from ``state`` (None:
        zeros), and the state after the last token: the LM head over
        :meth:`features_with_state`. Subclasses write either this or
        ``features_with_state`` and ``lm_head_module``."""
        head = self.lm_head_module()
        if head is None:
            raise NotImplementedError(
                f"{type(self).__name__} defines neither forward_with_state nor lm_head_module"
            )
        h, new_state = self.features_with_state(tokens, state)
        return head(h), new_state

    def features_with_state(self, tokens: Any, state: State | None = None) -> tuple[Any, State]:
        """The hidden states the LM head reads (B, T, d) (after the final norm), and the
        state after the last token."""
        raise NotImplementedError

    def lm_head_module(self) -> nn.Module | None:
        """The module mapping hidden states (..., d) to logits (..., vocab), row by row;
        None when the model does not split its forward so (:meth:`loss` then takes the
        logits from :meth:`forward` whole)."""
        return None

    def init_state(self, batch: int) -> State:
        raise NotImplementedError

    # loss(): logits of more than loss_chunk_above bytes are computed in chunks of at most
    # loss_chunk_bytes (see there); loss_chunk_bytes = 0 turns the chunking off. Set per
    # model (``model.loss_chunk_bytes = 0``) or per call (``loss(..., chunk_bytes=0)``).
    loss_chunk_bytes: int = LOSS_CHUNK_BYTES
    loss_chunk_above: int = LOSS_CHUNK_ABOVE

    def loss(self, tokens: Any, targets: Any, *, chunk_bytes: int | None = None) -> Any:
        """Mean cross-entropy of the next-token predictions: logits of ``tokens`` against
        int32 ``targets`` of the same (batch, time) shape. Returns a 0-d tensor.

        When the logits (batch * time * vocab float32) would take more than
        ``self.loss_chunk_above`` bytes (512 MiB: 8 x 512 tokens of a 50k vocabulary are 0.8
        GiB), the LM head and the loss run over chunks of token rows, each chunk's logits at
        most ``chunk_bytes`` (default ``self.loss_chunk_bytes``, 64 MiB, counted in the
        logits' dtype: bfloat16/float16 under :class:`recurra.autocast`; 0 turns chunking
        off; given here, it chunks whenever the logits pass it) and each chunk inside its
        own ``recurra.recompute()`` segment: only one chunk's logits (and, in the backward,
        their gradient) is alive at a time instead of the whole (B*T, vocab) pair, the
        largest tensors of a step. The backward computes each chunk's head product once
        more (a third more head work); the loss and the gradients are those of the
        unchunked loss up to float32 rounding."""
        tgt, b, t = as_tokens(targets, self.vocab_size, self.device)
        head = self.lm_head_module()
        if chunk_bytes is None:
            big = b * t * self.vocab_size * 4 > self.loss_chunk_above
            limit = self.loss_chunk_bytes if big else 0
        else:
            limit = chunk_bytes
        half = rc.autocast_dtype()  # the head's product is 2-byte under autocast
        rows = chunk_rows(b * t, self.vocab_size, limit or 0, 4 if half is None else half.itemsize)
        if head is None or rows >= b * t:
            return ops.cross_entropy(self.forward(tokens), tgt)
        h, _ = self.features_with_state(tokens, None)
        return chunked_cross_entropy(h, head, tgt, rows)


# chunk_rows: where a chunk holds at least this many rows, its rows are a multiple of it, so
# that the head's products tile evenly (the tensor-core matmuls work in 128-row tiles: 8 x 512
# tokens of the 130M vocabulary as 16 chunks of 256 rows, not 13 of 316, each of which ran as
# 384 rows).
CHUNK_ROW_ALIGN = 128


def chunk_rows(n: int, vocab: int, limit: int, itemsize: int = 4) -> int:
    """Rows per chunk for :func:`chunked_cross_entropy`: ``n`` when n * vocab logits of
    ``itemsize`` bytes (4: float32, 2: bfloat16/float16) fit in ``limit`` bytes (or limit <=
    0), else the rows of equal chunks (the last may be shorter) of at most ``limit`` bytes
    each (at least one row), a multiple of ``CHUNK_ROW_ALIGN`` rows where ``limit`` holds
    that many."""
    if itemsize not in (2, 4):
        raise ValueError(f"chunk_rows: itemsize must be 2 or 4, got {itemsize!r}")
    if limit <= 0 or n * vocab * itemsize <= limit:
        return n
    most = max(1, limit // (vocab * itemsize))  # rows of at most limit bytes
    align = CHUNK_ROW_ALIGN if most >= CHUNK_ROW_ALIGN else 1
    most -= most % align
    n_chunks = -(-n // most)
    rows = -(-n // n_chunks)  # equal chunks, no larger than `most`
    return min(most, -(-rows // align) * align)


def chunked_cross_entropy(h: Any, head: Any, targets: Any, rows: int) -> Any:
    """``cross_entropy(head(h), targets)`` (the mean over every row) computed ``rows`` token
    rows at a time, each chunk's ``head`` and loss in its own recomputation segment, so
    that its logits are not kept for the backward but made again right before their
    gradient. ``h`` (..., d), ``targets`` int32 (...) of h's leading shape."""
    d = h.shape[-1]
    n = h.size // d
    hf, tf = h.reshape(n, d), targets.reshape(n)
    total = None
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        with rc.recompute():
            part = ops.cross_entropy(head(hf[lo:hi]), tf[lo:hi]) * ((hi - lo) / n)
        total = part if total is None else total + part
    return total


# -- shared Mamba helpers -------------------------------------------------------------------


#: while a generation step graph that carries its state is traced: a function (x, state,
#: weight, bias) -> (y, new state) or None that may run a one-token conv with the state
#: updated in place (recurra_models.generation); None otherwise
_conv_step_hook: Callable[..., tuple[Any, Any] | None] | None = None


def causal_conv(x: Any, state: Any | None, weight: Any, bias: Any | None) -> tuple[Any, Any]:
    """Depthwise causal conv over time with SiLU, as in Mamba.

    ``x`` (B, T, C), ``state`` (B, C, K-1) (the last K-1 inputs, None for zeros),
    ``weight`` (C, K), ``bias`` (C,). Returns (silu(conv(x) + bias) of shape (B, T, C),
    the new state (B, C, K-1)).

    Under :class:`recurra.autocast` the conv computes in float32 and its result is rounded
    to the autocast dtype, as mamba-ssm's causal_conv1d returns its input's dtype: the
    activations the scan and the rest of the block keep for the backward are 2-byte (their
    float32 up-casts are recomputed there), not a float32 copy of the conv's output."""
    b, t, c = x.shape
    k = weight.shape[-1]
    half = rc.autocast_dtype()
    if state is None:  # one op (fused where the backend has the kernel), rounded by the op
        return ops.causal_conv_silu(x, weight, bias, dtype=half), conv_state_after(x, k)
    step = _conv_step_hook
    if step is not None and t == 1 and half is None:
        done = step(x, state, weight, bias)
        if done is not None:
            return done
    xt = x.permute(0, 2, 1)  # (B, C, T)
    sx = ops.concat([state, xt], axis=2)
    y = ops.ssm_conv(sx, weight)  # (B, T, C)
    if bias is not None:
        y = y + bias
    new_state = sx[:, :, t:] if k > 1 else sx[:, :, :0]
    y = ops.silu(y)
    return (y if half is None else y.to(half)), new_state


def conv_state_after(x: Any, k: int) -> Any:
    """The conv state (B, C, K-1) after inputs x (B, T, C) that started from zeros: the last
    K-1 inputs, zero-padded on the left (a lazy view: only computed if read)."""
    t = x.shape[1]
    sx = ops.pad(x.permute(0, 2, 1), ((0, 0), (0, 0), (k - 1, 0)))
    return sx[:, :, t:] if k > 1 else sx[:, :, :0]


def inv_softplus(x: np.ndarray) -> np.ndarray:
    """The inverse of softplus: log(exp(x) - 1), stable for small x."""
    out: np.ndarray = x + np.log(-np.expm1(-x))
    return out


def init_dt_bias(
    rng: np.random.Generator, n: int, dt_min: float, dt_max: float, floor: float
) -> np.ndarray:
    """dt bias so that softplus(bias) is log-uniform in [dt_min, dt_max] (Mamba's init)."""
    dt = np.exp(rng.random(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return inv_softplus(np.maximum(dt, floor)).astype(np.float32)


def zero_state(shapes: list[list[tuple[int, ...]]], device: Any) -> State:
    """A state of zero tensors of the given per-layer shapes on ``device``."""
    return [[rc.tensor(np.zeros(s, np.float32), device=device) for s in layer] for layer in shapes]


def check_state(
    state: Any, shapes: list[list[tuple[int, ...]]], who: str, layout: str = ""
) -> None:
    """Raises ValueError when ``state`` is not one list of tensors per layer of ``shapes``
    (``layout`` names the tensors of a layer in the message)."""
    if not isinstance(state, (list, tuple)) or len(state) != len(shapes):
        n = len(state) if isinstance(state, (list, tuple)) else type(state).__name__
        raise ValueError(f"{who}: the state must hold one entry per layer ({len(shapes)}), got {n}")
    for i, (layer, want) in enumerate(zip(state, shapes)):
        got = (
            [tuple(getattr(z, "shape", ())) for z in layer]
            if isinstance(layer, (list, tuple))
            else None
        )
        if got != [tuple(w) for w in want]:
            raise ValueError(
                f"{who}: state of layer {i} has shapes {got}, expected {want}"
                + (f" ({layout})" if layout else "")
            )

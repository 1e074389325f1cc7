"""What the RWKV-6 and RWKV-7 language models share: the model around the blocks (embedding,
``blocks.0.ln0``, ``ln_out``, head; the per-layer state ``[att_shift (B, C), wkv (B, H, S, S),
ffn_shift (B, C)]`` and its checks), the block (``x + att(ln1(x))``, then ``x + ffn(ln2(x))``),
reading official checkpoints (float arrays, layer counts, shape checks, the head size) and
the initialisers of the official training code. :mod:`recurra_models.rwkv6` and
:mod:`recurra_models.rwkv7` add their time and channel mixing and configs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from recurra import ops
from recurra_models import nn
from recurra_models.lm import CausalLM, State, as_tokens, check_state, zero_state

__all__ = ["RWKVBlock", "RWKVFamilyLM"]

LN_X_EPS = 64e-5  # GroupNorm eps of ln_x in the official code: 1e-5 * head_size_divisor**2


class RWKVBlock(nn.Module):
    """``x + att(ln1(x))``, then ``x + ffn(ln2(x))``; block 0 also holds ``ln0`` (applied by
    the model to the embeddings). Subclasses set ``TimeMix`` and ``ChannelMix`` (built as
    ``TimeMix(cfg, layer_id, rng)``) and write ``forward``."""

    TimeMix: ClassVar[type]
    ChannelMix: ClassVar[type]

    def __init__(self, cfg: Any, layer_id: int, rng: np.random.Generator | None) -> None:
        super().__init__()
        if layer_id == 0:
            self.ln0 = nn.LayerNorm(cfg.n_embd)
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.att = self.TimeMix(cfg, layer_id, rng)
        self.ffn = self.ChannelMix(cfg, layer_id, rng)

    def channel_mix(self, x: Any, dx: Any, state: list[Any], att_shift: Any, wkv: Any) -> Any:
        """The second half of a block: x + dx (the time mixing's output), then
        ``x + ffn(ln2(x))``. Returns (x, the layer's new state)."""
        x = x + dx
        dx, ffn_shift = self.ffn(self.ln2(x), state[2])
        return x + dx, [att_shift, wkv, ffn_shift]


# What a layer's state holds, for error messages.
_LAYOUT = "[att_shift, wkv, ffn_shift]"


class RWKVFamilyLM(CausalLM):
    """What the RWKV-6 and RWKV-7 LMs share: ``emb -> blocks.0.ln0 -> blocks -> ln_out ->
    head`` under the official parameter names, the per-layer state ``[att_shift (B, C),
    wkv (B, H, S, S), ffn_shift (B, C)]``, its checks, and the recurrent forward around the
    blocks. Subclasses set ``arch``, ``Config`` (with ``vocab_size``, ``n_embd``,
    ``n_layer``, ``head_size``, ``n_head``), ``Block`` (built as ``Block(cfg, layer_id,
    rng)``) and may replace :meth:`run_blocks`."""

    Block: ClassVar[type]

    def __init__(self, config: Any = None, seed: int | None = 0) -> None:
        """A model of ``config`` (None: the default Config), initialised like the official
        training code from ``seed`` (``seed=None``: all zeros, for loading weights
        afterwards)."""
        super().__init__()
        cfg = config if config is not None else self.Config()
        self.config = cfg
        rng = None if seed is None else np.random.default_rng(seed)
        init = _Init(rng)
        self.emb = init.embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(self.Block(cfg, i, rng) for i in range(cfg.n_layer))
        self.ln_out = nn.LayerNorm(cfg.n_embd)
        self.head = init.head(cfg.n_embd, cfg.vocab_size)

    def residual_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def state_shapes(self, batch: int) -> list[list[tuple[int, ...]]]:
        """Shapes of :meth:`init_state`'s tensors: per layer [(B, C), (B, H, S, S), (B, C)]."""
        c = self.config
        s = c.head_size
        return [[(batch, c.n_embd), (batch, c.n_head, s, s), (batch, c.n_embd)]] * c.n_layer

    def init_state(self, batch: int) -> State:
        """Zero states: per layer [att_shift (B, C), wkv (B, H, S, S), ffn_shift (B, C)]."""
        return zero_state(self.state_shapes(batch), self.device)

    def lm_head_module(self) -> nn.Module:
        return self.head

    def features_with_state(self, tokens: Any, state: State | None = None) -> tuple[Any, State]:
        """The hidden states after ``ln_out`` (B, T, C) of int32 tokens (B, T) starting from
        ``state`` (None: zeros), and the state after the last token (lazy tensors; see
        ``lm.realize``); the logits are ``head`` of them (``forward_with_state``).

        Raises TypeError/ValueError for bad tokens and ValueError for a state that does not
        fit the model or the batch."""
        tok, b, _ = as_tokens(tokens, self.vocab_size, self.device)
        if state is None:
            state = self.init_state(b)
        else:
            check_state(state, self.state_shapes(b), type(self).__name__, _LAYOUT)
        first: Any = self.blocks[0]  # block 0 holds ln0
        x = first.ln0(self.emb(tok))
        x, new_state = self.run_blocks(x, [list(st) for st in state])
        return self.ln_out(x), new_state

    def run_blocks(self, x: Any, state: State) -> tuple[Any, State]:
        """The blocks over x (B, T, C) (after ln0) from ``state`` (one list per layer), each
        ``block(x, layer_state) -> (x, new layer state)``. Returns (x after the last block,
        the new state)."""
        new_state: State = []
        for blk, st in zip(self.blocks, state):
            x, st2 = blk(x, st)
            new_state.append(st2)
        return x, new_state


# --------------------------------------------------------------------------------------------
# Official checkpoints
# --------------------------------------------------------------------------------------------
def reject_family(sd: Mapping[str, Any], keys: tuple[str, ...], who: str, other: str) -> None:
    """Raises ValueError when sd holds one of ``keys`` (the other family's: ``other``)."""
    for key in keys:
        if key in sd:
            raise ValueError(
                f"{who}.from_official: this is an {other} state dict (it has "
                f"'{keys[0]}'); use {other.replace('-', '')}LM.from_official"
            )


def head_size_of(
    sd: Mapping[str, np.ndarray],
    key: str,
    width: int,
    width_name: str,
    head_size: int | None,
    who: str,
) -> int:
    """The head size of an official checkpoint from ``key``, an (H, S) vector (stored flat,
    the head size is ``head_size``, default 64) of ``width`` (= H * S) entries. Raises
    ValueError when it contradicts ``head_size`` or does not divide the width."""
    vec = require(sd, key)
    hs = int(vec.shape[1]) if vec.ndim == 2 else int(head_size or 64)
    if head_size is not None and head_size != hs:
        raise ValueError(
            f"{who}.from_official: key '{key}' has shape {vec.shape}: head size {hs}, but "
            f"head_size={head_size} was given"
        )
    if vec.size != width or width % hs:
        raise ValueError(
            f"{who}.from_official: key '{key}' has shape {vec.shape}, which does not fit "
            f"{width_name} {width} with head size {hs}"
        )
    return hs


def token_shift(x: Any, shift: Any) -> tuple[Any, Any]:
    """RWKV's token shift: for x (B, T, C) and the previous call's last token ``shift``
    (B, C), returns (the previous token of every position (B, T, C), x's last token (B, C))."""
    b, t, c = x.shape
    first = shift.reshape(b, 1, c)
    prev = first if t == 1 else ops.concat([first, x[:, : t - 1, :]], axis=1)
    return prev, x[:, t - 1, :]


def head_norm(y: Any, b: int, t: int, ln: nn.LayerNorm) -> Any:
    """``torch.nn.GroupNorm(H, A)`` over the heads of y (B*T, H, S) with ln's weight and bias
    and eps LN_X_EPS: each head normalised on its own. Returns (B, T, A)."""
    h, s = y.shape[1], y.shape[2]
    yn = ops.layer_norm(y, LN_X_EPS).reshape(b, t, h * s)
    return yn * ln.weight + ln.bias


def official_arrays(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The entries of an official checkpoint as float32 numpy arrays (torch tensors of any
    float dtype, bfloat16 included, are converted). Raises ValueError naming a key whose
    value is not numeric, TypeError for a non-mapping."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"expected a dict of arrays (an official state dict), got {type(state_dict).__name__}"
        )
    out: dict[str, np.ndarray] = {}
    for key, value in state_dict.items():
        v = value
        if hasattr(v, "detach") and hasattr(v, "float"):  # a torch tensor
            v = v.detach().float().cpu().numpy()
        try:
            arr = np.asarray(v)
        except Exception as e:  # noqa: BLE001 - name the key whatever failed
            raise ValueError(f"key {key!r}: cannot convert to an array ({e})") from e
        if arr.dtype.kind not in "fiu":
            raise ValueError(f"key {key!r} has non-numeric dtype {arr.dtype}")
        out[str(key)] = np.ascontiguousarray(arr, dtype=np.float32)
    return out


def require(sd: Mapping[str, np.ndarray], key: str) -> np.ndarray:
    """sd[key]; raises ValueError naming the key when it is missing."""
    if key not in sd:
        raise ValueError(f"the state dict has no key {key!r}")
    return sd[key]


def require_matrix(sd: Mapping[str, np.ndarray], key: str) -> tuple[int, int]:
    """The shape of the 2-D entry ``key``; raises ValueError naming it if missing or not
    2-D."""
    arr = require(sd, key)
    if arr.ndim != 2:
        raise ValueError(f"key {key!r} has shape {arr.shape}, expected a matrix")
    return int(arr.shape[0]), int(arr.shape[1])


def count_layers(sd: Mapping[str, np.ndarray]) -> int:
    """The number of blocks (``blocks.{i}.*`` keys for i = 0..n-1). Raises ValueError when
    there is none or the indices have a gap."""
    ids = {int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))}
    if not ids:
        raise ValueError("the state dict has no 'blocks.{i}.' keys")
    n = max(ids) + 1
    missing = sorted(set(range(n)) - ids)
    if missing:
        raise ValueError(f"the state dict has no keys of block(s) {missing} (blocks 0..{n - 1})")
    return n


def conform(sd: dict[str, np.ndarray], model: nn.Module, who: str) -> dict[str, np.ndarray]:
    """``sd`` with each entry reshaped to the model's parameter shape when only the layout
    differs (a squeezed (C,) for (1, 1, C), a flat (A,) for (H, S)).

    Raises ValueError naming the key for a missing or unexpected key, or a shape that holds
    a different number of elements or differs in more than size-1 axes and flattening."""
    own = dict(model.named_parameters())
    missing = [k for k in own if k not in sd]
    if missing:
        raise ValueError(f"{who}: the state dict has no key {missing[0]!r}" + _more(missing))
    unexpected = [k for k in sd if k not in own]
    if unexpected:
        raise ValueError(f"{who}: unexpected key {unexpected[0]!r}" + _more(unexpected))
    out = {}
    for key, arr in sd.items():
        want = tuple(own[key].shape)
        if arr.shape != want:
            squeezed = tuple(d for d in want if d != 1)
            same_vec = tuple(d for d in arr.shape if d != 1) == squeezed
            flat = arr.ndim == 1 and arr.size == int(np.prod(want)) and len(squeezed) == 2
            if not (same_vec or flat):
                raise ValueError(
                    f"{who}: key {key!r} has shape {arr.shape}, expected {want} for this "
                    "model (sizes read from emb.weight and the block-0 matrices)"
                )
            arr = arr.reshape(want)
        out[key] = arr
    return out


def _more(keys: list[str]) -> str:
    return f" (and {len(keys) - 1} more: {keys[1:4]})" if len(keys) > 1 else ""


def _check_ints(who: str, positive: dict[str, Any], non_negative: dict[str, Any]) -> None:
    for group, low in ((positive, 1), (non_negative, 0)):
        for k, v in group.items():
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < low:
                kind = "a positive" if low else "a non-negative"
                raise ValueError(f"{who}: {k} must be {kind} integer, got {v!r}")


def _ratios(layer_id: int, n_layer: int) -> tuple[float, float]:
    """(ratio_0_to_1, ratio_1_to_almost0) of the official initialisation."""
    return layer_id / max(n_layer - 1, 1), 1.0 - layer_id / n_layer


def _orthogonal(rng: np.random.Generator, shape: tuple[int, int], gain: float) -> np.ndarray:
    """A (semi-)orthogonal matrix times ``gain`` (torch.nn.init.orthogonal_)."""
    rows, cols = shape
    a = rng.standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(a)
    q = q * np.sign(np.diag(r))
    return gain * (q if rows >= cols else q.T)


class Dense(nn.Module):
    """A bias-free linear layer ``x @ weight.T`` with weight (out, in) like torch's Linear.

    (nn.Linear draws a random init first; loading multi-GB checkpoints should not.)"""

    def __init__(self, weight: Any) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: Any) -> Any:
        """x (..., in) -> (..., out)."""
        return ops.matmul(x, self.weight.T)


class Lookup(nn.Module):
    """An embedding table (V, C): ``forward(int32 tensor)`` -> rows (``ops.get_rows``)."""

    def __init__(self, weight: Any) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, idx: Any) -> Any:
        """int32 indices (B, T) -> (B, T, C)."""
        return ops.get_rows(self.weight, idx)


class _Init:
    """Makes parameters from the official initialisation, or zeros when rng is None (the
    weights are loaded afterwards; this skips the expensive orthogonal draws)."""

    def __init__(self, rng: np.random.Generator | None) -> None:
        self.rng = rng

    def zeros(self, shape: tuple[int, ...]) -> Any:
        return nn.Parameter(np.zeros(shape, np.float32))

    def value(self, shape: tuple[int, ...], values: Any) -> Any:
        if self.rng is None:
            return self.zeros(shape)
        arr = np.asarray(values, np.float64)
        return nn.Parameter(np.broadcast_to(arr if arr.size == 1 else arr.reshape(shape), shape))

    def uniform(self, shape: tuple[int, ...], bound: float) -> Any:
        if self.rng is None:
            return self.zeros(shape)
        return nn.Parameter(self.rng.uniform(-bound, bound, shape))

    def orthogonal(self, shape: tuple[int, ...], gain: float) -> Any:
        if self.rng is None or gain == 0.0:
            return self.zeros(shape)
        if len(shape) == 3:
            return nn.Parameter(
                np.stack([_orthogonal(self.rng, shape[1:], gain) for _ in range(shape[0])])
            )
        return nn.Parameter(_orthogonal(self.rng, (shape[0], shape[1]), gain))

    def linear(self, n_in: int, n_out: int, gain: float) -> Dense:
        """A bias-free linear layer (weight (out, in)), orthogonal weight times ``gain``."""
        return Dense(self.orthogonal((n_out, n_in), gain))

    def linear_uniform(self, n_in: int, n_out: int, bound: float) -> Dense:
        """A bias-free linear layer with a weight uniform in +-bound."""
        return Dense(self.uniform((n_out, n_in), bound))

    def layer_norm(self, dim: int, weight: float = 1.0) -> nn.LayerNorm:
        ln = nn.LayerNorm(dim)
        if weight != 1.0 and self.rng is not None:
            ln.weight = nn.Parameter(np.full(dim, weight, np.float32))
        return ln

    def embedding(self, n: int, dim: int) -> Lookup:
        return Lookup(self.uniform((n, dim), 1e-4))

    def head(self, dim: int, vocab: int) -> Dense:
        gain = 0.5 * math.sqrt(vocab / dim) if vocab > dim else 0.5
        return self.linear(dim, vocab, gain)

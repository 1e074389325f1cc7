"""RWKV-6 ("Finch", x060) language model with the parameter names of the official checkpoints.

Per block, with ``shift(x)`` the previous token's input (the carried shift state for the
first token of a call):

    x  = x + att(ln1(x))          # time mixing
    x  = x + ffn(ln2(x))          # channel mixing

Time mixing (C = n_embd, A = dim_att = H * S)::

    xx     = shift(x) - x
    m_*    = LoRA_w/k/v/r/g(tanh((x + xx * time_maa_x) @ time_maa_w1)) via time_maa_w2
    x_*    = x + xx * (time_maa_* + m_*)                       # * in w, k, v, r, g
    r, k, v = receptance(x_r), key(x_k), value(x_v);  g = silu(gate(x_g))
    decay  = exp(-exp(time_decay + tanh(x_w @ time_decay_w1) @ time_decay_w2))
    y      = wkv6(k, v, r, u = time_faaaa, decay, state)       # per head of size S
    out    = output(group_norm_heads(y) * g)                   # ln_x, eps 64e-5

Channel mixing: ``sigmoid(receptance(x_r)) * value(relu(key(x_k))**2)`` with
``x_k = x + xx * time_maa_k``, ``x_r = x + xx * time_maa_r``. The model is
``emb -> blocks.0.ln0 -> blocks -> ln_out -> head``.

The state of each layer is ``[att_shift (B, C), wkv (B, H, S, S), ffn_shift (B, C)]`` (the
wkv state indexed [head, key, value], the convention of ``recurra.ops.rwkv_wkv6``).

The helpers at the bottom (token shift, per-head group norm, checkpoint reading,
initialisers) are shared with :mod:`recurra_models.rwkv7`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from recurra import ops
from recurra_models import nn
from recurra_models.lm import CausalLM, ConfigBase, State, as_tokens, check_state, zero_state

__all__ = [
    "RWKV6Block",
    "RWKV6ChannelMix",
    "RWKV6Config",
    "RWKV6LM",
    "RWKV6TimeMix",
    "RWKVFamilyLM",
]

LN_X_EPS = 64e-5  # GroupNorm eps of ln_x in the official code: 1e-5 * head_size_divisor**2


@dataclass
class RWKV6Config(ConfigBase):
    """Sizes of an RWKV-6 LM. ``dim_att=0`` means n_embd; ``dim_ffn=0`` means the official
    default ``int(n_embd * 3.5) // 32 * 32``."""

    vocab_size: int = 256
    n_embd: int = 64
    n_layer: int = 2
    head_size: int = 64
    dim_att: int = 0
    dim_ffn: int = 0
    d_mix_lora: int = 32
    d_decay_lora: int = 64

    def __post_init__(self) -> None:
        _check_ints(
            "RWKV6Config",
            positive=dict(
                vocab_size=self.vocab_size,
                n_embd=self.n_embd,
                n_layer=self.n_layer,
                head_size=self.head_size,
                d_mix_lora=self.d_mix_lora,
                d_decay_lora=self.d_decay_lora,
            ),
            non_negative=dict(dim_att=self.dim_att, dim_ffn=self.dim_ffn),
        )
        if self.att_dim % self.head_size:
            raise ValueError(
                f"RWKV6Config: dim_att {self.att_dim} is not a multiple of head_size "
                f"{self.head_size}"
            )

    @property
    def att_dim(self) -> int:
        """dim_att actually used (A = n_head * head_size)."""
        return self.dim_att or self.n_embd

    @property
    def ffn_dim(self) -> int:
        """dim_ffn actually used."""
        return self.dim_ffn or max(int(self.n_embd * 3.5) // 32 * 32, 32)

    @property
    def n_head(self) -> int:
        return self.att_dim // self.head_size


class RWKV6TimeMix(nn.Module):
    """RWKV-6 time mixing (``blocks.i.att``); ``forward(x, shift, wkv)`` as in the module
    docstring."""

    def __init__(self, cfg: RWKV6Config, layer_id: int, rng: np.random.Generator | None) -> None:
        super().__init__()
        c, a, h, s = cfg.n_embd, cfg.att_dim, cfg.n_head, cfg.head_size
        dm, dd = cfg.d_mix_lora, cfg.d_decay_lora
        self.n_head, self.head_size = h, s
        init = _Init(rng)
        r0, r1 = _ratios(layer_id, cfg.n_layer)
        ddd = np.arange(c) / c
        self.time_maa_x = init.value((1, 1, c), 1.0 - ddd**r1)
        self.time_maa_w = init.value((1, 1, c), 1.0 - ddd**r1)
        self.time_maa_k = init.value((1, 1, c), 1.0 - ddd**r1)
        self.time_maa_v = init.value((1, 1, c), 1.0 - (ddd**r1 + 0.3 * r0))
        self.time_maa_r = init.value((1, 1, c), 1.0 - ddd ** (0.5 * r1))
        self.time_maa_g = init.value((1, 1, c), 1.0 - ddd ** (0.5 * r1))
        self.time_maa_w1 = init.zeros((c, 5 * dm))
        self.time_maa_w2 = init.uniform((5, dm, c), 0.01)
        n = np.arange(a)
        self.time_decay = init.value(
            (1, 1, a), -6.0 + 5.0 * (n / max(a - 1, 1)) ** (0.7 + 1.3 * r0)
        )
        self.time_decay_w1 = init.zeros((c, dd))
        self.time_decay_w2 = init.uniform((dd, a), 0.01)
        zigzag = ((n + 1) % 3 - 1) * 0.1
        self.time_faaaa = init.value((h, s), r0 * (1.0 - n / max(a - 1, 1)) + zigzag)
        self.receptance = init.linear(c, a, 1.0)
        self.key = init.linear(c, a, 0.1)
        self.value = init.linear(c, a, 1.0)
        self.gate = init.linear(c, a, 0.1)
        self.output = init.linear(a, c, 0.0)
        self.ln_x = init.layer_norm(a, ((1 + layer_id) / cfg.n_layer) ** 0.7)

    def forward(self, x: Any, shift: Any, wkv: Any) -> tuple[Any, Any, Any]:
        """x (B, T, C) (already ln1-normalised), shift (B, C), wkv (B, H, S, S).

        Returns (output (B, T, C), new shift (B, C), new wkv state (B, H, S, S))."""
        b, t, c = x.shape
        h, s = self.n_head, self.head_size
        prev, new_shift = token_shift(x, shift)
        xx = prev - x
        xxx = x + xx * self.time_maa_x
        dm = self.time_maa_w2.shape[1]
        lora = ops.tanh(ops.matmul(xxx.reshape(b * t, c), self.time_maa_w1))  # (BT, 5 dm)
        lora = lora.reshape(b * t, 5, dm).permute(1, 0, 2)  # (5, BT, dm)
        mix = ops.matmul(lora, self.time_maa_w2)  # (5, BT, C): w, k, v, r, g

        def lerp(i: int, maa: Any) -> Any:
            return x + xx * (maa + mix[i].reshape(b, t, c))

        xw = lerp(0, self.time_maa_w)
        xk = lerp(1, self.time_maa_k)
        xv = lerp(2, self.time_maa_v)
        xr = lerp(3, self.time_maa_r)
        xg = lerp(4, self.time_maa_g)
        r = self.receptance(xr)
        k = self.key(xk)
        v = self.value(xv)
        g = ops.silu(self.gate(xg))
        wlog = self.time_decay + ops.matmul(
            ops.tanh(ops.matmul(xw, self.time_decay_w1)), self.time_decay_w2
        )
        decay = ops.exp(-ops.exp(wlog))
        y, new_wkv = ops.rwkv_wkv6(
            k.reshape(b * t, h, s),
            v.reshape(b * t, h, s),
            r.reshape(b * t, h, s),
            self.time_faaaa,
            decay.reshape(b * t, h, s),
            wkv,
        )
        y = head_norm(y, b, t, self.ln_x)
        return self.output(y * g), new_shift, new_wkv


class RWKV6ChannelMix(nn.Module):
    """RWKV-6 channel mixing (``blocks.i.ffn``)."""

    def __init__(self, cfg: RWKV6Config, layer_id: int, rng: np.random.Generator | None) -> None:
        super().__init__()
        c, f = cfg.n_embd, cfg.ffn_dim
        init = _Init(rng)
        _, r1 = _ratios(layer_id, cfg.n_layer)
        ddd = np.arange(c) / c
        self.time_maa_k = init.value((1, 1, c), 1.0 - ddd**r1)
        self.time_maa_r = init.value((1, 1, c), 1.0 - ddd**r1)
        self.key = init.linear(c, f, 1.0)
        self.receptance = init.linear(c, c, 0.0)
        self.value = init.linear(f, c, 0.0)

    def forward(self, x: Any, shift: Any) -> tuple[Any, Any]:
        """x (B, T, C) (ln2-normalised), shift (B, C). Returns (output, new shift)."""
        prev, new_shift = token_shift(x, shift)
        xx = prev - x
        k = ops.sqr(ops.relu(self.key(x + xx * self.time_maa_k)))
        rr = ops.sigmoid(self.receptance(x + xx * self.time_maa_r))
        return rr * self.value(k), new_shift


class RWKV6Block(nn.Module):
    """``x + att(ln1(x))``, then ``x + ffn(ln2(x))``; block 0 also holds ``ln0`` (applied by
    the model to the embeddings)."""

    def __init__(self, cfg: RWKV6Config, layer_id: int, rng: np.random.Generator | None) -> None:
        super().__init__()
        if layer_id == 0:
            self.ln0 = nn.LayerNorm(cfg.n_embd)
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.att = RWKV6TimeMix(cfg, layer_id, rng)
        self.ffn = RWKV6ChannelMix(cfg, layer_id, rng)

    def forward(self, x: Any, state: list[Any]) -> tuple[Any, list[Any]]:
        """x (B, T, C), state [att_shift, wkv, ffn_shift]. Returns (x, new state)."""
        dx, att_shift, wkv = self.att(self.ln1(x), state[0], state[1])
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
    rng)``) and implement :meth:`run_blocks`."""

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

    def forward_with_state(self, tokens: Any, state: State | None = None) -> tuple[Any, State]:
        """Logits (B, T, vocab) of int32 tokens (B, T) starting from ``state`` (None: zeros),
        and the state after the last token (lazy tensors; see ``lm.realize``).

        Raises TypeError/ValueError for bad tokens and ValueError for a state that does not
        fit the model or the batch."""
        tok, b, _ = as_tokens(tokens, self.vocab_size, self.device)
        if state is None:
            state = self.init_state(b)
        else:
            check_state(state, self.state_shapes(b), type(self).__name__, _LAYOUT)
        first: Any = self.blocks[0]  # an RWKV-6 or RWKV-7 block; block 0 holds ln0
        x = first.ln0(self.emb(tok))
        x, new_state = self.run_blocks(x, [list(st) for st in state])
        return self.head(self.ln_out(x)), new_state

    def run_blocks(self, x: Any, state: State) -> tuple[Any, State]:
        """The blocks over x (B, T, C) (after ln0) from ``state`` (one list per layer).
        Returns (x after the last block, the new state)."""
        raise NotImplementedError


class RWKV6LM(RWKVFamilyLM):
    """RWKV-6 causal LM (``arch = "rwkv6"``). Parameter names and shapes are those of the
    official checkpoints (``emb.weight``, ``blocks.{i}.att.time_maa_x``, ...,
    ``ln_out.weight``, ``head.weight``), so ``state_dict()`` is an official state dict and
    :meth:`from_official` loads one."""

    arch: ClassVar[str] = "rwkv6"
    Config: ClassVar[type] = RWKV6Config
    Block: ClassVar[type] = RWKV6Block

    def run_blocks(self, x: Any, state: State) -> tuple[Any, State]:
        """The blocks over x from ``state``; returns (x, new state)."""
        new_state: State = []
        for blk, st in zip(self.blocks, state):
            x, st2 = blk(x, st)
            new_state.append(st2)
        return x, new_state

    @classmethod
    def from_official(
        cls, state_dict: Mapping[str, Any], *, head_size: int | None = None
    ) -> RWKV6LM:
        """A model holding the weights of an official RWKV-6 state dict (keys such as
        ``blocks.0.att.time_maa_w1``; float arrays of any float dtype, torch tensors too).

        The config is read from the shapes: n_embd and vocab from ``emb.weight``, the layer
        count from the ``blocks.{i}`` keys, heads from ``time_faaaa`` (H, S) (stored flat,
        the head size is ``head_size``, default 64), dim_att/dim_ffn and the LoRA sizes from
        their matrices. Vectors stored squeezed ((C,) instead of (1, 1, C)) are accepted.

        Raises ValueError naming the key for a missing, unexpected or misshapen entry, or
        when the dict is an RWKV-7 one.
        """
        sd = official_arrays(state_dict)
        if "blocks.0.att.r_k" in sd or "blocks.0.att.x_r" in sd:
            raise ValueError(
                "RWKV6LM.from_official: this is an RWKV-7 state dict (it has "
                "'blocks.0.att.r_k'); use RWKV7LM.from_official"
            )
        vocab, c = require_matrix(sd, "emb.weight")
        n_layer = count_layers(sd)
        a = require_matrix(sd, "blocks.0.att.receptance.weight")[0]
        faaaa = require(sd, "blocks.0.att.time_faaaa")
        if faaaa.ndim == 2:
            hs = int(faaaa.shape[1])
        else:
            hs = int(head_size or 64)
        if head_size is not None and head_size != hs:
            raise ValueError(
                f"RWKV6LM.from_official: key 'blocks.0.att.time_faaaa' has shape "
                f"{faaaa.shape}: head size {hs}, but head_size={head_size} was given"
            )
        if faaaa.size != a or a % hs:
            raise ValueError(
                f"RWKV6LM.from_official: key 'blocks.0.att.time_faaaa' has shape "
                f"{faaaa.shape}, which does not fit dim_att {a} with head size {hs}"
            )
        w2 = require(sd, "blocks.0.att.time_maa_w2")
        if w2.ndim != 3 or w2.shape[0] != 5:
            raise ValueError(
                f"RWKV6LM.from_official: key 'blocks.0.att.time_maa_w2' has shape {w2.shape}, "
                "expected (5, D_mix, n_embd)"
            )
        cfg = RWKV6Config(
            vocab_size=vocab,
            n_embd=c,
            n_layer=n_layer,
            head_size=hs,
            dim_att=a,
            dim_ffn=require_matrix(sd, "blocks.0.ffn.key.weight")[0],
            d_mix_lora=int(w2.shape[1]),
            d_decay_lora=require_matrix(sd, "blocks.0.att.time_decay_w1")[1],
        )
        model = cls(cfg, seed=None)
        model.load_state_dict(conform(sd, model, "RWKV6LM.from_official"))
        return model


# --------------------------------------------------------------------------------------------
# Shared helpers (also used by rwkv7.py)
# --------------------------------------------------------------------------------------------
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

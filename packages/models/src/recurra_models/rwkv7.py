"""RWKV-7 ("Goose", x070) language model with the parameter names of the official checkpoints.

Per block ``x = x + att(ln1(x)); x = x + ffn(ln2(x))``. Time mixing (C = n_embd = H * S)::

    xx       = shift(x) - x;   x_* = x + xx * x_*              # * in r, w, k, v, a, g
    r, k, v  = receptance(x_r), key(x_k), value(x_v)
    decay    = exp(-exp(-0.5) * sigmoid(w0 + tanh(x_w @ w1) @ w2))
    v        = v                                     (layer 0: kept as v_first)
             = v + (v_first - v) * sigmoid(v0 + (x_v @ v1) @ v2)   (other layers)
    a        = sigmoid(a0 + (x_a @ a1) @ a2);   g = sigmoid(x_g @ g1) @ g2
    kk       = normalize_per_head(k * k_k);     k = k * (1 + (a - 1) * k_a)
    y        = wkv7(r, decay, k, v, -kk, kk * a, state)
    y        = group_norm_heads(y) + sum_head(r * k * r_k) * v      # ln_x, eps 64e-5
    out      = output(y * g)

Channel mixing: ``value(relu(key(x + xx * x_k))**2)``. The model is
``emb -> blocks.0.ln0 -> blocks -> ln_out -> head``.

The state of each layer is ``[att_shift (B, C), wkv (B, H, S, S), ffn_shift (B, C)]`` (the
wkv state indexed [head, value, key], the convention of ``recurra.ops.rwkv_wkv7``). v_first
is per token, not carried.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

import recurra as rc
from recurra import ops
from recurra_models import nn
from recurra_models.lm import ConfigBase, State
from recurra_models.rwkv_base import (
    RWKVBlock,
    RWKVFamilyLM,
    _check_ints,
    _Init,
    _ratios,
    conform,
    count_layers,
    head_norm,
    head_size_of,
    official_arrays,
    reject_family,
    require_matrix,
    token_shift,
)

__all__ = ["RWKV7Block", "RWKV7ChannelMix", "RWKV7Config", "RWKV7LM", "RWKV7TimeMix"]

DECAY_SCALE = math.exp(-0.5)  # 0.606531 in the official code: w soft-clamped to (-inf, -0.5)

# Training memory: three elementwise chains of a block (the key update with kk, the bonus,
# group norm and gate after wkv7, and ln2 with the channel mixing's token shift and mix) run
# inside their own recomputation segments, so the backward keeps only what the matmuls and
# wkv7 read of them and makes the rest again right before their gradients (8 of a block's
# ~38 kept (B, T, C) tensors, for ~25 elementwise passes and one product with the narrow
# gate matrix; no C x C product). The norm and the mixes before the time mixing, the decay
# and the value gate would save 5 more for ~20 passes (+5% CPU work per step on 2 cores in
# all, measured): left out. The gradients are the same. False keeps every intermediate
# (the plan of before; tests compare against it). Under gradient_checkpointing the segments
# join the halves of the block.
RECOMPUTE_CHAINS = True


def _chain() -> Any:
    """A recomputation segment for a cheap chain (see RECOMPUTE_CHAINS), else nothing."""
    return rc.recompute() if RECOMPUTE_CHAINS else contextlib.nullcontext()


def _lora_dim(c: int, factor: float) -> int:
    """The official suggestion for a LoRA width: max(32, round(factor sqrt(C) / 32) * 32)."""
    return max(32, int(round(factor * math.sqrt(c) / 32) * 32))


@dataclass
class RWKV7Config(ConfigBase):
    """Sizes of an RWKV-7 LM. Zero sizes mean the official defaults: dim_ffn = 4 n_embd,
    LoRA widths from n_embd (decay and a: 2.5 sqrt(C), v: 1.7 sqrt(C), gate: 5 sqrt(C),
    rounded to multiples of 32). ``layer0_v_lora``: layer 0 holds the (unused) v0/v1/v2 like
    the current official training code (older checkpoints lack them)."""

    vocab_size: int = 256
    n_embd: int = 64
    n_layer: int = 2
    head_size: int = 64
    dim_ffn: int = 0
    d_decay_lora: int = 0
    d_aaa_lora: int = 0
    d_mv_lora: int = 0
    d_gate_lora: int = 0
    layer0_v_lora: bool = True

    def __post_init__(self) -> None:
        _check_ints(
            "RWKV7Config",
            positive=dict(
                vocab_size=self.vocab_size,
                n_embd=self.n_embd,
                n_layer=self.n_layer,
                head_size=self.head_size,
            ),
            non_negative=dict(
                dim_ffn=self.dim_ffn,
                d_decay_lora=self.d_decay_lora,
                d_aaa_lora=self.d_aaa_lora,
                d_mv_lora=self.d_mv_lora,
                d_gate_lora=self.d_gate_lora,
            ),
        )
        if self.n_embd % self.head_size:
            raise ValueError(
                f"RWKV7Config: n_embd {self.n_embd} is not a multiple of head_size {self.head_size}"
            )
        if not isinstance(self.layer0_v_lora, bool):
            raise ValueError(
                f"RWKV7Config: layer0_v_lora must be a bool, got {self.layer0_v_lora!r}"
            )

    @property
    def n_head(self) -> int:
        return self.n_embd // self.head_size

    def sizes(self) -> dict[str, int]:
        """The sizes actually used: ffn, decay, aaa, mv, gate."""
        c = self.n_embd
        return dict(
            ffn=self.dim_ffn or 4 * c,
            decay=self.d_decay_lora or _lora_dim(c, 2.5),
            aaa=self.d_aaa_lora or _lora_dim(c, 2.5),
            mv=self.d_mv_lora or _lora_dim(c, 1.7),
            gate=self.d_gate_lora or _lora_dim(c, 5.0),
        )


class RWKV7TimeMix(nn.Module):
    """RWKV-7 time mixing (``blocks.i.att``)."""

    def __init__(self, cfg: RWKV7Config, layer_id: int, rng: np.random.Generator | None) -> None:
        super().__init__()
        c, h, s = cfg.n_embd, cfg.n_head, cfg.head_size
        z = cfg.sizes()
        self.layer_id = layer_id
        self.n_head, self.head_size = h, s
        init = _Init(rng)
        r0, r1 = _ratios(layer_id, cfg.n_layer)
        ddd = np.arange(c) / c
        self.x_r = init.value((1, 1, c), 1.0 - ddd ** (0.2 * r1))
        self.x_w = init.value((1, 1, c), 1.0 - ddd ** (0.9 * r1))
        self.x_k = init.value((1, 1, c), 1.0 - ddd ** (0.7 * r1))
        self.x_v = init.value((1, 1, c), 1.0 - ddd ** (0.7 * r1))
        self.x_a = init.value((1, 1, c), 1.0 - ddd ** (0.9 * r1))
        self.x_g = init.value((1, 1, c), 1.0 - ddd ** (0.2 * r1))
        n = np.arange(c)
        linear = n / max(c - 1, 1) - 0.5
        zigzag = ((n % s) - (s - 1) / 2) / max((s - 1) / 2, 1)
        zigzag = zigzag * np.abs(zigzag)
        www = -6.0 + 6.0 * (n / max(c - 1, 1)) ** (1.0 + r0**0.3)
        self.w0 = init.value((1, 1, c), www + 0.5 + zigzag * 2.5)
        self.w1 = init.zeros((c, z["decay"]))
        self.w2 = init.orthogonal((z["decay"], c), 0.1 * _gain(z["decay"], c))
        self.a0 = init.value((1, 1, c), -0.19 + zigzag * 0.3 + linear * 0.4)
        self.a1 = init.zeros((c, z["aaa"]))
        self.a2 = init.orthogonal((z["aaa"], c), 0.1 * _gain(z["aaa"], c))
        if layer_id > 0 or cfg.layer0_v_lora:
            self.v0 = init.value((1, 1, c), 0.73 - linear * 0.4)
            self.v1 = init.zeros((c, z["mv"]))
            self.v2 = init.orthogonal((z["mv"], c), 0.1 * _gain(z["mv"], c))
        self.g1 = init.zeros((c, z["gate"]))
        self.g2 = init.orthogonal((z["gate"], c), 0.1 * _gain(z["gate"], c))
        self.k_k = init.value((1, 1, c), 0.71 - linear * 0.1)
        self.k_a = init.value((1, 1, c), 1.02)
        self.r_k = init.value((h, s), -0.04)
        bound = 1.0 / math.sqrt(c)
        self.receptance = init.linear_uniform(c, c, 0.5 * bound)
        self.key = init.linear_uniform(c, c, 0.05 * bound)
        self.value = init.linear_uniform(c, c, 0.5 * bound)
        self.output = init.linear(c, c, 0.0)
        self.ln_x = init.layer_norm(c, ((1 + layer_id) / cfg.n_layer) ** 0.7)

    def forward(
        self, x: Any, shift: Any, wkv: Any, v_first: Any | None, ln: nn.LayerNorm | None = None
    ) -> tuple[Any, Any, Any, Any]:
        """x (B, T, C) (ln1-normalised, or the block's input when ``ln``, the block's ln1, is
        given), shift (B, C), wkv (B, H, S, S), v_first (B, T, C) (None in layer 0, which
        makes it).

        Returns (output (B, T, C), new shift, new wkv state, v_first)."""
        b, t, c = x.shape
        h, s = self.n_head, self.head_size
        if ln is not None:
            x = ln(x)
        prev, new_shift = token_shift(x, shift)
        xx = prev - x
        xr, xk, xv = x + xx * self.x_r, x + xx * self.x_k, x + xx * self.x_v
        # The w, a and g mixes feed narrow LoRA matrices only (C -> 64..160): their first
        # products are recomputed in the backward from x and xx instead of keeping three
        # (B, T, C) mixes for the weight gradients (a few percent more LoRA work).
        with rc.recompute():
            lw = ops.matmul(x + xx * self.x_w, self.w1)
            la = ops.matmul(x + xx * self.x_a, self.a1)
            lg = ops.matmul(x + xx * self.x_g, self.g1)
        r = self.receptance(xr)
        k = self.key(xk)
        v = self.value(xv)
        wlog = self.w0 + ops.matmul(ops.tanh(lw), self.w2)
        decay = ops.exp(ops.sigmoid(wlog) * (-DECAY_SCALE))
        if v_first is None:
            v_first = v
        else:
            gate_v = ops.sigmoid(self.v0 + ops.matmul(ops.matmul(xv, self.v1), self.v2))
            v = v + (v_first - v) * gate_v
        a = ops.sigmoid(self.a0 + ops.matmul(la, self.a2))
        with _chain():  # keeps k and a, not k * k_k or k * a - k
            # F.normalize per head: kk / max(|kk|, 1e-12) == rms_norm(kk, 1e-24 / S) /
            # sqrt(S) up to the clamp region; rms_norm is one fused op with a stable
            # gradient. Made negated: wkv7 reads -kk and kk * a, and the backward keeps
            # only these two (with kk and -kk it kept three tensors of (B, T, C)); the sign
            # flips are exact.
            nkk = (k * self.k_k).reshape(b * t, h, s)
            nkk = ops.rms_norm(nkk, 1e-24 / s) * (-1.0 / math.sqrt(s))
            # k * (1 + (a - 1) * k_a) without scalar constants: the backward of a tensor
            # plus a constant reduces the whole gradient to the constant's shape (~25 ms per
            # op at 4 x 256 x 512 on 2 cores), for a constant that needs no gradient.
            k = k + (k * a - k) * self.k_a
            nkk_a = -(nkk * a.reshape(b * t, h, s))
        r3, k3, v3 = r.reshape(b * t, h, s), k.reshape(b * t, h, s), v.reshape(b * t, h, s)
        y, new_wkv = ops.rwkv_wkv7(r3, decay.reshape(b * t, h, s), k3, v3, nkk, nkk_a, wkv)
        # The output's input y * g is kept (the output weight's gradient reads it); the
        # group norm, the bonus, the gate and their sum are made again in the backward.
        with _chain():
            g = ops.matmul(ops.sigmoid(lg), self.g2)
            bonus = ops.sum(r3 * k3 * self.r_k, axis=-1, keepdims=True) * v3  # (BT, H, S)
            y = head_norm(y, b, t, self.ln_x) + bonus.reshape(b, t, c)
            yg = y * g
        return self.output(yg), new_shift, new_wkv, v_first


class RWKV7ChannelMix(nn.Module):
    """RWKV-7 channel mixing (``blocks.i.ffn``)."""

    def __init__(self, cfg: RWKV7Config, layer_id: int, rng: np.random.Generator | None) -> None:
        super().__init__()
        c, f = cfg.n_embd, cfg.sizes()["ffn"]
        init = _Init(rng)
        _, r1 = _ratios(layer_id, cfg.n_layer)
        self.x_k = init.value((1, 1, c), 1.0 - (np.arange(c) / c) ** (r1**4))
        self.key = init.linear_uniform(c, f, 0.5 / math.sqrt(c))
        self.value = init.linear(f, c, 0.0)

    def forward(self, x: Any, shift: Any, ln: nn.LayerNorm | None = None) -> tuple[Any, Any]:
        """x (B, T, C) (ln2-normalised, or the block's residual stream when ``ln``, the
        block's ln2, is given), shift (B, C). Returns (output, new shift)."""
        with _chain():  # keeps the key's input, not ln2's normalised output or xx
            if ln is not None:
                x = ln(x)
            prev, new_shift = token_shift(x, shift)
            xk = x + (prev - x) * self.x_k
        k = ops.relu_sqr(self.key(xk))
        return self.value(k), new_shift


class RWKV7Block(RWKVBlock):
    """``x + att(ln1(x))``, then ``x + ffn(ln2(x))``; block 0 also holds ``ln0``."""

    TimeMix = RWKV7TimeMix
    ChannelMix = RWKV7ChannelMix

    def forward(self, x: Any, state: list[Any], v_first: Any | None) -> tuple[Any, list[Any], Any]:
        """x (B, T, C), state [att_shift, wkv, ffn_shift], v_first (None in layer 0).

        Returns (x, new state, v_first)."""
        with self._half():
            dx, att_shift, wkv, v_first = self.att(x, state[0], state[1], v_first, self.ln1)
            x = x + dx
        with self._half():
            dx, ffn_shift = self.ffn(x, state[2], self.ln2)
            x = x + dx
        return x, [att_shift, wkv, ffn_shift], v_first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Checkpointed (recompute_), each half is a segment of its own (see _half), not
        # the whole block.
        return self.forward(*args, **kwargs)

    def _half(self) -> Any:
        """Under gradient checkpointing, a recomputation segment for one half of the block
        (time mixing, channel mixing): the backward then holds one half's intermediates at
        a time, for one more (B, T, C) tensor kept per block (the stream between them)."""
        return rc.recompute() if self.__dict__.get("_recompute") else contextlib.nullcontext()


class RWKV7LM(RWKVFamilyLM):
    """RWKV-7 causal LM (``arch = "rwkv7"``). Parameter names and shapes are those of the
    official checkpoints (``emb.weight``, ``blocks.{i}.att.x_r``, ``...att.w0``,
    ``...att.r_k``, ``ln_out.weight``, ``head.weight``), so ``state_dict()`` is an official
    state dict and :meth:`from_official` loads one."""

    arch: ClassVar[str] = "rwkv7"
    Config: ClassVar[type] = RWKV7Config
    Block: ClassVar[type] = RWKV7Block

    def run_blocks(self, x: Any, state: State) -> tuple[Any, State]:
        """The blocks over x from ``state``, layer 0 making v_first for the others; returns
        (x, new state)."""
        v_first = None
        new_state: State = []
        for blk, st in zip(self.blocks, state):
            x, st2, v_first = blk(x, st, v_first)
            new_state.append(st2)
        return x, new_state

    @classmethod
    def from_official(
        cls, state_dict: Mapping[str, Any], *, head_size: int | None = None
    ) -> RWKV7LM:
        """A model holding the weights of an official RWKV-7 state dict (keys such as
        ``blocks.0.att.w0``; float arrays of any float dtype, torch tensors too).

        The config is read from the shapes: n_embd and vocab from ``emb.weight``, the layer
        count from the ``blocks.{i}`` keys, heads from ``r_k`` (H, S) (stored flat, the head
        size is ``head_size``, default 64), dim_ffn and the LoRA widths from their matrices;
        ``layer0_v_lora`` from whether ``blocks.0.att.v0`` is present. Vectors stored squeezed
        ((C,) instead of (1, 1, C)) are accepted.

        Raises ValueError naming the key for a missing, unexpected or misshapen entry, or
        when the dict is an RWKV-6 one.
        """
        sd = official_arrays(state_dict)
        who = "RWKV7LM"
        reject_family(sd, ("blocks.0.att.time_faaaa", "blocks.0.att.time_maa_x"), who, "RWKV-6")
        vocab, c = require_matrix(sd, "emb.weight")
        n_layer = count_layers(sd)
        hs = head_size_of(sd, "blocks.0.att.r_k", c, "n_embd", head_size, who)
        # v1 of layer 0 may be absent; layer 1 (if any) always has it.
        mv_key = (
            "blocks.0.att.v1" if "blocks.0.att.v1" in sd or n_layer == 1 else ("blocks.1.att.v1")
        )
        d_mv = require_matrix(sd, mv_key)[1] if mv_key in sd else 32
        cfg = RWKV7Config(
            vocab_size=vocab,
            n_embd=c,
            n_layer=n_layer,
            head_size=hs,
            dim_ffn=require_matrix(sd, "blocks.0.ffn.key.weight")[0],
            d_decay_lora=require_matrix(sd, "blocks.0.att.w1")[1],
            d_aaa_lora=require_matrix(sd, "blocks.0.att.a1")[1],
            d_mv_lora=d_mv,
            d_gate_lora=require_matrix(sd, "blocks.0.att.g1")[1],
            layer0_v_lora="blocks.0.att.v0" in sd,
        )
        model = cls(cfg, seed=None)
        model.load_state_dict(conform(sd, model, "RWKV7LM.from_official"))
        return model


def _gain(rows: int, cols: int) -> float:
    """The official ortho_init gain factor: sqrt(rows / cols) for tall matrices, else 1."""
    return math.sqrt(rows / cols) if rows > cols else 1.0

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

The model around the blocks, the block itself, checkpoint reading and the initialisers are
:mod:`recurra_models.rwkv_base`'s, shared with :mod:`recurra_models.rwkv7`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from recurra import ops
from recurra_models import nn
from recurra_models.lm import ConfigBase
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
    require,
    require_matrix,
    token_shift,
)

__all__ = [
    "RWKV6Block",
    "RWKV6ChannelMix",
    "RWKV6Config",
    "RWKV6LM",
    "RWKV6TimeMix",
    "RWKVFamilyLM",
]


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
        k = ops.relu_sqr(self.key(x + xx * self.time_maa_k))
        rr = ops.sigmoid(self.receptance(x + xx * self.time_maa_r))
        return rr * self.value(k), new_shift


class RWKV6Block(RWKVBlock):
    """``x + att(ln1(x))``, then ``x + ffn(ln2(x))``; block 0 also holds ``ln0`` (applied by
    the model to the embeddings)."""

    TimeMix = RWKV6TimeMix
    ChannelMix = RWKV6ChannelMix

    def forward(self, x: Any, state: list[Any]) -> tuple[Any, list[Any]]:
        """x (B, T, C), state [att_shift, wkv, ffn_shift]. Returns (x, new state)."""
        dx, att_shift, wkv = self.att(self.ln1(x), state[0], state[1])
        out: tuple[Any, list[Any]] = self.channel_mix(x, dx, state, att_shift, wkv)
        return out


class RWKV6LM(RWKVFamilyLM):
    """RWKV-6 causal LM (``arch = "rwkv6"``). Parameter names and shapes are those of the
    official checkpoints (``emb.weight``, ``blocks.{i}.att.time_maa_x``, ...,
    ``ln_out.weight``, ``head.weight``), so ``state_dict()`` is an official state dict and
    :meth:`from_official` loads one."""

    arch: ClassVar[str] = "rwkv6"
    Config: ClassVar[type] = RWKV6Config
    Block: ClassVar[type] = RWKV6Block

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
        who = "RWKV6LM"
        reject_family(sd, ("blocks.0.att.r_k", "blocks.0.att.x_r"), who, "RWKV-7")
        vocab, c = require_matrix(sd, "emb.weight")
        n_layer = count_layers(sd)
        a = require_matrix(sd, "blocks.0.att.receptance.weight")[0]
        hs = head_size_of(sd, "blocks.0.att.time_faaaa", a, "dim_att", head_size, who)
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

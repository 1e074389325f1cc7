"""Plain PyTorch eager RWKV-6 and RWKV-7 language models: the peer that recurra's RWKV6LM /
RWKV7LM are timed against.

They load the same official state dicts (numpy arrays or torch tensors under the official
key names), run the whole sequence at once for everything but the wkv recurrence, and run
that recurrence as a Python loop over time, batched over the batch and the heads: what a
PyTorch user without custom CUDA/Triton kernels writes. Autograd works through both.

    model = TorchRWKV7(state_dict, dtype=torch.float32, device="cpu")
    logits, state = model(tokens)             # tokens: int64 (B, T); logits (B, T, V)
    logits, state = model(next_tokens, state)  # continue from the state

State per layer: (att_shift (B, C), wkv (B, H, S, S), ffn_shift (B, C)), wkv indexed
[head, key, value] for RWKV-6 and [head, value, key] for RWKV-7 (as recurra's ops).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - torch's usual name

__all__ = ["TorchRWKV6", "TorchRWKV7", "greedy_generate", "torch_rwkv_from_official"]

LN_X_EPS = 64e-5
DECAY_SCALE = math.exp(-0.5)  # RWKV-7 decay exp(-exp(-0.5) * sigmoid(w))

LayerState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class _Base(torch.nn.Module):
    """Shared loading (official keys -> one flat ParameterDict) and the model skeleton."""

    head_key = ""

    def __init__(
        self,
        state_dict: Mapping[str, Any],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        head_size: int = 64,
    ) -> None:
        super().__init__()
        self.p = torch.nn.ParameterDict()
        self._names: dict[str, str] = {}
        for key, value in state_dict.items():
            t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
            safe = key.replace(".", "__")  # ParameterDict keys cannot contain dots
            self._names[key] = safe
            self.p[safe] = torch.nn.Parameter(t.detach().to(device=device, dtype=dtype).clone())
        self.n_layer = 1 + max(
            int(m.group(1)) for k in state_dict if (m := re.match(r"blocks\.(\d+)\.", k))
        )
        self.vocab, self.n_embd = self.w("emb.weight").shape
        hk = self.w(self.head_key)
        self.n_head, self.head_size = (
            tuple(hk.shape) if hk.ndim == 2 else (hk.numel() // head_size, head_size)
        )

    def w(self, key: str) -> torch.Tensor:
        """The parameter of official key ``key``."""
        return self.p[self._names[key]]

    def vec(self, key: str) -> torch.Tensor:
        """A per-channel parameter flattened to (C,)."""
        return self.w(key).reshape(-1)

    def zero_state(self, batch: int) -> list[LayerState]:
        """Zeros: per layer (att_shift (B, C), wkv (B, H, S, S), ffn_shift (B, C))."""
        ref = self.w("emb.weight")
        c, h, s = self.n_embd, self.n_head, self.head_size
        return [
            (ref.new_zeros(batch, c), ref.new_zeros(batch, h, s, s), ref.new_zeros(batch, c))
            for _ in range(self.n_layer)
        ]

    def _ln(self, x: torch.Tensor, key: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w(key + ".weight"), self.w(key + ".bias"))

    def _head_norm(self, y: torch.Tensor, key: str) -> torch.Tensor:
        b, t, a = y.shape
        yn = F.group_norm(
            y.reshape(b * t, a),
            self.n_head,
            self.w(key + ".weight"),
            self.w(key + ".bias"),
            eps=LN_X_EPS,
        )
        return yn.reshape(b, t, a)

    @staticmethod
    def _shift(x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return torch.cat([prev.unsqueeze(1), x[:, :-1]], dim=1)

    def forward(
        self, tokens: torch.Tensor, state: list[LayerState] | None = None
    ) -> tuple[torch.Tensor, list[LayerState]]:
        """Logits (B, T, V) of int64 tokens (B, T) from ``state`` (None: zeros), and the state
        after the last token."""
        b = tokens.shape[0]
        state = state if state is not None else self.zero_state(b)
        x = self._ln(F.embedding(tokens, self.w("emb.weight")), "blocks.0.ln0")
        new_state = []
        v_first = None
        for i in range(self.n_layer):
            pre = f"blocks.{i}."
            a_prev, wkv, f_prev = state[i]
            xa = self._ln(x, pre + "ln1")
            dx, wkv, v_first = self._att(i, xa, a_prev, wkv, v_first)
            x = x + dx
            xf = self._ln(x, pre + "ln2")
            x = x + self._ffn(i, xf, f_prev)
            new_state.append((xa[:, -1], wkv, xf[:, -1]))
        x = self._ln(x, "ln_out")
        return x @ self.w("head.weight").T, new_state

    def _att(
        self,
        i: int,
        x: torch.Tensor,
        prev: torch.Tensor,
        wkv: torch.Tensor,
        v_first: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def _ffn(self, i: int, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TorchRWKV6(_Base):
    """RWKV-6 (x060) in eager PyTorch."""

    head_key = "blocks.0.att.time_faaaa"

    def _att(
        self, i: int, x: torch.Tensor, prev: torch.Tensor, wkv: torch.Tensor, v_first: Any
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        p = f"blocks.{i}.att."
        b, t, c = x.shape
        h, s = self.n_head, self.head_size
        xx = self._shift(x, prev) - x
        w2 = self.w(p + "time_maa_w2")
        lora = torch.tanh((x + xx * self.vec(p + "time_maa_x")) @ self.w(p + "time_maa_w1"))
        lora = lora.reshape(b * t, 5, -1).transpose(0, 1)
        mw, mk, mv, mr, mg = torch.bmm(lora, w2).reshape(5, b, t, c).unbind(0)
        xw = x + xx * (self.vec(p + "time_maa_w") + mw)
        xk = x + xx * (self.vec(p + "time_maa_k") + mk)
        xv = x + xx * (self.vec(p + "time_maa_v") + mv)
        xr = x + xx * (self.vec(p + "time_maa_r") + mr)
        xg = x + xx * (self.vec(p + "time_maa_g") + mg)
        r = xr @ self.w(p + "receptance.weight").T
        k = xk @ self.w(p + "key.weight").T
        v = xv @ self.w(p + "value.weight").T
        g = F.silu(xg @ self.w(p + "gate.weight").T)
        wlog = self.vec(p + "time_decay") + torch.tanh(xw @ self.w(p + "time_decay_w1")) @ self.w(
            p + "time_decay_w2"
        )
        decay = torch.exp(-torch.exp(wlog))
        u = self.w(p + "time_faaaa").reshape(1, h, s, 1)
        r4, k4, v4, d4 = (z.reshape(b, t, h, s) for z in (r, k, v, decay))
        ys = []
        for j in range(t):
            kv = k4[:, j, :, :, None] * v4[:, j, :, None, :]  # (B, H, key, value)
            ys.append(torch.einsum("bhi,bhij->bhj", r4[:, j], u * kv + wkv))
            wkv = d4[:, j, :, :, None] * wkv + kv
        y = self._head_norm(torch.stack(ys, 1).reshape(b, t, h * s), p + "ln_x")
        return (y * g) @ self.w(p + "output.weight").T, wkv, None

    def _ffn(self, i: int, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        p = f"blocks.{i}.ffn."
        xx = self._shift(x, prev) - x
        k = torch.relu((x + xx * self.vec(p + "time_maa_k")) @ self.w(p + "key.weight").T) ** 2
        xr = x + xx * self.vec(p + "time_maa_r")
        rr = torch.sigmoid(xr @ self.w(p + "receptance.weight").T)
        return rr * (k @ self.w(p + "value.weight").T)


class TorchRWKV7(_Base):
    """RWKV-7 (x070) in eager PyTorch."""

    head_key = "blocks.0.att.r_k"

    def _att(
        self,
        i: int,
        x: torch.Tensor,
        prev: torch.Tensor,
        wkv: torch.Tensor,
        v_first: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        p = f"blocks.{i}.att."
        b, t, c = x.shape
        h, s = self.n_head, self.head_size
        xx = self._shift(x, prev) - x
        xr, xw, xk, xv, xa, xg = (x + xx * self.vec(p + f"x_{n}") for n in "rwkvag")
        r = xr @ self.w(p + "receptance.weight").T
        k = xk @ self.w(p + "key.weight").T
        v = xv @ self.w(p + "value.weight").T
        wlog = self.vec(p + "w0") + torch.tanh(xw @ self.w(p + "w1")) @ self.w(p + "w2")
        decay = torch.exp(-DECAY_SCALE * torch.sigmoid(wlog))
        if v_first is None:
            v_first = v
        else:
            gate = torch.sigmoid(self.vec(p + "v0") + (xv @ self.w(p + "v1")) @ self.w(p + "v2"))
            v = v + (v_first - v) * gate
        a = torch.sigmoid(self.vec(p + "a0") + (xa @ self.w(p + "a1")) @ self.w(p + "a2"))
        g = torch.sigmoid(xg @ self.w(p + "g1")) @ self.w(p + "g2")
        kk = F.normalize((k * self.vec(p + "k_k")).reshape(b, t, h, s), dim=-1, p=2.0)
        k = k * (1 + (a - 1) * self.vec(p + "k_a"))
        r4, w4, k4, v4, a4 = (z.reshape(b, t, h, s) for z in (r, decay, k, v, a))
        ys = []
        for j in range(t):  # S = S diag(w) + (S (-kk)) (kk a)^T + v k^T;  y = S r
            sa = torch.einsum("bhij,bhj->bhi", wkv, -kk[:, j])
            wkv = (
                wkv * w4[:, j, :, None, :]
                + sa[..., None] * (kk[:, j] * a4[:, j])[:, :, None]
                + v4[:, j, :, :, None] * k4[:, j, :, None, :]
            )
            ys.append(torch.einsum("bhij,bhj->bhi", wkv, r4[:, j]))
        y = self._head_norm(torch.stack(ys, 1).reshape(b, t, c), p + "ln_x")
        bonus = (r4 * k4 * self.w(p + "r_k").reshape(h, s)).sum(-1, keepdim=True) * v4
        y = y + bonus.reshape(b, t, c)
        return (y * g) @ self.w(p + "output.weight").T, wkv, v_first

    def _ffn(self, i: int, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        p = f"blocks.{i}.ffn."
        xk = x + (self._shift(x, prev) - x) * self.vec(p + "x_k")
        return (torch.relu(xk @ self.w(p + "key.weight").T) ** 2) @ self.w(p + "value.weight").T


def torch_rwkv_from_official(
    state_dict: Mapping[str, Any],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    head_size: int = 64,
) -> _Base:
    """TorchRWKV6 or TorchRWKV7 for an official state dict (version from the keys:
    ``blocks.0.att.r_k`` means RWKV-7). ``head_size`` is only used for a flat time_faaaa/r_k.
    """
    cls = TorchRWKV7 if "blocks.0.att.r_k" in state_dict else TorchRWKV6
    return cls(state_dict, dtype=dtype, device=device, head_size=head_size)


@torch.no_grad()
def greedy_generate(model: _Base, prompt: torch.Tensor, n_tokens: int) -> list[int]:
    """Greedy decoding: the prompt (1, T) int64 runs once (prefill), then each new token is one
    recurrent step from the carried state. Returns the ``n_tokens`` new ids."""
    logits, state = model(prompt)
    out: list[int] = []
    for _ in range(n_tokens):
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        logits, state = model(torch.tensor([[tok]], device=prompt.device), state)
    return out

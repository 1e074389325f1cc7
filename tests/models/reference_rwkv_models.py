"""Float64 numpy references of the RWKV-6 ("Finch", x060) and RWKV-7 ("Goose", x070) language
models, and random state dicts in the official checkpoint layout.

Written from the published model definitions (BlinkDL's RWKV-LM v6/v7 model code and the
``rwkv`` pip package), in RNN form: one token at a time through every layer, carrying the
state. This shares nothing with recurra's parallel implementation (which pads/concats the
token shift and runs the wkv kernels over whole sequences), so agreement checks both.

Official key layout (as stored in the ``.pth`` files written by the official training code;
C = n_embd, A = dim_att = H * S, F = dim_ffn, V = vocab):

common: ``emb.weight`` (V, C), ``blocks.0.ln0.{weight,bias}`` (C,) (layer 0 only),
``blocks.i.ln1/ln2.{weight,bias}`` (C,), ``ln_out.{weight,bias}`` (C,), ``head.weight`` (V, C);
every ``*.weight`` of a linear layer is (out, in) like ``torch.nn.Linear``.

RWKV-6 ``blocks.i.att.``: ``time_maa_{x,w,k,v,r,g}`` (1, 1, C); ``time_maa_w1`` (C, 5 D_mix);
``time_maa_w2`` (5, D_mix, C) with the five LoRA outputs in the order w, k, v, r, g;
``time_decay`` (1, 1, A); ``time_decay_w1`` (C, D_decay); ``time_decay_w2`` (D_decay, A);
``time_faaaa`` (H, S) (some converters flatten it to (A,)); ``receptance/key/value/gate.weight``
(A, C); ``output.weight`` (C, A); ``ln_x.{weight,bias}`` (A,) (GroupNorm over H heads,
eps 64e-5). ``blocks.i.ffn.``: ``time_maa_{k,r}`` (1, 1, C), ``key.weight`` (F, C),
``receptance.weight`` (C, C), ``value.weight`` (C, F).

RWKV-7 ``blocks.i.att.``: ``x_{r,w,k,v,a,g}`` (1, 1, C); ``w0, a0, v0`` (1, 1, C);
``w1, a1, v1, g1`` (C, D_*); ``w2, a2, v2, g2`` (D_*, C); ``k_k, k_a`` (1, 1, C); ``r_k`` (H, S);
``receptance/key/value/output.weight`` (C, C); ``ln_x.{weight,bias}`` (C,). Layer 0 has
``v0/v1/v2`` in checkpoints of the current training code but they are unused there (layer 0
stores its value as ``v_first``); some checkpoints lack them. ``blocks.i.ffn.``: ``x_k``
(1, 1, C), ``key.weight`` (F, C), ``value.weight`` (C, F) (F = 4 C in the official models).

State (both versions), one entry per layer: ``(att_shift (B, C), wkv (B, H, S, S),
ffn_shift (B, C))``; the wkv state is indexed [h, key i, value j] for RWKV-6 and
[h, value i, key j] for RWKV-7 (the conventions of recurra's ops).
"""

from __future__ import annotations

import math
import re

import numpy as np

Array = np.ndarray
StateDict = dict[str, Array]
LayerState = tuple[Array, Array, Array]

LN_EPS = 1e-5
LN_X_EPS = 64e-5  # 1e-5 * head_size_divisor**2 in the official code (divisor 8)
W7_SCALE = math.exp(-0.5)  # RWKV-7: decay = exp(-exp(-0.5) * sigmoid(w)); 0.606531 officially


def _f64(sd: StateDict) -> StateDict:
    return {k: np.asarray(v, np.float64) for k, v in sd.items()}


def _sigmoid(x: Array) -> Array:
    return 1.0 / (1.0 + np.exp(-x))


def layer_norm(x: Array, w: Array, b: Array, eps: float = LN_EPS) -> Array:
    """LayerNorm over the last axis (biased variance); returns x's shape."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w.reshape(-1) + b.reshape(-1)


def group_norm(x: Array, n_groups: int, w: Array, b: Array, eps: float = LN_X_EPS) -> Array:
    """torch GroupNorm on (B, A) rows: normalise each of ``n_groups`` contiguous channel groups,
    then the per-channel affine. Returns (B, A)."""
    bsz, a = x.shape
    g = x.reshape(bsz, n_groups, a // n_groups)
    mu = g.mean(-1, keepdims=True)
    var = ((g - mu) ** 2).mean(-1, keepdims=True)
    return ((g - mu) / np.sqrt(var + eps)).reshape(bsz, a) * w.reshape(-1) + b.reshape(-1)


def n_layers_of(sd: StateDict) -> int:
    """The number of blocks in an official state dict (1 + the largest ``blocks.i``)."""
    ids = [int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))]
    return max(ids) + 1


def _heads(sd: StateDict, key: str, head_size: int | None) -> tuple[int, int]:
    shape = np.shape(sd[key])
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    size = int(np.prod(shape))
    s = head_size or 64
    return size // s, s


def zero_state(sd: StateDict, batch: int, head_size: int | None = None) -> list[LayerState]:
    """The all-zero state of either version (head size from ``time_faaaa`` / ``r_k``)."""
    key = "blocks.0.att.time_faaaa" if "blocks.0.att.time_faaaa" in sd else "blocks.0.att.r_k"
    h, s = _heads(sd, key, head_size)
    c = np.shape(sd["emb.weight"])[1]
    return [
        (np.zeros((batch, c)), np.zeros((batch, h, s, s)), np.zeros((batch, c)))
        for _ in range(n_layers_of(sd))
    ]


# --------------------------------------------------------------------------------------------
# RWKV-6
# --------------------------------------------------------------------------------------------
def _tmix6(p: StateDict, x: Array, prev: Array, wkv: Array, h: int, s: int) -> tuple[Array, Array]:
    """One token of RWKV-6 time mixing for a batch: x, prev (B, C), wkv (B, H, S, S)."""
    bsz = x.shape[0]
    xx = prev - x
    xxx = x + xx * p["time_maa_x"].reshape(-1)
    w2 = p["time_maa_w2"]
    n_lora = w2.shape[1]
    lora = np.tanh(xxx @ p["time_maa_w1"]).reshape(bsz, 5, n_lora)
    mw, mk, mv, mr, mg = (lora[:, i] @ w2[i] for i in range(5))

    def mix(name: str, m: Array) -> Array:
        return x + xx * (p[name].reshape(-1) + m)

    xw, xk, xv = mix("time_maa_w", mw), mix("time_maa_k", mk), mix("time_maa_v", mv)
    xr, xg = mix("time_maa_r", mr), mix("time_maa_g", mg)
    r = xr @ p["receptance.weight"].T
    k = xk @ p["key.weight"].T
    v = xv @ p["value.weight"].T
    gz = xg @ p["gate.weight"].T
    g = gz * _sigmoid(gz)
    wlog = p["time_decay"].reshape(-1) + np.tanh(xw @ p["time_decay_w1"]) @ p["time_decay_w2"]
    decay = np.exp(-np.exp(wlog))
    u = p["time_faaaa"].reshape(h, s)
    r, k, v, decay = (z.reshape(bsz, h, s) for z in (r, k, v, decay))
    kv = k[..., :, None] * v[..., None, :]  # (B, H, key i, value j)
    y = np.einsum("bhi,bhij->bhj", r, u[None, :, :, None] * kv + wkv)
    wkv = decay[..., :, None] * wkv + kv
    y = group_norm(y.reshape(bsz, h * s), h, p["ln_x.weight"], p["ln_x.bias"])
    return (y * g) @ p["output.weight"].T, wkv


def _cmix6(p: StateDict, x: Array, prev: Array) -> Array:
    xx = prev - x
    xk = x + xx * p["time_maa_k"].reshape(-1)
    xr = x + xx * p["time_maa_r"].reshape(-1)
    k = np.maximum(xk @ p["key.weight"].T, 0.0) ** 2
    return _sigmoid(xr @ p["receptance.weight"].T) * (k @ p["value.weight"].T)


def rwkv6_forward(
    sd: StateDict,
    tokens: Array,
    state: list[LayerState] | None = None,
    head_size: int | None = None,
) -> tuple[Array, list[LayerState]]:
    """Runs an RWKV-6 official state dict over int tokens (B, T), token by token.

    Returns ``(logits (B, T, V), state)`` in float64, the state after the last token.
    ``head_size`` is only needed when ``time_faaaa`` is stored flat (default 64).
    """
    sd = _f64(sd)
    tokens = np.asarray(tokens)
    bsz, t_len = tokens.shape
    h, s = _heads(sd, "blocks.0.att.time_faaaa", head_size)
    n_layer = n_layers_of(sd)
    st = [tuple(z.copy() for z in ls) for ls in (state or zero_state(sd, bsz, head_size))]
    logits = []
    for t in range(t_len):
        x = sd["emb.weight"][tokens[:, t]]
        x = layer_norm(x, sd["blocks.0.ln0.weight"], sd["blocks.0.ln0.bias"])
        for i in range(n_layer):
            pre = f"blocks.{i}."
            att = {k[len(pre) + 4 :]: v for k, v in sd.items() if k.startswith(pre + "att.")}
            ffn = {k[len(pre) + 4 :]: v for k, v in sd.items() if k.startswith(pre + "ffn.")}
            a_prev, wkv, f_prev = st[i]
            xa = layer_norm(x, sd[pre + "ln1.weight"], sd[pre + "ln1.bias"])
            dx, wkv = _tmix6(att, xa, a_prev, wkv, h, s)
            x = x + dx
            xf = layer_norm(x, sd[pre + "ln2.weight"], sd[pre + "ln2.bias"])
            x = x + _cmix6(ffn, xf, f_prev)
            st[i] = (xa, wkv, xf)
        x = layer_norm(x, sd["ln_out.weight"], sd["ln_out.bias"])
        logits.append(x @ sd["head.weight"].T)
    return np.stack(logits, axis=1), st


# --------------------------------------------------------------------------------------------
# RWKV-7
# --------------------------------------------------------------------------------------------
def _tmix7(
    p: StateDict,
    x: Array,
    prev: Array,
    wkv: Array,
    v_first: Array | None,
    h: int,
    s: int,
) -> tuple[Array, Array, Array]:
    """One token of RWKV-7 time mixing: returns (output, new wkv, v_first)."""
    bsz = x.shape[0]
    xx = prev - x
    xr, xw, xk, xv, xa, xg = (x + xx * p[f"x_{n}"].reshape(-1) for n in "rwkvag")
    r = xr @ p["receptance.weight"].T
    k = xk @ p["key.weight"].T
    v = xv @ p["value.weight"].T
    wlog = p["w0"].reshape(-1) + np.tanh(xw @ p["w1"]) @ p["w2"]
    decay = np.exp(-W7_SCALE * _sigmoid(wlog))
    if v_first is None:  # layer 0
        v_first = v
    else:
        v = v + (v_first - v) * _sigmoid(p["v0"].reshape(-1) + (xv @ p["v1"]) @ p["v2"])
    a = _sigmoid(p["a0"].reshape(-1) + (xa @ p["a1"]) @ p["a2"])
    g = _sigmoid(xg @ p["g1"]) @ p["g2"]
    kk = (k * p["k_k"].reshape(-1)).reshape(bsz, h, s)
    kk = kk / np.maximum(np.linalg.norm(kk, axis=-1, keepdims=True), 1e-12)
    k = k * (1.0 + (a - 1.0) * p["k_a"].reshape(-1))
    r3, w3, k3, v3, a3 = (z.reshape(bsz, h, s) for z in (r, decay, k, v, a))
    # S = S diag(w) + (S (-kk)) (kk a)^T + v k^T, S indexed [value i, key j]
    sa = np.einsum("bhij,bhj->bhi", wkv, -kk)
    wkv = (
        wkv * w3[:, :, None, :]
        + sa[..., :, None] * (kk * a3)[..., None, :]
        + v3[..., :, None] * k3[..., None, :]
    )
    y = np.einsum("bhij,bhj->bhi", wkv, r3).reshape(bsz, h * s)
    y = group_norm(y, h, p["ln_x.weight"], p["ln_x.bias"])
    bonus = (r3 * k3 * p["r_k"].reshape(h, s)).sum(-1, keepdims=True) * v3
    y = y + bonus.reshape(bsz, h * s)
    return (y * g) @ p["output.weight"].T, wkv, v_first


def _cmix7(p: StateDict, x: Array, prev: Array) -> Array:
    xk = x + (prev - x) * p["x_k"].reshape(-1)
    k = np.maximum(xk @ p["key.weight"].T, 0.0) ** 2
    return k @ p["value.weight"].T


def rwkv7_forward(
    sd: StateDict,
    tokens: Array,
    state: list[LayerState] | None = None,
    head_size: int | None = None,
) -> tuple[Array, list[LayerState]]:
    """Runs an RWKV-7 official state dict over int tokens (B, T), token by token.

    Returns ``(logits (B, T, V), state)`` in float64, the state after the last token.
    """
    sd = _f64(sd)
    tokens = np.asarray(tokens)
    bsz, t_len = tokens.shape
    h, s = _heads(sd, "blocks.0.att.r_k", head_size)
    n_layer = n_layers_of(sd)
    st = [tuple(z.copy() for z in ls) for ls in (state or zero_state(sd, bsz, head_size))]
    logits = []
    for t in range(t_len):
        x = sd["emb.weight"][tokens[:, t]]
        x = layer_norm(x, sd["blocks.0.ln0.weight"], sd["blocks.0.ln0.bias"])
        v_first = None
        for i in range(n_layer):
            pre = f"blocks.{i}."
            att = {k[len(pre) + 4 :]: v for k, v in sd.items() if k.startswith(pre + "att.")}
            ffn = {k[len(pre) + 4 :]: v for k, v in sd.items() if k.startswith(pre + "ffn.")}
            a_prev, wkv, f_prev = st[i]
            xa = layer_norm(x, sd[pre + "ln1.weight"], sd[pre + "ln1.bias"])
            dx, wkv, v_first = _tmix7(att, xa, a_prev, wkv, v_first, h, s)
            x = x + dx
            xf = layer_norm(x, sd[pre + "ln2.weight"], sd[pre + "ln2.bias"])
            x = x + _cmix7(ffn, xf, f_prev)
            st[i] = (xa, wkv, xf)
        x = layer_norm(x, sd["ln_out.weight"], sd["ln_out.bias"])
        logits.append(x @ sd["head.weight"].T)
    return np.stack(logits, axis=1), st


# --------------------------------------------------------------------------------------------
# Random official-layout state dicts
# --------------------------------------------------------------------------------------------
def _common(rng: np.random.Generator, sd: StateDict, vocab: int, c: int, n_layer: int) -> None:
    def ln(name: str) -> None:
        sd[f"{name}.weight"] = (1.0 + 0.2 * rng.standard_normal(c)).astype(np.float32)
        sd[f"{name}.bias"] = (0.2 * rng.standard_normal(c)).astype(np.float32)

    sd["emb.weight"] = rng.standard_normal((vocab, c)).astype(np.float32)
    ln("blocks.0.ln0")
    for i in range(n_layer):
        ln(f"blocks.{i}.ln1")
        ln(f"blocks.{i}.ln2")
    ln("ln_out")
    sd["head.weight"] = (rng.standard_normal((vocab, c)) / math.sqrt(c)).astype(np.float32)


def _mat(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> Array:
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _uni(rng: np.random.Generator, shape: tuple[int, ...], lo: float, hi: float) -> Array:
    return rng.uniform(lo, hi, shape).astype(np.float32)


def random_rwkv6_state_dict(
    *,
    vocab: int = 64,
    n_embd: int = 32,
    head_size: int = 8,
    n_layer: int = 2,
    dim_ffn: int | None = None,
    d_mix: int = 8,
    d_decay: int = 8,
    flat_faaaa: bool = False,
    seed: int = 0,
) -> StateDict:
    """A random RWKV-6 state dict in the official layout (float32 arrays).

    Values are scaled like a trained model's (decays in about (0.1, 0.97), mixes in (0, 1),
    linear weights ~ 1/sqrt(fan_in)). ``flat_faaaa`` stores ``time_faaaa`` as (A,).
    """
    rng = np.random.default_rng(seed)
    c, a = n_embd, n_embd
    h, s = a // head_size, head_size
    f = dim_ffn or int((c * 3.5) // 32 * 32) or 4 * c
    sd: StateDict = {}
    _common(rng, sd, vocab, c, n_layer)
    for i in range(n_layer):
        p = f"blocks.{i}.att."
        for n in "xwkvrg":
            sd[p + f"time_maa_{n}"] = _uni(rng, (1, 1, c), 0.0, 1.0)
        sd[p + "time_maa_w1"] = _mat(rng, (c, 5 * d_mix), 0.3)
        sd[p + "time_maa_w2"] = _mat(rng, (5, d_mix, c), 0.2)
        sd[p + "time_decay"] = _uni(rng, (1, 1, a), -3.0, 0.5)
        sd[p + "time_decay_w1"] = _mat(rng, (c, d_decay), 0.3)
        sd[p + "time_decay_w2"] = _mat(rng, (d_decay, a), 0.2)
        faaaa = _uni(rng, (h, s), -0.5, 0.5)
        sd[p + "time_faaaa"] = faaaa.reshape(-1) if flat_faaaa else faaaa
        for n in ("receptance", "key", "value", "gate"):
            sd[p + f"{n}.weight"] = _mat(rng, (a, c), 1.0 / math.sqrt(c))
        sd[p + "output.weight"] = _mat(rng, (c, a), 1.0 / math.sqrt(a))
        sd[p + "ln_x.weight"] = (1.0 + 0.2 * rng.standard_normal(a)).astype(np.float32)
        sd[p + "ln_x.bias"] = _mat(rng, (a,), 0.2)
        q = f"blocks.{i}.ffn."
        sd[q + "time_maa_k"] = _uni(rng, (1, 1, c), 0.0, 1.0)
        sd[q + "time_maa_r"] = _uni(rng, (1, 1, c), 0.0, 1.0)
        sd[q + "key.weight"] = _mat(rng, (f, c), 1.0 / math.sqrt(c))
        sd[q + "receptance.weight"] = _mat(rng, (c, c), 1.0 / math.sqrt(c))
        sd[q + "value.weight"] = _mat(rng, (c, f), 1.0 / math.sqrt(f))
    return sd


def random_rwkv7_state_dict(
    *,
    vocab: int = 64,
    n_embd: int = 32,
    head_size: int = 8,
    n_layer: int = 2,
    dim_ffn: int | None = None,
    d_decay: int = 8,
    d_aaa: int = 8,
    d_mv: int = 8,
    d_gate: int = 16,
    layer0_v_lora: bool = True,
    seed: int = 0,
) -> StateDict:
    """A random RWKV-7 state dict in the official layout (float32 arrays).

    ``layer0_v_lora`` adds the (unused) ``blocks.0.att.v0/v1/v2`` like the current training
    code does; without it layer 0 lacks them, like older checkpoints.
    """
    rng = np.random.default_rng(seed)
    c = n_embd
    h, s = c // head_size, head_size
    f = dim_ffn or 4 * c
    sd: StateDict = {}
    _common(rng, sd, vocab, c, n_layer)
    for i in range(n_layer):
        p = f"blocks.{i}.att."
        for n in "rwkvag":
            sd[p + f"x_{n}"] = _uni(rng, (1, 1, c), 0.0, 1.0)
        sd[p + "w0"] = _uni(rng, (1, 1, c), -4.0, 1.0)
        sd[p + "w1"] = _mat(rng, (c, d_decay), 0.3)
        sd[p + "w2"] = _mat(rng, (d_decay, c), 0.3)
        sd[p + "a0"] = _uni(rng, (1, 1, c), -1.0, 1.0)
        sd[p + "a1"] = _mat(rng, (c, d_aaa), 0.3)
        sd[p + "a2"] = _mat(rng, (d_aaa, c), 0.3)
        if i > 0 or layer0_v_lora:
            sd[p + "v0"] = _uni(rng, (1, 1, c), -1.0, 1.0)
            sd[p + "v1"] = _mat(rng, (c, d_mv), 0.3)
            sd[p + "v2"] = _mat(rng, (d_mv, c), 0.3)
        sd[p + "g1"] = _mat(rng, (c, d_gate), 0.3)
        sd[p + "g2"] = _mat(rng, (d_gate, c), 0.3)
        sd[p + "k_k"] = _uni(rng, (1, 1, c), 0.5, 1.0)
        sd[p + "k_a"] = _uni(rng, (1, 1, c), 0.5, 1.5)
        sd[p + "r_k"] = _mat(rng, (h, s), 0.3)
        for n in ("receptance", "key", "value", "output"):
            sd[p + f"{n}.weight"] = _mat(rng, (c, c), 1.0 / math.sqrt(c))
        sd[p + "ln_x.weight"] = (1.0 + 0.2 * rng.standard_normal(c)).astype(np.float32)
        sd[p + "ln_x.bias"] = _mat(rng, (c,), 0.2)
        q = f"blocks.{i}.ffn."
        sd[q + "x_k"] = _uni(rng, (1, 1, c), 0.0, 1.0)
        sd[q + "key.weight"] = _mat(rng, (f, c), 1.0 / math.sqrt(c))
        sd[q + "value.weight"] = _mat(rng, (c, f), 1.0 / math.sqrt(f))
    return sd

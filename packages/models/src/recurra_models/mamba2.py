"""Mamba-2 language model (Dao & Gu, 2024) with the parameter names of Hugging Face's
``Mamba2ForCausalLM``.

Per layer: ``x + mixer(rms_norm(x))`` with the mixer

    z, xBC, dt = in_proj(h).split(d_inner, d_inner + 2 * n_groups * d_state, n_heads)
    xBC        = silu(causal_depthwise_conv(xBC) + conv_bias)
    x, B, C    = xBC.split(d_inner, n_groups * d_state, n_groups * d_state)
    y          = multi_head_scan(x, dt + dt_bias, A = -exp(A_log) per head, B, C) + D * x
    out        = out_proj(group_rms_norm(y * silu(z)) * norm_weight)

(the D skip and the gated norm are one op, ops.gated_rms_norm).

then a final RMSNorm and the LM head (untied by default, like Hugging Face's config).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

import recurra as rc
from recurra import ops
from recurra_models import nn
from recurra_models.lm import (
    ConfigBase,
    _positive,
    causal_conv,
    init_dt_bias,
)
from recurra_models.mamba import MambaBlock, MambaFamilyLM, _Conv1d, _zeros, step_constant

__all__ = ["GatedRMSNorm", "Mamba2Block", "Mamba2Config", "Mamba2LM", "Mamba2Mixer"]

# Under autocast the gated norm and out_proj of a mixer form one recomputation segment
# (recurra.recompute): the backward runs them again (one more out_proj product and norm
# per layer) right before their gradients, so that the norm's 2-byte output, out_proj's
# input (d_inner * 2 bytes per token, 12.5 MB per Mamba2-130m layer at 8 x 512), is not
# kept through the step; the segment's inputs (y, z, x) are kept for the norm's gradient
# anyway. False keeps that output (the plan of before; tests compare the two: the same
# gradients, bit for bit). Float32 steps do not recompute.
RECOMPUTE_NORM_PROJ = True
# The scan's ``checkpoints`` argument (ops.ssm_scan): None saves the states entering each
# chunk except under autocast (the chunked device backward then recomputes them); True
# saves them under autocast too (the plan of before, for comparisons).
SCAN_CHECKPOINTS: bool | None = None
# Under autocast, the last KEEP_NORM_PROJ of the layers (a fraction: the last
# floor(KEEP_NORM_PROJ * n_layer)) keep their norm's output (no recomputation segment:
# out_proj's product and the norm run once), and the last KEEP_CHECKPOINTS (a fraction
# too) save their scan's checkpoints (the float32 states entering each 64-token chunk,
# which keep the scan's whole packed float32 result: the chunked device backward reads
# them instead of recomputing them): time bought with memory, layer by layer. Both 0: on
# the H200 (Mamba2-130m, 8 x 512) keeping the norm's output in every layer saved 2.4 ms of
# 126 a step for 0.27 GiB, past the 0.6x-of-float32 memory bound, and the checkpoints
# 6.3 ms for 1.8 GiB (docs/ops.md; bench/mixed_precision.py --precisions
# bf16-keepnorm=F,bf16-keepck=F measures other fractions).
KEEP_NORM_PROJ = 0.0
KEEP_CHECKPOINTS = 0.0


@dataclass
class Mamba2Config(ConfigBase):
    """Sizes of a Mamba-2 LM. ``n_heads = expand * d_model / head_dim`` (``n_heads=0``:
    derived; a given value must agree). ``dt_limit`` clamps softplus(dt) like Hugging Face's
    ``time_step_limit``."""

    vocab_size: int = 256
    d_model: int = 64
    n_layer: int = 2
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    head_dim: int = 16
    n_heads: int = 0
    n_groups: int = 1
    conv_bias: bool = True
    bias: bool = False
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dt_limit: tuple[float, float] = field(default=(0.0, math.inf))

    _aliases: ClassVar[dict[str, str]] = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layer",
        "state_size": "d_state",
        "conv_kernel": "d_conv",
        "num_heads": "n_heads",
        "use_conv_bias": "conv_bias",
        "use_bias": "bias",
        "layer_norm_epsilon": "norm_eps",
        "tie_word_embeddings": "tie_embeddings",
        "time_step_limit": "dt_limit",
    }

    def __post_init__(self) -> None:
        who = "Mamba2Config"
        _positive(
            who,
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layer=self.n_layer,
            d_state=self.d_state,
            expand=self.expand,
            head_dim=self.head_dim,
            n_groups=self.n_groups,
        )
        if not isinstance(self.d_conv, int) or self.d_conv < 2:
            raise ValueError(f"{who}: d_conv must be an integer >= 2, got {self.d_conv!r}")
        di = self.expand * self.d_model
        if di % self.head_dim:
            raise ValueError(
                f"{who}: expand * d_model ({di}) must be a multiple of head_dim ({self.head_dim})"
            )
        if self.n_heads in (0, None):
            self.n_heads = di // self.head_dim
        if self.n_heads * self.head_dim != di:
            raise ValueError(
                f"{who}: n_heads * head_dim ({self.n_heads} * {self.head_dim}) "
                f"must equal expand * d_model ({di})"
            )
        if self.n_heads % self.n_groups or di % self.n_groups:
            raise ValueError(
                f"{who}: n_heads ({self.n_heads}) must be a multiple of n_groups ({self.n_groups})"
            )
        lo, hi = (float(v) for v in self.dt_limit)
        if not 0.0 <= lo < hi:
            raise ValueError(
                f"{who}: dt_limit must be (lo, hi) with 0 <= lo < hi, got {self.dt_limit!r}"
            )
        self.dt_limit = (lo, hi)
        if not self.norm_eps >= 0:
            raise ValueError(f"{who}: norm_eps must be >= 0, got {self.norm_eps!r}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state


def _norm_dtype() -> Any:
    """The dtype the gated norm returns: the autocast dtype (nn.NORM_TO_AUTOCAST) or float32."""
    return rc.autocast_dtype() if nn.NORM_TO_AUTOCAST else None


class GatedRMSNorm(nn.Module):
    """norm(y * silu(z)) * weight where the RMS norm runs over groups of ``group_size``
    channels (Hugging Face's ``MambaRMSNormGated``); with ``x`` and ``d``, y + x * d (the
    Mamba-2 D skip, d one value per head) takes y's place. One fused op on the CPU
    (ops.gated_rms_norm)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.dim, self.group_size, self.eps = dim, group_size, eps
        self.weight = nn.Parameter(np.ones(dim, np.float32))

    def forward(self, y: Any, z: Any, x: Any = None, d: Any = None) -> Any:
        """y, z, x (B, T, dim), d (n_heads,) -> (B, T, dim); under autocast in its dtype,
        rounded by the op (out_proj's input: no cast node between them)."""
        return ops.gated_rms_norm(
            y, z, self.weight, self.eps, self.group_size, x=x, d=d, dtype=_norm_dtype()
        )


class Mamba2Mixer(nn.Module):
    """The Mamba-2 mixer (see the module docstring)."""

    def __init__(self, cfg: Mamba2Config, rng: np.random.Generator) -> None:
        super().__init__()
        self.cfg = cfg
        d, di, nh = cfg.d_model, cfg.d_inner, cfg.n_heads
        self.in_proj = nn.Linear(d, di + cfg.conv_dim + nh, bias=cfg.bias, seed=rng)
        self.conv1d = _Conv1d(cfg.conv_dim, cfg.d_conv, cfg.conv_bias, rng)
        self.dt_bias = nn.Parameter(init_dt_bias(rng, nh, 1e-3, 1e-1, 1e-4))
        self.A_log = nn.Parameter(np.log(np.arange(1, nh + 1, dtype=np.float32)))
        self.norm = GatedRMSNorm(di, di // cfg.n_groups, cfg.norm_eps)
        self.D = nn.Parameter(np.ones(nh, np.float32))
        self.out_proj = nn.Linear(di, d, bias=cfg.bias, seed=rng)
        # the mixer's layer in its model (Mamba2LM sets it; -1: standalone, in no model)
        self.layer_idx = -1

    def _among_last(self, fraction: float) -> bool:
        """Whether this mixer is in the last floor(fraction * n_layer) layers of its model."""
        n = self.cfg.n_layer
        return self.layer_idx >= 0 and n - self.layer_idx <= int(fraction * n + 1e-9)

    def forward(self, h: Any, state: list[Any] | None = None) -> tuple[Any, list[Any]]:
        """h (B, T, d_model), state [conv (B, conv_dim, d_conv-1), ssm (B, n_heads, head_dim,
        d_state)] or None. Returns (output (B, T, d_model), new state)."""
        c = self.cfg
        b, t, _ = h.shape
        di, cd, nh, p, g, n = c.d_inner, c.conv_dim, c.n_heads, c.head_dim, c.n_groups, c.d_state
        zxbcdt = self.in_proj(h)
        z = zxbcdt[:, :, :di]
        xbc = zxbcdt[:, :, di : di + cd]
        dt = zxbcdt[:, :, di + cd :] + self.dt_bias  # (B, T, H)
        lo, hi = c.dt_limit
        if lo > 0.0 or math.isfinite(hi):
            # The op applies softplus itself: hand it softplus^-1(clamp(softplus(dt))).
            sp = ops.clamp(ops.softplus(dt), max(lo, 1e-30), hi)
            dt = ops.log(ops.exp(sp) - 1.0)
        conv_state = state[0] if state is not None else None
        # The conv and the gated norm read their slices of in_proj's output as they lie:
        # their backwards keep that output (z, xBC and dt together), as many bytes as
        # copies of z and xBC would take, without the two copies.
        xbc, conv_state = causal_conv(xbc, conv_state, self.conv1d.w2d(), self.conv1d.bias)
        x, bm, cm = xbc[:, :, :di], xbc[:, :, di : di + g * n], xbc[:, :, di + g * n :]
        x = x.reshape(b, t, nh, p)
        bm = bm.reshape(b, t, g, n)
        cm = cm.reshape(b, t, g, n)
        a = step_constant(self, "A")  # -exp(A_log) per head (n_heads, 1)
        s0 = state[1] if state is not None else _zeros((b, nh, p, n), h.device)
        ids = np.arange(b, dtype=np.int32)
        half = rc.autocast_dtype()
        ck = SCAN_CHECKPOINTS
        if ck is None and half is not None and self._among_last(KEEP_CHECKPOINTS):
            ck = True
        y, s1 = ops.ssm_scan(s0, x, dt, a, bm, cm, ids, checkpoints=ck)
        seg: Any = contextlib.nullcontext()
        if half is not None:
            # Under autocast: y rounded to the autocast dtype, as mamba-ssm's chunked scan
            # returns its input's dtype, so that the gated norm (float32) keeps the 2-byte y
            # for its backward, not the scan's float32 packed result; then
            # (RECOMPUTE_NORM_PROJ) the norm and out_proj in a recomputation segment.
            y = y.to(half)
            if RECOMPUTE_NORM_PROJ and not self._among_last(KEEP_NORM_PROJ):
                seg = rc.recompute()
        with seg:
            y = self.norm(y.reshape(b, t, di), z, x=x.reshape(b, t, di), d=self.D)
            out = self.out_proj(y)
        return out, [conv_state, s1]

    def step_constants(self) -> dict[str, Any]:
        """The weight-only values of the forward: A = -exp(A_log) as (n_heads, 1)."""
        return {"A": (-ops.exp(self.A_log)).reshape(self.cfg.n_heads, 1)}


class Mamba2Block(MambaBlock):
    """Pre-norm residual block with the Mamba-2 mixer: x + mixer(norm(x))."""

    def __init__(self, cfg: Mamba2Config, rng: np.random.Generator) -> None:
        super().__init__(cfg, rng, Mamba2Mixer)


class Mamba2LM(MambaFamilyLM):
    """Mamba-2 causal LM (``arch = "mamba2"``); keys match ``Mamba2ForCausalLM``'s
    state_dict: ``backbone.embeddings.weight``, ``backbone.layers.{i}.norm.weight``,
    ``backbone.layers.{i}.mixer.{in_proj,conv1d,out_proj}.*``,
    ``backbone.layers.{i}.mixer.{dt_bias,A_log,D,norm.weight}``, ``backbone.norm_f.weight``,
    ``lm_head.weight``."""

    arch: ClassVar[str] = "mamba2"
    Config: ClassVar[type] = Mamba2Config
    Mixer: ClassVar[type] = Mamba2Mixer

    def __init__(self, config: Any = None, seed: int = 0) -> None:
        super().__init__(config, seed)
        for i, layer in enumerate(self.backbone.layers):
            assert isinstance(layer, MambaBlock)
            layer.mixer.layer_idx = i  # for KEEP_NORM_PROJ / KEEP_CHECKPOINTS

    def init_state_shapes(self, batch: int) -> list[list[tuple[int, ...]]]:
        """Per layer: conv (batch, conv_dim, d_conv-1), ssm (batch, n_heads, head_dim,
        d_state)."""
        c = self.config
        return [
            [(batch, c.conv_dim, c.d_conv - 1), (batch, c.n_heads, c.head_dim, c.d_state)]
            for _ in range(c.n_layer)
        ]


_ = rc  # re-exported tensor module used by type hints in docs

"""Mamba-1 language model (Gu & Dao, 2023) with the parameter names of Hugging Face's
``MambaForCausalLM``.

Per layer: ``x + mixer(rms_norm(x))`` with the mixer

    x, z   = in_proj(h).split(2)                    # (B, T, d_inner) each
    x      = silu(causal_depthwise_conv(x) + conv_bias)
    dt, B, C = x_proj(x).split(dt_rank, d_state, d_state)
    dt     = dt_proj(dt)                            # bias included, softplus in the scan
    y      = selective_scan(x, dt, A = -exp(A_log), B, C) + D * x
    out    = out_proj(y * silu(z))

then a final RMSNorm and the LM head (tied to the embeddings by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

import recurra as rc
from recurra import ops
from recurra_models import nn
from recurra_models.lm import (
    CausalLM,
    ConfigBase,
    State,
    _positive,
    as_tokens,
    causal_conv,
    check_state,
    init_dt_bias,
    zero_state,
)

__all__ = ["MambaBlock", "MambaConfig", "MambaLM", "MambaMixer", "MambaModel"]


@dataclass
class MambaConfig(ConfigBase):
    """Sizes of a Mamba-1 LM. ``dt_rank=0`` means ceil(d_model / 16) (the "auto" rank)."""

    vocab_size: int = 256
    d_model: int = 64
    n_layer: int = 2
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int = 0
    conv_bias: bool = True
    bias: bool = False
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    _aliases: ClassVar[dict[str, str]] = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layer",
        "state_size": "d_state",
        "conv_kernel": "d_conv",
        "time_step_rank": "dt_rank",
        "use_conv_bias": "conv_bias",
        "use_bias": "bias",
        "layer_norm_epsilon": "norm_eps",
        "tie_word_embeddings": "tie_embeddings",
    }

    def __post_init__(self) -> None:
        raw: object = self.dt_rank  # HF configs write "auto" (or null)
        if raw in ("auto", None):
            self.dt_rank = 0
        _positive(
            "MambaConfig",
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layer=self.n_layer,
            d_state=self.d_state,
            expand=self.expand,
        )
        if not isinstance(self.d_conv, int) or self.d_conv < 2:
            raise ValueError(f"MambaConfig: d_conv must be an integer >= 2, got {self.d_conv!r}")
        if not isinstance(self.dt_rank, int) or self.dt_rank < 0:
            raise ValueError(f"MambaConfig: dt_rank must be >= 0 (0 = auto), got {self.dt_rank!r}")
        if not self.norm_eps >= 0:
            raise ValueError(f"MambaConfig: norm_eps must be >= 0, got {self.norm_eps!r}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def rank(self) -> int:
        """The dt rank actually used."""
        return self.dt_rank or math.ceil(self.d_model / 16)


class MambaMixer(nn.Module):
    """The Mamba-1 mixer (see the module docstring)."""

    def __init__(self, cfg: MambaConfig, rng: np.random.Generator) -> None:
        super().__init__()
        d, di, n, r, k = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.rank, cfg.d_conv
        self.d_inner, self.d_state, self.rank, self.d_conv = di, n, r, k
        self.in_proj = nn.Linear(d, 2 * di, bias=cfg.bias, seed=rng)
        self.conv1d = _Conv1d(di, k, cfg.conv_bias, rng)
        self.x_proj = nn.Linear(di, r + 2 * n, bias=False, seed=rng)
        self.dt_proj = nn.Linear(r, di, bias=True, seed=rng)
        std = r**-0.5
        self.dt_proj.weight.assign_(rng.uniform(-std, std, (di, r)).astype(np.float32))
        assert self.dt_proj.bias is not None  # bias=True above
        self.dt_proj.bias.assign_(init_dt_bias(rng, di, 1e-3, 1e-1, 1e-4))
        self.A_log = nn.Parameter(np.log(np.tile(np.arange(1, n + 1, dtype=np.float32), (di, 1))))
        self.D = nn.Parameter(np.ones(di, np.float32))
        self.out_proj = nn.Linear(di, d, bias=cfg.bias, seed=rng)

    def forward(self, h: Any, state: list[Any] | None = None) -> tuple[Any, list[Any]]:
        """h (B, T, d_model), state [conv (B, d_inner, d_conv-1), ssm (B, d_inner, 1, d_state)]
        or None. Returns (output (B, T, d_model), new state)."""
        b, t, _ = h.shape
        di, n, r = self.d_inner, self.d_state, self.rank
        xz = self.in_proj(h)
        x, z = xz[:, :, :di], xz[:, :, di:]
        conv_state = state[0] if state is not None else None
        x, conv_state = causal_conv(x, conv_state, self.conv1d.w2d(), self.conv1d.bias)
        dbc = self.x_proj(x)
        dt = self.dt_proj(dbc[:, :, :r])  # (B, T, d_inner), bias added before softplus
        bm = dbc[:, :, r : r + n].reshape(b, t, 1, n)
        cm = dbc[:, :, r + n :].reshape(b, t, 1, n)
        a = step_constant(self, "A")  # -exp(A_log) (d_inner, d_state)
        s0 = state[1] if state is not None else _zeros((b, di, 1, n), h.device)
        y, s1 = ops.ssm_scan(
            s0, x.reshape(b, t, di, 1), dt, a, bm, cm, np.arange(b, dtype=np.int32)
        )
        y = y.reshape(b, t, di) + x * self.D
        return self.out_proj(y * ops.silu(z)), [conv_state, s1]

    def step_constants(self) -> dict[str, Any]:
        """The weight-only values of the forward: A = -exp(A_log) (see step_constant)."""
        return {"A": -ops.exp(self.A_log)}


def step_constant(module: Any, name: str) -> Any:
    """``module.step_constants()[name]``, or while a step graph is traced the graph input
    that stands for it (computed from the weights once per StepGraph.start, not per token)."""
    traced = module.__dict__.get("_step_inputs")
    return traced[name] if traced is not None else module.step_constants()[name]


class _Conv1d(nn.Module):
    """Weights of a depthwise ``torch.nn.Conv1d`` (weight (C, 1, K), bias (C,))."""

    def __init__(self, channels: int, kernel: int, bias: bool, rng: np.random.Generator) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(kernel)  # PyTorch's default for fan_in = K
        self.weight = nn.Parameter(rng.uniform(-bound, bound, (channels, 1, kernel)))
        self.bias = nn.Parameter(rng.uniform(-bound, bound, (channels,))) if bias else None

    def w2d(self) -> Any:
        c, _, k = self.weight.shape
        return self.weight.reshape(c, k)


class MambaBlock(nn.Module):
    """Pre-norm residual block: x + mixer(norm(x)); the mixer is Mamba-1's unless given."""

    def __init__(self, cfg: Any, rng: np.random.Generator, mixer: type | None = None) -> None:
        super().__init__()
        # the mixers start with in_proj: the norm hands it the autocast dtype (RMSNorm)
        self.norm = nn.RMSNorm(cfg.d_model, cfg.norm_eps, to_autocast=True)
        self.mixer = (mixer or MambaMixer)(cfg, rng)

    def forward(self, x: Any, state: list[Any] | None = None) -> tuple[Any, list[Any]]:
        y, st = self.mixer(self.norm(x), state)
        return x + y, st


class MambaModel(nn.Module):
    """Embeddings, the blocks and the final norm (Hugging Face's ``backbone``)."""

    def __init__(self, cfg: Any, rng: np.random.Generator, mixer: type | None = None) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model, seed=rng)
        self.embeddings.weight.assign_(
            (0.02 * rng.standard_normal((cfg.vocab_size, cfg.d_model))).astype(np.float32)
        )
        self.layers = nn.ModuleList(MambaBlock(cfg, rng, mixer) for _ in range(cfg.n_layer))
        self.norm_f = nn.RMSNorm(cfg.d_model, cfg.norm_eps, to_autocast=True)  # -> the LM head


class MambaFamilyLM(CausalLM):
    """What Mamba-1 and Mamba-2 LMs share: backbone + LM head (optionally tied), zero
    states, and the recurrent forward. Subclasses set ``Mixer`` and ``init_state_shapes``."""

    Mixer: ClassVar[type]

    def __init__(self, config: Any = None, seed: int = 0) -> None:
        super().__init__()
        cfg = config if config is not None else self.Config()
        self.config = cfg
        rng = np.random.default_rng(seed)
        self.backbone = MambaModel(cfg, rng, self.Mixer)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, seed=rng)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def residual_blocks(self) -> list[nn.Module]:
        return list(self.backbone.layers)

    def init_state_shapes(self, batch: int) -> list[list[tuple[int, ...]]]:
        raise NotImplementedError

    def init_state(self, batch: int) -> State:
        """Zero states, per layer [conv state, scan state] (see init_state_shapes)."""
        return zero_state(self.init_state_shapes(batch), self.device)

    def lm_head_module(self) -> nn.Module:
        return self.lm_head

    def features_with_state(self, tokens: Any, state: State | None = None) -> tuple[Any, State]:
        """The hidden states after ``norm_f`` (B, T, d_model) of int32 tokens (B, T) starting
        from ``state`` (None: zeros), and the state after the last token (the logits are
        ``lm_head`` of them: ``forward_with_state``).

        Raises TypeError/ValueError for bad tokens and ValueError for a state that does not
        fit the model or the batch."""
        tok, b, _ = as_tokens(tokens, self.vocab_size, self.device)
        if state is not None:
            check_state(state, self.init_state_shapes(b), type(self).__name__)
        h = self.backbone.embeddings(tok)
        new_state: State = []
        for i, layer in enumerate(self.backbone.layers):
            h, st = layer(h, state[i] if state is not None else None)
            new_state.append(st)
        return self.backbone.norm_f(h), new_state


class MambaLM(MambaFamilyLM):
    """Mamba-1 causal LM (``arch = "mamba"``); keys match ``MambaForCausalLM``'s state_dict:
    ``backbone.embeddings.weight``, ``backbone.layers.{i}.norm.weight``,
    ``backbone.layers.{i}.mixer.{in_proj,conv1d,x_proj,dt_proj,out_proj}.*``,
    ``backbone.layers.{i}.mixer.{A_log,D}``, ``backbone.norm_f.weight``, ``lm_head.weight``
    (the same tensor as the embeddings when tied)."""

    arch: ClassVar[str] = "mamba"
    Config: ClassVar[type] = MambaConfig
    Mixer: ClassVar[type] = MambaMixer

    def init_state_shapes(self, batch: int) -> list[list[tuple[int, ...]]]:
        """Per layer: conv (batch, d_inner, d_conv-1), ssm (batch, d_inner, 1, d_state)."""
        c = self.config
        return [
            [(batch, c.d_inner, c.d_conv - 1), (batch, c.d_inner, 1, c.d_state)]
            for _ in range(c.n_layer)
        ]


#: the zero initial states made last, by (shape, device): one tensor serves every layer and
#: every step (nothing writes into it), so a step neither uploads its zeros again nor names a
#: new buffer (a device then replays the step's recording)
_ZEROS: dict[tuple[tuple[int, ...], str], Any] = {}


def _zeros(shape: tuple[int, ...], device: Any) -> Any:
    key = (tuple(shape), str(device))
    z = _ZEROS.get(key)
    buf = z.storage if z is not None else None
    if z is None or (buf is not None and not getattr(buf, "valid", True)):  # a device closed
        if len(_ZEROS) >= 4 and key not in _ZEROS:
            _ZEROS.pop(next(iter(_ZEROS)))
        z = _ZEROS[key] = rc.tensor(np.zeros(shape, np.float32), device=device)
    return z

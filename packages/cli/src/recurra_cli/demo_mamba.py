"""The Mamba training demo: a Mamba-style block (ssm_conv -> ssm_scan -> MSE) trained by SGD.

The task needs memory: every output position must be the running mean of the inputs up
to it, which a recurrence can represent and a memoryless map cannot. The same initial
weights and batches are trained on each requested backend, so the only difference
between the runs is where the nodes executed; a run that silently fell back to the CPU
shows in the placement report instead of passing as agreement.

Comparing backends: the two free-running loss curves are kept (and shown), but at the full
size's learning rate the training is chaotic after a few dozen epochs, so float rounding
alone makes those curves part and cannot tell a backend bug from rounding. The verdict
comes from a **lockstep** comparison instead: during the first backend's run, the second
backend computes the loss and every gradient at the same parameters and on the same batch
at every step; the largest relative gap of the loss and of each gradient decides AGREE or
MISMATCH against :data:`LOCKSTEP_TOL`. The gap of a gradient is its largest element error
over the run divided by its largest element over the run: near convergence a gradient is
small and mostly cancellation, so dividing by that step's own size would measure rounding,
not agreement.

Shapes (numpy order): S = samples per step (n_seqs), T = tokens, H = heads, P = head_dim,
N = d_state, D = d_inner = H * P, K = d_conv.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import recurra as rc
from recurra import ops


@dataclass(frozen=True)
class DemoConfig:
    d_state: int = 128
    head_dim: int = 64
    n_head: int = 16
    n_tok: int = 64
    n_seqs: int = 1
    d_conv: int = 4
    n_samples: int = 16
    epochs: int = 60
    lr: float = 40.0
    clip: float = 0.05
    seed: int = 20260819

    @property
    def d_inner(self) -> int:
        return self.head_dim * self.n_head

    @classmethod
    def small(cls, epochs: int | None = None) -> DemoConfig:
        # Fewer, smaller weights than the full size: a smaller step keeps SGD stable.
        return cls(
            d_state=4,
            head_dim=2,
            n_head=2,
            n_tok=6,
            d_conv=3,
            n_samples=24,
            epochs=40 if epochs is None else epochs,
            lr=2.0,
        )


@dataclass
class RunResult:
    backend: str
    history: list[float]
    seconds: float
    placement: dict[str, str]
    n_splits: int
    verdict: str = ""
    final_pct_of_zero: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)


def make_problem(
    cfg: DemoConfig,
) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray], float]:
    """Batches, initial parameters and the predict-zero baseline, all from cfg.seed."""
    rng = np.random.default_rng(cfg.seed)
    S, T, D, H, N, K = cfg.n_seqs, cfg.n_tok, cfg.d_inner, cfg.n_head, cfg.d_state, cfg.d_conv
    batches = []
    for _ in range(cfg.n_samples):
        x = rng.uniform(-1, 1, (S, T, D)).astype(np.float32)
        y = np.cumsum(x.astype(np.float64), axis=1) / np.arange(1, T + 1)[None, :, None]
        sx = np.zeros((S, D, K - 1 + T), np.float32)
        sx[:, :, K - 1 :] = x.transpose(0, 2, 1)
        batches.append({"sx": sx, "target": y.astype(np.float32).reshape(S, T, H, cfg.head_dim)})
    params = {
        "conv": rng.uniform(-0.3, 0.3, (D, K)).astype(np.float32),
        "B": rng.uniform(-0.3, 0.3, (S, T, 1, N)).astype(np.float32),
        "C": rng.uniform(-0.3, 0.3, (S, T, 1, N)).astype(np.float32),
        # Negative decay keeps the recurrence stable; dt passes through softplus in the op.
        "A": -rng.uniform(0.2, 1.0, (H, 1)).astype(np.float32),
        "dt": rng.uniform(0.01, 0.1, (S, T, H)).astype(np.float32),
    }
    baseline = float(np.mean([np.mean(b["target"].astype(np.float64) ** 2) for b in batches]))
    return batches, params, baseline


class MambaBlockGraph:
    """The block as one explicit graph, built and differentiated once, fed every step."""

    def __init__(self, cfg: DemoConfig, backend: str = "cpu") -> None:
        S, T, H, P, N, K = cfg.n_seqs, cfg.n_tok, cfg.n_head, cfg.head_dim, cfg.d_state, cfg.d_conv
        D = cfg.d_inner
        # The scheduler places each node on `backend` when it has a kernel for it, else on the
        # CPU: the placement report shows which, so a fallback cannot pass as a GPU run.
        g = rc.Graph(backends=None if backend == "cpu" else [backend])
        self.graph = g
        self.sx = g.tensor((S, D, K - 1 + T), name="sx")
        self.params = {
            "conv": g.param((D, K), name="conv"),
            "dt": g.param((S, T, H), name="dt"),
            "A": g.param((H, 1), name="A"),
            "B": g.param((S, T, 1, N), name="B"),
            "C": g.param((S, T, 1, N), name="C"),
        }
        self.s0 = g.tensor((S, H, P, N), name="s0")
        self.ids = g.tensor((S,), dtype="int32", name="ids")
        self.target = g.tensor((S, T, H, P), name="target")
        p = self.params
        self.conv_out = ops.ssm_conv(self.sx, p["conv"])  # (S, T, D)
        x_scan = self.conv_out.reshape(S, T, H, P)
        self.y, self.state = ops.ssm_scan(
            self.s0, x_scan, p["dt"], p["A"], p["B"], p["C"], self.ids
        )
        n_out = S * T * H * P
        self.loss = ops.scale(ops.sum(ops.sqr(self.y - self.target)), 1.0 / n_out)
        g.set_output(self.conv_out)
        g.set_loss(self.loss)
        g.build_backward(self.loss)
        self.grads = {k: g.grad(t) for k, t in p.items()}
        g.set_data(self.s0, np.zeros((S, H, P, N), np.float32))
        g.set_data(self.ids, np.arange(S, dtype=np.int32))

    def step(
        self, params: dict[str, np.ndarray], batch: dict[str, np.ndarray]
    ) -> tuple[float, dict[str, np.ndarray]]:
        g = self.graph
        g.set_data(self.sx, batch["sx"])
        g.set_data(self.target, batch["target"])
        for k, t in self.params.items():
            g.set_data(t, params[k])
        g.compute()
        grads = {}
        for k, gt in self.grads.items():
            grads[k] = gt.numpy() if gt is not None else np.zeros_like(params[k])
        return self.loss.item(), grads

    def placement(self) -> tuple[dict[str, str], int]:
        g = self.graph
        where = {
            "ssm_conv": g.backend_of(self.conv_out),
            "ssm_scan": g.backend_of(self.y),
            "loss": g.backend_of(self.loss),
        }
        return where, g.n_splits


def sgd_update(
    params: dict[str, np.ndarray], grads: dict[str, np.ndarray], cfg: DemoConfig
) -> None:
    """Plain SGD with each gradient clipped to norm cfg.clip; A kept < 0 and dt > 0."""
    for k, gval in grads.items():
        gval = np.where(np.isfinite(gval), gval, 0.0)
        norm = float(np.sqrt(np.sum(gval.astype(np.float64) ** 2)))
        if norm > cfg.clip:
            gval = gval * (cfg.clip / norm)
        params[k] = (params[k] - cfg.lr * gval).astype(np.float32)
    params["A"] = np.minimum(params["A"], -0.05)
    params["dt"] = np.maximum(params["dt"], 1e-3)


def verdict(final: float, baseline: float) -> str:
    if not np.isfinite(final):
        return "FAIL (not finite)"
    if final >= baseline:
        return "FAIL (no better than zero)"
    if final > 0.5 * baseline:
        return "WEAK"
    return "OK"


#: Lockstep gaps above this are a MISMATCH. float32 rounding of the same loss and gradients
#: on two backends stays orders of magnitude below it (CPU vs lavapipe: at most 3e-6, at the
#: full size and with --small); one gradient element off by 1% of the gradient puts it at 1e-2.
LOCKSTEP_TOL = 1e-3


class _Gap:
    """The running largest |a - b| and largest |a|, |b| of one quantity over a run."""

    def __init__(self) -> None:
        self.diff, self.scale = 0.0, 0.0

    def add(self, a: np.ndarray | float, b: np.ndarray | float) -> None:
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if not (np.isfinite(a64).all() and np.isfinite(b64).all()):
            self.diff = float("inf")
            return
        self.diff = max(self.diff, float(np.max(np.abs(a64 - b64), initial=0.0)))
        self.scale = max(self.scale, float(np.max(np.abs(a64), initial=0.0)))
        self.scale = max(self.scale, float(np.max(np.abs(b64), initial=0.0)))

    @property
    def rel(self) -> float:
        return self.diff / self.scale if self.scale > 0 else self.diff


def train(
    cfg: DemoConfig,
    backend: str,
    on_epoch: Callable[[int, float], None] | None = None,
    shadow: str | None = None,
) -> RunResult:
    """Trains the block from cfg's initial weights on one backend ("cpu", "vulkan", ...).

    With ``shadow`` (another backend), that backend computes the loss and gradients at the
    same parameters and batch at every step (lockstep); the largest relative gaps are in
    ``extra["lockstep"]``: ``{"against", "steps", "max_rel_gap": {"loss", "grad.<name>"}}``.

    Raises ValueError for a backend name recurra does not know.
    """
    batches, params, baseline = make_problem(cfg)
    block = MambaBlockGraph(cfg, backend)
    twin = MambaBlockGraph(cfg, shadow) if shadow is not None else None
    gaps = {k: _Gap() for k in ("loss", *(f"grad.{k}" for k in params))}
    placement, n_splits = block.placement()
    history: list[float] = []
    twin_seconds = 0.0  # not counted in the run's time
    t0 = time.perf_counter()
    for epoch in range(cfg.epochs):
        total = 0.0
        for b in batches:
            loss, grads = block.step(params, b)
            if twin is not None:
                t1 = time.perf_counter()
                loss2, grads2 = twin.step(params, b)  # sgd_update below makes new arrays
                twin_seconds += time.perf_counter() - t1
                gaps["loss"].add(loss, loss2)
                for k, gval in grads.items():
                    gaps[f"grad.{k}"].add(gval, grads2[k])
            total += loss
            sgd_update(params, grads, cfg)
        history.append(total / len(batches))
        if on_epoch is not None:
            on_epoch(epoch + 1, history[-1])
    seconds = time.perf_counter() - t0 - twin_seconds
    final = history[-1]
    extra: dict[str, Any] = {"baseline": baseline}
    if twin is not None:
        extra["lockstep"] = {
            "against": shadow,
            "steps": cfg.epochs * len(batches),
            "max_rel_gap": {k: g.rel for k, g in gaps.items()},
        }
    return RunResult(
        backend,
        history,
        seconds,
        placement,
        n_splits,
        verdict(final, baseline),
        100.0 * final / baseline if np.isfinite(final) else float("nan"),
        extra,
    )


def compare(
    a: RunResult, b: RunResult, tol: float = 0.05, lockstep_tol: float = LOCKSTEP_TOL
) -> dict[str, Any]:
    """AGREE/MISMATCH between two runs.

    ``max_rel_gap`` / ``median_rel_gap``: the per-epoch relative gap of the free-running loss
    curves (information: chaotic training makes them part by rounding alone). When ``a``
    ran ``b``'s backend in lockstep (``train(..., shadow=b.backend)``), its gaps decide the
    status against ``lockstep_tol`` (``lockstep``: each gap, the worst one and its name);
    without lockstep data the free-running gap decides against ``tol``."""
    ha, hb = np.array(a.history), np.array(b.history)
    ok = np.isfinite(ha) & np.isfinite(hb)
    scale = np.maximum(np.maximum(np.abs(ha), np.abs(hb)), 1e-12)
    rel = np.where(ok, np.abs(ha - hb) / scale, np.nan)
    fell_back = b.backend != "cpu" and any(v == "cpu" for v in b.placement.values())
    lock = a.extra.get("lockstep")
    lockstep = None
    if lock is not None and lock.get("against") == b.backend:
        gaps = lock["max_rel_gap"]
        worst = max(gaps, key=lambda k: gaps[k])
        lockstep = {**lock, "worst": worst, "worst_gap": gaps[worst], "tol": lockstep_tol}
    if fell_back:
        status = "MISMATCH (the second run fell back to the CPU: nothing was compared)"
    elif lockstep is not None:
        if lockstep["worst_gap"] > lockstep_tol:  # inf included (not finite on one side)
            status = f"MISMATCH ({lockstep['worst']} differs at the same parameters)"
        else:
            status = "AGREE"
    elif not ok.all():
        status = "MISMATCH (non-finite loss on one backend)"
    elif np.nanmax(rel) > tol:
        status = "MISMATCH"
    else:
        status = "AGREE"
    return {
        "max_rel_gap": float(np.nanmax(rel)) if ok.any() else float("nan"),
        "median_rel_gap": float(np.nanmedian(rel)) if ok.any() else float("nan"),
        "lockstep": lockstep,
        "status": status,
    }


def config_dict(cfg: DemoConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["d_inner"] = cfg.d_inner
    return d

"""Learning-rate schedules: step decay, cosine with linear warmup, one-cycle.

A scheduler sets ``group["lr"]`` of every parameter group from a closed formula of its
counter ``last_epoch`` (0 after construction). Call :meth:`LRScheduler.step` after
``optimizer.step()``. With gradient accumulation, a call made while the optimizer's
accumulation window is open (it did not update) does nothing, so a per-iteration
``opt.step(); sched.step()`` loop schedules per real update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from recurra_optim.optimizer import Optimizer

__all__ = ["LRScheduler", "StepLR", "CosineWarmupLR", "OneCycleLR"]


class LRScheduler:
    """Base class: subclasses implement :meth:`get_lr` for ``self.last_epoch``.

    Each group remembers its starting rate in ``group["initial_lr"]`` (set on first use,
    as in PyTorch); ``base_lrs`` are those rates.
    """

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not a recurra_optim optimizer")
        self.optimizer = optimizer
        if last_epoch == -1:
            for g in optimizer.param_groups:
                g.setdefault("initial_lr", g["lr"])
        else:
            for i, g in enumerate(optimizer.param_groups):
                if "initial_lr" not in g:
                    raise KeyError(
                        f"param 'initial_lr' is not specified in param_groups[{i}] "
                        f"when resuming a scheduler"
                    )
        self.base_lrs: list[float] = [float(g["initial_lr"]) for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._last_lr: list[float] = []
        self._advance()

    def get_lr(self) -> list[float]:
        """The learning rate of each group at ``self.last_epoch``."""
        raise NotImplementedError

    def _advance(self) -> None:
        self.last_epoch += 1
        lrs = self.get_lr()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]

    def step(self) -> None:
        """Advances the schedule by one, unless the optimizer is inside an accumulation
        window (its last step() did not update)."""
        if self.optimizer.accumulating:
            return
        self._advance()

    def get_last_lr(self) -> list[float]:
        """The learning rates set by the last step (one per group)."""
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state (everything but the optimizer)."""
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`. Raises ValueError when it has other keys."""
        want = set(self.state_dict())
        if set(state_dict) != want:
            raise ValueError(
                f"scheduler state has keys {sorted(state_dict)}, expected {sorted(want)}"
            )
        self.__dict__.update(state_dict)


class StepLR(LRScheduler):
    """``lr = initial_lr * gamma ** (last_epoch // step_size)``.

    Raises ValueError for step_size < 1.
    """

    def __init__(
        self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        if int(step_size) < 1:
            raise ValueError(f"step_size must be >= 1, got {step_size}")
        self.step_size = int(step_size)
        self.gamma = float(gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        f = self.gamma ** (self.last_epoch // self.step_size)
        return [b * f for b in self.base_lrs]


class CosineWarmupLR(LRScheduler):
    """Linear warmup, then a cosine decay to ``min_lr``.

    For step ``t``: ``t < warmup_steps``: ``lr = base * (t + 1) / warmup_steps`` (the first
    update already moves; the rate reaches ``base`` at ``t = warmup_steps - 1``);
    ``warmup_steps <= t <= total_steps``: ``lr = min_lr + (base - min_lr) * (1 + cos(pi *
    (t - warmup_steps) / (total_steps - warmup_steps))) / 2``; after ``total_steps``:
    ``min_lr``. ``min_lr`` is one value or one per group.

    Raises ValueError unless 0 <= warmup_steps < total_steps.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int,
        total_steps: int,
        min_lr: float | Sequence[float] = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if not 0 <= int(warmup_steps) < int(total_steps):
            raise ValueError(
                f"need 0 <= warmup_steps < total_steps, got {warmup_steps} and {total_steps}"
            )
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        n = len(optimizer.param_groups)
        mins = list(min_lr) if isinstance(min_lr, Sequence) else [float(min_lr)] * n
        if len(mins) != n:
            raise ValueError(f"min_lr has {len(mins)} values for {n} parameter groups")
        self.min_lrs = [float(m) for m in mins]
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        t = self.last_epoch
        out = []
        for base, lo in zip(self.base_lrs, self.min_lrs):
            if t < self.warmup_steps:
                out.append(base * (t + 1) / self.warmup_steps)
            elif t <= self.total_steps:
                frac = (t - self.warmup_steps) / (self.total_steps - self.warmup_steps)
                out.append(lo + (base - lo) * 0.5 * (1.0 + math.cos(math.pi * frac)))
            else:
                out.append(lo)
        return out


class OneCycleLR(LRScheduler):
    """The 1cycle policy (Smith & Topin), PyTorch's ``OneCycleLR`` formulas.

    The rate rises from ``max_lr / div_factor`` to ``max_lr`` over the first
    ``pct_start`` of ``total_steps``, then anneals to ``initial / final_div_factor``
    (``three_phase``: back to the initial rate first, then down). With ``cycle_momentum``
    the momentum (SGD) or beta1 (Adam, AdamW, Lion) moves inversely between
    ``base_momentum`` and ``max_momentum``. Stepping past ``total_steps`` raises ValueError.

    Raises ValueError for bad sizes or fractions, and when cycling momentum on an optimizer
    without momentum or betas.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        max_lr: float | Sequence[float],
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | Sequence[float] = 0.85,
        max_momentum: float | Sequence[float] = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        last_epoch: int = -1,
    ) -> None:
        if total_steps is not None:
            if int(total_steps) <= 0:
                raise ValueError(f"expected a positive integer total_steps, got {total_steps}")
            self.total_steps = int(total_steps)
        elif epochs is not None and steps_per_epoch is not None:
            if int(epochs) <= 0 or int(steps_per_epoch) <= 0:
                raise ValueError("epochs and steps_per_epoch must be positive integers")
            self.total_steps = int(epochs) * int(steps_per_epoch)
        else:
            raise ValueError("you must define either total_steps or (epochs and steps_per_epoch)")
        if not 0.0 <= pct_start <= 1.0:
            raise ValueError(f"expected a float between 0 and 1 for pct_start, got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self.anneal_strategy = anneal_strategy
        groups = optimizer.param_groups
        max_lrs = self._per_group("max_lr", max_lr, len(groups))
        if last_epoch == -1:
            for g, m in zip(groups, max_lrs):
                g["initial_lr"] = m / div_factor
                g["max_lr"] = m
                g["min_lr"] = g["initial_lr"] / final_div_factor
        total = float(self.total_steps)
        if three_phase:
            self._phases = [
                (
                    float(pct_start * total) - 1,
                    "initial_lr",
                    "max_lr",
                    "max_momentum",
                    "base_momentum",
                ),
                (
                    float(2 * pct_start * total) - 2,
                    "max_lr",
                    "initial_lr",
                    "base_momentum",
                    "max_momentum",
                ),
                (total - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum"),
            ]
        else:
            self._phases = [
                (
                    float(pct_start * total) - 1,
                    "initial_lr",
                    "max_lr",
                    "max_momentum",
                    "base_momentum",
                ),
                (total - 1, "max_lr", "min_lr", "base_momentum", "max_momentum"),
            ]
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum:
            d = optimizer.defaults
            if "momentum" not in d and "betas" not in d:
                raise ValueError("optimizer must support momentum or betas with cycle_momentum")
            self._use_beta1 = "betas" in d
            maxm = self._per_group("max_momentum", max_momentum, len(groups))
            basem = self._per_group("base_momentum", base_momentum, len(groups))
            if last_epoch == -1:
                for g, mx, bs in zip(groups, maxm, basem):
                    if self._use_beta1:
                        g["betas"] = (mx, *tuple(g["betas"])[1:])
                    else:
                        g["momentum"] = mx
                    g["max_momentum"] = mx
                    g["base_momentum"] = bs
        super().__init__(optimizer, last_epoch)

    @staticmethod
    def _per_group(name: str, v: float | Sequence[float], n: int) -> list[float]:
        if isinstance(v, Sequence):
            if len(v) != n:
                raise ValueError(f"expected {n} values for {name}, got {len(v)}")
            return [float(x) for x in v]
        return [float(v)] * n

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def get_lr(self) -> list[float]:
        t = self.last_epoch
        if t > self.total_steps:
            raise ValueError(
                f"tried to step {t} times; the total number of steps is {self.total_steps}"
            )
        lrs = []
        for g in self.optimizer.param_groups:
            start = 0.0
            for i, (end, lr0, lr1, m0, m1) in enumerate(self._phases):
                if t <= end or i == len(self._phases) - 1:
                    pct = (t - start) / (end - start)
                    lr = self._anneal(g[lr0], g[lr1], pct)
                    if self.cycle_momentum:
                        mom = self._anneal(g[m0], g[m1], pct)
                        if self._use_beta1:
                            g["betas"] = (mom, *tuple(g["betas"])[1:])
                        else:
                            g["momentum"] = mom
                    break
                start = end
            lrs.append(lr)
        return lrs

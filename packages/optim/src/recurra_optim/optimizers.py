"""SGD, Adam, AdamW and Lion. The formulas are PyTorch's (Lion: Chen et al. 2023).

Each step runs one fused native kernel per parameter group (recurra's ``sgd_step``,
``adam_step``, ``adamw_step``, ``lion_step`` ops) that reads the gradient once and updates
the parameter and its state in place.
"""

from __future__ import annotations

from typing import Any

from recurra_optim._support import _check_beta, _check_nonneg
from recurra_optim.optimizer import Optimizer, ParamsT

__all__ = ["SGD", "Adam", "AdamW", "Lion"]


def _check_betas(betas: Any) -> None:
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of floats, got {betas!r}") from None
    _check_beta("beta parameter at index 0", b1)
    _check_beta("beta parameter at index 1", b2)


class SGD(Optimizer):
    """Stochastic gradient descent with momentum (PyTorch's formulation).

    With ``g = grad + weight_decay * p``: ``buf = g`` on a parameter's first step, then
    ``buf = momentum * buf + (1 - dampening) * g``; the step direction is ``g + momentum *
    buf`` (nesterov) or ``buf``; ``p -= lr * direction``. State per parameter: ``step`` and,
    with momentum, ``momentum_buffer``.

    Raises ValueError for a negative lr, momentum or weight decay, or nesterov without
    momentum or with dampening. See :class:`Optimizer` for the keyword arguments.
    """

    _op = "sgd_step"
    _optional_state = ("momentum_buffer",)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        **kwargs: Any,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults, **kwargs)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check_nonneg("lr", group["lr"])
        _check_nonneg("momentum value", group["momentum"])
        _check_nonneg("dampening value", group["dampening"])
        _check_nonneg("weight_decay value", group["weight_decay"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _extra(self, group: dict[str, Any]) -> tuple[int, ...]:
        return (1 if group["momentum"] != 0 else 0,)

    def _hyper(self, group: dict[str, Any]) -> dict[str, float]:
        return {
            "weight_decay": group["weight_decay"],
            "a": group["momentum"],
            "b": group["dampening"],
            "c": 1.0 if group["nesterov"] else 0.0,
            "maximize": 1.0 if group["maximize"] else 0.0,
        }


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction; weight decay is L2 (added to the gradient).

    ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
    ``p -= lr / (1-b1^t) * m / (sqrt(v) / sqrt(1-b2^t) + eps)``, t the parameter's step.
    State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``.

    Raises ValueError for lr < 0, eps < 0, a beta outside [0, 1) or weight decay < 0.
    """

    _op = "adam_step"

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        **kwargs: Any,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=maximize
        )
        super().__init__(params, defaults, **kwargs)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check_nonneg("lr", group["lr"])
        _check_nonneg("epsilon value", group["eps"])
        _check_betas(group["betas"])
        _check_nonneg("weight_decay value", group["weight_decay"])

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _hyper(self, group: dict[str, Any]) -> dict[str, float]:
        b1, b2 = group["betas"]
        return {
            "weight_decay": group["weight_decay"],
            "a": b1,
            "b": b2,
            "c": group["eps"],
            "maximize": 1.0 if group["maximize"] else 0.0,
        }


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter): ``p *= 1 - lr * wd`` before
    the Adam update. Default weight decay 1e-2."""

    _op = "adamw_step"

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            **kwargs,
        )


class Lion(Optimizer):
    """Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023).

    ``p = p (1 - lr wd) - lr sign(b1 m + (1-b1) g)``, then ``m = b2 m + (1-b2) g``.
    State per parameter: ``step``, ``exp_avg``. Use a learning rate 3-10x smaller than
    AdamW's (default 1e-4).

    Raises ValueError for lr < 0, a beta outside [0, 1) or weight decay < 0.
    """

    _op = "lion_step"

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        **kwargs: Any,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, **kwargs)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check_nonneg("lr", group["lr"])
        _check_betas(group["betas"])
        _check_nonneg("weight_decay value", group["weight_decay"])

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg",)

    def _hyper(self, group: dict[str, Any]) -> dict[str, float]:
        b1, b2 = group["betas"]
        return {
            "weight_decay": group["weight_decay"],
            "a": b1,
            "b": b2,
            "maximize": 1.0 if group["maximize"] else 0.0,
        }

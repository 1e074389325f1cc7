"""Dynamic loss scaling for float16 mixed precision.

float16 has 5 exponent bits: gradients below 2^-24 flush to zero and above 65504 overflow.
Scaling the loss by S before ``backward()`` moves the gradients of the float16 part of the
graph S times up, out of the underflow range; the optimizer divides them by S again (in
its fused step, before clipping, so clipping and the gradient norm see the true
gradients). When a gradient comes out inf or NaN the scale was too large: the step is
skipped (parameters and moments untouched), the gradients cleared and S halved. After
``growth_interval`` good steps in a row S doubles. bfloat16 has float32's exponent range
and needs none of this.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["DynamicLossScale"]


def _finite(g: Any) -> bool:
    arr = np.asarray(g)
    return bool(np.isfinite(arr.astype(np.float32, copy=False)).all())


class DynamicLossScale:
    """Scales the loss, unscales the gradients in the optimizer step, skips overflowing
    steps.

    Usage::

        scaler = DynamicLossScale()
        loss = model.loss(x, y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)    # False: skipped (inf/NaN gradient), the scale halved
        optimizer.zero_grad()

    Raises ValueError for a non-positive or non-finite ``init_scale``, a
    ``growth_factor`` <= 1, a ``backoff_factor`` outside (0, 1) or a ``growth_interval``
    < 1.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 2.0**-14,
    ) -> None:
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be positive and finite, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if int(growth_interval) < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.scale_value = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.good_steps = 0  # finite steps since the scale last changed
        self.skipped = 0  # steps skipped so far

    def scale(self, loss: Any) -> Any:
        """The loss times the current scale (a recurra tensor: call ``backward()`` on it)."""
        return loss * self.scale_value

    def grads_finite(self, optimizer: Any) -> bool:
        """Whether every gradient of ``optimizer``'s parameters is finite."""
        return all(
            _finite(p.grad)
            for g in optimizer.param_groups
            for p in g["params"]
            if p.grad is not None
        )

    def step(self, optimizer: Any) -> bool:
        """Steps ``optimizer`` with the gradients divided by the scale, or skips the step
        when a gradient is inf or NaN (clears the gradients, halves the scale). Returns
        whether the optimizer stepped."""
        if not self.grads_finite(optimizer):
            optimizer.zero_grad(force=True)
            if getattr(optimizer, "_micro", 0):  # an open accumulation window is dropped too
                optimizer._micro = 0
            self.scale_value = max(self.min_scale, self.scale_value * self.backoff_factor)
            self.good_steps = 0
            self.skipped += 1
            return False
        optimizer.loss_scale = self.scale_value
        try:
            optimizer.step()
        finally:
            optimizer.loss_scale = 1.0
        if not getattr(optimizer, "updated", True):
            return True  # inside an accumulation window: the scale stays until its update
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale_value *= self.growth_factor
            self.good_steps = 0
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`. Raises ValueError for a malformed state."""
        try:
            scale, good, skipped = (
                float(state["scale"]),
                int(state["good_steps"]),
                int(state["skipped"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed loss-scale state: {e!r}") from None
        if not (math.isfinite(scale) and scale > 0) or good < 0 or skipped < 0:
            raise ValueError(f"malformed loss-scale state: {dict(state)!r}")
        self.scale_value, self.good_steps, self.skipped = scale, good, skipped

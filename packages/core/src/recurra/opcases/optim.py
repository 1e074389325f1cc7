"""Cases of the optimizer updates (in place, through ``recurra.ops.FusedStep``) and of
grad_norm (an ordinary node)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from recurra import ops
from recurra.opcases._case import OpCase, UpdateSpec, normal, uniform


def _no_build(*leaves: Any) -> Any:
    raise TypeError("an optimizer case runs through FusedStep, not a graph")


def _opt_inputs(shapes: Sequence[tuple[int, ...]], sources: Sequence[str]) -> Any:
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        d: dict[str, np.ndarray] = {}
        for t, shape in enumerate(shapes):
            for src in sources:
                if src == "step":
                    d[f"step{t}"] = np.array([t], np.int32)  # tensors at different steps
                elif src in ("m", "buf"):
                    d[f"{src}{t}"] = normal(rng, *shape, scale=0.1)
                elif src == "v":
                    d[f"v{t}"] = uniform(rng, 0.0, 0.05, *shape)
                else:
                    d[f"{src}{t}"] = normal(rng, *shape)
        return d

    return make


def update(
    op: str,
    name: str,
    extra: tuple[int, ...],
    sources: Sequence[str],
    hyper: dict[str, float],
    shapes: Sequence[tuple[int, ...]],
) -> OpCase:
    """An optimizer case: ``op`` over tensors of ``shapes``, each with ``sources``."""
    spec = UpdateSpec(op, extra, tuple(hyper.items()), len(sources))
    return OpCase(op, name, _opt_inputs(shapes, sources), _no_build, grad=False, update=spec)


def _norm_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    hyper = ops.pack_hyper({"grad_scale": 0.5, "clip_value": 1.5, "max_norm": 1.0})
    return {"hyper": hyper, "g0": normal(rng, 5, 7), "g1": normal(rng, 33)}


def cases() -> list[OpCase]:
    two = [(5, 7), (33,)]
    adam_h = {"lr": 1e-2, "a": 0.9, "b": 0.999, "c": 1e-8}
    adam_src = ("param", "grad", "m", "v", "step")
    return [
        update("sgd_step", "plain", (0,), ("param", "grad", "step"), {"lr": 0.1}, two),
        update(
            "sgd_step",
            "nesterov_wd",
            (1,),
            ("param", "grad", "buf", "step"),
            {"lr": 0.05, "a": 0.9, "b": 0.0, "c": 1.0, "weight_decay": 0.01},
            two,
        ),
        update("adam_step", "l2_wd", (), adam_src, {**adam_h, "weight_decay": 0.01}, two),
        update(
            "adamw_step",
            "clip_value",
            (),
            adam_src,
            {**adam_h, "weight_decay": 0.1, "clip_value": 0.8},
            two,
        ),
        update(
            "adamw_step",
            "ten_tensors",
            (),
            adam_src,
            {**adam_h, "weight_decay": 0.1},
            [(3, 4)] * 10,
        ),
        update(
            "lion_step",
            "wd",
            (),
            ("param", "grad", "m", "step"),
            {"lr": 1e-3, "a": 0.9, "b": 0.99, "weight_decay": 0.1},
            two,
        ),
        update(
            "grad_clip",
            "value_and_scale",
            (),
            ("grad",),
            {"clip_value": 0.5, "grad_scale": 0.5},
            two,
        ),
        OpCase(
            "grad_norm",
            "scale_clip_max",
            _norm_inputs,
            lambda h, a, b: ops.grad_norm(h, [a, b]),
            grad=False,
        ),
    ]

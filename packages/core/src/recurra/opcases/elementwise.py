"""Cases of the elementwise ops: binary (numpy broadcasting) and unary (activations)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from recurra import ops
from recurra.opcases._case import (
    FiniteDiff,
    Node,
    OpCase,
    away_from_zero,
    f32,
    normal,
    spread,
    uniform,
)

Sampler = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]

# ---- unary -------------------------------------------------------------------------------
#: Shapes every unary op runs at: odd sizes, the vector lanes' tail, several dimensions, and
#: one array large enough to split across threads (4 grains of the CPU pool) and workgroups.
UNARY_SHAPES: dict[str, tuple[int, ...]] = {
    "1": (1,),
    "3": (3,),
    "17": (17,),
    "1000": (1000,),
    "3x17": (3, 17),
    "2x3x5": (2, 3, 5),
    "3x5x7": (3, 5, 7),
    "100003": (100003,),
}
#: NaN with infinities (NaN in, NaN out, forward and gradient), and NaN among finite values
#: on the vector path of a device.
NAN_ROW = np.array([np.nan, -np.inf, -1.0, 0.5, 2.0, np.inf], np.float32)
NAN_FINITE_ROW = np.array([np.nan, -3.0, -1.0, 0.5, 2.0, 5.0], np.float32)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.asarray(np.vectorize(math.erf, otypes=[np.float64])(x))


def _softplus(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return np.asarray(0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))))


def _silu(x: np.ndarray) -> np.ndarray:
    return np.asarray(x / (1 + np.exp(-x)))


def _pow15(x: np.ndarray) -> np.ndarray:
    """x ** 1.5 as exp(1.5 * log(x)): NaN for every x < 0 (numpy gives inf at -inf)."""
    return np.where(x >= 0, np.abs(x) ** 1.5, np.nan)


def unary(
    op: str,
    build: Callable[[Any], Any],
    ref: Callable[[np.ndarray], np.ndarray],
    sample: Sampler,
    *,
    fp: tuple[float, ...] | None = (),
    nan_grad: bool = True,
    ref_tol: tuple[float, float] = (2e-6, 1e-6),
) -> list[OpCase]:
    """Every case of one unary op: ``build(x)`` through recurra.ops, ``ref(x)`` in float64,
    ``sample(rng, shape)`` its inputs. ``fp``: the float parameters of the core op ``op``
    that ``build`` is (None: ``build`` is no single node). ``nan_grad``: a NaN input gives a
    NaN gradient (False for ops whose gradient ignores x)."""

    def inputs(shape: tuple[int, ...]) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
        return lambda rng: {"x": sample(rng, shape)}

    node = Node(op, (), fp) if fp is not None else None
    kw: dict[str, Any] = {"ref": ref, "ref_tol": ref_tol, "node": node}
    out = [OpCase(op, name, inputs(s), build, **kw) for name, s in UNARY_SHAPES.items()]
    out.append(OpCase(op, "fd_2x3", inputs((2, 3)), build, fd=FiniteDiff(), **kw))
    for name, row, n in (("nan_inf", NAN_ROW, 18), ("nan_1000", NAN_FINITE_ROW, 1000)):
        data = f32(np.resize(row, n))
        out.append(
            OpCase(
                op,
                name,
                _fixed(data),
                build,
                nonfinite=True,
                nan_grad=nan_grad,
                **kw,
            )
        )
    return out


def _fixed(data: np.ndarray) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
    """Inputs that are always ``data`` (a copy each time)."""
    return lambda rng: {"x": data.copy()}


def _n(scale: float = 1.0) -> Sampler:
    return lambda rng, s: normal(rng, *s, scale=scale)


def _u(lo: float, hi: float) -> Sampler:
    return lambda rng, s: uniform(rng, lo, hi, *s)


def _kinked(rng: np.random.Generator, s: tuple[int, ...]) -> np.ndarray:
    """Away from the kink at 0, the first element positive (relu passes some gradient)."""
    x = away_from_zero(rng, *s)
    x.flat[0] = abs(x.flat[0])
    return x


def _spread(rng: np.random.Generator, s: tuple[int, ...]) -> np.ndarray:
    return spread(rng, *s)


def unary_cases() -> list[OpCase]:
    """One entry per unary op (see the package docstring: adding an activation is one line
    here plus its kernels)."""
    return [
        *unary("neg", ops.neg, np.negative, _n(), nan_grad=False),
        *unary("abs", ops.abs, np.abs, _kinked),
        *unary("sqr", ops.sqr, np.square, _n()),
        *unary("sqrt", ops.sqrt, np.sqrt, _u(0.2, 4.0)),
        *unary("exp", ops.exp, np.exp, _n()),
        *unary("log", ops.log, np.log, _u(0.2, 4.0)),
        *unary(
            "scale",
            lambda x: ops.scale(x, -1.75),
            lambda x: x * -1.75,
            _n(),
            fp=(-1.75,),
            nan_grad=False,
        ),
        *unary(
            "clamp",
            lambda x: ops.clamp(x, -0.5, 0.75),
            lambda x: np.clip(x, -0.5, 0.75),
            _spread,
            fp=(-0.5, 0.75),
        ),
        # pow(x, 1.5) is exp(1.5 * log(x)): no node of its own.
        *unary("pow", lambda x: ops.pow(x, 1.5), _pow15, _u(0.2, 3.0), fp=None),
        *unary("relu", ops.relu, lambda x: np.maximum(x, 0), _kinked),
        *unary("silu", ops.silu, _silu, _n(2.0)),
        *unary("gelu", ops.gelu, lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2))), _n(2.0)),
        *unary("gelu_tanh", ops.gelu_tanh, _gelu_tanh, _n(2.0)),
        *unary("relu_sqr", ops.relu_sqr, lambda x: np.maximum(x, 0) ** 2, _kinked),
        *unary("sigmoid", ops.sigmoid, lambda x: 1 / (1 + np.exp(-x)), _n(2.0)),
        *unary("tanh", ops.tanh, np.tanh, _n(2.0)),
        # Scale 10 reaches the x > 20 branch of softplus.
        *unary("softplus", ops.softplus, _softplus, _n(10.0)),
    ]


# ---- binary ------------------------------------------------------------------------------
BINARY_SHAPES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "same_3x17": ((3, 17), (3, 17)),
    "row_bcast": ((3, 17), (17,)),
    "bcast_4d": ((2, 3, 4, 5), (1, 3, 1, 5)),
    "bcast_both": ((4, 1, 5), (3, 1)),
    "1_1": ((1,), (1,)),
    "3_3": ((3,), (3,)),
    "17_17": ((17,), (17,)),
    "1000_1000": ((1000,), (1000,)),
    "3x4_4": ((3, 4), (4,)),
    "3x1_1x5": ((3, 1), (1, 5)),
    "2x1x4_3x1": ((2, 1, 4), (3, 1)),
    "scalar_3x4": ((), (3, 4)),
    "1_100003": ((1,), (100003,)),
}


def binary(op: str, build: Callable[[Any, Any], Any], ref: Callable[..., Any]) -> list[OpCase]:
    """Every case of one binary op (``div`` keeps its divisor away from zero)."""
    divisor = op == "div"

    def inputs(sa: tuple[int, ...], sb: tuple[int, ...]) -> Any:
        def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
            b = away_from_zero(rng, *sb, gap=0.5) if divisor else normal(rng, *sb)
            return {"a": normal(rng, *sa), "b": b}

        return make

    kw: dict[str, Any] = {"ref": ref, "ref_tol": (1e-6, 1e-7), "node": Node(op)}
    out = [
        OpCase(op, name, inputs(sa, sb), build, **kw) for name, (sa, sb) in BINARY_SHAPES.items()
    ]
    out.append(OpCase(op, "fd_2x1x3_4x1", inputs((2, 1, 3), (4, 1)), build, fd=FiniteDiff(), **kw))
    return out


def binary_cases() -> list[OpCase]:
    return [
        *binary("add", ops.add, np.add),
        *binary("sub", ops.sub, np.subtract),
        *binary("mul", ops.mul, np.multiply),
        *binary("div", ops.div, np.divide),
    ]


def cases() -> list[OpCase]:
    return [*binary_cases(), *unary_cases()]

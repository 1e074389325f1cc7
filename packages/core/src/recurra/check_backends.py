"""Every op on every device backend against the CPU: ``python -m recurra.check_backends``.

Like ggml's test-backend-ops. Each *case* (an op at given shapes) is built twice with the
explicit graph API: once for the CPU (the reference) and once with the backend under test
preferred (``recurra.Graph(backends=[name])``). Both graphs get the same inputs and a loss
``sum(out * R)`` with a fixed random ``R`` per output, and are differentiated with respect to
every float input. The check compares

- the forward results and the gradients with the normalized MSE
  ``sum((x - ref)**2) / sum(ref**2)`` (integer results: exact), against ``FORWARD_NMSE_MAX`` /
  ``GRAD_NMSE_MAX`` unless the case documents a looser bound;
- the placement: the scheduler reports which backend computed each node
  (``Graph.placement()``); a case whose nodes all ran on the backend under test is ``ok``, a
  case with nodes that fell back to the CPU is ``unsupported`` (its numbers are still
  compared: the nodes that did run on the device must agree).

Verdicts: ``ok``, ``unsupported``, ``MISMATCH`` (a result beyond its bound), ``ERROR`` (an
exception while building or running). Exit codes of :func:`main`: 0 when every case is
``ok`` or ``unsupported`` (with ``--strict`` only ``ok``), 1 on any mismatch or error, 2 for
bad arguments (an unknown op or backend), 3 when no backend other than the CPU is available
(0 with ``--allow-cpu-only``). ``--backend cpu`` compares the CPU with itself: a self-test of
the cases, not of a backend.

The optimizer update ops (sgd_step, adam_step, adamw_step, lion_step, grad_clip) write into
their sources, so they run through :class:`recurra.ops.FusedStep` on tensors that live on the
backend under test (``recurra.tensor(x, device=...)``), and the updated parameters, moments
and step counts are compared. Their placement needs no count: the core runs an in-place op
where the memory it writes lives and raises when that backend has no kernel for it (never a
silent CPU fallback), so a run that completes ran on the device; the "no kernel" error is
reported as ``unsupported``. ``grad_norm`` is an ordinary node and gets a graph case.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import recurra as rc
from recurra import ops
from recurra._install import PLUGINS, install_hint

__all__ = [
    "EXIT_MISMATCH",
    "EXIT_NO_BACKEND",
    "EXIT_OK",
    "EXIT_USAGE",
    "FORWARD_NMSE_MAX",
    "GRAD_NMSE_MAX",
    "NOT_COVERED",
    "BackendUnavailableError",
    "Case",
    "CaseResult",
    "UnknownBackendError",
    "UnknownOpError",
    "UpdateSpec",
    "cases",
    "check",
    "check_case",
    "compare",
    "device_backends",
    "exit_code",
    "format_row",
    "format_table",
    "main",
    "nmse",
    "no_device_message",
    "op_names",
    "resolve_backends",
    "select_cases",
    "summary",
    "to_json",
]

FORWARD_NMSE_MAX = 1e-7
GRAD_NMSE_MAX = 1e-7

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_NO_BACKEND = 0, 1, 2, 3

OK, UNSUPPORTED, MISMATCH, ERROR = "ok", "unsupported", "MISMATCH", "ERROR"

#: Public names of recurra.ops without a case here, and why (none today; helpers such as
#: ``apply`` and ``pack_hyper`` are not ops).
NOT_COVERED: dict[str, str] = {}

# Ops that only re-describe memory (no computation) when their source is dense: a CPU
# location reported for them is the location of the leaf they view, not a fallback.
_VIEW_OPS = frozenset({"reshape", "permute", "slice", "broadcast_to"})


# ------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UpdateSpec:
    """How an optimizer case runs: ``FusedStep([(op, extra, tensors)])`` with hyper-parameters
    ``hyper`` (see :func:`recurra.ops.pack_hyper`), run ``steps`` times. The case's inputs
    are the sources of every tensor in the op's source order, one tensor after the other."""

    op: str
    extra: tuple[int, ...]
    hyper: tuple[tuple[str, float], ...]
    sources_per_tensor: int
    steps: int = 3


@dataclass(frozen=True)
class Case:
    """One op at fixed shapes.

    ``inputs(rng)`` returns the named inputs in the order ``build`` takes them; float
    inputs become trainable leaves (``Graph.param``), int32 ones plain inputs. ``build``
    applies the op to the leaves and returns one tensor or a tuple of them. ``note``
    documents a bound looser than the defaults. Optimizer cases set ``update`` instead (and
    have no gradients); their ``build`` is unused.
    """

    op: str
    name: str
    inputs: Callable[[np.random.Generator], dict[str, np.ndarray]]
    build: Callable[..., Any]
    forward_tol: float = FORWARD_NMSE_MAX
    grad_tol: float = GRAD_NMSE_MAX
    grad: bool = True
    note: str = ""
    update: UpdateSpec | None = None

    @property
    def id(self) -> str:
        return f"{self.op}/{self.name}"

    def seed(self) -> int:
        """A seed that depends on the case's id only (stable across runs and processes)."""
        return zlib.crc32(self.id.encode())


def _f32(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return _f32(rng.standard_normal(shape) * scale)


def _away_from_zero(rng: np.random.Generator, *shape: int, gap: float = 0.25) -> np.ndarray:
    """Normal values pushed out of (-gap, gap): inputs of kinks (relu, abs) and of divisors."""
    x = rng.standard_normal(shape)
    return _f32(np.where(np.abs(x) < gap, np.copysign(gap, x) + x, x))


def _uniform(rng: np.random.Generator, lo: float, hi: float, *shape: int) -> np.ndarray:
    return _f32(rng.uniform(lo, hi, shape))


def _spread(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Distinct values (a shuffled grid plus a little noise): max has a unique argmax, and
    clamp has no element on a bound."""
    n = int(np.prod(shape))
    grid = np.linspace(-2.0, 2.0, n) + rng.uniform(-0.3, 0.3, n) * (4.0 / max(n, 1))
    return _f32(rng.permutation(grid).reshape(shape))


def _binary_inputs(sa: tuple[int, ...], sb: tuple[int, ...], divisor: bool = False) -> Any:
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        b = _away_from_zero(rng, *sb, gap=0.5) if divisor else _normal(rng, *sb)
        return {"a": _normal(rng, *sa), "b": b}

    return make


def _unary_inputs(gen: Callable[[np.random.Generator], np.ndarray]) -> Any:
    return lambda rng: {"x": gen(rng)}


def _scan_inputs(
    n_seqs: int, n_tok: int, n_head: int, head_dim: int, d_state: int, n_group: int, per_state: bool
) -> Any:
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        n_rows = n_seqs + 1  # one state row that no sequence reads: its gradient is 0
        return {
            "s": _normal(rng, n_rows, n_head, head_dim, d_state),
            "x": _normal(rng, n_seqs, n_tok, n_head, head_dim),
            "dt": _f32(rng.standard_normal((n_seqs, n_tok, n_head)) - 1.0),
            "A": _f32(-np.exp(rng.uniform(-1.0, 1.5, (n_head, d_state if per_state else 1)))),
            "B": _normal(rng, n_seqs, n_tok, n_group, d_state),
            "C": _normal(rng, n_seqs, n_tok, n_group, d_state),
            "ids": rng.permutation(n_rows)[:n_seqs].astype(np.int32),
        }

    return make


def _wkv_inputs(kind: str, T: int, H: int, S: int, n_seqs: int) -> Any:
    """Inputs in the op's argument order, in the ranges the models use (decays in (0.5, 1))."""

    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        def x() -> np.ndarray:
            return _normal(rng, T, H, S, scale=0.5)

        def decay() -> np.ndarray:
            return _uniform(rng, 0.5, 0.99, T, H, S)

        state = _normal(rng, n_seqs, H, S, S, scale=0.5)
        if kind == "rwkv_wkv6":
            return {
                "k": x(),
                "v": x(),
                "r": x(),
                "tf": _normal(rng, H, S, scale=0.5),
                "td": decay(),
                "state": state,
            }
        if kind == "gated_linear_attn":
            return {"k": x(), "v": x(), "q": x(), "g": decay(), "state": state}
        # RWKV-7: a = -kk, b = kk * gate with kk L2-normalised per head, as in the model.
        kk = rng.standard_normal((T, H, S))
        kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
        gate = rng.uniform(0.0, 1.0, (T, H, S))
        return {
            "r": x(),
            "w": decay(),
            "k": x(),
            "v": x(),
            "a": _f32(-kk),
            "b": _f32(kk * gate),
            "state": state,
        }

    return make


def _no_build(*leaves: Any) -> Any:
    raise TypeError("an optimizer case runs through FusedStep, not a graph")


def _build_cases() -> list[Case]:
    out: list[Case] = []

    def add(op: str, name: str, inputs: Any, build: Callable[..., Any], **kw: Any) -> None:
        out.append(Case(op, name, inputs, build, **kw))

    # -- elementwise, binary (numpy broadcasting) --------------------------------------
    shapes = {
        "same_3x17": ((3, 17), (3, 17)),
        "row_bcast": ((3, 17), (17,)),
        "bcast_4d": ((2, 3, 4, 5), (1, 3, 1, 5)),
        "bcast_both": ((4, 1, 5), (3, 1)),
    }
    binary = {"add": ops.add, "sub": ops.sub, "mul": ops.mul, "div": ops.div}
    for op, fn in binary.items():
        for name, (sa, sb) in shapes.items():
            add(op, name, _binary_inputs(sa, sb, divisor=op == "div"), fn)

    # -- elementwise, unary ---------------------------------------------------------------
    unary: list[tuple[str, Callable[..., Any], Callable[[np.random.Generator], np.ndarray]]] = [
        ("neg", ops.neg, lambda r: _normal(r, 3, 17)),
        ("abs", ops.abs, lambda r: _away_from_zero(r, 3, 17)),
        ("sqr", ops.sqr, lambda r: _normal(r, 3, 17)),
        ("sqrt", ops.sqrt, lambda r: _uniform(r, 0.2, 4.0, 3, 17)),
        ("exp", ops.exp, lambda r: _normal(r, 3, 17)),
        ("log", ops.log, lambda r: _uniform(r, 0.2, 4.0, 3, 17)),
        ("scale", lambda x: ops.scale(x, -1.75), lambda r: _normal(r, 3, 17)),
        ("clamp", lambda x: ops.clamp(x, -0.5, 0.75), lambda r: _spread(r, 3, 17)),
        ("pow", lambda x: ops.pow(x, 1.5), lambda r: _uniform(r, 0.2, 3.0, 3, 17)),
        ("relu", ops.relu, lambda r: _away_from_zero(r, 3, 17)),
        ("silu", ops.silu, lambda r: _normal(r, 3, 17, scale=2.0)),
        ("gelu", ops.gelu, lambda r: _normal(r, 3, 17, scale=2.0)),
        ("gelu_tanh", ops.gelu_tanh, lambda r: _normal(r, 3, 17, scale=2.0)),
        ("sigmoid", ops.sigmoid, lambda r: _normal(r, 3, 17, scale=2.0)),
        ("tanh", ops.tanh, lambda r: _normal(r, 3, 17, scale=2.0)),
        # Scale 10 reaches the x > 20 branch of softplus.
        ("softplus", ops.softplus, lambda r: _normal(r, 3, 17, scale=10.0)),
    ]
    for op, fn, gen in unary:
        add(op, "3x17", _unary_inputs(gen), fn)
    add("sqr", "odd_1000", _unary_inputs(lambda r: _normal(r, 1000)), ops.sqr)

    # -- views (the loss reads them strided; their gradients are computed nodes) ------------
    x345 = _unary_inputs(lambda r: _normal(r, 3, 4, 5))
    add("reshape", "3x4x5_to_12x5", x345, lambda x: ops.reshape(x, (12, 5)))
    add("reshape", "transposed", x345, lambda x: ops.reshape(ops.transpose(x, 0, 2), (5, 12)))
    add("permute", "201", x345, lambda x: ops.permute(x, (2, 0, 1)))
    add("transpose", "last_two", x345, lambda x: ops.transpose(x))
    add("contiguous", "of_transpose", x345, lambda x: ops.contiguous(ops.transpose(x, 0, 2)))
    add(
        "broadcast_to",
        "3x1_to_2x3x4",
        _unary_inputs(lambda r: _normal(r, 3, 1)),
        lambda x: ops.broadcast_to(x, (2, 3, 4)),
    )
    add("getitem", "slices", x345, lambda x: ops.getitem(x, (slice(1, None), slice(None, None, 2))))
    add("getitem", "int_none", x345, lambda x: ops.getitem(x, (1, None, Ellipsis, slice(1, 4))))

    # -- reductions ------------------------------------------------------------------------
    x4 = _unary_inputs(lambda r: _normal(r, 2, 3, 4, 5))
    add("sum", "all", x4, lambda x: ops.sum(x))
    add("sum", "axis1", x4, lambda x: ops.sum(x, axis=1))
    add("sum", "axes02_keepdims", x4, lambda x: ops.sum(x, axis=(0, 2), keepdims=True))
    add(
        "sum",
        "long_row_1000",
        _unary_inputs(lambda r: _normal(r, 3, 1000)),
        lambda x: ops.sum(x, axis=-1),
    )
    add("mean", "last_axis", x4, lambda x: ops.mean(x, axis=-1))
    add("mean", "all", x4, lambda x: ops.mean(x))
    spread4 = _unary_inputs(lambda r: _spread(r, 2, 3, 4, 5))
    add("max", "all", spread4, lambda x: ops.max(x))
    add("max", "axis0", spread4, lambda x: ops.max(x, axis=0))
    add("max", "last_axis", spread4, lambda x: ops.max(x, axis=-1))

    # -- matrix products -------------------------------------------------------------------
    def mm(sa: tuple[int, ...], sb: tuple[int, ...]) -> Any:
        return lambda rng: {"a": _normal(rng, *sa), "b": _normal(rng, *sb)}

    add("matmul", "5x7_7x3", mm((5, 7), (7, 3)), ops.matmul)
    add(
        "matmul",
        "67x45_45x33",
        mm((67, 45), (45, 33)),
        ops.matmul,
        note="sizes that are no multiple of any tile (partial tiles on every edge)",
    )
    add(
        "matmul",
        "131x70_70x129",
        mm((131, 70), (70, 129)),
        ops.matmul,
        note="past a 128 tile on both output axes",
    )
    add("matmul", "batched_bcast", mm((2, 1, 4, 6), (3, 6, 5)), ops.matmul)
    add("matmul", "vector_matrix", mm((7,), (7, 3)), ops.matmul)
    add("matmul", "matrix_vector", mm((5, 7), (7,)), ops.matmul)
    add("matmul", "transposed_a", mm((7, 5), (7, 3)), lambda a, b: ops.matmul(ops.transpose(a), b))
    add("out_prod", "2x5x4_2x5x3", mm((2, 5, 4), (2, 5, 3)), ops.out_prod)
    add("out_prod", "bcast", mm((1, 6, 4), (3, 6, 5)), ops.out_prod)

    # -- neural-net ops --------------------------------------------------------------------
    x49 = _unary_inputs(lambda r: _normal(r, 4, 9, scale=2.0))
    for op, fn in (("softmax", ops.softmax), ("log_softmax", ops.log_softmax)):
        add(op, "last_axis", x49, fn)
        add(op, "axis0", x49, lambda x, f=fn: f(x, axis=0))
        add(op, "long_row_700", _unary_inputs(lambda r: _normal(r, 2, 700, scale=3.0)), fn)

    def ce_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {
            "logits": _normal(rng, 3, 4, 10, scale=2.0),
            "targets": rng.integers(0, 10, (3, 4)).astype(np.int32),
        }

    add("cross_entropy", "3x4x10", ce_inputs, ops.cross_entropy)
    add("mse_loss", "3x5", mm((3, 5), (3, 5)), ops.mse_loss)
    add("mse_loss", "bcast", mm((3, 5), (5,)), ops.mse_loss)
    norm_in = _unary_inputs(lambda r: _f32(r.standard_normal((4, 33)) * 2.0 + 0.5))
    add("rms_norm", "4x33", norm_in, lambda x: ops.rms_norm(x, 1e-6))
    add("layer_norm", "4x33", norm_in, lambda x: ops.layer_norm(x, 1e-5))
    add("rms_norm", "3d_odd", _unary_inputs(lambda r: _normal(r, 2, 3, 17)), ops.rms_norm)
    add(
        "rms_norm",
        "weighted",
        lambda r: {"x": _normal(r, 3, 33), "w": _f32(1.0 + 0.3 * r.standard_normal(33))},
        lambda x, w: ops.rms_norm(x, 1e-5, w),
        note="a fused op on the CPU, rms_norm then mul on a device",
    )
    add("layer_norm", "3d_odd", _unary_inputs(lambda r: _normal(r, 2, 3, 17)), ops.layer_norm)

    def gated_inputs(skip: bool) -> Any:
        def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
            out = {
                "y": _normal(rng, 2, 3, 16),
                "z": _normal(rng, 2, 3, 16, scale=2.0),
                "w": _f32(1.0 + 0.3 * rng.standard_normal(16)),
            }
            if skip:
                out.update(x=_normal(rng, 2, 3, 16), d=_normal(rng, 4))
            return out

        return make

    # On a device backend the op is built from elementwise ops: checked against the fused CPU op.
    add(
        "gated_rms_norm",
        "groups_of_8_skip",
        gated_inputs(True),
        lambda y, z, w, x, d: ops.gated_rms_norm(y, z, w, 1e-5, 8, x=x, d=d),
    )
    add("gated_rms_norm", "no_skip", gated_inputs(False), ops.gated_rms_norm)

    def conv_inputs(bias: bool) -> Any:
        def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
            out = {"x": _normal(rng, 2, 7, 20), "weight": _normal(rng, 20, 4, scale=0.5)}
            if bias:
                out["bias"] = _normal(rng, 20)
            return out

        return make

    # On a device backend: pad + ssm_conv + add + silu, checked against the fused CPU op.
    add("causal_conv_silu", "2x7x20_k4_bias", conv_inputs(True), ops.causal_conv_silu)
    add("causal_conv_silu", "no_bias", conv_inputs(False), ops.causal_conv_silu)

    def rows_inputs(idx_shape: tuple[int, ...]) -> Any:
        def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
            idx = rng.integers(0, 10, idx_shape).astype(np.int32)
            idx.reshape(-1)[-1] = idx.reshape(-1)[0]  # a repeated row: its gradients add up
            return {"table": _normal(rng, 10, 6), "idx": idx}

        return make

    add("get_rows", "2x3_idx", rows_inputs((2, 3)), ops.get_rows)
    add("get_rows", "1d_idx", rows_inputs((7,)), ops.get_rows)

    # -- shape ops that move data ----------------------------------------------------------
    def cat_inputs(*shapes: tuple[int, ...]) -> Any:
        return lambda rng: {f"t{i}": _normal(rng, *s) for i, s in enumerate(shapes)}

    add("concat", "axis0", cat_inputs((2, 3), (4, 3)), lambda a, b: ops.concat([a, b], axis=0))
    add(
        "concat",
        "three_axis1",
        cat_inputs((2, 1, 5), (2, 3, 5), (2, 2, 5)),
        lambda a, b, c: ops.concat([a, b, c], axis=1),
    )
    add(
        "concat",
        "int32",
        lambda rng: {
            "a": rng.integers(-9, 9, (2, 3)).astype(np.int32),
            "b": rng.integers(-9, 9, (2, 2)).astype(np.int32),
        },
        lambda a, b: ops.concat([a, b], axis=-1),
        grad=False,
    )
    add(
        "pad",
        "2d",
        _unary_inputs(lambda r: _normal(r, 3, 4)),
        lambda x: ops.pad(x, ((1, 2), (0, 3)), value=0.5),
    )
    add("pad", "3d_uniform", x345, lambda x: ops.pad(x, 1))
    add("cumsum", "last_axis", _unary_inputs(lambda r: _normal(r, 3, 7)), ops.cumsum)
    add("cumsum", "axis0_reverse", x345, lambda x: ops.cumsum(x, axis=0, reverse=True))
    add("cumsum", "long_300", _unary_inputs(lambda r: _normal(r, 2, 300)), ops.cumsum)

    # -- recurrent ops ---------------------------------------------------------------------
    def conv_inputs(n_seqs: int, d_inner: int, d_conv: int, n_tok: int) -> Any:
        return lambda rng: {
            "sx": _normal(rng, n_seqs, d_inner, d_conv - 1 + n_tok),
            "c": _normal(rng, d_inner, d_conv, scale=0.5),
        }

    add("ssm_conv", "d_conv4", conv_inputs(2, 5, 4, 7), ops.ssm_conv)
    add("ssm_conv", "odd_d_conv3", conv_inputs(3, 7, 3, 5), ops.ssm_conv)
    # n_seqs, n_tok, n_head, head_dim, d_state, n_group, per_state (see docs/ops.md)
    add(
        "ssm_scan",
        "mamba1",
        _scan_inputs(2, 5, 6, 1, 16, 1, True),
        ops.ssm_scan,
        note="Mamba-1 layout: head_dim 1, one decay per state, d_state 16",
    )
    add(
        "ssm_scan",
        "mamba2",
        _scan_inputs(2, 6, 4, 8, 16, 2, False),
        ops.ssm_scan,
        note="Mamba-2 layout: 4 heads of 8, one decay per head, 2 groups",
    )
    add("ssm_scan", "odd_sizes", _scan_inputs(3, 4, 3, 5, 17, 3, False), ops.ssm_scan)
    for kind, fn in (
        ("rwkv_wkv6", ops.rwkv_wkv6),
        ("rwkv_wkv7", ops.rwkv_wkv7),
        ("gated_linear_attn", lambda k, v, q, g, s: ops.gated_linear_attn(k, v, q, g, s, 0.7)),
    ):
        add(kind, "T8_H2_S8_2seqs", _wkv_inputs(kind, 8, 2, 8, 2), fn)
        add(kind, "T6_H3_S5_3seqs", _wkv_inputs(kind, 6, 3, 5, 3), fn)

    # -- optimizer updates (in place, through FusedStep; see the module docstring) ----------
    def opt_inputs(shapes: Sequence[tuple[int, ...]], sources: Sequence[str]) -> Any:
        def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
            d: dict[str, np.ndarray] = {}
            for t, shape in enumerate(shapes):
                for src in sources:
                    if src == "step":
                        d[f"step{t}"] = np.array([t], np.int32)  # tensors at different steps
                    elif src in ("m", "buf"):
                        d[f"{src}{t}"] = _normal(rng, *shape, scale=0.1)
                    elif src == "v":
                        d[f"v{t}"] = _uniform(rng, 0.0, 0.05, *shape)
                    else:
                        d[f"{src}{t}"] = _normal(rng, *shape)
            return d

        return make

    def add_update(
        op: str,
        name: str,
        extra: tuple[int, ...],
        sources: Sequence[str],
        hyper: dict[str, float],
        shapes: Sequence[tuple[int, ...]],
    ) -> None:
        spec = UpdateSpec(op, extra, tuple(hyper.items()), len(sources))
        add(op, name, opt_inputs(shapes, sources), _no_build, grad=False, update=spec)

    two = [(5, 7), (33,)]
    adam_h = {"lr": 1e-2, "a": 0.9, "b": 0.999, "c": 1e-8}
    add_update("sgd_step", "plain", (0,), ("param", "grad", "step"), {"lr": 0.1}, two)
    add_update(
        "sgd_step",
        "nesterov_wd",
        (1,),
        ("param", "grad", "buf", "step"),
        {"lr": 0.05, "a": 0.9, "b": 0.0, "c": 1.0, "weight_decay": 0.01},
        two,
    )
    add_update(
        "adam_step",
        "l2_wd",
        (),
        ("param", "grad", "m", "v", "step"),
        {**adam_h, "weight_decay": 0.01},
        two,
    )
    add_update(
        "adamw_step",
        "clip_value",
        (),
        ("param", "grad", "m", "v", "step"),
        {**adam_h, "weight_decay": 0.1, "clip_value": 0.8},
        two,
    )
    add_update(
        "adamw_step",
        "ten_tensors",
        (),
        ("param", "grad", "m", "v", "step"),
        {**adam_h, "weight_decay": 0.1},
        [(3, 4)] * 10,
    )
    add_update(
        "lion_step",
        "wd",
        (),
        ("param", "grad", "m", "step"),
        {"lr": 1e-3, "a": 0.9, "b": 0.99, "weight_decay": 0.1},
        two,
    )
    add_update(
        "grad_clip", "value_and_scale", (), ("grad",), {"clip_value": 0.5, "grad_scale": 0.5}, two
    )

    def norm_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
        hyper = ops.pack_hyper({"grad_scale": 0.5, "clip_value": 1.5, "max_norm": 1.0})
        return {"hyper": hyper, "g0": _normal(rng, 5, 7), "g1": _normal(rng, 33)}

    add(
        "grad_norm",
        "scale_clip_max",
        norm_inputs,
        lambda h, a, b: ops.grad_norm(h, [a, b]),
        grad=False,
    )
    return out


_CASES: list[Case] | None = None


def cases() -> list[Case]:
    """Every case, grouped by op (built once)."""
    global _CASES
    if _CASES is None:
        _CASES = _build_cases()
    return list(_CASES)


def op_names() -> list[str]:
    """The ops that have cases, in case order."""
    return list(dict.fromkeys(c.op for c in cases()))


class UnknownOpError(ValueError):
    """An op name without cases."""


class UnknownBackendError(ValueError):
    """A backend name recurra does not know."""


class BackendUnavailableError(RuntimeError):
    """A known backend that cannot run here (no device, no driver, disabled)."""


def select_cases(op_filter: Iterable[str] | None = None) -> list[Case]:
    """The cases of the named ops (exact names; all cases for None or an empty list).

    Raises UnknownOpError naming the unknown ops (and, for an uncovered op, why).
    """
    wanted = list(dict.fromkeys(op_filter or ()))
    if not wanted:
        return cases()
    known = set(op_names())
    bad = [w for w in wanted if w not in known]
    if bad:
        why = "; ".join(f"{b}: {NOT_COVERED[b]}" for b in bad if b in NOT_COVERED)
        raise UnknownOpError(
            f"no cases for op(s) {', '.join(bad)}"
            + (f" ({why})" if why else "")
            + f"; ops with cases: {', '.join(op_names())}"
        )
    return [c for c in cases() if c.op in wanted]


# ------------------------------------------------------------------------------------------
# backends
# ------------------------------------------------------------------------------------------
def device_backends() -> list[str]:
    """The device names of every usable backend other than the CPU (``["vulkan:0"]``...)."""
    from recurra import backends

    backends.available()
    return backends.registered_devices()


def resolve_backends(names: Iterable[str] | None = None) -> list[str]:
    """Device names to check: every non-CPU device for None/empty; ``"vulkan"`` means each
    Vulkan device, ``"vulkan:1"`` that one, ``"cpu"`` the CPU itself (a self-test).

    Raises UnknownBackendError for a name recurra does not know and BackendUnavailableError
    for a known backend without a usable device (the message says why).
    """
    from recurra import backends

    infos = {b.name: b for b in backends.available()}
    registered = device_backends()
    wanted = [n.strip().lower() for n in (names or ()) if n.strip()]
    if not wanted:
        return registered
    out: list[str] = []
    for spec in wanted:
        base, _, idx = spec.partition(":")
        if base == "cpu":
            if idx not in ("", "0"):
                raise UnknownBackendError(f"unknown backend {spec!r}: there is one CPU, 'cpu'")
            found = ["cpu"]
        elif idx:
            found = [spec] if spec in registered else []
        else:
            found = [d for d in registered if d.partition(":")[0] == base]
        if not found:
            if base in infos or base in PLUGINS:
                info = infos.get(base)
                if info is not None and info.available:
                    why = f"it has no device {spec!r} (devices: {', '.join(registered)})"
                elif info is not None:
                    why = info.reason or "no usable device"
                else:
                    hint = install_hint(PLUGINS[base])
                    why = f"the {base} backend is not installed (to add it, {hint})"
                raise BackendUnavailableError(f"backend {spec!r} is unavailable: {why}")
            known = sorted(set(infos) | {"cpu"})
            raise UnknownBackendError(
                f"unknown backend {spec!r}; known backends: {', '.join(known)}"
            )
        out += [d for d in found if d not in out]
    return out


def no_device_message() -> str:
    """Why there is nothing to compare: each device backend and why it cannot start (a
    backend that is installed but has no driver or device says so; one that is not installed
    says how to install it)."""
    from recurra import backends

    whys = [f"{b.name}: {b.reason}" for b in backends.available() if b.name != "cpu"]
    return (
        "no backend other than the CPU is available, so there is nothing to compare ("
        + ("; ".join(whys) or "no backend plugin is known")
        + ")"
    )


# ------------------------------------------------------------------------------------------
# the comparison
# ------------------------------------------------------------------------------------------
def nmse(got: np.ndarray, ref: np.ndarray) -> float:
    """Normalized mean squared error sum((got - ref)**2) / sum(ref**2), in float64.

    When ref is all zeros the plain sum of squares is returned (0 only for an exact match).
    Raises ValueError when the shapes differ.
    """
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"nmse: shapes differ: {got.shape} vs {ref.shape}")
    num = float(np.sum((got - ref) ** 2))
    den = float(np.sum(ref * ref))
    return num / den if den > 0 else num


def compare(got: np.ndarray | None, ref: np.ndarray | None) -> float:
    """The error of one result against its reference: the NMSE over the non-NaN positions
    for floats, 0 or inf for integers (exact), inf for a shape/dtype mismatch, a NaN pattern
    that differs, a non-finite value where the reference is finite, or a result on only one
    side. Two missing results compare as 0."""
    if got is None or ref is None:
        return 0.0 if got is None and ref is None else math.inf
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        return math.inf
    if ref.dtype.kind in "iu" or got.dtype.kind in "iu":
        return 0.0 if got.dtype == ref.dtype and np.array_equal(got, ref) else math.inf
    ref_nan, got_nan = np.isnan(ref), np.isnan(got)
    if not np.array_equal(ref_nan, got_nan):
        return math.inf
    keep = ~ref_nan
    g, r = got[keep], ref[keep]
    if not np.array_equal(np.isinf(g), np.isinf(r)) or not np.array_equal(
        g[np.isinf(g)], r[np.isinf(r)]
    ):
        return math.inf
    fin = np.isfinite(r)
    return nmse(g[fin], r[fin])


@dataclass
class _Run:
    outputs: list[np.ndarray]
    grads: dict[str, np.ndarray | None]
    placement: dict[str, int]
    fallback: list[str]


def _run_case(case: Case, data: dict[str, np.ndarray], backend: str | None) -> _Run:
    """Builds ``case`` as one graph (preferring ``backend``; None: the plain CPU graph),
    differentiates sum(out * R) and computes it. Returns results, gradients and placement."""
    g = rc.Graph(backends=[backend] if backend not in (None, "cpu") else None)
    leaves = []
    for name, arr in data.items():
        if arr.dtype == np.float32 and case.grad:
            leaves.append(g.param(arr.shape, name=name))
        else:
            dtype = "float32" if arr.dtype == np.float32 else "int32"
            leaves.append(g.input(arr.shape, dtype=dtype, name=name))
    res = case.build(*leaves)
    outs = list(res) if isinstance(res, tuple) else [res]
    for o in outs:
        if o.op != "leaf":
            g.set_output(o)
    grads: dict[str, Any] = {}
    floats = [o for o in outs if o.dtype == "float32"]
    if case.grad and floats:
        rng = np.random.default_rng(case.seed() + 1)
        loss = None
        for o in floats:
            r = g.constant(_f32(rng.standard_normal(o.shape)))
            term = ops.sum(ops.mul(o, r))
            loss = term if loss is None else ops.add(loss, term)
        assert loss is not None
        g.set_loss(loss)
        g.build_backward(loss)
        for leaf in leaves:
            if leaf.dtype == "float32":
                gr = leaf.grad
                if gr is not None and gr.op != "leaf":
                    g.set_output(gr)
                grads[leaf.name] = gr
    for leaf, arr in zip(leaves, data.values()):
        g.set_data(leaf, arr)
    g.compute()
    placement = g.placement()
    fallback: list[str] = []
    if backend not in (None, "cpu") and placement.get("cpu", 0):
        for i in range(g.n_nodes):
            t = rc.GraphTensor(g, i, (), "float32")
            op = t.op
            if op != "leaf" and op not in _VIEW_OPS and g.backend_of(t) == "cpu":
                fallback.append(op)
    return _Run(
        outputs=[o.numpy() for o in outs],
        grads={k: (v.numpy() if v is not None else None) for k, v in grads.items()},
        placement=placement,
        fallback=list(dict.fromkeys(fallback)),
    )


def _run_update(case: Case, data: dict[str, np.ndarray], backend: str | None) -> _Run:
    """Runs an optimizer case through FusedStep on host arrays (backend None or "cpu") or on
    tensors in ``backend``'s memory; returns every source after the steps."""
    spec = case.update
    assert spec is not None
    on_device = backend not in (None, "cpu")
    srcs: list[Any] = [
        rc.tensor(a.copy(), device=backend) if on_device else a.copy() for a in data.values()
    ]
    n = spec.sources_per_tensor
    rows = [tuple(srcs[i : i + n]) for i in range(0, len(srcs), n)]
    step = ops.FusedStep([(spec.op, spec.extra, rows)])
    step.set_hyper(0, dict(spec.hyper))
    for _ in range(spec.steps):
        step.run()
    where = backend if on_device and backend is not None else "cpu"
    return _Run(
        outputs=[np.asarray(s) for s in srcs],
        grads={},
        placement={where: len(rows)},
        fallback=[],
    )


def _no_kernel(exc: BaseException) -> bool:
    """Whether an exception says that the device has no kernel for an in-place update."""
    return "no kernel" in str(exc)


@dataclass
class CaseResult:
    """The outcome of one case on one backend."""

    op: str
    case: str
    backend: str
    verdict: str
    forward_nmse: float | None = None
    grad_nmse: float | None = None
    forward_tol: float = FORWARD_NMSE_MAX
    grad_tol: float = GRAD_NMSE_MAX
    placement: dict[str, int] = field(default_factory=dict)
    fallback_ops: list[str] = field(default_factory=list)
    worst_grad: str = ""
    message: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.verdict in (MISMATCH, ERROR)

    def placement_text(self) -> str:
        """E.g. ``"vulkan:0 7"`` or ``"vulkan:0 5, cpu 2 (ssm_scan_back)"``."""
        if not self.placement:
            return "-"
        parts = [f"{b} {n}" for b, n in self.placement.items()]
        text = ", ".join(parts)
        return text + (f" ({', '.join(self.fallback_ops)})" if self.fallback_ops else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "case": self.case,
            "backend": self.backend,
            "verdict": self.verdict,
            "forward_nmse": _json_num(self.forward_nmse),
            "grad_nmse": _json_num(self.grad_nmse),
            "forward_tol": self.forward_tol,
            "grad_tol": self.grad_tol,
            "placement": self.placement,
            "fallback_ops": self.fallback_ops,
            "worst_grad": self.worst_grad or None,
            "message": self.message or None,
            "seconds": round(self.seconds, 4),
        }


def _json_num(v: float | None) -> float | str | None:
    if v is None or math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else "inf"


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:300]


def check_case(case: Case, backend: str) -> CaseResult:
    """Runs one case on the CPU and on ``backend`` and compares them; never raises (an
    exception becomes an ERROR verdict with the message)."""
    t0 = time.perf_counter()
    res = CaseResult(
        case.op, case.name, backend, ERROR, forward_tol=case.forward_tol, grad_tol=case.grad_tol
    )
    data = case.inputs(np.random.default_rng(case.seed()))
    run = _run_update if case.update is not None else _run_case
    try:
        ref = run(case, data, None)
    except Exception as e:  # noqa: BLE001 - reported as a verdict
        res.message = f"the CPU reference failed: {_short(e)}"
        res.seconds = time.perf_counter() - t0
        return res
    try:
        got = run(case, data, backend)
    except Exception as e:  # noqa: BLE001 - reported as a verdict
        if case.update is not None and _no_kernel(e):
            res.verdict = UNSUPPORTED
            res.message = f"no kernel on {backend}: {_short(e)}"
        else:
            res.message = _short(e)
        res.seconds = time.perf_counter() - t0
        return res
    res.placement, res.fallback_ops = got.placement, got.fallback
    res.forward_nmse = max((compare(a, b) for a, b in zip(got.outputs, ref.outputs)), default=0.0)
    if len(got.outputs) != len(ref.outputs):
        res.forward_nmse = math.inf
    if case.grad and ref.grads:
        worst, worst_name = -1.0, ""
        for name, want in ref.grads.items():
            e = compare(got.grads.get(name), want)
            if e > worst or math.isnan(e):
                worst, worst_name = e, name
        res.grad_nmse, res.worst_grad = worst, worst_name
    bad = []
    if not res.forward_nmse <= case.forward_tol:
        bad.append(f"forward NMSE {res.forward_nmse:.3g} > {case.forward_tol:g}")
    if res.grad_nmse is not None and not res.grad_nmse <= case.grad_tol:
        bad.append(f"gradient of {res.worst_grad} NMSE {res.grad_nmse:.3g} > {case.grad_tol:g}")
    if bad:
        res.verdict, res.message = MISMATCH, "; ".join(bad)
    elif backend != "cpu" and set(res.placement) - {backend}:
        res.verdict = UNSUPPORTED
        where = ", ".join(res.fallback_ops) or "some nodes"
        res.message = f"ran on the CPU: {where}"
    else:
        res.verdict = OK
    res.seconds = time.perf_counter() - t0
    return res


def check(
    op_filter: Iterable[str] | None = None,
    backends: Iterable[str] | None = None,
    *,
    on_result: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Runs the selected cases on the selected backends (see :func:`select_cases` and
    :func:`resolve_backends`; default: all cases on every non-CPU device). Calls
    ``on_result`` after each case. Returns the results in run order (backend-major).

    Raises UnknownOpError, UnknownBackendError or BackendUnavailableError for bad
    selections; returns an empty list when no backend is selected or available.
    """
    selected = select_cases(op_filter)
    devices = resolve_backends(backends)
    out: list[CaseResult] = []
    for dev in devices:
        for case in selected:
            r = check_case(case, dev)
            out.append(r)
            if on_result is not None:
                on_result(r)
    return out


def exit_code(results: Sequence[CaseResult], strict: bool = False) -> int:
    """EXIT_MISMATCH when a case failed (or, with ``strict``, was unsupported), else 0."""
    if any(r.failed for r in results):
        return EXIT_MISMATCH
    if strict and any(r.verdict == UNSUPPORTED for r in results):
        return EXIT_MISMATCH
    return EXIT_OK


def summary(results: Sequence[CaseResult]) -> dict[str, int]:
    """Counts per verdict (every verdict present, 0 when absent)."""
    counts = {OK: 0, UNSUPPORTED: 0, MISMATCH: 0, ERROR: 0}
    for r in results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    return counts


def to_json(results: Sequence[CaseResult], backends: Sequence[str], code: int) -> dict[str, Any]:
    """The JSON document of a run: backends, per-case results, counts and the exit code."""
    return {
        "backends": list(backends),
        "results": [r.as_dict() for r in results],
        "summary": summary(results),
        "exit_code": code,
    }


# ------------------------------------------------------------------------------------------
# text output
# ------------------------------------------------------------------------------------------
_HEADER = ("op", "case", "backend", "fwd NMSE", "grad NMSE", "placement", "verdict")
_WIDTHS = (18, 20, 9, 9, 9, 30, 11)


def _fmt_err(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    return f"{v:.2e}" if math.isfinite(v) else ("nan" if math.isnan(v) else "inf")


def _row(cells: Sequence[str]) -> str:
    return "  ".join(f"{c:<{w}}" for c, w in zip(cells, _WIDTHS)).rstrip()


def format_row(r: CaseResult) -> str:
    """One table line (and the message, indented, for a case that is not ok)."""
    line = _row(
        (
            r.op,
            r.case,
            r.backend,
            _fmt_err(r.forward_nmse),
            _fmt_err(r.grad_nmse),
            r.placement_text(),
            r.verdict,
        )
    )
    if r.verdict != OK and r.message:
        line += f"\n    {r.message}"
    return line


def format_table(results: Sequence[CaseResult]) -> str:
    """The results as a plain-text table with a header."""
    return "\n".join([_row(_HEADER), *(format_row(r) for r in results)])


def _format_list() -> str:
    lines = [f"{'op':<18}  {'case':<20}  {'fwd tol':<8}  {'grad tol':<8}  note"]
    for c in cases():
        gt = f"{c.grad_tol:g}" if c.grad else "-"
        lines.append(f"{c.op:<18}  {c.name:<20}  {c.forward_tol:<8g}  {gt:<8}  {c.note}".rstrip())
    lines.append("")
    lines.append("not covered:")
    lines += [f"  {n}: {why}" for n, why in NOT_COVERED.items()]
    try:
        devs = device_backends()
    except Exception as e:  # noqa: BLE001 - listing must work without any backend
        devs = []
        lines.append(f"backends: discovery failed: {_short(e)}")
    lines.append(f"device backends here: {', '.join(devs) if devs else 'none (CPU only)'}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m recurra.check_backends",
        description="Run every op case on every non-CPU backend and compare with the CPU "
        "(forward and gradients, normalized MSE), proving where each case ran.",
    )
    ap.add_argument(
        "--op",
        action="append",
        default=[],
        metavar="NAME",
        help="only this op (exact name; repeatable); see --list",
    )
    ap.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="NAME",
        help="only this backend or device ('vulkan', 'vulkan:0'; repeatable); "
        "'cpu' checks the CPU against itself",
    )
    ap.add_argument(
        "--strict", action="store_true", help="an unsupported case (CPU fallback) fails the run"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument(
        "--allow-cpu-only",
        action="store_true",
        help="exit 0 (not 3) when no backend other than the CPU is available",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring). Returns the exit code."""
    ap = _parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 for --help
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    if args.list:
        print(_format_list())
        return EXIT_OK
    try:
        selected = select_cases(args.op)
        devices = resolve_backends(args.backend)
    except (UnknownOpError, UnknownBackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BackendUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_BACKEND
    if not devices:
        msg = no_device_message()
        code = EXIT_OK if args.allow_cpu_only else EXIT_NO_BACKEND
        if args.json:
            doc = to_json([], [], code)
            doc["message"] = msg
            print(json.dumps(doc))
        else:
            print(("note: " if code == EXIT_OK else "error: ") + msg, file=sys.stderr)
        return code

    ops_wanted = list(dict.fromkeys(c.op for c in selected))

    def show(r: CaseResult) -> None:
        print(format_row(r), flush=True)

    if not args.json:
        print(
            f"checking {len(selected)} cases of {len(ops_wanted)} ops on {', '.join(devices)} "
            f"against the CPU (NMSE bounds: forward {FORWARD_NMSE_MAX:g}, gradients "
            f"{GRAD_NMSE_MAX:g} unless a case documents more)"
        )
        print(_row(_HEADER), flush=True)
    results = check(args.op, devices, on_result=None if args.json else show)
    code = exit_code(results, args.strict)
    if args.json:
        print(json.dumps(to_json(results, devices, code)))
    else:
        counts = summary(results)
        print(
            ", ".join(f"{n} {v}" for v, n in counts.items())
            + f" -> {'PASS' if code == EXIT_OK else 'FAIL'}"
        )
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the reader went away (`| head`): not an error of the check
        sys.stderr.close()
        sys.exit(EXIT_OK)

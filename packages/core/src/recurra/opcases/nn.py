"""Cases of the neural-net ops: softmax, losses, norms, fused gated norm and causal conv,
embedding rows."""

from __future__ import annotations

from typing import Any

import numpy as np

from recurra import ops
from recurra.opcases._case import FiniteDiff, Node, OpCase, f32, normal

NN_TOL = (1e-5, 1e-6)
#: Row shapes of the row-wise ops: one element, odd rows, a long row, several axes.
ROW_SHAPES = [(1,), (3,), (17,), (1000,), (3, 17), (2, 3, 300)]


def _x(*shape: int, scale: float = 1.0, shift: float = 0.0) -> Any:
    return lambda rng: {"x": f32(normal(rng, *shape, scale=scale) + shift)}


def _tag(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _softmax_ref(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return np.asarray(e / e.sum(axis=axis, keepdims=True))


def _log_softmax_ref(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = x.max(axis=axis, keepdims=True)
    return np.asarray(x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True)))


def _rms_norm_ref(x: np.ndarray, eps: float, w: np.ndarray | None = None) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return np.asarray(y if w is None else y * w)


def _layer_norm_ref(x: np.ndarray, eps: float) -> np.ndarray:
    c = x - x.mean(axis=-1, keepdims=True)
    return np.asarray(c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps))


def _cross_entropy_ref(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    lp = _log_softmax_ref(logits)
    picked = np.take_along_axis(lp, targets[..., None].astype(np.int64), axis=-1)
    return np.asarray(-picked.mean())


def softmax_cases() -> list[OpCase]:
    out = []
    x49 = _x(4, 9, scale=2.0)
    for op, fn, ref in (
        ("softmax", ops.softmax, _softmax_ref),
        ("log_softmax", ops.log_softmax, _log_softmax_ref),
    ):
        kw: dict[str, Any] = {"ref": ref, "ref_tol": NN_TOL}
        out += [
            OpCase(op, "last_axis", x49, fn, node=Node(op), **kw),
            OpCase(
                op,
                "axis0",
                x49,
                lambda x, f=fn: f(x, axis=0),
                ref=lambda x, r=ref: r(x, axis=0),
                ref_tol=NN_TOL,
            ),
            OpCase(op, "long_row_700", _x(2, 700, scale=3.0), fn, node=Node(op), **kw),
        ]
        out += [OpCase(op, _tag(s), _x(*s, scale=3.0), fn, node=Node(op), **kw) for s in ROW_SHAPES]
    return out


def _ce_inputs(lead: tuple[int, ...], c: int) -> Any:
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {
            "logits": normal(rng, *lead, c, scale=2.0),
            "targets": rng.integers(0, c, lead).astype(np.int32),
        }

    return make


def _ab(sa: tuple[int, ...], sb: tuple[int, ...]) -> Any:
    return lambda rng: {"a": normal(rng, *sa), "b": normal(rng, *sb)}


def loss_cases() -> list[OpCase]:
    def mse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.asarray(np.mean((a - b) ** 2))

    out = [
        OpCase(
            "cross_entropy",
            "3x4x10",
            _ce_inputs((3, 4), 10),
            ops.cross_entropy,
            ref=_cross_entropy_ref,
            ref_tol=NN_TOL,
        ),
        OpCase("mse_loss", "3x5", _ab((3, 5), (3, 5)), ops.mse_loss, ref=mse, ref_tol=NN_TOL),
        OpCase("mse_loss", "bcast", _ab((3, 5), (5,)), ops.mse_loss, ref=mse, ref_tol=NN_TOL),
    ]
    for n, c in [(1, 1), (3, 17), (17, 1000), (64, 5)]:
        out.append(
            OpCase(
                "cross_entropy",
                f"{n}x{c}",
                _ce_inputs((n,), c),
                ops.cross_entropy,
                ref=_cross_entropy_ref,
                ref_tol=NN_TOL,
                node=Node("cross_entropy"),
            )
        )
    return out


def _norm_case(op: str, name: str, inputs: Any, eps: float | None) -> OpCase:
    fn, ref = (
        (ops.rms_norm, _rms_norm_ref) if op == "rms_norm" else (ops.layer_norm, _layer_norm_ref)
    )
    default = 1e-6 if op == "rms_norm" else 1e-5
    e = default if eps is None else eps
    build = fn if eps is None else (lambda x: fn(x, e))
    return OpCase(
        op, name, inputs, build, ref=lambda x: ref(x, e), ref_tol=NN_TOL, node=Node(op, (), (e,))
    )


def _weighted_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"x": normal(rng, 3, 33), "w": f32(1.0 + 0.3 * rng.standard_normal(33))}


def norm_cases() -> list[OpCase]:
    norm_in = _x(4, 33, scale=2.0, shift=0.5)
    out = [
        _norm_case("rms_norm", "4x33", norm_in, 1e-6),
        _norm_case("layer_norm", "4x33", norm_in, 1e-5),
        _norm_case("rms_norm", "3d_odd", _x(2, 3, 17), None),
        OpCase(
            "rms_norm",
            "weighted",
            _weighted_inputs,
            lambda x, w: ops.rms_norm(x, 1e-5, w),
            ref=lambda x, w: _rms_norm_ref(x, 1e-5, w),
            ref_tol=NN_TOL,
            note="a fused op on the CPU, rms_norm then mul on a device",
        ),
        _norm_case("layer_norm", "3d_odd", _x(2, 3, 17), None),
    ]
    for op in ("rms_norm", "layer_norm"):
        for s in ROW_SHAPES:
            # One-element rows: the backward is r g eps / (x^2 + eps), pure cancellation with
            # a tiny eps; a large eps keeps it well conditioned.
            out.append(
                _norm_case(op, f"rows_{_tag(s)}", _x(*s, shift=0.5), 0.5 if s[-1] == 1 else 1e-5)
            )
    return out


def _gated_ref(
    y: np.ndarray,
    z: np.ndarray | None,
    w: np.ndarray,
    eps: float,
    gs: int,
    x: np.ndarray | None = None,
    d: Any = None,
) -> np.ndarray:
    """gated_rms_norm in float64 (z None: no gate; x, d None: no D skip)."""
    u = y if x is None else y + x * np.repeat(d, y.shape[-1] // d.shape[0])
    h = u if z is None else u * z / (1.0 + np.exp(-z))
    g = h.reshape(*h.shape[:-1], -1, gs)
    n = g / np.sqrt(np.mean(g * g, axis=-1, keepdims=True) + eps)
    return np.asarray(n.reshape(h.shape) * w)


def _conv_silu_ref(x, w, b=None):  # type: ignore[no-untyped-def]
    """causal_conv_silu in float64: zeros before t = 0."""
    s, t, d = x.shape
    k = w.shape[1]
    xp = np.concatenate([np.zeros((s, k - 1, d)), x], axis=1)
    pre = sum(xp[:, j : j + t, :] * w[:, j] for j in range(k))
    if b is not None:
        pre = pre + b
    return np.asarray(pre / (1.0 + np.exp(-pre)))


def fused_cases() -> list[OpCase]:
    """The fused ops of the Mamba blocks. On a device without their kernels the scheduler
    builds them from other ops (recurra/op_spec.h); either way against float64 references,
    and the small ones' CPU gradients against finite differences."""
    fd = FiniteDiff()

    def gated_inputs(lead: tuple[int, ...], c: int, heads: int, z: bool, skip: bool) -> Any:
        def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
            out = {"y": normal(rng, *lead, c)}
            if z:
                out["z"] = normal(rng, *lead, c, scale=2.0)
            out["w"] = f32(1.0 + 0.3 * rng.standard_normal(c))
            if skip:
                out.update(x=normal(rng, *lead, c), d=normal(rng, heads))
            return out

        return make

    def gated(
        name: str,
        lead: tuple[int, ...],
        c: int,
        gs: int,
        heads: int = 0,
        z: bool = True,
        eps: float = 1e-5,
    ) -> OpCase:
        skip = heads > 0
        small = c * int(np.prod(lead)) <= 256
        if skip:
            build: Any = lambda y, z, w, x, d: ops.gated_rms_norm(y, z, w, eps, gs, x=x, d=d)  # noqa: E731
            ref: Any = lambda y, z, w, x, d: _gated_ref(y, z, w, eps, gs, x, d)  # noqa: E731
        elif z:
            build = lambda y, z, w: ops.gated_rms_norm(y, z, w, eps, gs)  # noqa: E731
            ref = lambda y, z, w: _gated_ref(y, z, w, eps, gs)  # noqa: E731
        else:  # rms_norm with a weight: gated_rms_norm(y, w), group_size C
            build = lambda y, w: ops.rms_norm(y, eps, w)  # noqa: E731
            ref = lambda y, w: _gated_ref(y, None, w, eps, c)  # noqa: E731
        return OpCase(
            "gated_rms_norm",
            name,
            gated_inputs(lead, c, heads, z, skip),
            build,
            ref=ref,
            ref_tol=(2e-5, 1e-5),  # groups of 2: a few ulps of h near eps
            fd=fd if small else None,
            node=Node("gated_rms_norm", (gs,), (eps,)),
        )

    def conv_inputs(s: int, t: int, d: int, k: int, bias: bool) -> Any:
        def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
            out = {"x": normal(rng, s, t, d), "weight": normal(rng, d, k, scale=0.5)}
            if bias:
                out["bias"] = normal(rng, d)
            return out

        return make

    def conv(name: str, s: int, t: int, d: int, k: int, bias: bool = True) -> OpCase:
        return OpCase(
            "causal_conv_silu",
            name,
            conv_inputs(s, t, d, k, bias),
            ops.causal_conv_silu,
            ref=_conv_silu_ref,
            ref_tol=(2e-5, 2e-6),
            fd=fd if s * t * d <= 256 else None,
            node=Node("causal_conv_silu"),
        )

    return [
        gated("groups_of_8_skip", (2, 3), 16, 8, heads=4),
        gated("no_skip", (2, 3), 16, 16),
        gated("weight_only", (3, 33), 33, 33, z=False),
        # groups of one: h / sqrt(h^2 + eps) is a step at 0 unless eps is large
        gated("one_channel", (5,), 1, 1, heads=1, eps=0.5),
        gated("groups_of_3_skip", (3,), 6, 3, heads=3),
        gated("wide_groups_skip", (2, 17), 256, 128, heads=4),
        gated("group_lt_c_no_skip", (2, 5), 48, 16),
        gated("rows_70000", (70000,), 4, 2, heads=2),
        gated("rows_70000_wide", (70001,), 64, 64, z=False),
        conv("2x7x20_k4_bias", 2, 7, 20, 4),
        conv("no_bias", 2, 7, 20, 4, bias=False),
        conv("t_lt_k", 3, 2, 5, 4),
        conv("t1_k4_no_bias", 2, 1, 3, 4, bias=False),
        conv("k1", 2, 5, 3, 1),
        conv("wide_70ch_k3", 2, 40, 70, 3),
        conv("rows_70000", 7, 10000, 3, 4),
    ]


def _rows_inputs(idx_shape: tuple[int, ...], v: int = 10, d: int = 6) -> Any:
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        idx = rng.integers(0, v, idx_shape).astype(np.int32)
        idx.reshape(-1)[-1] = idx.reshape(-1)[0]  # a repeated row: its gradients add up
        return {"table": normal(rng, v, d), "idx": idx}

    return make


def rows_cases() -> list[OpCase]:
    kw: dict[str, Any] = {"ref": lambda t, i: t[i], "ref_tol": (0.0, 0.0), "node": Node("get_rows")}
    out = [
        OpCase("get_rows", "2x3_idx", _rows_inputs((2, 3)), ops.get_rows, **kw),
        OpCase("get_rows", "1d_idx", _rows_inputs((7,)), ops.get_rows, **kw),
    ]
    for idx_shape in [(1,), (5,), (2, 3), (2, 2, 2), (1000,)]:
        for d in (1, 3, 100):
            name = f"idx{_tag(idx_shape)}_d{d}"
            out.append(OpCase("get_rows", name, _rows_inputs(idx_shape, 17, d), ops.get_rows, **kw))
    return out


def cases() -> list[OpCase]:
    return [*softmax_cases(), *loss_cases(), *norm_cases(), *fused_cases(), *rows_cases()]

"""Cases of the shape ops: views (reshape, permute, transpose, broadcast_to, getitem,
contiguous) and the ops that move data (concat, pad, cumsum)."""

from __future__ import annotations

from typing import Any

import numpy as np

from recurra import ops
from recurra.opcases._case import Node, OpCase, normal

EXACT = (0.0, 0.0)


def _x(*shape: int) -> Any:
    return lambda rng: {"x": normal(rng, *shape)}


def view_cases() -> list[OpCase]:
    """The loss reads views strided; their gradients are computed nodes."""
    x345 = _x(3, 4, 5)
    kw: dict[str, Any] = {"ref_tol": EXACT}
    return [
        OpCase(
            "reshape",
            "3x4x5_to_12x5",
            x345,
            lambda x: ops.reshape(x, (12, 5)),
            ref=lambda x: x.reshape(12, 5),
            **kw,
        ),
        OpCase(
            "reshape",
            "transposed",
            x345,
            lambda x: ops.reshape(ops.transpose(x, 0, 2), (5, 12)),
            ref=lambda x: np.swapaxes(x, 0, 2).reshape(5, 12),
            **kw,
        ),
        OpCase(
            "permute",
            "201",
            x345,
            lambda x: ops.permute(x, (2, 0, 1)),
            ref=lambda x: x.transpose(2, 0, 1),
            **kw,
        ),
        OpCase(
            "transpose", "last_two", x345, ops.transpose, ref=lambda x: np.swapaxes(x, -1, -2), **kw
        ),
        OpCase(
            "contiguous",
            "of_transpose",
            x345,
            lambda x: ops.contiguous(ops.transpose(x, 0, 2)),
            ref=lambda x: np.swapaxes(x, 0, 2),
            **kw,
        ),
        OpCase(
            "broadcast_to",
            "3x1_to_2x3x4",
            _x(3, 1),
            lambda x: ops.broadcast_to(x, (2, 3, 4)),
            ref=lambda x: np.broadcast_to(x, (2, 3, 4)),
            **kw,
        ),
        OpCase(
            "getitem",
            "slices",
            x345,
            lambda x: ops.getitem(x, (slice(1, None), slice(None, None, 2))),
            ref=lambda x: x[1:, ::2],
            **kw,
        ),
        OpCase(
            "getitem",
            "int_none",
            x345,
            lambda x: ops.getitem(x, (1, None, Ellipsis, slice(1, 4))),
            ref=lambda x: x[1, None, ..., 1:4],
            **kw,
        ),
    ]


def _cat(*shapes: tuple[int, ...]) -> Any:
    return lambda rng: {f"t{i}": normal(rng, *s) for i, s in enumerate(shapes)}


def _concat_case(name: str, axis: int, *shapes: tuple[int, ...]) -> OpCase:
    return OpCase(
        "concat",
        name,
        _cat(*shapes),
        lambda *ts: ops.concat(list(ts), axis=axis),
        ref=lambda *xs: np.concatenate(xs, axis=axis),
        ref_tol=EXACT,
        node=Node("concat", (axis % len(shapes[0]),)) if len(shapes) == 2 else None,
    )


def _int_concat(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "a": rng.integers(-9, 9, (2, 3)).astype(np.int32),
        "b": rng.integers(-9, 9, (2, 2)).astype(np.int32),
    }


def _pad_case(name: str, shape: tuple[int, ...], width: Any, value: float) -> OpCase:
    w = np.asarray(width, dtype=np.int64)
    pairs = np.broadcast_to(w if w.ndim == 2 else np.resize(w, 2), (len(shape), 2))
    return OpCase(
        "pad",
        name,
        _x(*shape),
        lambda x: ops.pad(x, width, value=value),
        ref=lambda x: np.pad(x, pairs, constant_values=value),
        ref_tol=EXACT,
        node=Node("pad", tuple(int(v) for v in pairs.reshape(-1)), (value,)),
    )


def _cumsum_case(
    name: str,
    shape: tuple[int, ...],
    axis: int,
    reverse: bool,
    tol: tuple[float, float] = (1e-5, 1e-4),  # float32 running sums: errors grow along the axis
) -> OpCase:
    def ref(x: np.ndarray) -> np.ndarray:
        if reverse:
            return np.flip(np.cumsum(np.flip(x, axis), axis), axis)
        return np.cumsum(x, axis)

    return OpCase(
        "cumsum",
        name,
        _x(*shape),
        lambda x: ops.cumsum(x, axis=axis, reverse=reverse),
        ref=ref,
        ref_tol=tol,
        node=Node("cumsum", (axis % len(shape), int(reverse))),
    )


#: (dtype, its recurra_dtype code, half an ulp relative): the casts' cases (the bits of the
#: rounding are tested in tests/core/test_dtypes.py).
_CASTS = (("bfloat16", 2, 2.0**-8), ("float16", 3, 2.0**-11))


def _cast_case(dtype: str, code: int, half_ulp: float) -> OpCase:
    return OpCase(
        "cast",
        f"to_{dtype}",
        _x(3, 4, 5),
        lambda x: ops.cast(x, dtype),
        ref=lambda x: x,
        ref_tol=(half_ulp, 0.0),
        grad=False,
        node=Node("cast", (code,)),
    )


def data_cases() -> list[OpCase]:
    out = [
        _concat_case("axis0", 0, (2, 3), (4, 3)),
        _concat_case("three_axis1", 1, (2, 1, 5), (2, 3, 5), (2, 2, 5)),
        OpCase(
            "concat",
            "int32",
            _int_concat,
            lambda a, b: ops.concat([a, b], axis=-1),
            ref=lambda a, b: np.concatenate([a, b], axis=-1),
            ref_tol=EXACT,
            grad=False,
            node=Node("concat", (1,)),
        ),
    ]
    for axis in range(3):
        shape_b = [3, 4, 5]
        shape_b[axis] = 2
        out.append(_concat_case(f"3x4x5_axis{axis}", axis, (3, 4, 5), tuple(shape_b)))
    out += [
        *(_cast_case(dt, code, half_ulp) for dt, code, half_ulp in _CASTS),
        _pad_case("2d", (3, 4), ((1, 2), (0, 3)), 0.5),
        _pad_case("3d_uniform", (3, 4, 5), 1, 0.0),
        _pad_case("17", (17,), (2, 3), 0.0),
        _pad_case("3x4_left_right", (3, 4), ((1, 0), (2, 5)), -1.5),
        _pad_case("1x1x1x1", (1, 1, 1, 1), ((1, 0), (0, 1), (2, 0), (0, 3)), 1.0),
        _cumsum_case("last_axis", (3, 7), -1, False),
        _cumsum_case("axis0_reverse", (3, 4, 5), 0, True),
        _cumsum_case("long_300", (2, 300), -1, False),
        # Longer than 65535 along a non-last axis (lavapipe's loop limit, see cumsum.comp);
        # float32 sums of 70001 terms are off by about 1e-3 from float64 on the CPU too.
        _cumsum_case("70001x2_axis0", (70001, 2), 0, False, (1e-5, 1e-2)),
        _cumsum_case("70001x2_axis0_reverse", (70001, 2), 0, True, (1e-5, 1e-2)),
    ]
    for shape in ((1,), (17,), (1000,), (3, 17), (4, 5, 6)):
        for axis in range(len(shape)):
            for reverse in (False, True):
                name = "x".join(map(str, shape)) + f"_axis{axis}" + ("_reverse" if reverse else "")
                out.append(_cumsum_case(name, shape, axis, reverse))
    return out


def cases() -> list[OpCase]:
    return [*view_cases(), *data_cases()]

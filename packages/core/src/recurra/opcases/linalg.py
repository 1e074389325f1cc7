"""Cases of the matrix products: matmul and out_prod."""

from __future__ import annotations

from typing import Any

import numpy as np

from recurra import ops
from recurra.opcases._case import Node, OpCase, normal

#: Products accumulate K float32 terms: relative to the size of the result.
MM_TOL = (1e-5, 1e-5)


def _ab(sa: tuple[int, ...], sb: tuple[int, ...]) -> Any:
    return lambda rng: {"a": normal(rng, *sa), "b": normal(rng, *sb)}


def _tag(sa: tuple[int, ...], sb: tuple[int, ...]) -> str:
    return "x".join(map(str, sa)) + "_" + "x".join(map(str, sb))


def _out_prod_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.swapaxes(a, -1, -2) @ b
    return out


def matmul(name: str, sa: tuple[int, ...], sb: tuple[int, ...], note: str = "") -> OpCase:
    both_2d = len(sa) >= 2 and len(sb) >= 2
    return OpCase(
        "matmul",
        name,
        _ab(sa, sb),
        ops.matmul,
        ref=np.matmul,
        ref_tol=MM_TOL,
        node=Node("matmul") if both_2d else None,
        note=note,
    )


def out_prod(name: str, sa: tuple[int, ...], sb: tuple[int, ...]) -> OpCase:
    return OpCase(
        "out_prod",
        name,
        _ab(sa, sb),
        ops.out_prod,
        ref=_out_prod_ref,
        ref_tol=MM_TOL,
        node=Node("out_prod"),
    )


def cases() -> list[OpCase]:
    out = [
        matmul("5x7_7x3", (5, 7), (7, 3)),
        matmul(
            "67x45_45x33",
            (67, 45),
            (45, 33),
            note="sizes that are no multiple of any tile (partial tiles on every edge)",
        ),
        matmul("131x70_70x129", (131, 70), (70, 129), note="past a 128 tile on both output axes"),
        matmul("batched_bcast", (2, 1, 4, 6), (3, 6, 5)),
        matmul("vector_matrix", (7,), (7, 3)),
        matmul("matrix_vector", (5, 7), (7,)),
        OpCase(
            "matmul",
            "transposed_a",
            _ab((7, 5), (7, 3)),
            lambda a, b: ops.matmul(ops.transpose(a), b),
            ref=lambda a, b: a.T @ b,
            ref_tol=MM_TOL,
        ),
        out_prod("2x5x4_2x5x3", (2, 5, 4), (2, 5, 3)),
        out_prod("bcast", (1, 6, 4), (3, 6, 5)),
    ]
    for sa, sb in [
        ((1, 1), (1, 1)),
        ((3, 17), (17, 5)),
        ((17, 33), (33, 1)),
        ((65, 129), (129, 67)),
        ((8, 12), (12, 16)),
        ((2, 3, 4, 5), (5, 6)),
        ((2, 1, 4, 5), (3, 5, 6)),
        ((3, 0), (0, 4)),
        ((1, 1000), (1000, 3)),
    ]:
        out.append(matmul(_tag(sa, sb), sa, sb))
    for sa, sb in [((1, 1), (1, 1)), ((17, 3), (17, 5)), ((20, 33), (20, 12)), ((2, 7, 4), (7, 6))]:
        out.append(out_prod(_tag(sa, sb), sa, sb))
    out.append(out_prod("3x1x9x5_2x9x4", (3, 1, 9, 5), (2, 9, 4)))
    return out

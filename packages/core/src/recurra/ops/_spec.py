"""The op spec (recurra/op_spec.h, the declaration of every op) as read-only Python data."""

from __future__ import annotations

import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from recurra.ops import _exports


@dataclass(frozen=True)
class OpSpec:
    """One op of the core's op table.

    ``srcs``, ``n_ip`` and ``n_fp`` are (min, max) counts of sources, integer and float
    parameters (max -1: any number). ``unary`` is the op's RECURRA_UNARY_* code for an
    elementwise unary op (act_grad's parameter), else -1. ``sources``, ``ip``, ``fp`` and
    ``output`` say what each means (``"packed: a, b"``: one flat output holding a then b);
    ``backward`` names the op(s) its gradient is built from ("" when not differentiable);
    ``decomposition`` the ops it becomes on a backend without a kernel for it ("" none).
    ``dtypes``: the float dtypes its float sources may have (one of them for all; see
    RECURRA_OPS_HALF): ``("float32",)``, or also ``"bfloat16"`` and ``"float16"``.
    ``reads_half``: its kernels compute in float32 but read bfloat16/float16 sources as they
    are, mixed with float32 ones (RECURRA_OPS_HALF_IN; the output float32, cross_entropy_back's
    its logits' dtype): no up-cast is needed before it.
    ``autocast``: how :func:`recurra.autocast` casts its float sources (RECURRA_AUTOCAST_*):
    ``"lower"`` to the autocast dtype, ``"float32"`` up to float32, ``"match"`` float32 ones
    to the autocast dtype when another is 2-byte, ``"widen"`` (the ``reads_half`` ops) and
    ``"keep"`` never.
    """

    name: str
    srcs: tuple[int, int]
    n_ip: tuple[int, int]
    n_fp: tuple[int, int]
    unary: int
    sources: str
    ip: str
    fp: str
    output: str
    backward: str
    decomposition: str
    dtypes: tuple[str, ...]
    reads_half: bool
    autocast: str


@functools.cache
def spec() -> Mapping[str, OpSpec]:
    """Every op's :class:`OpSpec` by name, in the op table's order (a read-only mapping)."""
    from recurra import _core

    return MappingProxyType({e["name"]: OpSpec(**e) for e in _core.op_spec()})


@functools.cache
def op_codes() -> Mapping[str, int]:
    """The named codes of recurra/op_spec.h that Python packs into op parameters and
    sources (``SSM_SCAN_SAVE_CHECKPOINTS``, ``HYPER_LR``...), read-only."""
    from recurra import _core

    return MappingProxyType(dict(_core.op_codes()))


if not typing.TYPE_CHECKING:  # mypy reads the public names from the module itself
    __all__ = _exports.public_names(globals())

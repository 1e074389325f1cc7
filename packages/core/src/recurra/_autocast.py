"""Mixed precision: :class:`autocast` and the per-op cast policy.

Inside ``with recurra.autocast(recurra.bfloat16):`` every op recorded through
``recurra.ops`` (``apply``) first casts its float sources by the op's class, declared in the
op spec (RECURRA_AUTOCAST_* in recurra/op_spec.h, ``recurra.ops.spec()[name].autocast``):

- ``"lower"`` (matmul, out_prod: the ops whose cost is a matmul): every float source to the
  autocast dtype, so the product and its output are 2-byte;
- ``"float32"`` (ops without 2-byte kernels: the recurrent scans, convolutions,
  cross-entropy, fused norms; and the numerically sensitive ones that could take 2-byte
  floats: softmax/log_softmax, rms_norm/layer_norm, sum, cumsum, exp, log, softplus):
  2-byte sources up to float32;
- ``"match"`` (the other elementwise and shape ops): sources of mixed float dtypes are cast
  to the autocast dtype (the 2-byte activation sets the dtype, a float32 weight or bias is
  cast to it); sources that share one dtype are left as they are;
- ``"widen"`` (RECURRA_OPS_HALF_IN: the fused norm and convolution, the scan,
  cross-entropy): float32 ops whose kernels read 2-byte sources as they are, converting
  each value exactly where they load it: left as they are, so no up-cast node (no dispatch,
  no float32 copy) runs before them; the gradient of a 2-byte source is rounded to its dtype;
- ``"keep"`` (cast, fill, assign, the optimizer ops): never touched.

A parameter (a leaf requiring gradients) is cast once per autocast region and per target
dtype while that cast is pending: a tied weight used twice in a forward pass costs one cast.
Once the cast has been computed the leaf may be changed in place (an optimizer step), so its
next use casts again. A view of a parameter (``W.T`` in a linear layer) is cast as the view
of the parameter's cast: no dense float32 copy of the transposed weight.

The backward needs nothing special: the gradient of a cast is cast back to its
source's dtype, so a float32 parameter gets a float32 gradient, and each backward op runs in
the dtypes its forward op had.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from recurra._dtype import HALF, DType, as_dtype, bfloat16, float32

F = TypeVar("F", bound=Callable[..., Any])


class _State(threading.local):
    def __init__(self) -> None:
        self.dtype: DType | None = None
        # (id(leaf), target dtype, grad enabled) -> (leaf, its cast); the leaf is kept alive
        # so that its id stays unique while the entry exists.
        self.cache: dict[tuple[int, str, bool], tuple[Any, Any]] | None = None
        self.stack: list[tuple[DType | None, Any]] = []


STATE = _State()


class autocast:
    """Mixed precision inside a ``with`` block (or a decorated function).

    ``dtype`` is ``recurra.bfloat16`` (the default) or ``recurra.float16``; ``enabled=False``
    turns autocast off inside the block (nested in an enabled one, too). The state is per
    thread. Raises TypeError for any other dtype (float32, int32, unknown names).
    """

    def __init__(self, dtype: Any = bfloat16, enabled: bool = True) -> None:
        d = as_dtype(dtype)
        if d not in HALF:
            raise TypeError(
                f"autocast: the dtype must be recurra.bfloat16 or recurra.float16, not {d}"
            )
        self.dtype = d
        self.enabled = bool(enabled)

    def __enter__(self) -> autocast:
        STATE.stack.append((STATE.dtype, STATE.cache))
        if not self.enabled:
            STATE.dtype, STATE.cache = None, None
        elif STATE.dtype != self.dtype:  # the same dtype nested: share the outer casts
            STATE.dtype, STATE.cache = self.dtype, {}
        return self

    def __exit__(self, *exc: object) -> None:
        STATE.dtype, STATE.cache = STATE.stack.pop()

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with autocast(self.dtype, self.enabled):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"recurra.autocast({self.dtype!r}, enabled={self.enabled})"


def autocast_dtype() -> DType | None:
    """The dtype of the innermost enabled :class:`autocast` of this thread, or None."""
    return STATE.dtype


def is_autocast_enabled() -> bool:
    """Whether ops recorded now on this thread are cast by the autocast policy."""
    return STATE.dtype is not None


@functools.cache
def op_class(name: str) -> str:
    """The autocast class of op ``name``: "lower", "float32", "widen", "match" or "keep"."""
    from recurra.ops._spec import spec

    s = spec().get(name)
    return s.autocast if s is not None else "keep"


# Views that may sit between a parameter and the op that reads it (nn.Linear's W^T).
_VIEWS = ("permute", "reshape")


def _is_param(t: Any) -> bool:
    from recurra._tensor import Tensor

    return isinstance(t, Tensor) and t.is_leaf and t.requires_grad


def _cast(t: Any, target: DType) -> Any:
    from recurra._tensor import LAZY, is_grad_enabled
    from recurra.ops import cast

    cache = STATE.cache
    if cache is None:
        return cast(t, target)
    if getattr(t, "_op", None) in _VIEWS and _is_param(t._src[0]):
        # A view of a parameter (W^T): cast the parameter (once, cached) and view the cast,
        # instead of a dense float32 copy of the view to cast from.
        return LAZY.apply(t._op, [_cast(t._src[0], target)], t._ip, t._fp)
    if not _is_param(t):
        return cast(t, target)
    key = (id(t), str(target), is_grad_enabled())
    hit = cache.get(key)
    if hit is not None and hit[1].storage is None:  # still pending: the leaf is unchanged
        return hit[1]
    out = cast(t, target)
    cache[key] = (t, out)
    return out


def cast_sources(name: str, srcs: Sequence[Any]) -> Sequence[Any]:
    """``srcs`` (tensors of one frontend) cast as op ``name``'s autocast class says."""
    dtype = STATE.dtype
    if dtype is None:
        return srcs
    cls = op_class(name)
    if cls in ("keep", "widen"):
        return srcs
    floats = {s.dtype for s in srcs if s.dtype.is_floating}
    if cls == "lower":
        target = dtype
    elif cls == "float32":
        target = float32
    elif len(floats) > 1:  # "match": a mix of float dtypes
        target = dtype
    else:
        return srcs
    if not floats or floats == {target}:
        return srcs
    return [_cast(s, target) if s.dtype.is_floating and s.dtype != target else s for s in srcs]

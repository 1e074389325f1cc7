"""Optimizer update ops: fused, in-place updates of parameters and their state.

These ops differ from every other op: they **write into their sources** (the parameter, its
moments, its step count; the gradient for ``grad_clip``) and return a 1-element dummy. So
they must be built on leaves bound to the memory to update; the core refuses anything else.
One node updates many tensors at once (one parallel region per step, not one per tensor).

Two ways to use them:

- :class:`FusedStep`: what ``recurra_optim`` uses. A small native graph built once for a set
  of tensors, whose leaves are bound (zero-copy) to the arrays to update; each step only
  rebinds what changed (usually the gradients) and runs it.
- :func:`adam_step` and friends: the same ops on the explicit graph API
  (:class:`recurra.Graph`), for ggml-style training loops. The update happens when the
  graph is computed.

Hyper-parameters travel in a float32 tensor of :data:`HYPER_LEN` elements (see
:func:`pack_hyper`): each slot is a pair (hi, lo) of float32 whose sum is the double value,
so a learning rate or a beta keeps about 48 bits without float64 support on the device, and
changing a learning rate never rebuilds a graph.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from recurra import _core
from recurra.ops import _exports
from recurra.ops._apply import apply


def _slot_names() -> tuple[str, ...]:
    codes = _core.op_codes()
    names = ["reserved"] * int(codes["HYPER_SLOTS"])
    for key, slot in codes.items():
        if key.startswith("HYPER_") and key != "HYPER_SLOTS":
            names[int(slot)] = key.removeprefix("HYPER_").lower()
    return tuple(names)


#: Slot names of the hyper-parameter tensor, in order (RECURRA_HYPER_* of recurra/op_spec.h,
#: lowercased; "reserved" where no slot is named). Slots a, b, c mean beta1, beta2, eps
#: (Adam, AdamW), beta1, beta2 (Lion), or momentum, dampening, nesterov (SGD).
#: clip_value <= 0 and max_norm <= 0 mean "off".
HYPER_SLOTS: tuple[str, ...] = _slot_names()
HYPER_LEN = 2 * len(HYPER_SLOTS)
_SLOT = {name: i for i, name in enumerate(HYPER_SLOTS)}
_DEFAULTS = {"grad_scale": 1.0}

#: Sources per tensor of each update op, in order ("buf" only with SGD momentum).
_UPDATE_SOURCES: dict[str, tuple[str, ...]] = {
    "sgd_step": ("param", "grad", "buf", "step"),
    "adam_step": ("param", "grad", "m", "v", "step"),
    "adamw_step": ("param", "grad", "m", "v", "step"),
    "lion_step": ("param", "grad", "m", "step"),
    "grad_clip": ("grad",),
}


def pack_hyper(values: Mapping[str, float], out: np.ndarray | None = None) -> np.ndarray:
    """Packs named hyper-parameters into the float32 (hi, lo) layout of the update ops.

    Unnamed slots are 0 (grad_scale: 1). Returns ``out`` (or a new array of HYPER_LEN).
    Raises ValueError for an unknown name or a non-finite value.
    """
    if out is None:
        out = np.empty(HYPER_LEN, np.float32)
    full = [0.0] * len(HYPER_SLOTS)
    for k, v in _DEFAULTS.items():
        full[_SLOT[k]] = v
    for k, v in values.items():
        if k not in _SLOT:
            raise ValueError(f"unknown hyper-parameter slot {k!r}; expected one of {HYPER_SLOTS}")
        v = float(v)
        if not np.isfinite(v):
            raise ValueError(f"hyper-parameter {k} must be finite, got {v}")
        full[_SLOT[k]] = v
    hi = np.asarray(full, np.float64).astype(np.float32)
    lo = (np.asarray(full, np.float64) - hi.astype(np.float64)).astype(np.float32)
    out[0::2] = hi
    out[1::2] = lo
    return out


#: Sources one optimizer node takes at most when it runs on a device backend
#: (RECURRA_MAX_SRC of the C backend table, 12 since its ABI 2); device steps are cut into
#: such nodes: two AdamW tensors a node (hyper + 2 x 5 sources), so that a device records
#: one dispatch of step counts (and the node's dummy) for two tensors.
_DEVICE_MAX_SRC = 12


def _device_buffer(a: Any) -> Any:
    """The DeviceBuffer behind a recurra tensor that lives on a device backend, else None."""
    value = getattr(a, "_value", None)
    if isinstance(value, _core.DeviceBuffer):
        return value
    if value is None and getattr(a, "is_on_device", False):
        from recurra._tensor import LAZY  # a pending result: compute it where it lives

        LAZY.run([a])
        return a._value if isinstance(a._value, _core.DeviceBuffer) else None
    return None


def _check_source(a: Any, what: str) -> Any:
    """Returns what a leaf binds to: the array itself, or a device tensor's buffer."""
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous to be updated in place")
        return a
    buf = _device_buffer(a)
    if buf is None:
        raise TypeError(
            f"{what} must be a numpy array or a recurra tensor on a device, got {type(a).__name__}"
        )
    if not buf.valid:
        raise RuntimeError(f"{what}: its device memory was released (the backend closed)")
    return buf


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), max(1, size))]


class FusedStep:
    """One optimizer step as a native graph: built once, then rebound and rerun each step.

    ``updates`` is a sequence of ``(op, ip_extra, tensors)``: ``op`` one of ``sgd_step``,
    ``adam_step``, ``adamw_step``, ``lion_step``, ``grad_clip``; ``ip_extra`` its integer
    parameters after (n, has_gstat) (``(has_buf,)`` for sgd_step, else ``()``); ``tensors``
    a list of per-tensor tuples of sources in the op's source order (_UPDATE_SOURCES; the step
    count is a 1-element int32). A source is a numpy array, bound without copying, or a
    recurra tensor on a device backend, bound to its device memory: either way the update
    lands in place. Device updates run on that device (the core places in-place ops where
    the memory they write lives), cut into nodes of at most _DEVICE_MAX_SRC sources, so
    parameters and state never cross to the host. With ``norm=True`` a ``grad_norm`` over all
    gradients runs first and every update scales its gradients by its clip coefficient (read
    the norm back with :meth:`grad_norm`); it takes grad_scale, clip_value and max_norm from
    update 0's hyper-parameters.

    Raises ValueError/TypeError (from the core) for mismatched shapes or dtypes, and
    RuntimeError when a device holding sources has no kernel for the update.
    """

    def __init__(
        self,
        updates: Sequence[tuple[str, Sequence[int], Sequence[Sequence[Any]]]],
        *,
        norm: bool = False,
    ) -> None:
        self._g = _core.Graph()
        self._hyper: list[np.ndarray] = []
        self._leaf: list[list[list[int]]] = []  # [update][tensor][source] -> node id
        self._bound: list[list[list[Any]]] = []  # what each leaf is bound to now
        self._norm_id = -1
        self._hyper_dev: list[Any] = []  # the device copy of each update's hyper, or None
        devices: set[str] = set()
        built: list[tuple[str, list[int], int, list[list[int]], str]] = []
        for op, extra, tensors in updates:
            if op not in _UPDATE_SOURCES:
                raise ValueError(f"FusedStep: unknown update op {op!r}")
            if not tensors:
                raise ValueError(f"FusedStep: {op} needs at least one tensor")
            h = pack_hyper({})
            hid = self._g.leaf("float32", [HYPER_LEN], _core.FLAG_INPUT, f"{op}.hyper")
            ids: list[list[int]] = []
            bound: list[list[Any]] = []
            on_device = ""
            for t, sources in enumerate(tensors):
                row, brow = [], []
                for k, a in enumerate(sources):
                    b = _check_source(a, f"{op}: source {k} of tensor {t}")
                    if isinstance(b, np.ndarray):
                        dt = "int32" if b.dtype == np.int32 else "float32"
                        nid = self._g.leaf(dt, list(b.shape), _core.FLAG_INPUT, "")
                        self._g.bind(nid, b)
                    else:
                        nid = self._g.leaf(str(a.dtype), list(a.shape), _core.FLAG_INPUT, "")
                        self._g.bind_device(nid, b)
                        devices.add(b.backend)
                        on_device = b.backend
                    row.append(nid)
                    brow.append(b)
                ids.append(row)
                bound.append(brow)
            if on_device:
                # The hyper-parameters live beside the tensors too, uploaded only when they
                # change (set_hyper), so a steady-state step moves nothing to the device.
                hbuf = _core.DeviceBuffer(on_device, HYPER_LEN * 4)
                hbuf.upload(h)
                self._g.bind_device(hid, hbuf)
                self._hyper_dev.append(hbuf)
            else:
                self._g.bind(hid, h)
                self._hyper_dev.append(None)
            self._hyper.append(h)
            self._leaf.append(ids)
            self._bound.append(bound)
            built.append((op, list(extra), hid, ids, on_device))
        if devices:  # grad_norm is an ordinary node: prefer the device that holds the grads
            self._g.set_backends(sorted(devices), False)
        if norm:
            g_pos = [_UPDATE_SOURCES[op].index("grad") for op, *_ in updates]
            grads = [row[g_pos[u]] for u, (*_, ids, _) in enumerate(built) for row in ids]
            hid0 = built[0][2]
            if devices:  # a tree of nodes that each fit the device's source limit
                level = [
                    self._g.op("grad_norm", [hid0, *c], [], [])
                    for c in _chunks(grads, _DEVICE_MAX_SRC - 1)
                ]
                while len(level) > 1:
                    level = [
                        self._g.op("grad_norm", [hid0, *c], [1], [])
                        for c in _chunks(level, _DEVICE_MAX_SRC - 1)
                    ]
                self._norm_id = level[0]
            else:
                self._norm_id = self._g.op("grad_norm", [hid0, *grads], [], [])
            self._g.set_flags(self._norm_id, _core.FLAG_OUTPUT)
        for op, extra, hid, ids, on_device in built:
            fixed = [hid] + ([self._norm_id] if norm else [])
            per = len(ids[0])
            size = (_DEVICE_MAX_SRC - len(fixed)) // per if on_device else len(ids)
            for rows in _chunks(ids, size):
                srcs = fixed + [i for row in rows for i in row]
                self._g.op(op, srcs, [len(rows), 1 if norm else 0, *extra], [])
        self._g.plan()

    def hyper(self, update: int) -> np.ndarray:
        """A copy of the packed hyper-parameters of update ``update`` (set them with
        :meth:`set_hyper`)."""
        out: np.ndarray = self._hyper[update].copy()
        return out

    def set_hyper(self, update: int, values: Mapping[str, float]) -> None:
        """Packs ``values`` into update ``update``'s hyper-parameters (see pack_hyper); for
        a device update this is the one upload, of HYPER_LEN floats."""
        pack_hyper(values, self._hyper[update])
        dev = self._hyper_dev[update]
        if dev is not None:
            dev.upload(self._hyper[update])

    def bind(self, update: int, tensor: int, source: int, array: Any) -> None:
        """Points one source at ``array`` (a numpy array or a device tensor, same shape and
        dtype; no copy). Cheap when it is bound already. Raises ValueError/TypeError on a
        mismatch."""
        b = _check_source(array, f"bind: source {source} of tensor {tensor}")
        if self._bound[update][tensor][source] is b:
            return
        nid = self._leaf[update][tensor][source]
        if isinstance(b, np.ndarray):
            self._g.bind(nid, b)
        else:
            self._g.bind_device(nid, b)
        self._bound[update][tensor][source] = b

    def bind_column(self, update: int, source: int, arrays: Sequence[Any]) -> None:
        """Binds source ``source`` of every tensor of update ``update`` (one array or device
        tensor per tensor, in order), skipping those already bound: the per-step call for
        the gradients."""
        if len(arrays) != len(self._bound[update]):
            raise ValueError(
                f"bind_column: {len(arrays)} arrays for {len(self._bound[update])} tensors"
            )
        for t, a in enumerate(arrays):
            self.bind(update, t, source, a)

    def unbind_column(self, update: int, source: int) -> None:
        """Lets go of source ``source`` of every tensor of update ``update`` (the gradients,
        once the step ran): the step then keeps none of that memory alive between steps. The
        plan stays: binding arrays or buffers of the same device again costs no planning, and
        :meth:`run` raises until they are bound."""
        for t, row in enumerate(self._bound[update]):
            if row[source] is not None:
                self._g.unbind(self._leaf[update][t][source])
                row[source] = None

    def bound(self, update: int, tensor: int, source: int) -> Any:
        """The object source ``source`` of tensor ``tensor`` is bound to now (None after
        :meth:`unbind_column`)."""
        return self._bound[update][tensor][source]

    def run(self) -> None:
        """Runs the step: every bound array is updated in place."""
        self._g.compute()

    def grad_norm(self) -> float:
        """The global gradient norm of the last run (effective gradient: scaled and clipped
        by value). Raises RuntimeError when the step was built without ``norm=True``."""
        if self._norm_id < 0:
            raise RuntimeError("FusedStep.grad_norm(): this step was built without norm=True")
        return float(self._g.read(self._norm_id)[0])


# ---- the same ops on the explicit graph API ------------------------------------------------


def _graph_srcs(op: str, srcs: Sequence[Any]) -> list[Any]:
    from recurra.graph import GraphTensor

    for s in srcs:
        if not isinstance(s, GraphTensor):
            raise TypeError(
                f"{op}: update ops write into their sources, so they take leaves of a "
                f"recurra.Graph (got {type(s).__name__}); for eager updates use FusedStep "
                f"or recurra_optim"
            )
    return list(srcs)


def _update(
    op: str, hyper: Any, gstat: Any, per_tensor: Sequence[Sequence[Any]], extra: Sequence[int] = ()
) -> Any:
    n = len(per_tensor)
    srcs = [hyper] + ([gstat] if gstat is not None else []) + [s for row in per_tensor for s in row]
    return apply(op, _graph_srcs(op, srcs), ip=(n, 1 if gstat is not None else 0, *extra))


def sgd_step(
    hyper: Any,
    params: Sequence[Any],
    grads: Sequence[Any],
    steps: Sequence[Any],
    bufs: Sequence[Any] | None = None,
    gstat: Any = None,
) -> Any:
    """SGD (momentum, nesterov, weight decay) on graph leaves, in place; returns the dummy
    node (depend on it, or just compute the graph). ``bufs``: momentum buffers, or None for
    plain SGD. ``gstat``: a :func:`grad_norm` node for clipping by global norm."""
    rows = [
        (p, g, *([b] if bufs is not None else []), s)
        for p, g, b, s in zip(params, grads, bufs if bufs is not None else params, steps)
    ]
    return _update("sgd_step", hyper, gstat, rows, (1 if bufs is not None else 0,))


def adam_step(
    hyper: Any,
    params: Sequence[Any],
    grads: Sequence[Any],
    ms: Sequence[Any],
    vs: Sequence[Any],
    steps: Sequence[Any],
    gstat: Any = None,
) -> Any:
    """Adam with bias correction and L2 weight decay, on graph leaves, in place."""
    return _update("adam_step", hyper, gstat, list(zip(params, grads, ms, vs, steps)))


def adamw_step(
    hyper: Any,
    params: Sequence[Any],
    grads: Sequence[Any],
    ms: Sequence[Any],
    vs: Sequence[Any],
    steps: Sequence[Any],
    gstat: Any = None,
) -> Any:
    """AdamW (decoupled weight decay), on graph leaves, in place."""
    return _update("adamw_step", hyper, gstat, list(zip(params, grads, ms, vs, steps)))


def lion_step(
    hyper: Any,
    params: Sequence[Any],
    grads: Sequence[Any],
    ms: Sequence[Any],
    steps: Sequence[Any],
    gstat: Any = None,
) -> Any:
    """Lion (sign of the interpolated momentum, decoupled weight decay), in place."""
    return _update("lion_step", hyper, gstat, list(zip(params, grads, ms, steps)))


def grad_norm(hyper: Any, grads: Sequence[Any]) -> Any:
    """A (2,) node: [global L2 norm of the effective gradients, clip coefficient]."""
    return apply("grad_norm", _graph_srcs("grad_norm", [hyper, *grads]))


def grad_clip(hyper: Any, grads: Sequence[Any], gstat: Any = None) -> Any:
    """Scales and clips gradient leaves in place (by value, and by ``gstat``'s coefficient)."""
    return _update("grad_clip", hyper, gstat, [(g,) for g in grads])


if not typing.TYPE_CHECKING:  # mypy reads the public names from the module itself
    __all__ = _exports.public_names(globals())

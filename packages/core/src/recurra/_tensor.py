"""The tensor API: lazy tensors that record ops and run them as one planned graph.

Ops on :class:`Tensor` record nodes; nothing runs until a value is needed (``numpy()``,
``item()``, ``backward()``, ``np.asarray``). Then every pending node reachable from what is
needed is built into one native graph, planned, and run. A graph with the same structure
as one run before (same ops, shapes, dtypes and parameters; different data) reuses the
native graph and its memory plan: a training loop plans once.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from recurra import _core
from recurra._devices import Device, parse_device
from recurra._dtype import DType, as_dtype, bits_view, is_dtype
from recurra._tensorbase import TensorOps
from recurra.ops import _apply
from recurra.ops._apply import to_supported


class _State(threading.local):
    """Per-thread settings; the class attributes are each thread's defaults."""

    grad_enabled = True
    segment = 0  # the recomputation segment ops are recorded into (0: none)
    strict: bool | None = None  # strict placement; None: from RECURRA_STRICT


_state = _State()


def is_grad_enabled() -> bool:
    """True unless inside :func:`no_grad`."""
    return _state.grad_enabled


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Context manager: ops inside record no gradient history (as ``torch.no_grad``)."""
    prev = is_grad_enabled()
    _state.grad_enabled = False
    try:
        yield
    finally:
        _state.grad_enabled = prev


_segment_ids = itertools.count(1)  # next() is atomic under the GIL


@contextlib.contextmanager
def recompute() -> Iterator[None]:
    """Context manager: the forward of what runs inside is recomputed during the backward
    instead of kept (activation checkpointing; torch.utils.checkpoint's trade).

    Tensors that ops create inside form one *recomputation segment*. When ``backward()``
    differentiates them it first runs their ops again (right before their gradients) and
    the gradient rules read those copies, so the memory planner reuses the memory of the
    originals once the forward no longer reads them. Only tensors that flow in or out of
    the block stay alive through the step. Gradients are the same as without (the same ops
    run on the same data); a step costs about one more forward of the block.

    A ``recompute()`` entered inside another joins the outer segment (the whole outer block
    is recomputed as one). Ops that update memory in place (the optimizers' steps) cannot
    run twice: differentiating a segment that holds one raises ValueError.
    """
    prev = _state.segment
    _state.segment = prev or next(_segment_ids)
    try:
        yield
    finally:
        _state.segment = prev


def strict_placement() -> bool:
    """Whether a node that no device backend supports raises instead of running on the CPU.

    Set with :func:`set_strict_placement` or the environment variable RECURRA_STRICT=1.
    """
    v = _state.strict
    if v is None:
        import os

        return os.environ.get("RECURRA_STRICT", "") not in ("", "0")
    return bool(v)


def set_strict_placement(flag: bool) -> None:
    """Strict placement: raise RuntimeError for any node a device backend cannot run."""
    _state.strict = bool(flag)


def _host_array(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A numpy array whose memory is counted in recurra's persistent pool."""
    n = math.prod(shape)
    buf = _core.HostBuffer(max(n, 1) * np.dtype(dtype).itemsize)
    arr: np.ndarray = np.frombuffer(memoryview(buf), dtype=dtype, count=n).reshape(shape)
    return arr


class Tensor(TensorOps):
    """A lazy tensor of the tensor API (float32, bfloat16, float16 or int32; up to 4 axes)."""

    __slots__ = (
        "_op",
        "_src",
        "_ip",
        "_fp",
        "shape",
        "dtype",
        "_value",
        "requires_grad",
        "grad",
        "_is_param",
        "device",
        "_seg",
        "__weakref__",
    )
    _op: str | None
    _src: tuple[Tensor, ...]
    _ip: tuple[int, ...]
    _fp: tuple[float, ...]
    shape: tuple[int, ...]
    #: The dtype: ``recurra.float32``, ``bfloat16``, ``float16`` or ``int32`` (a str subclass).
    dtype: DType
    _value: np.ndarray | _core.DeviceBuffer | None
    requires_grad: bool
    #: The gradient ``backward()`` accumulated (a tensor on this tensor's device), or None.
    grad: Tensor | None
    _is_param: bool
    device: Device
    _seg: int

    def __init__(self) -> None:
        raise TypeError("create tensors with recurra.tensor() or recurra.param()")

    @classmethod
    def _new(
        cls,
        op: str | None,
        src: tuple[Tensor, ...],
        ip: tuple[int, ...],
        fp: tuple[float, ...],
        shape: tuple[int, ...],
        dtype: str,
        value: np.ndarray | _core.DeviceBuffer | None,
        requires_grad: bool,
        device: Device,
    ) -> Tensor:
        t = object.__new__(cls)
        t._op = op
        t._src = src
        t._ip = ip
        t._fp = fp
        t.shape = shape
        t.dtype = dtype if type(dtype) is DType else as_dtype(dtype)
        t._value = value
        t.requires_grad = requires_grad
        t.grad = None
        t._is_param = False
        t.device = device
        t._seg = 0  # recomputation segment (see recompute()); 0: none
        return t

    @property
    def _frontend(self) -> LazyFrontend:
        return LAZY

    @property
    def is_leaf(self) -> bool:
        return self._op is None

    # -- values ----------------------------------------------------------------------
    @property
    def storage(self) -> np.ndarray | _core.DeviceBuffer | None:
        """The memory holding this tensor's value, as it is now: nothing is computed,
        copied or moved.

        - a numpy array when the value is on the host: the tensor's own memory (writing
          into it changes the tensor; this is how the optimizers update parameters and
          their state in place);
        - a :class:`recurra.DeviceBuffer` when the value lives in a device backend's memory
          (``upload``/``download`` copy into and out of it; ``valid`` is False once its
          backend was closed);
        - None while the value is pending (recorded ops that have not run yet).

        Use :meth:`numpy` for a copy of the value on the host, computing it if needed.
        """
        return self._value

    def _realized(self) -> np.ndarray:
        """The value as a host array (computing it, and downloading it from a device)."""
        if self._value is None:
            LAZY.run([self])
        v = self._value
        if isinstance(v, _core.DeviceBuffer):
            host = np.empty(self.shape, self.dtype.numpy)
            v.download(bits_view(host))
            return host
        assert v is not None
        return v

    @property
    def is_on_device(self) -> bool:
        """True when the value lives in a plugin backend's memory (not the host)."""
        return self.device.backend != "cpu"

    def numpy(self) -> np.ndarray:
        """Runs what is pending and returns the value as a new numpy array."""
        out: np.ndarray = self._realized().copy()
        return out

    def item(self) -> float | int:
        """The value of a one-element tensor as a Python number."""
        if self.size != 1:
            raise ValueError(f"item(): the tensor has {self.size} elements, not 1")
        value: float | int = self._realized().reshape(()).item()
        return value

    def tolist(self) -> Any:
        return self._realized().tolist()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        v = self._realized()
        if dtype is not None and np.dtype(dtype) != v.dtype:
            if copy is False:
                raise ValueError("converting the dtype needs a copy, but copy=False was given")
            converted: np.ndarray = v.astype(dtype)
            return converted
        if copy:
            copied: np.ndarray = v.copy()
            return copied
        out: np.ndarray = v.view()
        out.flags.writeable = False
        return out

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __repr__(self) -> str:
        v = self._value
        if v is None:
            state = "pending"
        elif isinstance(v, np.ndarray):
            state = np.array2string(v, threshold=20)
        else:  # a device buffer: its value is not downloaded for a repr
            state = f"on {self.device}"
        extra = ", requires_grad=True" if self.requires_grad else ""
        return f"recurra.Tensor({state}, shape={self.shape}, dtype={self.dtype}{extra})"

    # -- autodiff --------------------------------------------------------------------
    def backward(self, gradient: Any = None) -> None:
        """Computes the gradient of this tensor with respect to every parameter it depends on.

        Gradients accumulate into ``param.grad`` (as in PyTorch). A non-scalar tensor needs
        ``gradient`` (same shape). Raises RuntimeError if nothing requires a gradient.
        """
        if not self.requires_grad:
            raise RuntimeError(
                "backward(): this tensor does not require grad (no parameter flows into it, "
                "or it was computed under no_grad())"
            )
        seed = None
        if gradient is None:
            if self.size != 1:
                raise RuntimeError(
                    f"backward(): grad can be implicitly created only for scalar outputs "
                    f"(shape {self.shape}); pass gradient="
                )
        else:
            seed = gradient if isinstance(gradient, Tensor) else tensor(gradient)
            if seed.shape != self.shape:
                raise ValueError(
                    f"backward(): gradient has shape {seed.shape}, tensor has shape {self.shape}"
                )
        LAZY.run([self], loss=self, seed=seed)

    def detach(self) -> Tensor:
        """The same value (computed now, sharing memory, on the same device), cut from the
        gradient history."""
        if self._value is None:
            LAZY.run([self])
        return Tensor._new(
            None, (), (), (), self.shape, self.dtype, self._value, False, self.device
        )

    def requires_grad_(self, flag: bool = True) -> Tensor:
        if not self.is_leaf:
            raise RuntimeError("requires_grad_() works on leaf tensors only")
        if flag and not self.dtype.is_floating:
            raise TypeError("only float tensors (float32, bfloat16, float16) can require gradients")
        self.requires_grad = flag
        self._is_param = flag
        return self

    def to(self, target: str | Device | DType) -> Tensor:
        """This tensor on a device, or cast to a dtype (the same object when it already is).

        ``t.to("vulkan")`` moves the value (a new leaf); ``t.to(recurra.bfloat16)`` (or
        ``recurra.float16``, ``recurra.float32``) is the op ``cast``: float32 -> 2-byte
        floats rounds to nearest even, and its gradient is cast back to this tensor's dtype.
        """
        if not isinstance(target, Device) and is_dtype(target):
            return self._cast(as_dtype(target))
        dev = parse_device(target)
        if dev == self.device:
            return self
        t = _from_host(self._realized(), dev)
        t.requires_grad = self.requires_grad and self.is_leaf
        t._is_param = self._is_param
        return t

    def _cast(self, dtype: DType) -> Tensor:
        from recurra.ops import cast

        out: Tensor = cast(self, dtype)
        return out

    # In-place update of a leaf's data (used by optimizers and users alike).
    def assign_(self, value: Any) -> Tensor:
        """Overwrites this leaf's data in place with ``value`` (same shape)."""
        if not self.is_leaf:
            raise RuntimeError("assign_() works on leaf tensors only")
        want = self.dtype.numpy
        arr = np.asarray(value._realized() if isinstance(value, Tensor) else value, dtype=want)
        if arr.shape != self.shape:
            arr = np.broadcast_to(arr, self.shape)
        if isinstance(self._value, _core.DeviceBuffer):
            self._value.upload(bits_view(np.ascontiguousarray(arr)))
        else:
            self._realized()[...] = arr
        return self


def _wrap_value(value: np.ndarray, requires_grad: bool, device: Device) -> Tensor:
    dtype = as_dtype(value.dtype)
    return Tensor._new(None, (), (), (), tuple(value.shape), dtype, value, requires_grad, device)


def _results(g: Any, items: list[tuple[int, Device]]) -> list[Any]:
    """The values of nodes ``(nid, device)`` after compute, each kept on its device.

    Results computed on their tensor's device are copied out of the graph's arena together
    (one submission and one wait per device, not one per tensor); a result with memory of
    its own (a parameter's gradient, FLAG_OWN_MEMORY) is handed over instead of copied."""
    out: list[Any] = [None] * len(items)
    on_device: list[int] = []
    first: dict[int, int] = {}  # node -> the first item that took it (later ones copy)
    for k, (nid, device) in enumerate(items):
        if device.backend == "cpu":
            out[k] = g.take(nid) if first.setdefault(nid, k) == k else out[first[nid]].copy()
        elif g.backend_of(nid) == str(device):
            on_device.append(k)
        else:  # computed elsewhere (CPU fallback): move it to the tensor's device
            host = g.read(nid)
            buf = _core.DeviceBuffer(str(device), max(host.nbytes, 4))
            buf.upload(bits_view(host))
            out[k] = buf
    if on_device:
        bufs = g.take_buffers([items[k][0] for k in on_device])
        for k, buf in zip(on_device, bufs):
            out[k] = buf
    return out


def tensor(data: Any, device: str | Device | None = None, dtype: Any = None) -> Tensor:
    """A tensor holding a copy of ``data`` (array-like; float -> float32, int -> int32;
    numpy float16 and ml_dtypes.bfloat16 arrays keep their dtype). ``dtype`` (a recurra
    dtype, its name or a numpy dtype) converts first (to 2-byte floats: round to nearest
    even).

    Raises TypeError for unsupported dtypes and ValueError for more than 4 axes or an
    unknown device.
    """
    dev = parse_device(device)
    if isinstance(data, Tensor):
        data = data._realized()
    if dtype is not None and is_dtype(dtype):
        dtype = as_dtype(dtype).numpy
    arr = np.asarray(data, dtype=dtype) if dtype is not None else np.asarray(data)
    if arr.dtype.kind not in "fiub" and arr.dtype != as_dtype("bfloat16").numpy:
        raise TypeError(
            f"unsupported dtype {arr.dtype}: recurra tensors are float32, bfloat16, float16 "
            "or int32"
        )
    return _from_host(to_supported(arr), dev)


def _from_host(arr: np.ndarray, dev: Device) -> Tensor:
    """A leaf holding a copy of host array ``arr`` on device ``dev``."""
    if dev.backend == "cpu":
        value = _host_array(arr.shape, arr.dtype)
        value[...] = arr
        return _wrap_value(value, False, dev)
    buf = _core.DeviceBuffer(str(dev), max(arr.nbytes, 4))
    buf.upload(bits_view(np.ascontiguousarray(arr)))
    dtype = as_dtype(arr.dtype)
    return Tensor._new(None, (), (), (), tuple(arr.shape), dtype, buf, False, dev)


def param(data: Any, device: str | Device | None = None, dtype: Any = None) -> Tensor:
    """A trainable tensor (a leaf that receives ``.grad`` from ``backward()``), float32
    unless ``dtype`` says bfloat16 or float16 (its gradient then has that dtype too)."""
    dt = as_dtype(dtype) if dtype is not None else as_dtype("float32")
    if not dt.is_floating:
        raise TypeError(f"param: parameters are float tensors, not {dt}")
    t = tensor(data, device=device, dtype=dt)
    t.requires_grad = True
    t._is_param = True
    return t


class GradientListener(Protocol):
    """Told by every backward that computes gradients of some of its ``params`` when each
    group of them is final, while the rest of the backward still runs (registered with
    :func:`add_gradient_listener`; recurra_dist starts the exchange of a bucket of gradients
    there). Gradients of the last layers are computed first, so a group of them completes
    early.

    ``begin(present)``: before the computation; ``present[i]``: whether this backward
    computes a gradient for ``params[i]``. A false result: the listener sits this one out.
    ``ready(k, read)``: every gradient of ``params[i]``, ``i`` in ``groups[k]``, is final;
    ``read(i, out)`` copies this backward's gradient of ``params[i]`` (not yet added to
    ``params[i].grad``) into the C-contiguous array ``out`` of its dtype and size;
    ``read([i, j, ...], out)`` those of several parameters one after the other (on a
    device: packed there, one download). It must not compute tensors.
    Groups are reported in the order they complete. ``end()``: the gradients are in ``.grad``.
    On a device with asynchronous reads (``recurra._core.has_async_reads``) the backward is
    submitted whole, each part copying the groups it completes to host-visible memory, and
    the groups are reported while the device runs: ``read`` waits for its group's copy only.
    There, an optional ``target(k)`` (called after ``begin``) may name host-visible memory
    (a ``DeviceBuffer`` of the device, or None) that group k is copied into on the device,
    packed as ``read(groups[k], out)`` lays it out (used only where this backward computes
    every gradient of the group): ``read(groups[k], out)`` with ``out`` that memory then
    copies nothing.
    """

    params: list[Tensor]
    groups: list[list[int]]

    def begin(self, present: list[bool]) -> bool: ...
    def ready(self, k: int, read: Callable[[int | list[int], np.ndarray], None]) -> None: ...
    def end(self) -> None: ...


_LISTENERS: list[weakref.ref[Any]] = []


def add_gradient_listener(listener: GradientListener) -> None:
    """Registers ``listener`` (held weakly: it ends with its owner) for every backward."""
    remove_gradient_listener(listener)
    _LISTENERS.append(weakref.ref(listener))


def remove_gradient_listener(listener: GradientListener) -> None:
    """Forgets ``listener`` (and any listener already gone)."""
    _LISTENERS[:] = [r for r in _LISTENERS if r() is not None and r() is not listener]


def _listening(plan: _Plan, params: list[Tensor]) -> list[tuple[Any, list[int]]]:
    """The listeners interested in this backward, each with the gradient node of each of
    its parameters (-1: none in this backward)."""
    gid_of = {id(p): gid for gid, p in zip(plan.grad_ids, params) if gid >= 0}
    out = []
    for ref in list(_LISTENERS):
        lst = ref()
        if lst is None:
            continue
        gids = [gid_of.get(id(p), -1) for p in lst.params]
        if any(gid >= 0 for gid in gids) and lst.begin([gid >= 0 for gid in gids]):
            out.append((lst, gids))
    return out


def _compute_reporting(g: Any, listening: list[tuple[Any, list[int]]]) -> None:
    """``g.compute()``, telling each listener when each of its groups is final."""
    node_groups: list[list[int]] = []
    owner: list[tuple[Any, int, list[int]]] = []
    targets: list[Any] = []
    for lst, gids in listening:
        target: Callable[[int], Any] | None = getattr(lst, "target", None)
        for k, group in enumerate(lst.groups):
            node_groups.append([gids[i] for i in group if gids[i] >= 0])
            owner.append((lst, k, gids))
            whole = all(gids[i] >= 0 for i in group)
            targets.append(target(k) if target is not None and whole else None)

    def ready(j: int) -> None:
        lst, k, gids = owner[j]

        def read(which: int | list[int], out: np.ndarray) -> None:
            idx = [which] if isinstance(which, int) else list(which)
            missing = [i for i in idx if gids[i] < 0]
            if missing:
                raise ValueError(f"this backward computes no gradient for parameter {missing[0]}")
            if isinstance(which, int):
                g.read_into(gids[which], out)
            else:
                g.read_packed([gids[i] for i in idx], out)

        lst.ready(k, read)

    if any(t is not None for t in targets):
        g.compute_reporting(node_groups, ready, targets)
    else:
        g.compute_reporting(node_groups, ready)


class _Plan:
    __slots__ = ("graph", "leaf_ids", "out_ids", "grad_ids", "loss_id")

    def __init__(self) -> None:
        self.graph = _core.Graph()
        self.leaf_ids: list[int] = []
        self.out_ids: list[int] = []
        self.grad_ids: list[int] = []
        self.loss_id = -1


#: device constants of at most this many bytes are kept by value (LazyFrontend.constant)
_SMALL_BYTES = 256
_SMALL_KEPT = 256


class LazyFrontend:
    """Builds, caches and runs the native graphs behind lazy tensors."""

    def __init__(self, max_plans: int = 64) -> None:
        self._plans: OrderedDict[Any, _Plan] = OrderedDict()
        self.max_plans = max_plans
        self.hits = 0
        self.misses = 0
        self._lock = threading.RLock()
        self._small: OrderedDict[Any, Tensor] = OrderedDict()  # see constant()

    # -- recording ---------------------------------------------------------------------
    def constant(self, arr: np.ndarray, device: Device | None = None) -> Tensor:
        """A leaf holding ``arr`` (on the host, or copied to ``device``).

        A small constant on a device (a Python number, an index array of a few elements) is
        uploaded once and kept (the last ``_SMALL_KEPT`` of them, by value): a training step
        that makes the same constants again then names the same buffers, and the device
        replays its recording instead of recording it again. Nothing writes into a constant.
        """
        if device is not None and device.backend != "cpu":
            if arr.nbytes > _SMALL_BYTES:
                return _from_host(arr, device)
            key = (str(device), arr.dtype.str, arr.shape, arr.tobytes())
            with self._lock:
                t = self._small.get(key)
                buf = t._value if t is not None else None
                if t is None or not isinstance(buf, _core.DeviceBuffer) or not buf.valid:
                    t = self._small[key] = _from_host(arr, device)
                    if len(self._small) > _SMALL_KEPT:
                        self._small.popitem(last=False)
                else:
                    self._small.move_to_end(key)
            return t
        return _wrap_value(arr, False, parse_device(None))

    def apply(
        self, name: str, srcs: list[Tensor], ip: tuple[int, ...], fp: tuple[float, ...]
    ) -> Tensor:
        rg = False
        if srcs:
            dev = srcs[0].device
            for s in srcs:
                if s.device is not dev and s.device != dev:
                    raise ValueError(
                        f"{name}: inputs are on different devices ({dev} and {s.device})"
                    )
                rg = rg or s.requires_grad
        else:
            dev = parse_device(None)
        dtype, shape = _core.infer(name, [(s.dtype, s.shape) for s in srcs], ip, fp)
        rg = rg and is_grad_enabled()
        t = Tensor._new(name, tuple(srcs), ip, fp, shape, dtype, None, rg, dev)
        t._seg = _state.segment
        return t

    # -- running -----------------------------------------------------------------------
    def run(
        self, outputs: list[Tensor], loss: Tensor | None = None, seed: Tensor | None = None
    ) -> None:
        """Computes ``outputs`` (and, with ``loss``, the gradients of its parameters)."""
        with self._lock:
            self._run(outputs, loss, seed)

    def _run(self, outputs: list[Tensor], loss: Tensor | None, seed: Tensor | None) -> None:
        plan, leaves = self._prepare(outputs, loss, seed)
        self._execute(plan, leaves, outputs, loss is not None)

    def _prepare(
        self, outputs: list[Tensor], loss: Tensor | None, seed: Tensor | None
    ) -> tuple[_Plan, list[Tensor]]:
        """The plan that computes ``outputs`` (and the gradients of ``loss``), from the
        cache or built now, and the tensors to bind to its leaves, in order."""
        want_grad = loss is not None
        roots = list(outputs) + ([seed] if seed is not None else [])
        order: list[Tensor] = []
        index: dict[int, int] = {}

        def expand(t: Tensor) -> bool:
            if t._op is None:
                return False
            if want_grad and t.requires_grad:
                return True
            return t._value is None

        # Iterative post-order DFS (graphs can be deep). expanded[i]: whether order[i] is an
        # op node of the plan (else a leaf: a tensor whose value is bound).
        expanded: list[bool] = []
        for root in roots:
            if id(root) in index:
                continue
            stack: list[tuple[Tensor, bool]] = [(root, False)]
            while stack:
                t, done = stack.pop()
                tid = id(t)
                if tid in index:
                    continue
                if done or not expand(t):
                    index[tid] = len(order)
                    order.append(t)
                    expanded.append(done)
                    continue
                stack.append((t, True))
                for s in reversed(t._src):
                    if id(s) not in index:
                        stack.append((s, False))

        key_parts: list[Any] = []
        leaves: list[Tensor] = []
        # Recomputation segments matter to the backward only; numbered in order of
        # appearance so that each step's fresh ids give the same key.
        segs: dict[int, int] = {0: 0}
        for t, op in zip(order, expanded):
            if op:
                seg = segs.setdefault(t._seg, len(segs)) if want_grad else 0
                key_parts.append((t._op, t._ip, t._fp, tuple([index[id(s)] for s in t._src]), seg))
            else:
                is_param = want_grad and t.requires_grad
                key_parts.append(("leaf", t.dtype, t.shape, is_param))
                leaves.append(t)
        out_pos = tuple(index[id(t)] for t in outputs)
        loss_pos = index[id(loss)] if loss is not None else -1
        seed_pos = index[id(seed)] if seed is not None else -1
        by_id = {id(t.device): t.device for t in order}  # few distinct Device objects
        devices = tuple(sorted({str(d) for d in by_id.values()}))
        key = (tuple(key_parts), out_pos, loss_pos, seed_pos, devices, strict_placement())

        plan = self._plans.get(key)
        if plan is None:
            self.misses += 1
            plan = self._build(order, expand, index, outputs, loss, seed)
            self._plans[key] = plan
            if len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
        else:
            self.hits += 1
            self._plans.move_to_end(key)
        return plan, leaves

    def _execute(
        self, plan: _Plan, leaves: list[Tensor], outputs: list[Tensor], want_grad: bool
    ) -> None:
        """Binds ``leaves`` to ``plan``'s leaves, computes it, stores the values of
        ``outputs`` in them and (``want_grad``) accumulates the gradients into ``.grad`` of
        the leaves that require one."""
        g = plan.graph
        for nid, t in zip(plan.leaf_ids, leaves):
            if t._value is None:
                t._realized()
            value = t._value
            if isinstance(value, _core.DeviceBuffer):
                g.bind_device(nid, value)
            else:
                assert value is not None  # computed just above
                g.bind(nid, bits_view(value))
        params = [t for t in leaves if t.requires_grad] if want_grad else []
        listening = _listening(plan, params) if want_grad and _LISTENERS else []
        if listening:
            _compute_reporting(g, listening)
        else:
            g.compute()
        graded = [(gid, p) for gid, p in zip(plan.grad_ids, params) if gid >= 0]
        values = _results(
            g,
            [(nid, t.device) for nid, t in zip(plan.out_ids, outputs)]
            + [(gid, p.device) for gid, p in graded],
        )
        for t, v in zip(outputs, values):
            t._value = v
        if want_grad:
            for (_, p), gval in zip(graded, values[len(outputs) :]):
                if p.grad is None:
                    p.grad = Tensor._new(None, (), (), (), p.shape, p.dtype, gval, False, p.device)
                else:
                    p.grad = (
                        p.grad
                        + Tensor._new(None, (), (), (), p.shape, p.dtype, gval, False, p.device)
                    ).detach()
            # Results of this run that nobody asked for stay pending: recomputing is cheap
            # and keeping them would pin memory.
            for lst, _ in listening:
                lst.end()

    def _build(
        self,
        order: list[Tensor],
        expand: Any,
        index: dict[int, int],
        outputs: list[Tensor],
        loss: Tensor | None,
        seed: Tensor | None,
    ) -> _Plan:
        plan = _Plan()
        g = plan.graph
        devices = sorted({str(t.device) for t in order if t.device.backend != "cpu"})
        if devices:
            g.set_backends(devices, strict=strict_placement())
        ids: list[int] = []
        want_grad = loss is not None
        seg = 0
        segs: dict[int, int] = {0: 0}  # numbered as in the plan key
        for t in order:
            if expand(t):
                if want_grad and t._seg != seg:
                    seg = t._seg
                    g.set_segment(segs.setdefault(seg, len(segs)))
                assert t._op is not None  # expand() is True for op nodes only
                nid = g.op(t._op, [ids[index[id(s)]] for s in t._src], list(t._ip), list(t._fp))
            else:
                flags = _core.FLAG_INPUT
                if want_grad and t.requires_grad:
                    flags = _core.FLAG_PARAM
                nid = g.leaf(t.dtype, list(t.shape), flags)
                plan.leaf_ids.append(nid)
            ids.append(nid)
        g.set_segment(0)
        for t in outputs:
            g.set_flags(ids[index[id(t)]], _core.FLAG_OUTPUT)
        plan.out_ids = [ids[index[id(t)]] for t in outputs]
        if loss is not None:
            plan.loss_id = ids[index[id(loss)]]
            seed_id = ids[index[id(seed)]] if seed is not None else -1
            g.build_backward(plan.loss_id, seed_id)
            for t in order:
                if not expand(t) and t.requires_grad:
                    plan.grad_ids.append(g.grad(ids[index[id(t)]]))
        # Planned at the first compute, once the leaves are bound: planned now, every device
        # leaf would count as host memory and be mirrored into the device arena.
        return plan

    def cache_info(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "plans": len(self._plans)}

    def clear(self) -> None:
        self._plans.clear()


LAZY = LazyFrontend()
_apply.LAZY_TENSOR, _apply.LAZY_FRONTEND = Tensor, LAZY


def plan_cache_info() -> dict[str, int]:
    """Counts of graph runs that reused a cached plan (hits) and that planned (misses)."""
    return LAZY.cache_info()

"""The graph API: an explicit graph, built, differentiated and run step by step (like ggml).

    g = recurra.Graph()
    x = g.input((4, 8), name="x")           # fed with set_data before each compute
    w = g.param((8, 2), name="w")           # trainable: gets a gradient
    loss = recurra.ops.mean(recurra.ops.sqr(x @ w))
    g.build_backward(loss)                  # appends the gradient nodes
    g.set_data(x, xs); g.set_data(w, ws)
    g.compute()
    loss.numpy(), w.grad.numpy()

The same graph can be computed again after new set_data calls; its memory plan is kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from recurra import _core
from recurra._dtype import as_dtype, bits_view
from recurra._tensorbase import TensorOps
from recurra.ops._apply import to_supported


class GraphTensor(TensorOps):
    """A node of a :class:`Graph`."""

    __slots__ = ("graph", "id", "shape", "dtype", "name")

    def __init__(
        self, graph: Graph, node_id: int, shape: tuple[int, ...], dtype: str, name: str = ""
    ) -> None:
        self.graph = graph
        self.id = node_id
        self.shape = shape
        self.dtype = as_dtype(dtype)
        self.name = name

    @property
    def _frontend(self) -> Graph:
        return self.graph

    @property
    def op(self) -> str:
        """The op that computes this node (``"leaf"`` for inputs, params and constants)."""
        op: str = self.graph._g.info(self.id)["op"]
        return op

    @property
    def grad(self) -> GraphTensor | None:
        """The gradient node (after :meth:`Graph.build_backward`), or None."""
        return self.graph.grad(self)

    def numpy(self) -> np.ndarray:
        """The value from the last :meth:`Graph.compute` (a copy)."""
        return self.graph.get_data(self)

    def item(self) -> float:
        v = self.numpy()
        if v.size != 1:
            raise ValueError(f"item(): the tensor has {v.size} elements, not 1")
        return float(v.reshape(()).item())

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        v = self.numpy()
        return v.astype(dtype) if dtype is not None else v

    def set_data(self, value: Any) -> None:
        self.graph.set_data(self, value)

    def __repr__(self) -> str:
        nm = f" '{self.name}'" if self.name else ""
        return f"GraphTensor#{self.id}{nm}(op={self.op}, shape={self.shape}, dtype={self.dtype})"


class Graph:
    """An explicit computation graph, run by the scheduler.

    ``backends`` lists device backends to prefer, in order (e.g. ``["vulkan"]``); each node
    runs on the first one that supports it and on the CPU otherwise. With ``strict=True`` a
    node that no listed backend supports raises RuntimeError instead of falling back.
    """

    def __init__(self, backends: list[str] | None = None, strict: bool = False) -> None:
        self._g = _core.Graph()
        self._computed = False
        self._segments = 0  # recomputation segments made so far
        #: the devices its nodes are placed on first (empty: the CPU alone)
        self.backends: tuple[str, ...] = ()
        if backends:
            from recurra._devices import parse_device

            self.backends = tuple(str(parse_device(b)) for b in backends)
            self._g.set_backends(list(self.backends), strict)

    # -- leaves ------------------------------------------------------------------------
    def _leaf(self, shape: Any, dtype: str, flags: int, name: str) -> GraphTensor:
        shape = (
            (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        )
        dtype = as_dtype(dtype)
        nid = self._g.leaf(dtype, list(shape), flags, name)
        return GraphTensor(self, nid, shape, dtype, name)

    def input(self, shape: Any, dtype: str = "float32", name: str = "") -> GraphTensor:
        """A leaf fed from outside with :meth:`set_data` (does not pin anything anywhere)."""
        return self._leaf(shape, dtype, _core.FLAG_INPUT, name)

    def tensor(self, shape: Any, dtype: str = "float32", name: str = "") -> GraphTensor:
        """A leaf without flags (ggml's new_tensor); set its data before computing."""
        return self._leaf(shape, dtype, 0, name)

    def param(self, shape: Any, name: str = "") -> GraphTensor:
        """A trainable float32 leaf: :meth:`build_backward` gives it a gradient node."""
        return self._leaf(shape, "float32", _core.FLAG_PARAM, name)

    def constant(self, value: Any) -> GraphTensor:
        """A leaf holding a copy of ``value``."""
        arr = to_supported(np.array(value))
        dtype = as_dtype(arr.dtype)
        # its data is private to the graph: a device copy of it is made once, not per compute
        t = self._leaf(arr.shape, dtype, _core.FLAG_CONST, "")
        self._g.bind(t.id, bits_view(arr))
        return t

    # -- frontend protocol (used by recurra.ops) --------------------------------------------
    def apply(
        self, name: str, srcs: list[GraphTensor], ip: tuple[int, ...], fp: tuple[float, ...]
    ) -> GraphTensor:
        nid = self._g.op(name, [s.id for s in srcs], list(ip), list(fp))
        info = self._g.info(nid)
        return GraphTensor(self, nid, tuple(info["shape"]), info["dtype"])

    # -- flags and autodiff ----------------------------------------------------------------
    def set_output(self, t: GraphTensor) -> None:
        """Keeps ``t``'s value readable after compute (its memory is not reused)."""
        self._check(t)
        self._g.set_flags(t.id, _core.FLAG_OUTPUT)

    def set_loss(self, t: GraphTensor) -> None:
        """Marks ``t`` as the loss (also an output)."""
        self._check(t)
        self._g.set_flags(t.id, _core.FLAG_LOSS | _core.FLAG_OUTPUT)

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """Context manager: the op nodes built inside form a recomputation segment; their
        forward runs again right before their gradient nodes instead of being kept (see
        :func:`recurra.recompute`). Entered inside another, it joins the outer one."""
        prev = self._g.segment()
        if not prev:
            self._segments += 1
            self._g.set_segment(self._segments)
        try:
            yield
        finally:
            self._g.set_segment(prev)

    def build_backward(self, loss: GraphTensor, gradient: GraphTensor | None = None) -> None:
        """Appends the gradient graph of ``loss`` (a scalar, or pass ``gradient``)."""
        self._check(loss)
        self._g.build_backward(loss.id, gradient.id if gradient is not None else -1)

    def grad(self, t: GraphTensor) -> GraphTensor | None:
        """The node holding d(loss)/d(t), or None when no gradient was built for ``t``."""
        self._check(t)
        gid = self._g.grad(t.id)
        if gid < 0:
            return None
        info = self._g.info(gid)
        return GraphTensor(self, gid, tuple(info["shape"]), info["dtype"])

    # -- data and running --------------------------------------------------------------
    def set_data(self, t: GraphTensor, value: Any) -> None:
        """Copies ``value`` (same number of elements) into leaf ``t``."""
        self._check(t)
        arr = np.array(value, dtype=as_dtype(t.dtype).numpy, copy=True, order="C")
        if arr.size != t.size:
            raise ValueError(
                f"set_data: {t!r} has shape {t.shape} ({t.size} elements), got {arr.size}"
            )
        self._g.bind(t.id, bits_view(arr.reshape(t.shape)))

    def compute(self) -> None:
        """Runs the whole graph on the CPU. Raises RuntimeError if a leaf has no data."""
        self._g.compute()
        self._computed = True

    def get_data(self, t: GraphTensor) -> np.ndarray:
        """A copy of ``t``'s value after :meth:`compute`."""
        self._check(t)
        if not self._computed and t.op != "leaf":
            raise RuntimeError(f"get_data: the graph has not been computed yet ({t!r})")
        return self._g.read(t.id)

    def backend_of(self, t: GraphTensor) -> str:
        """The backend that computes ``t`` (or holds it, for leaves and views): ``"cpu"``,
        ``"vulkan:0"``, ..."""
        self._check(t)
        return self._g.backend_of(t.id)

    @property
    def n_splits(self) -> int:
        """The number of consecutive runs of nodes on one backend."""
        return self._g.n_splits()

    def splits(self) -> list[tuple[str, int, int]]:
        """Per split: (backend, number of nodes, number of tensors copied in)."""
        return [(str(b), int(n), int(m)) for b, n, m in self._g.splits()]

    def placement(self) -> dict[str, int]:
        """How many computed nodes each backend runs."""
        out: dict[str, int] = {}
        for b, n, _ in self.splits():
            out[b] = out.get(b, 0) + n
        return out

    def memory(self) -> dict[str, Any]:
        """The memory plan: ``arena_bytes`` (what the arenas take), ``unplanned_bytes`` (the
        same intermediates without reuse), ``n_planned`` (planned nodes), ``segments`` (the
        bytes of each arena segment per backend: a device's arena is split into buffers no
        larger than its largest allocation), ``peak_live_bytes`` (the most bytes alive at
        once: arena_bytes less fragmentation) and ``live_at_peak`` (``(op, bytes)`` pairs,
        largest first: which ops made what is alive then - where to look to save memory),
        ``own_bytes`` (parameters' gradients: memory of their own, outside the arenas, handed
        over as ``.grad``), ``n_in_place``/``in_place_bytes`` (nodes that write over a source
        dying there: elementwise ones, and on the CPU cross_entropy_back over its logits;
        and the bytes that saved), ``n_redirected`` (pieces of packed CPU results written
        straight into their window of a merged gradient scatter), ``n_folded_casts`` (casts
        of float32 gradients to a 2-byte dtype not run on a device: the assign or add reading
        them rounds their float32 sources itself), ``n_widened_products`` (casts to float32 of
        a 2-byte product run on a device as that product writing float32: a weight's gradient
        under autocast, not rounded to the 2-byte type first); ``live_nodes_at_peak`` lists
        the nodes alive at the peak, ``(id, op, dtype, shape, bytes, made by the forward)``,
        and ``peak_node`` is the node at which the peak is reached."""
        return dict(self._g.plan())

    @property
    def n_nodes(self) -> int:
        return len(self._g)

    def _check(self, t: Any) -> None:
        if not isinstance(t, GraphTensor) or t.graph is not self:
            raise ValueError(f"{t!r} is not a tensor of this graph")

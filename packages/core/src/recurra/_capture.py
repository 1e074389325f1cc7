"""Step capture: run a function's graph again from its plan, without running its Python.

Every call of a model's loss records its ops again (thousands of lazy nodes) and the lazy
frontend then walks them only to find the plan it has cached. :func:`capture` skips both:
the first call of the function for a given *signature* traces it as usual and remembers
which leaves of the resulting plan are the arguments and which are other tensors
(parameters, constants made while tracing); a later call with the same signature binds the
new arguments and the current values of those other tensors and computes the cached plan
directly. This is the model of ``jax.jit`` and of CUDA graphs, with their rule:

**The function must build the same graph for the same signature.** Whatever it decides on
the host while tracing (Python numbers, numpy constants, branches on shapes or flags, the
values it reads with ``item()``) is frozen into the capture. Tensors other than the arguments
are bound by object: a parameter changed in place (``assign_``, an optimizer step) is seen
by the next call; a parameter replaced by a new tensor object is not (pass ``params`` to
have that checked).

The signature of a call is: the shape, dtype, device and ``requires_grad`` of every tensor
argument (and which arguments are the same tensor), the other arguments' values (they must
be hashable), the grad mode, the autocast dtype, strict placement, whether the call is
inside a ``recompute()`` block, and ``key()`` when given.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from recurra import _autocast
from recurra._devices import Device, parse_device
from recurra._tensor import (
    LAZY,
    Tensor,
    _Plan,
    _state,
    is_grad_enabled,
    strict_placement,
    tensor,
)

__all__ = ["Captured", "CaptureError", "capture"]


class CaptureError(RuntimeError):
    """A function that cannot be captured (it computes values while tracing, or copies an
    argument instead of reading it)."""


_ARG = object()  # marks a leaf bound to an argument


def _flatten(tree: Any, out: list[Tensor]) -> Any:
    """The structure of ``tree`` (tensors, tuples, lists, dicts, other values) with each
    tensor replaced by its index in ``out`` (appended)."""
    if isinstance(tree, Tensor):
        out.append(tree)
        return ("T", len(out) - 1)
    if isinstance(tree, (tuple, list)):
        return (type(tree), [_flatten(v, out) for v in tree])
    if isinstance(tree, dict):
        return (dict, [(k, _flatten(v, out)) for k, v in tree.items()])
    return ("V", tree)


def _unflatten(spec: Any, values: list[Tensor]) -> Any:
    kind, body = spec
    if kind == "T":
        return values[body]
    if kind == "V":
        return body
    if kind is dict:
        return {k: _unflatten(v, values) for k, v in body}
    return kind(_unflatten(v, values) for v in body)


def _leaf_of(t: Tensor) -> Tensor:
    """A leaf holding ``t``'s value (``t`` itself when it is a computed leaf)."""
    if t._op is None and t._value is not None:
        return t
    return t.detach()


class _Trace:
    """One captured signature: the plan, what binds each of its leaves, the outputs."""

    __slots__ = ("plan", "sources", "arg_pos", "bound", "params", "outs", "spec", "want_grad")

    def __init__(
        self,
        plan: _Plan,
        leaves: list[Tensor],
        arg_index: dict[int, int],
        outs: list[Tensor],
        spec: Any,
        want_grad: bool,
    ) -> None:
        self.plan = plan
        self.want_grad = want_grad
        # sources[i]: the tensor bound to leaf i, or _ARG (then arg_pos[i] is the argument)
        self.sources: list[Any] = []
        self.arg_pos: list[int] = []
        for t in leaves:
            k = arg_index.get(id(t), -1)
            self.sources.append(_ARG if k >= 0 else t)
            self.arg_pos.append(k)
        # the other tensors, with what the plan assumed of them
        self.bound = [(t, t.requires_grad, t.shape) for t in leaves if id(t) not in arg_index]
        self.params = [t for t, rg, _ in self.bound if rg]
        self.outs = [(t.shape, t.dtype, t.device) for t in outs]
        self.spec = spec

    def stale(self, params: Any) -> str | None:
        """Why this trace no longer matches the tensors it binds (None: it does)."""
        for t, rg, shape in self.bound:
            if t.requires_grad != rg:
                return "a captured tensor's requires_grad changed"
            if t.shape != shape:
                return "a captured tensor's shape changed"
        if params is not None:
            current = {id(p) for p in (params() if callable(params) else params)}
            if any(id(p) not in current for p in self.params):
                return "a parameter was replaced by another tensor"
        return None

    def replay(self, args: list[Tensor]) -> Any:
        leaves = [args[k] if s is _ARG else s for s, k in zip(self.sources, self.arg_pos)]
        outs = [Tensor._new(None, (), (), (), s, dt, None, False, d) for s, dt, d in self.outs]
        with LAZY._lock:
            LAZY._execute(self.plan, leaves, outs, self.want_grad)
        return _unflatten(self.spec, outs)


class Captured:
    """A function captured by :func:`capture`: call it like the function.

    ``traces`` and ``replays`` count the calls that traced and the calls that ran a
    captured plan; ``retraces`` the traces dropped because a tensor they bind changed
    (see ``params``).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        backward: bool,
        params: Callable[[], Iterable[Tensor]] | Iterable[Tensor] | None,
        key: Callable[[], Any] | None,
        device: str | Device | None,
        max_traces: int,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"capture: expected a function, got {type(fn).__name__}")
        if max_traces < 1:
            raise ValueError(f"capture: max_traces must be >= 1, got {max_traces}")
        self.fn = fn
        self.backward = bool(backward)
        self.params = params
        self.key = key
        self.device = parse_device(device)
        self.max_traces = int(max_traces)
        self._traces: OrderedDict[Any, _Trace] = OrderedDict()
        self._lock = threading.RLock()
        self.traces = 0
        self.replays = 0
        self.retraces = 0
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def clear(self) -> None:
        """Forgets every captured signature (the next calls trace again)."""
        with self._lock:
            self._traces.clear()

    def _signature(self, args: list[Any]) -> tuple[Any, ...]:
        seen: dict[int, int] = {}
        sig: list[Any] = []
        for k, a in enumerate(args):
            if isinstance(a, Tensor):
                first = seen.setdefault(id(a), k)
                sig.append((a.shape, str(a.dtype), str(a.device), a.requires_grad, first))
            else:
                try:
                    hash(a)
                except TypeError:
                    raise TypeError(
                        f"capture: argument {k} ({type(a).__name__}) is neither a tensor, a "
                        "numpy array nor a hashable value"
                    ) from None
                sig.append(("V", type(a), a))
        return (
            tuple(sig),
            is_grad_enabled(),
            str(_autocast.STATE.dtype),
            strict_placement(),
            bool(_state.segment),
            self.key() if self.key is not None else None,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        names = tuple(kwargs)
        flat = [
            tensor(a, device=self.device) if isinstance(a, np.ndarray) else a
            for a in (*args, *kwargs.values())
        ]
        flat = [_leaf_of(a) if isinstance(a, Tensor) else a for a in flat]
        if self.backward and not is_grad_enabled():
            raise RuntimeError("capture(backward=True): called under no_grad()")
        sig = (names, self._signature(flat))
        with self._lock:
            trace = self._traces.get(sig)
            if trace is not None:
                why = trace.stale(self.params)
                if why is None:
                    self._traces.move_to_end(sig)
                    self.replays += 1
                    return trace.replay(flat)
                del self._traces[sig]
                self.retraces += 1
            trace, result = self._trace(flat, len(args), names)
            self._traces[sig] = trace
            if len(self._traces) > self.max_traces:
                self._traces.popitem(last=False)
            self.traces += 1
            return result

    def _trace(self, flat: list[Any], n_pos: int, names: tuple[str, ...]) -> tuple[_Trace, Any]:
        runs = LAZY.hits + LAZY.misses
        out = self.fn(*flat[:n_pos], **dict(zip(names, flat[n_pos:])))
        if LAZY.hits + LAZY.misses != runs:
            raise CaptureError(
                "capture: the function computed values while it was traced (item(), numpy(), "
                "backward() or printing a tensor inside it): what it read would be frozen "
                "into the capture; call it uncaptured"
            )
        outs: list[Tensor] = []
        spec = _flatten(out, outs)
        if not outs:
            raise CaptureError("capture: the function returned no tensor")
        loss = None
        if self.backward:
            loss = outs[0]
            if loss.size != 1 or not loss.requires_grad:
                raise CaptureError(
                    "capture(backward=True): the function's result (or its first tensor) must "
                    f"be a one-element tensor that requires grad; got shape {loss.shape}, "
                    f"requires_grad={loss.requires_grad}"
                )
        arg_index = {id(a): k for k, a in enumerate(flat) if isinstance(a, Tensor)}
        with LAZY._lock:
            plan, leaves = LAZY._prepare(outs, loss, None)
            leaf_ids = {id(t) for t in leaves}
            for k, a in enumerate(flat):
                if isinstance(a, Tensor) and id(a) not in leaf_ids:
                    raise CaptureError(
                        f"capture: argument {k} does not reach the graph as it is (the function "
                        "does not use it, or copies it, e.g. with .to(device)): a replay would "
                        "reuse the traced copy. Pass it on the device the function uses"
                    )
            LAZY._execute(plan, leaves, outs, loss is not None)
        trace = _Trace(plan, leaves, arg_index, outs, spec, loss is not None)
        result = _unflatten(spec, [_leaf_of(t) for t in outs])
        return trace, result


def capture(
    fn: Callable[..., Any] | None = None,
    *,
    backward: bool = False,
    params: Callable[[], Iterable[Tensor]] | Iterable[Tensor] | None = None,
    key: Callable[[], Any] | None = None,
    device: str | Device | None = None,
    max_traces: int = 8,
) -> Any:
    """Captures ``fn`` (a function of tensors returning tensors) so that later calls run its
    graph from the cached plan instead of running its Python again.

    ::

        step = recurra.capture(model.loss, backward=True, params=model.parameters)
        for x, y in batches:
            loss = step(x, y)            # forward + backward: gradients are in p.grad
            opt.step(); opt.zero_grad()

    The first call for a signature traces ``fn`` normally; later calls with that signature
    bind the new arguments and the current values of every other tensor the graph reads
    (parameters updated in place by an optimizer are seen) and compute the plan directly.
    Results are the same bits as calling ``fn`` (and ``backward()``) uncaptured. See the
    module :mod:`recurra._capture` for the rule: ``fn`` must build the same graph for the
    same signature (host-side values are frozen at the trace).

    Args:
        fn: the function; it returns a tensor, or tuples/lists/dicts of tensors (other
            values in them are returned as traced). It must not compute values while it
            runs (``item()``, ``numpy()``): that raises :class:`CaptureError`.
        backward: False: the call computes the results. True: the call is a training
            step: ``fn``'s result (or its first tensor) is the loss, and the one graph
            computes the results and the gradients of the loss, which accumulate into
            ``.grad`` of the parameters exactly as ``loss.backward()`` does.
        params: the tensors that must be the parameters (an iterable, or a function
            returning one, e.g. ``model.parameters``); checked at every call: a captured
            parameter that is no longer among them (replaced by a new tensor object)
            makes the call trace again.
        key: a function whose (hashable) value is part of the signature: settings of the
            host side that change the graph (a model's flags).
        device: where numpy array arguments are put (default: the CPU).
        max_traces: how many signatures are kept (least recently used dropped).

    Results are computed tensors without gradient history (``backward()`` on them raises;
    with ``backward=True`` it has run). Arguments enter as values: a pending or non-leaf
    tensor argument is computed and detached first; numpy arrays become tensors on
    ``device``; other arguments must be hashable and are part of the signature.
    Usable as a decorator: ``@recurra.capture(backward=True)``.
    """
    if fn is None:
        return lambda f: Captured(f, backward, params, key, device, max_traces)
    return Captured(fn, backward, params, key, device, max_traces)

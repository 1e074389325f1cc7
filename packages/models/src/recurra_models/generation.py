"""Text generation: prompt prefill through the parallel path, then the recurrent step mode
(one token per step, O(1) state), with greedy / temperature / top-k / top-p sampling."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

import recurra as rc
from recurra_models import lm
from recurra_models.lm import State, realize

__all__ = ["StepGraph", "generate", "sample_token", "stream"]


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (
        not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 1
    ):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def sample_token(
    logits: np.ndarray,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    rng: np.random.Generator | None = None,
) -> int:
    """One token id drawn from a row of logits (V,).

    ``temperature == 0`` is greedy (the first maximum); otherwise the logits are divided by
    the temperature, cut to the ``top_k`` largest and to the smallest set whose probability
    reaches ``top_p`` (nucleus), and a token is drawn with ``rng``.
    Returns an int. Raises ValueError for bad settings or logits that are not 1-D and
    finite somewhere."""
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:  # greedy: a finite first maximum is the answer (no float64 copy)
        raw = np.asarray(logits).reshape(-1)
        if raw.size and raw.dtype.kind == "f":
            i = int(np.argmax(raw))  # a NaN or an infinity there: the full checks below
            if np.isfinite(raw[i]):
                return i
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    if x.size == 0 or not np.isfinite(x).any():
        raise ValueError("sample_token: the logits are empty or all non-finite")
    x = np.where(np.isnan(x), -np.inf, x)
    if temperature == 0:
        return int(np.argmax(x))
    rng = rng if rng is not None else np.random.default_rng()
    x = x / float(temperature)
    order = np.argsort(-x, kind="stable")  # largest first, ties by index
    if top_k is not None and top_k < x.size:
        order = order[:top_k]
    z = x[order]
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p is not None and top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    cdf = np.cumsum(probs)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(order[min(i, order.size - 1)])


def _prompt(prompt_ids: Any, vocab: int) -> np.ndarray:
    arr = np.asarray(prompt_ids.numpy() if isinstance(prompt_ids, rc.Tensor) else prompt_ids)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise ValueError(f"prompt_ids must be one sequence (1-D), got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("prompt_ids must hold at least one token")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"prompt_ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= vocab:
        raise ValueError(
            f"prompt ids must be in [0, {vocab}), got min {arr.min()}, max {arr.max()}"
        )
    return arr.astype(np.int32)


_VIEW_OPS = {"reshape", "permute", "slice", "broadcast_to", "transpose"}


_TRACE_LOCK = threading.Lock()  # one trace at a time patches rc.ops.ssm_scan, lm's conv hook


@contextmanager
def _scan_state_in_place(g: Any, leaves: list[Any]) -> Iterator[None]:
    """While a CPU step graph that carries its state is traced: an ``ssm_scan`` of one token
    whose state source is one of ``leaves`` becomes a scan that writes the new state into
    that leaf in place (RECURRA_SSM_SCAN_STATE_IN_PLACE) and returns the leaf as the new
    state, which then needs no ``assign``: the largest state of a Mamba-2 step (18.9 MB for
    the 130M preset) is read once and written once per token, not also copied. Any other
    call goes to the op as it is. Likewise the one-token causal conv of such a state is one
    ``conv_step`` node (conv, bias and SiLU, the state shifted in place) instead of a
    concat, the conv, the bias, the SiLU and an ``assign`` of the new state."""
    ids_of = {t.id for t in leaves}
    plain = rc.ops.ssm_scan
    flag = rc.ops.op_codes()["SSM_SCAN_STATE_IN_PLACE"]

    def conv(x: Any, state: Any, weight: Any, bias: Any) -> tuple[Any, Any] | None:
        if not (isinstance(state, rc.GraphTensor) and state.graph is g and state.id in ids_of):
            return None
        srcs = [state, x, weight] + ([] if bias is None else [bias])
        return g.apply("conv_step", srcs, (), ()), state

    def scan(
        s: Any,
        x: Any,
        dt: Any,
        A: Any,
        B: Any,
        C: Any,
        ids: Any,
        *,
        checkpoints: bool | None = None,
    ) -> tuple[Any, Any]:
        mine = isinstance(s, rc.GraphTensor) and s.graph is g and s.id in ids_of
        if not mine or len(x.shape) != 4 or x.shape[1] != 1:
            return plain(s, x, dt, A, B, C, ids, checkpoints=checkpoints)
        if not isinstance(ids, rc.GraphTensor):
            ids = g.constant(np.asarray(ids, np.int32))
        y = g.apply("ssm_scan", [s, x, dt, A, B, C, ids], (flag,), ())
        return y.reshape(*x.shape), s

    with _TRACE_LOCK:
        rc.ops.ssm_scan = scan
        lm._conv_step_hook = conv
        try:
            yield
        finally:
            rc.ops.ssm_scan = plain
            lm._conv_step_hook = None


def _views(g: Any, node: int, base: int) -> bool:
    """Whether graph node ``node`` is ``base`` or a view of it through view ops (then an
    ``assign`` of it into ``base`` would read what it writes)."""
    while node != base:
        info = g._g.info(node)
        if not (info["is_view"] or info["op"] in _VIEW_OPS) or not info["src"]:
            return False
        node = info["src"][0]
    return True


class StepGraph:
    """The model's one-token step traced once into an explicit :class:`recurra.Graph`.

    On the CPU each call binds the current parameter buffers (so training between calls is
    seen), feeds the token and the carried state (numpy arrays), computes, and returns the
    logits and the new state as numpy arrays: the Python cost per token is a few binds and
    copies, not the re-recording of every op.

    On a device the graph is *resident*: parameters and the carried state are bound to device
    buffers, and the step ends with ``assign`` nodes that write the new state into the
    buffers it read, in place. A token then costs one upload of the token id, one submission
    and one download of the logits; the state never leaves the device (see :meth:`start` and
    :meth:`step`). A CPU graph built with ``carry=True`` works the same way with host arrays
    of its own: no state is copied in or out per token, and the parameters are bound once
    per :meth:`start` (what :func:`stream` uses).

    Works for models whose ``forward_with_state`` only uses ``recurra.ops`` on its inputs and
    parameters; :func:`StepGraph.build` returns None when the model cannot be traced (the
    caller then uses the lazy path).
    """

    def __init__(
        self,
        graph: Any,
        params: list[tuple[Any, Any]],
        tok: Any,
        st_in: list[Any],
        logits: Any,
        st_out: list[Any],
        layout: list[int],
        resident: bool = False,
        carry: bool = False,
        constants: list[tuple[Any, str, Any]] | None = None,
    ) -> None:
        self.graph, self.params, self.tok = graph, params, tok
        # (module, name, leaf): weight-only values (module.step_constants()) that the graph
        # takes as inputs, computed from the parameters whenever they are bound
        self.constants = constants or []
        self.st_in, self.logits, self.st_out, self.layout = st_in, logits, st_out, layout
        self.resident = resident
        self.carry = carry or resident
        # carry: the device buffers (resident) or host arrays the state lives in
        self._state: list[Any] = []

    @classmethod
    def build(cls, model: Any, batch: int = 1, carry: bool = False) -> StepGraph | None:
        """Traces ``model.forward_with_state`` for (batch, 1) tokens; None when the model
        uses something the explicit graph cannot take. A model on a device gives a resident
        graph (every node placed on that device under the current strict-placement
        setting); on the CPU, ``carry`` gives a graph that keeps the state in arrays of its
        own (:meth:`start`, :meth:`step`) instead of taking and returning it per call."""
        device = str(model.device)
        resident = getattr(model.device, "backend", "cpu") != "cpu"
        carry = carry or resident
        shapes = [[tuple(t.shape) for t in layer] for layer in model.init_state(batch)]
        g = rc.Graph(backends=[device], strict=rc.strict_placement()) if resident else rc.Graph()
        leaves: dict[int, tuple[Any, Any]] = {}
        swapped: list[tuple[Any, str, Any]] = []
        constants: list[tuple[Any, str, Any]] = []
        try:
            if not resident:  # weight-only values as inputs, computed once per start()
                with rc.no_grad():
                    for m in model.modules():
                        if not hasattr(m, "step_constants"):
                            continue
                        made = {k: g.input(tuple(v.shape)) for k, v in m.step_constants().items()}
                        constants += [(m, k, leaf) for k, leaf in made.items()]
                        m.__dict__["_step_inputs"] = made
            for m in model.modules():
                for name, p in list(m.__dict__["_parameters"].items()):
                    if p is None:
                        continue
                    if id(p) not in leaves:
                        leaves[id(p)] = (p, g.tensor(p.shape, name=name))
                    swapped.append((m, name, p))
                    object.__setattr__(m, name, leaves[id(p)][1])
            tok = g.input((batch, 1), "int32", name="tokens")
            st_in = [[g.input(s) for s in layer] for layer in shapes]
            flat_in = [t for layer in st_in for t in layer]
            in_place = _scan_state_in_place(g, flat_in) if carry and not resident else nullcontext()
            with rc.no_grad(), in_place:
                logits, st_out = model.forward_with_state(tok, st_in)
            flat_out = [t for layer in st_out for t in layer]
            if not all(isinstance(t, rc.GraphTensor) and t.graph is g for t in [logits, *flat_out]):
                return None
            if [[tuple(t.shape) for t in layer] for layer in st_out] != shapes:
                return None
            g.set_output(logits)
            if carry and not all(t.dtype == "float32" for t in flat_in):
                return None  # host arrays of the carried state are float32
            if carry:
                for dst, src in zip(flat_in, flat_out):
                    if src.id == dst.id:  # updated in place already
                        continue
                    if _views(g, src.id, dst.id):  # looks into dst itself: copy it first
                        src = rc.ops.contiguous(src)
                    g.set_output(g.apply("assign", [dst, src], (), ()))
            else:
                for t in flat_out:
                    g.set_output(t)
        except Exception:  # noqa: BLE001 - any tracing failure means: use the lazy path
            return None
        finally:
            for m, name, p in swapped:
                object.__setattr__(m, name, p)
            for m, _, _ in constants:
                m.__dict__.pop("_step_inputs", None)
        return cls(
            g,
            list(leaves.values()),
            tok,
            flat_in,
            logits,
            flat_out,
            [len(layer) for layer in shapes],
            resident,
            carry,
            constants,
        )

    def _bind_params(self) -> None:
        g = self.graph
        for p, leaf in self.params:
            if self.resident:
                g._g.bind_device(leaf.id, p.storage)
            else:
                g._g.bind(leaf.id, p._realized())
        with rc.no_grad():  # the graph keeps the arrays it is bound to
            values: dict[int, dict[str, Any]] = {}
            for m, name, leaf in self.constants:
                if id(m) not in values:
                    values[id(m)] = m.step_constants()
                arr = np.ascontiguousarray(values[id(m)][name].numpy(), np.float32)
                g._g.bind(leaf.id, arr)

    def __call__(
        self, tokens: np.ndarray, state: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits (batch, 1, V) and the new flat state list for tokens (batch, 1) (a graph
        on the CPU)."""
        if self.carry:
            raise RuntimeError("this StepGraph carries its state: use start() and step()")
        g = self.graph
        self._bind_params()
        g.set_data(self.tok, tokens)
        for leaf, v in zip(self.st_in, state):
            g.set_data(leaf, v)
        g.compute()
        logits: np.ndarray = g.get_data(self.logits)
        return logits, [g.get_data(t) for t in self.st_out]

    def start(self, state: State) -> None:
        """Graphs that carry their state: takes over ``state`` (computed tensors, e.g. after
        the prompt) and binds the parameters' buffers (as they are now: bind again with
        another start() after changing them); later steps update the state in place."""
        self._bind_params()
        flat = [t for layer in state for t in layer]
        realize(flat)
        if not self.resident:  # host arrays, bound once, filled per start
            if not self._state:
                self._state = [np.empty(tuple(leaf.shape), np.float32) for leaf in self.st_in]
                for leaf, arr in zip(self.st_in, self._state):
                    self.graph._g.bind(leaf.id, arr)
            for arr, t in zip(self._state, flat):
                np.copyto(arr, np.asarray(t).reshape(arr.shape))
            return
        self._state = []
        for leaf, t in zip(self.st_in, flat):
            buf = (t if t.is_on_device else t.to(self.graph.backends[0])).storage
            self._state.append(buf)
            self.graph._g.bind_device(leaf.id, buf)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Graphs that carry their state: the logits (batch, 1, V) of tokens (batch, 1); the
        state moves one token on, in place (on the device for a resident graph)."""
        if not self._state:
            raise RuntimeError("StepGraph.step: call start(state) first")
        g = self.graph
        g.set_data(self.tok, tokens)
        g.compute()
        logits: np.ndarray = g.get_data(self.logits)
        return logits


def _graph_key(model: Any) -> tuple[Any, ...]:
    """What a traced step depends on besides the parameters' values: the device, the
    placement setting, and which tensor every module's parameter slot holds (a module or
    parameter replaced means another graph)."""
    slots = tuple(
        (type(m), name, id(p))
        for m in model.modules()
        for name, p in m.__dict__["_parameters"].items()
    )
    return (str(model.device), rc.strict_placement(), slots)


def _take_step_graph(model: Any) -> tuple[tuple[Any, ...], StepGraph | None]:
    """The model's step graph for batch 1: the one a previous :func:`stream` left (traced and
    planned already: tracing and planning the 130M presets' ~1400 nodes costs tens of ms) when
    nothing it depends on changed, else a new one. The caller holds it alone until it gives
    it back with :func:`_give_back_step_graph` (a stream running beside traces its own)."""
    key = _graph_key(model)
    cached = model.__dict__.pop("_step_graph_cache", None)
    if cached is not None and cached[0] == key:
        return key, cached[1]
    return key, StepGraph.build(model, carry=True)


def _give_back_step_graph(model: Any, key: tuple[Any, ...], graph: StepGraph | None) -> None:
    model.__dict__["_step_graph_cache"] = (key, graph)


def _step(model: Any, tokens: np.ndarray, state: State | None) -> tuple[np.ndarray, State]:
    """Runs the model over ``tokens`` (1, T) from ``state``; returns the logits of the last
    token (V,) and the new state, computed in one graph and cut from the graph history."""
    logits, new_state = model.forward_with_state(tokens, state)
    last = logits[:, -1, :] if logits.shape[1] > 1 else logits
    flat = [t for layer in new_state for t in layer]
    realize([last, *flat])
    detached = [[t.detach() for t in layer] for layer in new_state]
    return np.asarray(last).reshape(-1), detached


def stream(
    model: Any,
    prompt_ids: Any,
    max_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_ids: Iterable[int] = (),
    use_graph: bool = True,
) -> Iterator[int]:
    """Yields up to ``max_tokens`` new token ids after ``prompt_ids`` (a 1-D int array).

    The prompt runs through the parallel path once (prefill); each new token is one step of
    the recurrent mode from the carried state. Sampling as in :func:`sample_token`, drawn
    from ``np.random.default_rng(seed)`` (a fixed seed gives the same tokens). Stops early
    after yielding a token in ``stop_ids``. ``use_graph`` runs the steps through a traced
    :class:`StepGraph` (same numbers, less Python per token) when the model allows it.

    Raises ValueError/TypeError for a bad prompt or bad sampling settings."""
    _check_sampling(temperature, top_k, top_p)
    if not isinstance(max_tokens, (int, np.integer)) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
    prompt = _prompt(prompt_ids, model.vocab_size)
    stops = {int(s) for s in stop_ids}
    if max_tokens == 0:
        return
    rng = np.random.default_rng(seed)
    was_training = model.training
    model.eval()
    graph: StepGraph | None = None
    key: tuple[Any, ...] | None = None
    try:
        # no_grad around the computations only, not across the yields: the caller's code
        # between tokens (another stream, a training step) keeps its own gradient mode.
        with rc.no_grad():
            logits, state = _step(model, prompt[None, :], None)
            if use_graph and max_tokens > 1:
                key, graph = _take_step_graph(model)
            if graph is not None:
                graph.start(state)
        for i in range(int(max_tokens)):
            tok = sample_token(logits, temperature, top_k, top_p, rng)
            yield tok
            if tok in stops or i == max_tokens - 1:
                break
            tokens = np.array([[tok]], np.int32)
            with rc.no_grad():
                if graph is not None:
                    logits = graph.step(tokens).reshape(-1)
                else:
                    logits, state = _step(model, tokens, state)
    finally:
        if key is not None:
            _give_back_step_graph(model, key, graph)
        model.train(was_training)


def generate(
    model: Any,
    prompt_ids: Any,
    max_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_ids: Iterable[int] = (),
    use_graph: bool = True,
) -> list[int]:
    """The new token ids (the prompt not included) that :func:`stream` yields."""
    return list(
        stream(model, prompt_ids, max_tokens, temperature, top_k, top_p, seed, stop_ids, use_graph)
    )

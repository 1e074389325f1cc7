"""The optimizer base class: parameter groups, resident state, the fused step.

Every optimizer keeps, per parameter, a step count and its moments as recurra tensors created
on the parameter's device, and updates parameter and state **in place** with one fused
native kernel per parameter group (``recurra.ops.FusedStep``): the parameter's buffer is the
same object before and after a step, and a step allocates nothing in the persistent pool.

Gradient accumulation (``accumulate_steps=k``): gradients accumulate in ``p.grad`` across
``backward()`` calls, as in PyTorch; ``step()`` counts calls and updates on every k-th one,
with the summed gradient (divided by k when ``average=True``). Between updates ``step()``
does nothing and ``zero_grad()`` keeps the gradients (the accumulation window is open), so
an ordinary ``backward(); step(); zero_grad()`` loop accumulates without changes.

Clipping (``max_grad_norm``, ``clip_value``) happens inside the step, where the gradients
are: the global norm is a reduction over all gradients in the same native graph, and the
update scales by the clip coefficient. ``p.grad`` itself is left as it was (see
:func:`recurra_optim.clip_grad_norm_` for PyTorch's in-place variant).

Master weights: a parameter that is itself 2-byte (bfloat16 or float16, e.g. loaded with
``dtype=recurra.bfloat16``) gets a float32 master copy, ``state[p]["master"]``, on its
device. The step updates the master (from the gradient converted to float32, with float32
moments), then writes the master rounded to nearest even into the parameter (on a device
through a ``cast`` node there). Clipping and the gradient norm work on the float32
gradients; ``state_dict`` carries the masters (a state without one, from a float32 run,
starts from the parameter's value).
Under :func:`recurra.autocast` float32 parameters need nothing of this: they are the master
weights, and their gradients come back float32.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

import recurra
from recurra import Tensor
from recurra.ops import FusedStep
from recurra_optim import _files
from recurra_optim._support import (
    _as_groups,
    _check_accumulate,
    _check_clip,
    _check_nonneg,
    _download,
    _grad,
    _grad_buffer,
    _host_storages,
    _is_tensor,
    _on_device,
    _param_list,
)

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]] | Mapping[str, Tensor]

_MAX_PLANS = 8


class Optimizer:
    """Base class. Subclasses define the update op, the state they keep and their
    hyper-parameters (``_op``, ``_state_keys``, ``_hyper``, ``_check_group``).

    Args:
        params: tensors, a mapping name -> tensor, or a list of parameter groups (dicts with
            a ``"params"`` entry and per-group hyper-parameters).
        defaults: the hyper-parameters a group gets when it does not set them.
        accumulate_steps: update on every k-th call of :meth:`step` (k >= 1).
        average: divide the accumulated gradient by k (else use the sum).
        max_grad_norm: clip the global L2 norm of all gradients to this (None: off).
        clip_value: clamp every gradient element to [-clip_value, clip_value] (None: off).

    Raises:
        ValueError: an empty parameter list, a parameter in two groups, a bad
            hyper-parameter, ``accumulate_steps <= 0``.
        TypeError: a parameter that is not a float32 recurra tensor requiring gradients.
    """

    _op: str = ""

    def __init__(
        self,
        params: ParamsT,
        defaults: dict[str, Any],
        *,
        accumulate_steps: int = 1,
        average: bool = True,
        max_grad_norm: float | None = None,
        clip_value: float | None = None,
    ) -> None:
        self.defaults = dict(defaults)
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Tensor, dict[str, Tensor]] = {}
        self._names: dict[int, str] = {}
        self.accumulate_steps = _check_accumulate(accumulate_steps)
        self.average = bool(average)
        self.max_grad_norm = _check_clip("max_grad_norm", max_grad_norm)
        self.clip_value = _check_clip("clip_value", clip_value)
        self.step_count = 0  # real updates so far
        # The loss was multiplied by this before backward() (float16 loss scaling,
        # recurra_optim.DynamicLossScale sets it): the step divides the gradients by it.
        self.loss_scale = 1.0
        self.last_grad_norm: float | None = None
        self._micro = 0  # step() calls since the last update
        self._updated = False
        self._plans: OrderedDict[Any, _Plan] = OrderedDict()
        self._staging: dict[int, dict[str, np.ndarray]] = {}  # host copies of device tensors
        # Whether the parameters' device runs the update ops itself (None: not known yet;
        # False: it has no kernels, so device tensors are staged through the host).
        self._device_kernels: bool | None = None
        groups = _as_groups(params, self._names)
        for g in groups:
            self.add_param_group(g)

    # -- what subclasses provide ----------------------------------------------------------
    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The float32 state tensors (the parameter's shape) a parameter of ``group`` has."""
        raise NotImplementedError

    def _hyper(self, group: dict[str, Any]) -> dict[str, float]:
        """The update op's hyper-parameter slots for ``group`` (see recurra.ops.pack_hyper)."""
        raise NotImplementedError

    def _extra(self, group: dict[str, Any]) -> tuple[int, ...]:
        """Integer parameters of the update op after (n, has_gstat)."""
        return ()

    def _check_group(self, group: dict[str, Any]) -> None:
        """Raises ValueError for a bad hyper-parameter of ``group``."""
        _check_nonneg("lr", group["lr"])

    # -- parameter groups -----------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group (a dict with ``"params"`` and optional hyper-parameters); its state is
        created now, on each parameter's device.

        Raises ValueError when a parameter is already in a group, a required hyper-parameter
        is missing or a value is out of range; TypeError for a non-parameter.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"a parameter group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        if "params" not in group:
            raise ValueError("a parameter group needs a 'params' entry")
        params = _param_list(group["params"], self._names)
        if not params:
            raise ValueError("a parameter group needs at least one parameter")
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in params}) != len(params) or any(id(p) in seen for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        for k, v in self.defaults.items():
            if v is _REQUIRED and k not in group:
                raise ValueError(
                    f"parameter group didn't specify a value of required optimization parameter {k}"
                )
            group.setdefault(k, v)
        for k, v in list(group.items()):
            if k != "params" and isinstance(self.defaults.get(k), tuple):
                group[k] = tuple(v)
        group["params"] = params
        self._check_group(group)
        self.param_groups.append(group)
        for p in params:
            self._init_state(p, group)
        self._plans.clear()

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        st = self.state.setdefault(p, {})
        if p.dtype != recurra.float32 and "master" not in st:
            st["master"] = recurra.tensor(p.numpy().astype(np.float32), device=p.device)
        if "step" not in st:
            st["step"] = recurra.tensor(np.zeros(1, np.int32), device=p.device)
        for k in self._state_keys(group):
            if k not in st:
                st[k] = recurra.tensor(np.zeros(p.shape, np.float32), device=p.device)

    def _target(self, p: Tensor) -> Tensor:
        """The float32 tensor the update op changes: p, or the master copy of a 2-byte p."""
        return self.state[p].get("master", p) if p.dtype != recurra.float32 else p

    def _write_masters(self, ps: Iterable[Tensor]) -> None:
        """Writes each 2-byte parameter from its float32 master, rounded to nearest even:
        on the host straight into the parameter's memory (ml_dtypes rounds bit for bit as
        the core's cast), on a device through a cast node there."""
        for p in ps:
            if p.dtype == recurra.float32:
                continue
            master = self.state[p]["master"]
            dst, src = p.storage, master.storage
            if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
                np.copyto(dst, src.astype(dst.dtype))
            else:
                p.assign_(master.to(p.dtype))

    def _name(self, p: Tensor) -> str:
        return self._names.get(id(p)) or f"parameter {self._index(p)}"

    def _index(self, p: Tensor) -> int:
        i = 0
        for g in self.param_groups:
            for q in g["params"]:
                if q is p:
                    return i
                i += 1
        return -1

    # -- properties -----------------------------------------------------------------------
    @property
    def accumulating(self) -> bool:
        """True while an accumulation window is open (step() was called without updating)."""
        return self._micro > 0

    @property
    def micro_step(self) -> int:
        """step() calls since the last update (0 .. accumulate_steps - 1)."""
        return self._micro

    @property
    def updated(self) -> bool:
        """Whether the last step() call updated the parameters."""
        return self._updated

    @property
    def resident(self) -> bool:
        """True when the state lives in a device's memory (a GPU backend); False when it
        lives in host memory, as it does for parameters on the CPU."""
        return any(t.device.backend != "cpu" for st in self.state.values() for t in st.values())

    # -- the step -------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True, *, force: bool = False) -> None:
        """Clears the gradients (to None, or to zeros in place) -- except while an
        accumulation window is open, where it keeps them (pass ``force=True`` to clear
        anyway)."""
        if self._micro > 0 and not force:
            return
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                elif _is_tensor(p.grad):
                    p.grad.assign_(np.zeros(p.grad.shape, np.float32))  # in place, any device
                else:
                    buf = _grad_buffer(p, writable=True)
                    assert buf is not None  # p.grad is not None
                    buf[...] = 0.0

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step: updates every parameter that has a gradient, in place, on
        every ``accumulate_steps``-th call (the other calls only count).

        Returns what ``closure`` returns (it is called first, when given), else None.
        Raises ValueError when a gradient's shape differs from its parameter's.
        """
        loss = closure() if closure is not None else None
        if self._micro + 1 < self.accumulate_steps:
            self._micro += 1
            self._updated = False
            return loss
        self._updated = self._apply()  # raises before changing anything
        self._micro = 0
        if self._updated:
            self.step_count += 1
        return loss

    def _apply(self) -> bool:
        rows: list[tuple[int, list[Tensor]]] = []
        for gi, group in enumerate(self.param_groups):
            ps = [p for p in group["params"] if p.grad is not None]
            if ps:
                rows.append((gi, ps))
        if not rows:
            return False
        norm = self.max_grad_norm is not None
        key = (
            norm,
            tuple((gi, tuple(map(id, ps)), self._extra(self.param_groups[gi])) for gi, ps in rows),
        )
        uploads: list[tuple[Any, np.ndarray]] = []  # device buffers to write back after the run
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build(rows, norm, uploads)
            self._plans[key] = plan
            if len(self._plans) > _MAX_PLANS:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
            for u, (gi, ps) in enumerate(rows):
                if not self._rebind(plan, u, gi, ps, uploads):
                    self._plans.pop(key, None)  # a parameter moved: build again
                    return self._apply()
        scale = (1.0 / self.accumulate_steps if self.average else 1.0) / float(self.loss_scale)
        common = {
            "grad_scale": scale,
            "clip_value": self.clip_value or 0.0,
            "max_norm": self.max_grad_norm or 0.0,
        }
        fs = plan.step
        for u, (gi, _) in enumerate(rows):
            group = self.param_groups[gi]
            hv = {"lr": float(group["lr"]), **common, **self._hyper(group)}
            sig = tuple(hv.items())
            if plan.hyper_sig[u] != sig:
                self._check_group(group)
                fs.set_hyper(u, hv)
                plan.hyper_sig[u] = sig
        fs.run()
        # The cached step lets go of this step's gradients: bound until the next step they
        # would stay alive after zero_grad() (a model's worth of gradient memory held through
        # the next forward and backward). Rebinding them costs no planning.
        for u in range(len(rows)):
            fs.unbind_column(u, 1)
        for buf, host in uploads:
            buf.upload(host)
        for _, ps in rows:
            self._write_masters(ps)
        if norm:
            self.last_grad_norm = fs.grad_norm()
        return True

    def _build(
        self,
        rows: list[tuple[int, list[Tensor]]],
        norm: bool,
        uploads: list[tuple[Any, np.ndarray]],
    ) -> _Plan:
        """Checks every parameter and gradient and builds the fused step over them."""
        updates = []
        on_host = []
        for gi, ps in rows:
            group = self.param_groups[gi]
            keys = self._state_keys(group)
            tensors = []
            for p in ps:
                self._check_grad_shape(p)
                self._init_state(p, group)
                self._check_value(p, group)
                tensors.append(self._arrays(p, keys, uploads))
            updates.append((self._op, self._extra(group), tensors))
            on_host.append(all(isinstance(p.storage, np.ndarray) for p in ps))
        try:
            fs = FusedStep(updates, norm=norm)
        except RuntimeError as exc:
            if self._device_kernels is not None or "has no kernel" not in str(exc):
                raise
            # A device backend without the update kernels: stage through the host instead.
            self._device_kernels = False
            uploads.clear()
            return self._build(rows, norm, uploads)
        if not all(on_host):
            self._device_kernels = True
        return _Plan(fs, on_host, [[self._target(p).storage for p in ps] for _, ps in rows])

    def _rebind(
        self, plan: _Plan, u: int, gi: int, ps: list[Tensor], uploads: list[tuple[Any, np.ndarray]]
    ) -> bool:
        """Points update u of a cached plan at this step's arrays (usually only the
        gradients change). Returns False when a parameter moved and the plan must go."""
        fs = plan.step
        group = self.param_groups[gi]
        if not plan.on_host[u]:
            keys = self._state_keys(group)
            for t, p in enumerate(ps):
                self._check_grad_shape(p)
                if self._target(p).storage is not plan.values[u][t]:
                    return False
                for k, a in enumerate(self._arrays(p, keys, uploads)):
                    fs.bind(u, t, k, a)
            return True
        values = plan.values[u]
        grads = []
        for t, p in enumerate(ps):
            if self._target(p).storage is not values[t]:
                return False
            g = _grad(p)
            ga = g.storage if isinstance(g, Tensor) else g
            if (
                type(ga) is not np.ndarray
                or ga.dtype != np.float32
                or g is None
                or g.shape != p.shape
                or not ga.flags.c_contiguous
            ):
                self._check_grad_shape(p)
                ga = self._host_grad(p)
            grads.append(ga)
        fs.bind_column(u, 1, grads)
        return True

    def _check_grad_shape(self, p: Tensor) -> None:
        gshape = tuple(getattr(p.grad, "shape", ()))
        if gshape != p.shape:
            raise ValueError(
                f"{type(self).__name__}.step(): shape mismatch: the gradient of "
                f"{self._name(p)} has shape {gshape}, the parameter {p.shape}"
            )

    def _host_grad(self, p: Tensor) -> np.ndarray:
        """p's gradient as a dense float32 host array (a download for a device gradient)."""
        g = p.grad
        if not _on_device(g):
            arr = _grad_buffer(p, writable=False)
            assert arr is not None
            return arr
        if g.dtype != recurra.float32:  # a 2-byte gradient: converted exactly
            return np.asarray(g.numpy(), np.float32)
        stage = self._staging.setdefault(id(p), {})
        host = stage.get("grad")
        if host is None or host.shape != p.shape:
            host = stage["grad"] = np.empty(p.shape, np.float32)
        _download(g, host, self._name(p), "gradient")
        return host

    def _arrays(
        self, p: Tensor, keys: tuple[str, ...], uploads: list[tuple[Any, np.ndarray]]
    ) -> tuple[np.ndarray | Tensor, ...]:
        """The host arrays the update op works on for p: (param, grad, *state, step).

        On the CPU these are the tensors' own buffers (updated in place, zero-copy). For a
        parameter on a device backend they are host staging copies, downloaded now and
        uploaded back after the run (``uploads``), until the backends run the update ops
        themselves; the state still lives on the device between steps.
        """
        st = self.state[p]
        tensors = [self._target(p), *(st[k] for k in keys), st["step"]]
        own = _host_storages(tensors)
        if own is not None:
            return (own[0], self._host_grad(p), *own[1:])
        if self._device_kernels is not False and all(t.device == p.device for t in tensors):
            # Resident: the update runs on the device, on the tensors themselves.
            g = p.grad
            if _on_device(g) and g.device == p.device and g.dtype != recurra.float32:
                g = g.to(recurra.float32).detach()  # a cast node on the device
            if not (_on_device(g) and g.device == p.device):
                g = recurra.tensor(self._host_grad(p), device=p.device)
            return (tensors[0], g, *(st[k] for k in keys), st["step"])
        stage = self._staging.setdefault(id(p), {})
        out = []
        for name, t in zip(("param", *keys, "step"), tensors):
            host = stage.get(name)
            if host is None or host.shape != t.shape:
                host = stage[name] = np.empty(t.shape, np.int32 if name == "step" else np.float32)
            _download(t, host, self._name(p), name)
            uploads.append((t.storage, host))
            out.append(host)
        return (out[0], self._host_grad(p), *out[1:])

    def _check_value(self, p: Tensor, group: dict[str, Any]) -> None:
        """Checks a parameter's data the first time it is seen (and whenever it is replaced),
        and moves the state along if the parameter changed device."""
        self._sync_state(p, group)
        value = self._target(p).storage
        if isinstance(value, np.ndarray):
            if (
                value.dtype != np.float32
                or value.shape != p.shape
                or not value.flags.c_contiguous
                or not value.flags.writeable
            ):
                raise ValueError(
                    f"{type(self).__name__}.step(): the data of {self._name(p)} is "
                    f"not a writable C-contiguous float32 array of shape {p.shape}"
                )
        elif not getattr(value, "valid", True):
            raise RuntimeError(
                f"{type(self).__name__}.step(): the device memory of "
                f"{self._name(p)} was released (its backend closed); move the "
                f"parameter to a live device before stepping"
            )

    def _sync_state(self, p: Tensor, group: dict[str, Any]) -> None:
        """Moves p's state to p's device when the parameter moved (for instance back to the
        host after its device was released): the state follows the parameter. Raises
        RuntimeError when the state's own device memory is gone."""
        st = self.state[p]
        for k, t in list(st.items()):
            if t.device == p.device:
                continue
            if not getattr(t.storage, "valid", True):
                raise RuntimeError(
                    f"{type(self).__name__}: the {k} state of {self._name(p)} "
                    f"lived on {t.device}, whose memory was released; restore it "
                    f"with load_state_dict()/load() from a saved state"
                )
            st[k] = recurra.tensor(t.numpy(), device=p.device)
            self._staging.pop(id(p), None)
            self._plans.clear()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state as plain Python and numpy values (copies):

        ``{"state": {index: {"step": int, name: ndarray, ...}}, "param_groups": [{...,
        "params": [index, ...]}], "optimizer": {type, accumulation, clipping, counters}}``;
        parameters are numbered in group order, as in PyTorch.
        """
        state: dict[int, dict[str, Any]] = {}
        groups = []
        i = 0
        for g in self.param_groups:
            idx = []
            for p in g["params"]:
                st = self.state[p]
                entry: dict[str, Any] = {"step": int(st["step"].numpy()[0])}
                for k, t in st.items():
                    if k != "step":
                        entry[k] = t.numpy()
                state[i] = entry
                idx.append(i)
                i += 1
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": idx})
        return {
            "state": state,
            "param_groups": groups,
            "optimizer": {
                "type": type(self).__name__,
                "accumulate_steps": self.accumulate_steps,
                "average": self.average,
                "max_grad_norm": self.max_grad_norm,
                "clip_value": self.clip_value,
                "micro_step": self._micro,
                "step_count": self.step_count,
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict` (exactly: values, counters, hyper-parameters). The
        state is copied into the existing buffers, which stay where they are.

        Everything is checked before anything changes: raises ValueError when the dict is
        malformed, for another optimizer type, or does not match the parameters (group
        count, group sizes, state shapes); the optimizer is then unchanged.
        """
        new_groups, new_state, meta = self._validate_state_dict(state_dict)
        for group, ng in zip(self.param_groups, new_groups):
            params = group["params"]
            group.clear()
            group.update(ng)
            group["params"] = params
        i = 0
        for group in self.param_groups:
            keys = self._state_keys(group)
            for p in group["params"]:
                entry = new_state.get(i, {})
                i += 1
                st = self.state[p]
                for k in [k for k in st if k != "step" and k not in keys and k not in entry]:
                    del st[k]
                self._init_state(p, group)
                # assign_ writes into the tensor's own memory, on the host or a device.
                st["step"].assign_(np.int32(entry.get("step", 0)))
                for k in keys:
                    st[k].assign_(entry[k] if k in entry else np.float32(0.0))
                for k, arr in entry.items():  # optional state the group does not use now
                    if k == "step" or k in keys:
                        continue
                    if k in st:
                        st[k].assign_(arr)
                    else:
                        st[k] = recurra.tensor(arr, device=p.device)
                self._write_masters([p])
        if meta:
            self.accumulate_steps = meta["accumulate_steps"]
            self.average = meta["average"]
            self.max_grad_norm = meta["max_grad_norm"]
            self.clip_value = meta["clip_value"]
            self._micro = meta["micro_step"]
            self.step_count = meta["step_count"]
        self._plans.clear()

    def _validate_state_dict(
        self, sd: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]], dict[str, Any]]:
        if not isinstance(sd, Mapping) or "state" not in sd or "param_groups" not in sd:
            raise ValueError(
                "not an optimizer state dict: expected the keys 'state' and 'param_groups'"
            )
        meta_in = sd.get("optimizer")
        meta: dict[str, Any] = {}
        if meta_in is not None:
            if not isinstance(meta_in, Mapping):
                raise ValueError("'optimizer' entry must be a dict")
            kind = meta_in.get("type")
            if kind != type(self).__name__:
                raise ValueError(
                    f"the state is of a {kind} optimizer, this one is {type(self).__name__}"
                )
            try:
                meta = {
                    "accumulate_steps": _check_accumulate(meta_in["accumulate_steps"]),
                    "average": bool(meta_in["average"]),
                    "max_grad_norm": _check_clip("max_grad_norm", meta_in["max_grad_norm"]),
                    "clip_value": _check_clip("clip_value", meta_in["clip_value"]),
                    "micro_step": int(meta_in["micro_step"]),
                    "step_count": int(meta_in["step_count"]),
                }
            except (KeyError, TypeError) as e:
                raise ValueError(f"malformed 'optimizer' entry: {e!r}") from None
            if not 0 <= meta["micro_step"] < meta["accumulate_steps"] or meta["step_count"] < 0:
                raise ValueError("malformed 'optimizer' entry: counters out of range")
        groups_in = sd["param_groups"]
        if not isinstance(groups_in, (list, tuple)) or len(groups_in) != len(self.param_groups):
            n = len(groups_in) if isinstance(groups_in, (list, tuple)) else "?"
            raise ValueError(
                f"the state has {n} parameter groups, this optimizer {len(self.param_groups)}"
            )
        new_groups: list[dict[str, Any]] = []
        index: dict[int, tuple[Tensor, dict[str, Any]]] = {}
        for gi, (mine, theirs) in enumerate(zip(self.param_groups, groups_in)):
            if not isinstance(theirs, Mapping) or "params" not in theirs:
                raise ValueError(f"parameter group {gi} of the state is malformed")
            ids = list(theirs["params"])
            if len(ids) != len(mine["params"]):
                raise ValueError(
                    f"parameter group {gi} has {len(ids)} parameters in the state, "
                    f"{len(mine['params'])} here"
                )
            ng = {k: v for k, v in theirs.items() if k != "params"}
            for k, v in self.defaults.items():
                if k not in ng:
                    if v is _REQUIRED:
                        raise ValueError(f"parameter group {gi} of the state lacks {k!r}")
                    ng[k] = mine.get(k, v)
                if isinstance(v, tuple) or isinstance(mine.get(k), tuple):
                    ng[k] = tuple(ng[k])
            check = dict(ng, params=mine["params"])
            self._check_group(check)
            new_groups.append(ng)
            for i, p in zip(ids, mine["params"]):
                if not isinstance(i, (int, np.integer)) or int(i) in index:
                    raise ValueError(
                        f"parameter group {gi} of the state has a bad or repeated "
                        f"parameter index {i!r}"
                    )
                index[int(i)] = (p, check)
        state_in = sd["state"]
        if not isinstance(state_in, Mapping):
            raise ValueError("'state' must be a dict")
        new_state: dict[int, dict[str, Any]] = {}
        flat = [p for g in self.param_groups for p in g["params"]]
        for key, entry in state_in.items():
            try:
                i = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"bad parameter index {key!r} in the state") from None
            if i not in index:
                raise ValueError(f"the state has an entry for parameter {i}, which no group lists")
            p, group = index[i]
            pos = next(j for j, q in enumerate(flat) if q is p)
            if not isinstance(entry, Mapping):
                raise ValueError(f"state of parameter {i} must be a dict")
            out: dict[str, Any] = {}
            want = set(self._state_keys(group))
            for k, v in entry.items():
                if k == "step":
                    s = np.asarray(v).ravel()
                    ok = s.size == 1 and s.dtype.kind in "iuf" and float(s[0]).is_integer()
                    if not ok or not 0 <= int(s[0]) < 2**31 - 1:
                        raise ValueError(f"state of parameter {i}: bad step count {v!r}")
                    out["step"] = int(s[0])
                    continue
                if k == "master" and p.dtype == recurra.float32:
                    raise ValueError(
                        f"state of parameter {i}: a float32 master copy for a float32 parameter"
                    )
                if k not in want and k not in self._optional_state and k != "master":
                    raise ValueError(
                        f"state of parameter {i}: unexpected entry {k!r} for "
                        f"{type(self).__name__} (expected {sorted(want)})"
                    )
                arr = np.asarray(v)
                if arr.dtype.kind != "f":
                    raise ValueError(
                        f"state of parameter {i}: {k} must be floating point, got {arr.dtype}"
                    )
                if arr.shape != p.shape:
                    raise ValueError(
                        f"state of parameter {i}: {k} has shape {arr.shape}, the "
                        f"parameter {p.shape} (shape mismatch)"
                    )
                out[k] = np.ascontiguousarray(arr, np.float32)
            missing = want - set(out)
            if missing:
                raise ValueError(f"state of parameter {i} lacks {sorted(missing)}")
            new_state[pos] = out
        return new_groups, new_state, meta

    _optional_state: tuple[str, ...] = ()

    def save(self, path: str | Any) -> None:
        """Writes :meth:`state_dict` to ``path`` as safetensors, atomically (a temporary file
        in the same folder, fsync, rename): a crash or an error leaves any file already at
        ``path`` intact. Raises OSError naming the file when it cannot be written."""
        _files.save(self, path)

    def load(self, path: str | Any) -> None:
        """Restores the state saved by :meth:`save`. Raises FileNotFoundError, or ValueError
        naming the file and the problem (not safetensors, corrupt, another optimizer type,
        parameters that do not match); the optimizer is then unchanged."""
        _files.load(self, path)

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            for k in sorted(k for k in g if k != "params"):
                lines.append(f"    {k}: {g[k]}")
        lines.append(")")
        return "\n".join(lines)


class _Plan:
    """A cached FusedStep: per update, whether it works on host buffers directly, the
    parameter arrays it is bound to, and the hyper-parameters last packed into it."""

    __slots__ = ("step", "on_host", "values", "hyper_sig")

    def __init__(self, step: FusedStep, on_host: list[bool], values: list[list[Any]]) -> None:
        self.step = step
        self.on_host = on_host
        self.values = values
        self.hyper_sig: list[Any] = [None] * len(on_host)


class _Required:
    def __repr__(self) -> str:
        return "<required parameter>"


_REQUIRED: Any = _Required()


# ---- helpers --------------------------------------------------------------------------------

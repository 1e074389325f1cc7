"""A small module API on top of recurra's lazy tensors.

Attributes of a :class:`Module` that are parameters (trainable recurra leaf tensors, made
with :func:`Parameter`) or other modules (or :class:`ModuleList`s of modules) register
themselves under dotted names such as ``layers.0.mixer.in_proj.weight``. The names of the
layers below follow PyTorch's, so that Hugging Face checkpoints load by name.

Shapes are numpy order; weights of :class:`Linear` are stored (out_features, in_features)
like PyTorch's, so checkpoints load without transposes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

import recurra as rc
from recurra import ops

__all__ = [
    "Embedding",
    "LayerNorm",
    "Linear",
    "Module",
    "ModuleList",
    "Parameter",
    "RMSNorm",
    "is_parameter",
]


def Parameter(data: Any, device: Any = None) -> rc.Tensor:  # noqa: N802 - PyTorch's name
    """A trainable float32 recurra tensor holding a copy of ``data``.

    Returns a leaf tensor with ``requires_grad=True``. Raises TypeError for data that is not
    numeric.
    """
    return rc.param(np.asarray(data, dtype=np.float32), device=device)


def is_parameter(value: Any) -> bool:
    """True when ``value`` is a trainable leaf tensor (what a Module registers)."""
    return isinstance(value, rc.Tensor) and value.is_leaf and bool(value.requires_grad)


class Module:
    """Base class of layers and models.

    Subclasses assign parameters and sub-modules as attributes in ``__init__`` (after
    calling ``super().__init__()``) and define ``forward``; calling the module calls
    ``forward``.
    """

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    # -- registration ------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(
                f"{type(self).__name__}: call super().__init__() before assigning attributes"
            )
        params: dict[str, rc.Tensor] = self.__dict__["_parameters"]
        modules: dict[str, Module] = self.__dict__["_modules"]
        params.pop(name, None)
        modules.pop(name, None)
        if is_parameter(value):
            params[name] = value
        elif isinstance(value, Module):
            modules[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self.__dict__["_parameters"].pop(name, None)
        self.__dict__["_modules"].pop(name, None)
        object.__delattr__(self, name)

    def register_parameter(self, name: str, value: rc.Tensor | None) -> None:
        """Registers ``value`` (a trainable tensor) under ``name``; None removes it.

        Raises TypeError when value is not a trainable recurra tensor."""
        if value is not None and not is_parameter(value):
            raise TypeError(
                f"register_parameter({name!r}): expected a trainable recurra tensor "
                f"(recurra_models.nn.Parameter), got {type(value).__name__}"
            )
        setattr(self, name, value)

    # -- traversal ---------------------------------------------------------------------
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """Yields (dotted name, module) for this module and every module below it."""
        yield prefix, self
        for name, m in self.__dict__["_modules"].items():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator[Module]:
        """Yields this module and every module below it."""
        for _, m in self.named_modules():
            yield m

    def children(self) -> Iterator[Module]:
        """Yields the direct sub-modules."""
        yield from self.__dict__["_modules"].values()

    def _named_parameters_all(self, prefix: str = "") -> Iterator[tuple[str, rc.Tensor]]:
        for name, p in self.__dict__["_parameters"].items():
            yield (f"{prefix}.{name}" if prefix else name), p
        for name, m in self.__dict__["_modules"].items():
            yield from m._named_parameters_all(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, remove_duplicate: bool = True) -> Iterator[tuple[str, rc.Tensor]]:
        """Yields (dotted name, parameter). A parameter shared by two modules (tied
        embeddings) is yielded once, under its first name, unless ``remove_duplicate`` is
        False."""
        seen: set[int] = set()
        for name, p in self._named_parameters_all():
            if remove_duplicate:
                if id(p) in seen:
                    continue
                seen.add(id(p))
            yield name, p

    def parameters(self) -> Iterator[rc.Tensor]:
        """Yields every parameter once."""
        for _, p in self.named_parameters():
            yield p

    def num_parameters(self) -> int:
        """The number of scalar parameters (shared parameters counted once)."""
        return int(sum(p.size for p in self.parameters()))

    def _aliases(self) -> dict[str, str]:
        """Maps every name of a shared parameter other than its first to the first."""
        first: dict[int, str] = {}
        out: dict[str, str] = {}
        for name, p in self._named_parameters_all():
            if id(p) in first:
                out[name] = first[id(p)]
            else:
                first[id(p)] = name
        return out

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters as numpy arrays of their dtype (copies; float32 unless :meth:`to`
        converted them), keyed by dotted name; a shared parameter appears once, under its
        first name."""
        return {name: p.numpy() for name, p in self.named_parameters()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Copies the arrays of ``state_dict`` into the parameters, in place (tensors keep
        their identity, so an optimizer built on them stays valid).

        Keys may also use the second name of a shared (tied) parameter. Values are numpy
        arrays, recurra tensors or anything ``np.asarray`` takes; they are cast to each
        parameter's dtype (float32 unless :meth:`to` gave the model another).

        Raises:
            ValueError: (strict) a parameter with no entry, or an entry that names no
                parameter; (always) an entry whose shape differs from the parameter's,
                naming the key and both shapes; non-finite-shaped or non-numeric data.
        """
        own = dict(self.named_parameters())
        aliases = self._aliases()
        resolved: dict[str, tuple[str, Any]] = {}
        unexpected: list[str] = []
        for key, value in state_dict.items():
            target = key if key in own else aliases.get(key)
            if target is None:
                unexpected.append(key)
                continue
            if target in resolved and resolved[target][0] != key:
                continue  # both names of a tied parameter given: the first name wins
            resolved[target] = (key, value)
        missing = [k for k in own if k not in resolved]
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append(f"missing keys: {_short(missing)}")
            if unexpected:
                parts.append(f"unexpected keys: {_short(unexpected)}")
            raise ValueError(f"load_state_dict of {type(self).__name__}: " + "; ".join(parts))
        # Check everything before changing anything, so a failed load leaves the model as it was.
        arrays: dict[str, np.ndarray] = {}
        for target, (key, value) in resolved.items():
            p = own[target]
            arr = _as_dtype(value, key, p.dtype)
            if tuple(arr.shape) != tuple(p.shape):
                raise ValueError(
                    f"load_state_dict of {type(self).__name__}: key {key!r} has shape "
                    f"{tuple(arr.shape)}, the model's parameter has shape {tuple(p.shape)}"
                )
            arrays[target] = arr
        for target, arr in arrays.items():
            own[target].assign_(arr)

    # -- modes and devices ---------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        """Sets training mode on this module and every sub-module; returns self."""
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self) -> Module:
        """Sets evaluation mode (``train(False)``); returns self."""
        return self.train(False)

    def requires_grad_(self, flag: bool = True) -> Module:
        """Marks every parameter as trainable (or not, when ``flag`` is False); returns self.

        Frozen tensors stay registered as parameters of the module that holds them."""
        for p in self.parameters():
            p.requires_grad_(flag)
        return self

    def zero_grad(self) -> None:
        """Drops the gradients of every parameter."""
        for p in self.parameters():
            p.grad = None

    @property
    def device(self) -> Any:
        """The device of the first parameter (``recurra.Device``), CPU when there is none."""
        for p in self.parameters():
            return getattr(p, "device", rc.parse_device("cpu"))
        return rc.parse_device("cpu")

    def to(self, device: Any) -> Module:
        """Moves every parameter to ``device`` ("cpu", "vulkan", "vulkan:N"), or converts it
        to a float dtype (``recurra.bfloat16``, ``float16``, ``float32``: rounded to
        nearest even); returns self.

        Parameters are replaced by tensors on the new device or of the new dtype (shared
        ones stay shared); build optimizers after moving. Raises ValueError for an unknown
        or unavailable device. A model in bfloat16/float16 holds its weights in 2 bytes;
        the recurrent operators and norms take float32 only (they raise TypeError), so
        running it waits on mixed precision (autocast)."""
        if isinstance(device, rc.DType) or device in ("bfloat16", "float16", "float32"):
            dt = rc.DType(device)

            def convert(p: rc.Tensor) -> rc.Tensor:
                return rc.param(p.numpy().astype(dt.numpy), device=p.device, dtype=dt)

            self._replace_parameters(convert)
            return self
        dev = rc.parse_device(device)
        self._replace_parameters(lambda p: p.to(dev))
        self._on_moved(dev)
        return self

    def _replace_parameters(self, make: Any) -> None:
        moved: dict[int, rc.Tensor] = {}
        for m in self.modules():
            table: dict[str, rc.Tensor] = m.__dict__["_parameters"]
            for name, p in list(table.items()):
                if id(p) not in moved:
                    q = make(p)
                    if not q.requires_grad:  # Tensor.to keeps this for leaves; be explicit
                        q.requires_grad_(True)
                    moved[id(p)] = q
                setattr(m, name, moved[id(p)])

    def _on_moved(self, device: Any) -> None:
        """Hook for subclasses holding non-parameter tensors (constants) to move them."""
        for m in self.children():
            m._on_moved(device)

    # -- calling -----------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_recompute"):
            with rc.recompute():
                return self.forward(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def recompute_(self, flag: bool = True) -> Module:
        """Makes this module's forward run inside ``recurra.recompute()`` (its own
        recomputation segment): the backward runs it again instead of keeping its
        intermediates. Returns self."""
        object.__setattr__(self, "_recompute", bool(flag))
        return self

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, m in self.__dict__["_modules"].items():
            sub = repr(m).replace("\n", "\n  ")
            lines.append(f"  ({name}): {sub}")
        if len(lines) == 1:
            return lines[0] + ")"
        return "\n".join(lines) + "\n)"


class ModuleList(Module):
    """A list of modules, registered under the names "0", "1", ..."""

    def __init__(self, modules: Iterable[Module] = ()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> ModuleList:
        """Adds ``module`` at the end; returns self. Raises TypeError for a non-Module."""
        if not isinstance(module, Module):
            raise TypeError(f"ModuleList holds Modules, got {type(module).__name__}")
        setattr(self, str(len(self)), module)
        return self

    def __len__(self) -> int:
        return len(self.__dict__["_modules"])

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self.__dict__["_modules"].values()))

    def __getitem__(self, i: int) -> Module:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"ModuleList index {i} out of range for {n} modules")
        module: Module = self.__dict__["_modules"][str(i % n)]
        return module


# -- layers ------------------------------------------------------------------------------


def _rng(seed: int | np.random.Generator | None) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


class Linear(Module):
    """y = x @ weight.T + bias, weight stored (out_features, in_features) like PyTorch.

    Initialised like PyTorch (uniform in +-1/sqrt(in_features)) from ``seed`` (an int or a
    numpy Generator).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        seed: int | np.random.Generator | None = 0,
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"Linear: sizes must be positive, got in={in_features}, out={out_features}"
            )
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        rng = _rng(seed)
        bound = 1.0 / math.sqrt(in_features)
        self.weight = Parameter(rng.uniform(-bound, bound, (out_features, in_features)))
        self.bias = Parameter(rng.uniform(-bound, bound, (out_features,))) if bias else None

    def forward(self, x: Any) -> Any:
        """x (..., in_features) -> (..., out_features). Raises ValueError for a wrong last
        axis."""
        shape = tuple(x.shape)
        if not shape or shape[-1] != self.in_features:
            raise ValueError(
                f"Linear: input has shape {shape}, expected last axis {self.in_features}"
            )
        x2 = x.reshape(-1, self.in_features) if len(shape) != 2 else x
        y = ops.matmul(x2, self.weight.T)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features) if len(shape) != 2 else y

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """A lookup table (num_embeddings, embedding_dim); init normal(0, 1) like PyTorch."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, seed: int | np.random.Generator | None = 0
    ) -> None:
        super().__init__()
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(
                f"Embedding: sizes must be positive, got {num_embeddings}, {embedding_dim}"
            )
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.weight = Parameter(_rng(seed).standard_normal((num_embeddings, embedding_dim)))

    def forward(self, idx: Any) -> Any:
        """int32 indices of any shape (up to 3 axes) -> idx.shape + (embedding_dim,).

        Raises TypeError for non-integer indices and ValueError (numpy input) for indices
        outside [0, num_embeddings)."""
        if isinstance(idx, np.ndarray) or isinstance(idx, (list, tuple)):
            arr = np.asarray(idx)
            if arr.dtype.kind not in "iu":
                raise TypeError(f"Embedding: indices must be integers, got dtype {arr.dtype}")
            if arr.size and (arr.min() < 0 or arr.max() >= self.num_embeddings):
                raise ValueError(
                    f"Embedding: token ids must be in [0, {self.num_embeddings}), got "
                    f"min {int(arr.min())}, max {int(arr.max())}"
                )
            idx = rc.tensor(arr.astype(np.int32), device=self.weight.device)
        return ops.get_rows(self.weight, idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


#: Under autocast, the norms whose output feeds products only (RMSNorm(to_autocast=True),
#: Mamba-2's gated norm) return the autocast dtype, rounded by the norm op itself. False: they
#: return float32 and the product casts it (recurra before; for comparisons, e.g.
#: bench/step_memory.py --up-casts). The values are the same.
NORM_TO_AUTOCAST = True


class RMSNorm(Module):
    """x / sqrt(mean(x**2) + eps) * weight over the last axis (weight initialised to 1).

    ``to_autocast``: the output feeds products only (a pre-norm before a projection), so
    under :class:`recurra.autocast` the norm rounds it to the autocast dtype itself
    (``ops.rms_norm(dtype=...)``): the value the product's cast would make, without the cast
    node, and the backward reads the product's 2-byte gradient as it is."""

    def __init__(self, dim: int, eps: float = 1e-5, to_autocast: bool = False) -> None:
        super().__init__()
        self.dim = int(dim)
        self.eps = float(eps)
        self.to_autocast = bool(to_autocast)
        self.weight = Parameter(np.ones(dim, np.float32))

    def forward(self, x: Any) -> Any:
        """Returns a tensor of x's shape."""
        dtype = rc.autocast_dtype() if self.to_autocast and NORM_TO_AUTOCAST else None
        return ops.rms_norm(x, self.eps, self.weight, dtype=dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class LayerNorm(Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (weight 1, bias 0)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.dim = int(dim)
        self.eps = float(eps)
        self.weight = Parameter(np.ones(dim, np.float32))
        self.bias = Parameter(np.zeros(dim, np.float32)) if bias else None

    def forward(self, x: Any) -> Any:
        """Returns a tensor of x's shape."""
        y = ops.layer_norm(x, self.eps) * self.weight
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


# -- helpers -------------------------------------------------------------------------------


def _short(keys: list[str], n: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _as_dtype(value: Any, key: str, dtype: Any) -> np.ndarray:
    """``value`` as a C-contiguous array of the recurra dtype ``dtype`` (bfloat16 and float16
    arrays convert straight, without a float32 copy)."""
    want = rc.DType(dtype).numpy if isinstance(dtype, str) else np.float32
    if isinstance(value, rc.Tensor):
        return np.ascontiguousarray(value.numpy(), dtype=want)
    try:
        arr = np.asarray(value)
    except Exception as e:  # noqa: BLE001 - report any conversion failure with the key
        raise ValueError(f"load_state_dict: key {key!r}: cannot convert to an array ({e})") from e
    if arr.dtype.kind not in "fiub" and arr.dtype != rc.bfloat16.numpy:
        raise ValueError(f"load_state_dict: key {key!r} has non-numeric dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=want)

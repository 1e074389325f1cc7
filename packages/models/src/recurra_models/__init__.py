"""recurra-models: Mamba, Mamba-2, RWKV-6 and RWKV-7 language models on recurra.

    import recurra_models as rm
    model = rm.create("mamba", d_model=64, n_layer=2, vocab_size=256)
    logits = model(tokens)                       # int32 (batch, time) -> (batch, time, vocab)
    model = rm.load_pretrained("folder")         # HF Mamba / Mamba2 folder, or RWKV file
    tok = model.tokenizer                        # the folder's tokenizer (or None)
    rm.save_pretrained(model, "out")             # back to a transformers / RWKV folder
    ids = rm.generate(model, prompt, max_tokens=32, temperature=0.0)

Architectures are found through the ``recurra.models`` entry point group; each entry is a
class with a ``Config`` dataclass and a ``from_config(cfg_dict, seed=0)`` classmethod.
"""

from __future__ import annotations

from importlib import import_module
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from recurra_models import nn as nn

# Imported now, not lazily: the function has its module's name, and importing the module
# later (``import recurra_models.presets``) would otherwise bind the package's ``presets``
# to the module.
from recurra_models.presets import presets as presets

if TYPE_CHECKING:  # what _LAZY loads on first use, for type checkers and readers
    from recurra_models.evaluation import evaluate_tokens
    from recurra_models.export import save_pretrained
    from recurra_models.generation import generate, sample_token, stream
    from recurra_models.loading import load_pretrained, load_safetensors
    from recurra_models.mamba import MambaConfig, MambaLM
    from recurra_models.mamba2 import Mamba2Config, Mamba2LM
    from recurra_models.rwkv6 import RWKV6LM, RWKV6Config
    from recurra_models.rwkv7 import RWKV7LM, RWKV7Config
    from recurra_models.textdata import tokenize_files
    from recurra_models.tokenizer import ByteTokenizer
    from recurra_models.tokenizers import (
        HFTokenizer,
        TextStreamer,
        WorldTokenizer,
        load_tokenizer,
        train_byte_bpe,
    )
    from recurra_models.training import (
        CheckpointError,
        Trainer,
        batch_at,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )

try:
    __version__ = _metadata.version("recurra-models")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

# Built-in architectures, used when the package's entry points are not installed (a source
# tree on sys.path); installed entry points take precedence and may add more.
_BUILTIN = {
    "mamba": "recurra_models.mamba:MambaLM",
    "mamba2": "recurra_models.mamba2:Mamba2LM",
    "rwkv6": "recurra_models.rwkv6:RWKV6LM",
    "rwkv7": "recurra_models.rwkv7:RWKV7LM",
}

# Public names defined in submodules, imported when first used (so that importing the
# package stays cheap and a missing optional module does not break the rest).
_LAZY = {
    "MambaLM": "recurra_models.mamba",
    "MambaConfig": "recurra_models.mamba",
    "Mamba2LM": "recurra_models.mamba2",
    "Mamba2Config": "recurra_models.mamba2",
    "RWKV6LM": "recurra_models.rwkv6",
    "RWKV6Config": "recurra_models.rwkv6",
    "RWKV7LM": "recurra_models.rwkv7",
    "RWKV7Config": "recurra_models.rwkv7",
    "load_pretrained": "recurra_models.loading",
    "load_safetensors": "recurra_models.loading",
    "ByteTokenizer": "recurra_models.tokenizer",
    "HFTokenizer": "recurra_models.tokenizers",
    "WorldTokenizer": "recurra_models.tokenizers",
    "TextStreamer": "recurra_models.tokenizers",
    "load_tokenizer": "recurra_models.tokenizers",
    "train_byte_bpe": "recurra_models.tokenizers",
    "tokenize_files": "recurra_models.textdata",
    "save_pretrained": "recurra_models.export",
    "evaluate_tokens": "recurra_models.evaluation",
    "generate": "recurra_models.generation",
    "stream": "recurra_models.generation",
    "sample_token": "recurra_models.generation",
    "Trainer": "recurra_models.training",
    "save_checkpoint": "recurra_models.training",
    "load_checkpoint": "recurra_models.training",
    "CheckpointError": "recurra_models.training",
    "batch_at": "recurra_models.training",
    "latest_checkpoint": "recurra_models.training",
}

__all__ = [
    "ByteTokenizer",
    "CheckpointError",
    "HFTokenizer",
    "Mamba2Config",
    "Mamba2LM",
    "MambaConfig",
    "MambaLM",
    "RWKV6Config",
    "RWKV6LM",
    "RWKV7Config",
    "RWKV7LM",
    "TextStreamer",
    "Trainer",
    "WorldTokenizer",
    "__version__",
    "architectures",
    "batch_at",
    "create",
    "evaluate_tokens",
    "from_config",
    "generate",
    "get_architecture",
    "latest_checkpoint",
    "load_checkpoint",
    "load_pretrained",
    "load_safetensors",
    "load_tokenizer",
    "presets",
    "nn",
    "sample_token",
    "save_checkpoint",
    "save_pretrained",
    "stream",
    "tokenize_files",
    "train_byte_bpe",
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'recurra_models' has no attribute {name!r}")
    value = getattr(import_module(mod), name)
    globals()[name] = value
    return value


def _entry_points() -> dict[str, str]:
    """name -> "module:attr" of every registered architecture (built-ins included)."""
    found = dict(_BUILTIN)
    for ep in _metadata.entry_points(group="recurra.models"):  # Python >= 3.10
        found[ep.name] = ep.value
    return found


def architectures() -> list[str]:
    """The names of the registered architectures ("mamba", "mamba2", "rwkv6", "rwkv7", and
    any added by other packages), sorted."""
    return sorted(_entry_points())


def get_architecture(arch: str) -> type:
    """The model class registered as ``arch``.

    Raises ValueError for an unknown name (listing the known ones) and ImportError when the
    registered class cannot be imported (saying which module failed)."""
    table = _entry_points()
    spec = table.get(arch)
    if spec is None:
        raise ValueError(f"unknown architecture {arch!r}; registered: {', '.join(sorted(table))}")
    module, _, attr = spec.partition(":")
    try:
        obj: Any = import_module(module)
    except ImportError as e:
        raise ImportError(
            f"architecture {arch!r} is registered as {spec!r}, but {module} cannot be imported: {e}"
        ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(
                f"architecture {arch!r} is registered as {spec!r}, but {module} has no {attr!r}"
            ) from None
    return obj  # type: ignore[no-any-return]


def from_config(arch: str, config: dict[str, Any], seed: int = 0) -> Any:
    """A freshly initialised model of architecture (or preset) ``arch`` from a config dict.

    Raises ValueError for an unknown architecture or config field."""
    from recurra_models.presets import resolve

    arch, config = resolve(arch, config)
    return get_architecture(arch).from_config(config, seed=seed)  # type: ignore[attr-defined]


def create(arch: str, *, seed: int = 0, **config: Any) -> Any:
    """A freshly initialised model: ``create("mamba", d_model=64, n_layer=2)``, or a preset
    of a published checkpoint's shape: ``create("mamba2-130m")`` (see :func:`presets`;
    keyword arguments override its fields).

    Returns the architecture's model class instance. Raises ValueError for an unknown
    architecture or config field."""
    return from_config(arch, config, seed=seed)

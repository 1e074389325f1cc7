"""Writing models back in the formats they were read from.

- ``format="hf"`` (Mamba, Mamba-2): a transformers folder, ``config.json`` (the
  transformers field names: the inverse of the configs' ``_aliases`` that
  :func:`recurra_models.loading.load_pretrained` reads) + ``model.safetensors`` (our
  parameter names are transformers' names) + the tokenizer's files, loadable by
  ``MambaForCausalLM`` / ``Mamba2ForCausalLM.from_pretrained`` and by ``load_pretrained``;
- ``format="rwkv"`` (RWKV-6, RWKV-7): the official layout, one ``model.pth`` state dict
  (``.safetensors`` with the same keys when torch is not installed) + the World vocabulary.

The folder is written into a temporary sibling and renamed into place: a reader never sees
half of it, and an existing non-empty folder is replaced only with ``overwrite=True``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from recurra_models.loading import _HF_ARCHS, save_safetensors

__all__ = ["hf_config", "save_pretrained"]

_HF_CLASS = {arch: name for name, arch in _HF_ARCHS.items() if name.endswith("ForCausalLM")}


def _json_value(v: Any) -> Any:
    if isinstance(v, tuple):
        v = list(v)
    if isinstance(v, list):
        return [_json_value(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        # transformers' own spelling of non-finite floats in config.json (strict JSON)
        return {"__float__": "Infinity" if v > 0 else "-Infinity" if v < 0 else "NaN"}
    return v


def hf_config(model: Any, tokenizer: Any = None) -> dict[str, Any]:
    """The transformers ``config.json`` of a Mamba / Mamba-2 model: each config field under
    the transformers name that loading maps to it (the inverted ``_aliases``), plus
    ``architectures``, ``model_type`` and the tokenizer's special token ids.

    Raises ValueError for an architecture transformers has no class for."""
    arch = getattr(model, "arch", "")
    if arch not in _HF_CLASS:
        raise ValueError(
            f"a {arch or type(model).__name__} model has no transformers format "
            f"(only {', '.join(sorted(_HF_CLASS))}); RWKV models export with format='rwkv'"
        )
    cfg = model.config
    to_hf = {ours: hf for hf, ours in type(cfg)._aliases.items()}
    out: dict[str, Any] = {"architectures": [_HF_CLASS[arch]], "model_type": arch}
    for k, v in cfg.to_dict().items():
        out[to_hf.get(k, k)] = _json_value(v)
    out["hidden_act"] = "silu"
    if arch == "mamba":
        out["intermediate_size"] = cfg.d_inner
        out["time_step_rank"] = cfg.rank  # 0 ("auto") written out
    for key in ("eos", "pad", "bos"):
        v = getattr(tokenizer, f"{key}_id", None) if tokenizer is not None else None
        if v is not None:
            out[f"{key}_token_id"] = int(v)
    return out


def _write_hf(model: Any, folder: Path, tokenizer: Any) -> None:
    cfg = hf_config(model, tokenizer)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_safetensors(folder / "model.safetensors", model.state_dict(), {"format": "pt"})


def _write_rwkv(model: Any, folder: Path) -> str:
    arch = getattr(model, "arch", "")
    if arch not in ("rwkv6", "rwkv7"):
        raise ValueError(
            f"format='rwkv' takes an RWKV-6 or RWKV-7 model, not {arch or type(model).__name__}"
            " (Mamba models export with format='hf')"
        )
    sd = model.state_dict()
    try:
        import torch
    except ImportError:
        save_safetensors(folder / "model.safetensors", sd)
        return "model.safetensors"
    torch.save(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, folder / "model.pth"
    )
    return "model.pth"


def save_pretrained(
    model: Any,
    folder: str | os.PathLike[str],
    tokenizer: Any = None,
    *,
    format: str | None = None,  # noqa: A002 - the user-facing name
    overwrite: bool = False,
) -> Path:
    """Writes ``model`` (and ``tokenizer``'s files) as a folder other tools read.

    ``format`` is "hf" (Mamba / Mamba-2, the default for them) or "rwkv" (RWKV-6 / -7, the
    default for them); see the module docstring. ``tokenizer`` defaults to
    ``model.tokenizer`` (set by ``load_pretrained``). Returns the folder.

    Raises FileExistsError when ``folder`` exists and is not empty (unless ``overwrite``),
    ValueError for a format the architecture does not have."""
    from recurra_models.tokenizers import save_tokenizer

    out = Path(os.fspath(folder))
    arch = getattr(model, "arch", "")
    fmt = format or ("rwkv" if arch.startswith("rwkv") else "hf")
    if fmt not in ("hf", "rwkv"):
        raise ValueError(f"unknown export format {fmt!r}: 'hf' or 'rwkv'")
    if fmt == "hf":
        hf_config(model)  # refuses RWKV before anything is written
    if tokenizer is None:
        tokenizer = getattr(model, "tokenizer", None)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: the folder exists and is not empty (pass overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if fmt == "hf":
            _write_hf(model, tmp, tokenizer)
        else:
            _write_rwkv(model, tmp)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

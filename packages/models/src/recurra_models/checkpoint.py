"""Checkpoints: atomic, resumable, checked on load (used by :class:`recurra_models.Trainer`).

A checkpoint is a folder with four files, each written atomically (temporary file, fsync,
rename):

- ``model.safetensors``: the model's state_dict;
- ``config.json``: ``{"arch": ..., "config": {...}}``;
- ``optimizer.safetensors``: the optimizer's state (``Optimizer.save``);
- ``trainer.json`` (written last): step, seed, data hash, history, scheduler state, extra,
  and the SHA-256 of the three other files, so that a set of files from different saves
  (an interrupted save) is detected on load.

``latest.json`` under a trainer's ``out_dir`` points at the newest complete folder and lists
the folders the trainer wrote (``"checkpoints"``, oldest first): pruning deletes only those.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from recurra_models.loading import (
    confined_path,
    load_safetensors,
    read_json,
    save_safetensors,
    write_atomic,
)

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "load_checkpoint",
    "read_checkpoint_meta",
    "save_checkpoint",
]

FORMAT = "recurra-models-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupted or not matching the model,
    optimizer or data. The message names the file and the problem."""


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# -- checkpoints ---------------------------------------------------------------------------

_FILES = ("model.safetensors", "config.json", "optimizer.safetensors")


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: Any,
    optimizer: Any = None,
    step: int = 0,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Writes a checkpoint folder (see the module docstring); returns its path.

    ``extra`` is any JSON-serialisable dict kept in ``trainer.json``. Raises OSError naming
    the file that could not be written, TypeError when ``extra`` is not JSON-serialisable."""
    d = Path(os.fspath(directory))
    d.mkdir(parents=True, exist_ok=True)
    arch = getattr(model, "arch", type(model).__name__)
    config = model.config.to_dict() if hasattr(model, "config") else {}
    save_safetensors(
        d / "model.safetensors", model.state_dict(), {"format": FORMAT, "arch": str(arch)}
    )
    write_atomic(d / "config.json", json.dumps({"arch": arch, "config": config}, indent=2).encode())
    hashes = {
        "model.safetensors": _file_hash(d / "model.safetensors"),
        "config.json": _file_hash(d / "config.json"),
    }
    if optimizer is not None:
        optimizer.save(d / "optimizer.safetensors")
        hashes["optimizer.safetensors"] = _file_hash(d / "optimizer.safetensors")
    elif (d / "optimizer.safetensors").exists():
        (d / "optimizer.safetensors").unlink()
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "files": hashes,
        "extra": extra or {},
    }
    try:
        blob = json.dumps(meta, indent=2, allow_nan=True).encode()
    except TypeError as e:
        raise TypeError(f"save_checkpoint: extra is not JSON-serialisable ({e})") from None
    write_atomic(d / "trainer.json", blob)
    return d


def _fail(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: {problem}")


def read_checkpoint_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The verified ``trainer.json`` of a checkpoint folder (file hashes checked).

    Raises FileNotFoundError for a missing folder or file, CheckpointError naming the file
    for invalid JSON, another format, or a file whose content does not match its hash."""
    d = Path(os.fspath(directory))
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: checkpoint folder not found")
    tj = d / "trainer.json"
    try:
        meta = read_json(tj, "checkpoint trainer.json")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _fail(tj, "not a recurra-models checkpoint (format field missing or different)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise _fail(tj, f"unsupported checkpoint format version {meta.get('format_version')!r}")
    files = meta.get("files")
    if not isinstance(files, dict) or not isinstance(meta.get("step"), int):
        raise _fail(tj, "malformed: 'files' or 'step' missing")
    for name, digest in files.items():
        try:
            fp = confined_path(d, name, f"{tj} 'files'")
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        if not fp.is_file():
            raise FileNotFoundError(f"{fp}: checkpoint file not found (listed in {tj})")
        if _file_hash(fp) != digest:
            raise _fail(fp, f"corrupted or from another save: its SHA-256 does not match {tj}")
    return meta


def load_checkpoint(
    directory: str | os.PathLike[str], model: Any = None, optimizer: Any = None
) -> dict[str, Any]:
    """Reads a checkpoint folder written by :func:`save_checkpoint`.

    With ``model`` None, a model of the saved architecture and config is created (through
    the registry); otherwise the saved arch and config must equal the model's and the
    weights are copied into it in place. With ``optimizer``, its state is restored too.
    Returns ``{"model", "optimizer", "step", "extra", "config"}``.

    Raises FileNotFoundError for a missing folder or file, CheckpointError (a ValueError)
    naming the file and the problem: corrupted data, a hash mismatch, another architecture
    or config, tensors that do not match the model, optimizer state that does not match."""
    from recurra_models import get_architecture

    d = Path(os.fspath(directory))
    meta = read_checkpoint_meta(d)
    cj = d / "config.json"
    try:
        cfg = read_json(cj, "checkpoint config.json")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(cfg, dict) or "arch" not in cfg or not isinstance(cfg.get("config"), dict):
        raise _fail(cj, "malformed: expected {'arch': ..., 'config': {...}}")
    if model is None:
        try:
            model = get_architecture(cfg["arch"]).from_config(cfg["config"])  # type: ignore[attr-defined]
        except ValueError as e:
            raise _fail(cj, str(e)) from None
    else:
        arch = getattr(model, "arch", type(model).__name__)
        if cfg["arch"] != arch:
            raise _fail(cj, f"the checkpoint is a {cfg['arch']!r} model, the model is {arch!r}")
        mine = model.config.to_dict() if hasattr(model, "config") else {}
        if _norm(mine) != _norm(cfg["config"]):
            diff = sorted(
                k
                for k in set(mine) | set(cfg["config"])
                if _norm(mine.get(k)) != _norm(cfg["config"].get(k))
            )
            shown = ", ".join(
                f"{k}: saved {cfg['config'].get(k)!r} vs model {mine.get(k)!r}" for k in diff[:6]
            )
            raise _fail(cj, f"config does not match the model ({shown})")
    mf = d / "model.safetensors"
    try:
        tensors, _ = load_safetensors(mf)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    # Everything is checked before anything changes: the weights against the model (names,
    # shapes, dtypes), then the optimizer state, which Optimizer.load restores all or nothing;
    # only then are the weights copied in.
    _check_weights(mf, tensors, model)
    if optimizer is not None:
        of = d / "optimizer.safetensors"
        if "optimizer.safetensors" not in meta["files"]:
            raise FileNotFoundError(f"{of}: the checkpoint has no optimizer state")
        try:
            optimizer.load(of)
        except ValueError as e:
            msg = str(e)
            raise CheckpointError(msg if str(of) in msg else f"{of}: {msg}") from None
    try:
        model.load_state_dict(tensors, strict=True)
    except ValueError as e:
        raise _fail(mf, str(e)) from None
    return {
        "model": model,
        "optimizer": optimizer,
        "step": int(meta["step"]),
        "extra": meta.get("extra") or {},
        "config": cfg,
    }


def _check_weights(path: Path, tensors: dict[str, np.ndarray], model: Any) -> None:
    """Raises CheckpointError naming ``path`` unless ``tensors`` has exactly the model's
    state_dict names, each floating point and of the parameter's shape."""
    own = {k: tuple(np.shape(v)) for k, v in model.state_dict().items()}
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    if missing or unexpected:
        parts = [f"missing {missing[:6]}"] if missing else []
        parts += [f"unexpected {unexpected[:6]}"] if unexpected else []
        raise _fail(path, "tensors do not match the model: " + "; ".join(parts))
    for k, shape in own.items():
        arr = tensors[k]
        if arr.dtype.kind != "f":
            raise _fail(path, f"tensor {k!r} is {arr.dtype}, the model's weights are float32")
        if tuple(arr.shape) != shape:
            raise _fail(path, f"tensor {k!r} has shape {tuple(arr.shape)}, the model's {shape}")


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path:
    """The checkpoint folder ``directory`` names: itself when it holds ``trainer.json``,
    else the folder its ``latest.json`` points to (which must lie inside it).

    Raises FileNotFoundError when there is neither, CheckpointError naming latest.json when
    it is malformed or its path leaves the folder."""
    base = Path(os.fspath(directory))
    if (base / "trainer.json").exists():
        return base
    latest = base / "latest.json"
    if not latest.is_file():
        raise FileNotFoundError(f"{latest}: no checkpoint to resume from in {base}")
    try:
        name = read_json(latest, "latest.json")["path"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{latest}: malformed ({e})") from None
    try:
        return confined_path(base, name, f"{latest} 'path'")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _norm(v: Any) -> Any:
    """JSON round trip, so tuples/lists and inf compare as saved."""
    return json.loads(json.dumps(v, allow_nan=True))


def _written_checkpoints(out_dir: Path) -> list[str]:
    """The checkpoint folders a trainer wrote into ``out_dir``, oldest first, from the
    manifest in its ``latest.json`` (empty when there is none or it is unreadable: folders
    nobody listed are never pruned)."""
    try:
        names = json.loads((out_dir / "latest.json").read_text())["checkpoints"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not isinstance(names, list):
        return []
    return [n for n in names if isinstance(n, str) and _CKPT_NAME.fullmatch(n)]


_CKPT_NAME = re.compile(r"ckpt-\d{8,}")

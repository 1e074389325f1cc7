"""Optimizer state files: safetensors, written atomically, checked fully on load.

Layout: one tensor per state entry, named ``state.<param index>.<entry>`` (the step count as
int64 of shape (1,)); the header's ``__metadata__`` holds ``format`` ("recurra-optim"),
``format_version``, ``optimizer``: JSON with the optimizer type, its parameter groups,
the shapes of its parameters, the accumulation and clipping settings and the counters, and
``checksum``: ``sha256:<hex>`` over the metadata and every tensor (name, dtype, shape,
bytes), verified on load (files written before the checksum existed have none and load).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from recurra import write_atomic

if TYPE_CHECKING:
    from recurra_optim.optimizer import Optimizer

FORMAT = "recurra-optim"
FORMAT_VERSION = "1"
_MAX_HEADER = 100 * 1024 * 1024


def _encode(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return value.item()
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__tuple__"}:
        return tuple(_decode(v) for v in value["__tuple__"])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _checksum(tensors: dict[str, np.ndarray], info: str) -> str:
    """``sha256:<hex>`` of the optimizer metadata and of every tensor in name order."""
    h = hashlib.sha256(info.encode())
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        h.update(f"\0{name}\0{arr.dtype.str}\0{list(arr.shape)}\0".encode())
        h.update(arr.tobytes())
    return "sha256:" + h.hexdigest()


def save(opt: Optimizer, path: str | os.PathLike[str]) -> None:
    """Writes opt.state_dict() to ``path`` (see the module docstring) atomically.

    Raises OSError naming the file when it cannot be written; an existing file at ``path``
    is left as it was, and no temporary file is left behind.
    """
    from safetensors.numpy import save as st_save

    path = os.fspath(path)
    sd = opt.state_dict()
    tensors: dict[str, np.ndarray] = {}
    for i, entry in sd["state"].items():
        for k, v in entry.items():
            if k == "step":
                tensors[f"state.{i}.step"] = np.array([v], np.int64)
            else:
                tensors[f"state.{i}.{k}"] = np.ascontiguousarray(v, np.float32)
    shapes = [list(p.shape) for g in opt.param_groups for p in g["params"]]
    meta = {
        "optimizer": sd["optimizer"],
        "param_groups": [{k: _encode(v) for k, v in g.items()} for g in sd["param_groups"]],
        "param_shapes": shapes,
    }
    info = json.dumps(meta)
    blob = st_save(
        tensors,
        metadata={
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "optimizer": info,
            "checksum": _checksum(tensors, info),
        },
    )
    write_atomic(path, blob, "save the optimizer state")


def _header(blob: bytes) -> dict[str, Any]:
    if len(blob) < 8:
        raise ValueError(f"the file is too short to be safetensors ({len(blob)} bytes)")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > _MAX_HEADER or 8 + n > len(blob):
        raise ValueError("the safetensors header length is invalid (truncated or not safetensors)")
    try:
        head = json.loads(blob[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the safetensors header is not valid JSON ({e})") from None
    if not isinstance(head, dict):
        raise ValueError("the safetensors header is not a JSON object")
    return head


def read_state_dict(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[list[int]]]:
    """Reads a file written by :func:`save`; returns (state dict, parameter shapes).

    Raises FileNotFoundError, or ValueError saying what is wrong (not safetensors, corrupt,
    not an optimizer state file, an unknown format version).
    """
    from safetensors.numpy import load as st_load

    with open(path, "rb") as f:
        blob = f.read()
    meta = _header(blob).get("__metadata__") or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"not a recurra optimizer state file (format {meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"unsupported format version {meta.get('format_version')!r} "
            f"(this recurra-optim reads version {FORMAT_VERSION})"
        )
    try:
        tensors = st_load(blob)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"corrupt safetensors data ({type(e).__name__}: {e})") from None
    if "checksum" in meta and meta["checksum"] != _checksum(tensors, str(meta.get("optimizer"))):
        raise ValueError(
            "corrupted: the checksum in the file does not match its data (the file was "
            "damaged after it was written)"
        )
    try:
        info = json.loads(meta["optimizer"])
        groups = [{k: _decode(v) for k, v in g.items()} for g in info["param_groups"]]
        shapes = [list(s) for s in info["param_shapes"]]
        opt_meta = info["optimizer"]
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt optimizer metadata ({type(e).__name__}: {e})") from None
    state: dict[int, dict[str, Any]] = {}
    for name, arr in tensors.items():
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
            raise ValueError(f"unexpected tensor {name!r}")
        entry = state.setdefault(int(parts[1]), {})
        if parts[2] == "step":
            if arr.shape != (1,) or arr.dtype.kind not in "iu":
                raise ValueError(f"tensor {name!r} must be one integer")
            entry["step"] = int(arr[0])
        else:
            entry[parts[2]] = arr
    return {"state": state, "param_groups": groups, "optimizer": opt_meta}, shapes


def load(opt: Optimizer, path: str | os.PathLike[str]) -> None:
    """Restores opt from ``path``. Raises FileNotFoundError, or ValueError naming the file
    and the problem; opt is unchanged when anything is wrong."""
    path = os.fspath(path)
    try:
        sd, shapes = read_state_dict(path)
        mine = [list(p.shape) for g in opt.param_groups for p in g["params"]]
        if len(shapes) != len(mine):
            raise ValueError(
                f"the file holds state for {len(shapes)} parameters, this optimizer has {len(mine)}"
            )
        for i, (a, b) in enumerate(zip(shapes, mine)):
            if a != b:
                raise ValueError(
                    f"parameter {i} has shape {tuple(a)} in the file but "
                    f"{tuple(b)} here (shape mismatch)"
                )
        opt.load_state_dict(sd)
    except ValueError as e:
        raise ValueError(f"{path}: cannot load the optimizer state: {e}") from None

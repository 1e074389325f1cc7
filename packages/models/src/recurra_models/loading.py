"""Loading pretrained weights, and safetensors files read and written with checks.

- :func:`load_pretrained`: a Hugging Face folder (``config.json`` + ``model.safetensors`` or
  a sharded ``model.safetensors.index.json``) of ``MambaForCausalLM`` or
  ``Mamba2ForCausalLM``, or an official RWKV-6 / RWKV-7 checkpoint (``.pth`` through torch,
  or ``.safetensors`` with the same key names).
- :func:`load_safetensors` / :func:`save_safetensors`: the file format, read by a small
  parser of our own (so bfloat16 and float16 weights load into float32 without torch, and a
  damaged file gives an error that says what is wrong), written atomically.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

import recurra as rc
from recurra import write_atomic

__all__ = [
    "confined_path",
    "load_pretrained",
    "load_safetensors",
    "read_json",
    "save_safetensors",
    "write_atomic",
]

_MAX_HEADER = 100 * 1024 * 1024
_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": "bf16",
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}

# -- safetensors ---------------------------------------------------------------------------


def confined_path(folder: str | os.PathLike[str], name: Any, source: str) -> Path:
    """``folder / name`` for a file name read from a file (``source``, named in errors),
    refusing names that could leave the folder: absolute paths, ``..`` components, empty
    or non-string names. The check is on the name itself, so symlinks inside the folder (as
    in a Hugging Face cache snapshot) keep working.

    Raises ValueError naming ``source`` and the offending name."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{source}: expected a file name, got {name!r}")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
        raise ValueError(
            f"{source}: the path {name!r} leaves its folder {os.fspath(folder)!r} (absolute or "
            f"with '..'); only names inside the folder are allowed"
        )
    return Path(os.fspath(folder)) / name


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where its data starts.

    Raises FileNotFoundError, or ValueError naming the file when it is not safetensors
    (too short, a bad header length, a header that is not JSON)."""
    p = os.fspath(path)
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{p}: not a safetensors file (only {len(head)} bytes)")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(
                f"{p}: not a safetensors file, or truncated (header length {n}, file size {size})"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{p}: the safetensors header is not a JSON object")
    return header, 8 + n


def load_safetensors(
    path: str | os.PathLike[str], *, float32: bool = True
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Reads every tensor of a safetensors file.

    Returns (tensors, metadata): float tensors (F64/F32/F16/BF16) as float32 when
    ``float32`` (else in their own dtype: BF16 as ``ml_dtypes.bfloat16``, F16 as
    ``np.float16``), integer tensors in their dtype; metadata is the header's
    ``__metadata__`` (a str -> str dict).

    Raises FileNotFoundError for a missing file and ValueError naming the file and the
    tensor for anything damaged: a bad header, an unknown dtype, offsets outside the data
    or inconsistent with the shape, overlapping tensors, a truncated file."""
    p = os.fspath(path)
    header, start = read_safetensors_header(p)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{p}: the safetensors __metadata__ is not an object")
    with open(p, "rb") as f:
        f.seek(start)
        data = f.read()
    out: dict[str, np.ndarray] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(s) for s in info["shape"])
            lo, hi = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{p}: tensor {name!r} has a malformed header entry {info!r}"
            ) from None
        if dtype not in _DTYPES:
            raise ValueError(f"{p}: tensor {name!r} has unsupported dtype {dtype}")
        count = int(np.prod(shape, dtype=np.int64))
        if any(s < 0 for s in shape) or not 0 <= lo <= hi or hi - lo != count * _SIZES[dtype]:
            raise ValueError(
                f"{p}: tensor {name!r} ({dtype} {list(shape)}) has data offsets [{lo}, {hi}) "
                f"that do not match its size"
            )
        if hi > len(data):
            raise ValueError(
                f"{p}: truncated: tensor {name!r} needs bytes up to {hi} of the data section, "
                f"which has {len(data)}"
            )
        spans.append((lo, hi, name))
        buf = data[lo:hi]
        kind = _DTYPES[dtype]
        if kind == "bf16" and not float32:
            arr = np.frombuffer(buf, dtype="<u2").view(rc.bfloat16.numpy).reshape(shape)
        elif kind == "bf16":
            bits = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32).reshape(shape)
        else:
            arr = np.frombuffer(buf, dtype=np.dtype(kind).newbyteorder("<")).reshape(shape)
            if float32 and arr.dtype.kind == "f":
                arr = arr.astype(np.float32)
            else:
                arr = arr.astype(arr.dtype.newbyteorder("="))
        out[name] = np.array(arr)  # own, writable memory
    spans.sort()
    for (_, hi0, a), (lo1, _, b) in zip(spans, spans[1:]):
        if lo1 < hi0:
            raise ValueError(f"{p}: tensors {a!r} and {b!r} overlap in the data section")
    return out, {str(k): str(v) for k, v in meta.items()}


def save_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes numpy arrays to a safetensors file atomically (see :func:`write_atomic`).

    Raises OSError naming the file when it cannot be written."""
    from safetensors.numpy import save as st_save

    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    blob = st_save(arrays, metadata=dict(metadata) if metadata else None)
    write_atomic(path, blob)


def read_json(path: str | os.PathLike[str], what: str = "JSON file") -> Any:
    """The parsed content of a JSON file.

    Raises FileNotFoundError naming the file, ValueError naming the file, line and column
    for invalid JSON."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"{p}: {what} not found")
    try:
        with open(p, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{p}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
        ) from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text ({e})") from None


# -- pretrained models ---------------------------------------------------------------------

_HF_ARCHS = {
    "MambaForCausalLM": "mamba",
    "Mamba2ForCausalLM": "mamba2",
    "MambaModel": "mamba",
    "Mamba2Model": "mamba2",
}


def _hf_arch(cfg: dict[str, Any], path: str) -> str:
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for a in archs:
        if a in _HF_ARCHS:
            return _HF_ARCHS[a]
    mt = cfg.get("model_type")
    if mt in ("mamba", "mamba2"):
        return str(mt)
    raise ValueError(
        f"{path}: unknown architecture (architectures={archs!r}, model_type={mt!r}); "
        f"supported: MambaForCausalLM (model_type 'mamba'), Mamba2ForCausalLM ('mamba2')"
    )


def _hf_value(v: Any) -> Any:
    """transformers writes non-finite floats as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        return float(v["__float__"])
    if isinstance(v, list):
        return [_hf_value(x) for x in v]
    return v


def _hf_config(arch: str, cfg: dict[str, Any], path: str) -> Any:
    from recurra_models.mamba import MambaConfig
    from recurra_models.mamba2 import Mamba2Config

    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{path}: hidden_act {act!r} is not supported (only 'silu')")
    cls = MambaConfig if arch == "mamba" else Mamba2Config
    keep = {
        k: _hf_value(v)
        for k, v in cfg.items()
        if k in cls._aliases or k in cls.__dataclass_fields__
    }
    if arch == "mamba":
        keep.setdefault("tie_word_embeddings", True)  # transformers' default for Mamba
    else:
        keep.setdefault("tie_word_embeddings", False)
        if isinstance(keep.get("time_step_limit"), list):
            keep["time_step_limit"] = tuple(keep["time_step_limit"])
    try:
        c = cls.from_dict(keep)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if arch == "mamba" and "intermediate_size" in cfg and cfg["intermediate_size"] != c.d_inner:
        raise ValueError(
            f"{path}: intermediate_size {cfg['intermediate_size']} != expand * hidden_size "
            f"({c.d_inner})"
        )
    return c


def _hf_tensors(folder: Path, float32: bool = True) -> tuple[dict[str, np.ndarray], str]:
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return load_safetensors(single, float32=float32)[0], str(single)
    if index.is_file():
        idx = read_json(index, "safetensors index")
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        out: dict[str, np.ndarray] = {}
        shards = {str(confined_path(folder, v, str(index))): v for v in wm.values()}
        for shard in sorted(shards):
            sp = Path(shard)
            if not sp.is_file():
                raise FileNotFoundError(f"{sp}: shard listed in {index} not found")
            out.update(load_safetensors(sp, float32=float32)[0])
        return out, str(index)
    if (folder / "pytorch_model.bin").is_file():
        raise FileNotFoundError(
            f"{single}: not found (the folder has pytorch_model.bin; convert it to "
            f"safetensors, e.g. with transformers' save_pretrained(safe_serialization=True))"
        )
    raise FileNotFoundError(f"{single}: not found (nor model.safetensors.index.json)")


def _load_hf(folder: Path, device: Any, dtype: Any = None) -> Any:
    from recurra_models import get_architecture

    cfg_path = folder / "config.json"
    cfg = read_json(cfg_path, "config.json")
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object")
    arch = _hf_arch(cfg, str(cfg_path))
    config = _hf_config(arch, cfg, str(cfg_path))
    # In a 2-byte dtype the file's tensors are read as they are (no float32 copy of them) and
    # copied into parameters of that dtype.
    half = dtype is not None and rc.DType(dtype) != "float32"
    tensors, src = _hf_tensors(folder, float32=not half)
    # Old checkpoints name the embeddings "embedding" (transformers renames them on load too).
    tensors = {
        k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in tensors.items()
    }
    model = get_architecture(arch)(config)
    if half:
        model.to(rc.DType(dtype))
    try:
        model.load_state_dict(tensors, strict=True)
    except ValueError as e:
        raise ValueError(f"{src}: {e}") from None
    return model.to(device) if device is not None else model


def _torch_state_dict(path: str) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"{path}: reading a .pth checkpoint needs PyTorch (pip install torch), or "
            f"convert it to .safetensors with the same key names"
        ) from None
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for damaged files
        raise ValueError(
            f"{path}: cannot read the PyTorch checkpoint ({type(e).__name__}: {e})"
        ) from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise ValueError(
            f"{path}: expected a state dict (a dict of tensors), got {type(sd).__name__}"
        )
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if hasattr(v, "detach"):
            v = v.detach().to("cpu")
            v = v.float().numpy() if v.is_floating_point() else v.numpy()
        out[str(k)] = v
    return out


def rwkv_version(keys: Any) -> int | None:
    """7 or 6 from the key names of an official RWKV state dict, None when it is neither."""
    ks = set(keys)
    if any(k.endswith(("att.w0", "att.k_k", "att.a0", "att.r_k")) for k in ks):
        return 7
    if any(k.endswith(("att.time_maa_x", "att.time_faaaa", "att.time_decay")) for k in ks):
        return 6
    return None


def _load_rwkv(path: Path, device: Any, dtype: Any = None) -> Any:
    from recurra_models import get_architecture

    p = str(path)
    if path.suffix == ".safetensors":
        sd: dict[str, Any] = dict(load_safetensors(path)[0])
    else:
        sd = _torch_state_dict(p)
    v = rwkv_version(sd)
    if v is None:
        raise ValueError(
            f"{p}: unknown architecture: not an RWKV-6 or RWKV-7 checkpoint (no "
            f"blocks.N.att.time_maa_x / time_faaaa or att.w0 / att.r_k keys)"
        )
    cls = get_architecture(f"rwkv{v}")
    try:
        model = cls.from_official(sd)  # type: ignore[attr-defined]
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
    if dtype is not None:
        model.to(rc.DType(dtype))  # converted after loading in float32 (from_official's)
    return model.to(device) if device is not None else model


def load_pretrained(path: str | os.PathLike[str], device: Any = None, dtype: Any = None) -> Any:
    """A model with pretrained weights.

    ``path`` is a Hugging Face folder (``config.json`` with ``architectures`` /
    ``model_type`` of Mamba or Mamba2, plus ``model.safetensors`` or a sharded index), or an
    official RWKV-6/7 checkpoint file (``.pth``, read through torch; or ``.safetensors`` with
    the official key names), or a folder holding exactly one such file and no config.json.
    Weights of any float dtype (bf16 included) load as float32, unless ``dtype``
    (``recurra.bfloat16`` or ``recurra.float16``) asks for that dtype: a Hugging Face
    folder's tensors are then read and kept in it without a float32 copy of the checkpoint
    (an RWKV checkpoint is converted after loading). ``device`` moves the model.
    ``model.tokenizer`` is the tokenizer stored with it (``tokenizer.json`` with the folder's
    special tokens, or an RWKV World ``rwkv_vocab*.txt`` next to the file), or None.

    Raises FileNotFoundError naming the missing file; ValueError naming the file and the
    problem (invalid JSON, unknown architecture, a missing, unexpected or misshapen tensor,
    a damaged safetensors file); ImportError for a .pth file without torch.
    """
    p = Path(os.fspath(path))
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or folder")
    if dtype is not None and rc.DType(dtype) not in ("float32", "bfloat16", "float16"):
        raise TypeError(f"load_pretrained: dtype must be a float dtype, got {dtype!r}")
    model = _load_any(p, device, dtype)
    from recurra_models.tokenizers import find_tokenizer

    model.tokenizer = find_tokenizer(p)
    return model


def _load_any(p: Path, device: Any, dtype: Any = None) -> Any:
    if p.is_dir():
        if (p / "config.json").is_file():
            return _load_hf(p, device, dtype)
        cands = sorted(q for q in p.iterdir() if q.suffix in (".pth", ".safetensors"))
        if len(cands) == 1:
            return _load_rwkv(cands[0], device, dtype)
        raise FileNotFoundError(
            f"{p / 'config.json'}: not found (a Hugging Face folder needs config.json; an "
            f"RWKV folder needs exactly one .pth or .safetensors file, found {len(cands)})"
        )
    if p.suffix in (".pth", ".pt", ".safetensors"):
        return _load_rwkv(p, device, dtype)
    if p.name == "config.json":
        return _load_hf(p.parent, device, dtype)
    raise ValueError(
        f"{p}: not a checkpoint this loader knows (expected a Hugging Face folder, a .pth or "
        f"a .safetensors file)"
    )

"""Helpers shared by the Vulkan tests (the device gate is the suite's `vulkan` marker, in
tests/conftest.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

import recurra as rc


def cpu(name: str, srcs: list[np.ndarray], ip=(), fp=()) -> np.ndarray:
    """Returns op `name` (integer params ip, float params fp) computed by the core on the
    CPU through recurra's Python API."""
    ts = [rc.tensor(np.ascontiguousarray(s)) for s in srcs]
    return np.asarray(rc.ops.apply(name, ts, ip=ip, fp=fp).numpy())


def grouped_tiles(tiles_m: int, tiles_n: int, group_m: int) -> list[tuple[int, int]]:
    """The (tile row, tile column) the coopmat shaders give each workgroup id in turn: bands
    of group_m tile rows, column by column within a band (matmul_coopmat*.comp)."""
    order = []
    for pid in range(tiles_n * tiles_m):
        per_group = group_m * tiles_n
        first_m = (pid // per_group) * group_m
        rows = min(tiles_m - first_m, group_m)
        order.append((first_m + (pid % per_group) % rows, (pid % per_group) // rows))
    return order


VK_DIR = Path(__file__).resolve().parents[2] / "packages" / "vulkan"
_COMPILER = VK_DIR / "tools" / "coopmat_compiler.py"


def find_coopmat_compiler() -> list[str]:
    """tools/coopmat_compiler.py find: [compiler, libdir, spirv-opt, spirv-val, why not]
    (the compiler "" when none is found)."""
    out = subprocess.run(
        [sys.executable, str(_COMPILER), "find"], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    return [line.strip() for line in out[:5]]


def compile_coopmat(
    found: list[str], src: Path, out: Path, flags: list[str], bf16: bool
) -> subprocess.CompletedProcess:
    """Compiles a coopmat shader as the build does (tools/coopmat_compiler.py compile, with
    the tools find_coopmat_compiler found; bf16: the retyped module)."""
    compiler, libdir, opt, val = found[:4]
    cmd = [sys.executable, str(_COMPILER), "compile", "--compiler", compiler]
    cmd += ["--libdir", libdir, "--opt", opt, "--val", val] + (["--bf16"] if bf16 else [])
    cmd += [str(src), str(out), *flags]
    return subprocess.run(cmd, capture_output=True, text=True)


def op_tiles() -> dict[str, dict[str, int]]:
    """The op's tilings in meson.build: name -> BM BN BK WM WN."""
    text = (VK_DIR / "meson.build").read_text()
    start = text.index("coopmat_op_tiles = [")
    block = text[start : text.index("\n]", start)]
    return {
        m.group(1): {k: int(v) for k, v in re.findall(r"'-D(\w+)=(\d+)'", m.group(2))}
        for m in re.finditer(r"\['(\w+)', \[([^\]]*)\]", block)
    }

"""The core's C++ files can share one translation unit (issue 15: compile time).

packages/core/meson.build compiles most files a few to a unit (meson's unity build: each
unit includes several .cpp files, so the headers are parsed once per unit). Which files end
up together depends on the order and on unity_size, so any two must be able to: no two files
may define the same internal name (an anonymous-namespace or static helper, a constant, a
struct). This compiles every file (but the pybind11 bindings, a unit of their own) as one
unit, syntax only, so a clash shows here and not in whichever grouping meets it first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "packages" / "core"
CSRC = CORE / "csrc"


def test_all_sources_compile_as_one_unit(tmp_path: Path) -> None:
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler (c++ or $CXX) on PATH")
    sources = sorted(p for p in CSRC.rglob("*.cpp") if p.name != "bindings.cpp")
    assert len(sources) > 20, sources
    unit = tmp_path / "all.cpp"
    unit.write_text("".join(f'#include "{p}"\n' for p in sources))
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-I", str(CORE / "src/recurra/include")]
    res = subprocess.run([*cmd, str(unit)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, "\n".join(
        line for line in res.stderr.splitlines() if "error" in line
    )

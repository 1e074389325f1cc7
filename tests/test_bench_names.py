"""Every benchmark runs as `python bench/NAME.py`, which puts bench/ first on sys.path: a
script named like a standard-library module (bench/tokenize.py did) would shadow it for
every other bench script and the peers they import (torch imports `tokenize`)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_no_bench_script_shadows_a_standard_module() -> None:
    clash = sorted(p.name for p in BENCH.glob("*.py") if p.stem in sys.stdlib_module_names)
    assert not clash, f"bench scripts named like standard-library modules: {clash}"

"""Rooms by job (issue 17): no tracked source file grows past MAX_LINES lines. A file that
does is split along its jobs (see packages/core/csrc/ops/ssm_scan/ for an example), not
allowed here: the allowlist is for generated tables only."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 800
SUFFIXES = (".py", ".cpp", ".h", ".comp", ".glsl")

# Generated tables, which may be longer: none today.
GENERATED: dict[str, str] = {}

# Files being split by work already under way, each with the reason; remove an entry as soon
# as its file is below the limit (the test fails while a listed file fits).
PENDING: dict[str, str] = {}


def tracked_sources() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"not a git checkout ({exc})")
    return sorted(p for p in out.decode().split("\0") if p.endswith(SUFFIXES))


def line_count(rel: str) -> int:
    with open(ROOT / rel, "rb") as f:
        return sum(1 for _ in f)


def test_no_source_file_above_the_limit() -> None:
    paths = [p for p in tracked_sources() if (ROOT / p).is_file()]
    assert paths, "no tracked source files found"
    long = {p: n for p in paths if (n := line_count(p)) > MAX_LINES}
    unexpected = {p: n for p, n in long.items() if p not in GENERATED and p not in PENDING}
    assert not unexpected, (
        f"source files above {MAX_LINES} lines (split them by job): "
        + ", ".join(f"{p} ({n})" for p, n in sorted(unexpected.items()))
    )


def test_allowlists_are_current() -> None:
    tracked = set(tracked_sources())
    for name, table in (("GENERATED", GENERATED), ("PENDING", PENDING)):
        for p in table:
            assert p in tracked, f"{name} lists {p}, which is not a tracked source file"
            assert line_count(p) > MAX_LINES, (
                f"{name} lists {p}, which has {line_count(p)} lines now: drop the entry"
            )

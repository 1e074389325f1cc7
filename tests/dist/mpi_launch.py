"""Launching tests/dist/dp_worker.py under mpiexec (a module of its own, not conftest: a
test importing ``conftest`` could get another folder's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def find_mpiexec() -> str | None:
    """mpiexec next to this Python (the `mpich` wheel's, in a venv), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def launch(
    mpiexec: str, n: int, args: list[str], timeout: float = 240.0, wrap: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs ``mpiexec -n n python dp_worker.py ARGS`` (after the command ``wrap``, which
    runs its arguments); a job that outlives ``timeout`` fails the test (its processes are
    killed)."""
    cmd = [*(wrap or []), mpiexec, "-n", str(n), sys.executable, str(HERE / "dp_worker.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", RECURRA_NUM_THREADS="1")
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s:\n{e.stderr}", pytrace=False)

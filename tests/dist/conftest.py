"""The MPI launcher for the recurra_dist tests, and the gate that keeps them from passing
as "all skipped".

Without ``mpiexec`` or recurra-dist (mpi4py) the tests FAIL when the suite runs as CI runs
it (RECURRA_TEST_BACKEND set, as nox's tests sessions do, or RECURRA_EXPECT_MPI=1);
elsewhere they skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

EXPECT_MPI_ENV = "RECURRA_EXPECT_MPI"


def _expect_mpi() -> bool:
    flag = os.environ.get(EXPECT_MPI_ENV, "").strip().lower()
    if flag:
        return flag not in ("0", "false", "no")
    return bool(os.environ.get("RECURRA_TEST_BACKEND") or os.environ.get("CI"))


def find_mpiexec() -> str | None:
    """mpiexec next to this Python (the `mpich` wheel's, in a venv), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def _unavailable(reason: str) -> None:
    if _expect_mpi():
        pytest.fail(
            f"MPI is unavailable: {reason} (set {EXPECT_MPI_ENV}=0 to skip the "
            "recurra_dist tests instead)",
            pytrace=False,
        )
    pytest.skip(f"MPI unavailable: {reason}")


@pytest.fixture(scope="session")
def mpiexec() -> str:
    """The path of mpiexec; fails or skips as the module docstring says when there is none
    or recurra_dist cannot start MPI."""
    try:
        import mpi4py  # noqa: F401 - not mpi4py.MPI: this process does not start MPI

        import recurra_dist  # noqa: F401
    except ImportError as e:
        _unavailable(f"recurra_dist or mpi4py cannot be imported ({e})")
    exe = find_mpiexec()
    if exe is None:
        _unavailable("no mpiexec beside python or on PATH (pip install mpich)")
    assert exe is not None
    return exe


def launch(
    mpiexec: str, n: int, args: list[str], timeout: float = 240.0
) -> subprocess.CompletedProcess[str]:
    """Runs ``mpiexec -n n python dp_worker.py ARGS``; a job that outlives ``timeout``
    fails the test (its processes are killed)."""
    cmd = [mpiexec, "-n", str(n), sys.executable, str(HERE / "dp_worker.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", RECURRA_NUM_THREADS="1")
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s:\n{e.stderr}", pytrace=False)

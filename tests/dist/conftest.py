"""The MPI launcher for the recurra_dist tests, and the gate that keeps them from passing
as "all skipped".

Without ``mpiexec`` or recurra-dist (mpi4py) the tests FAIL when the suite runs as CI runs
it (RECURRA_TEST_BACKEND set, as nox's tests sessions do, or RECURRA_EXPECT_MPI=1);
elsewhere they skip with the reason.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from mpi_launch import find_mpiexec  # noqa: E402 - after the sys.path entry

EXPECT_MPI_ENV = "RECURRA_EXPECT_MPI"


def _expect_mpi() -> bool:
    flag = os.environ.get(EXPECT_MPI_ENV, "").strip().lower()
    if flag:
        return flag not in ("0", "false", "no")
    return bool(os.environ.get("RECURRA_TEST_BACKEND") or os.environ.get("CI"))


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

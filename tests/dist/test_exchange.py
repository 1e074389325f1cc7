"""The pieces of recurra_dist's exchange that need no second rank: the pairwise sum's adding
in threads (which the 2-core CI machine never picks: its ranks leave no core for them) and
the pairwise sum over one rank."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from recurra_dist._exchange import _add_in_order


@pytest.mark.parametrize("n_terms", [2, 3, 4])
@pytest.mark.parametrize("into", ["new", "first", "last"])
def test_threaded_add_is_the_left_to_right_float32_sum(n_terms: int, into: str) -> None:
    rng = np.random.default_rng(n_terms)
    size = 1_000_003  # several pieces of 2**18, the last one shorter
    terms = [rng.standard_normal(size).astype(np.float32) * 10.0**k for k in range(n_terms)]
    ref = terms[0].astype(np.float32)
    for t in terms[1:]:
        ref = ref + t  # float32, left to right
    for threads in (1, 4):
        ts = [t.copy() for t in terms]
        out = {"new": np.empty(size, np.float32), "first": ts[0], "last": ts[-1]}[into]
        with ThreadPoolExecutor(threads) as pool:
            _add_in_order(ts, out, pool if threads > 1 else None, threads)
        assert out.tobytes() == ref.tobytes(), (threads, into)


def test_pairwise_sum_over_one_rank_keeps_the_buffer() -> None:
    code = (
        "import numpy as np\n"
        "from mpi4py import MPI\n"
        "from recurra_dist._exchange import pairwise_sum\n"
        "buf = np.arange(10, dtype=np.float32)\n"
        "pairwise_sum(MPI.COMM_SELF, buf, MPI.Request.Waitall, lambda n: np.empty(n, np.float32))\n"
        "assert buf.tolist() == list(range(10)), buf\n"
        "print('ONE RANK OK')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ONE RANK OK" in r.stdout, r.stdout + r.stderr

"""recurra_dist under mpiexec: N ranks train what one process trains with the same global
batch; a failing rank ends the job; a checkpoint resumes on another number of ranks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from dp_worker import CASES, STEPS, run
from mpi_launch import launch

RTOL = 1e-5


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (per tensor: elements near zero do not blow the ratio up)."""
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def _load(path: Path, case: str) -> tuple[np.ndarray, dict[str, np.ndarray], bool]:
    z = np.load(path)
    prefix = f"{case}/w/"
    weights = {k[len(prefix) :]: z[k] for k in z.files if k.startswith(prefix)}
    weights.pop("@overlapped", None)
    weights.pop("@threaded", None)
    weights.pop("@streamed", None)
    return z[f"{case}/losses"], weights, bool(z[f"{case}/consistent"])


def _overlapped(path: Path, case: str) -> int:
    """How many exchanges of the run began during the backward."""
    return int(np.load(path)[f"{case}/w/@overlapped"])


def _compare(losses: np.ndarray, weights: dict[str, np.ndarray], ref: tuple) -> float:
    ref_losses, ref_weights, _ = ref
    ref_weights = {k: v for k, v in ref_weights.items() if not k.startswith("@")}
    assert len(losses) == len(ref_losses)
    worst = _rel(losses, np.asarray(ref_losses))
    assert set(weights) == set(ref_weights)
    for k, w in weights.items():
        worst = max(worst, _rel(w, ref_weights[k]))
    return worst


def _check_overlap(path: Path, case: str, steps: int) -> None:
    """The overlapped run (the default) began every exchange during the backward, the other
    none, and both end with the same bits."""
    k = int(CASES[case][1].get("accumulate_steps", 1))
    assert _overlapped(path, case) == steps // k, case
    assert _overlapped(path, f"{case}/late") == 0, case
    losses, weights, _ = _load(path, case)
    late_losses, late_weights, same = _load(path, f"{case}/late")
    assert same
    assert losses.tobytes() == late_losses.tobytes(), f"{case}: other losses without overlap"
    for name, w in weights.items():
        assert w.tobytes() == late_weights[name].tobytes(), f"{case}: {name} without overlap"


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple]:
    """One process, no recurra_dist: the whole global batch per step."""
    return {case: run(case, parallel=False) for case in CASES}


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_match_one_process(mpiexec, tmp_path, reference, n):
    out = tmp_path / "res.npz"
    r = launch(mpiexec, n, ["equal", str(out)])
    assert r.returncode == 0, r.stderr
    for case in CASES:
        losses, weights, same = _load(out, case)
        assert same, f"{case}: the {n} ranks ended with different weights"
        worst = _compare(losses, weights, reference[case])
        print(f"{n} ranks, {case}: max rel diff {worst:.2e}")
        assert worst < RTOL, f"{case}: {n} ranks differ from one process by {worst:.2e}"
        # the training did something: the weights moved from the initial ones
        init = run(case, parallel=False, steps=0)[1]
        assert max(_rel(weights[k], init[k]) for k in init) > 1e-4
        _check_overlap(out, case, STEPS)
    _check_blocking(out, reference["sgd"], n)
    _check_thread(out)
    _check_pairwise(out, reference["sgd"], n)


def _check_pairwise(path: Path, ref: tuple, n: int) -> None:
    """collective="pairwise" trains what one process trains; with 2 ranks (a + b: one
    order) bitwise what MPI's sum gives."""
    losses, weights, same = _load(path, "sgd/pairwise")
    assert same, f"sgd, pairwise: the {n} ranks ended with different weights"
    assert _overlapped(path, "sgd/pairwise") == STEPS
    worst = _compare(losses, weights, ref)
    assert worst < RTOL, f"sgd, pairwise: {n} ranks differ by {worst:.2e}"
    # summed and written back in pieces, by pipelined messages: the same bits
    piece_losses, piece_weights, same = _load(path, "sgd/pairwise/pieces")
    assert same and _overlapped(path, "sgd/pairwise/pieces") == STEPS
    assert int(np.load(path)["sgd/pairwise/pieces/w/@streamed"]) > 0
    assert losses.tobytes() == piece_losses.tobytes()
    assert all(w.tobytes() == piece_weights[k].tobytes() for k, w in weights.items())
    if n == 2:
        mpi_losses, mpi_weights, _ = _load(path, "sgd")
        assert losses.tobytes() == mpi_losses.tobytes()
        assert all(w.tobytes() == mpi_weights[k].tobytes() for k, w in weights.items())


def _check_thread(path: Path) -> None:
    """The exchange thread (the default) sums what the caller's thread sums, bit for bit,
    with and without overlap."""
    z = np.load(path)
    for case in ("sgd", "sgd/late"):
        assert bool(z[f"{case}/w/@threaded"]) and not bool(z[f"{case}/nothread/w/@threaded"])
        losses, weights, same = _load(path, case)
        other_losses, other_weights, other_same = _load(path, f"{case}/nothread")
        assert same and other_same
        assert losses.tobytes() == other_losses.tobytes(), case
        for name, w in weights.items():
            assert w.tobytes() == other_weights[name].tobytes(), f"{case}: {name}"


def _check_blocking(path: Path, ref: tuple, n: int) -> None:
    """collective="blocking" (MPI_Allreduce) trains what one process trains too, and began
    every exchange during the backward."""
    losses, weights, same = _load(path, "sgd/blocking")
    assert same, f"sgd with MPI_Allreduce: the {n} ranks ended with different weights"
    worst = _compare(losses, weights, ref)
    assert worst < RTOL, f"sgd with MPI_Allreduce: {n} ranks differ by {worst:.2e}"
    assert _overlapped(path, "sgd/blocking") == STEPS


@pytest.mark.vulkan
def test_ranks_on_vulkan_match_one_process_on_vulkan(mpiexec, vulkan, tmp_path):
    """Gradients in device memory: downloaded into the buckets, averaged, uploaded back."""
    out = tmp_path / "res.npz"
    r = launch(mpiexec, 2, ["equal", str(out), "vulkan"])
    assert r.returncode == 0, r.stderr
    for case in CASES:
        losses, weights, same = _load(out, case)
        assert same, f"{case}: the ranks ended with different weights"
        worst = _compare(losses, weights, run(case, parallel=False, device=vulkan))
        print(f"2 ranks on vulkan, {case}: max rel diff {worst:.2e}")
        assert worst < RTOL, f"{case}: 2 ranks differ from one process by {worst:.2e}"
        _check_overlap(out, case, STEPS)
    _check_blocking(out, run("sgd", parallel=False, device=vulkan), 2)
    _check_thread(out)
    _check_pairwise(out, run("sgd", parallel=False, device=vulkan), 2)


@pytest.mark.parametrize(
    "device, n", [("cpu", 2), ("cpu", 3), pytest.param("vulkan", 2, marks=pytest.mark.vulkan)]
)
def test_profile_exchange_and_argument_checks(mpiexec, device, n, request):
    """DataParallel refuses an unknown collective; profile_exchange() times every bucket and
    leaves the mean of the ranks' gradients, bitwise as sync_gradients() (dp_worker.py)."""
    args = ["exchange"] + ([request.getfixturevalue("vulkan")] if device == "vulkan" else [])
    r = launch(mpiexec, n, args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "EXCHANGE OK" in r.stdout, r.stdout


@pytest.mark.parametrize("n", [1, 2, 3])
def test_pairwise_sums_in_pieces_and_through_shared_memory(mpiexec, n):
    """pairwise_sum in pieces, through shared memory and by its fallback, with and without
    threads: bitwise the float32 rank-order sum (dp_worker.py sum_checks)."""
    r = launch(mpiexec, n, ["sums"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUMS OK" in r.stdout, r.stdout


def test_little_shared_memory_takes_the_messages(mpiexec):
    """A host whose /dev/shm has little room (a container's): the shared windows must not be
    allocated past it (MPICH's window of 32 MB per rank in a 64 MB tmpfs dies of SIGBUS), the
    sums go by messages with the same bits. Runs the ranks in a mount namespace of their own
    with a 64 MB tmpfs on /dev/shm (needs root, as CI has)."""
    mount = "mount -t tmpfs -o size=64m tmpfs /dev/shm"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", mount], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here: {probe.stderr.strip()}")
    cmd = f'{mount} && exec "$0" "$@"'
    r = launch(mpiexec, 2, ["small-shm"], wrap=["unshare", "-m", "sh", "-c", cmd])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SMALL SHM OK" in r.stdout, r.stdout


def test_reference_differs_from_a_smaller_batch(reference):
    """The equality above is not vacuous: training on one rank's share alone (what a
    wrapper that forgot to average would do) gives other weights."""
    import dp_worker

    old = dp_worker.BATCH
    dp_worker.BATCH = old // 2
    try:
        losses, weights, _ = run("sgd", parallel=False)
    finally:
        dp_worker.BATCH = old
    assert _compare(np.asarray(losses), weights, reference["sgd"]) > 1e-3


@pytest.mark.parametrize("how", ["raise", "exit", "kill", "sysexit", "hang"])
def test_failing_rank_ends_the_job(mpiexec, tmp_path, how):
    r = launch(mpiexec, 2, ["fail", how, str(tmp_path)], timeout=120)
    assert r.returncode != 0
    text = r.stdout + r.stderr
    if how == "raise":  # the failing rank's message and traceback
        assert "[rank 1/2]" in text and "boom on rank 1" in text, text
    elif how == "kill":  # the launcher names the signal
        assert "Killed" in text or "signal 9" in text, text
    elif how == "sysexit":  # the exiting rank ends the job with its status, at once
        assert r.returncode == 4 and "[rank 1/2] sys.exit(4)" in text, text
        assert "ExchangeTimeout" not in text, text
    elif how == "hang":  # rank 0 gives up waiting after the 5 s timeout
        assert "[rank 0/2]" in text and "ExchangeTimeout" in text, text
    else:
        assert r.returncode == 3, text  # os._exit(3): its status is the job's
    # the checkpoint of step 1 (or 2) is complete and loads
    from dp_worker import make

    import recurra_models as rm

    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["step"] in (1, 2)
    model, opt = make("adamw_clip")
    out = rm.load_checkpoint(tmp_path / latest["path"], model, opt)
    assert out["step"] == latest["step"]
    assert out["extra"]["world_size"] == 2


def test_resume_on_another_world_size(mpiexec, tmp_path):
    """4 steps on 2 ranks, then on to 8 on 3 ranks == 8 steps in one process."""
    r = launch(mpiexec, 2, ["train", str(tmp_path), "4"])
    assert r.returncode == 0, r.stderr
    r = launch(mpiexec, 3, ["train", str(tmp_path), "8", "--resume"])
    assert r.returncode == 0, r.stderr
    losses, weights, same = _load(tmp_path / "result-8.npz", "adamw_accum")
    assert same
    assert _overlapped(tmp_path / "result-8.npz", "adamw_accum") == STEPS // 2  # 3 ranks
    ref = run("adamw_accum", parallel=False, steps=2 * STEPS)
    worst = _compare(losses, weights, ref)
    print(f"resume 2 -> 3 ranks: max rel diff {worst:.2e}")
    assert worst < RTOL


def test_a_launcher_of_another_mpi_is_refused(tmp_path):
    # mpiexec said the job has 2 processes, but the MPI library mpi4py loaded sees 1 (each
    # process a singleton: the H200's system Open MPI under the mpich wheel's mpiexec). Each
    # rank would train alone; init() refuses instead, naming the library.
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMPI_COMM_WORLD_SIZE="2")
    for var in ("PMI_SIZE", "PMI_RANK", "PMI_FD", "PMI_PORT", "OMPI_COMM_WORLD_RANK"):
        env.pop(var, None)
    code = "import recurra_dist; recurra_dist.init()"
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0
    assert "mpiexec started 2 processes" in r.stderr and "sees a job of 1" in r.stderr, r.stderr

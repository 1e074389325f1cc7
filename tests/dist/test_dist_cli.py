"""`recurra train --nproc N` (mpiexec on this host): the losses of one process, rank 0's
output only, a checkpoint that resumes on another number of processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("recurra_cli")


def _train(tmp_path, nproc: int, *extra: str) -> dict:
    data = tmp_path / "tiny.txt"
    if not data.exists():
        data.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    cmd = [sys.executable, "-m", "recurra_cli", "train", "--model", "mamba"]
    cmd += ["--data", str(data), "--json", "--batch-size", "6", "--seq-len", "8", "--lr", "0.01"]
    if "--resume" not in extra:
        cmd += ["--config", "d_model=16", "--config", "n_layer=1"]
    cmd += extra
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    env = dict(os.environ, OMP_NUM_THREADS="1", RECURRA_NUM_THREADS="1")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} hung:\n{e.stderr}", pytrace=False)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, r.stdout  # one JSON object: rank 0's
    return json.loads(lines[0])


def test_nproc_gives_the_losses_of_one_process_and_resumes_on_another_count(mpiexec, tmp_path):
    one = _train(tmp_path, 1, "--steps", "4")
    two = _train(tmp_path, 2, "--steps", "2", "--out", str(tmp_path / "run"))
    assert two["processes"] == 2 and two["exchange_s_per_step"] > 0
    three = _train(tmp_path, 3, "--steps", "4", "--out", str(tmp_path / "run"), "--resume")
    assert three["processes"] == 3 and three["resumed_from"] == 2
    got = two["losses"] + three["losses"]
    assert len(got) == 4
    for a, b in zip(got, one["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (got, one["losses"])

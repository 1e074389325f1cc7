"""The demo on Vulkan: the same block, weights and batches on the CPU and on the Vulkan
backend (lavapipe in CI) must AGREE, with every recurrent node placed on the GPU, both in
lockstep (the verdict) and along the free-running curves."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

recurra_cli = pytest.importorskip("recurra_cli.main")

pytestmark = pytest.mark.vulkan


def test_demo_agrees_between_cpu_and_vulkan(vulkan: str) -> None:
    result = CliRunner().invoke(
        recurra_cli.app, ["demo", "mamba-train", "--backend", "both", "--small", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    runs = {r["backend"]: r for r in report["runs"]}
    assert set(runs) == {"cpu", "vulkan"}
    # the GPU run really ran on the GPU: a CPU fallback would make the comparison vacuous
    assert set(runs["vulkan"]["placement"].values()) == {"vulkan:0"}, runs["vulkan"]
    assert runs["vulkan"]["n_splits"] == 1
    assert all(r["verdict"] == "OK" for r in runs.values()), runs
    assert report["comparison"]["status"] == "AGREE", report["comparison"]
    assert report["comparison"]["max_rel_gap"] < 1e-3
    # the verdict comes from the lockstep comparison: Vulkan computed the loss and every
    # gradient at the CPU run's parameters, every step, within rounding of the CPU's
    lock = report["comparison"]["lockstep"]
    assert lock["against"] == "vulkan" and lock["steps"] == 40 * 24, lock
    assert set(lock["max_rel_gap"]) == {"loss", *(f"grad.{k}" for k in "conv dt A B C".split())}
    assert lock["worst_gap"] <= lock["tol"] / 10, lock  # rounding, far below the tolerance

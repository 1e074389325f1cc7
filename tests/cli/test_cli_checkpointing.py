"""`recurra train --gradient-checkpointing`: the same run (the same losses, bitwise), with each
block's forward recomputed in the backward."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from recurra_cli.main import app

runner = CliRunner()


def _losses_of(tmp_path, model: str, config: list[str], variants: list[list[str]]) -> list:
    """The --json losses of a 3-step `recurra train` run per variant (extra flags)."""
    pytest.importorskip("recurra_models")
    data = tmp_path / "tiny.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    args = ["train", "--model", model, "--data", str(data), "--steps", "3", "--json"]
    args += ["--batch-size", "2", "--seq-len", "16"]
    for c in config:
        args += ["--config", c]
    losses = []
    for extra in variants:
        res = runner.invoke(app, [*args, *extra])
        assert res.exit_code == 0, res.output
        losses.append(json.loads(res.stdout)["losses"])
    return losses


def test_train_with_gradient_checkpointing_gives_the_same_losses(tmp_path):
    losses = _losses_of(
        tmp_path, "mamba", ["d_model=16", "n_layer=2"], [[], ["--gradient-checkpointing"]]
    )
    assert len(losses[1]) == 3 and losses[0] == losses[1]


def test_train_captured_and_uncaptured_give_the_same_losses(tmp_path):
    config = ["d_model=16", "n_layer=2", "head_dim=8", "d_state=8"]
    losses = _losses_of(tmp_path, "mamba2", config, [["--no-capture"], ["--capture"]])
    assert len(losses[1]) == 3 and losses[0] == losses[1] and losses[0][0] != losses[0][-1]

"""`recurra train --gradient-checkpointing`: the same run (the same losses, bitwise), with each
block's forward recomputed in the backward."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from recurra_cli.main import app

runner = CliRunner()


def test_train_with_gradient_checkpointing_gives_the_same_losses(tmp_path):
    pytest.importorskip("recurra_models")
    data = tmp_path / "tiny.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    args = ["train", "--model", "mamba", "--data", str(data), "--steps", "3", "--json"]
    args += ["--batch-size", "2", "--seq-len", "16", "--config", "d_model=16"]
    args += ["--config", "n_layer=2"]
    losses = []
    for extra in ([], ["--gradient-checkpointing"]):
        res = runner.invoke(app, [*args, *extra])
        assert res.exit_code == 0, res.output
        losses.append(json.loads(res.stdout)["losses"])
    assert len(losses[1]) == 3 and losses[0] == losses[1]


def test_train_captured_and_uncaptured_give_the_same_losses(tmp_path):
    pytest.importorskip("recurra_models")
    data = tmp_path / "tiny.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    args = ["train", "--model", "mamba2", "--data", str(data), "--steps", "3", "--json"]
    args += ["--batch-size", "2", "--seq-len", "16", "--config", "d_model=16"]
    args += ["--config", "n_layer=2", "--config", "head_dim=8", "--config", "d_state=8"]
    losses = []
    for extra in (["--no-capture"], ["--capture"]):
        res = runner.invoke(app, [*args, *extra])
        assert res.exit_code == 0, res.output
        losses.append(json.loads(res.stdout)["losses"])
    assert len(losses[1]) == 3 and losses[0] == losses[1] and losses[0][0] != losses[0][-1]

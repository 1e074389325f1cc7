"""`recurra train --precision`: bf16 and f16 runs end to end on a tiny model; checkpoints
keep float32 weights; a bad value is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from recurra_cli.main import app

runner = CliRunner()
TEXT = "the quick brown fox jumps over the lazy dog. " * 60


def _run(tmp_path: Path, precision: str, out: str) -> dict:
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    args = ["train", "--model", "mamba2", "--config", "d_model=16", "--config", "n_layer=1"]
    args += ["--config", "d_state=4", "--config", "head_dim=8", "--data", str(data)]
    args += ["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--lr", "1e-2"]
    args += ["--precision", precision, "--out", str(tmp_path / out), "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_train_precision_end_to_end(tmp_path: Path, precision: str) -> None:
    import recurra_models as rm

    ref = _run(tmp_path, "fp32", "ref")
    rec = _run(tmp_path, precision, "run")
    assert rec["precision"] == precision and ref["precision"] == "fp32"
    assert rec["last_step"] == 4
    if precision == "bf16":
        assert rec["skipped_steps"] == 0
        # the same batches: the first loss (same weights) agrees to bf16 precision
        assert rec["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-2)
        assert rec["losses"][0] != ref["losses"][0]
    else:  # the default scale 2^16 may overflow at first: those steps are skipped
        assert 0 <= rec["skipped_steps"] < 4
    ck = rm.load_checkpoint(tmp_path / "run" / "ckpt-00000004")
    for name, arr in ck["model"].state_dict().items():
        assert np.asarray(arr).dtype == np.float32, name
    meta = json.loads((tmp_path / "run" / "ckpt-00000004" / "trainer.json").read_text())
    assert meta["extra"]["precision"] == precision
    assert (meta["extra"]["loss_scale"] is not None) == (precision == "f16")


def test_train_precision_refused(tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    res = runner.invoke(
        app, ["train", "--model", "mamba2", "--data", str(data), "--precision", "int8"]
    )
    assert res.exit_code == 2
    assert "--precision" in res.output

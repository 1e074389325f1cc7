"""Training: resumed runs reproduce the uninterrupted loss curve, checkpoints round-trip,
damaged or mismatched checkpoints raise errors that name the file and the problem."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import recurra_models as rm
from recurra_models.training import CheckpointError, batch_at
from recurra_optim import AdamW

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 40


def _setup(arch: str = "mamba", d_model: int = 16):
    kw = {"head_dim": 8} if arch == "mamba2" else {}
    model = rm.create(arch, vocab_size=256, d_model=d_model, n_layer=2, d_state=4, seed=1, **kw)
    return model, AdamW(list(model.parameters()), lr=3e-3, weight_decay=0.01)


def _trainer(model, opt, out_dir, steps, **kw):
    data = rm.ByteTokenizer().encode(TEXT)
    return rm.Trainer(
        model, opt, data, batch_size=2, seq_len=16, steps=steps, out_dir=out_dir, seed=5, **kw
    )


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_resume_reproduces_the_loss_curve(tmp_path: Path, arch: str) -> None:
    events: list[dict] = []
    full = _trainer(*_setup(arch), tmp_path / "full", 6).fit(events.append)
    assert [r["step"] for r in full] == [1, 2, 3, 4, 5, 6]
    assert {e["kind"] for e in events} == {"step", "checkpoint", "done"}

    first = _trainer(*_setup(arch), tmp_path / "split", 3)
    first.fit()
    m2, o2 = _setup(arch)
    second = _trainer(m2, o2, tmp_path / "split", 6)
    assert second.resume() == 3
    hist = second.fit()
    assert [r["loss"] for r in hist] == [r["loss"] for r in full]  # exactly equal
    assert hist[-1]["loss"] < hist[0]["loss"]
    # and the final weights are equal too
    ref = full_model_state = rm.load_checkpoint(tmp_path / "full" / "ckpt-00000006")["model"]
    for (n, a), (_, b) in zip(full_model_state.state_dict().items(), m2.state_dict().items()):
        np.testing.assert_array_equal(a, b, err_msg=n)
    assert ref.arch == arch


def test_checkpoint_round_trip_and_eval(tmp_path: Path) -> None:
    model, opt = _setup("mamba2")
    data = rm.ByteTokenizer().encode(TEXT)
    tr = rm.Trainer(
        model,
        opt,
        data,
        batch_size=2,
        seq_len=16,
        steps=4,
        eval_data=data[:200],
        eval_every=2,
        out_dir=tmp_path,
        checkpoint_every=1,
        keep=2,
    )
    hist = tr.fit()
    assert "eval_loss" in hist[1] and "eval_loss" in hist[3] and "eval_loss" not in hist[0]
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-00000003", "ckpt-00000004"]
    assert json.loads((tmp_path / "latest.json").read_text())["step"] == 4
    assert not list(tmp_path.rglob("*.tmp"))  # no temporary files left behind
    out = rm.load_checkpoint(tmp_path / "ckpt-00000004")
    t = np.array([[72, 101, 108]], np.int32)
    np.testing.assert_array_equal(out["model"](t).numpy(), model(t).numpy())
    assert out["step"] == 4 and out["extra"]["seed"] == 0
    x, y = batch_at(data, 3, 8, seed=2, step=7)
    x2, y2 = batch_at(data, 3, 8, seed=2, step=7)
    assert (x == x2).all() and (y == y2).all() and (x[:, 1:] == y[:, :-1]).all()


def test_damaged_and_mismatched_checkpoints_raise(tmp_path: Path) -> None:
    model, opt = _setup()
    ck = rm.save_checkpoint(tmp_path / "ck", model, opt, step=3)
    assert rm.load_checkpoint(ck, model, opt)["step"] == 3

    # flip one byte of the weights: the hash in trainer.json no longer matches
    mf = ck / "model.safetensors"
    blob = bytearray(mf.read_bytes())
    blob[-3] ^= 0xFF
    mf.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupted"):
        rm.load_checkpoint(ck, model, opt)

    ck = rm.save_checkpoint(tmp_path / "ck2", model, opt, step=3)
    (ck / "trainer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"trainer.json: invalid JSON"):
        rm.load_checkpoint(ck)

    ck = rm.save_checkpoint(tmp_path / "ck3", model, opt, step=3)
    (ck / "optimizer.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"optimizer.safetensors"):
        rm.load_checkpoint(ck, model, opt)

    ck = rm.save_checkpoint(tmp_path / "ck4", model, opt, step=3)
    other, other_opt = _setup(d_model=32)
    with pytest.raises(CheckpointError, match=r"config.json: config does not match.*d_model"):
        rm.load_checkpoint(ck, other, other_opt)
    m2, o2 = _setup("mamba2")
    with pytest.raises(CheckpointError, match=r"config.json: the checkpoint is a 'mamba' model"):
        rm.load_checkpoint(ck, m2, o2)
    # an optimizer over other parameters
    small_opt = AdamW(list(model.parameters())[:3], lr=1e-3)
    with pytest.raises(CheckpointError, match=r"optimizer.safetensors"):
        rm.load_checkpoint(ck, model, small_opt)

    with pytest.raises(FileNotFoundError, match="nothing-here"):
        rm.load_checkpoint(tmp_path / "nothing-here")


def test_resume_refuses_other_data_or_settings(tmp_path: Path) -> None:
    _trainer(*_setup(), tmp_path, 2).fit()
    m, o = _setup()
    other = rm.Trainer(
        m,
        o,
        rm.ByteTokenizer().encode(TEXT[::-1]),
        batch_size=2,
        seq_len=16,
        steps=4,
        out_dir=tmp_path,
        seed=5,
    )
    with pytest.raises(CheckpointError, match=r"trainer.json: .*different data"):
        other.resume()
    tr = _trainer(m, o, tmp_path, 4)
    tr.seq_len = 8
    with pytest.raises(CheckpointError, match=r"seq_len differs"):
        tr.resume()
    with pytest.raises(FileNotFoundError, match="latest.json"):
        _trainer(m, o, tmp_path / "empty", 4).resume()
    with pytest.raises(ValueError, match="seq_len"):
        rm.Trainer(m, o, np.arange(5), batch_size=1, seq_len=8, steps=1)
    with pytest.raises(ValueError, match="batch_size"):
        rm.Trainer(m, o, np.arange(50), batch_size=0, seq_len=8, steps=1)


def test_encode_file(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_text("abc\n", encoding="utf-8")
    np.testing.assert_array_equal(rm.ByteTokenizer().encode_file(p), [97, 98, 99, 10])
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        rm.ByteTokenizer().encode_file(tmp_path / "nope.txt")


def test_fit_prints_progress_and_checkpoints_periodically_by_default(tmp_path: Path, capsys):
    events: list[dict] = []
    tr = _trainer(*_setup(), tmp_path, 20)
    assert (tr.checkpoint_every, tr.log_every) == (2, 1)  # a tenth, a twentieth of the run
    tr.fit(events.append)
    saved = [e["step"] for e in events if e["kind"] == "checkpoint"]
    assert saved == list(range(2, 21, 2))
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-00000018", "ckpt-00000020"]
    err = capsys.readouterr().err.splitlines()
    steps = [line for line in err if line.startswith("step ") and "loss" in line]
    assert len(steps) == 20 and steps[0].startswith("step 1/20  loss ")
    assert "ETA" in steps[0] and "tokens/s" in steps[0] and "ETA" not in steps[-1]
    assert any(line.endswith("ckpt-00000020") for line in err)

    quiet = _trainer(*_setup(), tmp_path / "quiet", 3, log_every=0, checkpoint_every=0)
    assert quiet.checkpoint_every == 0
    quiet.fit()
    assert capsys.readouterr().err == ""
    assert [p.name for p in (tmp_path / "quiet").glob("ckpt-*")] == ["ckpt-00000003"]
    long = _trainer(*_setup(), None, 100_000)
    assert (long.checkpoint_every, long.log_every) == (1000, 100)


def test_presets_stays_the_function_after_its_module_is_imported() -> None:
    # The package's presets() shares its name with the module recurra_models.presets:
    # importing that module must not rebind the package's name to it.
    import subprocess
    import sys

    code = (
        "import recurra_models as rm, recurra_models.presets; "
        "assert 'mamba2-130m' in rm.presets(), rm.presets"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr

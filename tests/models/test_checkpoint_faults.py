"""Fault cases of checkpoints and optimizer files (issue 14): a refused load changes nothing,
pruning deletes only what the trainer wrote, damaged optimizer files are detected, and file
names read from a checkpoint cannot leave its folder."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import recurra_models as rm
from recurra_models import training
from recurra_models.training import CheckpointError
from recurra_optim import SGD, AdamW

TEXT = "It was the best of times, it was the worst of times. " * 20


def _model(seed: int = 1):
    return rm.create("mamba", vocab_size=256, d_model=16, n_layer=2, d_state=4, seed=seed)


def _trainer(model, opt, out_dir, steps, **kw):
    data = rm.ByteTokenizer().encode(TEXT)
    return rm.Trainer(
        model, opt, data, batch_size=2, seq_len=16, steps=steps, out_dir=out_dir, seed=5, **kw
    )


def _weights(model) -> dict[str, bytes]:
    return {k: np.asarray(v).tobytes() for k, v in model.state_dict().items()}


def _opt_state(opt) -> str:
    sd = opt.state_dict()
    h = hashlib.sha256(repr(sd["param_groups"]).encode() + repr(sd["optimizer"]).encode())
    for i in sorted(sd["state"]):
        for k, v in sorted(sd["state"][i].items()):
            h.update(f"{i}.{k}".encode() + np.asarray(v).tobytes())
    return h.hexdigest()


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _rehash(ckpt: Path, name: str) -> None:
    """Updates trainer.json after a test rewrote one of the checkpoint's files, so that only
    the content problem (not the hash) is what the load meets."""
    tj = ckpt / "trainer.json"
    meta = json.loads(tj.read_text())
    meta["files"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    tj.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A two-step run: out_dir with ckpt-00000002 (model + AdamW state)."""
    out = tmp_path_factory.mktemp("run")
    model = _model()
    _trainer(model, AdamW(list(model.parameters()), lr=3e-3), out, 2).fit()
    return out


# -- 4: a failed load changes nothing ----------------------------------------------------------


def _mismatched_optimizers(model):
    params = list(model.parameters())
    return {
        "another type": SGD(params, lr=0.1, momentum=0.9),
        "fewer parameters": AdamW(params[:-1], lr=3e-3),
    }


@pytest.mark.parametrize("case", ["another type", "fewer parameters"])
def test_a_load_refused_for_the_optimizer_leaves_model_and_optimizer_as_they_were(
    saved: Path, case: str
) -> None:
    model = _model(seed=7)  # other weights than the checkpoint's
    opt = _mismatched_optimizers(model)[case]
    before, opt_before = _weights(model), _opt_state(opt)
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        rm.load_checkpoint(saved / "ckpt-00000002", model, opt)
    assert _weights(model) == before  # not one weight overwritten
    assert _opt_state(opt) == opt_before


def test_a_refused_resume_changes_nothing(saved: Path) -> None:
    model = _model(seed=7)
    opt = AdamW(list(model.parameters())[:-1], lr=3e-3)
    tr = _trainer(model, opt, saved, 4)
    before, files = _weights(model), _files(saved)
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        tr.resume()
    assert _weights(model) == before and tr.step == 0 and tr.history == []
    assert _files(saved) == files


def test_a_refused_resume_leaves_the_scheduler_as_it_was(tmp_path: Path) -> None:
    from recurra_optim import StepLR

    model = _model()
    opt = AdamW(list(model.parameters()), lr=3e-3)
    _trainer(model, opt, tmp_path, 3, scheduler=StepLR(opt, step_size=1, gamma=0.5)).fit()
    model = _model(seed=7)
    opt = AdamW(list(model.parameters())[:-1], lr=3e-3)
    sched = StepLR(opt, step_size=1, gamma=0.5)
    before = dict(sched.state_dict())
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        _trainer(model, opt, tmp_path, 6, scheduler=sched).resume()
    assert sched.state_dict() == before


@pytest.mark.parametrize(
    "change, needle",
    [
        ("int", "int32, the model's weights are float32"),
        ("shape", "has shape"),
        ("extra", "tensors do not match the model: unexpected ['extra.weight']"),
        ("missing", "tensors do not match the model: missing ["),
    ],
)
def test_weights_that_do_not_match_are_refused_before_anything_changes(
    saved: Path, tmp_path: Path, change: str, needle: str
) -> None:
    from recurra_models.loading import load_safetensors, save_safetensors

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt-00000002", ckpt)
    tensors, meta = load_safetensors(ckpt / "model.safetensors")
    last = sorted(tensors)[-1]
    if change == "int":
        tensors[last] = tensors[last].astype(np.int32)
    elif change == "shape":
        tensors[last] = tensors[last].reshape(-1)[:-1]
    elif change == "extra":
        tensors["extra.weight"] = np.zeros(3, np.float32)
    else:
        del tensors[last]
    save_safetensors(ckpt / "model.safetensors", tensors, meta)
    _rehash(ckpt, "model.safetensors")
    model = _model(seed=7)
    opt = AdamW(list(model.parameters()), lr=3e-3)
    before, opt_before = _weights(model), _opt_state(opt)
    with pytest.raises(CheckpointError, match="model.safetensors") as e:
        rm.load_checkpoint(ckpt, model, opt)
    assert needle in str(e.value)
    assert _weights(model) == before and _opt_state(opt) == opt_before


def test_a_good_load_still_restores_everything(saved: Path) -> None:
    model = _model(seed=7)
    opt = AdamW(list(model.parameters()), lr=3e-3)
    out = rm.load_checkpoint(saved / "ckpt-00000002", model, opt)
    assert out["step"] == 2
    assert _weights(model) == _weights(rm.load_checkpoint(saved / "ckpt-00000002")["model"])
    assert opt.state_dict()["optimizer"]["step_count"] == 2


# -- 5: pruning deletes only what the trainer wrote ---------------------------------------------


def test_pruning_keeps_folders_the_trainer_did_not_write(tmp_path: Path) -> None:
    out = tmp_path / "run"
    model = _model()
    _trainer(model, AdamW(list(model.parameters()), lr=3e-3), out, 2).fit()
    shutil.copytree(out / "ckpt-00000002", out / "ckpt-best")  # the user's copy
    (out / "ckpt-notes").mkdir()
    (out / "ckpt-notes" / "todo.txt").write_text("mine")
    (out / "ckpt-99999999").mkdir()  # named like a checkpoint, but not written by this run
    (out / "ckpt-99999999" / "keep.txt").write_text("mine too")
    user = {n: _files(out / n) for n in ("ckpt-best", "ckpt-notes", "ckpt-99999999")}

    model = _model()
    opt = AdamW(list(model.parameters()), lr=3e-3)
    tr = _trainer(model, opt, out, 5, checkpoint_every=1, keep=1)
    tr.resume()
    tr.fit()
    names = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert names == ["ckpt-00000005", "ckpt-99999999", "ckpt-best", "ckpt-notes"]
    assert {n: _files(out / n) for n in user} == user  # byte for byte
    latest = json.loads((out / "latest.json").read_text())
    assert latest["path"] == "ckpt-00000005" and latest["checkpoints"] == ["ckpt-00000005"]
    # the user's copy is still a usable checkpoint
    assert rm.load_checkpoint(out / "ckpt-best")["step"] == 2


def test_keep_two_prunes_the_oldest_written(tmp_path: Path) -> None:
    out = tmp_path / "run"
    model = _model()
    _trainer(model, AdamW(list(model.parameters()), lr=3e-3), out, 4, checkpoint_every=1).fit()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "ckpt-00000003",
        "ckpt-00000004",
    ]


# -- 7: optimizer files have a checksum ---------------------------------------------------------


def _opt_file(tmp_path: Path) -> tuple[AdamW, Path]:
    model = _model()
    opt = AdamW(list(model.parameters()), lr=3e-3)
    tr = _trainer(model, opt, None, 1)
    tr.fit()
    path = tmp_path / "opt.safetensors"
    opt.save(path)
    return opt, path


def test_an_optimizer_file_with_a_flipped_data_byte_is_refused(tmp_path: Path) -> None:
    opt, path = _opt_file(tmp_path)
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0x01  # one bit of the last tensor's data: still valid safetensors
    path.write_bytes(bytes(blob))
    fresh = AdamW(list(_model(seed=3).parameters()), lr=3e-3)
    before = _opt_state(fresh)
    with pytest.raises(ValueError, match="checksum") as e:
        fresh.load(path)
    assert str(path) in str(e.value) and "corrupted" in str(e.value)
    assert _opt_state(fresh) == before


def test_an_optimizer_file_without_a_checksum_still_loads(tmp_path: Path) -> None:
    from safetensors.numpy import load, save

    from recurra_models.loading import read_safetensors_header

    opt, path = _opt_file(tmp_path)
    meta = read_safetensors_header(path)[0]["__metadata__"]
    assert meta["checksum"].startswith("sha256:")
    del meta["checksum"]  # as written before the checksum existed
    path.write_bytes(save(load(path.read_bytes()), metadata=meta))
    fresh = AdamW(list(_model(seed=3).parameters()), lr=3e-3)
    fresh.load(path)
    assert _opt_state(fresh) == _opt_state(opt)


def test_a_checkpoint_with_a_flipped_byte_in_any_file_is_refused(saved: Path, tmp_path) -> None:
    for name in ("model.safetensors", "optimizer.safetensors", "config.json"):
        ckpt = tmp_path / name
        shutil.copytree(saved / "ckpt-00000002", ckpt)
        blob = bytearray((ckpt / name).read_bytes())
        blob[-2] ^= 0x01
        (ckpt / name).write_bytes(bytes(blob))
        model = _model(seed=7)
        before = _weights(model)
        with pytest.raises(CheckpointError, match=name):
            rm.load_checkpoint(ckpt, model, AdamW(list(model.parameters()), lr=3e-3))
        assert _weights(model) == before


# -- 10: names read from files stay in their folder ---------------------------------------------


@pytest.mark.parametrize("bad", ["../elsewhere", "/tmp/elsewhere", "ckpt-00000002/../../x"])
def test_latest_json_cannot_point_outside_its_folder(saved: Path, tmp_path: Path, bad) -> None:
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(saved / "ckpt-00000002", tmp_path / "elsewhere")  # a real checkpoint
    (out / "latest.json").write_text(json.dumps({"step": 2, "path": bad}))
    with pytest.raises(CheckpointError, match="leaves its folder") as e:
        training.latest_checkpoint(out)
    assert "latest.json" in str(e.value)
    model = _model(seed=7)
    tr = _trainer(model, AdamW(list(model.parameters()), lr=3e-3), out, 4)
    before = _weights(model)
    with pytest.raises(CheckpointError, match="leaves its folder"):
        tr.resume()
    assert _weights(model) == before and tr.step == 0


def test_trainer_json_files_cannot_name_files_outside(saved: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt-00000002", ckpt)
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    meta = json.loads((ckpt / "trainer.json").read_text())
    meta["files"]["../secret.txt"] = hashlib.sha256(secret.read_bytes()).hexdigest()
    (ckpt / "trainer.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="leaves its folder") as e:
        rm.load_checkpoint(ckpt)
    assert "trainer.json" in str(e.value) and "../secret.txt" in str(e.value)


def test_shard_names_cannot_leave_the_folder(tmp_path: Path) -> None:
    from recurra_models.loading import save_safetensors

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["MambaForCausalLM"],
                "hidden_size": 16,
                "num_hidden_layers": 1,
                "vocab_size": 256,
                "state_size": 4,
            }
        )
    )
    save_safetensors(tmp_path / "outside.safetensors", {"w": np.zeros(2, np.float32)})
    for bad in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        index = {"weight_map": {"backbone.embeddings.weight": bad}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ValueError, match="leaves its folder") as e:
            rm.load_pretrained(folder)
        assert "model.safetensors.index.json" in str(e.value)

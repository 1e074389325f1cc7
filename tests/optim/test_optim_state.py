"""state_dict / load_state_dict (exact round trip, checked before anything changes) and
save / load with safetensors (atomic writes; bad files named with the problem, the disk and
the optimizer left intact)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import recurra
import recurra_optim as optim

RNG = np.random.default_rng(11)


def trained(cls: type = optim.Adam, steps: int = 3, **kw: Any) -> tuple[Any, list[Any]]:
    ps = [recurra.param(RNG.standard_normal(s).astype(np.float32)) for s in ((3, 4), (5,))]
    opt = cls([{"params": [ps[0]]}, {"params": [ps[1]], "lr": 0.05}], **kw)
    for _ in range(steps):
        for p in ps:
            p.grad = recurra.tensor(RNG.standard_normal(p.shape).astype(np.float32))
        opt.step()
    return opt, ps


def fresh_like(opt: Any, **kw: Any) -> tuple[Any, list[Any]]:
    ps = [
        recurra.param(np.zeros(p.shape, np.float32)) for g in opt.param_groups for p in g["params"]
    ]
    return type(opt)([{"params": [ps[0]]}, {"params": [ps[1]]}], **kw), ps


def assert_sd_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    assert a["param_groups"] == b["param_groups"]
    assert a["optimizer"] == b["optimizer"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        ea, eb = a["state"][i], b["state"][i]
        assert ea.keys() == eb.keys()
        for k in ea:
            if k == "step":
                assert ea[k] == eb[k]
            else:
                assert ea[k].dtype == eb[k].dtype == np.float32
                np.testing.assert_array_equal(ea[k], eb[k])  # bit for bit


def snapshot(opt: Any) -> dict[str, Any]:
    return opt.state_dict()


@pytest.mark.parametrize(
    "cls,kw",
    [
        (optim.Adam, {}),
        (optim.AdamW, dict(accumulate_steps=3, average=False, max_grad_norm=2.5)),
        (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, clip_value=0.5)),
        (optim.SGD, dict(lr=0.1)),
        (optim.Lion, dict(weight_decay=0.1)),
    ],
)
def test_state_dict_round_trip_is_exact(cls: type, kw: dict[str, Any]) -> None:
    opt, _ = trained(cls, steps=4, **kw)
    sd = opt.state_dict()
    other, _ = fresh_like(opt)
    other.load_state_dict(sd)
    assert_sd_equal(other.state_dict(), sd)
    # The copies are independent of the optimizer's own buffers.
    sd["state"][0]["step"] = 99
    assert other.state_dict()["state"][0]["step"] != 99


def test_loaded_state_continues_exactly() -> None:
    opt, ps = trained(optim.Adam, steps=3)
    other, qs = fresh_like(opt)
    other.load_state_dict(opt.state_dict())
    for p, q in zip(ps, qs):
        q.assign_(p.numpy())
    for _ in range(3):
        for p, q in zip(ps, qs):
            g = RNG.standard_normal(p.shape).astype(np.float32)
            p.grad, q.grad = recurra.tensor(g), recurra.tensor(g)
        opt.step()
        other.step()
    for p, q in zip(ps, qs):
        np.testing.assert_array_equal(p.numpy(), q.numpy())


def test_load_state_dict_keeps_the_buffers_in_place() -> None:
    opt, _ = trained(optim.Adam)
    other, qs = fresh_like(opt)
    bufs = [other.state[q]["exp_avg"]._value for q in qs]
    other.load_state_dict(opt.state_dict())
    assert all(other.state[q]["exp_avg"]._value is b for q, b in zip(qs, bufs))
    np.testing.assert_array_equal(
        other.state[qs[0]]["exp_avg"].numpy(), opt.state_dict()["state"][0]["exp_avg"]
    )


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda sd: sd["optimizer"].update(type="SGD"), "SGD optimizer"),
        (lambda sd: sd["param_groups"].pop(), "parameter groups"),
        (lambda sd: sd["param_groups"][0]["params"].append(7), "parameters in the state"),
        (lambda sd: sd["state"][0].update(exp_avg=np.zeros((4, 3), np.float32)), "shape mismatch"),
        (lambda sd: sd["state"][1].pop("exp_avg_sq"), "lacks"),
        (lambda sd: sd["state"][1].update(momentum_buffer=np.zeros(5, np.float32)), "unexpected"),
        (lambda sd: sd["state"][0].update(step=-1), "step count"),
        (lambda sd: sd["param_groups"][1].update(betas=(2.0, 0.9)), "beta"),
        (lambda sd: sd["optimizer"].update(accumulate_steps=0), "accumulate_steps"),
        (lambda sd: sd.pop("state"), "not an optimizer state dict"),
    ],
)
def test_bad_state_dicts_raise_and_change_nothing(mutate: Any, msg: str) -> None:
    opt, _ = trained(optim.Adam)
    sd = opt.state_dict()
    before = snapshot(opt)
    mutate(sd)
    with pytest.raises(ValueError, match=msg):
        opt.load_state_dict(sd)
    assert_sd_equal(snapshot(opt), before)


# ---- files -------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    opt, _ = trained(optim.AdamW, steps=2, accumulate_steps=2, max_grad_norm=1.0)
    path = tmp_path / "opt.safetensors"
    opt.save(path)
    other, _ = fresh_like(opt)
    other.load(str(path))
    assert_sd_equal(other.state_dict(), opt.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["opt.safetensors"]  # no temporary file left


def test_save_overwrites_atomically_and_a_failed_save_leaves_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "opt.safetensors"
    opt, ps = trained(optim.Adam, steps=1)
    opt.save(path)
    original = path.read_bytes()
    for p in ps:
        p.grad = recurra.tensor(np.ones(p.shape, np.float32))
    opt.step()

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="opt.safetensors.*No space left"):
        opt.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == original
    assert sorted(os.listdir(tmp_path)) == ["opt.safetensors"]
    opt.save(path)  # a successful save replaces it
    assert path.read_bytes() != original


def test_save_to_a_missing_folder_names_the_file(tmp_path: Path) -> None:
    opt, _ = trained(optim.SGD, lr=0.1)
    with pytest.raises(OSError, match="nowhere"):
        opt.save(tmp_path / "nowhere" / "opt.safetensors")


def _expect_bad_file(opt: Any, path: Path, msg: str) -> None:
    before = snapshot(opt)
    content = path.read_bytes()
    with pytest.raises(ValueError, match=msg) as info:
        opt.load(path)
    assert str(path) in str(info.value)  # the error names the file
    assert_sd_equal(snapshot(opt), before)  # the optimizer is unchanged
    assert path.read_bytes() == content  # and so is the file


def test_truncated_file(tmp_path: Path) -> None:
    opt, _ = trained(optim.Adam)
    path = tmp_path / "opt.safetensors"
    opt.save(path)
    path.write_bytes(path.read_bytes()[:-20])
    _expect_bad_file(opt, path, "corrupt|invalid")


def test_garbage_file(tmp_path: Path) -> None:
    opt, _ = trained(optim.Adam)
    path = tmp_path / "opt.safetensors"
    path.write_bytes(b"\x00\x01not a safetensors file at all" * 3)
    _expect_bad_file(opt, path, "header")
    path.write_bytes(b"abc")
    _expect_bad_file(opt, path, "too short")


def test_corrupt_header_json(tmp_path: Path) -> None:
    opt, _ = trained(optim.Adam)
    path = tmp_path / "opt.safetensors"
    head = b"{not json"
    path.write_bytes(len(head).to_bytes(8, "little") + head)
    _expect_bad_file(opt, path, "not valid JSON")


def test_a_plain_safetensors_file_is_not_optimizer_state(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    opt, _ = trained(optim.Adam)
    path = tmp_path / "weights.safetensors"
    save_file({"w": np.zeros(3, np.float32)}, str(path))
    _expect_bad_file(opt, path, "not a recurra optimizer state file")


def test_file_of_another_optimizer(tmp_path: Path) -> None:
    sgd, _ = trained(optim.SGD, lr=0.1, momentum=0.9)
    path = tmp_path / "sgd.safetensors"
    sgd.save(path)
    opt, _ = trained(optim.Adam)
    _expect_bad_file(opt, path, "SGD optimizer")


def test_file_of_other_parameters(tmp_path: Path) -> None:
    opt, _ = trained(optim.Adam)
    path = tmp_path / "opt.safetensors"
    opt.save(path)
    ps = [recurra.param(np.zeros((4, 3), np.float32)), recurra.param(np.zeros(5, np.float32))]
    other = optim.Adam([{"params": [ps[0]]}, {"params": [ps[1]]}])
    _expect_bad_file(other, path, r"shape \(3, 4\) in the file but \(4, 3\) here")
    three = optim.Adam([recurra.param(np.zeros(2, np.float32)) for _ in range(3)])
    _expect_bad_file(three, path, "2 parameters")


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    opt, _ = trained(optim.Adam)
    with pytest.raises(FileNotFoundError):
        opt.load(tmp_path / "absent.safetensors")

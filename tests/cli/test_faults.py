"""Fault cases of the ``recurra`` command (issue 14): each ends in one ``error:`` line and a
non-zero exit, never a traceback, and nothing a user saved is lost."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from recurra_cli.main import app

rm = pytest.importorskip("recurra_models")

runner = CliRunner()
TINY = ["--config", "d_model=16", "--config", "n_layer=1", "--batch-size", "2", "--seq-len", "16"]


def _data(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.txt"
    p.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    return p


def _train(data: Path, out: Path | str, steps: int = 1, *extra: str) -> list[str]:
    args = ["train", "--model", "mamba", "--data", str(data), "--steps", str(steps)]
    return [*args, "--out", str(out), "--json", *TINY, *extra]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def assert_one_line_error(res, code: int, *needles: str) -> str:
    """The command exited ``code`` through one ``error:`` line, no traceback."""
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def no_training(monkeypatch):
    """Counts training steps: a refused run must fail before the first one."""
    calls: list[int] = []
    real = rm.Trainer.train_step

    def counted(self, step):
        calls.append(step)
        return real(self, step)

    monkeypatch.setattr(rm.Trainer, "train_step", counted)
    return calls


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> tuple[Path, Path]:
    """(data file, --out folder of a finished 2-step run)."""
    tmp = tmp_path_factory.mktemp("cli-run")
    data, out = _data(tmp), tmp / "run"
    res = runner.invoke(app, _train(data, out, 2))
    assert res.exit_code == 0, res.output
    return data, out


# -- 8: paths that cannot be written are found before training --------------------------------


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here")
def test_out_under_proc_is_refused_before_training(tmp_path, no_training) -> None:
    res = runner.invoke(app, _train(_data(tmp_path), "/proc/recurra-run"))
    assert_one_line_error(res, 2, "--out '/proc/recurra-run'", "not a writable folder")
    assert no_training == []


def _read_only(monkeypatch) -> None:
    """The write check meets a read-only folder (as root, chmod does not stop writes)."""
    import recurra_cli.train as train_cmd

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(train_cmd.tempfile, "NamedTemporaryFile", refuse)


def test_out_read_only_is_refused_before_training(tmp_path, monkeypatch, no_training) -> None:
    _read_only(monkeypatch)
    res = runner.invoke(app, _train(_data(tmp_path), tmp_path / "ro"))
    assert_one_line_error(res, 2, "ro'", "not a writable folder", "Permission denied")
    assert no_training == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes anyway")
def test_out_chmod_read_only_is_refused_before_training(tmp_path, no_training) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        res = runner.invoke(app, _train(_data(tmp_path), ro))
    finally:
        ro.chmod(0o755)
    assert_one_line_error(res, 2, "not a writable folder")
    assert no_training == []


def test_resume_into_a_read_only_folder(run_dir, monkeypatch, no_training) -> None:
    data, out = run_dir
    before = _files(out)
    _read_only(monkeypatch)
    args = ["train", "--resume", "--out", str(out), "--data", str(data), "--steps", "4"]
    res = runner.invoke(app, [*args, "--batch-size", "2", "--seq-len", "16", "--json"])
    assert_one_line_error(res, 2, str(out), "not a writable folder")
    assert no_training == [] and _files(out) == before


def test_a_failed_checkpoint_write_is_one_line(tmp_path, monkeypatch) -> None:
    import recurra_models.training as tr

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tr, "save_checkpoint", disk_full)
    res = runner.invoke(app, _train(_data(tmp_path), tmp_path / "run"))
    assert_one_line_error(res, 1, "cannot write the checkpoint", "No space left")


# -- 8: bad numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize("lr", ["inf", "nan", "-1", "-inf"])
def test_bad_learning_rates(tmp_path, lr, no_training) -> None:
    res = runner.invoke(app, _train(_data(tmp_path), tmp_path / "run", 1, "--lr", lr))
    assert_one_line_error(res, 2, "--lr must be a finite number >= 0")
    assert no_training == [] and not (tmp_path / "run").exists()


def test_a_huge_batch_size_is_out_of_memory_not_a_traceback(tmp_path) -> None:
    args = _train(_data(tmp_path), tmp_path / "run")
    args[args.index("--batch-size") + 1] = str(10**15)
    res = runner.invoke(app, args)
    assert_one_line_error(res, 1, "out of memory", "--batch-size 1000000000000000")


# -- 8: generate -------------------------------------------------------------------------------


def test_generate_prompt_with_a_byte_that_is_not_utf8(run_dir) -> None:
    _, out = run_dir
    # a \xff byte on the command line reaches Python as the surrogate escape \udcff
    args = ["generate", "--checkpoint", str(out), "--prompt", "ab\udcffc", "--max-tokens", "2"]
    res = runner.invoke(app, [*args, "--temperature", "0", "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert json.loads(res.stdout)["prompt"] == "ab\ufffdc"
    res = runner.invoke(app, [*args[:4], "a\ud800", "--max-tokens", "2"])
    assert_one_line_error(res, 2, "--prompt")


def test_generate_negative_seed(run_dir) -> None:
    _, out = run_dir
    args = ["generate", "--checkpoint", str(out), "--prompt", "a", "--seed", "-1"]
    assert_one_line_error(runner.invoke(app, args), 2, "--seed must be >= 0")


# -- 9: a second run does not destroy the first; Ctrl-C exits 130 -----------------------------


def test_a_second_run_into_the_same_out_is_refused(run_dir, no_training) -> None:
    data, out = run_dir
    before = _files(out)
    res = runner.invoke(app, _train(data, out, 1))
    assert_one_line_error(res, 2, str(out), "earlier run", "--resume", "--overwrite")
    assert no_training == [] and _files(out) == before
    res = runner.invoke(app, _train(data, out / "ckpt-00000002", 1))  # a checkpoint folder
    assert_one_line_error(res, 2, "earlier run")
    res = runner.invoke(app, _train(data, out, 1, "--resume", "--overwrite"))
    assert_one_line_error(res, 2, "exclude each other")
    assert _files(out) == before


def test_overwrite_replaces_the_earlier_run(tmp_path) -> None:
    data, out = _data(tmp_path), tmp_path / "run"
    assert runner.invoke(app, _train(data, out, 3)).exit_code == 0
    res = runner.invoke(app, _train(data, out, 1, "--overwrite", "--lr", "0.01"))
    assert res.exit_code == 0, res.output
    assert json.loads((out / "latest.json").read_text())["step"] == 1


def test_ctrl_c_exits_130_after_writing_the_checkpoint(tmp_path, monkeypatch) -> None:
    real = rm.Trainer.train_step

    def interrupt_once(self, step):
        loss = real(self, step)
        if step == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return loss

    monkeypatch.setattr(rm.Trainer, "train_step", interrupt_once)
    out = tmp_path / "run"
    res = runner.invoke(app, _train(_data(tmp_path), out, 50))
    assert res.exit_code == 130, res.output
    assert json.loads(res.stdout)["interrupted"] is True
    assert json.loads((out / "latest.json").read_text())["step"] == 1


def test_a_second_ctrl_c_exits_130_in_one_line(tmp_path, monkeypatch) -> None:
    def interrupt(self, step):
        raise KeyboardInterrupt

    monkeypatch.setattr(rm.Trainer, "train_step", interrupt)
    res = runner.invoke(app, _train(_data(tmp_path), tmp_path / "run", 5))
    assert_one_line_error(res, 130, "interrupted")


# -- 10: paths read from files stay in their folder; bench runs only what it is given ---------


@pytest.mark.parametrize("bad", ["../elsewhere", "/etc"])
def test_latest_json_pointing_outside(run_dir, tmp_path, bad) -> None:
    import shutil

    _, out = run_dir
    run = tmp_path / "run"
    shutil.copytree(out, run)
    (run / "latest.json").write_text(json.dumps({"step": 2, "path": bad}))
    args = ["generate", "--checkpoint", str(run), "--prompt", "a", "--max-tokens", "1"]
    assert_one_line_error(runner.invoke(app, args), 2, "latest.json", "leaves its folder")


def test_bench_never_runs_a_bench_folder_found_from_the_cwd(tmp_path, monkeypatch) -> None:
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "common.py").write_text("")
    marker = tmp_path / "ran"
    (bench / "core.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(bench)
    res = runner.invoke(app, ["bench", "ops"])
    assert_one_line_error(res, 2, "--bench-dir", "not installed")
    assert not marker.exists()
    res = runner.invoke(app, ["bench", "ops", "--bench-dir", str(bench), "--json"])
    assert res.exit_code == 0, res.output
    assert marker.exists()  # given explicitly, it runs


# -- 11: the demo's verdict comes from a lockstep comparison ----------------------------------


def test_demo_lockstep_catches_one_wrong_gradient_element(monkeypatch) -> None:
    import numpy as np

    from recurra_cli import demo_mamba as dm

    cfg = dm.DemoConfig.small(epochs=3)
    clean = dm.compare(dm.train(cfg, "cpu", shadow="cpu"), dm.train(cfg, "cpu"))
    assert clean["status"] == "AGREE", clean
    assert clean["lockstep"]["steps"] == 3 * cfg.n_samples
    assert set(clean["lockstep"]["max_rel_gap"]) == {
        "loss",
        "grad.conv",
        "grad.dt",
        "grad.A",
        "grad.B",
        "grad.C",
    }
    assert clean["lockstep"]["worst_gap"] < 1e-6  # the same backend: rounding-free

    created: list[object] = []
    real_init, real_step = dm.MambaBlockGraph.__init__, dm.MambaBlockGraph.step

    def init(self, *a, **k):
        real_init(self, *a, **k)
        created.append(self)

    def faulty_step(self, params, batch):
        loss, grads = real_step(self, params, batch)
        if self is created[1]:  # the lockstep twin: one element of one gradient is off by 1%
            g = grads["B"].copy()
            g.flat[3] += 0.01 * float(np.abs(g).max())
            grads["B"] = g
        return loss, grads

    monkeypatch.setattr(dm.MambaBlockGraph, "__init__", init)
    monkeypatch.setattr(dm.MambaBlockGraph, "step", faulty_step)
    lead = dm.train(cfg, "cpu", shadow="cpu")
    monkeypatch.setattr(dm.MambaBlockGraph, "step", real_step)
    bad = dm.compare(lead, dm.train(cfg, "cpu"))
    assert bad["status"].startswith("MISMATCH") and "grad.B" in bad["status"], bad
    assert bad["lockstep"]["worst"] == "grad.B"
    assert bad["lockstep"]["worst_gap"] > 5 * dm.LOCKSTEP_TOL  # about 1e-2
    assert bad["lockstep"]["max_rel_gap"]["loss"] < 1e-6  # the loss itself agreed
    # the free-running curves are still reported, as information
    assert bad["max_rel_gap"] == clean["max_rel_gap"] == 0.0


# -- 8: usage errors are one line too ----------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "--model", "mamba", "--data", "x.txt", "--steps", "0"], "'--steps'"),
        (["train", "--bogus"], "--bogus"),
        (["generate", "--prompt", "a"], "one of --model PATH or --checkpoint DIR"),
        (["nosuch"], "nosuch"),
    ],
)
def test_usage_errors_are_one_line(args, needle) -> None:
    assert_one_line_error(runner.invoke(app, args), 2, needle)

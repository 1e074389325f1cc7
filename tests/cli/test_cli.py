"""The `recurra` command, through typer's CliRunner and as a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from recurra_cli.main import app

runner = CliRunner()


def test_demo_full_size_trains_ok_json():
    """The default demo (d_state 128, 16 heads of 64, 64 tokens, 16 samples, 60 epochs)."""
    res = runner.invoke(app, ["demo", "mamba-train", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    cfg, run = out["config"], out["runs"][0]
    assert (cfg["d_state"], cfg["n_head"], cfg["head_dim"], cfg["epochs"]) == (128, 16, 64, 60)
    assert run["verdict"] == "OK"
    assert run["final_loss"] < 0.5 * out["baseline"]


def test_demo_small_trains_ok_json():
    res = runner.invoke(app, ["demo", "mamba-train", "--small", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    run = out["runs"][0]
    assert run["backend"] == "cpu"
    assert run["verdict"] == "OK"
    assert run["final_loss"] < 0.5 * out["baseline"]
    assert run["placement"] == {"ssm_conv": "cpu", "ssm_scan": "cpu", "loss": "cpu"}
    assert len(run["history"]) == out["config"]["epochs"]


def test_demo_bad_arguments_are_usage_errors():
    res = runner.invoke(app, ["demo", "mamba-train", "--backend", "tpu"])
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    res = runner.invoke(app, ["demo", "mamba-train", "--small", "--plot", "curve.txt"])
    assert res.exit_code == 2


def test_devices_lists_the_cpu():
    res = runner.invoke(app, ["devices", "--json"])
    assert res.exit_code == 0, res.output
    names = [b["name"] for b in json.loads(res.stdout)]
    assert names[-1] == "cpu"


def test_console_script_runs():
    exe = shutil.which("recurra")
    cmd = [exe] if exe else [sys.executable, "-m", "recurra_cli"]
    p = subprocess.run(
        [*cmd, "demo", "mamba-train", "--small", "--epochs", "30"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK" in p.stdout


# ---- recurra check-backends ------------------------------------------------------------------


def test_check_backends_cpu_self_check_json():
    res = runner.invoke(app, ["check-backends", "--backend", "cpu", "--op", "add", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["backends"] == ["cpu"] and doc["exit_code"] == 0
    assert {r["op"] for r in doc["results"]} == {"add"}
    for r in doc["results"]:
        assert r["verdict"] == "ok" and r["forward_nmse"] == 0.0
        assert list(r["placement"]) == ["cpu"]


def test_check_backends_table_and_list():
    res = runner.invoke(app, ["check-backends", "--backend", "cpu", "--op", "ssm_conv"])
    assert res.exit_code == 0, res.output
    assert "ssm_conv" in res.stdout and "PASS" in res.stdout and "d_conv4" in res.stdout
    res = runner.invoke(app, ["check-backends", "--list"])
    assert res.exit_code == 0
    for op in ("ssm_scan", "rwkv_wkv7", "gated_linear_attn", "matmul"):
        assert op in res.stdout


def test_check_backends_reports_a_mismatch_with_exit_1(monkeypatch):
    from recurra import check_backends as cb

    real = cb._run_case

    def wrong_on_the_backend_side(case, data, backend):
        run = real(case, data, None if backend is None else "cpu")
        if backend is not None:
            run.outputs[0] = run.outputs[0] * 2
        return run

    monkeypatch.setattr(cb, "_run_case", wrong_on_the_backend_side)
    res = runner.invoke(app, ["check-backends", "--backend", "cpu", "--op", "exp"])
    assert res.exit_code == 1, res.output
    assert "MISMATCH" in res.stdout and "FAIL" in res.stdout


def test_check_backends_usage_errors_and_no_device(monkeypatch):
    res = runner.invoke(app, ["check-backends", "--op", "not_an_op"])
    assert res.exit_code == 2 and "not_an_op" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["check-backends", "--backend", "tpu"])
    assert res.exit_code == 2 and "unknown backend" in res.output
    from recurra import check_backends as cb

    monkeypatch.setattr(cb, "device_backends", lambda: [])
    res = runner.invoke(app, ["check-backends"])
    assert res.exit_code == 3 and "no backend other than the CPU" in res.output
    res = runner.invoke(app, ["check-backends", "--allow-cpu-only"])
    assert res.exit_code == 0
    res = runner.invoke(app, ["check-backends", "--json"])
    assert res.exit_code == 3 and json.loads(res.stdout)["exit_code"] == 3


# ---- recurra bench ---------------------------------------------------------------------------

FAKE_SUITE = """
import json, sys
if "--bad" in sys.argv:
    print("usage: core.py: error: unrecognized arguments", file=sys.stderr)
    sys.exit(2)
print("## fake suite")
print("JSON " + json.dumps({"bench": "fake", "argv": sys.argv[1:]}))
sys.exit(1 if "--crash" in sys.argv else 0)
"""


def fake_bench(tmp_path):
    d = tmp_path / "repo" / "bench"
    d.mkdir(parents=True)
    (d / "common.py").write_text("")
    (d / "core.py").write_text(FAKE_SUITE)
    return d


def test_bench_runs_a_suite_with_extra_args(tmp_path):
    d = fake_bench(tmp_path)
    args = ["bench", "ops", "--bench-dir", str(d.parent), "--json", "--", "--only", "x"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["bench_dir"] == str(d.resolve())
    assert doc["suites"]["ops"]["result"] == {"bench": "fake", "argv": ["--only", "x"]}
    res = runner.invoke(app, ["bench", "ops", "--bench-dir", str(d)])
    assert res.exit_code == 0 and "## fake suite" in res.stdout
    assert "JSON" not in res.stdout  # the machine-read line is for --json only


def test_bench_exit_codes_of_failing_suites(tmp_path):
    d = fake_bench(tmp_path)
    res = runner.invoke(app, ["bench", "ops", "--bench-dir", str(d), "--", "--crash"])
    assert res.exit_code == 1
    res = runner.invoke(app, ["bench", "ops", "--bench-dir", str(d), "--", "--bad"])
    assert res.exit_code == 2
    # `all` skips suites this checkout lacks; naming one is an error
    res = runner.invoke(app, ["bench", "all", "--bench-dir", str(d), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert "skipped" in doc["suites"]["models"] and doc["suites"]["ops"]["exit_code"] == 0
    res = runner.invoke(app, ["bench", "models", "--bench-dir", str(d)])
    assert res.exit_code == 2 and "models.py not found" in res.output


def test_bench_needs_the_folder_given(tmp_path, monkeypatch):
    from recurra_cli.bench import find_bench_dir

    d = fake_bench(tmp_path)
    assert find_bench_dir(d) == find_bench_dir(d.parent) == d.resolve()
    # never found from the current directory upwards (see tests/cli/test_faults.py)
    monkeypatch.chdir(d)
    res = runner.invoke(app, ["bench", "ops", "--json"])
    assert res.exit_code == 2 and "pass --bench-dir" in " ".join(res.output.split())


def test_bench_usage_errors(tmp_path):
    res = runner.invoke(app, ["bench", "ops"])
    assert res.exit_code == 2 and "not installed" in res.output
    assert "Traceback" not in res.output
    res = runner.invoke(app, ["bench", "ops", "--bench-dir", str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and "not a bench folder" in res.output
    res = runner.invoke(app, ["bench", "fast"])
    assert res.exit_code == 2 and "unknown suite" in res.output
    res = runner.invoke(app, ["bench", "--help"])
    assert res.exit_code == 0 and "recurrent" in res.stdout


def test_console_script_check_backends_and_bench_help():
    exe = shutil.which("recurra")
    cmd = [exe] if exe else [sys.executable, "-m", "recurra_cli"]
    p = subprocess.run(
        [*cmd, "check-backends", "--backend", "cpu", "--op", "softmax", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert all(r["verdict"] == "ok" for r in json.loads(p.stdout)["results"])
    p = subprocess.run([*cmd, "bench", "--help"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "--bench-dir" in p.stdout


# ---- recurra train / generate ----------------------------------------------------------------

TINY = {
    "mamba": ["d_model=16", "n_layer=1"],
    "mamba2": ["d_model=16", "n_layer=1", "head_dim=8"],
    "rwkv6": ["n_embd=16", "n_layer=1", "head_size=8", "d_mix_lora=4", "d_decay_lora=4"],
    "rwkv7": ["n_embd=16", "n_layer=1", "head_size=8"],
}


def text_file(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    return p


def train_args(arch, data, out, steps, *extra):
    args = ["train", "--model", arch, "--data", str(data), "--steps", str(steps)]
    args += ["--batch-size", "2", "--seq-len", "16", "--out", str(out), "--json"]
    for c in TINY[arch]:
        args += ["--config", c]
    return args + list(extra)


@pytest.mark.parametrize("arch", list(TINY))
def test_train_then_generate_end_to_end(arch, tmp_path):
    pytest.importorskip("recurra_models")
    data, out = text_file(tmp_path), tmp_path / "run"
    res = runner.invoke(app, train_args(arch, data, out, 4))
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["model"] == arch and rec["last_step"] == 4 and len(rec["losses"]) == 4
    # an untrained byte model starts near ln 256 = 5.55
    assert abs(rec["losses"][0] - np.log(256)) < 0.5
    assert (out / "latest.json").is_file()
    args = ["generate", "--checkpoint", str(out), "--prompt", "the quick", "--max-tokens", "12"]
    res = runner.invoke(app, [*args, "--temperature", "0", "--json"])
    assert res.exit_code == 0, res.output
    gen = json.loads(res.stdout)
    assert gen["model"] == arch and len(gen["tokens"]) == 12
    assert all(0 <= t < 256 for t in gen["tokens"])
    # greedy decoding is deterministic, and the text is the decoded bytes
    again = json.loads(runner.invoke(app, [*args, "--temperature", "0", "--json"]).stdout)
    assert again["tokens"] == gen["tokens"]
    assert gen["text"] == bytes(gen["tokens"]).decode("utf-8", errors="replace")


def test_resumed_training_reproduces_the_uninterrupted_run(tmp_path):
    pytest.importorskip("recurra_models")
    data = text_file(tmp_path)
    full = runner.invoke(app, train_args("mamba", data, tmp_path / "full", 6))
    assert full.exit_code == 0, full.output
    first = runner.invoke(app, train_args("mamba", data, tmp_path / "part", 3))
    assert first.exit_code == 0, first.output
    args = ["train", "--resume", "--out", str(tmp_path / "part"), "--data", str(data)]
    args += ["--steps", "6", "--batch-size", "2", "--seq-len", "16", "--json"]
    second = runner.invoke(app, args)
    assert second.exit_code == 0, second.output
    rec = json.loads(second.stdout)
    assert rec["resumed_from"] == 3 and rec["model"] == "mamba"
    resumed = json.loads(first.stdout)["losses"] + rec["losses"]
    assert resumed == json.loads(full.stdout)["losses"]
    # a resume with another batch shape is refused, naming the difference
    res = runner.invoke(app, [*args[:-5], "--batch-size", "4", "--seq-len", "16"])
    assert res.exit_code == 2 and "batch_size differs" in res.output
    res = runner.invoke(app, [*args, "--steps", "6"])  # already at step 6
    assert res.exit_code == 2 and "raise --steps" in res.output


def test_train_and_generate_user_errors(tmp_path):
    pytest.importorskip("recurra_models")
    data = text_file(tmp_path)
    cases = [
        (["train", "--model", "mamba", "--data", str(tmp_path / "nope.txt")], 2, "not found"),
        (["train", "--model", "gpt", "--data", str(data)], 2, "unknown --model"),
        (["train", "--data", str(data)], 2, "--model is required"),
        (["train", "--model", "mamba", "--data", str(data), "--resume"], 2, "needs --out"),
        (["train", "--model", "mamba", "--data", str(data), "--device", "tpu"], 2, "tpu"),
        (["train", "--model", "mamba", "--data", str(data), "--config", "x"], 2, "KEY=VALUE"),
        (["train", "--model", "mamba", "--data", str(data), "--config", "bogus=1"], 2, "bogus"),
        (["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "a"], 2, "not exist"),
        (["generate", "--checkpoint", str(tmp_path), "--prompt", "a"], 2, "no checkpoint"),
    ]
    (tmp_path / "empty.txt").write_text("")
    cases.append((["train", "--model", "mamba", "--data", str(tmp_path / "empty.txt")], 2, "empty"))
    for args, code, needle in cases:
        res = runner.invoke(app, args)
        assert res.exit_code == code, (args, res.output)
        assert needle in " ".join(res.output.split()), (args, res.output)
        assert "Traceback" not in res.output
        assert res.exception is None or isinstance(res.exception, SystemExit)


def test_ctrl_c_stops_after_the_step_and_writes_a_checkpoint(tmp_path, monkeypatch):
    rm = pytest.importorskip("recurra_models")
    real_step = rm.Trainer.train_step

    def step_then_interrupt(self, step):
        loss = real_step(self, step)
        if step == 1:  # during the second step, as a user pressing Ctrl-C would
            os.kill(os.getpid(), signal.SIGINT)
        return loss

    monkeypatch.setattr(rm.Trainer, "train_step", step_then_interrupt)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when started in the background
    data, out = text_file(tmp_path), tmp_path / "run"
    res = runner.invoke(app, train_args("mamba", data, out, 50))
    assert res.exit_code == 130, res.output  # interrupted, after saving the checkpoint
    rec = json.loads(res.stdout)
    assert rec["interrupted"] is True and rec["last_step"] == 2 and len(rec["losses"]) == 2
    assert json.loads((out / "latest.json").read_text())["step"] == 2
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_generate_refuses_a_corrupted_checkpoint(tmp_path):
    pytest.importorskip("recurra_models")
    data, out = text_file(tmp_path), tmp_path / "run"
    assert runner.invoke(app, train_args("mamba", data, out, 1)).exit_code == 0
    latest = json.loads((out / "latest.json").read_text())["path"]
    weights = out / latest / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF
    weights.write_bytes(bytes(blob))
    res = runner.invoke(app, ["generate", "--checkpoint", str(out), "--prompt", "a"])
    assert res.exit_code == 2 and "not a usable checkpoint" in res.output
    assert isinstance(res.exception, SystemExit)


def test_train_without_recurra_models_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "recurra_models", None)  # import now raises ImportError
    res = runner.invoke(app, ["train", "--model", "mamba", "--data", str(text_file(tmp_path))])
    assert res.exit_code == 3
    assert "tools/build_wheels.py --install 'recurra-cli[models]'" in " ".join(res.output.split())
    res = runner.invoke(app, ["generate", "--checkpoint", str(tmp_path), "--prompt", "a"])
    assert res.exit_code == 3

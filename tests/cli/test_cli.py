"""The `recurra` command, through typer's CliRunner and as a subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from typer.testing import CliRunner

from recurra_cli.main import app

runner = CliRunner()


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

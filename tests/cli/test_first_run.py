"""A new user's first run: every install hint names a working command, --version and -h,
`recurra devices` lists a backend that is not installed, check-backends says why a backend
that is installed cannot start, --plot checks for matplotlib before training."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import recurra
from recurra import backends
from recurra._install import PLUGINS, install_command
from recurra_cli import main as cli_main
from recurra_cli.main import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]

# Every requirement a message of recurra names (the third-party ones install from PyPI).
HINTED = ["recurra-vulkan", "recurra-cli[models]"]
HINTED_THIRD_PARTY = ["matplotlib"]


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def no_plugins(monkeypatch):
    """recurra.backends as on a machine where no plugin package is installed."""
    monkeypatch.setattr(backends.metadata, "entry_points", lambda group=None: [])
    monkeypatch.setattr(backends, "_cache", None)
    yield
    backends.available(refresh=True)


def test_hints_are_the_documented_commands_and_they_run():
    """Each hint is in the README, and the command runs (the build itself is left out with
    --dry-run: nox's build session installs every combination for real)."""
    readme = (ROOT / "README.md").read_text() + (ROOT / "packages/cli/README.md").read_text()
    assert set(PLUGINS.values()) <= set(HINTED)
    for req in HINTED:
        cmd = install_command(req)
        assert cmd.startswith("python tools/build_wheels.py --install "), cmd
        assert cmd in readme, cmd
        args = re.findall(r"'[^']*'|\S+", cmd)[1:]
        p = subprocess.run(
            [sys.executable, *[a.strip("'") for a in args], "--dry-run"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        assert "would build" in p.stdout and "pip install --find-links" in p.stdout, p.stdout
    for req in HINTED_THIRD_PARTY:
        assert install_command(req) == f"pip install {req}"
    assert "--find-links dist 'recurra-cli[models]'" in readme


def test_no_source_file_names_an_unpublished_package_to_pip_install():
    """A hint such as `pip install recurra-vulkan` would look on PyPI, where recurra is not
    published: every hint goes through recurra._install."""
    bad = []
    for f in sorted((ROOT / "packages").rglob("*")):
        parts = f.relative_to(ROOT).parts
        if f.suffix not in (".py", ".build", ".md", ".toml") or any(
            p in ("build", "builddir") or p.startswith(".mesonpy") for p in parts
        ):
            continue
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if re.search(r"pip install\s+['\"]?recurra", line):
                bad.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_messages_name_the_hint(no_plugins, tmp_path, monkeypatch):
    with pytest.raises(ValueError) as e:
        recurra.parse_device("vulkan")
    assert install_command("recurra-vulkan") in str(e.value)
    monkeypatch.setitem(sys.modules, "recurra_models", None)
    data = tmp_path / "in.txt"
    data.write_text("hello world " * 20)
    res = runner.invoke(app, ["train", "--model", "mamba", "--data", str(data)])
    assert res.exit_code == 3
    assert install_command("recurra-cli[models]") in _flat(res.output)


def test_version_and_short_help():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(f"recurra {cli_main.versions()['recurra-cli']} (")
    assert f"recurra-core {recurra.__version__}" in res.stdout
    assert "recurra-dist " in res.stdout  # installed or "not installed", but listed
    for args in (["-h"], ["train", "-h"], ["demo", "mamba-train", "-h"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0 and "Usage:" in res.stdout, (args, res.output)


def test_backends_need_no_submodule_import():
    code = "import recurra as rc; print([b.name for b in rc.backends.available()][-1])"
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert p.returncode == 0 and p.stdout.strip() == "cpu", p.stdout + p.stderr


def test_devices_lists_a_plugin_that_is_not_installed(no_plugins):
    res = runner.invoke(app, ["devices", "--json"])
    assert res.exit_code == 0, res.output
    infos = {b["name"]: b for b in json.loads(res.stdout)}
    vk = infos["vulkan"]
    assert not vk["available"] and not vk["installed"]
    assert install_command("recurra-vulkan") in vk["reason"]
    res = runner.invoke(app, ["devices"])
    assert "vulkan" in res.stdout and "not installed" in _flat(res.stdout)


def test_check_backends_blames_the_driver_when_the_plugin_is_installed(monkeypatch):
    from recurra import check_backends as cb

    vk = backends.BackendInfo("vulkan", False, reason="libvulkan.so.1: cannot open", source="x")
    monkeypatch.setattr(backends, "available", lambda refresh=False: [vk])
    monkeypatch.setattr(cb, "device_backends", lambda: [])
    res = runner.invoke(app, ["check-backends"])
    assert res.exit_code == 3
    out = _flat(res.output)
    assert "vulkan: libvulkan.so.1: cannot open" in out
    assert "install" not in out, out


def test_plot_without_matplotlib_fails_before_training(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    res = runner.invoke(
        app, ["demo", "mamba-train", "--small", "--epochs", "1", "--plot", str(tmp_path / "a.png")]
    )
    assert res.exit_code == 3, res.output
    assert "pip install matplotlib" in _flat(res.output)
    assert "Training" not in res.output and "epoch" not in res.output


def _strict_json(text: str):
    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_train_json_is_strict_json(tmp_path):
    """Mamba-2's config holds dt_limit = (0, inf): --json writes "inf", not Infinity."""
    data = tmp_path / "in.txt"
    data.write_text("hello world, " * 40)
    args = ["train", "--model", "mamba2", "--data", str(data), "--steps", "1", "--json"]
    for c in ("d_model=16", "n_layer=1", "head_dim=8"):
        args += ["--config", c]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    doc = _strict_json(res.stdout.strip().splitlines()[-1])
    assert doc["config"]["dt_limit"] == [0.0, "inf"]

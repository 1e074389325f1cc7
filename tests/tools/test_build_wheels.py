"""tools/build_wheels.py: what a requirement needs, and a wheel built once per source state."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import build_wheels as bw  # noqa: E402


def names(pkgs):
    return [p.name for p in pkgs]


def test_the_repository_packages_and_what_each_combination_needs():
    pkgs = bw.discover_packages()
    order = names(pkgs)
    assert order[0] == "recurra-core"
    assert order.index("recurra-optim") < order.index("recurra-models")
    assert set(names(bw.select(["recurra-cli[models]"], pkgs))) == {
        "recurra-core",
        "recurra-cli",
        "recurra-optim",
        "recurra-models",
    }
    assert set(names(bw.select(["recurra-cli[dist]"], pkgs))) == {
        "recurra-core",
        "recurra-cli",
        "recurra-optim",
        "recurra-models",
        "recurra-dist",
    }
    assert set(names(bw.select(["recurra-dist"], pkgs))) == {
        "recurra-core",
        "recurra-optim",
        "recurra-dist",
    }
    assert names(bw.select(["recurra-vulkan"], pkgs)) == ["recurra-core", "recurra-vulkan"]
    assert names(bw.select(["recurra_core"], pkgs)) == ["recurra-core"]
    for req in bw.COMBINATIONS:
        assert "recurra-core" in names(bw.select([req], pkgs))
    with pytest.raises(ValueError, match="not a package of this repository"):
        bw.select(["recurra-tpu"], pkgs)
    with pytest.raises(ValueError, match="has no extra"):
        bw.select(["recurra-cli[gpu]"], pkgs)


def _package(root: Path, name: str, deps: list[str]) -> None:
    d = root / name.split("-")[1]
    (d / "src").mkdir(parents=True)
    (d / "src" / "mod.py").write_text("X = 1\n")
    meta = f'name = "{name}"\nversion = "1.0"\ndependencies = {json.dumps(deps)}\n'
    (d / "pyproject.toml").write_text("[project]\n" + meta)


@pytest.fixture
def fake_pip(monkeypatch):
    """Replaces `pip wheel` with one that writes an empty wheel; records what it built."""
    built: list[str] = []

    def run(cmd, check=False, **kw):
        out, src = Path(cmd[cmd.index("-w") + 1]), Path(cmd[-1])
        name = bw.tomllib.loads((src / "pyproject.toml").read_text())["project"]["name"]
        built.append(name)
        out.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(out / f"{name.replace('-', '_')}-1.0-py3-none-any.whl", "w") as z:
            z.writestr("mod.py", (src / "src" / "mod.py").read_text())
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bw.subprocess, "run", run)
    return built


def test_a_wheel_is_rebuilt_only_when_its_sources_or_dependencies_change(tmp_path, fake_pip):
    root, dist = tmp_path / "packages", tmp_path / "dist"
    _package(root, "demo-core", [])
    _package(root, "demo-app", ["demo-core>=1"])
    pkgs = bw.discover_packages(root)
    assert names(pkgs) == ["demo-core", "demo-app"]  # dependencies first

    wheels = bw.build(pkgs, dist, log=lambda m: None)
    assert sorted(fake_pip) == ["demo-app", "demo-core"]
    assert sorted(w.name for w in dist.glob("*.whl")) == sorted(p.name for p in wheels.values())

    fake_pip.clear()
    bw.build(pkgs, dist, log=lambda m: None)
    assert fake_pip == []  # nothing changed: nothing built

    (root / "app" / "src" / "mod.py").write_text("X = 2\n")
    bw.build(pkgs, dist, log=lambda m: None)
    assert fake_pip == ["demo-app"]

    fake_pip.clear()
    (root / "core" / "src" / "mod.py").write_text("X = 3\n")
    bw.build(pkgs, dist, log=lambda m: None)
    assert fake_pip == ["demo-core", "demo-app"]  # the dependent is rebuilt too
    assert len(list(dist.glob("demo_core-*.whl"))) == 1  # the old wheel was replaced

    fake_pip.clear()
    (root / "app" / "build").mkdir()  # build outputs beside the sources do not count
    (root / "app" / "build" / "junk.py").write_text("")
    bw.build(pkgs, dist, log=lambda m: None)
    assert fake_pip == []
    bw.build(pkgs, dist, force=True, log=lambda m: None)
    assert sorted(fake_pip) == ["demo-app", "demo-core"]


def test_command_line_dry_run_and_bad_names():
    cmd = [sys.executable, str(ROOT / "tools" / "build_wheels.py")]
    p = subprocess.run([*cmd, "--dry-run", "recurra-models"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "recurra-core, recurra-optim, recurra-models" in p.stdout
    p = subprocess.run([*cmd, "--dry-run", "recurra-nope"], capture_output=True, text=True)
    assert p.returncode == 2 and "not a package of this repository" in p.stderr
    p = subprocess.run([*cmd, "--install"], capture_output=True, text=True)
    assert p.returncode == 2 and "--install needs" in p.stderr

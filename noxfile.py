"""nox sessions for the recurra monorepo.

    nox                       # the default run (CI's command): lint, tests, build, sanitize
    nox -s tests              # the test suite against every backend in BACKENDS
    nox -s "tests(cpu)"       # one backend
    nox -s bench -- --only mamba2 --threads 2

Every session builds the packages it needs from packages/*/ into a fresh virtual
environment: nothing is reused between runs and nothing comes from the developer's own venv.
Packages are discovered (a folder under packages/ with a pyproject.toml) and installed in
dependency order, recurra-core first.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nox

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "no"
nox.options.error_on_external_run = False
nox.options.sessions = ["lint", "tests", "build", "sanitize"]

ROOT = Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"

# Backends the test suite runs against; each becomes one `tests(<name>)` session and reaches
# the tests as RECURRA_TEST_BACKEND (see tests/conftest.py). Add "vulkan" here.
BACKENDS = ["cpu", "vulkan"]

TEST_DEPS = ["pytest>=7", "hypothesis>=6"]
BUILD_DEPS = ["meson-python>=0.15", "meson>=1.1", "pybind11>=2.12", "ninja"]
RUFF = "ruff==0.17.6"
PEERS = ["torch==2.13.0", "ggml-python==0.0.45"]
MODEL_PEERS = ["torch==2.13.0", "transformers>=5,<6", "tokenizers>=0.20"]

# What `build` runs in the fresh venv after installing a package's wheel alone. Packages not
# listed get a plain import of their module.
SMOKE = {
    "recurra-core": """
import os
import numpy as np
import recurra
t = recurra.tensor(np.ones(3, np.float32))
assert (t + t).numpy().tolist() == [2.0, 2.0, 2.0], (t + t).numpy()
inc = recurra.get_include()
assert os.path.isfile(os.path.join(inc, "recurra", "backend.h")), inc
print("recurra", getattr(recurra, "__version__", "?"), "from", recurra.__file__)
""",
}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Package:
    """One folder under packages/ with its distribution name and local dependencies."""

    path: Path
    name: str  # canonical distribution name, e.g. "recurra-core"
    local_deps: list[str]  # canonical names of other packages/* it depends on

    @property
    def module(self) -> str:
        """The import name: recurra-core -> recurra, recurra-x -> recurra_x."""
        return "recurra" if self.name == "recurra-core" else self.name.replace("-", "_")


def discover_packages() -> list[Package]:
    """Returns every packages/*/ that has a pyproject.toml, in dependency order.

    recurra-core comes first; a package comes after every local package it depends on.
    Raises RuntimeError on a dependency cycle.
    """
    found: dict[str, tuple[Path, list[str]]] = {}
    for pyproject in sorted(PACKAGES_DIR.glob("*/pyproject.toml")):
        meta = tomllib.loads(pyproject.read_text())["project"]
        deps = [
            _canon(re.split(r"[\s;<>=!~\[(@]", d.strip(), maxsplit=1)[0])
            for d in meta.get("dependencies", [])
        ]
        found[_canon(meta["name"])] = (pyproject.parent, deps)
    ordered: list[Package] = []
    state: dict[str, str] = {}

    def visit(name: str) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise RuntimeError(f"dependency cycle among packages/ involving {name}")
        state[name] = "visiting"
        path, deps = found[name]
        local = [d for d in deps if d in found]
        for d in local:
            visit(d)
        state[name] = "done"
        ordered.append(Package(path, name, local))

    for name in sorted(found, key=lambda n: (n != "recurra-core", n)):
        visit(name)
    return ordered


def closure(pkg: Package, by_name: dict[str, Package]) -> list[Package]:
    """Returns pkg's local dependencies (transitively) and pkg itself, dependencies first."""
    out: list[Package] = []

    def walk(p: Package) -> None:
        for d in p.local_deps:
            walk(by_name[d])
        if p not in out:
            out.append(p)

    walk(pkg)
    return out


# Build outputs that must not travel into a staged copy (a stale setuptools build/ would put
# deleted files into a wheel).
_NOT_SOURCES = shutil.ignore_patterns(
    "build", "builddir", "dist", ".mesonpy-*", "*.egg-info", "__pycache__", "*.so", "*.pyc"
)


def stage(session: nox.Session, packages: list[Package]) -> dict[str, Path]:
    """Copies each package's sources to a fresh folder under the session's tmp dir.

    Builds then happen in the copy: nothing is written into the work tree (setuptools writes
    build/ and *.egg-info beside the sources, meson-python a .mesonpy-* folder) and nothing
    left there by an earlier build gets in. Returns distribution name -> staged folder.
    """
    root = Path(session.create_tmp()) / "src"
    shutil.rmtree(root, ignore_errors=True)
    return {
        p.name: Path(shutil.copytree(p.path, root / p.path.name, ignore=_NOT_SOURCES))
        for p in packages
    }


def install_packages(session: nox.Session, *pip_args: str) -> None:
    """Installs every package (non-editable, build isolation on) in dependency order."""
    staged = stage(session, discover_packages())
    session.install(*pip_args, *[str(d) for d in staged.values()])


@nox.session
@nox.parametrize("backend", [nox.param(b, id=b) for b in BACKENDS])
def tests(session: nox.Session, backend: str) -> None:
    """Runs the test suite with RECURRA_TEST_BACKEND=<backend>; no test run is a failure."""
    install_packages(session)
    session.install(*TEST_DEPS)
    if backend == "cpu":
        # Independent references: PyTorch's CPU build (on disk on the CI machine kind) and
        # transformers' Mamba/Mamba-2, whose logits recurra_models must reproduce.
        session.install(*MODEL_PEERS)
    env = {"RECURRA_TEST_BACKEND": backend, "RECURRA_HYPOTHESIS_PROFILE": "ci"}
    # pytest exits 5 when it collected no test; nox treats every non-zero code as a failure.
    session.run("pytest", "-q", *(session.posargs or ["tests"]), env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the Python sources (settings in ruff.toml)."""
    session.install(RUFF)
    session.run("ruff", "check", "packages", "tests", "bench", "noxfile.py", *session.posargs)


def _venv_python(venv: Path) -> str:
    return str(venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python"))


@nox.session
def build(session: nox.Session) -> None:
    """Builds each package's wheel as a user would and installs it alone into a fresh venv.

    Each wheel is installed with only the wheels of its own local dependencies (built here, not
    taken from an index) and its third-party requirements from PyPI; then it is imported and,
    for recurra-core, runs a tiny graph. Runs from a scratch folder so that nothing in the
    source tree can shadow the installed package.
    """
    session.install("pip>=23.1")
    packages = discover_packages()
    by_name = {p.name: p for p in packages}
    staged = stage(session, packages)
    tmp = Path(tempfile.mkdtemp(prefix="recurra-build-"))
    try:
        wheel_dir = tmp / "wheels"
        wheels: dict[str, Path] = {}
        for pkg in packages:
            out = tmp / "out" / pkg.name
            session.run(
                "python", "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(staged[pkg.name])
            )
            (whl,) = out.glob("*.whl")
            wheel_dir.mkdir(exist_ok=True)
            wheels[pkg.name] = Path(shutil.copy2(whl, wheel_dir))
            session.log(f"built {wheels[pkg.name].name}")
        for pkg in packages:
            venv = tmp / "venvs" / pkg.name
            session.run("python", "-m", "venv", str(venv))
            py = _venv_python(venv)
            files = [str(wheels[p.name]) for p in closure(pkg, by_name)]
            session.run(py, "-m", "pip", "install", "--no-cache-dir", *files, external=True)
            code = SMOKE.get(pkg.name, f"import {pkg.module}; print({pkg.module}.__file__)")
            with session.chdir(tmp):
                session.run(py, "-I", "-c", code, external=True)
            session.log(f"{pkg.name}: wheel installs alone and works")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gcc_library(name: str) -> str:
    """The real path of one of gcc's runtime libraries (e.g. libasan.so)."""
    out = subprocess.run(
        ["g++", f"-print-file-name={name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not os.path.isabs(out) or not os.path.exists(out):
        raise RuntimeError(f"g++ has no {name} (got {out!r}); install gcc's runtime libraries")
    return os.path.realpath(out)


def _asan_preload() -> str:
    """LD_PRELOAD for running the sanitized extension inside a non-sanitized python.

    libstdc++ is preloaded beside the ASan runtime: ASan resolves the real __cxa_throw when it
    starts, and python itself does not link libstdc++, so without it the first C++ exception
    ends in "CHECK failed: real___cxa_throw != 0".
    """
    return " ".join([_gcc_library("libasan.so"), _gcc_library("libstdc++.so")])


@nox.session
def sanitize(session: nox.Session) -> None:
    """Builds recurra-core with ASan + UBSan (assertions on) and runs tests/core under it."""
    session.install(*BUILD_DEPS, *TEST_DEPS, "numpy", "scipy-openblas32")
    core = [p for p in discover_packages() if p.name == "recurra-core"]
    session.install(
        "--no-build-isolation",
        str(stage(session, core)["recurra-core"]),
        "-Csetup-args=-Db_sanitize=address,undefined",
        "-Csetup-args=-Db_lundef=false",
        "-Csetup-args=-Db_ndebug=false",
        # -O1 halves the sanitized compile; it only takes effect while meson.build leaves the
        # optimization level to the buildtype (a hard-coded -O3 in cpp_args wins over it).
        "-Csetup-args=-Doptimization=1",
        "-Csetup-args=-Dcpp_args=-fno-omit-frame-pointer",
    )
    env = {
        "LD_PRELOAD": _asan_preload(),
        # CPython and numpy keep allocations for the life of the process: leaks are noise.
        # abort_on_error: the report ends in SIGABRT, on which pytest's faulthandler prints
        # the Python stack, naming the test.
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:abort_on_error=1",
        "RECURRA_TEST_BACKEND": "cpu",
        "RECURRA_HYPOTHESIS_PROFILE": "sanitize",
    }
    # --capture=sys: the sanitizers write to file descriptor 2, which pytest's default
    # capture would swallow when the process dies.
    session.run(
        "pytest", "-q", "-x", "--capture=sys", *(session.posargs or ["tests/core"]), env=env
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Runs bench/core.py and bench/recurrent.py against the peers that install here.

    Arguments after `--` go to both scripts (e.g. `--only mamba2 --threads 2`); `--no-peers`
    skips installing PyTorch and ggml-python.
    """
    args = list(session.posargs)
    install_packages(session)
    session.install("numpy")
    if "--no-peers" in args:
        args.remove("--no-peers")
    else:
        for peer in PEERS:  # a peer that does not install only costs its column (n/a)
            session.run("python", "-m", "pip", "install", peer, success_codes=[0, 1])
    session.run("python", "bench/core.py", *args)
    session.run("python", "bench/recurrent.py", *args)

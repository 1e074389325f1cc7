#!/usr/bin/env python3
"""Builds the wheels of this repository's packages into one folder (a wheelhouse), once.

    python tools/build_wheels.py                         # every package into dist/
    python tools/build_wheels.py recurra-models          # it and the packages it needs
    python tools/build_wheels.py --install 'recurra-cli[models]'   # ... then pip installs it
    pip install --find-links dist recurra-models         # later, in any venv

The packages under packages/ depend on each other by name (recurra-models needs
recurra-optim and recurra-core). Those names are not on PyPI, so pip finds them only in a
folder of wheels given with ``--find-links``; the third-party requirements (numpy...) come
from the package index as usual.

A package is built only when its sources (or those of a package it depends on) changed
since its wheel in the wheelhouse was built: the SHA-256 of the sources is kept in
``<dist>/.recurra-wheels.json``. ``--force`` rebuilds. Builds run in a copy of the sources
(nothing is written into packages/), with pip's build isolation; the C++ packages are
built with ``pip -v``, so the compiler's progress (``[12/40] Compiling ...``) shows.

recurra-vulkan needs ``glslc`` and the Vulkan headers (``apt-get install libvulkan-dev
glslc``); without glslc a run that names no package skips it with a note.

Also imported by noxfile.py (package discovery, staging, building).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ImportError:
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
PACKAGES_DIR = ROOT / "packages"
STATE_FILE = ".recurra-wheels.json"

#: What the README tells users to install (each works in a fresh venv with
#: ``pip install --find-links dist REQUIREMENT``); the nox ``build`` session installs each.
COMBINATIONS = [
    "recurra-core",
    "recurra-optim",
    "recurra-models",
    "recurra-vulkan",
    "recurra-cli",
    "recurra-cli[models]",
    "recurra-dist",
    "recurra-cli[dist]",
]


def install_command(requirement: str) -> str:
    """The one command (run in a checkout of this repository) that installs
    ``requirement``; the hints recurra prints name the same command."""
    quoted = f"'{requirement}'" if "[" in requirement else requirement
    return f"python tools/build_wheels.py --install {quoted}"


def canon(name: str) -> str:
    """A distribution name in PEP 503 normal form (recurra_core -> recurra-core)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    return canon(re.split(r"[\s;<>=!~\[(@]", req.strip(), maxsplit=1)[0])


@dataclass
class Package:
    """One folder under packages/ with its distribution name and local dependencies."""

    path: Path
    name: str  # canonical distribution name, e.g. "recurra-core"
    local_deps: list[str]  # canonical names of other packages/* it depends on
    version: str = "0"
    # extra -> the local packages it adds (recurra-cli[models] -> recurra-models, ...)
    local_extras: dict[str, list[str]] = field(default_factory=dict)

    @property
    def module(self) -> str:
        """The import name: recurra-core -> recurra, recurra-x -> recurra_x."""
        return "recurra" if self.name == "recurra-core" else self.name.replace("-", "_")

    @property
    def native(self) -> bool:
        """Whether it compiles C++ (a meson-python package)."""
        return (self.path / "meson.build").is_file()


def discover_packages(packages_dir: Path = PACKAGES_DIR) -> list[Package]:
    """Returns every packages/*/ that has a pyproject.toml, in dependency order.

    recurra-core comes first; a package comes after every local package it depends on.
    Raises RuntimeError on a dependency cycle.
    """
    found: dict[str, tuple[Path, dict]] = {}
    for pyproject in sorted(packages_dir.glob("*/pyproject.toml")):
        meta = tomllib.loads(pyproject.read_text())["project"]
        found[canon(meta["name"])] = (pyproject.parent, meta)
    ordered: list[Package] = []
    state: dict[str, str] = {}

    def visit(name: str) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise RuntimeError(f"dependency cycle among packages/ involving {name}")
        state[name] = "visiting"
        path, meta = found[name]
        local = [d for d in map(_req_name, meta.get("dependencies", [])) if d in found]
        extras = {
            extra: [d for d in map(_req_name, reqs) if d in found]
            for extra, reqs in meta.get("optional-dependencies", {}).items()
        }
        for d in local:
            visit(d)
        state[name] = "done"
        ordered.append(Package(path, name, local, meta.get("version", "0"), extras))

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


def select(requirements: list[str], packages: list[Package]) -> list[Package]:
    """The packages that installing ``requirements`` (``recurra-cli[models]``...) needs,
    in dependency order. Raises ValueError for a name that is not under packages/."""
    by_name = {p.name: p for p in packages}
    wanted: set[str] = set()
    for req in requirements:
        m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?\s*", req)
        name = canon(m.group(1)) if m else req
        if name not in by_name:
            raise ValueError(
                f"{req!r} is not a package of this repository (one of {', '.join(by_name)})"
            )
        extras = [canon(e) for e in (m.group(2) or "").split(",") if e.strip()]
        pkg = by_name[name]
        unknown = [e for e in extras if e not in pkg.local_extras]
        if unknown:
            raise ValueError(f"{req!r}: {name} has no extra {', '.join(unknown)}")
        roots = [pkg] + [by_name[d] for e in extras for d in pkg.local_extras[e]]
        for r in roots:
            wanted.update(p.name for p in closure(r, by_name))
    return [p for p in packages if p.name in wanted]


# Build outputs that must not travel into a staged copy (a stale setuptools build/ would put
# deleted files into a wheel).
NOT_SOURCES = shutil.ignore_patterns(
    "build", "builddir", "dist", ".mesonpy-*", "*.egg-info", "__pycache__", "*.so", "*.pyc"
)


def stage(packages: list[Package], root: Path) -> dict[str, Path]:
    """Copies each package's sources to ``root/<folder>`` (emptied first).

    Builds then happen in the copy: nothing is written into the work tree (setuptools writes
    build/ and *.egg-info beside the sources, meson-python a .mesonpy-* folder) and nothing
    left there by an earlier build gets in. The folder names are kept, so recurra-vulkan
    finds ../core. Returns distribution name -> staged folder.
    """
    shutil.rmtree(root, ignore_errors=True)
    return {
        p.name: Path(shutil.copytree(p.path, root / p.path.name, ignore=NOT_SOURCES))
        for p in packages
    }


def _source_files(folder: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        ignored = NOT_SOURCES(dirpath, dirnames + filenames)
        dirnames[:] = sorted(d for d in dirnames if d not in ignored)
        out += [Path(dirpath, f) for f in sorted(filenames) if f not in ignored]
    return out


def source_hashes(packages: list[Package]) -> dict[str, str]:
    """name -> SHA-256 of the package's source files and of its local dependencies' hashes
    (recurra-vulkan compiles against recurra-core's header) and the Python it is built for."""
    out: dict[str, str] = {}
    for p in packages:  # dependency order: a dependency's hash is known first
        h = hashlib.sha256(wheel_tag(p).encode())
        for f in _source_files(p.path):
            h.update(f.relative_to(p.path).as_posix().encode() + b"\0")
            h.update(f.read_bytes() + b"\0")
        for d in p.local_deps:
            h.update(out[d].encode() if d in out else d.encode())
        out[p.name] = h.hexdigest()
    return out


def wheel_tag(pkg: Package) -> str:
    """The Python tag of pkg's wheel here: cp311 for a C++ package, py3 otherwise."""
    if not pkg.native:
        return "py3"
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def _wheel_files(dist: Path, pkg: Package) -> list[Path]:
    stem = pkg.name.replace("-", "_")
    return [w for w in dist.glob(f"{stem}-*.whl") if w.name.split("-")[2] == wheel_tag(pkg)]


def missing_tools(pkg: Package) -> str:
    """Why pkg cannot be built here ("" when nothing is known to be missing)."""
    if pkg.name == "recurra-vulkan" and shutil.which("glslc") is None:
        return (
            "recurra-vulkan needs glslc and the Vulkan headers (apt-get install libvulkan-dev "
            "glslc, or the LunarG Vulkan SDK)"
        )
    return ""


def build(
    packages: list[Package],
    dist: Path,
    force: bool = False,
    verbose: bool = True,
    log=print,
    python: str = sys.executable,
) -> dict[str, Path]:
    """Builds the wheel of each of ``packages`` (in dependency order) into ``dist`` unless
    the one there was built from the same sources; returns name -> wheel path.

    Raises subprocess.CalledProcessError when a build fails (pip said why on stderr)."""
    dist.mkdir(parents=True, exist_ok=True)
    dist = dist.resolve()
    state_path = dist / STATE_FILE
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        state = {}
    hashes = source_hashes(discover_packages(packages[0].path.parent)) if packages else {}
    wheels: dict[str, Path] = {}
    staged: dict[str, Path] | None = None
    with tempfile.TemporaryDirectory(prefix="recurra-wheels-") as tmp:
        for pkg in packages:
            key = f"{pkg.name}@{wheel_tag(pkg)}"
            known = state.get(key, {})
            whl = dist / known.get("wheel", "-")
            if not force and known.get("sources") == hashes[pkg.name] and whl.is_file():
                log(f"{pkg.name}: {whl.name} is up to date")
                wheels[pkg.name] = whl
                continue
            if staged is None:  # every package: recurra-vulkan reads ../core
                staged = stage(discover_packages(packages[0].path.parent), Path(tmp) / "src")
            what = "C++, a few minutes on 2 cores" if pkg.native else "pure Python"
            log(f"{pkg.name}: building its wheel ({what})")
            out = Path(tmp) / "out" / pkg.name
            cmd = [python, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(staged[pkg.name])]
            if verbose and pkg.native:
                cmd.insert(4, "-v")  # meson-python shows ninja's progress only with -v
            elif not verbose:
                cmd.insert(4, "-q")
            subprocess.run(cmd, check=True)
            (new,) = out.glob("*.whl")
            for old in _wheel_files(dist, pkg):
                old.unlink()
            wheels[pkg.name] = Path(shutil.copy2(new, dist / new.name))
            state[key] = {"wheel": new.name, "sources": hashes[pkg.name]}
            state_path.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
            log(f"{pkg.name}: built {dist / new.name}")
    return wheels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Build the wheels of recurra's packages into a wheelhouse, then "
        "`pip install --find-links DIST NAME` installs any of them with its dependencies.",
    )
    ap.add_argument(
        "requirements",
        nargs="*",
        metavar="NAME",
        help="packages to build, with the ones they need (e.g. recurra-models, "
        "'recurra-cli[models]'); default: all",
    )
    ap.add_argument("--dist", type=Path, default=ROOT / "dist", help="the wheelhouse (dist/)")
    ap.add_argument(
        "--install",
        action="store_true",
        help="then `pip install --find-links DIST NAME...` into this Python",
    )
    ap.add_argument("--force", action="store_true", help="rebuild even up-to-date wheels")
    ap.add_argument("-q", "--quiet", action="store_true", help="no compiler progress")
    ap.add_argument("--dry-run", action="store_true", help="say what would be built, build nothing")
    args = ap.parse_args(argv)
    if args.install and not args.requirements:
        ap.error("--install needs the packages to install, e.g. --install recurra-models")

    packages = discover_packages()
    try:
        chosen = select(args.requirements, packages) if args.requirements else packages
    except ValueError as e:
        ap.error(str(e))
    for pkg in list(chosen):
        why = missing_tools(pkg)
        if why and args.requirements:
            print(f"error: {why}", file=sys.stderr)
            return 2
        if why:
            print(f"note: skipping {pkg.name}: {why}", file=sys.stderr)
            chosen.remove(pkg)
    dist = args.dist.resolve()
    if args.dry_run:
        print(f"would build into {dist}: {', '.join(p.name for p in chosen)}")
        if args.install:
            print(
                f"then: {sys.executable} -m pip install --find-links {dist} "
                f"{' '.join(args.requirements)}"
            )
        return 0
    try:
        build(chosen, dist, force=args.force, verbose=not args.quiet)
    except subprocess.CalledProcessError as e:
        print(f"error: the build failed ({e}); pip's output above says why", file=sys.stderr)
        return 1
    if args.install:
        cmd = [sys.executable, "-m", "pip", "install", "--find-links", str(dist)]
        return subprocess.run([*cmd, *args.requirements]).returncode
    rel = os.path.relpath(dist)
    rel = str(dist) if rel.startswith("..") else rel
    print(f"wheels in {rel}: pip install --find-links {rel} NAME (e.g. recurra-models)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

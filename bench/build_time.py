"""How long recurra-core takes to compile: CPU seconds of every compiler and linker run, and
the wall time of the whole build, from a fresh build folder.

    python bench/build_time.py                    # packages/core, ninja -j (cores), a table
    python bench/build_time.py --jobs 1 --top 30  # one job at a time (the least noisy CPU figures)
    python bench/build_time.py --json out.json    # the figures as JSON too
    python bench/build_time.py --keep build/bt    # keep the build folder (default: a temp one)

What it does: `meson setup` with the options meson-python passes (release, b_ndebug=if-release;
the same flags as `pip install ./packages/core`), the C++ compiler given to meson as this
script in `--wrap` mode, then `ninja -j JOBS`. The wrapper runs the real compiler (`c++`, or
$CXX) and appends its rusage (user + sys of the compiler and its children: cc1plus, as) and
wall time to a log, so the per-unit figures come from the real build with ninja's own order.
The wrapper's own Python start (~30 ms a run) is in the wall time, not in the CPU figures.

CPU seconds hardly change with the machine's load (the wall time does): the load average is
printed before and after. Target (issue 15): <= 90 s wall on 2 idle cores, i.e. the total
CPU / 2 and the longest chain of units (the slowest unit + the link) both well under 90 s.
Needs meson, ninja, pybind11 and numpy in this Python (the editable install's build tools).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG_ENV = "RECURRA_BUILD_TIME_LOG"


def wrap(argv: list[str]) -> int:
    """Runs the compiler command ``argv`` and appends one JSON line (output, user, sys, wall)
    to the log named by $RECURRA_BUILD_TIME_LOG. Returns the compiler's exit status."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    log = os.environ.get(LOG_ENV)
    if log and "-o" in argv:
        out = argv[argv.index("-o") + 1]
        rec = {"out": out, "user": usage.ru_utime, "sys": usage.ru_stime, "wall": wall}
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return os.waitstatus_to_exitcode(status)


def unit_names(build: Path, source: Path) -> dict[str, str]:
    """Object file (as the compiler's -o names it) -> a readable unit name: the source path
    relative to the package, or for a unity file of meson its sources' names in brackets."""
    names = {}
    for entry in json.loads((build / "compile_commands.json").read_text()):
        args = entry.get("arguments") or shlex.split(entry["command"])
        if "-o" not in args:
            continue
        src = Path(entry["directory"], entry["file"]).resolve()
        try:
            name = str(src.relative_to(source))
        except ValueError:  # a generated unity file: #include<...> lines
            members = [
                Path(line.split("<", 1)[1].rstrip(">")).name
                for line in src.read_text().splitlines()
                if line.startswith("#include<")
            ]
            name = f"{src.stem}[{' '.join(members)}]"
        names[args[args.index("-o") + 1]] = name
    return names


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(args: argparse.Namespace) -> dict:
    """Sets up and builds the package; returns the figures."""
    source = Path(args.source).resolve()
    build = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="recurra-build-time-"))
    if build.exists():
        if any(build.iterdir()) and not (build / "native.ini").exists():
            sys.exit(f"--keep {build}: not empty and not a folder of this script; not touched")
        shutil.rmtree(build)
    build.mkdir(parents=True)
    log = build / "units.jsonl"
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    native = build / "native.ini"
    compiler = [sys.executable, str(Path(__file__).resolve()), "--wrap", *cxx]
    native.write_text(
        f"[binaries]\npython = {sys.executable!r}\ncpp = [{', '.join(repr(a) for a in compiler)}]\n"
    )
    setup = [
        sys.executable, "-m", "mesonbuild.mesonmain", "setup", str(build / "b"), str(source),
        "-Dbuildtype=release", "-Db_ndebug=if-release", f"--native-file={native}",
        *args.setup_args,
    ]  # fmt: skip
    env = dict(os.environ)
    env.pop(LOG_ENV, None)
    t0 = time.perf_counter()
    subprocess.run(setup, check=True, env=env, stdout=subprocess.DEVNULL)
    t_setup = time.perf_counter() - t0

    env[LOG_ENV] = str(log)
    load_before = loadavg()
    t0 = time.perf_counter()
    ninja = shutil.which("ninja") or "ninja"
    subprocess.run([ninja, "-C", str(build / "b"), f"-j{args.jobs}"], check=True, env=env,
                   stdout=None if args.verbose else subprocess.DEVNULL)  # fmt: skip
    t_build = time.perf_counter() - t0
    load_after = loadavg()

    names = unit_names(build / "b", source)
    units = []
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        rec["unit"] = names.get(rec["out"], os.path.basename(rec["out"]))
        rec["cpu"] = rec["user"] + rec["sys"]
        units.append(rec)
    units.sort(key=lambda r: -r["cpu"])
    total = sum(u["cpu"] for u in units)
    if not args.keep:
        shutil.rmtree(build, ignore_errors=True)
    return {
        "source": str(source),
        "jobs": args.jobs,
        "setup_s": round(t_setup, 2),
        "build_wall_s": round(t_build, 2),
        "total_cpu_s": round(total, 2),
        "max_unit_cpu_s": round(units[0]["cpu"], 2) if units else 0.0,
        "units": len(units),
        "load_before": load_before,
        "load_after": load_after,
        "per_unit": [
            {k: (round(v, 2) if isinstance(v, float) else v) for k, v in u.items() if k != "out"}
            for u in units
        ],
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--wrap":
        sys.exit(wrap(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default=str(ROOT / "packages" / "core"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--top", type=int, default=10, help="units listed (slowest first)")
    ap.add_argument("--keep", help="build folder to keep (emptied first)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--verbose", action="store_true", help="show ninja's output")
    ap.add_argument("--setup-args", nargs="*", default=[], help="more `meson setup` options")
    args = ap.parse_args()
    res = run(args)
    print(f"{'unit':60s} {'cpu s':>7s} {'user':>7s} {'sys':>6s} {'wall':>7s}")
    for u in res["per_unit"][: args.top]:
        name = u["unit"][:60]
        print(f"{name:60s} {u['cpu']:7.2f} {u['user']:7.2f} {u['sys']:6.2f} {u['wall']:7.2f}")
    print(
        f"{res['units']} compiler/linker runs, {res['total_cpu_s']:.1f} CPU-s in all "
        f"(slowest {res['max_unit_cpu_s']:.1f} s); ninja -j{res['jobs']}: "
        f"{res['build_wall_s']:.1f} s wall (+ meson setup {res['setup_s']:.1f} s); "
        f"load {res['load_before']} before, {res['load_after']} after"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()

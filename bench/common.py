"""Shared pieces of the benchmarks: arguments, timing, BLAS facts, peers, the result table.

Every benchmark prints, per case, our median time, each peer's median time measured in the
same process, the ratio peer/ours (above 1: we are faster) and the design target, then one
last line `JSON {...}` with every figure. Nothing here asserts on speed.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OPENBLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


# ------------------------------------------------------------------------------------------
# arguments and case selection
# ------------------------------------------------------------------------------------------
def parse_args(description: str, case_names: Iterable[str]) -> argparse.Namespace:
    """Parses the common options; returns them with `.cases`, the selected case names."""
    names = list(case_names)
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--threads", type=int, default=2, help="threads for us and every peer")
    ap.add_argument("--reps", type=int, default=7, help="timed runs per measurement (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs before timing")
    ap.add_argument(
        "--budget",
        type=float,
        default=20.0,
        help="seconds one measurement may take; slow ones get fewer runs (>= 3)",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated case names or prefixes; one of: " + ", ".join(names),
    )
    ap.add_argument(
        "--no-check", action="store_true", help="skip comparing our results with the peers' results"
    )
    args = ap.parse_args()
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    # an exact name selects that case; anything else selects every case it prefixes
    args.cases = [
        n
        for n in names
        if not wanted or any(n == w or (w not in names and n.startswith(w)) for w in wanted)
    ]
    return args


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """Wall-clock times of one measurement, in milliseconds."""

    runs_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.runs_ms)

    @property
    def min_ms(self) -> float:
        return min(self.runs_ms)


def measure(
    fn: Callable[[], Any], reps: int = 7, warmup: int = 2, budget_s: float = 20.0
) -> Timing:
    """Runs fn `warmup` times untimed, then times up to `reps` runs and returns them.

    When one run is slow, the number of timed runs shrinks to fit `budget_s` (never below
    3 runs, nor below 1 warm-up), so a slow peer cannot stall the whole benchmark.
    """
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        if first * (warmup + reps) > budget_s:
            break
        fn()
    n = max(3, min(reps, int(budget_s / max(first, 1e-9))))
    runs = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return Timing(runs)


# ------------------------------------------------------------------------------------------
# BLAS (OpenBLAS inside numpy and inside scipy-openblas32, which recurra loads)
# ------------------------------------------------------------------------------------------
def _loaded_openblas() -> list[str]:
    libs = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                if "openblas" in os.path.basename(path).lower() and path not in libs:
                    libs.append(path)
    except OSError:
        pass
    return libs


def _symbol(lib: ctypes.CDLL, names: Iterable[str]) -> Any:
    for n in names:
        f = getattr(lib, n, None)
        if f is not None:
            return f
    return None


def blas_libraries(threads: int | None = None) -> list[dict[str, Any]]:
    """Every OpenBLAS loaded in this process: file, core type (kernel) and thread count.

    With `threads`, sets each one's thread count first (numpy's cannot be set otherwise
    once loaded).
    """
    out = []
    for path in _loaded_openblas():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        sfx = ("64_", "", "_64")
        setter = _symbol(
            lib,
            [f"scipy_openblas_set_num_threads{s}" for s in sfx]
            + ["openblas_set_num_threads64_", "openblas_set_num_threads"],
        )
        getter = _symbol(
            lib,
            [f"scipy_openblas_get_num_threads{s}" for s in sfx]
            + ["openblas_get_num_threads64_", "openblas_get_num_threads"],
        )
        core = _symbol(
            lib,
            [f"scipy_openblas_get_corename{s}" for s in sfx]
            + ["openblas_get_corename64_", "openblas_get_corename"],
        )
        if threads is not None and setter is not None:
            setter.argtypes = [ctypes.c_int]
            setter(threads)
        info: dict[str, Any] = {"lib": os.path.basename(path)}
        if core is not None:
            core.restype = ctypes.c_char_p
            info["coretype"] = core().decode()
        if getter is not None:
            getter.restype = ctypes.c_int
            info["threads"] = getter()
        out.append(info)
    return out


def environment(threads: int) -> dict[str, Any]:
    """What the figures depend on: CPU, threads, the OpenBLAS variables and kernels in use."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "env": {k: os.environ.get(k) for k in OPENBLAS_ENV},
        "blas": blas_libraries(threads),
    }


def print_environment(env: dict[str, Any]) -> None:
    print(
        f"# cpu: {env['cpu']} ({env['cores']} cores), threads: {env['threads']}, "
        f"python {env['python']}"
    )
    set_vars = {k: v for k, v in env["env"].items() if v is not None}
    if set_vars:
        print(
            f"# OpenBLAS variables in effect: {set_vars} (they slow a current numpy; for fair "
            f"numbers run under `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE`)"
        )
    else:
        print("# OpenBLAS variables in effect: none (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE unset)")
    for key in ("recurra", "ggml"):
        if key in env:
            print(f"# {key}: {env[key]}")
    for b in env["blas"]:
        print(
            f"# OpenBLAS loaded: {b['lib']} core={b.get('coretype', '?')} "
            f"threads={b.get('threads', '?')}"
        )


# ------------------------------------------------------------------------------------------
# recurra and the peers
# ------------------------------------------------------------------------------------------
def load_recurra(threads: int) -> tuple[ModuleType | None, str]:
    """Imports recurra and sets its thread count; returns (module or None, reason)."""
    try:
        import recurra
    except Exception as exc:  # a broken build must not hide the peers' figures
        return None, f"import recurra failed: {exc!r}"
    try:
        recurra.set_num_threads(threads)
    except AttributeError:
        pass
    return recurra, f"recurra {getattr(recurra, '__version__', '?')} from {recurra.__file__}"


def vulkan_device(index: int, flag: str) -> tuple[dict[str, Any] | None, str]:
    """Device `index` of recurra_vulkan's backend_info() (imported here), or (None, why not);
    `flag` names the option that chose the index. Import and backend errors propagate."""
    import recurra_vulkan

    info = recurra_vulkan.backend_info()
    devs = info.get("devices") or []
    if not devs:
        return None, f"no Vulkan device: {info.get('reason', '?')}"
    if index >= len(devs):
        return None, f"{flag} {index}: only {len(devs)} Vulkan device(s)"
    return devs[index], ""


def peers_dir() -> Path:
    """Where the peer scripts live: $RECURRA_PEERS_DIR, else ../shared/peers beside the repo."""
    env = os.environ.get("RECURRA_PEERS_DIR")
    return Path(env) if env else REPO.parent / "shared" / "peers"


def import_peer(name: str) -> tuple[ModuleType | None, str]:
    """Imports the peer script `name` (e.g. "ggml_peer") from peers_dir() at run time.

    Returns (module, "") or (None, why not): the directory is absent, or the script's own
    imports (ggml, torch) are not installed.
    """
    d = peers_dir()
    if not (d / f"{name}.py").is_file():
        return None, f"{d / (name + '.py')} not found (set RECURRA_PEERS_DIR)"
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))
    try:
        return importlib.import_module(name), ""
    except ImportError as exc:
        return None, f"{name}: {exc}"


class PeerUnavailable(Exception):
    """A peer cannot run here (not installed, no peers directory); the text says why."""


class OpMissing(Exception):
    """Our side of a case cannot run yet: the op is not in recurra."""


def is_missing_op(exc: BaseException) -> bool:
    """Whether an exception means "this op is not written yet" rather than a real failure."""
    if isinstance(exc, (OpMissing, AttributeError, ImportError, NotImplementedError)):
        return True
    return isinstance(exc, ValueError) and "unknown op" in str(exc)


def need(module: Any, *names: str) -> list[Any]:
    """Returns module.<name> for each name; raises OpMissing naming the first one absent."""
    out = []
    for n in names:
        f = getattr(module, n, None)
        if f is None:
            raise OpMissing(n)
        out.append(f)
    return out


def cuda_measure(torch: Any, fn: Callable[[], Any], reps: int, warmup: int) -> Timing:
    """Times fn with CUDA events after `warmup` untimed runs; returns the runs in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(float(start.elapsed_time(end)))
    return Timing(runs)


# ------------------------------------------------------------------------------------------
# results
# ------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One benchmark case: our figure, the peers' figures, the target."""

    name: str
    ours_ms: float | None = None
    ours_note: str = ""  # why ours is missing, or an extra figure such as GFLOP/s
    peers: dict[str, float | None] = field(default_factory=dict)
    peer_notes: dict[str, str] = field(default_factory=dict)
    target: str = ""  # the design target, as text
    target_ms: float | None = None  # when the target is a time
    target_ratio: float | None = None  # when the target is a ratio against the first peer
    check: str = ""  # agreement of our result with a peer's / the reference

    def ratio(self, peer: str) -> float | None:
        p = self.peers.get(peer)
        if p is None or self.ours_ms is None or self.ours_ms <= 0:
            return None
        return p / self.ours_ms

    def met(self) -> bool | None:
        if self.ours_ms is None:
            return None
        if self.target_ms is not None:
            return self.ours_ms <= self.target_ms
        if self.target_ratio is not None and self.peers:
            r = self.ratio(next(iter(self.peers)))
            return None if r is None else r >= self.target_ratio
        return None

    def as_json(self) -> dict[str, Any]:
        return {
            "ours_ms": _r(self.ours_ms),
            "ours_note": self.ours_note or None,
            "peers_ms": {k: _r(v) for k, v in self.peers.items()},
            "peer_notes": self.peer_notes or None,
            "ratio_peer_over_ours": {k: _r(self.ratio(k)) for k in self.peers},
            "target": self.target or None,
            "target_met": self.met(),
            "check": self.check or None,
        }


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


_COLS = (
    ("case", 18),
    ("ours ms", 18),
    ("peer", 14),
    ("peer ms", 18),
    ("peer/ours", 9),
    ("target", 30),
)


def _fmt_ms(v: float | None, note: str) -> str:
    if v is None:
        return note or "n/a"
    return f"{v:.3f}"


class Table:
    """Prints cases as they finish and the final JSON line."""

    def __init__(self, title: str, env: dict[str, Any]) -> None:
        self.title = title
        self.env = env
        self.cases: list[Case] = []
        print(f"## {title}")
        print_environment(env)
        print("# ratio = peer time / our time (above 1: recurra is faster); medians of runs")
        print("  ".join(f"{n:<{w}}" for n, w in _COLS).rstrip(), flush=True)

    def add(self, case: Case) -> None:
        self.cases.append(case)
        met = case.met()
        target = case.target + ("" if met is None else (": met" if met else ": not met"))
        peers = list(case.peers.items()) or [("-", None)]
        for i, (pname, pms) in enumerate(peers):
            r = case.ratio(pname)
            cells = (
                case.name if i == 0 else "",
                _fmt_ms(case.ours_ms, case.ours_note) if i == 0 else "",
                pname,
                "-" if pname == "-" else _fmt_ms(pms, case.peer_notes.get(pname, "")),
                "-" if r is None else f"{r:.2f}x",
                target if i == 0 else "",
            )
            print("  ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, _COLS)).rstrip())
        extra = [case.ours_note] if case.ours_ms is not None and case.ours_note else []
        extra += [
            f"{k}: {v}" for k, v in case.peer_notes.items() if case.peers.get(k) is not None and v
        ]
        if case.check:
            extra.append(f"check: {case.check}")
        for e in extra:
            print(f"{'':<{_COLS[0][1]}}  ({e})")
        sys.stdout.flush()

    def finish(self) -> None:
        out = {
            "bench": self.title,
            "env": self.env,
            "cases": {c.name: c.as_json() for c in self.cases},
        }
        print("JSON " + json.dumps(out), flush=True)


def run_side(case: Case, fn: Callable[[], Timing], *, peer: str | None = None) -> None:
    """Runs one side of a case (ours when peer is None), recording its median or why not.

    A missing op gives "n/a (op missing)"; any other exception is reported, never raised.
    """
    try:
        ms = fn().median_ms
        note = ""
    except Exception as exc:
        ms = None
        if peer is None and is_missing_op(exc):
            note = "n/a (op missing)"
        elif peer is not None and isinstance(exc, PeerUnavailable):
            note = f"n/a ({exc})"
        else:
            first = str(exc).splitlines()[0][:120] if str(exc) else ""
            note = f"error: {type(exc).__name__}: {first}"
    if peer is None:
        case.ours_ms, case.ours_note = ms, (note or case.ours_note)
    else:
        case.peers[peer] = ms
        if note:
            case.peer_notes[peer] = note


def run_worker(script: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs ``python script --worker JSON(spec)`` and returns the dict of its last ``RESULT
    {...}`` line, or {"error": why} when it printed none or ran past ``timeout`` seconds."""
    try:
        p = subprocess.run(
            [sys.executable, script, "--worker", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if lines:
        res: dict[str, Any] = json.loads(lines[-1][7:])
        return res
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {p.returncode}: {' | '.join(tail)[:300]}"}


def gpu_used_mib() -> float | None:
    """GPU 0's memory in use (MiB) as nvidia-smi reports it; None without nvidia-smi."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return float(r.stdout.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def run_polled(script: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """run_worker, with GPU memory polled every 20 ms while the worker runs when
    spec["device"] is not the CPU: the result gets "gpu_peak" (bytes above what was in use
    before it started)."""
    poll = spec["device"] != "cpu"
    base = gpu_used_mib() if poll else None
    peak = [0.0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            v = gpu_used_mib()
            if v is not None:
                peak[0] = max(peak[0], v)
            stop.wait(0.02)

    th = threading.Thread(target=watch, daemon=True)
    if base is not None:
        th.start()
    try:
        res = run_worker(script, spec, timeout)
    finally:
        stop.set()
    if base is not None:
        th.join()
        res["gpu_peak"] = max(0.0, peak[0] - base) * 2**20
    return res

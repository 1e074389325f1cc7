"""The Mamba-2 scan alone on a Vulkan device, per dispatch, with float32 and with 2-byte sources.

    python bench/scan_dtypes.py [--rounds 15] [--warmup 40] [--shape S,T,H,P,N,G]
    python bench/scan_dtypes.py --small   # a smoke run (lavapipe)

One ``ssm_scan`` forward and backward (the chunked kernels, checkpoints saved, as in the last
layers of an autocast step) at the shape of a Mamba2-130M training step on the GPU (batch 8 x
512 tokens, 24 heads, head_dim 64, d_state 128, one group), for each case in turn: float32
x, B, C, dt ("f32"); bfloat16 x, B, C ("bf16", what the autocast step hands the scan); and
bfloat16 dt too ("bf16dt"). The cases run interleaved in one process after ``--warmup``
rounds of all of them (the GPU at its clocks: a cold GPU measured several times slower), so a
case's figures are not skewed by when it ran. The child process runs with
RECURRA_VULKAN_PROFILE=dispatch (each dispatch timed on its own, between barriers); printed:
the medians over ``--rounds`` rounds of each pass's GPU time per call (the scan kernels by
MODE and VAR of shaders/ssm_scan_chunked.comp, either variant), their total, and the wall
time of a call.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import time

LINE = re.compile(r"^recurra-vulkan\[[^\]]*\]\s+(\S+)\s+([0-9.]+) us$")
# ssm_scan_chunked[_h][MODE,VAR,dtypes...]: one row per pass, whichever variant ran it
PASS = re.compile(r"ssm_scan_chunked(?:_h)?\[(\d+),(\d+),[^\]]*\]")
NAMES = {
    "0,0": "prep",
    "1,0": "C.B",
    "2,0": "states (forward)",
    "2,1": "states (recomputed)",
    "2,2": "states (reverse)",
    "4,0": "y",
    "5,0": "dC/dB",
    "6,0": "du",
    "7,0": "decay",
}
CASES = {"f32": (), "bf16": ("x", "B", "C"), "bf16dt": ("x", "B", "C", "dt")}


def child(args: argparse.Namespace) -> None:
    import numpy as np

    import recurra as rc
    import recurra.backends  # noqa: F401
    from recurra import ops

    S, T, H, P, N, G = args.dims
    dev = args.device
    rng = np.random.default_rng(0)
    raw = {
        "x": rng.standard_normal((S, T, H, P)),
        "dt": rng.standard_normal((S, T, H)) - 2.0,
        "B": rng.standard_normal((S, T, G, N)),
        "C": rng.standard_normal((S, T, G, N)),
    }
    a = rc.tensor(-np.arange(1, H + 1, dtype=np.float32).reshape(H, 1), device=dev)
    s0 = rc.tensor(np.zeros((S, H, P, N), np.float32), device=dev)
    w = rc.tensor(rng.standard_normal((S, T, H, P)).astype(np.float32), device=dev)
    ids = np.arange(S, dtype=np.int32)
    inputs = {}
    for case, half in CASES.items():
        inputs[case] = {}
        for k, v in raw.items():
            t = rc.tensor(
                v.astype(np.float32), device=dev, dtype=rc.bfloat16 if k in half else None
            )
            inputs[case][k] = t.requires_grad_(True)

    def call(case: str) -> None:
        t = inputs[case]
        y, _ = ops.ssm_scan(s0, t["x"], t["dt"], a, t["B"], t["C"], ids, checkpoints=True)
        ops.sum(y * w).backward()
        for v in t.values():
            v.grad = None

    for _ in range(args.warmup):
        for case in CASES:
            call(case)
    for _ in range(args.rounds):
        for case in CASES:
            print(f"@@call {case}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            call(case)
            print(f"@@wall {(time.perf_counter() - t0) * 1e3:.4f}", file=sys.stderr, flush=True)


Times = dict[str, list[float]]


def parse(lines: list[str]) -> tuple[dict[str, Times], Times]:
    """Per case and pass, the GPU ms of each timed call; per case, the calls' wall ms."""
    per: dict[str, Times] = collections.defaultdict(lambda: collections.defaultdict(list))
    walls: Times = collections.defaultdict(list)
    case, acc = None, collections.defaultdict(float)
    for ln in lines:
        if ln.startswith("@@call "):
            case, acc = ln.split()[1], collections.defaultdict(float)
        elif ln.startswith("@@wall ") and case:
            walls[case].append(float(ln.split()[1]))
            for k, v in acc.items():
                per[case][k].append(v)
            per[case]["all dispatches"].append(sum(acc.values()))
            case = None
        elif case and (m := LINE.match(ln)):
            p = PASS.search(m.group(1))
            key = NAMES.get(f"{p.group(1)},{p.group(2)}", m.group(1)) if p else "other"
            acc[key] += float(m.group(2)) / 1e3
    return per, walls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="vulkan")
    ap.add_argument("--shape", default="8,512,24,64,128,1", help="S,T,H,P,N,G")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--small", action="store_true", help="2,128,2,64,64,1, 2 rounds, 1 warm-up")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.small:
        args.shape, args.rounds, args.warmup = "2,128,2,64,64,1", 2, 1
    args.dims = [int(v) for v in args.shape.split(",")]
    if len(args.dims) != 6:
        sys.exit("--shape: six sizes S,T,H,P,N,G")
    if args.child:
        child(args)
        return
    env = dict(os.environ, RECURRA_VULKAN_PROFILE="dispatch")
    argv = [sys.executable, __file__, "--child", *sys.argv[1:]]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        sys.exit(f"the scan failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    per, walls = parse(p.stderr.splitlines())
    cases = list(CASES)
    order = [n for n in NAMES.values() if n in per[cases[0]]] + ["other", "all dispatches"]
    print(
        f"ssm_scan forward + backward, shape {args.shape} (S,T,H,P,N,G), ms per call, medians"
        f" of {args.rounds} rounds after {args.warmup} warm-up rounds;"
        f" load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'pass':22s}" + "".join(f"{c:>9s}" for c in cases) + f"{'bf16/f32':>10s}")
    for name in order + ["wall"]:
        got = [walls[c] if name == "wall" else per[c].get(name) or [0.0] for c in cases]
        vals = [statistics.median(v) for v in got]
        ratio = f"{vals[1] / vals[0]:10.2f}" if vals[0] > 0 else f"{'':10s}"
        print(f"{name:22s}" + "".join(f"{v:9.3f}" for v in vals) + ratio)


if __name__ == "__main__":
    main()

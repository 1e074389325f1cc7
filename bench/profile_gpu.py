"""Where a training step's GPU time goes, by op: a preset's step on a Vulkan device with
per-node timestamps (RECURRA_VULKAN_PROFILE=1), summed by op over the last of --steps steps;
with --dispatch, per dispatch (RECURRA_VULKAN_PROFILE=dispatch), summed by op/shader[spec].

    python bench/profile_gpu.py --preset mamba2-130m --batch 8 --seq-len 512
    python bench/profile_gpu.py --preset mamba2-130m --precision bf16  # under autocast
    python bench/profile_gpu.py --preset rwkv7-0.1b --n-layer 2 --batch 1 --seq-len 64  # smoke

The step runs in a child process (the variable is read when the device is made); each node's
time is its own (timestamps around it), so the sum is the step's GPU time without the gaps
between submissions. The wall time of the same steps without timestamps comes from the
parent's own run of the child with profiling off, printed beside it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

LINE = re.compile(r"^recurra-vulkan\[[^\]]*\]\s+(\S+)\s+([0-9.]+) us$")


def child(args: argparse.Namespace) -> None:
    import numpy as np

    import recurra as rc
    import recurra.backends  # noqa: F401
    import recurra_models as rm
    from recurra_optim import AdamW

    rc.set_strict_placement(True)
    over = {"n_layer": args.n_layer} if args.n_layer else {}
    model = rm.create(args.preset, seed=0, **over).to(args.device)
    if args.recompute:
        model.gradient_checkpointing(True)
    opt = AdamW(list(model.parameters()), lr=1e-4)
    rng = np.random.default_rng(0)
    data = rng.integers(0, min(model.vocab_size, 50000), (args.batch, args.seq_len + 1))
    x = rc.tensor(data[:, :-1].astype(np.int32), device=args.device)
    y = rc.tensor(data[:, 1:].astype(np.int32), device=args.device)
    times = []
    for i in range(args.steps):
        print(f"@@step {i}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        half = args.precision == "bf16"
        with rc.autocast(rc.bfloat16) if half else contextlib.nullcontext():
            loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"@@done {json.dumps(times)}", file=sys.stderr, flush=True)


def run_child(args: argparse.Namespace, profile: bool) -> tuple[list[str], list[float]]:
    env = dict(os.environ)
    if profile:
        env["RECURRA_VULKAN_PROFILE"] = "dispatch" if args.dispatch else "1"
    else:
        env.pop("RECURRA_VULKAN_PROFILE", None)
    argv = [sys.executable, __file__, "--child", *sys.argv[1:]]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        sys.exit(f"the step failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    lines = p.stderr.splitlines()
    done = [ln for ln in lines if ln.startswith("@@done ")]
    times = json.loads(done[-1][7:]) if done else []
    last = max(i for i, ln in enumerate(lines) if ln.startswith("@@step "))
    return lines[last + 1 :], times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="mamba2-130m")
    ap.add_argument("--n-layer", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--device", default="vulkan")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--dispatch",
        action="store_true",
        help="one time per dispatch, by op/shader[specialization constants] (which kernel ran)",
    )
    ap.add_argument("--raw", help="also write the last step's nodes, in order, to this file")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    lines, prof_times = run_child(args, profile=True)
    _, times = run_child(args, profile=False)
    by_op: dict[str, list[float]] = collections.defaultdict(list)
    order = []
    for ln in lines:
        m = LINE.match(ln)
        if m:
            by_op[m.group(1)].append(float(m.group(2)) / 1e3)
            order.append(f"{m.group(1)} {m.group(2)}")
    if args.raw:
        with open(args.raw, "w") as f:
            f.write("\n".join(order) + "\n")
    total = sum(sum(v) for v in by_op.values())
    print(
        f"{args.preset} batch {args.batch} x {args.seq_len}"
        f"{' recompute' if args.recompute else ''} {args.precision}: step wall (no timestamps) "
        f"{', '.join(f'{t:.1f}' for t in times)} ms; with timestamps "
        f"{', '.join(f'{t:.1f}' for t in prof_times)} ms; GPU time in nodes, last step "
        f"{total:.1f} ms"
    )
    rows: list[tuple[str, Any, Any, Any]] = []
    for op, v in sorted(by_op.items(), key=lambda kv: -sum(kv[1])):
        rows.append((op, len(v), sum(v), 100 * sum(v) / max(total, 1e-9)))
    width = max([24] + [len(r[0]) for r in rows[: args.top]])
    print(f"{'op':{width}s} {'nodes':>6s} {'ms':>9s} {'%':>6s}")
    for op, n, ms, pct in rows[: args.top]:
        print(f"{op:{width}s} {n:6d} {ms:9.2f} {pct:6.1f}")
    print("JSON " + json.dumps({"times": times, "by_op": {k: sum(v) for k, v in by_op.items()}}))


if __name__ == "__main__":
    main()

"""Thread-pool benchmark: training tokens/s of a small Mamba-2 LM with one thread against
the default thread count, on an idle machine and beside a competing busy process.

    python bench/threads.py [--reps 5] [--steps 3] [--d-model 128] [--n-layer 2]
    python bench/threads.py --preset mamba2-130m --reps 3 --steps 1   # the issue's size

One training step = forward, backward and an AdamW update on a (batch 4, seq_len 256) batch
of random byte tokens. For each condition (idle; one busy process that this script starts,
a Python loop spinning on one core, and stops again) the two thread counts are timed
alternately in one process, `--reps` rounds of `--steps` steps each, so that a change of
load on a shared machine hits both alike; the figures are medians over the rounds.

Targets (issue 15): beside one busy process, default threads >= 0.9x the tokens/s of one
thread; idle, >= 1.6x (on a machine with 2 or more cores to itself).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SPIN = "while True: pass"


def build(args: argparse.Namespace):
    """The training step of bench/models.py (forward, backward, AdamW) at these sizes."""
    from models import ours_train

    size = {
        "vocab": args.vocab,
        "d_model": args.d_model,
        "n_layer": args.n_layer,
        "d_state2": args.d_state,
        "head_dim": args.head_dim,
        "batch": args.batch,
        "seq_len": args.seq_len,
    }
    out: dict = {}
    step = ours_train("mamba2", size, out)
    return out["params"], step


def free_cores(n: int) -> float:
    """How many cores n GIL-free threads (hashing 64 MiB each) get at once now: CPU time
    over wall time. Near n on an idle machine; the idle target needs it near 2."""
    import hashlib
    import resource
    import threading

    data = b"x" * (64 << 20)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=hashlib.sha256, args=(data,)) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / wall


def tokens_per_s(step, n_threads: int, steps: int, tokens: int) -> float:
    import recurra as rc

    rc.set_num_threads(n_threads)
    step()  # a warm-up step at this thread count (the plan cache is already warm)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * tokens / (time.perf_counter() - t0)


def measure(step, default: int, args: argparse.Namespace) -> dict[int, float]:
    tokens = args.batch * args.seq_len
    runs: dict[int, list[float]] = {1: [], default: []}
    for _ in range(args.reps):
        for n in runs:
            runs[n].append(tokens_per_s(step, n, args.steps, tokens))
    return {n: statistics.median(v) for n, v in runs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--d-state", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--preset", help="take the sizes of a Mamba-2 preset (e.g. mamba2-130m)")
    args = ap.parse_args()
    if args.preset:
        from recurra_models.presets import resolve

        arch, cfg = resolve(args.preset, {})
        if arch != "mamba2":
            ap.error(f"--preset takes a Mamba-2 preset, not {args.preset} ({arch})")
        args.d_model, args.n_layer = cfg["d_model"], cfg["n_layer"]
        args.d_state, args.head_dim, args.vocab = cfg["d_state"], cfg["head_dim"], cfg["vocab_size"]

    import recurra as rc

    default = rc.get_num_threads()
    n_params, step = build(args)
    step()  # plans the graphs
    print(
        f"mamba2 d_model {args.d_model}, {args.n_layer} layers, vocab {args.vocab}, {n_params} "
        f"parameters; batch {args.batch} x {args.seq_len}; default threads {default} "
        f"(CPUs available: {len(os.sched_getaffinity(0))}, load average "
        f"{os.getloadavg()[0]:.1f})"
    )
    print(f"cores {default} GIL-free threads get at once now: {free_cores(default):.2f}")
    if default == 1:
        print("only one CPU: nothing to compare")
        return 0
    results = {}
    for cond in ("idle", "busy"):
        spinner = None
        if cond == "busy":
            spinner = subprocess.Popen([sys.executable, "-c", SPIN])
            time.sleep(0.5)
        try:
            results[cond] = measure(step, default, args)
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    rc.set_num_threads(default)
    target = {"idle": 1.6, "busy": 0.9}
    head = f"{default} threads tok/s"
    print(f"{'condition':<32}{'1 thread tok/s':>16}{head:>18}{'ratio':>8}  target")
    for cond, r in results.items():
        ratio = r[default] / r[1]
        label = "idle" if cond == "idle" else "beside 1 busy process"
        print(f"{label:<32}{r[1]:>16.0f}{r[default]:>18.0f}{ratio:>8.2f}  >= {target[cond]}")
    print(f"load average after: {os.getloadavg()[0]:.1f} (a shared machine makes these noisy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The matrix products of a training step, ours against OpenBLAS's sgemm alone.

    python bench/gemm_shapes.py --threads 2 --reps 3

Each product of the Mamba-2 130M step at batch 4 x 256 (shapes below; the operands stored as
the step stores them: weights (out, in) row-major, hence the transposed views) runs through
``ops.matmul`` under ``recurra.profile()`` (the kernel's time, no graph overhead), and then
through cblas_sgemm of the same wheel with its own threads, in the same process. Best of
--reps for both; the ratio ours / sgemm. Run with RECURRA_GEMM_SPLIT=... set or not for an
A/B of the blocking in the same window.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from profile_step import _Sgemm  # noqa: E402

# (name, m, n, k, A stored transposed, B stored transposed, calls per step)
SHAPES = [
    ("in_proj fwd", 1024, 3352, 768, False, True, 24),
    ("in_proj dX", 1024, 768, 3352, False, False, 24),
    ("in_proj dW", 3352, 768, 1024, True, False, 24),
    ("out_proj fwd", 1024, 768, 1536, False, True, 24),
    ("out_proj dX", 1024, 1536, 768, False, False, 24),
    ("out_proj dW", 768, 1536, 1024, True, False, 24),
    ("lm_head fwd", 1024, 50288, 768, False, True, 1),
    ("lm_head dX", 1024, 768, 50288, False, False, 1),
    ("lm_head dW", 50288, 768, 1024, True, False, 1),
]


def ours_seconds(m: int, n: int, k: int, ta: bool, tb: bool, reps: int) -> tuple[float, float]:
    import recurra as rc
    from recurra import ops

    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
    b_np = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    a = rc.tensor(a_np)
    b = rc.tensor(b_np)
    best = cpu = float("inf")
    for _ in range(reps + 1):
        c0 = time.process_time()
        with rc.profile() as prof:
            out = ops.matmul(a.T if ta else a, b.T if tb else b)
            out.numpy()
        cpu = min(cpu, time.process_time() - c0)
        t = sum(o.seconds for o in prof.ops if o.key.startswith("matmul"))
        best = min(best, t)
    # The values, once: against numpy (float64) on a slice of rows.
    got = out.numpy()[:64]
    a64 = (a_np.T if ta else a_np)[:64].astype(np.float64)
    ref = a64 @ (b_np.T if tb else b_np).astype(np.float64)
    err = np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref)))
    assert err < 1e-4, err
    return best, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated names (substrings)")
    args = ap.parse_args()
    import recurra as rc

    rc.set_num_threads(args.threads)
    blas = _Sgemm(args.threads)
    print(f"load {os.getloadavg()[0]:.2f}; split {os.environ.get('RECURRA_GEMM_SPLIT', 'default')}")
    head = ("product", "m", "n", "k", "ours ms", "sgemm ms", "ratio", "x/step")
    print("{:<14} {:>6} {:>6} {:>6} {:>8} {:>9} {:>6} {:>6}".format(*head))
    tot_o = tot_s = tot_oc = tot_sc = 0.0
    for name, m, n, k, ta, tb, calls in SHAPES:
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        o, oc = ours_seconds(m, n, k, ta, tb, args.reps)
        c0 = time.process_time()
        s = min(blas.seconds(m, n, k, ta, tb, 1) for _ in range(max(1, args.reps // 3)))
        sc = (time.process_time() - c0) / 4  # blas.seconds: one call, then best of 3
        tot_oc += oc * calls
        tot_sc += sc * calls
        tot_o += o * calls
        tot_s += s * calls
        row = f"{name:<14} {m:6d} {n:6d} {k:6d} {o * 1e3:8.1f} {s * 1e3:9.1f}"
        print(f"{row} {o / s:6.2f} {calls:6d}  cpu ms {oc * 1e3:8.1f} {sc * 1e3:8.1f}")
    print(f"{'per step':<14} {'':>20} {tot_o * 1e3:8.0f} {tot_s * 1e3:9.0f} {tot_o / tot_s:6.2f}")
    print(f"CPU time per step: ours {tot_oc:.1f} s, sgemm {tot_sc:.1f} s")
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

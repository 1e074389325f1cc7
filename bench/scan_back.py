"""ssm_scan_back alone on the CPU, at the shape of a Mamba2-130M training step.

    python bench/scan_back.py [--threads 2] [--reps 15] [--shape S,T,H,P,N,G] [--per-state]

Default shape: batch 4, T 256, 24 heads, head_dim 64, d_state 128, one group, one decay
per head (bench/scale.py's mamba2-130m train step calls it 24 times per step). Calls the op
through recurra.ops.apply and prints, as medians over the calls: the op's own time
(recurra.profile's timer around the kernel, what bench/profile_step.py reports), the wall
time of the whole call (with recording, the upload of the inputs and reading the result)
and the process CPU time of the call; GFLOP/s on the op's time and the nominal count of
the sequential form (10 flops per state element per token: the forward sweep's S += u B^T
and dC += S^T dy, the reverse sweep's lam += dy C^T, dB += lam^T u, du += lam B); the load
average beside them.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import recurra as rc


def inputs(S: int, T: int, H: int, P: int, N: int, G: int, per_state: bool) -> list[np.ndarray]:
    """(grad, s, x, dt, A, B, C, ids) with Mamba-2-like magnitudes (softplus(dt) ~ 0.05..2)."""
    rng = np.random.default_rng(0)

    def r(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    na = N if per_state else 1
    A = -np.exp(r(H, na, scale=0.5)).astype(np.float32)
    grad = r(S * T * H * P + S * H * P * N, scale=0.1)
    srcs = [r(S, H, P, N, scale=0.1), r(S, T, H, P), r(S, T, H) - np.float32(1.5), A]
    srcs += [r(S, T, G, N, scale=0.3), r(S, T, G, N, scale=0.3), np.arange(S, dtype=np.int32)]
    return [grad, *srcs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shape", default="4,256,24,64,128,1", help="S,T,H,P,N,G")
    ap.add_argument("--per-state", action="store_true", help="A (H, N) instead of (H, 1)")
    args = ap.parse_args()
    S, T, H, P, N, G = (int(v) for v in args.shape.split(","))
    rc.set_num_threads(args.threads)
    ts = [rc.tensor(a) for a in inputs(S, T, H, P, N, G, args.per_state)]

    def call() -> None:
        rc.ops.apply("ssm_scan_back", ts).numpy()

    for _ in range(2):
        call()
    op_ms, wall, cpu = [], [], []
    for _ in range(args.reps):
        c0, t0 = time.process_time(), time.perf_counter()
        with rc.profile() as prof:
            call()
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
        op_ms.append(sum(o.seconds for o in prof.ops if o.key == "ssm_scan_back") * 1e3)
    ms = float(np.median(op_ms))
    gflop = 10.0 * S * T * H * P * N / 1e9
    decay = "per-state A" if args.per_state else "A per head"
    print(
        f"ssm_scan_back S{S} T{T} H{H} P{P} N{N} G{G} {decay}, {args.threads} threads:"
        f" op {ms:.2f} ms/call (min {min(op_ms):.2f}, max {max(op_ms):.2f}),"
        f" {gflop / ms * 1e3:.1f} GFLOP/s; whole call {float(np.median(wall)):.2f} ms wall,"
        f" {float(np.median(cpu)):.2f} ms CPU; load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()

"""Where the time of a training step goes: recurra.profile() over one step of a preset.

    python bench/profile_step.py --preset mamba2-130m                 # per op
    python bench/profile_step.py --preset mamba2-130m --by-shape --sgemm   # matmuls vs sgemm

Builds the preset (seed 0), runs one untimed step (forward + cross-entropy + backward +
AdamW), then --steps profiled steps, and prints the wall time of the phases (forward and
backward run as one graph at ``loss.backward()``; the optimizer at ``opt.step()``) and the
per-op table. With --sgemm every matmul / out_prod entry (by shape) is set beside the time
that OpenBLAS's sgemm alone takes for the same product on the same threads, measured in the
same process right after (GFLOP/s of both and their ratio).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys
import time
from typing import Any

import numpy as np


def _step_fn(preset: str, batch: int, seq_len: int, n_layer: int) -> tuple[Any, Any]:
    import recurra as rc
    import recurra_models as rm
    from recurra_optim import AdamW

    over = {"n_layer": n_layer} if n_layer else {}
    model = rm.create(preset, seed=0, **over)
    rng = np.random.default_rng(0)
    data = rng.integers(0, min(model.vocab_size, 50000), (batch, seq_len + 1)).astype(np.int32)
    x = rc.tensor(data[:, :-1].copy())
    y = rc.tensor(data[:, 1:].copy())
    opt = AdamW(list(model.parameters()), lr=1e-4)
    phases: dict[str, float] = {}

    def step() -> None:
        t0 = time.perf_counter()
        loss = model.loss(x, y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        float(loss.item())
        t3 = time.perf_counter()
        for k, v in (("forward+backward", t1 - t0), ("optimizer", t2 - t1), ("rest", t3 - t2)):
            phases[k] = phases.get(k, 0.0) + v

    return step, phases


_SHAPE = re.compile(r"\(([\d, ]*)\)([T*]?)")


def _parse(key: str) -> tuple[str, list[tuple[tuple[int, ...], str]]] | None:
    op, _, rest = key.partition(" ")
    if op not in ("matmul", "out_prod"):
        return None
    srcs = rest.split(" -> ")[0]
    shapes = [
        (tuple(int(d) for d in m.group(1).replace(" ", "").split(",") if d), m.group(2))
        for m in _SHAPE.finditer(srcs)
    ]
    return (op, shapes) if len(shapes) == 2 else None


class _Sgemm:
    """OpenBLAS's cblas_sgemm from the scipy-openblas32 wheel, through ctypes."""

    def __init__(self, threads: int) -> None:
        import scipy_openblas32

        name = f"lib{scipy_openblas32.get_library()}.so"
        lib = os.path.join(scipy_openblas32.get_lib_dir(), name)
        self.lib = ctypes.CDLL(lib)
        self.fn = self.lib.scipy_cblas_sgemm
        self.set_threads = self.lib.scipy_openblas_set_num_threads
        self.threads = threads

    def seconds(self, m: int, n: int, k: int, ta: bool, tb: bool, batch: int) -> float:
        a = np.random.default_rng(1).standard_normal((k, m) if ta else (m, k)).astype(np.float32)
        b = np.random.default_rng(2).standard_normal((n, k) if tb else (k, n)).astype(np.float32)
        c = np.empty((m, n), np.float32)
        ptr = ctypes.c_void_p
        args = (
            101,
            112 if ta else 111,
            112 if tb else 111,
            m,
            n,
            k,
            ctypes.c_float(1.0),
            ptr(a.ctypes.data),
            a.shape[1],
            ptr(b.ctypes.data),
            b.shape[1],
            ctypes.c_float(0.0),
            ptr(c.ctypes.data),
            n,
        )
        self.set_threads(self.threads)
        try:
            self.fn(*args)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(batch):
                    self.fn(*args)
                best = min(best, time.perf_counter() - t0)
        finally:
            self.set_threads(1)  # recurra runs BLAS single-threaded in its own pool
        return best


def _gemm_dims(op: str, shapes: list[tuple[tuple[int, ...], str]]) -> tuple[int, ...]:
    """(batch, m, n, k, trans_a, trans_b) of the product as recurra hands it to sgemm."""
    (sa, fa), (sb, fb) = shapes
    if op == "matmul":
        m, k = sa[-2], sa[-1]
        ta = fa == "T"
    else:  # out_prod: a (k, m)
        k, m = sa[-2], sa[-1]
        ta = fa != "T"
    n = sb[-1]
    tb = fb == "T"
    a_batch = int(np.prod(sa[:-2])) if len(sa) > 2 else 1
    b_batch = int(np.prod(sb[:-2])) if len(sb) > 2 else 1
    if b_batch == 1 and not ta:  # rows of all batches in one product
        return 1, a_batch * m, n, k, ta, tb
    return max(a_batch, b_batch), m, n, k, ta, tb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-130m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--by-shape", action="store_true")
    ap.add_argument("--sgemm", action="store_true", help="matmuls beside sgemm alone (by shape)")
    ap.add_argument("--limit", type=int, default=40)
    args = ap.parse_args()
    import recurra as rc

    rc.set_num_threads(args.threads)
    step, phases = _step_fn(args.preset, args.batch, args.seq_len, args.n_layer)
    step()
    phases.clear()
    load = os.getloadavg()
    cpu0 = time.process_time()
    with rc.profile(by_shape=args.by_shape or args.sgemm) as prof:
        for _ in range(args.steps):
            step()
    cpu = (time.process_time() - cpu0) / args.steps
    wall = sum(phases.values()) / args.steps
    print(
        f"{args.preset} batch {args.batch} x {args.seq_len}, {args.threads} threads, "
        f"{args.steps} step(s): {wall * 1e3:.0f} ms/step wall, {cpu * 1e3:.0f} ms CPU; "
        f"load before {load[0]:.2f} after {os.getloadavg()[0]:.2f}"
    )
    for k, v in phases.items():
        print(f"  {k:<18} {v / args.steps * 1e3:10.1f} ms")
    print(prof.table(args.limit))
    if not args.sgemm:
        return
    blas = _Sgemm(args.threads)
    print(f"\nmatmuls beside sgemm alone ({args.threads} threads), per step:")
    print(f"{'product':<60} {'ms':>8} {'GF/s':>6} {'sgemm ms':>9} {'GF/s':>6} {'ratio':>6}")
    tot_ours = tot_ref = 0.0
    for o in prof.ops:
        parsed = _parse(o.key)
        if not parsed:
            continue
        nb, m, n, k, ta, tb = _gemm_dims(*parsed)
        calls = o.calls / args.steps
        ours = o.seconds / args.steps
        ref = blas.seconds(m, n, k, bool(ta), bool(tb), nb) * calls
        flops = 2.0 * nb * m * n * k * calls
        tot_ours += ours
        tot_ref += ref
        print(
            f"{o.key[:60]:<60} {ours * 1e3:8.1f} {flops / ours / 1e9:6.1f} "
            f"{ref * 1e3:9.1f} {flops / ref / 1e9:6.1f} {ours / ref:6.2f}"
        )
    print(f"{'all products':<60} {tot_ours * 1e3:8.1f} {'':>6} {tot_ref * 1e3:9.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

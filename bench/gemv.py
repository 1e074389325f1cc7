"""Matrix-vector products of a token step, kernel level: GB/s of W read.

    python bench/gemv.py [--threads 2] [--reps 7]

For each shape (the 130M presets' in_proj, out_proj, x_proj, LM head) it times y = x @ W.T
with W (n, k) float32 over a ring of distinct matrices of --ring-mib MiB in all (more than the
last-level cache, as in a token step, where 0.5 GB of weights stream once per token):

- ours: one explicit graph of all the ring's products (recurra.Graph, ``matmul(x, W.T)``),
  computed once per repetition on --threads threads; beside it the same graph with
  RECURRA_GEMV_ADJACENT=1 (the kernel's four rows adjacent instead of a quarter of a task
  apart: one short stream per row group instead of four long ones), the two alternating;
- sgemv: OpenBLAS's cblas_sgemv (the scipy-openblas32 wheel, ctypes) on the same matrices
  with OpenBLAS's own --threads threads;
- copy: the memory bandwidth of a plain copy of --ring-mib MiB (numpy's copyto, read +
  written bytes counted) on one thread and on --threads threads (each a slice).

Figures are medians over --reps repetitions after a warm-up; the load average is printed
(the machine may be shared).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import numpy as np

SHAPES = {
    "in_proj 3072x768": (3072, 768),
    "in_proj2 3352x768": (3352, 768),
    "out_proj 768x1536": (768, 1536),
    "x_proj 80x1536": (80, 1536),
    "dt_proj 1536x48": (1536, 48),
    "lm_head 50280x768": (50280, 768),
}


def ring(n: int, k: int, mib: float) -> list[np.ndarray]:
    count = max(1, int(np.ceil(mib * 2**20 / (n * k * 4))))
    rng = np.random.default_rng(0)
    return [rng.standard_normal((n, k)).astype(np.float32) for _ in range(count)]


def median_s(fn, reps: int) -> float:
    fn()
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def ours(ws: list[np.ndarray], x: np.ndarray, reps: int) -> tuple[float, float, np.ndarray]:
    """(seconds of the ring's products, the same with adjacent rows, the first result)."""
    import recurra as rc

    g = rc.Graph()
    xi = g.input(x.shape)
    outs = []
    for w in ws:
        leaf = g.tensor(w.shape)
        g.set_data(leaf, w)
        y = rc.ops.matmul(xi, leaf.T)
        g.set_output(y)
        outs.append(y)
    g.set_data(xi, x)
    runs: dict[str, list[float]] = {"0": [], "1": []}
    g.compute()
    for _ in range(reps):
        for flag, times in runs.items():
            os.environ["RECURRA_GEMV_ADJACENT"] = flag
            t0 = time.perf_counter()
            g.compute()
            times.append(time.perf_counter() - t0)
    del os.environ["RECURRA_GEMV_ADJACENT"]
    return statistics.median(runs["0"]), statistics.median(runs["1"]), g.get_data(outs[0])


class Sgemv:
    def __init__(self, threads: int) -> None:
        import scipy_openblas32

        lib = os.path.join(
            scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so"
        )
        self.lib = ctypes.CDLL(lib)
        self.lib.scipy_openblas_set_num_threads(threads)

    def run(self, ws: list[np.ndarray], x: np.ndarray, reps: int) -> tuple[float, np.ndarray]:
        n, k = ws[0].shape
        ys = [np.empty(n, np.float32) for _ in ws]
        f = self.lib.scipy_cblas_sgemv
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        calls = [
            (101, 111, n, k, one, w.ctypes.data, k, x.ctypes.data, 1, zero, y.ctypes.data, 1)
            for w, y in zip(ws, ys)
        ]
        f.argtypes = [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        f.argtypes += [ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]

        def go() -> None:
            for c in calls:
                f(*c)

        return median_s(go, reps), ys[0]


def copy_gbs(mib: float, reps: int, threads: int) -> float:
    """GB/s of numpy's copy of mib MiB (read + written bytes) cut into `threads` slices
    copied by as many Python threads (copyto releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    src = np.ones(int(mib * 2**20) // 4, np.float32)
    dst = np.empty_like(src)
    cuts = np.linspace(0, src.size, threads + 1).astype(int)
    parts = [(dst[a:b], src[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    with ThreadPoolExecutor(threads) as ex:
        s = median_s(lambda: list(ex.map(lambda p: np.copyto(*p), parts)), reps)
    return 2 * src.nbytes / s / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ring-mib", type=float, default=160.0)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-sgemv", action="store_true")
    args = ap.parse_args()
    import recurra as rc

    rc.set_num_threads(args.threads)
    blas = None if args.no_sgemv else Sgemv(args.threads)
    print(f"threads {args.threads}, ring {args.ring_mib} MiB, load {os.getloadavg()}")
    for t in sorted({1, args.threads}):
        gbs = copy_gbs(args.ring_mib, args.reps, t)
        print(f"copy, {t} thread(s), read+write: {gbs:.1f} GB/s")
    print(f"{'shape':<20} {'ours GB/s':>10} {'adjacent':>9} {'sgemv GB/s':>11} {'ratio':>6}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = ring(n, k, args.ring_mib)
        x = np.random.default_rng(1).standard_normal((1, k)).astype(np.float32)
        nbytes = sum(w.nbytes for w in ws)
        s_ours, s_adj, y = ours(ws, x, args.reps)
        ref = ws[0].astype(np.float64) @ x[0].astype(np.float64)
        err = float(np.abs(y[0] - ref).max() / np.abs(ref).max())
        line = f"{name:<20} {nbytes / s_ours / 1e9:10.1f} {nbytes / s_adj / 1e9:9.1f}"
        if blas:
            s_b, yb = blas.run(ws, x[0].copy(), args.reps)
            line += f" {nbytes / s_b / 1e9:11.1f} {s_b / s_ours:6.2f}"
        print(line + f"   (rel err {err:.1e}, {len(ws)} matrices)")
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()

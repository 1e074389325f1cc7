"""Tensor-core matmul through Vulkan (VK_KHR_cooperative_matrix) against PyTorch bf16 cuBLAS,
in one run (issue 18; target: >= 40% of PyTorch's bf16 throughput at 4096^3).

    python bench/coopmat.py [--size 4096] [--reps 20] [--dtypes bf16,f16] [--variants cm128,...]

For every dtype and shader variant: C (f32) = A @ B through recurra_vulkan._coopmat_matmul
(GPU time per matmul from timestamp queries, the median of --runs calls of --reps matmuls
each), and torch.matmul on CUDA in bf16 (and f16 when asked; CUDA events). Inputs are random
normals rounded to the dtype; every result is checked against the float64 numpy product of
the same rounded inputs: max |C - ref| / max (|A| @ |B|) must stay under 1e-4 (both sides
accumulate in fp32; products of 16-bit floats are exact in fp32). Prints TFLOP/s, ours/torch
and whether the target is met; --json PATH writes the figures.

Where the device or build lacks cooperative matrices, the line says why (coopmat_info). Exit
status 1 when a result is wrong or no variant ran.

The op (--op, on by default): the bfloat16/float16 `matmul` node through recurra's graph API
(strict placement: it runs on the device; shaders/matmul_coopmat_op.comp where the device has
cooperative matrices, else the 2-byte fallback), on 4096^3 and the products of a Mamba2-130M
training step at batch 8 x 512 (in_proj 768 -> 3352, out_proj 1536 -> 768, the LM head
768 -> 50280 and a 1024-token chunk of it, each with its backward products dW = x^T @ dy and
dX = dy @ W^T as transposed views), beside torch.matmul in the same dtype and layout. Ours per
product: the wall time of a graph of R independent products minus that of a graph of one,
over R - 1 (the submission and the wait cancel out; medians of --runs computes; R from
--op-reps). --op-tilings runs each RECURRA_VK_COOPMAT setting (auto, op128, op64,
op128x256drnf, op128m, off = the fallback shader), each optionally with ":S" (split-K into
S slices, RECURRA_VK_SPLITK); each line shows the plan it ran (tiling/slices). The group
mamba2step holds the step's products in the layouts the step runs them in (x @ W^T forward,
the 256-row chunks of its LM head). Each result is checked against
torch's float64 product of the same inputs: |C - ref| <= u |ref| + 2 K 2^-24 (|A| @ |B|)
(u: 2^-8 bf16, 2^-11 f16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

TARGET = 0.40


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bits_to_f32(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def operands(n: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(bits, float32 value) of an n x n random normal matrix rounded to dtype."""
    x = np.random.default_rng(seed).standard_normal((n, n), dtype=np.float32)
    bits = round_bf16(x) if dtype == "bf16" else x.astype(np.float16).view(np.uint16)
    return bits, bits_to_f32(bits, dtype)


def rel_error(c: np.ndarray, ref: np.ndarray, scale: float) -> float:
    return float(np.max(np.abs(c.astype(np.float64) - ref)) / scale)


def torch_cuda():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    return torch, ""


def time_torch(
    torch, a32: np.ndarray, b32: np.ndarray, dtype: str, reps: int, runs: int
) -> tuple[float, np.ndarray]:
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    a = torch.from_numpy(a32).cuda().to(tdt)  # exact: the values are representable
    b = torch.from_numpy(b32).cuda().to(tdt)
    sec = cuda_seconds(torch, lambda: torch.matmul(a, b), reps, runs)
    return sec, torch.matmul(a, b).float().cpu().numpy()


def cuda_seconds(torch, fn, reps: int, runs: int) -> float:
    """Seconds per call of fn on the GPU: CUDA events around reps calls, median of runs
    (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        per.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(per)


# (name, M, K, N, A given as a transposed view, B given as a transposed view)
OP_SHAPES = {
    "square": [("4096^3", 4096, 4096, 4096, False, False)],
    # the same product with each operand given as a transposed view (its other layouts)
    "layouts": [
        ("4096^3 A^T", 4096, 4096, 4096, True, False),
        ("4096^3 B^T", 4096, 4096, 4096, False, True),
        ("4096^3 A^T B^T", 4096, 4096, 4096, True, True),
    ],
    # a smoke test for CPU Vulkan (lavapipe): odd sizes, every layout
    "small": [
        ("small x@W", 130, 72, 200, False, False),
        ("small x^T@dy", 130, 72, 200, True, False),
        ("small dy@W^T", 130, 72, 200, False, True),
    ],
    "mamba2": [
        ("in_proj x@W", 4096, 768, 3352, False, False),
        ("in_proj dW=x^T@dy", 768, 4096, 3352, True, False),
        ("in_proj dX=dy@W^T", 4096, 3352, 768, False, True),
        ("out_proj x@W", 4096, 1536, 768, False, False),
        ("out_proj dW=x^T@dy", 1536, 4096, 768, True, False),
        ("out_proj dX=dy@W^T", 4096, 768, 1536, False, True),
        ("lm_head x@W", 4096, 768, 50280, False, False),
        ("lm_head dW=x^T@dy", 768, 4096, 50280, True, False),
        ("lm_head dX=dy@W^T", 4096, 50280, 768, False, True),
        ("lm_head chunk 1024 x@W", 1024, 768, 50280, False, False),
        ("lm_head chunk dW", 768, 1024, 50280, True, False),
        ("lm_head chunk dX", 1024, 50280, 768, False, True),
    ],
    # the products of a bf16 Mamba2-130M training step at batch 8 x 512 as it runs them:
    # Linear weights stored (out, in), so the forward is x @ W^T and the input gradient dy @ W;
    # the tied LM head over a 7-chunk loss (640 rows of the 50288-token padded vocabulary:
    # 64 MiB of bf16 logits a chunk)
    "mamba2step": [
        ("in_proj x@W^T", 4096, 768, 3352, False, True),
        ("in_proj dW=x^T@dy", 768, 4096, 3352, True, False),
        ("in_proj dX=dy@W", 4096, 3352, 768, False, False),
        ("out_proj x@W^T", 4096, 1536, 768, False, True),
        ("out_proj dW=x^T@dy", 1536, 4096, 768, True, False),
        ("out_proj dX=dy@W", 4096, 768, 1536, False, False),
        ("lm_head 640 x@E^T", 640, 768, 50288, False, True),
        ("lm_head 640 dW=h^T@dl", 768, 640, 50288, True, False),
        ("lm_head 640 dX=dl@E", 640, 50288, 768, False, False),
    ],
}
UNIT = {"bf16": 2.0**-8, "f16": 2.0**-11}


def np_dtype(dtype: str) -> np.dtype:
    if dtype == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


def op_operands(m: int, k: int, n: int, ta: bool, tb: bool, dtype: str, seed: int):
    """The stored arrays (A^T when ta, B^T when tb), rounded to dtype."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32).astype(np_dtype(dtype))
    b = rng.standard_normal((n, k) if tb else (k, n), dtype=np.float32).astype(np_dtype(dtype))
    return a, b


def op_graph(a: np.ndarray, b: np.ndarray, ta: bool, tb: bool, count: int):
    """A strict graph of `count` independent products of the constants a, b (transposed views
    where asked); returns (graph, the first product)."""
    import recurra as rc
    from recurra import ops

    g = rc.Graph(backends=["vulkan"], strict=True)
    ca, cb = g.constant(a), g.constant(b)
    va = ops.transpose(ca) if ta else ca
    vb = ops.transpose(cb) if tb else cb
    ys = [ops.matmul(va, vb) for _ in range(count)]
    for y in ys:
        g.set_output(y)
    return g, ys[0]


def time_op(a, b, ta, tb, reps: int, runs: int) -> tuple[float, np.ndarray, str]:
    """Seconds per product through the graph API, its first result and its backend."""
    g1, y1 = op_graph(a, b, ta, tb, 1)
    gr, _ = op_graph(a, b, ta, tb, reps)
    for g in (g1, gr):
        g.compute()  # uploads the constants, builds the pipelines
        g.compute()
    t1, tr = [], []
    for _ in range(runs):
        for g, out in ((g1, t1), (gr, tr)):
            t0 = time.perf_counter()
            g.compute()
            out.append(time.perf_counter() - t0)
    sec = (statistics.median(tr) - statistics.median(t1)) / (reps - 1)
    return sec, g1.get_data(y1), g1.backend_of(y1)


def time_torch_op(torch, a, b, ta, tb, reps: int, runs: int):
    """torch.matmul in the same dtype and layout: (seconds, float64 reference, |A| @ |B|)."""
    tdt = torch.bfloat16 if a.dtype != np.float16 else torch.float16
    ta_, tb_ = (torch.from_numpy(x.astype(np.float32)).cuda().to(tdt) for x in (a, b))
    va = ta_.t() if ta else ta_
    vb = tb_.t() if tb else tb_
    sec = cuda_seconds(torch, lambda: torch.matmul(va, vb), reps, runs)
    a64, b64 = va.double(), vb.double()
    ref = torch.matmul(a64, b64)
    mag = torch.matmul(a64.abs(), b64.abs())
    return sec, ref, mag


def bench_op(args, torch) -> list[dict]:
    """The matmul op through the graph API on every shape and tiling, beside torch."""
    import os

    import recurra_vulkan as rv

    results = []
    shapes = [s for group in args.op_shapes.split(",") if group for s in OP_SHAPES[group]]
    shapes = [s for s in shapes if args.op_match in s[0]]
    tilings = [t for t in args.op_tilings.split(",") if t]
    for dtype in [d for d in args.dtypes.split(",") if d]:
        for name, m, k, n, ta, tb in shapes:
            a, b = op_operands(m, k, n, ta, tb, dtype, m + n)
            flop = 2.0 * m * n * k
            peer, ref, mag = None, None, None
            if torch is not None:
                t_sec, ref, mag = time_torch_op(torch, a, b, ta, tb, args.op_reps, args.runs)
                peer = flop / t_sec / 1e12
                print(f"{dtype} op {name} ({m}x{k} @ {k}x{n}) torch: {peer:8.1f} TFLOP/s")
            for tiling in tilings:
                # TILING, TILING:SLICES (RECURRA_VK_SPLITK) or TILING:SLICES:T
                # (RECURRA_VK_TRANSPOSE)
                env = os.environ
                env["RECURRA_VK_COOPMAT"], _, rest = tiling.partition(":")
                env["RECURRA_VK_SPLITK"], _, env["RECURRA_VK_TRANSPOSE"] = rest.partition(":")
                # A transposable: one row-major matrix with 16-byte loads (csrc/ops/matmul.cpp)
                transposable = not ta and k % 8 == 0
                tile, slices, at = rv._vk.coopmat_op_plan(m, n, k, a_transposable=transposable)
                plan = f"{tile}/{slices}" + ("/A^T" if at else "")
                try:
                    sec, c, where = time_op(a, b, ta, tb, args.op_reps, args.runs)
                except (RuntimeError, ValueError, MemoryError) as e:
                    print(f"{dtype} op {name} {tiling}: {type(e).__name__}: {e}")
                    results.append({"dtype": dtype, "op": name, "tiling": tiling, "error": str(e)})
                    continue
                finally:
                    for var in ("RECURRA_VK_COOPMAT", "RECURRA_VK_SPLITK", "RECURRA_VK_TRANSPOSE"):
                        os.environ.pop(var, None)
                ours = flop / sec / 1e12 if sec > 0 else float("nan")
                ok = None
                if ref is not None:
                    got = torch.from_numpy(c.astype(np.float64)).cuda()
                    tol = UNIT[dtype] * ref.abs() + 2 * k * 2.0**-24 * mag
                    ok = bool(((got - ref).abs() <= tol).all().item())
                ratio = ours / peer if peer else None
                line = f"{dtype} op {name} {tiling:<9} ({plan}) on {where}: {ours:8.1f} TFLOP/s"
                line += f" ({sec * 1e3:.3f} ms)"
                if ratio is not None:
                    line += f", ours/torch {ratio:.2f}"
                    if name == "4096^3":
                        line += " (meets" if ratio >= TARGET else " (misses"
                        line += f" >= {TARGET:.2f})"
                if ok is not None:
                    line += ", ok" if ok else ", WRONG"
                print(line, flush=True)
                results.append(
                    {
                        "dtype": dtype,
                        "op": name,
                        "shape": [m, k, n],
                        "tiling": tiling,
                        "plan": plan,
                        "backend": where,
                        "tflops": ours,
                        "seconds": sec,
                        "torch_tflops": peer,
                        "ratio": ratio,
                        "correct": ok,
                    }
                )
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=4096, help="M = N = K (default 4096)")
    ap.add_argument("--reps", type=int, default=20, help="matmuls per timed call")
    ap.add_argument("--runs", type=int, default=5, help="timed calls (the median is reported)")
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--variants", default="", help="shader variants (default: all built)")
    ap.add_argument("--device", type=int, default=0, help="Vulkan device index")
    ap.add_argument("--json", default="", help="write the figures to this file")
    ap.add_argument(
        "--op",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the matmul op through the graph API (default on)",
    )
    ap.add_argument(
        "--standalone",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the standalone variants (default on)",
    )
    ap.add_argument(
        "--op-shapes",
        default="square,mamba2",
        help="groups: square, layouts, mamba2, mamba2step, small",
    )
    ap.add_argument(
        "--op-tilings",
        default="auto",
        help="RECURRA_VK_COOPMAT values (auto, off, op128, op64, op128x256drnf, op128m), "
        "each optionally with :SLICES (RECURRA_VK_SPLITK: split-K into that many slices, empty: "
        "auto) and :T (RECURRA_VK_TRANSPOSE: on, off or auto: a row-major A transposed first)",
    )
    ap.add_argument("--op-match", default="", help="only the products whose name has this")
    ap.add_argument("--op-reps", type=int, default=10, help="products per timed graph (>= 2)")
    args = ap.parse_args(argv)

    import recurra_vulkan as rv

    n = args.size
    flop = 2.0 * n**3
    try:
        info = rv.coopmat_info(args.device)
    except (RuntimeError, ValueError) as e:
        print(f"no Vulkan device: {e}")
        return 1
    print(f"device {args.device}: {rv.backend_info()['devices'][args.device]['name']}")
    print(f"  coopmat: {info['summary']}")
    print(f"  build: {info['build_note']}")
    print(f"  shapes: {', '.join(info['shapes']) or 'none'}; subgroup {info['subgroup_size']}")
    variants = [v for v in args.variants.split(",") if v] or list(info["variants"])
    torch, why_torch = torch_cuda()
    results = []
    if args.op_reps < 2:
        ap.error("--op-reps must be at least 2")
    for dtype in [d for d in args.dtypes.split(",") if d and args.standalone]:
        a_bits, a32 = operands(n, dtype, 1)
        b_bits, b32 = operands(n, dtype, 2)
        ref = a32.astype(np.float64) @ b32.astype(np.float64)
        scale = float(np.max(np.abs(a32).astype(np.float64) @ np.abs(b32).astype(np.float64)))
        peer = None
        if torch is not None:
            t_sec, t_c = time_torch(torch, a32, b32, dtype, args.reps, args.runs)
            peer = flop / t_sec / 1e12
            err = rel_error(t_c, ref, scale)
            ms = t_sec * 1e3
            print(
                f"{dtype} torch.matmul {n}^3: {peer:8.1f} TFLOP/s ({ms:.3f} ms), rel err {err:.2e}"
            )
            results.append(
                {"dtype": dtype, "who": "torch", "tflops": peer, "seconds": t_sec, "rel_err": err}
            )
        else:
            print(f"{dtype} torch: n/a ({why_torch})")
        for v in variants:
            try:
                secs = []
                c = None
                for _ in range(args.runs):
                    c, s = rv._coopmat_matmul(
                        a_bits, b_bits, dtype=dtype, reps=args.reps, variant=v, device=args.device
                    )
                    secs.append(s)
            except (NotImplementedError, RuntimeError, MemoryError) as e:
                # not supported, or the driver refused the pipeline: the other variants still run
                print(f"{dtype} vulkan {v}: {type(e).__name__}: {e}")
                results.append({"dtype": dtype, "who": v, "error": f"{type(e).__name__}: {e}"})
                continue
            sec = statistics.median(secs)
            ours = flop / sec / 1e12
            err = rel_error(c, ref, scale)
            ok = err < 1e-4
            ratio = ours / peer if peer else None
            verdict = ""
            if ratio is not None:
                met = "meets" if ratio >= TARGET else "misses"
                verdict = f", ours/torch {ratio:.2f} ({met} >= {TARGET:.2f})"
            ms = sec * 1e3
            print(
                f"{dtype} vulkan {v:<10} {n}^3: {ours:8.1f} TFLOP/s ({ms:.3f} ms), "
                f"rel err {err:.2e} {'ok' if ok else 'WRONG'}{verdict}"
            )
            results.append(
                {
                    "dtype": dtype,
                    "who": v,
                    "tflops": ours,
                    "seconds": sec,
                    "rel_err": err,
                    "correct": ok,
                    "ratio": ratio,
                }
            )
    if args.op:
        results += bench_op(args, torch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": n, "info": info, "results": results}, f, indent=1)
    bad = [r for r in results if r.get("correct") is False]
    ran = [r for r in results if "correct" in r]
    return 1 if bad or not ran else 0


if __name__ == "__main__":
    sys.exit(main())

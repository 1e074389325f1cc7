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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

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
    for _ in range(3):
        c = torch.matmul(a, b)
    torch.cuda.synchronize()
    per = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            c = torch.matmul(a, b)
        end.record()
        torch.cuda.synchronize()
        per.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(per), c.float().cpu().numpy()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=4096, help="M = N = K (default 4096)")
    ap.add_argument("--reps", type=int, default=20, help="matmuls per timed call")
    ap.add_argument("--runs", type=int, default=5, help="timed calls (the median is reported)")
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--variants", default="", help="shader variants (default: all built)")
    ap.add_argument("--device", type=int, default=0, help="Vulkan device index")
    ap.add_argument("--json", default="", help="write the figures to this file")
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
    for dtype in [d for d in args.dtypes.split(",") if d]:
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": n, "info": info, "results": results}, f, indent=1)
    bad = [r for r in results if r.get("correct") is False]
    ran = [r for r in results if "correct" in r]
    return 1 if bad or not ran else 0


if __name__ == "__main__":
    sys.exit(main())

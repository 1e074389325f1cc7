"""Benchmark of the Vulkan backend's two reference kernels, timed with GPU timestamps.

    python packages/vulkan/tools/bench_vk.py [--size 4096] [--add-mib 256] [--iters 20]
                                             [--variants [NAMES]]

- matmul: C = A @ B, square fp32 matrices (also B transposed, the x @ W^T of a linear
  layer); prints ms and TFLOP/s.
- add: c = a + b with every operand --add-mib MiB; prints ms and GB/s (3 x bytes moved).

Each node runs through the backend's C table (``recurra_vulkan._vk.profile_node``: the same
alloc / copy_in / compute / synchronize calls the core makes); the time is the GPU time of
the dispatch (timestamp queries), the median of --iters runs after warm-up runs. When
PyTorch with CUDA is importable, the same work is timed with CUDA events (TF32 off) and the
ratio printed. A small correctness check against numpy runs first.

--variants [legacy,auto,...] (default: all) then times every matmul shader variant (chosen
through the environment variable RECURRA_VK_MATMUL, read by the backend at each dispatch)
at --size, both layouts, after a correctness check of that variant, and prints one line per
variant with its TFLOP/s next to torch's. A variant that fails or computes wrong results is
reported and skipped, so the run completes unattended.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np


def _vk_time(
    vk,
    op: str,
    srcs: list[np.ndarray],
    out_shape: tuple[int, ...],
    iters: int,
    warmup: int,
    device: int,
) -> float:
    times = vk.profile_node(op, srcs, [], [], out_shape, "float32", iters, warmup, device)
    return statistics.median(times)


def _torch_time(fn, iters: int, warmup: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


ENV = "RECURRA_VK_MATMUL"
VARIANTS = ("legacy", "auto", "r128k8", "r128", "r128x64", "r64")


def _matmul_error(vk, device: int) -> str:
    """Returns "" when matmul (both B layouts, aligned and odd sizes) agrees with numpy
    within a relative error of 1e-5, else a line saying where it does not."""
    rng = np.random.default_rng(0)
    for m, k, n in [(512, 512, 512), (300, 257, 129)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        want = a.astype(np.float64) @ b.astype(np.float64)
        for bb in (b, np.ascontiguousarray(b.T).T):
            got = vk.run_node("matmul", [a, bb], [], [], (m, n), "float32", 0, device)
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            if not err < 1e-5:
                return f"matmul {m}x{k}x{n}: relative error {err:.2e} against numpy: WRONG"
    return ""


def _check(vk, device: int) -> None:
    """Results agree with numpy (relative error) before anything is timed; exits otherwise."""
    why = _matmul_error(vk, device)
    if why:
        sys.exit(why)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1 << 20).astype(np.float32)
    y = rng.standard_normal(1 << 20).astype(np.float32)
    if not np.array_equal(vk.run_node("add", [x, y], [], [], x.shape, "float32", 0, device), x + y):
        sys.exit("add: results differ from numpy: WRONG")
    print("check: matmul and add agree with numpy")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=int, default=4096, help="matmul M = N = K (default 4096)")
    p.add_argument("--add-mib", type=int, default=256, help="MiB per add operand (default 256)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", type=int, default=0, help="Vulkan device index")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    p.add_argument(
        "--variants",
        nargs="?",
        const=",".join(VARIANTS),
        default=None,
        metavar="NAMES",
        help="also time these matmul variants (comma-separated; default all: "
        + ",".join(VARIANTS)
        + ")",
    )
    args = p.parse_args(argv)
    variants = [v for v in (args.variants or "").split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {','.join(unknown)}: choose from {','.join(VARIANTS)}")

    import recurra_vulkan

    info = recurra_vulkan.backend_info()
    if not info["devices"]:
        print(f"no Vulkan device: {info['reason']}")
        return 1
    vk = recurra_vulkan._vk
    dev = info["devices"][args.device]
    print(
        f"vulkan device {args.device}: {dev['name']} ({dev['kind']}, {dev['driver']}, "
        f"Vulkan {dev['api_version']}, {dev['memory_bytes'] / 2**30:.1f} GiB)"
    )
    torch = None if args.no_torch else _torch_cuda()
    if torch is not None:
        print(f"torch {torch.__version__} on {torch.cuda.get_device_name()} (TF32 off)")
    else:
        print("torch with CUDA: not available, Vulkan numbers only")
    _check(vk, args.device)

    n = args.size
    rng = np.random.default_rng(1)
    a = rng.standard_normal((n, n)).astype(np.float32)
    b = rng.standard_normal((n, n)).astype(np.float32)
    flops = 2.0 * n * n * n
    layouts = (("A @ B", b), ("A @ B^T", np.ascontiguousarray(b.T).T))
    torch_times: dict[str, float] = {}
    for label, bb in layouts:
        t = _vk_time(vk, "matmul", [a, bb], (n, n), args.iters, args.warmup, args.device)
        line = (
            f"matmul {n}^3 fp32 {label:8s} vulkan {t * 1e3:8.3f} ms {flops / t / 1e12:7.2f} TFLOP/s"
        )
        if torch is not None:
            ta = torch.from_numpy(a).cuda()
            tb = torch.from_numpy(np.ascontiguousarray(bb)).cuda()
            if label == "A @ B^T":
                tb = torch.from_numpy(np.ascontiguousarray(bb.T)).cuda().t()
            tt = _torch_time(lambda ta=ta, tb=tb: ta @ tb, args.iters, args.warmup)
            torch_times[label] = tt
            line += (
                f" | torch {tt * 1e3:8.3f} ms {flops / tt / 1e12:7.2f} TFLOP/s"
                f" | vulkan/torch {tt / t:5.2f}x"
            )
        print(line)

    count = args.add_mib * (1 << 20) // 4
    x = rng.standard_normal(count).astype(np.float32)
    y = rng.standard_normal(count).astype(np.float32)
    moved = 3.0 * count * 4
    t = _vk_time(vk, "add", [x, y], (count,), args.iters, args.warmup, args.device)
    line = (
        f"add {args.add_mib} MiB/operand fp32     vulkan {t * 1e3:8.3f} ms "
        f"{moved / t / 1e9:7.1f} GB/s"
    )
    if torch is not None:
        tx, ty = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
        tt = _torch_time(lambda: tx + ty, args.iters, args.warmup)
        line += (
            f" | torch {tt * 1e3:8.3f} ms {moved / tt / 1e9:7.1f} GB/s"
            f" | vulkan/torch {tt / t:5.2f}x"
        )
    print(line)

    if variants:
        _bench_variants(vk, variants, a, layouts, torch_times, args)
    return 0


def _bench_variants(
    vk,
    variants: list[str],
    a: np.ndarray,
    layouts: tuple[tuple[str, np.ndarray], ...],
    torch_times: dict[str, float],
    args: argparse.Namespace,
) -> None:
    """Prints, per matmul variant and layout, the Vulkan time and TFLOP/s next to torch's;
    a variant that raises or fails its correctness check gets one line saying so. Restores
    RECURRA_VK_MATMUL afterwards. Returns None."""
    n = args.size
    flops = 2.0 * n * n * n
    saved = os.environ.get(ENV)
    print(f"matmul variants ({ENV}), {n}^3 fp32, median of {args.iters} runs:")
    try:
        for name in variants:
            os.environ[ENV] = name
            try:
                why = _matmul_error(vk, args.device)
            except Exception as e:  # reported; the other variants still run
                why = f"failed: {type(e).__name__}: {e}"
            if why:
                print(f"  {name:8s} {why}", flush=True)
                continue
            for label, bb in layouts:
                try:
                    t = _vk_time(
                        vk, "matmul", [a, bb], (n, n), args.iters, args.warmup, args.device
                    )
                except Exception as e:
                    print(f"  {name:8s} {label:8s} failed: {type(e).__name__}: {e}", flush=True)
                    continue
                line = (
                    f"  {name:8s} {label:8s} vulkan {t * 1e3:8.3f} ms "
                    f"{flops / t / 1e12:7.2f} TFLOP/s"
                )
                tt = torch_times.get(label)
                if tt is not None:
                    line += (
                        f" | torch {flops / tt / 1e12:7.2f} TFLOP/s | vulkan/torch {tt / t:5.2f}x"
                    )
                print(line, flush=True)
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


if __name__ == "__main__":
    sys.exit(main())

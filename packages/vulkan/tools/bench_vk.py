"""Benchmark of the Vulkan backend's two reference kernels, timed with GPU timestamps.

    python packages/vulkan/tools/bench_vk.py [--size 4096] [--add-mib 256] [--iters 20]

- matmul: C = A @ B, square fp32 matrices (also B transposed, the x @ W^T of a linear
  layer); prints ms and TFLOP/s.
- add: c = a + b with every operand --add-mib MiB; prints ms and GB/s (3 x bytes moved).

Each node runs through the backend's C table (``recurra_vulkan._vk.profile_node``: the same
alloc / copy_in / compute / synchronize calls the core makes); the time is the GPU time of
the dispatch (timestamp queries), the median of --iters runs after warm-up runs. When
PyTorch with CUDA is importable, the same work is timed with CUDA events (TF32 off) and the
ratio printed. A small correctness check against numpy runs first.
"""

from __future__ import annotations

import argparse
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


def _check(vk, device: int) -> None:
    """Results agree with numpy (relative error) before anything is timed."""
    rng = np.random.default_rng(0)
    for m, k, n in [(512, 512, 512), (300, 257, 129)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        want = a.astype(np.float64) @ b.astype(np.float64)
        for bb in (b, np.ascontiguousarray(b.T).T):
            got = vk.run_node("matmul", [a, bb], [], [], (m, n), "float32", 0, device)
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            if not err < 1e-5:
                sys.exit(f"matmul {m}x{k}x{n}: relative error {err:.2e} against numpy: WRONG")
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
    args = p.parse_args(argv)

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
    for label, bb in (("A @ B", b), ("A @ B^T", np.ascontiguousarray(b.T).T)):
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
    return 0


if __name__ == "__main__":
    sys.exit(main())

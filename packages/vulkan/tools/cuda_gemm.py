"""Times tools/cuda_gemm.cu's kernels launched by CUDA itself, beside torch.matmul (issue 18,
round 12; a developer's tool): the reference for the same cubin launched on a Vulkan device
through VK_NVX_binary_import (tools/coopmat_probe.cpp). Needs PyTorch with CUDA and the
driver's libcuda; the kernels run in PyTorch's context, on its current stream.

    nvcc -arch=sm_90 -cubin -O3 -o cuda_gemm.cubin cuda_gemm.cu
    python cuda_gemm.py cuda_gemm.cubin g128s3:128:128:128 g128k16s3d:128:128:128:24576 \\
        --occupancy 16384,24576

An entry is NAME:INVOCATIONS:BM:BN[:DYNAMIC_SHARED_BYTES]. Each kernel's result is checked
against float32 products of the same bf16 operands (largest error relative to the largest
entry); times are CUDA events over 20 products, the median of 7.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _check(r: int, what: str) -> None:
    if r != 0:
        raise RuntimeError(f"{what} failed: CUresult {r}")


def _median_seconds(torch, launch, reps: int = 20, runs: int = 7) -> float:
    for _ in range(reps):
        launch()
    times = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            launch()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / reps)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cubin")
    ap.add_argument("entries", nargs="*", help="NAME:INVOCATIONS:BM:BN[:DYNAMIC_SHARED_BYTES]")
    ap.add_argument("--size", type=int, default=4096, help="M = N = K")
    ap.add_argument("--occupancy", default="", help="shared memory sizes for the occupancy kernel")
    args = ap.parse_args()

    import torch

    cuda = ctypes.CDLL("libcuda.so.1")
    torch.zeros(1, device="cuda")  # PyTorch's context, current on this thread
    module = ctypes.c_void_p()
    with open(args.cubin, "rb") as f:
        _check(cuda.cuModuleLoadData(ctypes.byref(module), f.read()), "cuModuleLoadData")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def function(name: str, shared: int) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        _check(cuda.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), name)
        if shared > 48 * 1024:
            attr = CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(cuda.cuFuncSetAttribute(fn, attr, shared), "cuFuncSetAttribute")
        return fn

    s = args.size
    a = torch.randn(s, s, device="cuda").to(torch.bfloat16)
    b = torch.randn(s, s, device="cuda").to(torch.bfloat16)
    ref = a.float() @ b.float()
    flop = 2.0 * s**3
    for entry in args.entries:
        name, threads, bm, bn, *rest = entry.split(":")
        shared = int(rest[0]) if rest else 0
        fn = function(name, shared)
        c = torch.zeros(s, s, device="cuda")
        vals = [ctypes.c_uint64(t.data_ptr()) for t in (a, b, c)] + [ctypes.c_int(s)] * 3
        params = (ctypes.c_void_p * 6)(*[ctypes.addressof(v) for v in vals])
        grid = (s // int(bm)) * (s // int(bn))

        def launch(fn=fn, grid=grid, threads=int(threads), shared=shared, params=params) -> None:
            _check(
                cuda.cuLaunchKernel(fn, grid, 1, 1, threads, 1, 1, shared, stream, params, None),
                "launch",
            )

        launch()
        torch.cuda.synchronize()
        err = ((c - ref).abs().max() / ref.abs().max()).item()
        sec = _median_seconds(torch, launch)
        ok = "ok" if err < 1e-4 else "WRONG"
        print(f"{name} (CUDA launch): {flop / sec / 1e12:.1f} TFLOP/s, max rel err {err:.1e} {ok}")
    if args.entries:
        sec = _median_seconds(torch, lambda: a @ b)
        print(f"torch.matmul bf16 {s}^3: {flop / sec / 1e12:.1f} TFLOP/s")
    for shared in [int(x) for x in args.occupancy.split(",") if x]:
        fn = function("occupancy", shared)
        counters = torch.zeros(2048, dtype=torch.int32, device="cuda")
        vals = [ctypes.c_uint64(counters.data_ptr()), ctypes.c_uint64(counters.data_ptr() + 4096)]
        vals.append(ctypes.c_int(2_000_000))
        params = (ctypes.c_void_p * 3)(*[ctypes.addressof(v) for v in vals])
        _check(
            cuda.cuLaunchKernel(fn, 4096, 1, 1, 128, 1, 1, shared, stream, params, None), "launch"
        )
        torch.cuda.synchronize()
        peak = counters[1024:][counters[1024:] > 0]
        lo, hi = peak.min().item(), peak.max().item()
        print(f"occupancy (CUDA launch): 128 invocations, {shared} bytes: {lo} to {hi} per SM")


if __name__ == "__main__":
    main()

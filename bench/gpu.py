"""GPU benchmarks of the Vulkan backend against PyTorch CUDA, in one run (issues 4 and 6).

    python bench/gpu.py [--small] [--reps 20] [--only mlp,adam]

- mlp:  a 2-layer MLP training step (x @ W1 + b1 -> relu -> @ W2 + b2 -> MSE, backward, SGD
        update), parameters and data resident on the device. It runs under strict placement
        (a node the device cannot run raises instead of falling back to the CPU), and the
        host<->device traffic of a step is printed: only the scalar loss may come back.
- adam: one Adam step over a 10M and a 100M parameter tensor. Ours: GPU time of the
        adam_step node (timestamp queries), and the wall time of recurra_optim.Adam.step()
        on a resident parameter; PyTorch: fused CUDA Adam (CUDA events). Effective
        bandwidth = 7 x 4 bytes per parameter (read p, g, m, v; write p, m, v) / time.

Prints ours, the peer, peer/ours (above 1: we are faster) and the target; medians of --reps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback

import numpy as np
from common import cuda_measure, measure


def torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def row(name: str, ours: float | None, peer: float | None, unit: str, target: str) -> None:
    o = f"{ours:10.3f} {unit}" if ours is not None else "       n/a"
    p = f"{peer:10.3f} {unit}" if peer is not None else "       n/a"
    r = f"{peer / ours:6.2f}x" if ours and peer else "   n/a"
    print(f"{name:<44} ours {o} | peer {p} | peer/ours {r} | target {target}", flush=True)


def bench_mlp(args, torch) -> None:
    import recurra as rc
    import recurra_optim as optim
    from recurra import ops

    B, D, H = (64, 32, 64) if args.small else (4096, 1024, 4096)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, D)).astype(np.float32)
    y = rng.standard_normal((B, D)).astype(np.float32)
    w1 = (rng.standard_normal((D, H)) / np.sqrt(D)).astype(np.float32)
    w2 = (rng.standard_normal((H, D)) / np.sqrt(H)).astype(np.float32)
    dev = "vulkan"
    xt, yt = rc.tensor(x, device=dev), rc.tensor(y, device=dev)
    params = [
        rc.param(w1, device=dev),
        rc.param(np.zeros(H, np.float32), device=dev),
        rc.param(w2, device=dev),
        rc.param(np.zeros(D, np.float32), device=dev),
    ]
    opt = optim.SGD(params, lr=1e-3)
    losses = []

    def step() -> None:
        W1, b1, W2, b2 = params
        h = ops.relu(xt @ W1 + b1)
        loss = ops.mse_loss(h @ W2 + b2, yt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    rc.set_strict_placement(True)
    try:
        step()
        rc.reset_transfer_stats()
        step()
        traffic = rc.transfer_stats()
        ours = measure(step, reps=args.reps, warmup=3).median_ms
    finally:
        rc.set_strict_placement(False)
    flops = 3 * 2 * B * (D * H + H * D)
    print(
        f"mlp B{B} D{D} H{H}: strict placement (zero CPU nodes) ok; one step moved "
        f"{traffic}; loss {losses[0]:.4f} -> {losses[-1]:.4f}",
        flush=True,
    )
    peer = None
    if torch is not None:
        tx, ty = torch.tensor(x, device="cuda"), torch.tensor(y, device="cuda")
        tp = [
            torch.tensor(w1, device="cuda", requires_grad=True),
            torch.zeros(H, device="cuda", requires_grad=True),
            torch.tensor(w2, device="cuda", requires_grad=True),
            torch.zeros(D, device="cuda", requires_grad=True),
        ]
        topt = torch.optim.SGD(tp, lr=1e-3)

        def tstep() -> None:
            h = torch.relu(tx @ tp[0] + tp[1])
            loss = torch.nn.functional.mse_loss(h @ tp[2] + tp[3], ty)
            loss.backward()
            topt.step()
            topt.zero_grad()
            loss.item()

        peer = cuda_measure(torch, tstep, args.reps, 3).median_ms
    row("mlp step (wall, incl. loss.item())", ours, peer, "ms", "zero CPU nodes")
    print(f"  ours {flops / ours / 1e9:.2f} TFLOP/s", flush=True)


def bench_adam(args, torch) -> None:
    import recurra as rc
    import recurra_optim as optim
    import recurra_vulkan._vk as vk
    from recurra.ops import pack_hyper

    sizes = [10_000] if args.small else [10_000_000, 100_000_000]
    rng = np.random.default_rng(1)
    for n in sizes:
        p = rng.standard_normal(n).astype(np.float32)
        g = rng.standard_normal(n).astype(np.float32)
        hyper = pack_hyper({"lr": 1e-3, "a": 0.9, "b": 0.999, "c": 1e-8})
        zeros = np.zeros(n, np.float32)
        srcs = [hyper, p, g, zeros, zeros.copy(), np.zeros(1, np.int32)]
        gpu_ms = 1e3 * statistics.median(
            vk.profile_node("adam_step", srcs, [1, 0], [], [1], "float32", args.reps, 3, 0)
        )
        w = rc.param(p, device="vulkan")
        opt = optim.Adam([w], lr=1e-3)
        w.grad = rc.tensor(g, device="vulkan")

        wall_ms = measure(opt.step, reps=args.reps, warmup=3).median_ms
        peer = None
        if torch is not None:
            tp = torch.tensor(p, device="cuda", requires_grad=True)
            tp.grad = torch.tensor(g, device="cuda")
            topt = torch.optim.Adam([tp], lr=1e-3, fused=True)
            peer = cuda_measure(torch, topt.step, args.reps, 3).median_ms
        nbytes = 7 * 4 * n
        row(f"adam {n / 1e6:g}M: GPU time of the node", gpu_ms, peer, "ms", ">= 2.5 TB/s")
        row(f"adam {n / 1e6:g}M: Adam.step() wall", wall_ms, peer, "ms", "")
        line = f"  effective: ours {nbytes / gpu_ms / 1e9:.2f} TB/s (node), "
        line += f"{nbytes / wall_ms / 1e9:.2f} TB/s (step wall)"
        if peer:
            line += f"; torch fused {nbytes / peer / 1e9:.2f} TB/s"
        print(line, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny sizes (a check on lavapipe)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="mlp,adam")
    args = ap.parse_args()
    torch = torch_cuda()
    print(f"torch CUDA: {torch.cuda.get_device_name() if torch else 'n/a'}", flush=True)
    failed = 0
    for name, fn in (("mlp", bench_mlp), ("adam", bench_adam)):
        if name not in args.only.split(","):
            continue
        try:
            fn(args, torch)
        except Exception:  # noqa: BLE001 - one failing case costs its rows, not the run
            failed += 1
            print(f"{name}: FAILED", flush=True)
            traceback.print_exc(file=sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

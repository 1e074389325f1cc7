"""Optimizer benchmarks: one Adam step, recurra-optim against torch.optim.Adam.

    python bench/optim.py [--threads 2] [--reps 21] [--only adam-10M,adam-100x100K,adam-tiny]

Cases (as /work/shared/peers/bench_adam.py): 10M fp32 parameters in one tensor, and in 100
tensors of 100K; plus 1,000 tensors of 64 elements, where the per-tensor overhead shows.
PyTorch's fused CPU Adam, foreach and single-tensor paths are timed in the same process,
taking turns step by step (ours, fused, foreach, single, ours, ...) so that the load of a
shared machine hits every side alike; the figures are medians.
The step is memory-bound: it reads p, g, m, v and writes p, m, v (28 bytes per parameter);
GB/s below are 28 * n / time. The target is ours <= PyTorch fused (ratio >= 1.0x).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from common import Case, PeerUnavailable, Table, Timing, environment, load_recurra, parse_args

CASES = {
    "adam-10M": [(10_000_000,)],
    "adam-100x100K": [(100_000,)] * 100,
    "adam-tiny": [(64,)] * 1000,
}
PEERS = (
    ("torch fused", dict(fused=True)),
    ("torch foreach", dict(foreach=True)),
    ("torch single", dict(foreach=False)),
)


def gbps(n: int, ms: float | None) -> str:
    return "" if not ms else f"{28 * n / ms / 1e6:.1f} GB/s"


def bench_case(name: str, shapes: list[tuple[int, ...]], rc: Any, args: Any, table: Table) -> None:
    n = sum(int(np.prod(s)) for s in shapes)
    case = Case(f"{name}", target="<= torch fused (ratio >= 1.0x)", target_ratio=1.0)
    rng = np.random.default_rng(0)
    inits = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    grads = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    steps: dict[str, Callable[[], Any]] = {}
    ours_opt: Any = None
    ours_params: list[Any] = []
    try:
        if rc is None:
            raise RuntimeError("recurra not importable")
        import recurra_optim

        ours_params = [rc.param(a) for a in inits]
        for p, g in zip(ours_params, grads):
            p.grad = rc.tensor(g)
        ours_opt = recurra_optim.Adam(ours_params, lr=1e-3)
        steps["ours"] = ours_opt.step
    except Exception as exc:  # reported in the table, never raised
        case.ours_note = f"error: {type(exc).__name__}: {exc}"
    notes: dict[str, str] = {}
    for label, kw in PEERS:
        try:
            steps[label] = torch_adam(inits, grads, args, kw)
        except PeerUnavailable as exc:
            notes[label] = f"n/a ({exc})"
    timings = measure_interleaved(steps, args.reps, args.warmup)
    case.ours_ms = timings["ours"].median_ms if "ours" in timings else None
    for label, _ in PEERS:
        case.peers[label] = timings[label].median_ms if label in timings else None
        if label in notes:
            case.peer_notes[label] = notes[label]
        elif case.peers[label]:
            case.peer_notes[label] = gbps(n, case.peers[label])
    if case.ours_ms:
        case.ours_note = f"ours {gbps(n, case.ours_ms)}"
        if not args.no_check:
            check_against_torch(inits, grads, ours_opt, ours_params, case)
    table.add(case)


def measure_interleaved(
    steps: dict[str, Callable[[], Any]], reps: int, warmup: int
) -> dict[str, Timing]:
    """Times each step function ``reps`` times, taking turns (ours, peer 1, peer 2, ...), so
    that a change in the machine's load hits every side alike; returns each side's runs."""
    for _ in range(max(1, warmup)):
        for fn in steps.values():
            fn()
    runs: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(max(3, reps)):
        for k, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            runs[k].append((time.perf_counter() - t0) * 1e3)
    return {k: Timing(v) for k, v in runs.items()}


def torch_adam(
    inits: list[np.ndarray], grads: list[np.ndarray], args: Any, kw: dict[str, Any]
) -> Callable[[], Any]:
    """PyTorch's Adam over copies of the same parameters and gradients; returns its step."""
    try:
        import torch
    except ImportError as e:
        raise PeerUnavailable(f"torch not installed ({e})") from None
    torch.set_num_threads(args.threads)
    params = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in inits]
    for p, g in zip(params, grads):
        p.grad = torch.from_numpy(g.copy())
    return torch.optim.Adam(params, lr=1e-3, **kw).step


def check_against_torch(
    inits: list[np.ndarray], grads: list[np.ndarray], opt: Any, ps: list[Any], case: Case
) -> None:
    """After the timed steps, compares our parameters with torch's after as many steps."""
    try:
        import torch
    except ImportError:
        case.check = "torch absent: not compared"
        return
    steps = opt.step_count
    tp = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in inits[:3]]
    for p, g in zip(tp, grads[:3]):
        p.grad = torch.from_numpy(g.copy())
    topt = torch.optim.Adam(tp, lr=1e-3, fused=True)
    for _ in range(steps):
        topt.step()
    err = max(
        float(
            np.max(np.abs(p.numpy() - t.detach().numpy()))
            / max(float(np.max(np.abs(t.detach().numpy()))), 1e-30)
        )
        for p, t in zip(ps[:3], tp)
    )
    case.check = f"max rel diff vs torch fused after {steps} steps: {err:.1e}"


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], CASES)
    rc, where = load_recurra(args.threads)
    env = environment(args.threads)
    env["recurra"] = where
    table = Table("optim", env)
    for name in args.cases:
        bench_case(name, CASES[name], rc, args, table)
    table.finish()


if __name__ == "__main__":
    main()

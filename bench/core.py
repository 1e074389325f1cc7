"""Core benchmarks: fp32 matmul, elementwise add, a small MLP training step.

    python bench/core.py [--threads 2] [--reps 7] [--only matmul,add,mlp]

Peers, timed in the same process: numpy (matmul, add) and PyTorch's CPU build (MLP, when
installed). numpy and recurra both call OpenBLAS for matmul, so OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE (set on some machines; they slow a current OpenBLAS) affect both: the
header says which values are in effect. For fair numbers run under
`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from common import (
    Case,
    PeerUnavailable,
    Table,
    environment,
    load_recurra,
    measure,
    need,
    parse_args,
    run_side,
)

CASES = ["matmul", "add", "mlp"]

MATMUL_N = 2048
ADD_MB = 64  # size of each operand
MLP = {"batch": 256, "d_in": 1024, "d_hidden": 1024, "d_out": 10}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|."""
    want = np.asarray(want, np.float64)
    return float(
        np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.max(np.abs(want)), 1e-30)
    )


def bench_matmul(rc: Any, args: Any, table: Table) -> None:
    n = MATMUL_N
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    flop = 2.0 * n**3
    case = Case(f"matmul {n}^3", target=">= 0.8x numpy GFLOP/s", target_ratio=0.8)
    timing = dict(reps=args.reps, warmup=args.warmup, budget_s=args.budget)

    def ours() -> Any:
        if rc is None:
            raise RuntimeError("recurra not importable")
        (matmul,) = need(rc.ops, "matmul")
        ta, tb = rc.tensor(a), rc.tensor(b)
        got = np.asarray(matmul(ta, tb))
        if not args.no_check:
            err = rel_err(got, a.astype(np.float64) @ b)
            case.check = f"max rel err vs float64 numpy {err:.1e}"
        return measure(lambda: np.asarray(matmul(ta, tb)), **timing)

    run_side(case, ours)
    run_side(case, lambda: measure(lambda: a @ b, **timing), peer="numpy")
    if case.ours_ms:
        case.ours_note = f"ours {flop / case.ours_ms / 1e6:.1f} GFLOP/s"
    if case.peers.get("numpy"):
        case.peer_notes["numpy"] = f"{flop / case.peers['numpy'] / 1e6:.1f} GFLOP/s"
    table.add(case)


def bench_add(rc: Any, args: Any, table: Table) -> None:
    n = ADD_MB * (1 << 20) // 4
    rng = np.random.default_rng(1)
    a = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    moved = 3.0 * n * 4  # read two operands, write one result
    case = Case(f"add {ADD_MB} MB", target=">= 0.8x numpy GB/s", target_ratio=0.8)
    timing = dict(reps=args.reps, warmup=args.warmup, budget_s=args.budget)

    def ours() -> Any:
        if rc is None:
            raise RuntimeError("recurra not importable")
        ta, tb = rc.tensor(a), rc.tensor(b)
        got = np.asarray(ta + tb)
        if not args.no_check:
            case.check = f"max rel err vs numpy {rel_err(got, a + b):.1e}"
        return measure(lambda: np.asarray(ta + tb), **timing)

    run_side(case, ours)
    run_side(case, lambda: measure(lambda: a + b, **timing), peer="numpy")
    if case.ours_ms:
        case.ours_note = f"ours {moved / case.ours_ms / 1e6:.1f} GB/s (a fresh result array)"
    if case.peers.get("numpy"):
        case.peer_notes["numpy"] = f"{moved / case.peers['numpy'] / 1e6:.1f} GB/s (a + b)"
    table.add(case)


def _mlp_data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    bsz, d_in, d_h, d_out = MLP["batch"], MLP["d_in"], MLP["d_hidden"], MLP["d_out"]
    return {
        "x": rng.standard_normal((bsz, d_in), dtype=np.float32),
        "y": rng.integers(0, d_out, bsz).astype(np.int32),
        "w1": (rng.standard_normal((d_in, d_h)) / np.sqrt(d_in)).astype(np.float32),
        "b1": np.zeros(d_h, np.float32),
        "w2": (rng.standard_normal((d_h, d_out)) / np.sqrt(d_h)).astype(np.float32),
        "b2": np.zeros(d_out, np.float32),
    }


def bench_mlp(rc: Any, args: Any, table: Table) -> None:
    d = _mlp_data()
    shape = f"{MLP['batch']}x{MLP['d_in']}->{MLP['d_hidden']}->{MLP['d_out']}"
    case = Case("mlp fwd+bwd", target="(none)")
    timing = dict(reps=args.reps, warmup=args.warmup, budget_s=args.budget)
    results: dict[str, tuple[float, np.ndarray]] = {}

    def ours() -> Any:
        if rc is None:
            raise RuntimeError("recurra not importable")
        matmul, relu, xent = need(rc.ops, "matmul", "relu", "cross_entropy")
        x, y = rc.tensor(d["x"]), rc.tensor(d["y"])
        params = [rc.param(d[k]) for k in ("w1", "b1", "w2", "b2")]

        def step() -> tuple[Any, list[np.ndarray]]:
            for p in params:
                p.grad = None
            w1, b1, w2, b2 = params
            loss = xent(matmul(relu(matmul(x, w1) + b1), w2) + b2, y)
            loss.backward()
            return loss, [np.asarray(p.grad) for p in params]

        loss, grads = step()
        results["recurra"] = (float(np.asarray(loss).reshape(-1)[0]), grads[0])
        return measure(step, **timing)

    def torch_side() -> Any:
        try:
            import torch
            import torch.nn.functional as F  # noqa: N812 - PyTorch's own convention
        except ImportError as exc:
            raise PeerUnavailable("torch not installed") from exc
        torch.set_num_threads(args.threads)
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"]).long()
        params = [torch.tensor(d[k], requires_grad=True) for k in ("w1", "b1", "w2", "b2")]

        def step() -> Any:
            for p in params:
                p.grad = None
            w1, b1, w2, b2 = params
            loss = F.cross_entropy(torch.relu(x @ w1 + b1) @ w2 + b2, y)
            loss.backward()
            return loss

        loss = step()
        results["torch"] = (loss.item(), params[0].grad.numpy().copy())
        return measure(step, **timing)

    run_side(case, ours)
    run_side(case, torch_side, peer="torch")
    case.ours_note = case.ours_note or shape
    if not args.no_check and "recurra" in results and "torch" in results:
        (l_o, g_o), (l_t, g_t) = results["recurra"], results["torch"]
        case.check = f"loss {l_o:.6f} vs torch {l_t:.6f}; dW1 max rel err {rel_err(g_o, g_t):.1e}"
    table.add(case)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], CASES)
    rc, info = load_recurra(args.threads)
    env = environment(args.threads)  # after both OpenBLAS copies are loaded
    env["recurra"] = info
    table = Table("core", env)
    for name, fn in (("matmul", bench_matmul), ("add", bench_add), ("mlp", bench_mlp)):
        if name in args.cases:
            fn(rc, args, table)
    table.finish()


if __name__ == "__main__":
    main()

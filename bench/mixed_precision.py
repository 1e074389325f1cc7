"""Mixed precision against float32: a preset trained for --steps steps in each precision on
the same batches, from the same weights; ms/step, peak memory and the two loss curves.

    python bench/mixed_precision.py --device vulkan --preset mamba2-130m --batch 8 --seq-len 512
    python bench/mixed_precision.py --preset mamba2-130m --n-layer 2 --batch 2 --seq-len 64 \\
        --steps 20   # a CPU smoke run

The batches come from a fixed random first-order Markov chain over --symbols token ids
(seeded): a language a model learns step by step, so the curves fall and can be compared
step by step. Each precision runs in a process of its own (its peak memory is its own: on a
GPU what nvidia-smi reports while it runs, less what was in use before; everywhere the
library's own count, recurra.memory_stats). "bf16" is float32 parameters and optimizer
state with the forward under ``recurra.autocast(recurra.bfloat16)``. Both precisions run the
step through ``recurra.capture`` as ``recurra_models.Trainer`` does (``--no-capture``: the
model's Python records the step again every time).

Printed: median ms/step over the steps after --warmup, the speed-up (float32 ms / bf16 ms),
peak memory and its ratio (bf16 / float32), and the largest relative difference of the
loss curves, per step and of their 10-step moving averages.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import run_polled

HERE = Path(__file__).resolve().parent


def markov_batches(vocab: int, symbols: int, batch: int, seq_len: int, steps: int, seed: int):
    """steps batches (batch, seq_len + 1) of int32 ids from a seeded Markov chain: each
    symbol has 4 likely successors (weights 8, 4, 2, 1) among `symbols` ids below vocab."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(min(vocab, 50000), symbols, replace=False).astype(np.int32)
    succ = rng.integers(0, symbols, (symbols, 4))
    p = np.array([8, 4, 2, 1], np.float64) / 15
    for _ in range(steps):
        s = np.empty((batch, seq_len + 1), np.int64)
        s[:, 0] = rng.integers(0, symbols, batch)
        for t in range(1, seq_len + 1):
            pick = rng.choice(4, batch, p=p)
            s[:, t] = succ[s[:, t - 1], pick]
        yield ids[s]


def keep_variant(precision: str) -> None:
    """Sets Mamba-2's recomputation switches for a bf16 variant: bf16-keep keeps everything
    (checkpoints saved, norm + out_proj kept in every layer), bf16-keepnorm=F the norm's
    output in the last fraction F of the layers (mamba2.KEEP_NORM_PROJ; 1 without =F),
    bf16-keepck=F the scan's checkpoints (mamba2.KEEP_CHECKPOINTS), bf16-keepnorm=F+ck=G
    both. Raises ValueError for another name."""
    if precision in ("fp32", "bf16"):
        return
    from recurra_models import mamba2

    if precision == "bf16-keep":
        mamba2.SCAN_CHECKPOINTS, mamba2.RECOMPUTE_NORM_PROJ = True, False
        return
    if not precision.startswith("bf16-keep"):
        raise ValueError(f"unknown precision {precision!r}")
    for part in precision[len("bf16-keep") :].split("+"):
        what, _, f = part.partition("=")
        frac = float(f) if f else 1.0
        if what == "norm":
            mamba2.KEEP_NORM_PROJ = frac
        elif what == "ck":
            mamba2.KEEP_CHECKPOINTS = frac
        else:
            raise ValueError(f"unknown precision {precision!r}")


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import recurra as rc
    import recurra_models as rm
    from recurra_optim import AdamW

    if spec["device"] != "cpu":
        import recurra.backends  # noqa: F401

        rc.set_strict_placement(True)
    keep_variant(spec["precision"])
    over = {"n_layer": spec["n_layer"]} if spec["n_layer"] else {}
    model = rm.create(spec["preset"], seed=0, **over).to(spec["device"])
    if spec.get("loss_chunk_bytes") is not None:
        model.loss_chunk_bytes = spec["loss_chunk_bytes"]
    opt = AdamW(list(model.parameters()), lr=spec["lr"])
    half = spec["precision"].startswith("bf16")
    # the step as recurra_models.Trainer runs it: captured (the plan runs from its cache)
    step = None
    if spec["capture"]:
        step = rc.capture(model.loss, backward=True, params=model.parameters)
    losses, times = [], []
    rc._core.reset_peak_memory()
    batches = markov_batches(
        model.vocab_size, spec["symbols"], spec["batch"], spec["seq_len"], spec["steps"], 1
    )
    x = y = None
    for data in batches:
        t0 = time.perf_counter()
        if x is None or y is None:
            x = rc.tensor(data[:, :-1].copy(), device=spec["device"])
            y = rc.tensor(data[:, 1:].copy(), device=spec["device"])
        else:  # into the same buffers, as recurra_models.Trainer does (the step replays)
            x.assign_(data[:, :-1])
            y.assign_(data[:, 1:])
        ctx = rc.autocast(rc.bfloat16) if half else contextlib.nullcontext()
        with ctx:
            if step is not None:
                loss = step(x, y)  # forward and backward
            else:
                loss = model.loss(x, y)
                loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        times.append((time.perf_counter() - t0) * 1e3)
    st = rc.memory_stats()
    return {
        "losses": losses,
        "ms": times,
        "lib_peak": st["persistent"]["peak_bytes"] + st["transient"]["peak_bytes"],
    }


def moving(x: np.ndarray, w: int) -> np.ndarray:
    return np.convolve(x, np.ones(w) / w, mode="valid") if len(x) >= w else x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="mamba2-130m")
    ap.add_argument("--n-layer", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--symbols", type=int, default=1000)
    ap.add_argument(
        "--precisions",
        default="fp32,bf16",
        help="comma-separated: fp32, bf16, bf16-keep (bf16 with Mamba-2's scan checkpoints "
        "saved and its norm + out_proj kept, not recomputed: what they cost in time), "
        "bf16-keepnorm[=F], bf16-keepck[=F], bf16-keepnorm=F+ck=G (only the norm's output, "
        "only the checkpoints, of the last fraction F / G of the layers: see keep_variant)",
    )
    ap.add_argument(
        "--no-capture",
        dest="capture",
        action="store_false",
        help="record every step's ops again (the default captures the step, as Trainer does)",
    )
    ap.add_argument(
        "--loss-chunk-bytes",
        type=int,
        default=None,
        help="the model's loss_chunk_bytes (default: its own; 0: the loss unchunked)",
    )
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        spec = json.loads(a.worker)
        try:
            res = worker(spec)
        except Exception as exc:  # noqa: BLE001 - reported by the parent
            res = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        print("RESULT " + json.dumps(res), flush=True)
        return
    gib = 1 << 30
    out: dict[str, Any] = {}
    for prec in a.precisions.split(","):
        spec = {k: getattr(a, k) for k in ("preset", "n_layer", "device", "batch", "seq_len")}
        spec.update(
            steps=a.steps,
            lr=a.lr,
            symbols=a.symbols,
            precision=prec,
            capture=a.capture,
            loss_chunk_bytes=a.loss_chunk_bytes,
        )
        r = run_polled(__file__, spec, a.timeout)
        out[prec] = r
        if "error" in r:
            print(f"{prec}: {r['error']}")
            continue
        timed = r["ms"][a.warmup :] or r["ms"]
        ms = statistics.median(timed)
        r["median_ms"] = ms
        peak = r.get("gpu_peak")
        print(
            f"{a.preset} {prec}: {ms:.1f} ms/step (median of {len(timed)}), "
            f"{a.batch * a.seq_len / ms * 1e3:.0f} tok/s; peak "
            f"{'nvidia-smi %.2f GiB, ' % (peak / gib) if peak else ''}"
            f"library {r['lib_peak'] / gib:.2f} GiB; loss {r['losses'][0]:.4f} -> "
            f"{r['losses'][-1]:.4f}"
        )
    f, h = out.get("fp32", {}), out.get("bf16", {})
    if "losses" in f and "losses" in h:
        lf, lh = np.array(f["losses"]), np.array(h["losses"])
        per_step = float(np.max(np.abs(lh - lf) / np.abs(lf)))
        mf, mh = moving(lf, 10), moving(lh, 10)
        smooth = float(np.max(np.abs(mh - mf) / np.abs(mf)))
        key = "gpu_peak" if f.get("gpu_peak") and h.get("gpu_peak") else "lib_peak"
        print(
            f"speed-up fp32/bf16 {f['median_ms'] / h['median_ms']:.2f}x (target >= 2); memory "
            f"bf16/fp32 ({key}) {h[key] / f[key]:.2f} (target <= 0.6); loss curves: largest "
            f"relative difference per step {per_step:.4f}, of 10-step means {smooth:.4f} "
            f"(target <= 0.02)"
        )
    for name, k in out.items():
        if not name.startswith("bf16-") or "median_ms" not in k or "median_ms" not in h:
            continue
        key = "gpu_peak" if k.get("gpu_peak") and h.get("gpu_peak") else "lib_peak"
        ratio = f", {k[key] / f[key]:.3f} of fp32" if f.get(key) else ""
        print(
            f"bf16 recomputing vs keeping ({name}): {h['median_ms'] - k['median_ms']:+.1f} "
            f"ms/step, memory ({key}) {(h[key] - k[key]) / (1 << 30):+.2f} GiB{ratio}"
        )
    print("JSON " + json.dumps(out))


if __name__ == "__main__":
    main()

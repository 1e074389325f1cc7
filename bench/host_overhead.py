"""Host overhead of a training step: ms/step uncaptured (the model's Python records every op
again, then the lazy frontend finds the cached plan) against ``recurra.capture`` (the plan
runs from its cache with the new batch), same process, interleaved, medians.

    python bench/host_overhead.py                          # tiny dims (host-bound) + real
    python bench/host_overhead.py --only tiny --device vulkan --precision bf16

Cases, per preset (``--preset``, default mamba2-130m and rwkv7-0.1b):

- ``tiny``: the preset's depth with tiny widths (d 64, vocabulary 256) at batch 1 x 8: the
  compute is negligible, so the step time is the host's work;
- ``real``: the preset's published shape at a small batch (``--batch`` x ``--seq-len``).

Each case builds two identical models and AdamW optimizers (seed 0), one stepped
uncaptured (``model.loss(x, y).backward()``) and one through
``recurra.capture(model.loss, backward=True)``; the steps alternate between the two, so
load changes hit both alike. Their losses must be equal at every step (printed as
``check``). Wall time and the process's CPU time per step are reported (the CPU time is
less sensitive to other work on a shared machine). The first step of each side (the
trace / plan build) is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np

TINY = {
    "mamba2-130m": {"vocab_size": 256, "d_model": 64, "d_state": 16, "head_dim": 16},
    "mamba-130m": {"vocab_size": 256, "d_model": 64, "d_state": 16},
    "rwkv7-0.1b": {"vocab_size": 256, "n_embd": 64, "head_size": 16},
}


def run_case(
    preset: str, size: str, device: str, precision: str, batch: int, seq_len: int, steps: int
) -> dict[str, Any]:
    import recurra as rc
    import recurra_models as rm
    from recurra._tensor import LAZY
    from recurra_optim import AdamW

    LAZY.clear()
    config = TINY[preset] if size == "tiny" else {}
    b, t = (1, 8) if size == "tiny" else (batch, seq_len)
    dtype = {"bf16": rc.bfloat16, "f16": rc.float16}.get(precision)
    sides = {}
    for mode in ("uncaptured", "captured"):
        model = rm.create(preset, seed=0, **config).to(device)
        opt = AdamW(list(model.parameters()), lr=1e-4)
        step = rc.capture(model.loss, backward=True, params=model.parameters, device=device)
        sides[mode] = (model, opt, step)
    vocab = sides["captured"][0].vocab_size
    rng = np.random.default_rng(0)
    wall: dict[str, list[float]] = {m: [] for m in sides}
    cpu: dict[str, list[float]] = {m: [] for m in sides}
    mismatch = 0
    for k in range(steps + 1):
        data = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
        x, y = data[:, :-1].copy(), data[:, 1:].copy()
        losses = {}
        for mode, (model, opt, step) in sides.items():
            t0, c0 = time.perf_counter(), time.process_time()
            with rc.autocast(dtype or rc.bfloat16, enabled=dtype is not None):
                if mode == "captured":
                    loss = step(x, y)
                else:
                    loss = model.loss(x, y)
                    loss.backward()
            opt.step()
            opt.zero_grad()
            losses[mode] = loss.numpy().tobytes()
            if k:  # the first step traces and plans
                wall[mode].append(1e3 * (time.perf_counter() - t0))
                cpu[mode].append(1e3 * (time.process_time() - c0))
        mismatch += losses["captured"] != losses["uncaptured"]
    out: dict[str, Any] = {"preset": preset, "size": size, "batch": [b, t]}
    for mode in sides:
        out[f"{mode}_ms"] = round(statistics.median(wall[mode]), 3)
        out[f"{mode}_cpu_ms"] = round(statistics.median(cpu[mode]), 3)
    out["speedup"] = round(out["uncaptured_ms"] / out["captured_ms"], 2)
    out["host_ms_saved"] = round(out["uncaptured_ms"] - out["captured_ms"], 3)
    out["check"] = "losses equal" if not mismatch else f"{mismatch} step(s) differ"
    out["replays"] = sides["captured"][2].replays
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["mamba2-130m", "rwkv7-0.1b"])
    ap.add_argument("--only", choices=["tiny", "real"], default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "f16"])
    ap.add_argument("--batch", type=int, default=1, help="batch of the real case")
    ap.add_argument("--seq-len", type=int, default=32, help="sequence length of the real case")
    ap.add_argument("--steps", type=int, default=9, help="timed steps per side")
    ap.add_argument("--real-steps", type=int, default=3, help="timed steps per side (real)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("RECURRA_NUM_THREADS", str(a.threads))
    import recurra as rc

    rc.set_num_threads(a.threads)
    load = os.getloadavg()
    print(f"# device {a.device}, precision {a.precision}, {a.threads} threads, load {load[0]:.2f}")
    print(f"{'case':<24} {'uncaptured ms':>14} {'captured ms':>12} {'speedup':>8}  check")
    results = []
    for preset in a.preset:
        for size in ("tiny", "real"):
            if a.only not in (None, size):
                continue
            steps = a.steps if size == "tiny" else a.real_steps
            r = run_case(preset, size, a.device, a.precision, a.batch, a.seq_len, steps)
            results.append(r)
            name = f"{preset} {size} {r['batch'][0]}x{r['batch'][1]}"
            print(
                f"{name:<24} {r['uncaptured_ms']:>14.2f} {r['captured_ms']:>12.2f} "
                f"{r['speedup']:>7.2f}x  {r['check']} (cpu ms {r['uncaptured_cpu_ms']:.1f} "
                f"vs {r['captured_cpu_ms']:.1f})",
                flush=True,
            )
    env = {"device": a.device, "precision": a.precision, "threads": a.threads, "load": load}
    print("JSON " + json.dumps({"bench": "host_overhead", "env": env, "cases": results}))


if __name__ == "__main__":
    main()

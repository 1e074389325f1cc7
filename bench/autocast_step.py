"""A training step in float32 and under recurra.autocast, run on this machine: ms/step and
the transient pool's peak (the step's planned arenas), per architecture.

    python bench/autocast_step.py --arch mamba2 rwkv7 --d 256 --n-layer 4 --batch 4 --seq-len 256

The weights are float32 in both (the master weights); the loss of the first step is
printed for both so that the difference autocast makes is visible next to its cost.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np


def run(arch: str, precision: str, d: int, n_layer: int, batch: int, seq_len: int, steps: int):
    import recurra as rc
    import recurra_models as rm
    from recurra._tensor import LAZY
    from recurra_optim import AdamW

    LAZY.clear()  # the earlier run's cached plans hold their arenas in the transient pool

    size: dict[str, Any] = (
        {"d_model": d, "head_dim": 64, "d_state": 64}
        if arch == "mamba2"
        else {"n_embd": d, "head_size": 64}
    )
    model = rm.create(arch, vocab_size=256, n_layer=n_layer, seed=0, **size)
    opt = AdamW(list(model.parameters()), lr=1e-3)
    rng = np.random.default_rng(0)
    dtype = {"bf16": rc.bfloat16, "f16": rc.float16}.get(precision)
    times, losses, peaks = [], [], []
    for _ in range(steps):
        data = rng.integers(0, 256, (batch, seq_len + 1)).astype(np.int32)
        rc.reset_peak_memory()
        t0 = time.perf_counter()
        with rc.autocast(dtype or rc.bfloat16, enabled=dtype is not None):
            loss = model.loss(data[:, :-1], data[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))
        times.append(time.perf_counter() - t0)
        peaks.append(rc.memory_stats()["transient"]["peak_bytes"])
    peak = max(peaks[1:])
    return {
        "arch": arch,
        "precision": precision,
        "ms_per_step": 1e3 * float(np.median(times[1:])),
        "transient_peak_mib": peak / 2**20,
        "first_loss": losses[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", nargs="+", default=["mamba2", "rwkv7"])
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    for arch in a.arch:
        for p in a.precision:
            r = run(arch, p, a.d, a.n_layer, a.batch, a.seq_len, a.steps)
            print(json.dumps(r))


if __name__ == "__main__":
    main()

"""Where the time of one generated token goes: the traced step graph of a preset, per op.

    python bench/profile_gen.py --preset mamba-130m          # per op and shape
    python bench/profile_gen.py --preset rwkv7-0.1b --tokens 64

Builds the preset (seed 0; RWKV-7's zero-initialised matrices filled as bench/scale.py does),
takes the step graph that ``generate`` uses (recurra_models.generation, the state carried in
place) and times --tokens steps of one token: first unprofiled (the wall time per token, the
median over the steps), then under ``recurra.profile(by_shape=True)``. It prints, per token:

- each product of one row (the gemvs: ``x (1, K) @ W``) by shape, with the weight bytes it
  reads and the GB/s that gives, then the other ops;
- the sums: products, the other ops, and the wall time not spent in any op (the host's
  work per token: Python, binding, planning, the graph's walk between nodes);
- the weight bytes read per token and the GB/s of the whole token.

The load average is printed before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
_SHAPE = re.compile(r"\(([\d, ]*)\)")


def _step_graph(preset: str, n_layer: int) -> Any:
    import recurra as rc
    import recurra_models as rm
    from recurra_models.generation import _take_step_graph

    over = {"n_layer": n_layer} if n_layer else {}
    model = rm.create(preset, seed=0, **over)
    if type(model).arch == "rwkv7":
        sys.path.insert(0, str(HERE))
        from models import _fill_zero_matrices

        _fill_zero_matrices(model)
    model.eval()
    _, graph = _take_step_graph(model)
    if graph is None:
        raise SystemExit(f"{preset}: the step graph could not be traced")
    with rc.no_grad():
        graph.start(model.init_state(1))
    return graph


def _weight_bytes(key: str) -> int | None:
    """The bytes of the matrix a one-row matmul reads (its second source), else None."""
    op, _, rest = key.partition(" ")
    if op != "matmul":
        return None
    shapes = [
        tuple(int(d) for d in m.group(1).replace(" ", "").split(",") if d)
        for m in _SHAPE.finditer(rest.split(" -> ")[0])
    ]
    if len(shapes) != 2 or int(np.prod(shapes[0][:-1])) != 1:
        return None
    return int(np.prod(shapes[1])) * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="mamba-130m")
    ap.add_argument("--n-layer", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--limit", type=int, default=30, help="rows of the other ops")
    args = ap.parse_args()
    import recurra as rc

    rc.set_num_threads(args.threads)
    graph = _step_graph(args.preset, args.n_layer)
    tok = np.array([[5]], np.int32)
    for _ in range(5):
        graph.step(tok)
    load0 = os.getloadavg()[0]
    walls = []
    for _ in range(args.tokens):
        t0 = time.perf_counter()
        graph.step(tok)
        walls.append(time.perf_counter() - t0)
    with rc.profile(by_shape=True) as prof:
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            graph.step(tok)
        prof_wall = (time.perf_counter() - t0) / args.tokens
    n = args.tokens
    wall = statistics.median(walls)
    print(
        f"{args.preset}, {args.threads} threads, {n} tokens: {wall * 1e3:.2f} ms/token "
        f"(median; {prof_wall * 1e3:.2f} profiled); load {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    gemv = [(o, _weight_bytes(o.key)) for o in prof.ops]
    prods = [(o, b) for o, b in gemv if b is not None]
    rest = [o for o, b in gemv if b is None]
    print(f"\n{'product (one row)':<58} {'calls':>5} {'ms':>7} {'MB':>7} {'GB/s':>6}")
    for o, b in prods:
        ms = o.seconds / n * 1e3
        mb = b * o.calls / n / 1e6
        print(f"{o.key[:58]:<58} {o.calls // n:5d} {ms:7.3f} {mb:7.1f} {mb / ms:6.1f}")
    print(f"\n{'other op':<58} {'calls':>5} {'ms':>7}")
    for o in rest[: args.limit]:
        print(f"{o.key[:58]:<58} {o.calls // n:5d} {o.seconds / n * 1e3:7.3f}")
    p_ms = sum(o.seconds for o, _ in prods) / n * 1e3
    r_ms = sum(o.seconds for o in rest) / n * 1e3
    p_mb = sum(b * o.calls for o, b in prods) / n / 1e6
    nodes = sum(o.calls for o in prof.ops) / n
    print(
        f"\nper token: products {p_ms:.2f} ms ({p_mb:.1f} MB of weights, {p_mb / p_ms:.1f} GB/s), "
        f"other ops {r_ms:.2f} ms, outside the ops {prof_wall * 1e3 - p_ms - r_ms:.2f} ms; "
        f"{nodes:.0f} nodes; whole token {p_mb / (wall * 1e3):.1f} GB/s of weights"
    )


if __name__ == "__main__":
    main()

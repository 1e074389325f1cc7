"""The memory plan of a training step (forward + cross-entropy + backward) of a preset,
built but not run: peak_live_bytes and what is alive at the peak, by op.

    python bench/step_memory.py --preset mamba2-130m --n-layer 2 4 --batch 8 --seq-len 512
    python bench/step_memory.py --preset rwkv7-0.1b --vulkan-ops --recompute --loss-chunk 0
    python bench/step_memory.py --preset mamba2-130m --precision bf16   # under rc.autocast
    python bench/step_memory.py --precision bf16 --vulkan-ops --n-layer 24 --casts [--up-casts]

The graph is the one ``model.loss(x, y).backward()`` plans on the CPU; the planner is the
one a device uses. ``--vulkan-ops`` makes the CPU refuse the ops the Vulkan backend has no
kernel for (``--refuse`` names them), so the plan holds their decompositions as a device's
does. With two or more depths the per-layer and fixed parts are fitted (peak = fixed +
per_layer * n_layer, from the first and last depth). Nothing is computed: sizes of any
depth fit the planner's host memory. ``own`` is the parameters' gradients, which have
memory of their own (handed over as ``p.grad``, not planned in the arena); a step holds
arena + own at its end.

``--run-steps K`` runs K AdamW steps for real instead (on ``--device``, with strict
placement there) and prints, after each ``step(); zero_grad()``, what stays allocated
between steps (persistent bytes: parameters and moments) and the step's peaks
(``recurra.memory_stats()``); with a small ``--batch``/``--seq-len`` this fits the CPU:

    python bench/step_memory.py --preset rwkv7-0.1b --n-layer 12 --run-steps 3 \\
        --batch 1 --seq-len 32
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

# Ops with a CPU kernel but no Vulkan kernel; views are not ops. (causal_conv_silu and
# gated_rms_norm, with their backward ops, were here until the Vulkan backend got fused
# kernels for them: pass them to --refuse for the plan of RECURRA_VK_UNFUSED=1.)
VULKAN_MISSING: list[str] = []


class _Planned(Exception):
    pass


def step_plan(
    preset: str,
    n_layer: int,
    batch: int,
    seq_len: int,
    recompute: bool,
    chunk: int | None,
    precision: str = "fp32",
    device: str = "cpu",
    with_casts: bool = False,
    up_casts: bool = False,
) -> dict[str, Any]:
    """The memory plan (graph.memory()'s dict) of one training step, not run; with_casts:
    also its cast nodes (``casts``: :func:`cast_nodes`). up_casts: autocast casts the
    sources of the ops that read 2-byte sources as they are (``OpSpec.reads_half``) up to
    float32 anyway, and the norms before products return float32 (nn.NORM_TO_AUTOCAST), as
    recurra did before (the plan of that step, for comparison)."""
    import recurra as rc
    import recurra_models as rm
    from recurra._tensor import LAZY
    from recurra_models.presets import resolve

    arch = resolve(preset, {})[0]
    # the plan does not depend on the values: RWKV's zero init skips its orthogonal draws
    seed: Any = None if arch.startswith("rwkv") else 0
    model = rm.create(preset, seed=seed, n_layer=n_layer).to(device)
    model.gradient_checkpointing(recompute)
    rng = np.random.default_rng(0)
    data = rng.integers(0, min(model.vocab_size, 50000), (batch, seq_len + 1)).astype(np.int32)
    x = rc.tensor(data[:, :-1].copy(), device=device)
    y = rc.tensor(data[:, 1:].copy(), device=device)
    dtype = {"fp32": None, "bf16": rc.bfloat16, "f16": rc.float16}[precision]
    from recurra import _autocast
    from recurra_models import nn

    op_class = _autocast.op_class
    if up_casts:
        _autocast.op_class = lambda name: (  # type: ignore[assignment]
            "float32" if op_class(name) == "widen" else op_class(name)
        )
        nn.NORM_TO_AUTOCAST = False
    try:
        with rc.autocast(dtype or rc.bfloat16, enabled=dtype is not None):
            loss = model.loss(x, y, chunk_bytes=chunk)
    finally:
        _autocast.op_class = op_class  # type: ignore[assignment]
        nn.NORM_TO_AUTOCAST = True
    got: dict[str, Any] = {}
    build = LAZY._build

    def capture(*a: Any, **k: Any) -> Any:
        plan = build(*a, **k)
        got.update(plan.graph.plan())
        if with_casts:
            got["casts"] = cast_nodes(plan.graph)
        raise _Planned

    LAZY._build = capture  # type: ignore[method-assign]
    try:
        loss.backward()
    except _Planned:
        pass
    finally:
        LAZY._build = build  # type: ignore[method-assign]
        LAZY.clear()
    return got


def cast_nodes(g: Any) -> list[dict[str, Any]]:
    """The cast nodes of graph ``g`` that a step computes (those an output or the loss
    depends on): per cast, its source's op (through views: ``slice>contiguous`` where a
    contiguous copy of a view is cast), the ops reading it (through views), dtypes in and
    out, and the bytes it reads and writes."""
    n = len(g)
    info = [g.info(i) for i in range(n)]
    users: list[list[int]] = [[] for _ in range(n)]
    for i, d in enumerate(info):
        for s in d["src"]:
            users[s].append(i)
    live = [False] * n
    want = _core_flags()
    stack = [i for i, d in enumerate(info) if d["flags"] & want]
    while stack:
        i = stack.pop()
        if live[i]:
            continue
        live[i] = True
        stack.extend(info[i]["src"])

    def producer(i: int) -> str:
        d = info[i]
        if d["is_view"] or d["op"] == "contiguous":
            return producer(d["src"][0]) + ">" + d["op"]
        return d["op"]

    def readers(i: int) -> list[str]:
        out = []
        for u in users[i]:
            if not live[u]:
                continue
            out.extend(readers(u) if info[u]["is_view"] else [info[u]["op"]])
        return out

    size = {"float32": 4, "bfloat16": 2, "float16": 2}
    rows = []
    for i, d in enumerate(info):
        if d["op"] != "cast" or not live[i]:
            continue
        s = info[d["src"][0]]
        numel = int(np.prod(d["shape"])) if d["shape"] else 1
        rows.append(
            dict(
                id=i,
                src=producer(d["src"][0]),
                readers=sorted(set(readers(i))),
                dtype_in=s["dtype"],
                dtype_out=d["dtype"],
                shape=tuple(d["shape"]),
                bytes=numel * (size[s["dtype"]] + size[d["dtype"]]),
            )
        )
    return rows


def _core_flags() -> int:
    from recurra import _core

    return int(_core.FLAG_OUTPUT | _core.FLAG_LOSS)


def cast_groups(casts: list[dict[str, Any]]) -> list[tuple[tuple[Any, ...], tuple[int, int]]]:
    """Casts grouped by (source op, readers, dtype in, dtype out): (count, bytes), most
    bytes first."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for c in casts:
        key = (c["src"], ",".join(c["readers"]), c["dtype_in"], c["dtype_out"])
        g = groups.setdefault(key, [0, 0])
        g[0] += 1
        g[1] += c["bytes"]
    return sorted(((k, (n, b)) for k, (n, b) in groups.items()), key=lambda kv: -kv[1][1])


def node_groups(plan: dict[str, Any]) -> list[tuple[tuple[Any, ...], tuple[int, int]]]:
    """The nodes live at the peak grouped by (op, dtype, shape, made in the forward):
    (count, bytes) per group, largest first."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for _, op, dt, shape, nbytes, fwd in plan["live_nodes_at_peak"]:
        g = groups.setdefault((op, dt, tuple(shape), fwd), [0, 0])
        g[0] += 1
        g[1] += nbytes
    return sorted(((k, (c, b)) for k, (c, b) in groups.items()), key=lambda kv: -kv[1][1])


def run_steps(a: argparse.Namespace, n_layer: int) -> None:
    """Real AdamW steps: memory between steps and peaks, per step."""
    import recurra as rc
    import recurra_models as rm
    import recurra_optim as optim
    from recurra_models.presets import resolve

    arch = resolve(a.preset, {})[0]
    model = rm.create(a.preset, seed=None if arch.startswith("rwkv") else 0, n_layer=n_layer)
    model.gradient_checkpointing(a.recompute)
    if a.device != "cpu":
        model = model.to(a.device)
        rc.set_strict_placement(True)
    params = list(model.parameters())
    n_param = sum(int(np.prod(p.shape)) for p in params)
    opt = optim.AdamW(params, lr=1e-4)
    rng = np.random.default_rng(0)
    gib = 1 << 30
    size = f"{n_param / 1e6:.1f}M parameters ({4 * n_param / gib:.3f} GiB)"
    print(f"{a.preset} n_layer {n_layer}: {size}")
    for i in range(a.run_steps):
        shape = (a.batch, a.seq_len + 1)
        data = rng.integers(0, min(model.vocab_size, 50000), shape).astype(np.int32)
        x = rc.tensor(data[:, :-1].copy(), device=a.device)
        y = rc.tensor(data[:, 1:].copy(), device=a.device)
        rc.reset_peak_memory()
        loss = model.loss(x, y, chunk_bytes=a.loss_chunk)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()
        del loss
        st = rc.memory_stats()
        per, tr = st["persistent"], st["transient"]
        print(
            f"step {i}: loss {value:.4f}; between steps: persistent {per['bytes'] / gib:.3f} GiB "
            f"(parameters + moments {12 * n_param / gib:.3f}), transient {tr['bytes'] / gib:.3f}; "
            f"peaks: persistent {per['peak_bytes'] / gib:.3f}, "
            f"transient {tr['peak_bytes'] / gib:.3f}"
        )
        if a.device.startswith("vulkan"):
            import recurra_vulkan

            info = recurra_vulkan.memory_info(0, reset_peaks=True)
            pools = ", ".join(
                f"{k} {v['bytes_in_use'] / gib:.3f} (peak {v['peak_bytes'] / gib:.3f})"
                for k, v in info.items()
                if isinstance(v, dict) and "bytes_in_use" in v
            )
            print(
                f"    vulkan: reserved {info['reserved_bytes'] / gib:.3f} GiB, peak reserved "
                f"{info['peak_reserved_bytes'] / gib:.3f}, idle {info['idle_bytes'] / gib:.3f}; "
                f"{pools}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="mamba2-130m")
    ap.add_argument("--n-layer", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--recompute", action="store_true", help="gradient checkpointing per block")
    ap.add_argument(
        "--loss-chunk", type=int, default=None, help="loss chunk bytes (0: off; default: model's)"
    )
    ap.add_argument("--precision", choices=["fp32", "bf16", "f16"], default="fp32")
    ap.add_argument("--vulkan-ops", action="store_true", help="refuse what Vulkan lacks")
    ap.add_argument(
        "--device",
        default="cpu",
        help="plan on this device (e.g. vulkan: its placement, and the scans' checkpoints "
        "that only a device saves; the weights are uploaded there); with --run-steps: where "
        "the steps run",
    )
    ap.add_argument("--refuse", nargs="*", default=None, help="ops the CPU refuses")
    ap.add_argument("--top", type=int, default=12, help="ops listed at the peak")
    ap.add_argument(
        "--nodes", type=int, default=0, help="list this many (op, dtype, shape) groups at the peak"
    )
    ap.add_argument(
        "--keep-casts",
        action="store_true",
        help="keep casts for the backward (recurra's behaviour before casts were recomputed)",
    )
    ap.add_argument(
        "--casts",
        action="store_true",
        help="list the step's cast nodes, grouped by producer, readers and dtypes",
    )
    ap.add_argument(
        "--up-casts",
        action="store_true",
        help="cast the sources of the ops that read 2-byte sources up to float32 anyway, and "
        "the norms before products return float32 (the plan before they did)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--run-steps", type=int, default=0, help="run AdamW steps for real")
    a = ap.parse_args()
    from recurra import _core

    if a.device != "cpu":
        import recurra.backends  # noqa: F401

    refuse = a.refuse if a.refuse is not None else (VULKAN_MISSING if a.vulkan_ops else [])
    _core.set_cpu_refused_ops(refuse)
    _core.set_recompute_casts(not a.keep_casts)
    gib = 1 << 30
    if a.run_steps:
        for n in a.n_layer:
            run_steps(a, n)
        return
    rows = []
    for n in a.n_layer:
        p = step_plan(
            a.preset,
            n,
            a.batch,
            a.seq_len,
            a.recompute,
            a.loss_chunk,
            a.precision,
            a.device,
            with_casts=a.casts,
            up_casts=a.up_casts,
        )
        rows.append((n, p))
        if a.json:
            continue
        print(
            f"{a.preset} on {a.device} n_layer {n} batch {a.batch}x{a.seq_len} "
            f"recompute {a.recompute} "
            f"loss_chunk {a.loss_chunk} {a.precision} refused {refuse}: peak_live "
            f"{p['peak_live_bytes'] / gib:.3f} GiB, arena {p['arena_bytes'] / gib:.3f} GiB, "
            f"own {p.get('own_bytes', 0) / gib:.3f} GiB (arena + own "
            f"{(p['arena_bytes'] + p.get('own_bytes', 0)) / gib:.3f}), in place "
            f"{p.get('n_in_place', 0)} nodes ({p.get('in_place_bytes', 0) / gib:.3f} GiB)"
        )
        for op, b in p["live_at_peak"][: a.top]:
            print(f"    {op:24s} {b / gib:7.3f} GiB")
        if a.casts:
            casts = p["casts"]
            total = sum(c["bytes"] for c in casts)
            print(f"    casts: {len(casts)} nodes, {total / gib:.3f} GiB read + written")
            print("    by (source op, readers, dtype in -> out): count, MiB")
            for (src, rd, di, do), (cnt, b) in cast_groups(casts):
                print(f"    {src:30s} -> {rd:34s} {di:8s}->{do:8s} {cnt:4d} {b / 2**20:9.1f}")
        if a.nodes:
            print("    by (op, dtype, shape, forward/backward): count, GiB")
            for (op, dt, shape, fwd), (cnt, b) in node_groups(p)[: a.nodes]:
                where = "fwd" if fwd else "bwd"
                print(f"    {op:18s} {dt:8s} {str(shape):22s} {where} {cnt:4d} {b / gib:7.3f}")
    if len(rows) >= 2:
        (n0, p0), (n1, p1) = rows[0], rows[-1]
        per = (p1["peak_live_bytes"] - p0["peak_live_bytes"]) / (n1 - n0)
        fixed = p0["peak_live_bytes"] - per * n0
        out = dict(per_layer_gib=per / gib, fixed_gib=fixed / gib)
        print(
            json.dumps(out)
            if a.json
            else f"per layer {per / gib:.3f} GiB, fixed {fixed / gib:.3f} GiB"
        )
    if a.json:
        print(json.dumps([{"n_layer": n, **p} for n, p in rows]))


if __name__ == "__main__":
    main()

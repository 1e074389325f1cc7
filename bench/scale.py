"""Real-size models: the 130M presets trained and run by us and by their PyTorch peers.

    python bench/scale.py                                   # CPU, batch 4 x 256, 2 threads
    python bench/scale.py --device vulkan --batch 8 --seq-len 512   # a GPU: peers on CUDA
    python bench/scale.py --presets mamba2-130m --n-layer 2 --batch 1 --seq-len 16  # smoke

For each preset (recurra_models.presets: mamba-130m, mamba2-130m, rwkv7-0.1b) it measures
training (forward + cross-entropy + backward + AdamW, ms/step and tokens/s, peak memory)
and generation (greedy, ms per new token after the prompt), ours with and without
gradient checkpointing (recomputation per block) and the peer's: transformers' eager
MambaForCausalLM / Mamba2ForCausalLM, or bench/torch_rwkv.py's RWKV-7, holding the same
weights (both sides are built from seed 0) and fed the same batches; the first step's loss
of both sides is printed side by side.

Each side runs in a subprocess of its own, so that its peak memory is its own: peak RSS on
the CPU (``ru_maxrss``); on a GPU the device memory in use as nvidia-smi polls it every
20 ms while the side runs (less what was in use before it started), plus each library's own
count (recurra.memory_stats, torch.cuda.max_memory_allocated). Figures are medians of
--reps timed runs after a warm-up; ratio = peer time / our time (above 1: we are faster).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import run_polled

HERE = Path(__file__).resolve().parent
PRESETS = ["mamba2-130m", "mamba-130m", "rwkv7-0.1b"]
PEER = {"mamba": "transformers", "mamba2": "transformers", "rwkv7": "torch_rwkv"}


# ------------------------------------------------------------------------------------------
# the worker: one side of one preset, in its own process; prints one RESULT line
# ------------------------------------------------------------------------------------------


def _vk_memory(device: str, reset: bool = False) -> dict[str, Any] | None:
    """recurra_vulkan.memory_info of a Vulkan device, None elsewhere (or in an older build)."""
    if not device.startswith("vulkan"):
        return None
    import recurra_vulkan

    if not hasattr(recurra_vulkan, "memory_info"):
        return None
    index = int(device.partition(":")[2] or 0)
    return recurra_vulkan.memory_info(index, reset_peaks=reset)


def _model(spec: dict[str, Any]) -> Any:
    import recurra_models as rm

    over = {"n_layer": spec["n_layer"]} if spec.get("n_layer") else {}
    model = rm.create(spec["preset"], seed=0, **over)
    if type(model).arch == "rwkv7":
        sys.path.insert(0, str(HERE))
        from models import _fill_zero_matrices

        _fill_zero_matrices(model)
    return model


def _batch(spec: dict[str, Any], vocab: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    # token ids below 50k, like text in the GPT-NeoX / World vocabularies
    return rng.integers(0, min(vocab, 50000), (spec["batch"], spec["seq_len"] + 1)).astype(np.int32)


def _timed(fn: Any, reps: int, budget: float) -> tuple[list[float], float]:
    """(timed runs in ms, first run in ms): one untimed run, then up to reps runs that fit
    the budget (at least 1). reps 0: the first run is the only one, and it is timed (for
    steps that take minutes, e.g. RWKV-7's PyTorch peer on the CPU)."""
    t0 = time.perf_counter()
    fn()
    first = (time.perf_counter() - t0) * 1e3
    if reps == 0:
        return [first], first
    n = max(1, min(reps, int(budget * 1e3 / max(first, 1e-6))))
    runs = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return runs, first


def worker_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import recurra as rc
    import recurra_models as rm
    from recurra_optim import AdamW

    if spec["device"] != "cpu":
        import recurra.backends  # noqa: F401  (loads the plugin)

        rc.set_strict_placement(True)
    rc.set_num_threads(spec["threads"])
    model = _model(spec)
    arch = type(model).arch
    out: dict[str, Any] = {"params": model.num_parameters(), "arch": arch}
    model = model.to(spec["device"])
    if spec["recompute"]:
        model.gradient_checkpointing(True)
    data = _batch(spec, model.vocab_size)
    if "train" in spec["modes"]:
        opt = AdamW(list(model.parameters()), lr=1e-4)
        x = rc.tensor(data[:, :-1].copy(), device=spec["device"])
        y = rc.tensor(data[:, 1:].copy(), device=spec["device"])
        losses: list[float] = []

        def step() -> None:
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())

        getattr(rc, "reset_peak_memory", rc._core.reset_peak_memory)()
        vk = _vk_memory(spec["device"], reset=True)
        runs, first = _timed(step, spec["reps"], spec["budget"])
        st = rc.memory_stats()
        out.update(
            train_ms=runs,
            first_ms=first,
            loss0=losses[0],
            lib_peak=st["persistent"]["peak_bytes"] + st["transient"]["peak_bytes"],
        )
        vk = _vk_memory(spec["device"])
        if vk is not None:  # what the backend held: blocks, and op scratch beside the plan
            out["vk_reserved_peak"] = vk["peak_reserved_bytes"]
            out["vk_internal_peak"] = vk["internal"]["peak_bytes"]
    if "gen" in spec["modes"] and not spec["recompute"]:
        prompt = data[0, : spec["prompt"]]
        n = spec["gen_tokens"]
        ids: list[list[int]] = []

        def gen(k: int) -> Any:
            return lambda: ids.append(rm.generate(model, prompt, max_tokens=k, temperature=0.0))

        full, _ = _timed(gen(n + 1), spec["reps"], spec["budget"])
        one, _ = _timed(gen(1), spec["reps"], spec["budget"])
        out.update(gen_ms=(statistics.median(full) - statistics.median(one)) / n, tokens=ids[0])
    return out


def worker_peer(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    sys.path.insert(0, str(HERE))
    from models import make_torch, torch_greedy, torch_train_step

    torch.set_num_threads(spec["threads"])
    cuda = spec["device"] != "cpu"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device for the peer")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if cuda else "cpu"
    ours = _model(spec)
    arch = type(ours).arch
    vocab = ours.vocab_size
    model = make_torch(arch, ours, device=dev)
    del ours
    out: dict[str, Any] = {"peer": PEER[arch], "torch": torch.__version__}
    data = torch.from_numpy(_batch(spec, vocab).astype(np.int64)).to(dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    if "train" in spec["modes"]:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = data[:, :-1], data[:, 1:]
        losses: list[float] = []

        def step() -> None:
            loss = torch_train_step(arch, model, opt, x, y)
            losses.append(float(loss.detach()))
            sync()

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        runs, first = _timed(step, spec["reps"], spec["budget"])
        out.update(train_ms=runs, first_ms=first, loss0=losses[0])
        if cuda:
            out["lib_peak"] = torch.cuda.max_memory_allocated()
        del opt
    if "gen" in spec["modes"]:
        model.eval()
        prompt = data[:1, : spec["prompt"]]
        n = spec["gen_tokens"]
        ids: list[list[int]] = []

        def gen(k: int) -> Any:
            def run() -> None:
                ids.append(torch_greedy(arch, model, prompt, k))
                sync()

            return run

        full, _ = _timed(gen(n + 1), spec["reps"], spec["budget"])
        one, _ = _timed(gen(1), spec["reps"], spec["budget"])
        out.update(gen_ms=(statistics.median(full) - statistics.median(one)) / n, tokens=ids[0])
    return out


def worker(spec: dict[str, Any]) -> None:
    try:
        res = worker_peer(spec) if spec["side"] == "peer" else worker_ours(spec)
    except Exception as exc:  # noqa: BLE001 - a failed side is reported, not fatal
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        res = {"error": f"{type(exc).__name__}: {first}"}
    res["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------------------
# the parent: runs the sides one after another, polling GPU memory while each runs
# ------------------------------------------------------------------------------------------
def run_side(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    return run_polled(__file__, spec, timeout)


def _gib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**30:.2f} GiB"


def _med(r: dict[str, Any], key: str) -> float | None:
    v = r.get(key)
    return statistics.median(v) if isinstance(v, list) and v else v


def report(preset: str, spec: dict[str, Any], res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ours, ours_rc, peer = res.get("ours", {}), res.get("ours+recompute", {}), res.get("peer", {})
    tokens = spec["batch"] * spec["seq_len"]
    mem_key = "gpu_peak" if spec["device"] != "cpu" else "rss_peak"
    print(
        f"\n== {preset} ({ours.get('params', 0) / 1e6:.1f}M parameters), "
        f"{spec['device']}, batch {spec['batch']} x {spec['seq_len']}, peer: "
        f"{peer.get('peer', '?')} (torch {peer.get('torch', '?')})"
    )
    row: dict[str, Any] = {"preset": preset}
    for name, r in (("ours", ours), ("ours+recompute", ours_rc), ("peer", peer)):
        if not r:
            continue
        if "error" in r:
            print(f"  {name:15s} error: {r['error']}")
            row[name] = {"error": r["error"]}
            continue
        ms = _med(r, "train_ms")
        line = f"  {name:15s}"
        if ms is not None:
            line += (
                f" train {ms:9.1f} ms/step ({tokens / ms * 1e3:8.0f} tok/s, "
                f"{len(r['train_ms'])} runs) loss0 {r['loss0']:.6f}"
                f"  peak {_gib(r.get(mem_key))}"
            )
            if r.get("lib_peak") is not None:
                line += f" (own count {_gib(r['lib_peak'])})"
            if r.get("vk_reserved_peak") is not None:
                line += (
                    f" (device blocks {_gib(r['vk_reserved_peak'])},"
                    f" op scratch {_gib(r['vk_internal_peak'])})"
                )
        if r.get("gen_ms") is not None:
            line += f"  generate {r['gen_ms']:.2f} ms/token"
        print(line)
        row[name] = {k: r.get(k) for k in ("train_ms", "loss0", mem_key, "lib_peak", "gen_ms")}
    o, p = _med(ours, "train_ms"), _med(peer, "train_ms")
    if o and p:
        rel = abs(ours["loss0"] - peer["loss0"]) / max(abs(peer["loss0"]), 1e-12)
        print(f"  train: peer/ours {p / o:.2f}x; first loss rel. diff {rel:.1e}")
        row["train_ratio"] = p / o
    mo, mp = ours.get(mem_key), peer.get(mem_key)
    if mo and mp:
        line = f"  peak memory ours/peer {mo / mp:.2f}"
        row["mem_ratio"] = mo / mp
        if ours_rc.get(mem_key):
            line += f", with recomputation {ours_rc[mem_key] / mp:.2f}"
            row["mem_ratio_recompute"] = ours_rc[mem_key] / mp
        print(line)
    go, gp = ours.get("gen_ms"), peer.get("gen_ms")
    if go and gp:
        same = "same greedy tokens" if ours.get("tokens") == peer.get("tokens") else "tokens differ"
        print(f"  generate: ours/peer {go / gp:.2f} ({same})")
        row["gen_ratio"] = go / gp
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help="cpu, or vulkan[:N] (peers on CUDA)")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--batch", type=int, default=None, help="default 4 (CPU) / 8 (GPU)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 256 (CPU) / 512 (GPU)")
    ap.add_argument("--n-layer", type=int, default=0, help="override the preset's layers")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--reps", type=int, default=5, help="timed runs after a warm-up; 0: one run, not warmed"
    )
    ap.add_argument("--budget", type=float, default=60.0, help="seconds of timed runs a side")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--modes", default="train,gen")
    ap.add_argument("--sides", default="ours,ours+recompute,peer")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds per side")
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    gpu = args.device != "cpu"
    base = {
        "device": args.device,
        "batch": args.batch or (8 if gpu else 4),
        "seq_len": args.seq_len or (512 if gpu else 256),
        "n_layer": args.n_layer,
        "threads": args.threads,
        "reps": args.reps,
        "budget": args.budget,
        "prompt": args.prompt,
        "gen_tokens": args.gen_tokens,
        "modes": args.modes.split(","),
    }
    print(f"bench/scale.py: {base}; load average {os.getloadavg()}")
    rows = []
    for preset in [p for p in args.presets.split(",") if p]:
        res = {}
        for side in [s for s in args.sides.split(",") if s]:
            spec = dict(
                base,
                preset=preset,
                side="peer" if side == "peer" else "ours",
                recompute=side == "ours+recompute",
            )
            t0 = time.time()
            res[side] = run_side(spec, args.timeout)
            print(f"  [{preset} {side}: {time.time() - t0:.0f} s]", flush=True)
        rows.append(report(preset, base, res))
    print("JSON " + json.dumps({"config": base, "rows": rows}))


if __name__ == "__main__":
    main()

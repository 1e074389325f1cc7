"""GPU model benchmarks: small Mamba-1, Mamba-2, RWKV-7 LMs on Vulkan against PyTorch CUDA.

    python bench/gpu_models.py [--device-index 0] [--tiny] [--reps 7] [--only train_mamba]

The models, sizes, weights and batches are those of bench/models.py (d_model 512, 4 layers,
byte vocabulary; batch 4 x 256 tokens for training, prompt 32 + 64 generated tokens).

Ours: the model moved to the Vulkan device (``model.to("vulkan:N")``) under strict
placement (a node the device cannot run raises instead of falling back to the CPU).
Training step = forward + cross-entropy + backward + recurra_optim.AdamW (resident: the
parameters and the optimizer state stay in device memory) + reading the loss back (that read
is the synchronisation). Generation = recurra_models.generate, greedy, ms per new token.

Peer: the same model in PyTorch on CUDA holding the same weights (transformers'
MambaForCausalLM / Mamba2ForCausalLM, bench/torch_rwkv.py's TorchRWKV7), torch.optim.AdamW,
each step ended by torch.cuda.synchronize(); generation by transformers' generate() /
torch_rwkv.greedy_generate. TF32 is off (fp32 on both sides). Without CUDA, or without torch
or transformers, the peer is skipped and the reason printed (the lead may carry a
transformers wheel: it is pure Python).

Checks: our first-batch loss and greedy tokens on Vulkan against ours on the CPU (always)
and against the peer (when it ran). Every figure is the median of the timed runs (wall
clock); ratio = peer time / our time, from the same process. `--tiny` runs tiny sizes (a
smoke test on lavapipe, not a measurement).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Case,
    PeerUnavailable,
    Table,
    Timing,
    environment,
    measure,
    parse_args,
    vulkan_device,
)
from models import (  # noqa: E402
    SMALL,
    SPECS,
    TINY,
    Spec,
    make_ours,
    make_torch,
    tokens,
    torch_greedy,
    torch_train_step,
)

PEER = "torch cuda"
_NO_PEER = {"why": "no CUDA"}  # why the peer cannot run here (set by main)


def timed(fn: Callable[[], Any], args: Any) -> Timing:
    """common.measure, but a side whose first run is longer than --budget is timed once."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    if first > args.budget:
        return Timing([first * 1e3])
    return measure(fn, args.reps, max(0, args.warmup - 1), args.budget)


def _per_token(t: Timing, n: int) -> Timing:
    return Timing([ms / n for ms in t.runs_ms])


def load_vulkan(index: int) -> tuple[str | None, str]:
    """Our device name ("vulkan:N") and a line describing it, or (None, why not)."""
    try:
        import recurra_vulkan  # noqa: F401  (the import error is reported on its own)
    except Exception as exc:  # reported; the peers still run
        return None, f"import recurra_vulkan failed: {type(exc).__name__}: {exc}"
    try:
        d, why = vulkan_device(index, "--device-index")
        if d is None:
            return None, why
        line = (
            f"vulkan:{index} {d.get('name')} ({d.get('kind')}, {d.get('driver')}, "
            f"{d.get('memory_bytes', 0) / 2**30:.1f} GiB)"
        )
        return f"vulkan:{index}", line
    except Exception as exc:
        return None, f"Vulkan setup failed: {type(exc).__name__}: {exc}"


def load_torch_cuda() -> tuple[Any, str]:
    """(torch, description) when CUDA is usable, else (None, why the peer is skipped)."""
    try:
        import torch
    except ImportError:
        return None, "torch not installed: the PyTorch CUDA peer is skipped"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} has no CUDA device: the peer is skipped"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        tf = f"transformers {transformers.__version__}"
    except ImportError:
        tf = "transformers not installed (the Mamba peers are skipped; RWKV-7's still runs)"
    return torch, f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}; {tf}"


# ------------------------------------------------------------------------------------------
# ours
# ------------------------------------------------------------------------------------------
def ours_train(arch: str, size: dict[str, int], args: Any, dev: str, out: dict[str, Any]) -> Timing:
    import recurra as rc
    from recurra_optim import AdamW

    model = make_ours(arch, size).to(dev)
    out["params"] = model.num_parameters()
    opt = AdamW(list(model.parameters()), lr=1e-4)
    data = tokens(size, 0)
    x = rc.tensor(data[:, :-1].copy(), device=dev)
    y = rc.tensor(data[:, 1:].copy(), device=dev)
    losses: list[float] = []

    def step() -> None:
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # the only read back: it waits for the step

    t = timed(step, args)
    out["ours"] = losses[0]
    return t


def ours_gen(arch: str, size: dict[str, int], args: Any, dev: str, out: dict[str, Any]) -> Timing:
    import recurra_models as rm

    model = make_ours(arch, size).to(dev)
    out["params"] = model.num_parameters()
    prompt = tokens(size, 1)[0, : size["prompt"]]
    n = size["gen_tokens"]

    def gen() -> None:
        out["ours"] = rm.generate(model, prompt, max_tokens=n, temperature=0.0)

    return _per_token(timed(gen, args), n)


def cpu_reference(spec: Spec, size: dict[str, int]) -> Any:
    """Ours on the CPU (no timing): the first-batch loss, or the greedy tokens."""
    import recurra as rc
    import recurra_models as rm

    model = make_ours(spec.arch, size)
    rc.set_strict_placement(False)
    try:
        if spec.mode == "train":
            data = tokens(size, 0)
            return float(model.loss(data[:, :-1], data[:, 1:]).item())
        prompt = tokens(size, 1)[0, : size["prompt"]]
        return rm.generate(model, prompt, max_tokens=size["gen_tokens"], temperature=0.0)
    finally:
        rc.set_strict_placement(True)


# ------------------------------------------------------------------------------------------
# the peer
# ------------------------------------------------------------------------------------------
def torch_train(
    arch: str, size: dict[str, int], args: Any, torch: Any, out: dict[str, Any]
) -> Timing:
    if torch is None:
        raise PeerUnavailable(_NO_PEER["why"])
    model = make_torch(arch, make_ours(arch, size), device="cuda").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.from_numpy(tokens(size, 0).astype(np.int64)).cuda()
    x, y = data[:, :-1], data[:, 1:]
    losses: list[float] = []

    def step() -> None:
        loss = torch_train_step(arch, model, opt, x, y)
        if not losses:
            losses.append(float(loss.detach()))
        torch.cuda.synchronize()

    t = timed(step, args)
    out["torch"] = losses[0]
    return t


def torch_gen(
    arch: str, size: dict[str, int], args: Any, torch: Any, out: dict[str, Any]
) -> Timing:
    if torch is None:
        raise PeerUnavailable(_NO_PEER["why"])
    model = make_torch(arch, make_ours(arch, size), device="cuda").eval()
    prompt = torch.from_numpy(tokens(size, 1)[:1, : size["prompt"]].astype(np.int64)).cuda()
    n = size["gen_tokens"]

    def gen() -> None:
        out["torch"] = torch_greedy(arch, model, prompt, n)
        torch.cuda.synchronize()

    return _per_token(timed(gen, args), n)


# ------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------
def _side(fn: Callable[[], Timing]) -> tuple[float | None, str]:
    """Runs one side; returns (median ms, "") or (None, why not). Never raises."""
    try:
        return fn().median_ms, ""
    except PeerUnavailable as exc:
        return None, f"n/a ({exc})"
    except Exception as exc:  # a failing side costs its row, never the run
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        return None, f"error: {type(exc).__name__}: {first}"


def _agree(spec: Spec, a: Any, b: Any) -> str:
    if spec.mode == "train":
        rel = abs(a - b) / max(abs(b), 1e-12)
        return f"{a:.6f} vs {b:.6f} (rel. diff {rel:.1e}{'' if rel < 1e-4 else ', DIFFER'})"
    if a == b:
        return "same greedy tokens"
    k = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
    return f"greedy tokens differ from token {k}"


def run_case(
    name: str,
    spec: Spec,
    args: Any,
    size: dict[str, int],
    dev: str | None,
    torch: Any,
    table: Table,
) -> None:
    case = Case(name, target="(none set; GPU figures for the lead)")
    outs: dict[str, Any] = {}
    if dev is None:
        case.ours_note = "n/a (no Vulkan device)"
    else:
        fn = ours_train if spec.mode == "train" else ours_gen
        case.ours_ms, case.ours_note = _side(lambda: fn(spec.arch, size, args, dev, outs))
    pfn = torch_train if spec.mode == "train" else torch_gen
    ms, pnote = _side(lambda: pfn(spec.arch, size, args, torch, outs))
    case.peers[PEER] = ms
    if pnote:
        case.peer_notes[PEER] = pnote
    toks = size["batch"] * size["seq_len"]
    params = f"{outs['params'] / 1e6:.2f}M parameters" if "params" in outs else ""
    if spec.mode == "train":
        if case.ours_ms:
            case.ours_note = f"{toks / case.ours_ms * 1e3:.0f} tokens/s, {params}"
        if ms:
            case.peer_notes[PEER] = f"{toks / ms * 1e3:.0f} tokens/s"
    elif case.ours_ms:
        case.ours_note = params
    checks = []
    if not args.no_check and "ours" in outs:
        try:
            ref = cpu_reference(spec, size)
            checks.append("vulkan vs our CPU: " + _agree(spec, outs["ours"], ref))
        except Exception as exc:
            checks.append(f"vulkan vs our CPU: error {type(exc).__name__}: {exc}")
        if "torch" in outs:
            checks.append("vulkan vs torch cuda: " + _agree(spec, outs["ours"], outs["torch"]))
    case.check = "; ".join(checks)
    table.add(case)


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device-index", type=int, default=0)
    pre.add_argument("--tiny", action="store_true")
    extra, rest = pre.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    args = parse_args(__doc__.splitlines()[0] + " (also: --device-index N, --tiny)", SPECS)
    import recurra as rc

    rc.set_num_threads(args.threads)
    dev, dev_line = load_vulkan(extra.device_index)
    torch, torch_line = load_torch_cuda()
    if torch is None:
        _NO_PEER["why"] = torch_line.split(":")[0]
    size = TINY if extra.tiny else SMALL
    print(f"# ours: {dev_line}; recurra from {rc.__file__}")
    print(f"# peer: {torch_line}")
    print(f"# sizes {size}")
    env = environment(args.threads)
    env.update(vulkan=dev_line, peer=torch_line, sizes=size)
    title = "gpu_models" + (" (--tiny: a smoke test, not a measurement)" if extra.tiny else "")
    table = Table(title, env)
    if dev is not None:
        rc.set_strict_placement(True)
    try:
        for name in args.cases:
            run_case(name, SPECS[name], args, size, dev, torch, table)
    finally:
        if dev is not None:
            rc.set_strict_placement(False)
    table.finish()


if __name__ == "__main__":
    main()

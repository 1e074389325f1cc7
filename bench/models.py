"""Model benchmarks: training steps and generation of small Mamba-1, Mamba-2, RWKV-7 LMs.

    python bench/models.py [--threads 2] [--reps 7] [--only train_mamba,gen_mamba2] [--tiny]

Sizes (default, a real small LM that still finishes on 2 cores): byte vocabulary 256,
d_model 512, 4 layers; Mamba-1 d_state 16, expand 2; Mamba-2 head_dim 64, d_state 64;
RWKV-7 head size 64 (dim_ffn 4 d_model). The parameter count of each model is printed.
transformers' Mamba-1 training step is slow on the CPU (its reference scan loops over time
in Python and its backward grows with T^2: ~25 s at 4 x 128 tokens on 2 cores), so it is
timed by one run (see below).

Training: one step (forward, backward, AdamW update) on a (batch 4, seq_len 256) batch of
random tokens; the figure is ms per step, with tokens/s in the note. The peer is the same
model in PyTorch eager holding the same weights, with torch.optim.AdamW: transformers'
MambaForCausalLM / Mamba2ForCausalLM, and for RWKV-7 the eager model of torch_rwkv.py
(written from the published model definition; the wkv recurrence a Python loop over time).
The check compares the loss of the first batch on both sides.

Generation: greedy decoding of `gen_tokens` (64) new tokens after a `prompt` (32) tokens;
the figure is ms per generated token (prefill included, divided by the new tokens). The peer
is transformers' generate() (Mamba) or torch_rwkv.greedy_generate (RWKV-7) on the same
weights; the check says whether both produced the same tokens and how far the prompt's
logits are apart (max |difference| / max |logit|).

The two sides of a case are timed alternately in one process (see `interleaved`): the
machine is shared, and alternating makes a change of load hit both sides alike. Every
figure is the median of the timed runs; ratio = peer time / our time. A side whose first
run alone exceeds --budget seconds (transformers' Mamba-1 training) is timed by that run.
`--tiny` runs tiny sizes (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    Case,
    PeerUnavailable,
    Table,
    Timing,
    environment,
    load_recurra,
    parse_args,
)

SMALL = {
    "vocab": 256,
    "d_model": 512,
    "n_layer": 4,
    "d_state": 16,  # Mamba-1
    "d_state2": 64,  # Mamba-2
    "head_dim": 64,  # Mamba-2 head_dim and RWKV-7 head size
    "batch": 4,
    "seq_len": 256,
    "prompt": 32,
    "gen_tokens": 64,
}
TINY = {
    "vocab": 64,
    "d_model": 32,
    "n_layer": 2,
    "d_state": 8,
    "d_state2": 8,
    "head_dim": 16,
    "batch": 2,
    "seq_len": 16,
    "prompt": 4,
    "gen_tokens": 8,
}


@dataclass
class Spec:
    arch: str  # mamba | mamba2 | rwkv7
    mode: str  # train | gen
    target: str
    target_ratio: float


SPECS: dict[str, Spec] = {
    "train_mamba": Spec("mamba", "train", ">= 2x PyTorch eager", 2.0),
    "train_mamba2": Spec("mamba2", "train", ">= 2x PyTorch eager", 2.0),
    "train_rwkv7": Spec("rwkv7", "train", ">= 2x PyTorch eager", 2.0),
    "gen_mamba": Spec("mamba", "gen", ">= 2x transformers", 2.0),
    "gen_mamba2": Spec("mamba2", "gen", ">= 2x transformers", 2.0),
    "gen_rwkv7": Spec("rwkv7", "gen", ">= 2x PyTorch eager", 2.0),
}
PEER_NAME = {"mamba": "transformers", "mamba2": "transformers", "rwkv7": "torch_rwkv"}


def make_ours(arch: str, size: dict[str, int]) -> Any:
    """Our model of ``arch`` at ``size`` (seed 0: both sides get the same weights)."""
    import recurra_models as rm

    common = {"vocab_size": size["vocab"], "n_layer": size["n_layer"]}
    if arch == "mamba":
        return rm.create("mamba", d_model=size["d_model"], d_state=size["d_state"], **common)
    if arch == "mamba2":
        return rm.create(
            "mamba2",
            d_model=size["d_model"],
            d_state=size["d_state2"],
            head_dim=size["head_dim"],
            **common,
        )
    model = rm.create("rwkv7", n_embd=size["d_model"], head_size=size["head_dim"], **common)
    _fill_zero_matrices(model)
    return model


def _fill_zero_matrices(model: Any, seed: int = 1) -> None:
    """Gives the matrices that RWKV-7's official init sets to zero (the LoRA down
    projections, att.output, ffn.value) small random values, so that every part of the
    model shapes the logits and the checks below compare the whole model, not only the
    embedding and the head. The speed of either side does not depend on the values."""
    rng = np.random.default_rng(seed)
    for _, p in model.named_parameters():
        if p.ndim == 2 and not np.asarray(p).any():
            p.assign_((0.02 * rng.standard_normal(p.shape)).astype(np.float32))


def make_torch(arch: str, ours: Any, device: str = "cpu") -> Any:
    """The PyTorch peer holding our model's weights (raises PeerUnavailable): transformers'
    Mamba / Mamba-2 LM, or torch_rwkv.TorchRWKV7 for RWKV-7."""
    try:
        import torch
    except ImportError as exc:
        raise PeerUnavailable(f"torch not installed ({exc})") from None
    if arch == "rwkv7":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from torch_rwkv import TorchRWKV7

        return TorchRWKV7(ours.state_dict(), device=device, head_size=ours.config.head_size)
    try:
        import transformers
    except ImportError as exc:
        raise PeerUnavailable(f"transformers not installed ({exc})") from None
    c = ours.config
    if arch == "mamba":
        hc = transformers.MambaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.d_model,
            num_hidden_layers=c.n_layer,
            state_size=c.d_state,
            expand=c.expand,
            conv_kernel=c.d_conv,
            time_step_rank=c.rank,
            tie_word_embeddings=c.tie_embeddings,
            layer_norm_epsilon=c.norm_eps,
            use_cache=True,
        )
        model = transformers.MambaForCausalLM(hc)
    else:
        hc = transformers.Mamba2Config(
            vocab_size=c.vocab_size,
            hidden_size=c.d_model,
            num_hidden_layers=c.n_layer,
            state_size=c.d_state,
            expand=c.expand,
            conv_kernel=c.d_conv,
            head_dim=c.head_dim,
            num_heads=c.n_heads,
            n_groups=c.n_groups,
            tie_word_embeddings=c.tie_embeddings,
            layer_norm_epsilon=c.norm_eps,
            chunk_size=64,
            use_cache=True,
        )
        model = transformers.Mamba2ForCausalLM(hc)
    sd = {k: torch.from_numpy(v) for k, v in ours.state_dict().items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise PeerUnavailable(f"weights do not map: {missing} {unexpected}")
    return model.to(device)


def torch_logits(arch: str, model: Any, tokens: Any) -> Any:
    """Logits (B, T, V) of the peer for int64 tokens (B, T)."""
    if arch == "rwkv7":
        return model(tokens)[0]
    return model(tokens).logits


def torch_train_step(arch: str, model: Any, opt: Any, x: Any, y: Any) -> Any:
    """One training step of the PyTorch peer (cross-entropy of its logits, backward, the
    optimizer); returns the loss tensor."""
    import torch

    logits = torch_logits(arch, model, x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def tokens(size: dict[str, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, size["vocab"], (size["batch"], size["seq_len"] + 1)).astype(np.int32)


# ------------------------------------------------------------------------------------------
# the two sides of a case: each builds its model and returns the function to time (one
# training step, or one whole generation); the first run leaves its result in `out`
# ------------------------------------------------------------------------------------------
def ours_train(arch: str, size: dict[str, int], out: dict[str, Any]) -> Callable[[], None]:
    from recurra_optim import AdamW

    model = make_ours(arch, size)
    out["params"] = model.num_parameters()
    opt = AdamW(list(model.parameters()), lr=1e-4)
    data = tokens(size, 0)
    x, y = data[:, :-1], data[:, 1:]

    def step() -> None:
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if "ours" not in out:
            out["ours"] = float(loss.item())  # already computed: no extra work

    return step


def torch_train(arch: str, size: dict[str, int], out: dict[str, Any]) -> Callable[[], None]:
    import torch

    model = make_torch(arch, make_ours(arch, size)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.from_numpy(tokens(size, 0).astype(np.int64))
    x, y = data[:, :-1], data[:, 1:]

    def step() -> None:
        loss = torch_train_step(arch, model, opt, x, y)
        if "torch" not in out:
            out["torch"] = float(loss.detach())

    return step


def ours_gen(arch: str, size: dict[str, int], out: dict[str, Any]) -> Callable[[], None]:
    import recurra as rc
    import recurra_models as rm

    model = make_ours(arch, size)
    out["params"] = model.num_parameters()
    prompt = tokens(size, 1)[0, : size["prompt"]]
    n = size["gen_tokens"]
    with rc.no_grad():
        out["ours_logits"] = np.asarray(model.eval()(prompt[None, :]))

    def gen() -> None:
        out["ours"] = rm.generate(model, prompt, max_tokens=n, temperature=0.0)

    return gen


def torch_gen(arch: str, size: dict[str, int], out: dict[str, Any]) -> Callable[[], None]:
    import torch

    model = make_torch(arch, make_ours(arch, size)).eval()
    prompt = torch.from_numpy(tokens(size, 1)[:1, : size["prompt"]].astype(np.int64))
    n = size["gen_tokens"]
    with torch.no_grad():
        out["torch_logits"] = torch_logits(arch, model, prompt).numpy()

    def gen() -> None:
        out["torch"] = torch_greedy(arch, model, prompt, n)

    return gen


def torch_greedy(arch: str, model: Any, prompt: Any, n: int) -> list[int]:
    """Greedy decoding of n new tokens by the PyTorch peer (transformers' generate() for
    Mamba, torch_rwkv's loop for RWKV-7); returns the new token ids."""
    import torch

    if arch == "rwkv7":
        from torch_rwkv import greedy_generate

        return greedy_generate(model, prompt, n)
    with torch.no_grad():
        ids = model.generate(
            prompt,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return ids[0, prompt.shape[1] :].tolist()


def interleaved(fns: dict[str, Callable[[], Any]], args: Any) -> dict[str, Timing]:
    """Times the sides of a case alternately (ours, peer, peer, ours, ...), so that a change
    of the machine's load during the case hits both sides alike (the machine is shared).

    Each side's first run is untimed (warm-up; it fills the result for the checks), then
    ``--warmup - 1`` more warm-up rounds and up to ``--reps`` timed rounds (fewer when a
    round is slow: the rounds must fit ``--budget`` seconds per side, never below 3). A side
    whose first run alone exceeds the budget (transformers' Mamba-1 training on the CPU: its
    reference scan loops over time in Python and its backward grows with T^2) is not run
    again: that run is its one figure. Returns each side's timed runs (ms)."""
    first: dict[str, float] = {}
    for k, f in fns.items():
        t0 = time.perf_counter()
        f()
        first[k] = time.perf_counter() - t0
    out = {k: Timing([first[k] * 1e3]) for k in fns if first[k] > args.budget}
    rest = [k for k in fns if k not in out]
    if not rest:
        return out
    round_s = sum(first[k] for k in rest)
    for _ in range(max(0, args.warmup - 1)):
        if round_s * (args.warmup + args.reps) > args.budget * len(rest):
            break
        for k in rest:
            fns[k]()
    n = max(3, min(args.reps, int(args.budget * len(rest) / max(round_s, 1e-9))))
    runs: dict[str, list[float]] = {k: [] for k in rest}
    for i in range(n):
        for k in rest if i % 2 == 0 else reversed(rest):
            t0 = time.perf_counter()
            fns[k]()
            runs[k].append((time.perf_counter() - t0) * 1e3)
    out.update({k: Timing(v) for k, v in runs.items()})
    return out


# ------------------------------------------------------------------------------------------
# a case: both sides, their check, the verdict
# ------------------------------------------------------------------------------------------
def _prepare(fn: Callable[[], Callable[[], None]]) -> tuple[Callable[[], None] | None, str]:
    """Builds one side; returns (the function to time, "") or (None, why not)."""
    try:
        return fn(), ""
    except PeerUnavailable as exc:
        return None, f"n/a ({exc})"
    except Exception as exc:  # a failing side costs its row, never the run
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        return None, f"error: {type(exc).__name__}: {first}"


def check_line(spec: Spec, outs: dict[str, Any]) -> str:
    """Agreement of the two sides: first-batch losses (train), greedy tokens and prompt
    logits (gen); empty when one side did not run."""
    if "ours" not in outs or "torch" not in outs:
        return ""
    if spec.mode == "train":
        a, b = outs["ours"], outs["torch"]
        rel = abs(a - b) / max(abs(b), 1e-12)
        verdict = "agree" if rel < 1e-4 else "DIFFER"
        return f"first-batch loss ours {a:.6f}, peer {b:.6f} (rel. diff {rel:.1e}): {verdict}"
    same = outs["ours"] == outs["torch"]
    n_same = next(
        (i for i, (p, q) in enumerate(zip(outs["ours"], outs["torch"])) if p != q),
        min(len(outs["ours"]), len(outs["torch"])),
    )
    text = (
        "same greedy tokens"
        if same
        else f"greedy tokens differ from token {n_same} of {len(outs['ours'])}"
    )
    if "ours_logits" in outs and "torch_logits" in outs:
        a, b = outs["ours_logits"], outs["torch_logits"]
        if a.shape == b.shape:
            err = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
            text += f"; prompt logits max|diff|/max|logit| {err:.1e}"
            text += ": agree" if err < 1e-4 else ": DIFFER"
    return text


def run_case(name: str, spec: Spec, args: Any, size: dict[str, int], table: Table) -> None:
    case = Case(name, target=spec.target, target_ratio=spec.target_ratio)
    peer = PEER_NAME[spec.arch]
    toks = size["batch"] * size["seq_len"]
    per = 1 if spec.mode == "train" else size["gen_tokens"]  # gen: ms per new token
    outs: dict[str, Any] = {}
    ours_fn = ours_train if spec.mode == "train" else ours_gen
    peer_fn = torch_train if spec.mode == "train" else torch_gen
    ours, note = _prepare(lambda: ours_fn(spec.arch, size, outs))
    theirs, pnote = _prepare(lambda: peer_fn(spec.arch, size, outs))
    fns = {k: f for k, f in (("ours", ours), (peer, theirs)) if f is not None}
    try:
        timings = interleaved(fns, args)
    except Exception as exc:  # reported in the row, never raised
        timings = {}
        note = note or f"error: {type(exc).__name__}: {str(exc)[:160]}"
    ms = {k: t.median_ms / per for k, t in timings.items()}
    case.ours_ms = ms.get("ours")
    case.peers[peer] = ms.get(peer)
    runs = {k: len(t.runs_ms) for k, t in timings.items()}
    params = f"{outs['params'] / 1e6:.2f}M parameters" if "params" in outs else ""
    if case.ours_ms:
        rate = f"{toks / case.ours_ms * 1e3:.0f} tokens/s, " if spec.mode == "train" else ""
        note = note or f"{rate}{params}, {runs['ours']} timed runs"
    if case.peers[peer]:
        rate = f"{toks / case.peers[peer] * 1e3:.0f} tokens/s, " if spec.mode == "train" else ""
        pnote = pnote or f"{rate}{runs[peer]} timed run{'s' if runs[peer] > 1 else ''}"
    case.ours_note = note
    if pnote:
        case.peer_notes[peer] = pnote
    if not args.no_check:
        case.check = check_line(spec, outs)
    table.add(case)


def main() -> None:
    tiny = "--tiny" in sys.argv
    if tiny:
        sys.argv.remove("--tiny")
    args = parse_args(__doc__.splitlines()[0], SPECS)
    rc, info = load_recurra(args.threads)
    env = environment(args.threads)
    env["recurra"] = info
    try:
        import torch

        torch.set_num_threads(args.threads)
        env["torch"] = torch.__version__
    except ImportError:
        env["torch"] = "not installed"
    try:
        import transformers

        transformers.logging.set_verbosity_error()  # not the "slow path" notes per model
        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = "not installed"
    size = TINY if tiny else SMALL
    env["sizes"] = size
    print(f"# torch {env['torch']}, transformers {env['transformers']}; sizes {size}")
    table = Table("models" + (" (--tiny: a smoke test, not a measurement)" if tiny else ""), env)
    for name in args.cases:
        run_case(name, SPECS[name], args, size, table)
    table.finish()
    _ = rc


if __name__ == "__main__":
    main()

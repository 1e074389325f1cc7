"""Model benchmarks: training steps and generation of small Mamba-1, Mamba-2, RWKV-7 LMs.

    python bench/models.py [--threads 2] [--reps 7] [--only train_mamba,gen_mamba2] [--tiny]

Training: one step (forward, backward, AdamW update) on a (batch, seq_len) batch of random
tokens; the figure is ms per step, with tokens/s in the note. The peer is the same model in
PyTorch eager (transformers' MambaForCausalLM / Mamba2ForCausalLM, holding the same weights)
with torch.optim.AdamW. Generation: greedy decoding of `gen_tokens` new tokens after a short
prompt; the figure is ms per generated token; the peer is transformers' generate() on the
same weights, and the "check" line says whether both produced the same tokens. RWKV-7 has
no PyTorch peer here (none is installed), so only our figure is printed.
`--tiny` runs tiny sizes (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from common import (
    Case,
    PeerUnavailable,
    Table,
    Timing,
    environment,
    load_recurra,
    measure,
    parse_args,
    run_side,
)

SMALL = {
    "vocab": 256,
    "d_model": 256,
    "n_layer": 4,
    "d_state": 16,
    "batch": 4,
    "seq_len": 128,
    "prompt": 16,
    "gen_tokens": 64,
    "head_dim": 64,
}
TINY = {
    "vocab": 64,
    "d_model": 32,
    "n_layer": 2,
    "d_state": 8,
    "batch": 2,
    "seq_len": 16,
    "prompt": 4,
    "gen_tokens": 8,
    "head_dim": 16,
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
    "train_rwkv7": Spec("rwkv7", "train", "(no PyTorch peer here)", 0.0),
    "gen_mamba": Spec("mamba", "gen", ">= 2x transformers", 2.0),
    "gen_mamba2": Spec("mamba2", "gen", ">= 2x transformers", 2.0),
    "gen_rwkv7": Spec("rwkv7", "gen", "(no PyTorch peer here)", 0.0),
}


def make_ours(arch: str, size: dict[str, int]) -> Any:
    import recurra_models as rm

    common = {"vocab_size": size["vocab"], "n_layer": size["n_layer"]}
    if arch == "mamba":
        return rm.create("mamba", d_model=size["d_model"], d_state=size["d_state"], **common)
    if arch == "mamba2":
        return rm.create(
            "mamba2",
            d_model=size["d_model"],
            d_state=size["d_state"],
            head_dim=size["head_dim"],
            **common,
        )
    cls = rm.get_architecture("rwkv7")  # ImportError until RWKV-7 exists: "op missing"
    cfg = {f.name for f in __import__("dataclasses").fields(cls.Config)}
    kw = {
        k: v
        for k, v in (
            ("n_embd", size["d_model"]),
            ("d_model", size["d_model"]),
            ("head_size", size["head_dim"]),
        )
        if k in cfg
    }
    return cls.from_config({**common, **kw})


def make_torch(arch: str, ours: Any) -> Any:
    """transformers' model holding our model's weights (raises PeerUnavailable)."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise PeerUnavailable(f"transformers/torch not installed ({exc})") from None
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
    elif arch == "mamba2":
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
    else:
        raise PeerUnavailable("no PyTorch RWKV-7 implementation installed")
    sd = {k: torch.from_numpy(v) for k, v in ours.state_dict().items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise PeerUnavailable(f"weights do not map: {missing} {unexpected}")
    return model


def tokens(size: dict[str, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, size["vocab"], (size["batch"], size["seq_len"] + 1)).astype(np.int32)


def ours_train(arch: str, size: dict[str, int], args: Any) -> Callable[[], Timing]:
    def run() -> Timing:
        from recurra_optim import AdamW

        model = make_ours(arch, size)
        opt = AdamW(list(model.parameters()), lr=1e-4)
        data = tokens(size, 0)
        x, y = data[:, :-1], data[:, 1:]

        def step() -> None:
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()

        return measure(step, args.reps, args.warmup, args.budget)

    return run


def torch_train(arch: str, size: dict[str, int], args: Any) -> Callable[[], Timing]:
    def run() -> Timing:
        import torch

        model = make_torch(arch, make_ours(arch, size)).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        data = torch.from_numpy(tokens(size, 0).astype(np.int64))
        x, y = data[:, :-1], data[:, 1:]

        def step() -> None:
            logits = model(x).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
            )
            loss.backward()
            opt.step()
            opt.zero_grad()

        return measure(step, args.reps, args.warmup, args.budget)

    return run


def _per_token(t: Timing, n: int) -> Timing:
    return Timing([ms / n for ms in t.runs_ms])


def ours_gen(
    arch: str, size: dict[str, int], args: Any, out: dict[str, Any]
) -> Callable[[], Timing]:
    def run() -> Timing:
        import recurra_models as rm

        model = make_ours(arch, size)
        prompt = tokens(size, 1)[0, : size["prompt"]]
        n = size["gen_tokens"]

        def gen() -> None:
            out["ours"] = rm.generate(model, prompt, max_tokens=n, temperature=0.0)

        return _per_token(measure(gen, args.reps, args.warmup, args.budget), n)

    return run


def torch_gen(
    arch: str, size: dict[str, int], args: Any, out: dict[str, Any]
) -> Callable[[], Timing]:
    def run() -> Timing:
        import torch

        model = make_torch(arch, make_ours(arch, size)).eval()
        prompt = torch.from_numpy(tokens(size, 1)[:1, : size["prompt"]].astype(np.int64))
        n = size["gen_tokens"]

        def gen() -> None:
            with torch.no_grad():
                ids = model.generate(
                    prompt,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            out["torch"] = ids[0, prompt.shape[1] :].tolist()

        return _per_token(measure(gen, args.reps, args.warmup, args.budget), n)

    return run


def run_case(name: str, spec: Spec, args: Any, size: dict[str, int], table: Table) -> None:
    case = Case(
        name, target=spec.target, target_ratio=spec.target_ratio if spec.target_ratio else None
    )
    toks = size["batch"] * size["seq_len"]
    if spec.mode == "train":
        run_side(case, ours_train(spec.arch, size, args))
        if spec.arch != "rwkv7":
            run_side(case, torch_train(spec.arch, size, args), peer="torch")
        if case.ours_ms:
            case.ours_note = f"{toks / case.ours_ms * 1e3:.0f} tokens/s"
        if case.peers.get("torch"):
            case.peer_notes["torch"] = f"{toks / case.peers['torch'] * 1e3:.0f} tokens/s"
    else:
        outs: dict[str, Any] = {}
        run_side(case, ours_gen(spec.arch, size, args, outs))
        if spec.arch != "rwkv7":
            run_side(case, torch_gen(spec.arch, size, args, outs), peer="transformers")
        if "ours" in outs and "torch" in outs and not args.no_check:
            same = outs["ours"] == outs["torch"]
            case.check = "same greedy tokens" if same else "greedy tokens differ"
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
    size = TINY if tiny else SMALL
    env["sizes"] = size
    table = Table("models", env)
    for name in args.cases:
        run_case(name, SPECS[name], args, size, table)
    table.finish()
    _ = rc


if __name__ == "__main__":
    main()

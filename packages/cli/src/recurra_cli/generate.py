"""``recurra generate``: continues a prompt with a model trained by ``recurra train``."""

from __future__ import annotations

import codecs
import sys
import time
from pathlib import Path

import typer
from rich.markup import escape

from recurra_cli._common import EXIT_CHECK_FAILED, EXIT_OK, EXIT_UNAVAILABLE, dumps, err, fail
from recurra_cli.train import checkpoint_folder, parse_device, require_models


def generate(
    checkpoint: Path = typer.Option(
        ..., "--checkpoint", help="the --out folder of `recurra train`, or one checkpoint in it"
    ),
    prompt: str = typer.Option(..., "--prompt", help="the text to continue"),
    max_tokens: int = typer.Option(200, "--max-tokens", min=0, help="bytes to generate"),
    temperature: float = typer.Option(
        0.8, "--temperature", min=0.0, help="0 = greedy (always the most likely byte)"
    ),
    top_k: int | None = typer.Option(None, "--top-k", min=1, help="sample among the k best"),
    top_p: float | None = typer.Option(
        None, "--top-p", min=0.0, max=1.0, help="sample in the smallest set of mass >= p"
    ),
    seed: int | None = typer.Option(None, "--seed", help="a fixed seed repeats the output"),
    device: str = typer.Option("cpu", "--device", help="cpu or vulkan[:N]"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Continue --prompt with the model of a checkpoint, printing the text as it comes.

    --checkpoint is a checkpoint folder or the --out folder of `recurra train` (its latest
    checkpoint). The generated text goes to stdout, the timing to stderr.

    Exit 2 for a missing or unreadable checkpoint folder or bad sampling settings, 3 when
    recurra-models or the device is unavailable, 1 when generation itself fails.
    """
    rm = require_models("generate", ("load_checkpoint", "stream", "ByteTokenizer"))
    if top_p is not None and top_p <= 0:
        fail("--top-p must be in (0, 1]")
    folder = checkpoint_folder(checkpoint, "--checkpoint")
    dev = parse_device(device)
    try:
        ckpt = rm.load_checkpoint(folder)
    except (FileNotFoundError, ValueError) as e:
        fail(f"--checkpoint {str(checkpoint)!r} is not a usable checkpoint: {e}")
    net, arch = ckpt["model"], str(ckpt["config"]["arch"])
    tok = rm.ByteTokenizer()
    vocab = getattr(net, "vocab_size", tok.vocab_size)
    if vocab != tok.vocab_size:
        fail(
            f"the model in {str(checkpoint)!r} has a vocabulary of {vocab}, not bytes "
            f"({tok.vocab_size}): `recurra generate` reads byte-level models"
        )
    ids = tok.encode(prompt)
    if ids.size == 0:
        fail("--prompt is empty: give at least one character")
    try:
        net.to(dev)
    except ValueError as e:
        fail(str(e), EXIT_UNAVAILABLE)

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out_ids: list[int] = []
    text_parts: list[str] = []
    if not as_json:
        err.print(f"[dim]{arch} from {escape(str(checkpoint))} on {dev}[/]")
        sys.stdout.write(prompt)
        sys.stdout.flush()
    t0 = time.perf_counter()
    try:
        for t in rm.stream(net, ids, max_tokens, temperature, top_k, top_p, seed):
            out_ids.append(int(t))
            piece = decoder.decode(bytes([int(t)]))
            text_parts.append(piece)
            if not as_json and piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except (ValueError, RuntimeError, TypeError) as e:
        # the sampling settings were checked above: this is the model or the device failing
        fail(f"generation failed after {len(out_ids)} tokens on {dev}: {e}", EXIT_CHECK_FAILED)
    tail = decoder.decode(b"", final=True)
    text_parts.append(tail)
    seconds = time.perf_counter() - t0
    text = "".join(text_parts)
    if as_json:
        print(
            dumps(
                {
                    "checkpoint": str(checkpoint),
                    "model": arch,
                    "device": dev,
                    "prompt": prompt,
                    "text": text,
                    "tokens": out_ids,
                    "seconds": seconds,
                    "tokens_per_s": len(out_ids) / seconds if seconds > 0 else None,
                }
            )
        )
    else:
        sys.stdout.write(tail + "\n")
        sys.stdout.flush()
        err.print(
            f"[dim]{len(out_ids)} tokens in {seconds:.2f} s "
            f"({len(out_ids) / seconds if seconds > 0 else 0:.1f} tokens/s)[/]"
        )
    raise typer.Exit(EXIT_OK)

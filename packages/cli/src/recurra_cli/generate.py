"""``recurra generate``: continues a prompt with a model trained by ``recurra train``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import typer
from rich.markup import escape

from recurra_cli import text as text_io
from recurra_cli._common import EXIT_CHECK_FAILED, EXIT_OK, EXIT_UNAVAILABLE, dumps, err, fail
from recurra_cli.train import checkpoint_folder, parse_device, require_models


def generate(
    checkpoint: Path | None = typer.Option(
        None, "--checkpoint", help="the --out folder of `recurra train`, or one checkpoint in it"
    ),
    model: str | None = typer.Option(
        None, "--model", help="a transformers folder, an RWKV checkpoint, or a training run"
    ),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="bytes or a tokenizer path (default: the model's own)"
    ),
    prompt: str = typer.Option(
        ..., "--prompt", help="the text to continue (a byte model reads its bytes, UTF-8 or not)"
    ),
    max_tokens: int = typer.Option(200, "--max-tokens", min=0, help="tokens to generate"),
    temperature: float = typer.Option(
        0.8, "--temperature", min=0.0, help="0 = greedy (always the most likely byte)"
    ),
    top_k: int | None = typer.Option(None, "--top-k", min=1, help="sample among the k best"),
    top_p: float | None = typer.Option(
        None, "--top-p", min=0.0, max=1.0, help="sample in the smallest set of mass >= p"
    ),
    seed: int | None = typer.Option(None, "--seed", help="a fixed seed (>= 0) repeats the output"),
    device: str = typer.Option("cpu", "--device", help="cpu or vulkan[:N]"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Continue --prompt with a model, printing the text as it comes.

    --model is a transformers folder, an RWKV checkpoint or a `recurra train` run;
    --checkpoint a checkpoint folder or the --out folder of `recurra train` (its latest
    checkpoint). The text is decoded with the model's tokenizer (only complete characters
    are printed) and stops at its end-of-text token or after --max-tokens. Plain
    completion: no chat template. The generated text goes to stdout, the timing to stderr.

    Exit 2 for a missing or unreadable checkpoint folder or bad sampling settings, 3 when
    recurra-models or the device is unavailable, 1 when generation itself fails.
    """
    rm = require_models("generate", ("load_checkpoint", "stream", "ByteTokenizer", "TextStreamer"))
    if top_p is not None and top_p <= 0:
        fail("--top-p must be in (0, 1]")
    if seed is not None and seed < 0:
        fail(f"--seed must be >= 0, got {seed}")
    if (checkpoint is None) == (model is None):
        fail("give one of --model PATH or --checkpoint DIR")
    source = str(checkpoint if checkpoint is not None else model)
    if checkpoint is not None:
        checkpoint_folder(checkpoint, "--checkpoint")  # exits 2 naming the problem
    dev = parse_device(device)
    net, tok0, arch = text_io.load_model(rm, source, "--checkpoint" if checkpoint else "--model")
    tok = text_io.pick_tokenizer(rm, tokenizer, tok0)
    text_io.check_vocab(tok, net)
    # The prompt's bytes as given: a byte that is not UTF-8 reached Python as a surrogate
    # escape (PEP 383), which gives the byte back; a byte model reads it like any other,
    # another tokenizer sees U+FFFD in its place.
    try:
        raw = prompt.encode("utf-8", errors="surrogateescape")
    except UnicodeEncodeError as e:
        fail(f"--prompt holds a character that has no bytes ({e.reason} at {e.start})")
    prompt = raw.decode("utf-8", errors="replace")  # as printed: bad bytes become U+FFFD
    if isinstance(tok, rm.ByteTokenizer):
        ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int32)
    else:
        ids = tok.encode(prompt, add_special_tokens=True)
    if ids.size == 0:
        fail("--prompt is empty: give at least one character")
    try:
        net.to(dev)
    except ValueError as e:
        fail(str(e), EXIT_UNAVAILABLE)

    streamer = rm.TextStreamer(tok)
    eos = getattr(tok, "eos_id", None)
    out_ids: list[int] = []
    text_parts: list[str] = []
    if not as_json:
        err.print(f"[dim]{arch} from {escape(source)} on {dev}[/]")
        sys.stdout.write(prompt)
        sys.stdout.flush()
    t0 = time.perf_counter()
    try:
        stops = [eos] if eos is not None else []
        for t in rm.stream(net, ids, max_tokens, temperature, top_k, top_p, seed, stops):
            out_ids.append(int(t))
            if int(t) == eos:
                break
            piece = streamer.push(int(t))
            text_parts.append(piece)
            if not as_json and piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except (ValueError, RuntimeError, TypeError) as e:
        # the sampling settings were checked above: this is the model or the device failing
        fail(f"generation failed after {len(out_ids)} tokens on {dev}: {e}", EXIT_CHECK_FAILED)
    tail = streamer.flush()
    text_parts.append(tail)
    seconds = time.perf_counter() - t0
    text = "".join(text_parts)
    if as_json:
        print(
            dumps(
                {
                    "checkpoint": source,
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

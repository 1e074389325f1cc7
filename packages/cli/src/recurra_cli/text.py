"""Text in, text out: what ``recurra train / generate / eval / export`` share for pretrained
checkpoints and real tokenizers, and the ``eval`` and ``export`` commands.

A model is named by a preset (``mamba``, ``mamba2``, ``rwkv6``, ``rwkv7``: a fresh model)
or a path: a transformers Mamba / Mamba-2 folder, an official RWKV-6/7 checkpoint (or a
folder holding one), or the ``--out`` folder of ``recurra train`` (or one checkpoint in
it). The tokenizer comes with the model (``tokenizer.json``, an RWKV World vocabulary, the
``tokenizer/`` folder of a run), else ``--tokenizer``, else bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from recurra_cli._common import EXIT_CHECK_FAILED, EXIT_OK, EXIT_UNAVAILABLE, console, err, fail

TOKENIZER_DIR = "tokenizer"


def is_run(path: Path) -> bool:
    """Whether ``path`` is a ``recurra train`` output or one of its checkpoints."""
    return (path / "trainer.json").is_file() or (path / "latest.json").is_file()


def load_model(rm: Any, spec: str, option: str = "--model") -> tuple[Any, Any, str]:
    """(model, its tokenizer or None, arch) for a path (see the module docstring).
    Exits 2 naming the problem."""
    from recurra_cli.train import checkpoint_folder

    path = Path(spec)
    if path.is_dir() and is_run(path):
        folder = checkpoint_folder(path, option)
        try:
            ckpt = rm.load_checkpoint(folder)
        except (FileNotFoundError, ValueError) as e:
            fail(f"{option} {spec!r} is not a usable checkpoint: {e}")
        net = ckpt["model"]
        tok = None
        for d in (folder, path):
            tok = tok or find_tokenizer_in(rm, d)
        return net, tok, str(ckpt["config"]["arch"])
    try:
        net = rm.load_pretrained(path)
    except (FileNotFoundError, ValueError, ImportError) as e:
        fail(f"{option} {spec!r}: {e}")
    return net, getattr(net, "tokenizer", None), str(net.arch)


def find_tokenizer_in(rm: Any, folder: Path) -> Any:
    from recurra_models.tokenizers import find_tokenizer

    try:
        return find_tokenizer(folder)
    except (FileNotFoundError, ValueError, ImportError) as e:
        fail(f"the tokenizer in {str(folder)!r} cannot be read: {e}")


def pick_tokenizer(rm: Any, spec: str | None, default: Any) -> Any:
    """``--tokenizer`` when given (``bytes`` or a path), else ``default``, else bytes."""
    if spec is not None:
        try:
            return rm.load_tokenizer(spec)
        except (FileNotFoundError, ValueError, ImportError) as e:
            fail(f"--tokenizer: {e}")
    return default if default is not None else rm.ByteTokenizer()


def check_vocab(tok: Any, net: Any) -> None:
    if int(tok.vocab_size) > int(net.vocab_size):
        fail(
            f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary is "
            f"{net.vocab_size}: give the model's own tokenizer (--tokenizer)"
        )


def load_tokens(
    rm: Any,
    paths: list[Path],
    tok: Any,
    cache_dir: Path | None,
    text_field: str,
    option: str,
    quiet: bool,
) -> np.ndarray:
    """The token ids of text files (tokenized once into ``cache_dir``), with a progress bar.
    Exits 2 naming the file for a missing, empty or malformed input."""
    with Progress(
        TextColumn(f"  tokenizing {escape(option)}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        disable=quiet,
        transient=True,
    ) as progress:
        task = progress.add_task("tok", total=None)

        def on_progress(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        try:
            ids: np.ndarray = rm.tokenize_files(
                paths, tok, cache_dir, text_field=text_field, progress=on_progress
            )
            return ids
        except (FileNotFoundError, IsADirectoryError, PermissionError, ValueError) as e:
            fail(f"{option}: {e}")


def save_run_tokenizer(tok: Any, out: Path) -> None:
    """Keeps the tokenizer with a training run (``OUT/tokenizer/``), for generate/export."""
    from recurra_models.tokenizers import save_tokenizer

    try:
        save_tokenizer(tok, out / TOKENIZER_DIR)
    except OSError as e:
        fail(f"cannot write the tokenizer into {str(out / TOKENIZER_DIR)!r}: {e}")


def evaluate(
    model: str = typer.Option(
        ..., "--model", help="a transformers folder, an RWKV checkpoint or a `recurra train` run"
    ),
    data: list[Path] = typer.Option(..., "--data", help="held-out text (.txt or .jsonl)"),
    seq_len: int = typer.Option(256, "--seq-len", min=2, help="tokens per window"),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="windows per forward pass"),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="bytes or a tokenizer path"),
    text_field: str = typer.Option("text", "--text-field", help="the text field of .jsonl"),
    device: str = typer.Option("cpu", "--device", help="cpu or vulkan[:N]"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Loss and perplexity of a model on held-out text.

    The text is tokenized and cut into non-overlapping windows of --seq-len tokens (the
    last, shorter one included); each window is scored from a fresh state, and the loss is
    the mean next-token cross-entropy over all predictions (what transformers computes with
    labels=input_ids per window, weighted by the window's length).
    """
    from recurra_cli.train import parse_device, require_models

    rm = require_models("eval", ("load_pretrained", "tokenize_files", "evaluate_tokens"))
    dev = parse_device(device)
    net, tok0, arch = load_model(rm, model)
    tok = pick_tokenizer(rm, tokenizer, tok0)
    check_vocab(tok, net)
    tokens = load_tokens(rm, data, tok, None, text_field, "--data", as_json)
    if tokens.size < 2:
        fail(f"--data holds {tokens.size} token(s): at least 2 are needed")
    try:
        net.to(dev)
    except ValueError as e:
        fail(str(e), EXIT_UNAVAILABLE)
    try:
        res = rm.evaluate_tokens(net, tokens, seq_len=seq_len, batch_size=batch_size)
    except (ValueError, RuntimeError) as e:
        fail(f"evaluation failed on {dev}: {e}", EXIT_CHECK_FAILED)
    out = {"model": model, "arch": arch, "device": dev, "seq_len": seq_len, **res}
    out["tokens"] = int(res["tokens"])
    if as_json:
        print(json.dumps(out))
    else:
        console.print(
            f"{arch} on {out['tokens']:,} tokens: loss {res['loss']:.4f}, "
            f"perplexity {res['perplexity']:.3f}"
        )
    raise typer.Exit(EXIT_OK)


def export(
    source: str = typer.Argument(
        ..., help="a `recurra train` run (or checkpoint), a transformers folder or RWKV file"
    ),
    out: Path = typer.Argument(..., help="the folder to write"),
    fmt: str = typer.Option(
        "", "--format", help="hf (Mamba, Mamba-2) or rwkv (RWKV-6/7); default: by architecture"
    ),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="bytes or a tokenizer path (default: the model's own)"
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a non-empty OUT"),
) -> None:
    """Write a model as a folder other tools load.

    --format hf: config.json + model.safetensors + the tokenizer files, loadable by
    transformers (MambaForCausalLM / Mamba2ForCausalLM.from_pretrained, AutoTokenizer).
    --format rwkv: the official RWKV layout (model.pth + the World vocabulary). The folder
    is written atomically; an existing non-empty OUT is kept unless --overwrite.
    """
    from recurra_cli.train import require_models

    rm = require_models("export", ("save_pretrained", "load_pretrained"))
    if fmt and fmt not in ("hf", "rwkv"):
        fail(f"--format must be hf or rwkv, not {fmt!r}")
    if out.exists() and not out.is_dir():
        fail(f"OUT {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        fail(f"OUT {str(out)!r} exists and is not empty: pass --overwrite to replace it")
    net, tok0, arch = load_model(rm, source, "SOURCE")
    tok = pick_tokenizer(rm, tokenizer, tok0) if tokenizer or tok0 is not None else None
    try:
        path = rm.save_pretrained(net, out, tok, format=fmt or None, overwrite=overwrite)
    except (ValueError, FileExistsError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {str(out)!r}: {e}")
    kind = fmt or ("rwkv" if arch.startswith("rwkv") else "hf")
    console.print(f"{arch} written to {escape(str(path))} ({kind})")
    raise typer.Exit(EXIT_OK)

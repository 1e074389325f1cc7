"""``recurra train``: trains a byte-level language model on a text file, with checkpoints.

Built on recurra-models (``recurra-cli[models]``): the model comes from
``recurra_models.create(arch, **config)``, the loop is ``recurra_models.Trainer`` with an
AdamW optimizer, checkpoints are ``recurra_models.save_checkpoint`` folders (so that
``recurra generate --checkpoint DIR`` and ``--resume`` can read them).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from recurra._install import install_hint
from recurra_cli._common import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    console,
    dumps,
    fail,
)

INSTALL_HINT = install_hint("recurra-cli[models]")


def require_models(command: str, names: tuple[str, ...]) -> ModuleType:
    """recurra_models, with ``names`` importable from it; exits 3 saying what to install."""
    try:
        import recurra_models as rm
    except ImportError as e:
        fail(
            f"`recurra {command}` needs recurra-models, which is not installed ({e}): "
            f"{INSTALL_HINT}",
            EXIT_UNAVAILABLE,
        )
    missing = []
    for n in names:
        try:
            getattr(rm, n)
        except (AttributeError, ImportError):
            missing.append(n)
    if missing:
        fail(
            f"`recurra {command}` needs recurra_models.{', '.join(missing)}, which this "
            f"recurra-models ({getattr(rm, '__version__', '?')}) lacks: upgrade it "
            f"({INSTALL_HINT})",
            EXIT_UNAVAILABLE,
        )
    return rm


def parse_device(spec: str) -> str:
    """The canonical device name (``cpu``, ``vulkan:0``); exits 2 for a name recurra does not
    know and 3 for a known backend that cannot run here."""
    import recurra as rc
    import recurra.backends

    try:
        return str(rc.parse_device(spec))
    except ValueError as e:
        base = spec.strip().lower().partition(":")[0]
        known = {b.name for b in recurra.backends.available()} | {"cpu", "vulkan"}
        fail(str(e), EXIT_UNAVAILABLE if base in known else EXIT_USAGE)


def _parse_config(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are read as JSON when they parse (ints, floats, true),
    as strings otherwise."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            fail(f"--config expects KEY=VALUE (e.g. d_model=32), got {item!r}")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key.strip()] = value
    return out


def train(
    model: str | None = typer.Option(
        None,
        "--model",
        help="mamba, mamba2, rwkv6 or rwkv7 (with --resume: read from the checkpoint)",
    ),
    data: Path = typer.Option(..., "--data", help="a text file to train on (its UTF-8 bytes)"),
    device: str = typer.Option("cpu", "--device", help="cpu or vulkan[:N]"),
    steps: int = typer.Option(200, "--steps", min=1, help="optimizer steps in total"),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="sequences per step"),
    seq_len: int = typer.Option(64, "--seq-len", min=2, help="tokens per sequence"),
    lr: float = typer.Option(3e-3, "--lr", min=0.0, help="AdamW learning rate"),
    seed: int = typer.Option(0, "--seed", help="initialisation and batch seed"),
    config: list[str] = typer.Option(
        [], "--config", metavar="KEY=VALUE", help="model size, e.g. d_model=32 (repeatable)"
    ),
    out: Path | None = typer.Option(
        None, "--out", help="checkpoint folder (written every --checkpoint-every steps)"
    ),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every", min=1),
    resume: bool = typer.Option(False, "--resume", help="continue from the checkpoint in --out"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of bars"),
) -> None:
    """Train a byte-level Mamba / Mamba-2 / RWKV-6 / RWKV-7 language model on a text file.

    The loss is next-byte cross-entropy (a model that learned nothing scores ln 256 = 5.55).
    Batches depend only on (seed, step), so a run resumed with --resume reproduces the loss
    curve of an uninterrupted one. Exit 2 for a missing or unusable data file or bad
    arguments, 3 when recurra-models or the device is unavailable, 1 when training fails
    (the loss diverges, the model fails on the device).
    """
    rm = require_models("train", ("Trainer", "create", "ByteTokenizer", "load_checkpoint"))
    import recurra_optim

    if resume and out is None:
        fail("--resume needs --out DIR (the folder to resume from)")
    if not resume and model is None:
        fail(f"--model is required: one of {', '.join(rm.architectures())}")
    if model is not None and model not in rm.architectures():
        fail(f"unknown --model {model!r}: one of {', '.join(rm.architectures())}")
    if out is not None and out.exists() and not out.is_dir():
        fail(f"--out {str(out)!r} exists and is not a folder")
    dev = parse_device(device)
    overrides = _parse_config(config)
    try:
        tokens = rm.ByteTokenizer().encode_file(data)
    except (FileNotFoundError, IsADirectoryError, PermissionError, ValueError) as e:
        fail(f"--data: {e}")
    if tokens.size < seq_len + 1:
        fail(
            f"--data {str(data)!r} has {tokens.size} bytes: at least --seq-len + 1 = "
            f"{seq_len + 1} are needed"
        )

    resumed_from = 0
    if resume:
        assert out is not None
        folder = checkpoint_folder(out, "--out")
        try:
            ckpt = rm.load_checkpoint(folder)
        except (FileNotFoundError, ValueError) as e:
            fail(f"--resume: {e}")
        arch = str(ckpt["config"]["arch"])
        if model is not None and model != arch:
            fail(f"--model {model} does not match the checkpoint in {str(folder)!r} ({arch})")
        if overrides:
            fail("--config cannot change the model of a run being resumed")
        net, model = ckpt["model"], arch
    else:
        assert model is not None
        try:
            net = rm.create(model, seed=seed, **overrides)
        except (TypeError, ValueError) as e:
            fail(f"cannot create a {model} model with --config {' '.join(config)}: {e}")
    try:
        net.to(dev)
    except ValueError as e:
        fail(str(e), EXIT_UNAVAILABLE)
    opt = recurra_optim.AdamW(list(net.parameters()), lr=lr, weight_decay=0.01)
    try:
        trainer = rm.Trainer(
            net,
            opt,
            tokens,
            batch_size=batch_size,
            seq_len=seq_len,
            steps=steps,
            out_dir=out,
            checkpoint_every=checkpoint_every,
            seed=seed,
            log_every=0,  # the bar shows the progress
        )
        if resume:
            resumed_from = trainer.resume(out)
    except (FileNotFoundError, ValueError) as e:
        fail(f"--resume: {e}" if resume else str(e))
    if resumed_from >= steps:
        fail(
            f"the checkpoint in {str(out)!r} is at step {resumed_from} of --steps {steps}: "
            "raise --steps to train further"
        )

    n_params = sum(int(p.size) for p in net.parameters())
    if not as_json:
        console.print(
            f"[bold]Training {model}[/] ({n_params:,} parameters) on {dev}: {tokens.size:,} "
            f"bytes of {escape(str(data))}, batch {batch_size} x {seq_len} tokens, steps "
            f"{resumed_from + 1}..{steps}" + (f", checkpoints in {escape(str(out))}" if out else "")
        )
    records: list[dict[str, Any]] = []
    stop = _StopOnInterrupt()
    t0 = time.perf_counter()
    with (
        Progress(
            TextColumn("  step"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            disable=as_json,
        ) as progress,
        stop,
    ):
        task = progress.add_task("train", total=steps, completed=resumed_from, loss="-")

        def on_event(ev: dict[str, Any]) -> bool:
            if ev.get("kind") == "step":
                records.append(ev)
                progress.update(task, completed=ev["step"], loss=f"{ev['loss']:.4f}")
            return not stop.requested

        try:
            trainer.fit(callback=on_event)
        except FloatingPointError as e:
            fail(f"training diverged: {e} (try a smaller --lr)", EXIT_CHECK_FAILED)
        except (ValueError, RuntimeError, TypeError) as e:
            # not a usage error (arguments were checked above): the model or the device
            # failed; say where, without a traceback
            step = resumed_from + len(records) + 1
            fail(f"training failed at step {step} on {dev}: {e}", EXIT_CHECK_FAILED)
    seconds = time.perf_counter() - t0
    losses = [float(r["loss"]) for r in records]
    done = len(records)
    result = {
        "model": model,
        "config": _config_dict(net),
        "device": dev,
        "parameters": n_params,
        "data": str(data),
        "data_bytes": int(tokens.size),
        "steps": steps,
        "resumed_from": resumed_from,
        "last_step": resumed_from + done,
        "interrupted": stop.requested,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "losses": losses,
        "seconds": seconds,
        "tokens_per_s": done * batch_size * seq_len / seconds if seconds > 0 else None,
        "out": str(out) if out is not None else None,
    }
    if as_json:
        print(dumps(result))
    else:
        if losses:
            console.print(
                f"  loss {losses[0]:.4f} -> {losses[-1]:.4f} in {done} steps, {seconds:.1f} s "
                f"({result['tokens_per_s']:.0f} tokens/s)"
            )
        if stop.requested:
            console.print(f"  [yellow]interrupted after step {resumed_from + done}[/]")
        if out is not None:
            console.print(
                f"  checkpoint: {escape(str(out))}  (recurra generate --checkpoint "
                f"{escape(str(out))} --prompt ...; "
                "continue with --resume)"
            )
        else:
            console.print("  [yellow]no --out: nothing was saved[/]")
    raise typer.Exit(EXIT_OK)


def checkpoint_folder(path: Path, option: str) -> Path:
    """The checkpoint folder ``path`` names: itself (it holds ``trainer.json``) or, for a
    training ``--out`` folder, the one its ``latest.json`` points to. Exits 2 otherwise."""
    if not path.exists():
        fail(f"{option} {str(path)!r} does not exist")
    if not path.is_dir():
        fail(f"{option} {str(path)!r} is not a folder")
    if (path / "trainer.json").is_file():
        return path
    latest = path / "latest.json"
    if latest.is_file():
        try:
            name = json.loads(latest.read_text())["path"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail(f"{option}: {latest} is unreadable ({e})")
        return path / str(name)
    fail(
        f"{option} {str(path)!r} holds no checkpoint (no trainer.json, no latest.json): "
        "give a folder written by `recurra train --out`"
    )


class _StopOnInterrupt:
    """While active, the first Ctrl-C asks the loop to stop after the current step (the
    trainer then writes a checkpoint); a second one interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._old: Any = None

    def __enter__(self) -> _StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _config_dict(net: Any) -> dict[str, Any] | None:
    cfg = getattr(net, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    return to_dict() if callable(to_dict) else None

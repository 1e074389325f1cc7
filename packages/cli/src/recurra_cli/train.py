"""``recurra train``: trains a byte-level language model on a text file, with checkpoints.

Built on recurra-models (``recurra-cli[models]``): the model comes from
``recurra_models.create(arch, **config)``, the loop is ``recurra_models.Trainer`` with an
AdamW optimizer, checkpoints are ``recurra_models.save_checkpoint`` folders (so that
``recurra generate --checkpoint DIR`` and ``--resume`` can read them).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
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
from recurra_cli import text as text_io
from recurra_cli._common import (
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    console,
    dumps,
    fail,
)

INSTALL_HINT = install_hint("recurra-cli[models]")
DIST_HINT = install_hint("recurra-cli[dist]")

#: The MPI context of this process when `recurra train` runs as one rank of several (see
#: :func:`end_job`), else None.
DIST_CONTEXT: Any = None


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
        help="mamba, mamba2, rwkv6, rwkv7 or a preset of a published size (mamba-130m, "
        "mamba2-130m, rwkv7-0.1b) for a fresh model, or a path: a transformers folder or an "
        "RWKV checkpoint to fine-tune (with --resume: read from the checkpoint)",
    ),
    data: list[Path] = typer.Option(
        ..., "--data", help="text to train on: .txt or .jsonl files (repeatable)"
    ),
    eval_data: list[Path] = typer.Option(
        [], "--eval-data", help="held-out text: validation loss and perplexity (repeatable)"
    ),
    text_field: str = typer.Option("text", "--text-field", help="the text field of .jsonl"),
    tokenizer: str | None = typer.Option(
        None, "--tokenizer", help="bytes or a tokenizer path (default: the model's own, or bytes)"
    ),
    device: str = typer.Option("cpu", "--device", help="cpu or vulkan[:N]"),
    steps: int = typer.Option(200, "--steps", min=1, help="optimizer steps in total"),
    batch_size: int = typer.Option(
        8, "--batch-size", min=1, help="sequences per step (over all processes)"
    ),
    seq_len: int = typer.Option(64, "--seq-len", min=2, help="tokens per sequence"),
    lr: float = typer.Option(3e-3, "--lr", help="AdamW learning rate (finite, >= 0)"),
    seed: int = typer.Option(0, "--seed", help="initialisation and batch seed"),
    config: list[str] = typer.Option(
        [], "--config", metavar="KEY=VALUE", help="model size, e.g. d_model=32 (repeatable)"
    ),
    out: Path | None = typer.Option(
        None, "--out", help="checkpoint folder (written every --checkpoint-every steps)"
    ),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every", min=1),
    resume: bool = typer.Option(False, "--resume", help="continue from the checkpoint in --out"),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="start a new run in an --out folder that holds an earlier one"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of bars"),
    gradient_checkpointing: bool = typer.Option(
        False,
        "--gradient-checkpointing",
        help="recompute each block's forward in the backward instead of keeping it (less memory)",
    ),
    precision: str = typer.Option(
        "fp32",
        "--precision",
        help="fp32, bf16 or f16: mixed precision (matmuls and elementwise work in the 2-byte "
        "dtype, scans/norms/losses in float32, float32 master weights; f16 with a dynamic "
        "loss scale); checkpoints stay float32",
    ),
    capture: bool = typer.Option(
        True,
        "--capture/--no-capture",
        help="run each step's forward and backward from the captured plan instead of "
        "recording the model's ops again (recurra.capture; the same results, less host time)",
    ),
    nproc: int = typer.Option(
        1,
        "--nproc",
        min=1,
        help="data-parallel on N processes of this host (launches mpiexec; needs recurra-dist)",
    ),
) -> None:
    """Train a Mamba / Mamba-2 / RWKV-6 / RWKV-7 language model on text, or fine-tune one.

    --model PATH loads a pretrained model with its tokenizer; a preset trains a fresh one on
    bytes (or --tokenizer). The data is tokenized once into a token file cached in
    --out/tokens. The loss is next-token cross-entropy (a byte model that learned nothing
    scores ln 256 = 5.55).
    Batches depend only on (seed, step), so a run resumed with --resume reproduces the loss
    curve of an uninterrupted one. An --out folder holding an earlier run is refused unless
    --resume or --overwrite is given. Ctrl-C stops after the current step, writes a
    checkpoint and exits 130. Exit 2 for a missing or unusable data file, an --out folder
    that cannot be written or bad arguments, 3 when recurra-models or the device is
    unavailable, 1 when training fails (the loss diverges, the model fails on the device,
    memory runs out).

    Data-parallel (recurra-cli[dist]): `mpiexec -n N recurra train ...` (any MPI launcher,
    several hosts with a hostfile) or `recurra train --nproc N ...` (one host) trains on N
    processes, each on its share of every batch (--batch-size is the global batch: N must
    divide it), with the gradients averaged across them; --device vulkan gives process i
    vulkan:<i % GPUs>. Rank 0 prints and writes the checkpoints; --resume works with
    another N. A process that fails ends them all.
    """
    world = _world_size()
    if nproc > 1 and world == 1:
        raise typer.Exit(_launch(nproc))
    if nproc > 1 and nproc != world:
        fail(f"--nproc {nproc} inside an MPI job of {world} processes: drop --nproc")
    ctx = _init_dist() if world > 1 else None
    main_rank = ctx is None or ctx.rank == 0
    as_json = as_json or not main_rank  # only rank 0 prints: quiet elsewhere
    rm = require_models("train", ("Trainer", "create", "ByteTokenizer", "load_checkpoint"))
    import recurra_optim

    if resume and out is None:
        fail("--resume needs --out DIR (the folder to resume from)")
    known = [*rm.architectures(), *rm.presets()]
    if not resume and model is None:
        fail(f"--model is required: one of {', '.join(known)}, or a path")
    pretrained = model is not None and model not in known and Path(model).exists()
    if model is not None and model not in known and not pretrained:
        fail(f"unknown --model {model!r}: one of {', '.join(known)}, or a path")
    if not math.isfinite(lr) or lr < 0:
        fail(f"--lr must be a finite number >= 0, got {lr}")
    if precision.lower() not in ("fp32", "float32", "bf16", "bfloat16", "f16", "fp16", "float16"):
        fail(f"--precision must be fp32, bf16 or f16, got {precision!r}")
    if resume and overwrite:
        fail("--resume and --overwrite exclude each other: continue the run, or replace it")
    if out is not None and out.exists() and not out.is_dir():
        fail(f"--out {str(out)!r} exists and is not a folder")
    if out is not None and not resume and not overwrite:
        earlier = [n for n in ("latest.json", "trainer.json") if (out / n).is_file()]
        if earlier:
            fail(
                f"--out {str(out)!r} holds an earlier run ({earlier[0]}): pass --resume to "
                "continue it or --overwrite to replace it, or choose another --out"
            )
    dev = parse_device(device) if ctx is None else _rank_device(ctx, device)
    overrides = _parse_config(config)
    for flag, files in (("--data", data), ("--eval-data", eval_data)):
        for f in files:
            if not f.is_file():
                fail(f"{flag}: {f}: data file not found")

    resumed_from = 0
    if resume:
        assert out is not None
        folder = checkpoint_folder(out, "--out")
        try:
            ckpt = rm.load_checkpoint(folder)
        except (FileNotFoundError, ValueError) as e:
            fail(f"--resume: {e}")
        arch = str(ckpt["config"]["arch"])
        from recurra_models.presets import resolve

        if model is not None and not pretrained and resolve(model, {})[0] != arch:
            fail(f"--model {model} does not match the checkpoint in {str(folder)!r} ({arch})")
        if overrides:
            fail("--config cannot change the model of a run being resumed")
        net, model = ckpt["model"], arch
        tok = text_io.pick_tokenizer(rm, tokenizer, text_io.find_tokenizer_in(rm, out))
    elif pretrained:
        assert model is not None
        if overrides:
            fail("--config cannot change the size of a pretrained --model")
        net, tok0, model = text_io.load_model(rm, model)
        tok = text_io.pick_tokenizer(rm, tokenizer, tok0)
    else:
        assert model is not None
        tok = text_io.pick_tokenizer(rm, tokenizer, None)
        if tok.vocab_size != 256 and "vocab_size" not in overrides:
            overrides["vocab_size"] = int(tok.vocab_size)
        try:
            net = rm.create(model, seed=seed, **overrides)
        except (TypeError, ValueError) as e:
            fail(f"cannot create a {model} model with --config {' '.join(config)}: {e}")
    text_io.check_vocab(tok, net)
    if out is not None:
        check_writable(out, "--out")  # now: its token cache, and not after the training
    cache = out / "tokens" if out is not None else None
    if ctx is not None and not main_rank:
        ctx.barrier()  # rank 0 tokenizes into the cache first
    tokens = text_io.load_tokens(rm, data, tok, cache, text_field, "--data", as_json)
    if tokens.size < seq_len + 1:
        fail(f"--data has {tokens.size} tokens: at least --seq-len + 1 = {seq_len + 1} are needed")
    held_out = None
    if eval_data:
        held_out = text_io.load_tokens(
            rm, eval_data, tok, cache, text_field, "--eval-data", as_json
        )
        if held_out.size < seq_len + 1:
            fail(f"--eval-data has {held_out.size} tokens: at least {seq_len + 1} are needed")
    if out is not None and main_rank:
        text_io.save_run_tokenizer(tok, out)
    if ctx is not None and main_rank:
        ctx.barrier()
    try:
        net.to(dev)
    except ValueError as e:
        fail(str(e), EXIT_UNAVAILABLE)
    opt = recurra_optim.AdamW(list(net.parameters()), lr=lr, weight_decay=0.01)
    parallel = None
    if ctx is not None:
        import recurra_dist

        if batch_size % ctx.world_size:
            fail(f"--batch-size {batch_size} is not a multiple of the {ctx.world_size} processes")
        parallel = recurra_dist.DataParallel(net, opt, ctx)
    try:
        trainer = rm.Trainer(
            net,
            opt,
            tokens,
            batch_size=batch_size,
            seq_len=seq_len,
            steps=steps,
            eval_data=held_out,
            eval_every=checkpoint_every,
            out_dir=out,
            checkpoint_every=checkpoint_every,
            seed=seed,
            gradient_checkpointing=gradient_checkpointing,
            log_every=0,  # the bar shows the progress
            parallel=parallel,
            precision=precision,
            capture=capture,
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
    where = dev if ctx is None else f"{ctx.world_size} processes ({dev} on rank 0)"
    if not as_json:
        console.print(
            f"[bold]Training {model}[/] ({n_params:,} parameters) on {where}: {tokens.size:,} "
            f"tokens of {escape(', '.join(map(str, data)))}, batch {batch_size} x {seq_len} "
            "tokens, steps "
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
            TextColumn("loss {task.fields[loss]}{task.fields[val]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            disable=as_json,
        ) as progress,
        stop,
    ):
        task = progress.add_task("train", total=steps, completed=resumed_from, loss="-", val="")
        evals: list[dict[str, Any]] = []

        def on_event(ev: dict[str, Any]) -> bool:
            if ev.get("kind") == "step":
                records.append(ev)
                progress.update(task, completed=ev["step"], loss=f"{ev['loss']:.4f}")
            elif ev.get("kind") == "eval":
                v = float(ev["eval_loss"])
                evals.append({"step": ev["step"], "loss": v, "perplexity": math.exp(min(v, 700))})
                progress.update(task, val=f"  val {v:.4f} ppl {evals[-1]['perplexity']:.2f}")
            return not stop.requested

        try:
            trainer.fit(callback=on_event)
        except KeyboardInterrupt:
            fail(
                f"interrupted at once after step {resumed_from + len(records)} (a second "
                "Ctrl-C): the last checkpoint written is kept",
                EXIT_INTERRUPTED,
            )
        except FloatingPointError as e:
            fail(f"training diverged: {e} (try a smaller --lr)", EXIT_CHECK_FAILED)
        except MemoryError:
            fail(
                f"out of memory at step {resumed_from + len(records) + 1} with --batch-size "
                f"{batch_size} x --seq-len {seq_len}: use smaller ones",
                EXIT_CHECK_FAILED,
            )
        except OSError as e:
            fail(f"cannot write the checkpoint: {e}", EXIT_CHECK_FAILED)
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
        "data": [str(d) for d in data],
        "data_tokens": int(tokens.size),
        "tokenizer": type(tok).__name__,
        "eval": evals,
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
        "processes": ctx.world_size if ctx is not None else 1,
        "precision": trainer.precision,
        "skipped_steps": sum(1 for r in records if r.get("skipped")),
        "exchange_s_per_step": (
            sum(float(r.get("exchange_s", 0.0)) for r in records) / done
            if ctx is not None and done
            else None
        ),
    }
    if not main_rank:
        pass
    elif as_json:
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
    raise typer.Exit(EXIT_INTERRUPTED if stop.requested else EXIT_OK)


def _world_size() -> int:
    """The number of processes of the MPI job this one belongs to (1 outside mpiexec, or
    when recurra-dist is not installed)."""
    try:
        from recurra_dist import launched_world_size
    except ImportError:
        return 1
    return launched_world_size()


def _init_dist() -> Any:
    """Starts MPI for this rank: a failure on any rank now ends every rank (see end_job)."""
    global DIST_CONTEXT
    try:
        import recurra_dist
    except ImportError as e:
        fail(f"data-parallel training needs recurra-dist ({e}): {DIST_HINT}", EXIT_UNAVAILABLE)
    DIST_CONTEXT = recurra_dist.init()
    return DIST_CONTEXT


def _rank_device(ctx: Any, spec: str) -> str:
    """This rank's device: --device vulkan (no index) is vulkan:<local rank % GPUs>."""
    if spec.strip().lower() != "vulkan":
        return parse_device(spec)
    from recurra_dist import device_for

    try:
        return device_for(ctx.local_rank, "vulkan")
    except RuntimeError as e:
        fail(str(e), EXIT_UNAVAILABLE)


def end_job(code: Any) -> None:
    """Called with the exit status of the command: when this process is one rank of several
    and it fails (not 0, not an interrupt, which every rank sees), every rank of the job is
    ended (MPI_Abort) so that none waits for it for ever."""
    if DIST_CONTEXT is None or DIST_CONTEXT.world_size == 1:
        return
    if code in (None, 0, EXIT_OK, EXIT_INTERRUPTED):
        return
    from recurra_dist import abort

    abort(
        DIST_CONTEXT,
        f"recurra train exited with status {code}",
        code if isinstance(code, int) else 1,
    )


def _launch(nproc: int) -> int:
    """Runs this same command line as ``mpiexec -n nproc python -m recurra_cli ...`` (the
    --nproc option removed) and returns its exit status."""
    beside = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(beside) if beside.is_file() else shutil.which("mpiexec")
    if mpiexec is None:
        fail(f"--nproc needs mpiexec (an MPI library): {DIST_HINT}", EXIT_UNAVAILABLE)
    try:
        import recurra_dist  # noqa: F401
    except ImportError as e:
        fail(f"--nproc needs recurra-dist ({e}): {DIST_HINT}", EXIT_UNAVAILABLE)
    args: list[str] = []
    skip = False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            args.append(a)
    cmd = [mpiexec, "-n", str(nproc), sys.executable, "-m", "recurra_cli", *args]
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the ranks, not us
    try:
        return subprocess.run(cmd, env=dict(os.environ)).returncode
    finally:
        signal.signal(signal.SIGINT, old)


def check_writable(folder: Path, option: str) -> None:
    """Creates ``folder`` if needed and checks a file can be written in it; exits 2 naming
    the folder otherwise (a read-only folder, a path under /proc...)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".recurra-write-check-"):
            pass
    except OSError as e:
        fail(f"{option} {str(folder)!r} is not a writable folder: {e.strerror or e}")


def checkpoint_folder(path: Path, option: str) -> Path:
    """The checkpoint folder ``path`` names: itself (it holds ``trainer.json``) or, for a
    training ``--out`` folder, the one its ``latest.json`` points to. Exits 2 otherwise."""
    if not path.exists():
        fail(f"{option} {str(path)!r} does not exist")
    if not path.is_dir():
        fail(f"{option} {str(path)!r} is not a folder")
    if (path / "trainer.json").is_file() or (path / "latest.json").is_file():
        from recurra_models.training import latest_checkpoint

        try:
            return latest_checkpoint(path)
        except (OSError, ValueError) as e:
            fail(f"{option}: {e}")
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

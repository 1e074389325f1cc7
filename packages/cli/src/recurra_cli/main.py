"""The ``recurra`` command.

Exit codes: 0 success; 1 the work ran but failed its check (a FAIL/WEAK verdict, a backend
MISMATCH); 2 bad usage (bad arguments or paths); 3 a requested backend or component is
unavailable.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from recurra._install import install_hint
from recurra_cli import bench as bench_cmd
from recurra_cli import check as check_cmd
from recurra_cli import demo_mamba
from recurra_cli import generate as generate_cmd
from recurra_cli import text as text_cmd
from recurra_cli import train as train_cmd
from recurra_cli._common import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    console,
    dumps,
    err,
    help_text,
    one_line_usage_errors,
)
from recurra_cli._common import fail as _fail

app = typer.Typer(
    name="recurra",
    help="Train and run Mamba and RWKV models on any machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)
one_line_usage_errors()
demo_app = typer.Typer(help="End-to-end demos.", no_args_is_help=True)
app.add_typer(demo_app, name="demo")


#: The distributions `recurra --version` reports, the command's own first.
DISTRIBUTIONS = (
    "recurra-cli",
    "recurra-core",
    "recurra-optim",
    "recurra-models",
    "recurra-dist",
    "recurra-vulkan",
)


def versions() -> dict[str, str | None]:
    """Distribution -> installed version (None when not installed)."""
    out: dict[str, str | None] = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _print_version(value: bool) -> None:
    if value:
        found = versions()
        rest = ", ".join(f"{d} {v or 'not installed'}" for d, v in found.items())
        print(f"recurra {found['recurra-cli'] or '?'} ({rest})")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        "-V",
        callback=_print_version,
        is_eager=True,
        help="print the version of each recurra package and exit",
    ),
) -> None:
    """Train and run Mamba and RWKV models on any machine."""


def _available_backends() -> dict[str, str]:
    """Backend name -> "" when usable, or the reason it is not."""
    import recurra.backends

    return {b.name: ("" if b.available else b.reason) for b in recurra.backends.available()}


@demo_app.command("mamba-train")
def mamba_train(
    backend: str = typer.Option("cpu", help="cpu, vulkan, or both (trains on each and compares)"),
    small: bool = typer.Option(False, "--small", help="tiny sizes: a quick check in a second"),
    epochs: int | None = typer.Option(None, min=1, help="epochs (default 60, or 40 with --small)"),
    plot: Path | None = typer.Option(None, help="write the loss curves to this PNG file"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of tables"),
) -> None:
    """Train a Mamba-style block (ssm_conv -> ssm_scan -> MSE) and report whether it learned.

    The target at every position is the running mean of the inputs so far: only a layer
    that carries state across time can fit it. Verdict OK means the final loss is below
    half of the predict-zero baseline. With --backend both, the CPU run also has the Vulkan
    backend compute the loss and gradients at the same parameters and batch every step
    (lockstep): their largest relative gap decides AGREE or MISMATCH (the free-running
    curves are shown too, but chaotic training parts them by rounding alone).
    """
    backend = backend.lower()
    if backend not in ("cpu", "vulkan", "both"):
        _fail(f"--backend must be cpu, vulkan or both, not {backend!r}")
    if plot is not None:
        if plot.suffix.lower() != ".png":
            _fail(f"--plot needs a .png file name, got {str(plot)!r}")
        if not plot.parent.exists() if str(plot.parent) else False:
            _fail(f"--plot: directory {str(plot.parent)!r} does not exist")
        _require_matplotlib()  # before training, not after it
    cfg = demo_mamba.DemoConfig.small(epochs) if small else demo_mamba.DemoConfig()
    if epochs is not None and not small:
        cfg = demo_mamba.DemoConfig(epochs=epochs)

    status = _available_backends()
    runs = ["cpu"] if backend in ("cpu", "both") else []
    notes: list[str] = []
    if backend in ("vulkan", "both"):
        why = status.get("vulkan", "the recurra-vulkan package is not installed")
        if why:
            if backend == "vulkan":
                _fail(f"the Vulkan backend is unavailable: {why}", EXIT_UNAVAILABLE)
            notes.append(f"No Vulkan device ({why}): running the CPU pass only.")
        else:
            runs.append("vulkan")

    quiet = as_json
    if not quiet:
        console.print("[bold]Training a Mamba-style block (ssm_conv -> ssm_scan)[/]")
        console.print(
            f"  d_state={cfg.d_state} head_dim={cfg.head_dim} n_head={cfg.n_head} "
            f"d_inner={cfg.d_inner} tokens={cfg.n_tok} samples={cfg.n_samples} epochs={cfg.epochs}"
        )
        for n in notes:
            console.print(f"  [yellow]{n}[/]")

    results = []
    for name in runs:
        if not quiet:
            console.print(f"\n[bold]=== {name.upper()} ===[/]")
        with Progress(
            TextColumn("  {task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=quiet,
            transient=False,
        ) as progress:
            task = progress.add_task("epoch", total=cfg.epochs)

            def on_epoch(ep: int, loss: float, _task: TaskID = task) -> None:
                progress.update(_task, completed=ep, description=f"loss {loss:.5f}")

            # the first run of two has the second backend follow it in lockstep
            shadow = runs[1] if len(runs) == 2 and name == runs[0] else None
            try:
                res = demo_mamba.train(cfg, name, on_epoch, shadow=shadow)
            except ValueError as e:
                _fail(str(e), EXIT_UNAVAILABLE)
        results.append(res)
        if not quiet:
            where = " | ".join(f"{k} -> {v}" for k, v in res.placement.items())
            console.print(f"  placement: {where}   splits={res.n_splits}")
            step = max(1, cfg.epochs // 8)
            for i, h in enumerate(res.history, start=1):
                if i == 1 or i % step == 0 or i == cfg.epochs:
                    console.print(f"  epoch {i:3d}   loss {h:.5f}")
            console.print(
                f"  {res.seconds:.1f} s total, {res.seconds / cfg.epochs:.3f} s per epoch"
            )

    baseline = demo_mamba.make_problem(cfg)[2]
    comparison = demo_mamba.compare(results[0], results[1]) if len(results) == 2 else None
    ok = all(r.verdict == "OK" for r in results) and (
        comparison is None or comparison["status"] == "AGREE"
    )

    if as_json:
        out = {
            "config": demo_mamba.config_dict(cfg),
            "baseline": baseline,
            "notes": notes,
            "runs": [
                {
                    "backend": r.backend,
                    "first_loss": r.history[0],
                    "final_loss": r.history[-1],
                    "final_pct_of_zero": r.final_pct_of_zero,
                    "seconds": r.seconds,
                    "verdict": r.verdict,
                    "placement": r.placement,
                    "n_splits": r.n_splits,
                    "history": r.history,
                }
                for r in results
            ],
            "comparison": comparison,
            "ok": ok,
        }
        print(dumps(out))
    else:
        console.print(f"\n  predicting zero scores {baseline:.4f}: the number to beat")
        table = Table(title="comparison")
        for col in ("backend", "first loss", "final loss", "% of zero", "sec", "verdict"):
            table.add_column(col, justify="right" if col not in ("backend", "verdict") else "left")
        for r in results:
            table.add_row(
                r.backend,
                f"{r.history[0]:.4f}",
                f"{r.history[-1]:.4f}",
                f"{r.final_pct_of_zero:.1f}%",
                f"{r.seconds:.1f}",
                r.verdict,
            )
        console.print(table)
        if comparison is not None:
            console.print(
                f"free-running curves, per-epoch relative gap: max "
                f"{comparison['max_rel_gap']:.3g}, median {comparison['median_rel_gap']:.3g}"
            )
            lock = comparison["lockstep"]
            if lock is not None:
                gaps = ", ".join(f"{k} {v:.2g}" for k, v in lock["max_rel_gap"].items())
                console.print(
                    f"lockstep ({lock['steps']} steps at the same parameters), largest "
                    f"relative gap: {gaps} (tolerance {lock['tol']:.0e})"
                )
            console.print(f"[bold]{comparison['status']}[/]")
    if plot is not None:
        _plot(results, baseline, plot)
    raise typer.Exit(EXIT_OK if ok else EXIT_CHECK_FAILED)


def _require_matplotlib() -> None:
    """Exits 3 saying how to install matplotlib when it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _fail(f"--plot needs matplotlib: {install_hint('matplotlib')}", EXIT_UNAVAILABLE)


def _plot(results: list[demo_mamba.RunResult], baseline: float, path: Path) -> None:
    _require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(range(1, len(r.history) + 1), r.history, label=f"{r.backend} ({r.verdict})")
    ax.axhline(baseline, color="gray", linestyle="--", label="predict zero")
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean squared error")
    ax.set_yscale("log")
    ax.set_title("Mamba block training")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        _fail(f"--plot: cannot write {str(path)!r}: {e.strerror or e}")
    finally:
        plt.close(fig)


@app.command()
def devices(as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """List backends, their devices and memory, and why a plugin is unavailable."""
    import recurra
    import recurra.backends

    infos = recurra.backends.available()
    if as_json:
        print(
            dumps(
                [
                    {
                        "name": b.name,
                        "available": b.available,
                        "devices": b.devices,
                        "reason": b.reason,
                        "source": b.source,
                        "installed": getattr(b, "installed", True),
                    }
                    for b in infos
                ]
            )
        )
        return
    table = Table(title=f"recurra {recurra.__version__} backends")
    for col in ("backend", "status", "device", "memory", "details"):
        table.add_column(col)
    for b in infos:
        if not b.available:
            status = "[red]unavailable[/]" if getattr(b, "installed", True) else "not installed"
            table.add_row(b.name, status, "-", "-", escape(b.reason))
            continue
        for d in b.devices:
            mem = d.get("memory_bytes", 0)
            details = ", ".join(
                f"{k}={v}" for k, v in d.items() if k not in ("name", "memory_bytes", "index")
            )
            table.add_row(
                b.name,
                "[green]ok[/]",
                f"{d.get('index', 0)}: {d.get('name', '?')}",
                f"{mem / 2**30:.1f} GiB" if mem else "-",
                details,
            )
    console.print(table)


app.command("check-backends", help=help_text(check_cmd.check_backends.__doc__))(
    check_cmd.check_backends
)
app.command(
    "bench",
    help=help_text(bench_cmd.bench.__doc__),
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)(bench_cmd.bench)

app.command("train", help=help_text(train_cmd.train.__doc__))(train_cmd.train)
app.command("generate", help=help_text(generate_cmd.generate.__doc__))(generate_cmd.generate)
app.command("eval", help=help_text(text_cmd.evaluate.__doc__))(text_cmd.evaluate)
app.command("export", help=help_text(text_cmd.export.__doc__))(text_cmd.export)


def _load_plugins() -> None:
    """Sub-apps contributed by other packages through the ``recurra.cli`` entry point."""
    try:
        eps = metadata.entry_points(group="recurra.cli")
    except Exception:  # noqa: BLE001
        return
    for ep in eps:
        try:
            sub = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin must not break the command
            err.print(f"[yellow]warning:[/] recurra.cli plugin {ep.name!r} failed to load: {e}")
            continue
        if isinstance(sub, typer.Typer):
            app.add_typer(sub, name=ep.name)


_load_plugins()


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except SystemExit as e:
        train_cmd.end_job(e.code)  # one rank of a data-parallel job failing ends them all
        raise


if __name__ == "__main__":
    main()

"""``recurra check-backends``: every op on every device backend against the CPU.

A front end to :mod:`recurra.check_backends` (the comparison and the placement proof live
there, the cases in the registry :mod:`recurra.opcases`; ``python -m recurra.check_backends``
is the same check without rich).
"""

from __future__ import annotations

import math

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from recurra_cli._common import EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE, console, dumps, err, fail

_STYLE = {"ok": "green", "unsupported": "yellow", "MISMATCH": "bold red", "ERROR": "bold red"}


def _err_text(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    return f"{v:.2e}" if math.isfinite(v) else ("nan" if math.isnan(v) else "inf")


def _list_cases() -> None:
    from recurra import check_backends as cb

    table = Table(title="check-backends cases")
    for col in ("op", "case", "fwd bound", "grad bound", "note"):
        table.add_column(col, no_wrap=col != "note")
    for c in cb.cases():
        table.add_row(
            c.op, c.name, f"{c.forward_tol:g}", f"{c.grad_tol:g}" if c.grad else "-", c.note
        )
    console.print(table)
    for name, why in cb.NOT_COVERED.items():
        console.print(f"[dim]not covered: {name}: {why}[/]")


def check_backends(
    op: list[str] = typer.Option(
        [], "--op", metavar="NAME", help="only this op (exact name; repeatable)"
    ),
    backend: list[str] = typer.Option(
        [],
        "--backend",
        metavar="NAME",
        help="only this backend or device (vulkan, vulkan:0; repeatable); cpu: a self-test",
    ),
    strict: bool = typer.Option(
        False, "--strict", help="a case that fell back to the CPU fails the run"
    ),
    allow_cpu_only: bool = typer.Option(
        False, "--allow-cpu-only", help="exit 0 (not 3) when there is no device backend"
    ),
    list_cases: bool = typer.Option(False, "--list", help="list the cases and exit"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of tables"),
) -> None:
    """Run every op on each device backend and compare it with the CPU (forward and
    gradients, normalized MSE), showing where each case ran.

    Verdicts: ok (every node ran on the backend and agrees), unsupported (some nodes fell
    back to the CPU), MISMATCH, ERROR. Exit 0 when nothing mismatched (with --strict:
    everything ok), 1 on a mismatch or error, 2 for an unknown op or backend, 3 when no
    backend other than the CPU is available.
    """
    from recurra import check_backends as cb

    if list_cases:
        _list_cases()
        raise typer.Exit(EXIT_OK)
    try:
        selected = cb.select_cases(op)
        devices = cb.resolve_backends(backend)
    except (cb.UnknownOpError, cb.UnknownBackendError) as e:
        fail(str(e), EXIT_USAGE)
    except cb.BackendUnavailableError as e:
        fail(str(e), EXIT_UNAVAILABLE)
    if not devices:
        msg = cb.no_device_message()
        code = EXIT_OK if allow_cpu_only else EXIT_UNAVAILABLE
        if as_json:
            doc = cb.to_json([], [], code)
            doc["message"] = msg
            print(dumps(doc))
            raise typer.Exit(code)
        if code == EXIT_OK:
            err.print(f"[yellow]note:[/] {msg}")
            raise typer.Exit(code)
        fail(msg, code)

    with Progress(
        TextColumn("  {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=as_json,
        transient=True,
    ) as progress:
        task = progress.add_task("checking", total=len(selected) * len(devices))

        def on_result(r: cb.CaseResult) -> None:
            progress.update(task, advance=1, description=f"{r.backend} {r.op}/{r.case}")

        results = cb.check(op, devices, on_result=on_result)
    code = cb.exit_code(results, strict)
    if as_json:
        print(dumps(cb.to_json(results, devices, code)))
        raise typer.Exit(code)

    one = len(devices) == 1  # then the backend is in the title, not in a column
    table = Table(title=f"ops on {', '.join(devices)} against the CPU")
    cols = ["op", "case", *([] if one else ["backend"]), "fwd NMSE", "grad NMSE", "placement"]
    for col in [*cols, "verdict"]:
        table.add_column(
            col, justify="right" if "NMSE" in col else "left", no_wrap=col != "placement"
        )
    for r in results:
        style = _STYLE.get(r.verdict, "")
        table.add_row(
            r.op,
            r.case,
            *([] if one else [r.backend]),
            _err_text(r.forward_nmse),
            _err_text(r.grad_nmse),
            ", ".join(f"{b} {n}" for b, n in r.placement.items()) or "-",
            f"[{style}]{r.verdict}[/]" if style else r.verdict,
        )
    console.print(table)
    for r in results:
        if r.verdict != "ok" and r.message:
            console.print(f"  {r.op}/{r.case} on {r.backend}: {escape(r.message)}")
    counts = cb.summary(results)
    verdict = "[green]PASS[/]" if code == EXIT_OK else "[bold red]FAIL[/]"
    console.print(
        ", ".join(f"{n} {v}" for v, n in counts.items())
        + f"  (bounds: forward {cb.FORWARD_NMSE_MAX:g}, gradients {cb.GRAD_NMSE_MAX:g} unless "
        f"a case says otherwise; --strict: {'on' if strict else 'off'}) -> {verdict}"
    )
    raise typer.Exit(code)

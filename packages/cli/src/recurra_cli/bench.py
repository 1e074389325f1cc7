"""``recurra bench``: runs the benchmark suites of the repository's ``bench/`` folder.

The suites are scripts of the source tree, not of the installed package (they are not
shipped with it), so the folder is always given explicitly with ``--bench-dir``: nothing is
run from a ``bench/`` found by walking up from the current directory, which could be anyone's
code. ``bench/core.py`` (ops), ``bench/optim.py``, ``bench/recurrent.py`` and
``bench/models.py``. Each prints a
table of our times against the peers measured in the same process and ends with one line
``JSON {...}`` (see bench/common.py); arguments after ``--`` go to every suite
(``--threads``, ``--reps``, ``--only``...).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from recurra_cli._common import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, console, dumps, err, fail

#: Suite name -> script in bench/, in the order ``all`` runs them.
SUITES: dict[str, str] = {
    "ops": "core.py",
    "optim": "optim.py",
    "recurrent": "recurrent.py",
    "models": "models.py",
}
_MARKER = "common.py"  # every bench/ folder has it; a stray "bench" directory does not


def find_bench_dir(explicit: Path | None) -> Path:
    """The bench folder ``explicit`` names (the folder itself or a repository holding
    ``bench/``), as an absolute path.

    Raises FileNotFoundError when none is given (the benchmarks are not installed with the
    package) or the folder is not a bench folder."""
    if explicit is None:
        raise FileNotFoundError(
            "the benchmarks are not installed with recurra-cli: pass --bench-dir PATH, the "
            "bench/ folder of a recurra checkout (or the checkout itself)"
        )
    for cand in (explicit, explicit / "bench"):
        if (cand / _MARKER).is_file():
            return cand.resolve()
    raise FileNotFoundError(
        f"--bench-dir {str(explicit)!r} is not a bench folder (no {_MARKER} in it or in "
        f"its bench/ subfolder)"
    )


def _run_suite(script: Path, extra: list[str], quiet: bool) -> tuple[int, dict[str, Any] | None]:
    """Runs one suite script, echoing its output unless ``quiet`` (but not its machine-read
    ``JSON {...}`` line: ``--json`` collects those); returns its exit code and the parsed
    line (None when it printed none)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, str(script), *extra],
        cwd=str(script.parent.parent),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    result = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("JSON "):
            try:
                result = json.loads(line[5:])
            except json.JSONDecodeError:
                result = None
            continue
        if not quiet:
            print(line, end="", flush=True)
    return proc.wait(), result


def bench(
    ctx: typer.Context,
    suite: str = typer.Argument(
        "all", help="ops, optim, recurrent, models, or all", show_default=True
    ),
    bench_dir: Path | None = typer.Option(
        None,
        "--bench-dir",
        help="the bench/ folder of a recurra checkout, or the checkout (required: the "
        "benchmarks are not installed with the package)",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="print one JSON object with every suite's figures"
    ),
) -> None:
    """Run the benchmark suites of a recurra checkout's bench/ folder, given with
    --bench-dir (arguments after -- go to the suites, e.g.
    `recurra bench ops --bench-dir . -- --only matmul --reps 3`).

    The benchmarks are scripts of the source tree, not installed with the package, so the
    folder is never guessed. Exit 0 when every suite ran, 1 when one failed, 2 for bad usage
    (unknown suite, no --bench-dir, not a bench folder, or arguments a suite rejects).
    """
    name = suite.lower()
    if name not in (*SUITES, "all"):
        fail(f"unknown suite {suite!r}: choose one of {', '.join(SUITES)}, all")
    try:
        folder = find_bench_dir(bench_dir)
    except FileNotFoundError as e:
        fail(str(e))
    extra = list(ctx.args)
    chosen = list(SUITES) if name == "all" else [name]
    report: dict[str, Any] = {}
    codes: list[int] = []
    for s in chosen:
        script = folder / SUITES[s]
        if not script.is_file():
            if name != "all":
                fail(f"suite {s!r}: {script} not found (this checkout has no such benchmark)")
            report[s] = {"skipped": f"{script.name} not found"}
            if not as_json:
                err.print(f"[yellow]note:[/] skipping {s}: {escape(str(script))} not found")
            continue
        if not as_json:
            console.print(
                f"[bold]== recurra bench {s}: {escape(str(script))} {escape(' '.join(extra))}[/]"
            )
        try:
            code, result = _run_suite(script, extra, as_json)
        except OSError as e:
            fail(f"cannot run {script}: {e}", EXIT_CHECK_FAILED)
        codes.append(code)
        report[s] = {"exit_code": code, "result": result}
        if code != 0 and not as_json:
            err.print(f"[bold red]suite {s} exited with code {code}[/]")
    if any(c == EXIT_USAGE for c in codes):
        final = EXIT_USAGE  # argparse's exit code: the extra arguments were rejected
    elif any(c != 0 for c in codes):
        final = EXIT_CHECK_FAILED
    else:
        final = EXIT_OK
    if as_json:
        print(
            dumps({"bench_dir": str(folder), "args": extra, "suites": report, "exit_code": final})
        )
    raise typer.Exit(final)

"""What every ``recurra`` command shares: exit codes, the consoles, the usage-error exit."""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

#: 0 success; 1 the work ran but failed its check (a FAIL/WEAK verdict, a backend MISMATCH,
#: a benchmark that crashed); 2 bad usage (bad arguments or paths); 3 a requested backend or
#: component is unavailable (not installed, no device); 130 interrupted (Ctrl-C).
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
EXIT_INTERRUPTED = 130

console = Console(stderr=False)
err = Console(stderr=True, soft_wrap=True)  # messages hold paths: never hard-wrapped


def help_text(doc: str | None) -> str:
    """A docstring as command help: paragraphs kept, the line breaks inside each joined
    (Typer's rich help would otherwise print them as they are in the source)."""
    import inspect

    paras = inspect.cleandoc(doc or "").split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paras)


def fail(msg: str, code: int = EXIT_USAGE) -> NoReturn:
    """Prints ``error: msg`` on stderr (as plain text: brackets in paths or in
    ``pip install 'x[extra]'`` are not markup) and exits with ``code`` (a usage error by
    default)."""
    err.print(f"[bold red]error:[/] {escape(msg)}")
    raise typer.Exit(code)


def one_line_usage_errors() -> None:
    """Makes Typer print a usage error (a bad or missing option) as one ``error:`` line, like
    every other error of the command, instead of a usage text and a boxed panel.

    Typer formats these through ``typer.rich_utils.rich_format_error`` when rich is installed
    (a dependency of recurra-cli); without that hook Typer's own format stays."""
    try:
        from typer import rich_utils
    except ImportError:
        return
    if not hasattr(rich_utils, "rich_format_error"):
        return

    def one_line(e: Any) -> None:
        ctx = getattr(e, "ctx", None)
        path = getattr(ctx, "command_path", None)
        hint = f" (see `{path} --help`)" if path else ""
        err.print(f"[bold red]error:[/] {escape(e.format_message())}{escape(hint)}")

    rich_utils.rich_format_error = one_line  # type: ignore[assignment]  # typer's hook, replaced


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """``obj`` as strict JSON for ``--json``: a non-finite float (which JSON cannot hold;
    ``json.dumps`` would write ``Infinity``) becomes the string "inf", "-inf" or "nan"."""
    return json.dumps(_finite(obj), allow_nan=False)

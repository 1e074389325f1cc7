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
#: component is unavailable (not installed, no device).
EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3

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

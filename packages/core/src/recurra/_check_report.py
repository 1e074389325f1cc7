"""The text output and the command line of :mod:`recurra.check_backends` (its ``main``;
``python -m recurra.check_backends`` and ``recurra check-backends`` run the same check)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recurra.check_backends import CaseResult

# The verdict that needs no message (the same string as recurra.check_backends.OK).
OK = "ok"


def _cb() -> Any:
    """recurra.check_backends, imported when first used: it imports this module at its
    end, and ``python -m recurra.check_backends`` runs it as ``__main__`` first."""
    from recurra import check_backends

    return check_backends


__all__ = ["format_row", "format_table", "main"]

# ------------------------------------------------------------------------------------------
# text output
# ------------------------------------------------------------------------------------------
_HEADER = ("op", "case", "backend", "fwd NMSE", "grad NMSE", "placement", "verdict")
_WIDTHS = (18, 20, 9, 9, 9, 30, 11)


def _fmt_err(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    return f"{v:.2e}" if math.isfinite(v) else ("nan" if math.isnan(v) else "inf")


def _row(cells: Sequence[str]) -> str:
    return "  ".join(f"{c:<{w}}" for c, w in zip(cells, _WIDTHS)).rstrip()


def format_row(r: CaseResult) -> str:
    """One table line (and the message, indented, for a case that is not ok)."""
    line = _row(
        (
            r.op,
            r.case,
            r.backend,
            _fmt_err(r.forward_nmse),
            _fmt_err(r.grad_nmse),
            r.placement_text(),
            r.verdict,
        )
    )
    if r.verdict != OK and r.message:
        line += f"\n    {r.message}"
    return line


def format_table(results: Sequence[CaseResult]) -> str:
    """The results as a plain-text table with a header."""
    return "\n".join([_row(_HEADER), *(format_row(r) for r in results)])


def _format_list() -> str:
    cb = _cb()
    lines = [f"{'op':<18}  {'case':<20}  {'fwd tol':<8}  {'grad tol':<8}  note"]
    for c in cb.cases():
        gt = f"{c.grad_tol:g}" if c.grad else "-"
        lines.append(f"{c.op:<18}  {c.name:<20}  {c.forward_tol:<8g}  {gt:<8}  {c.note}".rstrip())
    lines.append("")
    lines.append("not covered:")
    lines += [f"  {n}: {why}" for n, why in cb.NOT_COVERED.items()]
    try:
        devs = cb.device_backends()
    except Exception as e:  # noqa: BLE001 - listing must work without any backend
        devs = []
        lines.append(f"backends: discovery failed: {cb._short(e)}")
    lines.append(f"device backends here: {', '.join(devs) if devs else 'none (CPU only)'}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m recurra.check_backends",
        description="Run every op case on every non-CPU backend and compare with the CPU "
        "(forward and gradients, normalized MSE), proving where each case ran.",
    )
    ap.add_argument(
        "--op",
        action="append",
        default=[],
        metavar="NAME",
        help="only this op (exact name; repeatable); see --list",
    )
    ap.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="NAME",
        help="only this backend or device ('vulkan', 'vulkan:0'; repeatable); "
        "'cpu' checks the CPU against itself",
    )
    ap.add_argument(
        "--strict", action="store_true", help="an unsupported case (CPU fallback) fails the run"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument(
        "--allow-cpu-only",
        action="store_true",
        help="exit 0 (not 3) when no backend other than the CPU is available",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring). Returns the exit code."""
    cb = _cb()
    ap = _parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 for --help
        return int(e.code) if isinstance(e.code, int) else cb.EXIT_USAGE
    if args.list:
        print(_format_list())
        return int(cb.EXIT_OK)
    try:
        selected = cb.select_cases(args.op)
        devices = cb.resolve_backends(args.backend)
    except (cb.UnknownOpError, cb.UnknownBackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return int(cb.EXIT_USAGE)
    except cb.BackendUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return int(cb.EXIT_NO_BACKEND)
    if not devices:
        msg = cb.no_device_message()
        code: int = cb.EXIT_OK if args.allow_cpu_only else cb.EXIT_NO_BACKEND
        if args.json:
            doc = cb.to_json([], [], code)
            doc["message"] = msg
            print(json.dumps(doc))
        else:
            print(("note: " if code == cb.EXIT_OK else "error: ") + msg, file=sys.stderr)
        return int(code)

    ops_wanted = list(dict.fromkeys(c.op for c in selected))

    def show(r: CaseResult) -> None:
        print(format_row(r), flush=True)

    if not args.json:
        print(
            f"checking {len(selected)} cases of {len(ops_wanted)} ops on {', '.join(devices)} "
            f"against the CPU (NMSE bounds: forward {cb.FORWARD_NMSE_MAX:g}, gradients "
            f"{cb.GRAD_NMSE_MAX:g} unless a case documents more)"
        )
        print(_row(_HEADER), flush=True)
    results = cb.check(args.op, devices, on_result=None if args.json else show)
    code = int(cb.exit_code(results, args.strict))
    if args.json:
        print(json.dumps(cb.to_json(results, devices, code)))
    else:
        counts = cb.summary(results)
        print(
            ", ".join(f"{n} {v}" for v, n in counts.items())
            + f" -> {'PASS' if code == cb.EXIT_OK else 'FAIL'}"
        )
    return int(code)

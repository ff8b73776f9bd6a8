"""``moetrace verify``: is a trace intact? Checksums and invariants, per dataset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moetrace.trace.integrity import CHECKSUMS
from moetrace.trace.verify import TraceReport, verify_trace
from moetrace.words import counted

from .errors import EXIT_INPUT, guarded
from .options import progress_meter, stdout_console

__all__ = ["verify"]


def verdict(report: TraceReport) -> str:
    """One line for a person: what the file is, and what to do about it."""
    if report.found == "missing":
        return "no such file; check the path"
    if report.found == "foreign":
        return "not a moetrace trace; give a trace file that moetrace wrote (.h5 from a dump, merge or convert)"
    if report.intact:
        return f"intact; {CHECKSUMS}"
    if report.damaged or report.problems:
        if not report.datasets:
            return ("DAMAGED: it cannot be read (truncated or overwritten); restore it from a copy, or gather the recording's "
                    "segments into a new trace with `moetrace recover DIR` if they remain")
        damaged = len(report.damaged)
        what = (f"{damaged} of {counted(len(report.datasets), 'dataset')} fail their checks" if damaged else
                f"its datasets read, but {counted(len(report.problems), 'check')} of the whole fail")
        return f"DAMAGED: {what} (below); restore it from a copy, or gather the recording's segments with `moetrace recover DIR` if they remain"
    return "unverified: readable, but written before moetrace had checksums, so nothing proves it unchanged (--allow-unverified accepts it)"


def _print(report: TraceReport) -> None:
    console = stdout_console()
    console.print(f"[bold]{report.path}[/bold]: {verdict(report)}", highlight=False)
    if report.datasets:
        table = Table(show_header=True, header_style="bold")
        for col in ("dataset", "status", "detail"):
            table.add_column(col, overflow="fold")
        for d in report.datasets:
            table.add_row(d.name, d.status, d.detail)
        console.print(table)
    for problem in report.problems if report.found == "trace" else ():
        console.print(f"problem: {problem}", markup=False)


@guarded
def verify(
    traces: Annotated[list[Path], typer.Argument(help="Trace files to check.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")] = False,
    allow_unverified: Annotated[bool, typer.Option("--allow-unverified", help="Exit 0 for readable traces written before checksums (they cannot be proven intact).")] = False,
    progress: Annotated[bool | None, typer.Option("--progress/--no-progress", help="Progress bar on stderr (default: when stderr is a terminal).")] = None,
) -> None:
    """Read every dataset of each trace, check its checksums and invariants, and report what is intact.

    Exit 0 only when every trace is intact (2 otherwise: damaged, unreadable, or unverified without --allow-unverified).
    """
    reports = []
    for path in traces:
        with progress_meter(progress, f"verifying {path.name}", unit_bytes=True) as update:
            reports.append(verify_trace(path, progress=update))
    ok = all(r.intact or (allow_unverified and not r.damaged and not r.problems) for r in reports)
    if as_json:
        typer.echo(json.dumps({"intact": ok, "traces": [r.as_dict() for r in reports]}, indent=2))
    else:
        for report in reports:
            _print(report)
    if not ok:
        raise typer.Exit(EXIT_INPUT)

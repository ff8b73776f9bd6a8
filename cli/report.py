"""``moetrace report``: one self-contained HTML file of a run's evidence (``moetrace.report``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetrace.routes import RoutesError

from .errors import CommandError, guarded
from .options import PHASE_HELP, existing_file, output_path, pass_phase_option, stage_meter, writing

__all__ = ["report"]


@guarded
def report(
    traces: Annotated[list[Path], typer.Argument(help="Traces: one file, a merged file, the per-rank files / segments of one run, and / or replica traces.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="HTML file to write.")] = Path("report.html"),
    routes: Annotated[Path | None, typer.Option("--routes", help="Per-request routed experts (a routes file, an API response body or .npy) for the request selector.")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Co-activated pairs and transitions per layer.")] = 5,
    phase: Annotated[str | None, typer.Option("--phase", help=PHASE_HELP)] = None,
    progress: Annotated[bool | None, typer.Option("--progress/--no-progress", help="Progress bar on stderr (default: when stderr is a terminal).")] = None,
    gpus_per_node: Annotated[int | None, typer.Option("--gpus-per-node", min=1, help="EP ranks per node: adds who sends to whom (node x node traffic).")] = None,
) -> None:
    """Write one HTML file (opens offline, plotly embedded) with a figure and a one-line reading per section."""
    from moetrace.report import build_report, require_plotly

    try:
        require_plotly()  # plotly is the `report` extra
    except ImportError as exc:
        raise CommandError(str(exc)) from None
    output_path(out)
    phase = pass_phase_option(phase)
    files = [existing_file(t) for t in traces]
    if routes is not None:
        existing_file(routes, "routes")
    try:
        with stage_meter(progress) as update, writing(out):
            written = build_report(files, out, routes=routes, top=top, phase=phase, progress=update, gpus_per_node=gpus_per_node)
    except RoutesError as exc:
        raise CommandError(str(exc)) from None
        raise CommandError(str(exc)) from None
    typer.echo(f"wrote {written} ({written.stat().st_size / 1e6:.1f} MB): open it in a browser")

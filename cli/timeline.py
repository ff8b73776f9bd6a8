"""``moetrace timeline``: Chrome trace-event JSON of a timed trace (ui.perfetto.dev, chrome://tracing)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetrace.analysis.timeline import build_timeline
from moetrace.trace.reader import open_trace
from moetrace.trace.writer import write_json_atomic
from moetrace.words import counted

from .errors import CommandError, guarded
from .options import existing_file, output_path, writing

__all__ = ["parse_passes", "timeline", "write_timeline"]


def parse_passes(text: str | None) -> tuple[int | None, int | None]:
    """``"A:B"`` -> pass ids ``A <= p < B`` (either side may be empty); ``None`` -> every pass."""
    if text is None:
        return None, None
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError(text)
        first, stop = (int(p) if p.strip() else None for p in parts)
    except ValueError:
        raise CommandError(f"--passes {text!r}: expected A:B (pass ids A <= p < B; A or B may be left out)") from None
    if first is not None and stop is not None and stop <= first:
        raise CommandError(f"--passes {text!r}: the end must be after the start")
    return first, stop


def write_timeline(trace_path: Path, out: Path, first: int | None = None, stop: int | None = None) -> int:
    """Write the timeline of ``trace_path`` to ``out`` atomically; returns the number of events."""
    with open_trace(trace_path) as trace:
        document = build_timeline(trace, first, stop)
    write_json_atomic(out, document)
    return len(document["traceEvents"])


@guarded
def timeline(
    trace: Annotated[Path, typer.Argument(help="A moetrace HDF5 trace recorded with timing=True.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="JSON file to write.")] = Path("timeline.json"),
    passes: Annotated[str | None, typer.Option("--passes", help="Pass ids A:B to include (A <= p < B; default all).")] = None,
) -> None:
    """Chrome trace-event JSON: one process per rank, one track per phase, pass windows on one clock."""
    first, stop = parse_passes(passes)
    with writing(out):
        count = write_timeline(existing_file(trace), output_path(out), first, stop)
    typer.echo(f"wrote {out} ({counted(count, 'event')}); open it in ui.perfetto.dev or chrome://tracing")

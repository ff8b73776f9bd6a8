"""``moetrace report``: one self-contained HTML file of a run (plotly, JavaScript embedded, no network).

:func:`build_report` reads the inputs through the analysis APIs (:mod:`.evidence`), picks the
sections their data supports (:mod:`.sections`), draws them with plotly (:mod:`.figures`) and
writes one page (:mod:`.page`). Needs the ``report`` extra (``pip install 'moetrace[report]'``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .evidence import Evidence

__all__ = ["SIZE_BOUND", "build_report", "require_plotly", "write_report"]

#: What the report embeds at most, whatever the trace length (docs/report.md).
SIZE_BOUND = (
    "Bounded size: figures hold summaries, never raw rows: time series at most {points} points, "
    "the expert heatmap at most {cells} cells, at most {requests} requests x {tokens} positions of routes, "
    "top pairs and transitions per layer; plus plotly.js (about 4.8 MB)."
)


def require_plotly() -> None:
    """Fail early, naming the extra to install, when plotly (the ``report`` extra) is missing.

    Raises:
        ImportError: plotly cannot be imported; the message says ``pip install 'moetrace[report]'``.
    """
    try:
        import plotly  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"the HTML report needs plotly ({exc}); install it: pip install 'moetrace[report]'") from None


def build_report(paths: Sequence[Path | str], out: Path | str, routes: Path | str | None = None, top: int = 5,
                 phase: str | None = None, progress: Callable[[str, int, int], None] | None = None,
                 gpus_per_node: int | None = None) -> Path:
    """Write the HTML report of ``paths`` (expert traces of one run and / or replica traces) to ``out``.

    Args:
        paths: traces: one file, a merged file, per-rank files or segments of one run, replica traces.
        out: the HTML file to write (atomically).
        routes: a routes file with per-request routed experts (``moetrace.routes.save_routes``).
        top: co-activated pairs and transitions per layer.
        phase: the expert sections of one pass phase only (``prefill``, ``decode``, ...: one expert trace).
        progress: ``progress(stage, done, total)`` while the placement section plans (:func:`.evidence.gather_evidence`).
        gpus_per_node: EP ranks per node: adds the "who sends to whom" section (``None``: left out).

    Raises:
        TraceError: an input is not a readable trace (the error ``moetrace analyze`` gives).
        RoutesError: the routes file cannot be read.
        ValueError: nothing to report on.
    """
    from .evidence import gather_evidence

    evidence = gather_evidence([Path(p) for p in paths], None if routes is None else Path(routes), top=top, phase=phase, progress=progress,
                               gpus_per_node=gpus_per_node)
    return write_report(evidence, out)


def write_report(evidence: Evidence, out: Path | str) -> Path:
    """Write the HTML report of gathered ``evidence`` (:func:`.evidence.gather_evidence`) to ``out``; returns the path."""
    from .page import write_page
    from .sections import (
        MAX_HEATMAP_CELLS,
        MAX_POINTS,
        MAX_REQUEST_TOKENS,
        MAX_REQUESTS,
        build_sections,
    )

    bound = SIZE_BOUND.format(points=MAX_POINTS, cells=MAX_HEATMAP_CELLS, requests=MAX_REQUESTS, tokens=MAX_REQUEST_TOKENS)
    return write_page(Path(out), build_sections(evidence), evidence.inputs, bound)

"""PNG plots of an :class:`~moetrace.analysis.summary.AnalysisReport` (headless, Agg).

Figures are built with :class:`matplotlib.figure.Figure` and the Agg canvas
directly, so plotting never touches pyplot's global state or needs a display. Matplotlib is
imported by :func:`plot_report`, when a figure is drawn: importing this module (as the
``moetrace`` command does for ``--kind``'s choices) costs nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..trace.schema import Attr

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .summary import AnalysisReport

__all__ = ["PLOT_KINDS", "plot_report"]

PLOT_KINDS = ("heatmap", "ranks", "timeline", "coactivation", "projection")


def _title(report: AnalysisReport, what: str) -> str:
    model = report.attrs.get(Attr.MODEL) or report.path.name
    return f"{what} — {model} ({report.attrs.get(Attr.MODE)}, {report.num_tokens} tokens)"


def _heatmap(report: AnalysisReport, fig: Figure) -> None:
    counts = report.logical_count.astype(np.float64)
    mean = counts.mean(axis=1, keepdims=True)
    ratio = np.divide(counts, mean, out=np.zeros_like(counts), where=mean > 0)
    ax = fig.add_subplot()
    image = ax.imshow(ratio, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_xlabel("logical expert")
    ax.set_ylabel("MoE layer (model index)")
    ax.set_yticks(range(len(report.layer_ids)), [str(x) for x in report.layer_ids])
    fig.colorbar(image, ax=ax, label="tokens / layer mean (1 = even)")
    ax.set_title(_title(report, "Expert load"))


def _ranks(report: AnalysisReport, fig: Figure) -> None:
    if report.ep_size == 1:
        raise ValueError(f"{report.path}: one EP rank recorded, and rank balance needs EP; "
                         "--kind projection shows what EP over R ranks would make of this load, --kind heatmap the expert load")
    load = report.rank_load
    total = load.sum(axis=0)
    top, bottom = fig.subplots(2, 1)
    ranks = np.arange(load.shape[1])
    top.bar(ranks, total, color="tab:blue")
    top.axhline(total.mean(), color="black", linestyle="--", label=f"mean {total.mean():.0f}")
    top.set_xlabel("EP rank")
    top.set_ylabel("token copies (all layers)")
    top.set_xticks(ranks)
    top.legend(loc="upper right")
    top.set_title(_title(report, f"Per-rank load (balancedness {report.balancedness:.3f})"))
    layers = np.arange(len(report.layer_ids))
    bottom.bar(layers, report.layer_balancedness, color="tab:green")
    bottom.set_ylim(0, 1.05)
    bottom.set_xticks(layers, [str(x) for x in report.layer_ids])
    bottom.set_xlabel("MoE layer (model index)")
    bottom.set_ylabel("balancedness (mean/max)")


def _timeline(report: AnalysisReport, fig: Figure) -> None:
    drift = report.drift
    if drift is None:
        raise ValueError(f"{report.path}: no time-ordered data (empty window or stream); the timeline needs passes")
    ax = fig.add_subplot()
    x = drift.first_pass
    ax.set_xlabel(f"first pass of window ({drift.passes_per_window} passes per window)")
    if report.ep_size > 1:
        ax.plot(x, drift.balancedness, marker="o", color="tab:blue", label="balancedness")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("balancedness (mean/max over ranks)", color="tab:blue")
        js_axis = ax.twinx()
    else:  # one rank: rank balancedness is 1 by definition, so only the drift is drawn
        js_axis = ax
    js_axis.plot(x[1:], drift.js_mean[1:], marker="s", color="tab:red", label="JS divergence from previous window")
    js_axis.set_ylabel("JS divergence (bits, mean over layers)", color="tab:red")
    js_axis.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    if js_axis is not ax:
        more = js_axis.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="lower left")
    ax.set_title(_title(report, "Balance and drift over time" if report.ep_size > 1 else "Drift over time (one EP rank)"))


def _coactivation(report: AnalysisReport, fig: Figure, layer: int | None) -> None:
    co = report.coactivation
    if co is None:
        raise ValueError(f"{report.path}: co-activation needs a per_token trace (this one is {report.attrs.get(Attr.MODE)})")
    ids = [int(x) for x in report.layer_ids]
    layer = ids[0] if layer is None else layer
    if layer not in ids:
        raise ValueError(f"layer {layer} was not analysed (layers: {ids})")
    matrix = co.coactivation[ids.index(layer)]
    ax = fig.add_subplot()
    image = ax.imshow(matrix, cmap="viridis", interpolation="nearest")
    ax.set_xlabel("logical expert")
    ax.set_ylabel("logical expert")
    fig.colorbar(image, ax=ax, label="tokens choosing both")
    ax.set_title(_title(report, f"Co-activation, layer {layer}"))


def _projection(report: AnalysisReport, fig: Figure) -> None:
    rows = report.ep_projection
    if not rows:
        raise ValueError(f"{report.path}: the EP projection needs at least 2 experts per layer")
    ranks = [row.ranks for row in rows]
    extra = rows[0].redundant_slots // rows[0].ranks
    ax = fig.add_subplot()
    series = (
        ("contiguous (rank r: experts [rE/R, (r+1)E/R))", [row.contiguous_balancedness for row in rows], "tab:red", "o"),
        ("planned (moetrace placement, E slots)", [row.planned_balancedness for row in rows], "tab:blue", "s"),
        (f"planned + {extra} redundant slot(s) per rank", [row.planned_redundant_balancedness for row in rows], "tab:green", "^"),
    )
    for label, values, color, marker in series:
        ax.plot(ranks, values, marker=marker, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.minorticks_off()
    ax.set_ylim(0, 1.05)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xlabel("EP ranks R (divisors of the expert count)")
    ax.set_ylabel("rank balancedness (mean / max rank load)")
    ax.legend(loc="lower left")
    ax.grid(True, alpha=0.3)
    ep = f"recorded on {report.ep_size} EP rank{'s' if report.ep_size > 1 else ''}"
    ax.set_title(_title(report, f"EP projection of this load ({ep})"))


def plot_report(report: AnalysisReport, path: Path | str, kind: str = "heatmap", layer: int | None = None) -> Path:
    """Draw one plot of ``report`` into the PNG ``path``.

    Args:
        kind: ``heatmap`` (layer x expert load), ``ranks`` (per-rank load and
            per-layer balancedness), ``timeline`` (balancedness and drift per
            window), ``coactivation`` (expert x expert matrix of one layer),
            ``projection`` (EP projection: rank balancedness against R per placement).
        layer: model layer id for ``coactivation`` (default the first analysed).

    Raises:
        ValueError: unknown kind, or the trace lacks what the kind needs.
    """
    if kind not in PLOT_KINDS:
        raise ValueError(f"unknown plot kind {kind!r}; choose one of {', '.join(PLOT_KINDS)}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize={"ranks": (10, 7), "coactivation": (8, 7)}.get(kind, (10, 6)), layout="constrained")
    FigureCanvasAgg(fig)
    if kind == "heatmap":
        _heatmap(report, fig)
    elif kind == "ranks":
        _ranks(report, fig)
    elif kind == "timeline":
        _timeline(report, fig)
    elif kind == "projection":
        _projection(report, fig)
    else:
        _coactivation(report, fig, layer)
    path = Path(path)
    fig.savefig(path, dpi=100, format="png")
    return path

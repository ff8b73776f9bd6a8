"""``moetrace analyze`` and ``plot``: offline analysis of a trace (``placement`` is in :mod:`.placement`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from rich import box
from rich.console import Console
from rich.table import Table

from moetrace.analysis.deployment import group_recordings
from moetrace.analysis.plots import PLOT_KINDS, plot_report
from moetrace.analysis.summary import AnalysisReport, analyze_trace
from moetrace.trace.reader import open_trace
from moetrace.trace.schema import Data
from moetrace.words import counted

from .errors import CommandError, guarded
from .options import (
    PHASE_HELP,
    existing_file,
    output_path,
    parse_layers,
    pass_phase_option,
    stdout_console,
    writing,
)
from .timing import print_timing

__all__ = ["analyze", "plot", "print_projection", "print_report"]

ANALYZE_LAYERS_HELP = "Model layer ids to analyse, e.g. '0,7,12-15' (default: all)."
#: Hottest experts shown per layer in the 80-column table (``--json`` lists ``--top``).
HOTTEST_SHOWN = 3


def _fmt(x: float) -> str:
    return f"{x:.3f}"


def print_projection(rows: list[dict[str, object]], console: Console) -> None:
    """The EP projection table: rank balancedness for each EP size and placement."""
    if not rows:
        console.print("EP projection: needs at least 2 experts per layer")
        return
    extra = rows[0]["redundant_slots"] // rows[0]["ranks"]  # type: ignore[operator]
    table = Table(title="EP projection: rank balancedness over R ranks",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("R", "experts/rank", "contiguous", "planned", f"planned +{extra}/rank"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(str(row["ranks"]), str(row["experts_per_rank"]), _fmt(row["contiguous_balancedness"]),  # type: ignore[arg-type]
                      _fmt(row["planned_balancedness"]), _fmt(row["planned_redundant_balancedness"]))  # type: ignore[arg-type]
    console.print(table)
    console.print("contiguous: rank r holds experts [r·E/R, (r+1)·E/R); planned: moetrace placement")


def print_report(report: AnalysisReport, console: Console) -> None:
    """The analysis as text: headline, per-layer, per-rank and EP-projection tables (80 columns wide)."""
    d = report.to_dict()
    _print_head(report, d, console)
    _print_expert_table(d, console)
    if report.ep_size > 1:
        _print_rank_tables(report, d, console)
    print_projection(d["ep_projection"], console)
    _print_coactivation(d, console)
    _print_drift(d, report.ep_size > 1, console)
    if d["timing"] is not None:
        print_timing(d["timing"], console)
    for note in d["notes"]:
        console.print(f"note: {note}")


def _print_head(report: AnalysisReport, d: dict, console: Console) -> None:
    t, totals = d["trace"], d["totals"]
    console.print(f"[bold]{report.path}[/bold]")
    console.print(
        f"mode={t['mode']} model={t['model'] or '-'} engine={t['engine'] or '-'} "
        f"ep_size={t['ep_size']} experts={t['num_logical_experts']} top_k={t['top_k']}"
        + (f" pass_phase={d['pass_phase']}" if d["pass_phase"] else "")
    )
    console.print(
        f"passes={totals['passes']} tokens={totals['tokens']} assignments={totals['assignments']} "
        f"invalid_ids={totals['invalid_ids']} dropped={totals['dropped']}"
    )
    for line in d["headline"]:
        console.print(f"[bold]{line}[/bold]")


def _print_expert_table(d: dict, console: Console) -> None:
    hot = d["overall"]["hot_experts"]
    table = Table(title="Per layer: balance over logical experts (idle: experts with no token)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("layer", "imbalance", "CV", f"top {hot}", "entropy", "idle", "hottest (x mean)"):
        table.add_column(col, justify="left" if col.startswith("hottest") else "right")
    for row in d["per_layer"]:
        hottest = ", ".join(f"{h['expert']}:{h['load_ratio']:.1f}" for h in row["hottest"][:HOTTEST_SHOWN])
        table.add_row(str(row["layer"]), f"{row['expert_imbalance']:.2f}", f"{row['expert_cv']:.2f}", f"{100 * row['hot_expert_share']:.0f}%",
                      f"{row['entropy_ratio']:.2f}", str(len(row["dead_experts"])), hottest)
    console.print(table)


def _print_rank_tables(report: AnalysisReport, d: dict, console: Console) -> None:
    ranks = d["ranks"]
    layer_table = Table(title=f"Per layer: balance over {report.ep_size} EP ranks", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("layer", "balancedness", "imbalance", "hottest rank"):
        layer_table.add_column(col, justify="right")
    for row in d["per_layer"]:
        layer_table.add_row(str(row["layer"]), _fmt(row["balancedness"]), f"{row['imbalance']:.2f}", str(int(np.argmax(row["rank_load"]))))
    console.print(layer_table)
    rank_table = Table(title="Per EP rank, all layers", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    rank_table.add_column("rank", justify="right")
    rank_table.add_column("token copies", justify="right")
    rank_table.add_column("x mean", justify="right")
    mean = float(np.mean(ranks["total_load"])) or 1.0
    for r, load in enumerate(ranks["total_load"]):
        rank_table.add_row(str(r), str(load), f"{load / mean:.2f}")
    console.print(rank_table)


def _print_coactivation(d: dict, console: Console) -> None:
    if d["coactivation"] is not None:
        co = Table(title="Co-activation: top expert pairs (lift = observed / independent)", title_justify="left")
        co.add_column("layer", justify="right")
        co.add_column("top pairs: experts a+b (tokens routed to both, lift)")
        for row in d["coactivation"]["per_layer"]:
            co.add_row(str(row["layer"]), "; ".join(f"{p['a']}+{p['b']} ({counted(p['count'], 'token')}, lift {p['lift']:.2f})" for p in row["top_pairs"]))
        console.print(co)
    if d["transitions"]:
        tr = Table(title="Cross-layer transitions (same top-k slot)", title_justify="left")
        for col in ("from", "to", "MI bits", "NMI", "top a->b (share)"):
            tr.add_column(col, justify="right" if col != "top a->b (share)" else "left")
        for row in d["transitions"]:
            top = ", ".join(f"{x['a']}->{x['b']} ({x['share']:.3f})" for x in row["top"])
            tr.add_row(str(row["from_layer"]), str(row["to_layer"]), _fmt(row["mutual_information_bits"]), _fmt(row["normalized_mutual_information"]), top)
        console.print(tr)


def _print_drift(d: dict, ep: bool, console: Console) -> None:
    drift = d["drift"]
    if drift is None:
        return
    js = "n/a (one window)" if drift["mean_js"] is None else f"mean {drift['mean_js']:.4f}, max {drift['max_js']:.4f}"
    window_balance = (f"; window balancedness min {_fmt(drift['balancedness_min'])} mean {_fmt(drift['balancedness_mean'])} "
                      f"max {_fmt(drift['balancedness_max'])}") if ep else ""
    console.print(
        f"drift: {counted(drift['num_windows'], 'window')} of {counted(drift['passes_per_window'], 'pass')}; "
        f"JS divergence between successive windows {js}{window_balance}"
    )

@guarded
def analyze(
    traces: Annotated[list[Path], typer.Argument(help="A moetrace HDF5 trace, the per-rank files / segments of one run (analysed as one), or the recordings of one deployment (a time series).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON report (schema in docs/analysis.md) instead of tables.")] = False,
    layers: Annotated[str | None, typer.Option("--layers", help=ANALYZE_LAYERS_HELP)] = None,
    window: Annotated[int | None, typer.Option("--window", min=1, help="Passes per drift window (default: about 20 windows).")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Hottest experts, pairs and transitions listed per layer (the expert table shows at most 3).")] = 5,
    progress: Annotated[bool | None, typer.Option("--progress/--no-progress", help="Progress bar on stderr (default: when stderr is a terminal).")] = None,
    scheduler: Annotated[str | None, typer.Option("--scheduler", help="Run on Dask (moetrace[dask]): 'local[:N]' starts N worker processes (default one per core), 'tcp://HOST:PORT' uses a running scheduler.")] = None,
    by: Annotated[str | None, typer.Option("--by", help="Attribution on a routes file or a per_token trace whose rows carry their requests: 'request', 'label' or 'label:NAME' (who drives the hot experts and ranks).")] = None,
    ep_size: Annotated[int, typer.Option("--ep-size", min=1, help="With --by: EP ranks for the hottest-rank figures (contiguous placement).")] = 1,
    phase: Annotated[str | None, typer.Option("--phase", help=PHASE_HELP)] = None,
) -> None:
    """Expert and rank balance, entropy, dead/hot experts, EP projection, co-activation, transitions and drift of a trace."""
    if by is not None:  # which requests / labels drive the load: moetrace.analysis.attribution
        from .attribution import print_attribution, run_attribution

        if len(traces) != 1:
            raise CommandError("--by takes one routes file")
        result = run_attribution(existing_file(traces[0], "routes"), by, ep_size, top)
        if as_json:
            typer.echo(json.dumps(result.to_dict(), indent=2))
        else:
            print_attribution(result, stdout_console())
        return

    phase = pass_phase_option(phase)
    if phase is not None and (len(traces) > 1 or scheduler is not None):
        raise CommandError("--phase analyses one trace (merge per-rank files first: moetrace merge)")
    if len(traces) > 1 or scheduler is not None:  # several files, or Dask: moetrace.analysis.distributed
        report = _analyze_many([existing_file(t) for t in traces], parse_layers(layers), window, top, progress, scheduler, as_json)
    else:
        report = _analyze_one(existing_file(traces[0]), parse_layers(layers), window, top, progress, as_json, phase)
    if report is None:  # printed already (a deployment series, a replica trace)
        return
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report, stdout_console())


def _analyze_one(path: Path, layers: list[int] | None, window: int | None, top: int, progress: bool | None,
                 as_json: bool, phase: str | None = None) -> AnalysisReport | None:
    """One trace, opened once: its analysis, or (a replica trace) the replica report, printed here."""
    with open_trace(path) as trace:
        if not trace.has(Data.REQUESTS):
            return analyze_trace(trace, layers=layers, window=window, top=top, progress=progress, phase=phase)
    from .replicas import print_replica_report

    print_replica_report(path, as_json)  # request->replica evidence (moetrace replicas)
    return None


def _analyze_many(files: list[Path], layers: list[int] | None, window: int | None, top: int, progress: bool | None,
                  scheduler: str | None, as_json: bool) -> AnalysisReport | None:
    """The files of one run analysed as one (in process or on Dask), or the deployment series of several runs."""
    from moetrace.analysis.distributed import analyze_traces, dask_client

    recordings = group_recordings(files) if len(files) > 1 else [files]
    if len(recordings) > 1:  # several runs: the deployment series (moetrace.analysis.deployment)
        _analyze_deployment(files, layers, top, scheduler, as_json)
        return None
    if scheduler is None:
        return analyze_traces(files, layers=layers, window=window, top=top, progress=progress)
    with dask_client(scheduler) as client:
        return analyze_traces(files, client=client, layers=layers, window=window, top=top)

def _analyze_deployment(files: list[Path], layers: list[int] | None, top: int, scheduler: str | None, as_json: bool) -> None:
    from moetrace.analysis.deployment import analyze_deployment
    from moetrace.analysis.distributed import dask_client

    from .deployment import print_deployment

    if scheduler is None:
        report = analyze_deployment(files, layers=layers, top=top)
    else:
        with dask_client(scheduler) as client:
            report = analyze_deployment(files, layers=layers, top=top, client=client)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_deployment(report, stdout_console())


@guarded
def plot(
    trace: Annotated[Path, typer.Argument(help="A moetrace HDF5 trace.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="PNG file to write.")],
    kind: Annotated[str, typer.Option("--kind", help=f"One of: {', '.join(PLOT_KINDS)}.")] = "heatmap",
    layers: Annotated[str | None, typer.Option("--layers", help=ANALYZE_LAYERS_HELP)] = None,
    layer: Annotated[int | None, typer.Option("--layer", help="Model layer id of the co-activation matrix (default: first analysed).")] = None,
    window: Annotated[int | None, typer.Option("--window", min=1, help="Passes per window for the timeline.")] = None,
    progress: Annotated[bool | None, typer.Option("--progress/--no-progress", help="Progress bar on stderr (default: when stderr is a terminal).")] = None,
) -> None:
    """Draw a PNG: layer x expert heatmap, per-rank load, balance/drift timeline, co-activation matrix or EP projection."""
    if kind not in PLOT_KINDS:
        raise CommandError(f"--kind {kind!r}: choose one of {', '.join(PLOT_KINDS)}")
    output_path(out)
    report = analyze_trace(existing_file(trace), layers=parse_layers(layers), window=window, progress=progress)
    with writing(out):
        written = plot_report(report, out, kind=kind, layer=layer)
    typer.echo(f"wrote {written} ({written.stat().st_size} bytes)")

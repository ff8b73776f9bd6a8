"""``moetrace traffic``: who sends to whom, rank x rank and node x node (:mod:`moetrace.analysis.traffic`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from .errors import CommandError, guarded
from .options import (
    PHASE_HELP,
    existing_file,
    output_path,
    parse_layers,
    pass_phase_option,
    progress_meter,
    stdout_console,
)

__all__ = ["print_traffic", "traffic"]


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _bytes(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= size:
            return f"{x / size:,.1f} {unit}"
    return f"{x:,.0f} B"


def print_traffic(d: dict[str, Any], console: Console) -> None:
    """The traffic as text: head, node x node matrix, per-layer shares, hottest links, nodes per token."""
    console.print(f"{d['ranks']} EP ranks on {d['nodes']} nodes of {d['gpus_per_node']} GPUs, {d['slots']} slots"
                  f"{' (re-projected onto --plan)' if d['plan'] else ''}; source ranks read: {len(d['sources'])}"
                  f"{'' if d['complete'] else ' (not every token group)'}")
    if not d["complete"]:
        missing = sorted(set(range(d["ranks"])) - set(d["sources"]))
        console.print(f"note: no trace of EP ranks {missing[:16]}{' ...' if len(missing) > 16 else ''}: their tokens are missing from the matrices")
    b = d["bytes"]
    console.print(f"token copies {d['copies']:,}  inter-node share {_share(d['inter_node_share'])}  bytes (dispatch+combine): "
                  f"inter-node {_bytes(b['inter_node'])}, NVLink {_bytes(b['nvlink'])}, RDMA with node de-duplication {_bytes(b['rdma_node_dedup'])}")
    nodes = Table(title="token copies: source node x destination node", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    nodes.add_column("from \\ to", justify="right")
    for n in range(d["nodes"]):
        nodes.add_column(str(n), justify="right")
    for n, row in enumerate(d["node_tokens"]):
        nodes.add_row(str(n), *(f"{x:,.0f}" for x in row))
    console.print(nodes)
    layers = Table(title="per layer", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("layer", "copies", "inter-node share", "mean nodes/token"):
        layers.add_column(col, justify="right")
    for row in d["layers"]:
        hist = row["nodes_per_token"]
        mean = "-" if hist is None or not sum(hist) else f"{sum(i * c for i, c in enumerate(hist)) / sum(hist):.2f}"
        layers.add_row(str(row["layer"]), f"{row['copies']:,.0f}", _share(row["inter_node_share"]), mean)
    console.print(layers)
    links = ", ".join(f"{x['source']}->{x['destination']} {x['tokens']:,.0f}" for x in d["hottest_node_links"][:5]) or "none"
    console.print(f"hottest node links: {links}")
    if d["nodes_per_token"] is not None:
        console.print("nodes per token (tokens x layers by distinct nodes reached): "
                      + "  ".join(f"{i}: {c:,}" for i, c in enumerate(d["nodes_per_token"]) if c))


@guarded
def traffic(
    traces: Annotated[list[Path], typer.Argument(help="The run's traces: every rank's per-rank file (or merged files).")],
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=1, help="GPUs (EP ranks) per node: ranks [n·G, (n+1)·G) are node n.")],
    plan: Annotated[Path | None, typer.Option("--plan", help="Re-project the routes onto this placement: a moetrace plan (placement --out) or an SGLang --init-expert-location .json.")] = None,
    layers: Annotated[str | None, typer.Option("--layers", help="Model layer ids, e.g. '0,7,12-15' (default: all).")] = None,
    phase: Annotated[str | None, typer.Option("--phase", help=PHASE_HELP)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON document (docs/traffic.md) instead of tables.")] = False,
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Write a PNG: the node x node heatmap and nodes per token.")] = None,
    progress: Annotated[bool | None, typer.Option("--progress/--no-progress", help="Progress bar on stderr (default: when stderr is a terminal).")] = None,
) -> None:
    """Who sends to whom: token copies rank x rank and node x node, inter-node share, bytes, hottest links, nodes per token."""
    from moetrace.analysis.traffic import trace_traffic
    from moetrace.placement.checks import PlacementError
    from moetrace.placement.plan_file import read_placement_file
    from moetrace.trace.reader import open_trace

    files = [existing_file(t) for t in traces]
    phase = pass_phase_option(phase)
    selected = parse_layers(layers)
    if out is not None:
        output_path(out)
    phy2log = None
    if plan is not None:
        with open_trace(files[0]) as first:
            from moetrace.analysis.source import select_layers

            layer_ids = [int(x) for x in first.layers[select_layers(first, selected)]]
            experts = first.num_logical_experts
        try:
            phy2log = read_placement_file(existing_file(plan, "plan"), layer_ids, experts)
        except PlacementError as exc:
            raise CommandError(f"--plan {exc}") from None
    try:
        with progress_meter(progress, "reading traces") as update:
            result = trace_traffic(files, gpus_per_node, phy2log, selected, phase, progress=update)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    document = result.to_dict()
    if out is not None:
        from moetrace.analysis.traffic_plot import plot_traffic

        plot_traffic(result, out)
    if as_json:
        typer.echo(json.dumps(document))
        return
    print_traffic(document, stdout_console())
    if out is not None:
        typer.echo(f"wrote {out}")

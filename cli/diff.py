"""``moetrace diff A B``: routing divergence between two runs of the same tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from moetrace.words import counted

from .errors import CommandError, guarded
from .options import existing_file, stdout_console

if TYPE_CHECKING:
    from moetrace.replay_audit import ReplayAuditReport

__all__ = ["diff"]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


@guarded
def diff(
    a: Annotated[Path, typer.Argument(help="First run: a per_token trace (.h5), or a routes file / wire payload (.json) / .npy.")],
    b: Annotated[Path, typer.Argument(help="Second run, of the same kind as A.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
    top: Annotated[int, typer.Option("--top", min=0, help="Most divergent experts to list per layer.")] = 3,
    ignore_model: Annotated[bool, typer.Option("--ignore-model", help="Compare even when the recorded model names differ.")] = False,
    audit: Annotated[bool, typer.Option(
        "--replay-audit",
        help="A is the routes a replay requested, B the routes the replayed run used: report the replay audit and exit 1 "
        "unless every requested (token, layer) row used its requested experts and every layer was reached.",
    )] = False,
) -> None:
    """Compare two runs' routes token by token: per-layer agreement, Jaccard, divergent experts (docs/divergence.md)."""
    from moetrace.analysis.divergence import DivergenceError, diff_sources, replay_audit

    existing_file(a, "input")
    existing_file(b, "input")
    try:
        result = diff_sources(a, b, ignore_model=ignore_model)
    except DivergenceError as exc:
        raise CommandError(str(exc)) from None
    if audit:
        _print_audit(replay_audit(result), as_json)
        return
    figures = result.to_dict(top)
    if as_json:
        typer.echo(json.dumps(figures, indent=2))
        return
    console = stdout_console()
    align = figures["alignment"]
    console.print(
        f"aligned by {align['by']}: {counted(align['matched_tokens'], 'token')} matched, {align['only_in_a']} only in A, "
        f"{align['only_in_b']} only in B; {counted(figures['tokens'], 'token')} with routes on both sides"
    )
    table = Table(title="Per layer (B against A)", title_justify="left")
    for column in ("layer", "tokens", "same set", "same order", "Jaccard", "top divergent experts (id: tokens)"):
        table.add_column(column, justify="left" if column.startswith(("layer", "top")) else "right")
    for row in figures["layers"]:
        name = str(row["layer"]) if row["layer_id"] is None else f"{row['layer']} (model {row['layer_id']})"
        experts = ", ".join(f"{e['expert']}: {e['tokens']}" for e in row["top_divergent_experts"]) or "-"
        jaccard = "-" if row["jaccard"] is None else f"{row['jaccard']:.3f}"
        table.add_row(name, str(row["tokens"]), _pct(row["set_agreement"]), _pct(row["order_agreement"]), jaccard, experts)
    console.print(table)
    hist = figures["differing_layers_histogram"]
    console.print(
        f"router agreement {_pct(figures['router_agreement'])} of (token, layer) pairs; tokens with >= 1 differing layer: "
        f"{_pct(figures['tokens_any_differ'])}"
    )
    console.print("differing layers per token: " + ", ".join(f"{n}: {count}" for n, count in enumerate(hist)))


def _print_audit(report: ReplayAuditReport, as_json: bool) -> None:
    """The replay audit of a diff; exit code 1 unless it is clean."""
    figures = report.to_dict()
    missing = figures["positions_only_in_requested"]
    ok = report.ok and not missing
    if as_json:
        typer.echo(json.dumps({**figures, "ok": ok}, indent=2))
    else:
        console = stdout_console()
        table = Table(title="Replay audit (B = what the replayed run used, against A = what was requested)", title_justify="left")
        for column in ("layer", "requested rows", "used as requested", "share"):
            table.add_column(column, justify="left" if column == "layer" else "right")
        for row in figures["layers"]:
            table.add_row(row["layer"], str(row["requested"]), str(row["matched"]), "-" if row["share"] is None else _pct(row["share"]))
        console.print(table)
        console.print(f"replay audit: {_pct(report.share)} of requested (token, layer) rows used their requested experts")
        if report.unreached:
            console.print(f"[red]routers never reached (requested, no routes in B): {', '.join(report.unreached)}[/red]")
        if missing:
            console.print(f"[red]{missing} requested positions are missing from B[/red]")
    if not ok:
        raise typer.Exit(1)

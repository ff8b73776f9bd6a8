"""``moetrace audit RECORDED... --returned FILE...``: do the routes an engine returned equal what it computed?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from moetrace.words import counted

from .errors import EXIT_FAILED, CommandError, guarded
from .options import existing_file, output_path, stdout_console, writing

if TYPE_CHECKING:
    from moetrace.analysis.route_audit import AuditReport, RecordedSource
    from moetrace.routes import RouteSet

__all__ = ["audit"]


def _is_sglang_answers(body: Any) -> bool:
    """A JSON list of SGLang answers, or a mapping request id -> answer (each with ``meta_info``)."""
    values = body if isinstance(body, list) else list(body.values()) if isinstance(body, dict) else []
    return bool(values) and all(isinstance(v, dict) and isinstance(v.get("meta_info"), dict) for v in values)


def _load_returned(paths: list[Path], recorded: RecordedSource, model_layers: int | None) -> RouteSet:
    """Every returned request of ``paths`` (routes files, wire payloads, SGLang answers) in one set."""
    from moetrace.adapters.base import AdapterError
    from moetrace.adapters.sglang.routed import answers_routes

    from moetrace.routes import RoutesError, load_routes

    merged: RouteSet | None = None
    for path in paths:
        existing_file(path, "returned routes")
        try:
            body = json.loads(path.read_text(encoding="utf-8")) if path.suffix != ".npy" else None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CommandError(f"{path}: not a routes file, wire payload or JSON of SGLang answers ({exc})") from None
        try:
            if body is not None and _is_sglang_answers(body):
                layers = model_layers if model_layers is not None else max(recorded.layer_ids) + 1
                part = answers_routes(body, layers, recorded.top_k)
            else:
                part = load_routes(path, validate=False)
        except (RoutesError, AdapterError) as exc:
            raise CommandError(f"{path}: {exc}") from None
        if merged is None:
            merged = part
            continue
        twice = sorted(set(merged.requests) & set(part.requests))
        if twice:
            raise CommandError(f"{path}: requests {twice[:5]} were already returned by an earlier file; give each request once")
        if part.id_space != merged.id_space:
            raise CommandError(f"{path}: routes in {part.id_space} ids, an earlier file in {merged.id_space} ids; convert them to logical ids first")
        merged.requests.update(part.requests)
        merged.provenance.update(part.provenance)
    assert merged is not None
    return merged


def _recorded(paths: list[Path]) -> RecordedSource:
    from moetrace.analysis.route_audit import AuditError, routeset_source, trace_source
    from moetrace.routes import RoutesError, load_routes

    for path in paths:
        existing_file(path, "recorded")
    with paths[0].open("rb") as f:
        is_trace = f.read(8) == b"\x89HDF\r\n\x1a\n"
    try:
        if is_trace:
            return trace_source(paths)
        if len(paths) != 1:
            raise CommandError("give one routes file as the recorded side (or the per_token trace files of the run)")
        return routeset_source(load_routes(paths[0]), describe=str(paths[0]))
    except (AuditError, RoutesError) as exc:
        raise CommandError(str(exc)) from None


def _print(report: AuditReport) -> None:
    console = stdout_console()
    figures = report.to_dict()
    console.print(
        f"{figures['requests']} returned requests: {figures['requests_ok']} match, {figures['requests_failed']} with faults; "
        f"{figures['compared_rows']} (position, layer) rows compared, {figures['matched_rows']} equal to the trace's; "
        f"{figures['recorded_only_requests']} recorded requests returned nothing"
    )
    if figures["weight_version_assumed_requests"]:
        console.print(f"{counted(figures['weight_version_assumed_requests'], 'request')} record no weight version: assumed {figures['expected_weight_version']!r}")
    if figures["faults"]:
        table = Table(title="Faults", title_justify="left")
        for column in ("fault", "requests", "count"):
            table.add_column(column, justify="left" if column == "fault" else "right")
        for name, entry in figures["faults"].items():
            table.add_row(name, str(entry["requests"]), str(entry["count"]))
        console.print(table)
        failed = [r for r in figures["per_request"] if not r["ok"]]
        shown = ", ".join(f"{r['request']} ({', '.join(r['faults'])})" for r in failed[:10])
        console.print(f"requests with faults: {shown}{' ...' if len(failed) > 10 else ''}")
    console.print("audit: every returned request matches" if report.ok else "[red]audit: faults found[/red]")


@guarded
def audit(
    recorded: Annotated[list[Path], typer.Argument(help="The recorder's side: the run's per_token trace (per-rank files together), or a routes file.")],
    returned: Annotated[list[Path], typer.Option(
        "--returned", "-r", help="Routes the engine returned: routes files, wire payloads (.json), .npy, or JSON of SGLang answers "
        "(a list, or a mapping request id -> answer). Repeat for several files.")],
    weight_version: Annotated[str | None, typer.Option("--weight-version", help="The weight version the routes must come from.")] = None,
    allow_other_weight_version: Annotated[bool, typer.Option(
        "--allow-other-weight-version", help="Do not count routes of another weight version as a fault (they are still reported).")] = False,
    model_layers: Annotated[int | None, typer.Option("--model-layers", min=1, help="The model's layers, to read SGLang answers (default: the last MoE layer + 1).")] = None,
    skip: Annotated[list[str] | None, typer.Option("--skip", help="Turn a check off (a fault name); repeatable.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Also write the JSON report to this file.")] = None,
) -> None:
    """Compare the routes an engine returned with its recorder's trace, request by request and position by position (docs/audit.md).

    Exit 0 when every returned request matches, 1 when faults are found (named), 2 for unusable input.
    """
    from moetrace.analysis.route_audit import FAULTS, AuditError, audit_routes

    skipped = set(skip or ())
    unknown = sorted(skipped - set(FAULTS))
    if unknown:
        raise CommandError(f"--skip {unknown[0]}: no such check; checks: {', '.join(FAULTS)}")
    if allow_other_weight_version:
        skipped.add("other_weight_version")
    if out is not None:
        output_path(out)
    source = _recorded(recorded)
    routes = _load_returned(returned, source, model_layers)
    try:
        report = audit_routes(routes, source, weight_version=weight_version, checks=[c for c in FAULTS if c not in skipped])
    except AuditError as exc:
        raise CommandError(str(exc)) from None
    figures = report.to_dict()
    if out is not None:
        from moetrace.trace.writer import write_json_atomic

        with writing(out):
            write_json_atomic(out, figures)
    if as_json:
        typer.echo(json.dumps(figures, indent=2))
    else:
        _print(report)
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)

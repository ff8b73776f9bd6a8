"""``moetrace convert``, ``merge``, ``inspect`` and ``routes``: produce and examine trace files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import h5py
import numpy as np
import typer
from rich.table import Table

from moetrace.routes import RoutesError, save_routes, trace_route_set
from moetrace.trace.convert import convert_jsonl, convert_sglang
from moetrace.trace.integrity import CHECKSUMS, reading
from moetrace.trace.merge import merge_traces, rank_stops
from moetrace.trace.reader import open_trace
from moetrace.trace.safe_open import open_hdf5
from moetrace.trace.schema import MERGED_DAMAGED_ATTR, Attr, Data
from moetrace.words import counted

from .errors import CommandError, guarded
from .options import existing_file, output_path, progress_meter, stdout_console, writing

__all__ = ["convert_to_trace", "inspect", "merge", "recover_run", "routes"]


@guarded
def convert_to_trace(
    src: Annotated[Path, typer.Argument(help="SGLang expert-distribution dump (.pt) or JSON-lines routing log.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Trace file to write (.h5).")],
    top_k: Annotated[int | None, typer.Option("--top-k", min=1, help="Experts per token (needed for SGLang stat/per_pass dumps).")] = None,
    ep_size: Annotated[int, typer.Option("--ep-size", min=1, help="EP ranks the physical experts were split over (SGLang).")] = 1,
    world_size: Annotated[int | None, typer.Option("--world-size", min=1, help="Ranks in the run (SGLang per-rank dumps; needed to merge them).")] = None,
    experts: Annotated[int | None, typer.Option("--experts", min=1, help="Experts per layer (JSON lines; default max id + 1).")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Run id to record (give per-rank conversions the same one to merge them).")] = None,
    model: Annotated[str, typer.Option("--model", help="Model name to record.")] = "",
) -> None:
    """Convert an SGLang .pt dump (stat, per_pass, per_token) or a JSON-lines routing log into a trace."""
    existing_file(src, "source")
    output_path(out)
    if src.suffix == ".pt":
        written = convert_sglang(src, out, top_k=top_k, ep_size=ep_size, run_id=run_id, world_size=world_size, model=model)
    else:
        written = convert_jsonl(src, out, num_experts=experts, run_id=run_id, model=model)
    with open_trace(written) as trace:
        typer.echo(f"wrote {written}: mode={trace.mode} layers={trace.num_layers} experts={trace.num_logical_experts} top_k={trace.top_k}")


@guarded
def merge(
    traces: Annotated[list[Path], typer.Argument(help="Per-rank traces of one run (rank 0..W-1).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Merged trace to write (.h5).")],
    progress: Annotated[bool | None, typer.Option("--progress/--no-progress", help="Progress bar on stderr (default: when stderr is a terminal).")] = None,
) -> None:
    """Join per-rank traces of one run into one trace (copied, rank axis / rank column; see docs/cli.md).

    Streams: 64 MiB of rows in flight over all inputs (and the merged column being built), plus one HDF5 chunk per dataset of each input.
    """
    for path in traces:
        existing_file(path)
    output_path(out)
    with progress_meter(progress, f"merging {len(traces)} traces (rows)") as update:
        written = merge_traces(traces, out, progress=update)
    with open_trace(written) as merged:
        left_out = json.loads(str(merged.attrs.get(MERGED_DAMAGED_ATTR, "[]")))
    typer.echo(f"wrote {written}: {counted(len(traces) - len(left_out), 'rank')}")
    if left_out:
        raise CommandError(f"{len(left_out)} damaged input(s) were left out of {written} (it holds the intact ranks only): {'; '.join(left_out)}")
    for note in rank_stops(traces):
        typer.echo(note)


@guarded
def recover_run(
    directory: Annotated[Path, typer.Argument(help="The dead recorder's output directory (holds its .moetrace-* segments).")],
    out: Annotated[Path | None, typer.Option("-o", "--out", help="Trace to write (.h5); -rank<r> is added per rank when several ranks left segments.")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Which run (or a prefix of its id) when the directory holds several.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Recover even though the recording process still runs.")] = False,
) -> None:
    """Gather the complete segments (or the stat checkpoint) a dead recording left into one valid trace per rank."""
    from moetrace.trace.recover import recover as recover_run

    if out is not None:
        output_path(out)
    ranks = recover_run(directory, out, run_id=run_id, force=force)
    for rank in ranks:
        typer.echo(rank.describe())
    damaged = [f"rank {r.rank}: {d}" for r in ranks for d in r.damaged]
    if damaged:
        raise CommandError(f"{len(damaged)} damaged file(s) were left out of the recovery (the rest is recovered above): {'; '.join(damaged)}")


def _datasets(path: Path) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []

    def visit(name: str, obj: object) -> None:
        if isinstance(obj, h5py.Dataset):
            filters = [f for f in ("compression", "shuffle") if getattr(obj, f)]
            rows.append(
                {
                    "name": f"/{name}",
                    "shape": list(obj.shape),
                    "dtype": str(obj.dtype),
                    "bytes": int(obj.size * obj.dtype.itemsize),
                    "stored_bytes": int(obj.id.get_storage_size()),
                    "chunks": list(obj.chunks) if obj.chunks else None,
                    "filters": [str(obj.compression) if f == "compression" else f for f in filters],
                }
            )

    with reading(path), open_hdf5(path) as f:
        f.visititems(visit)
    return rows


def _plain(value: object) -> object:
    if isinstance(value, np.ndarray):  # e.g. timing_histogram_edges
        return [_plain(v) for v in value.tolist()] if value.dtype.kind in "OSU" else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


@guarded
def inspect(
    trace: Annotated[Path, typer.Argument(help="A moetrace HDF5 trace.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Schema, root attributes, the parallel layout of each rank row, datasets (shape, dtype, size raw / on disk) of a trace."""
    with open_trace(existing_file(trace)) as tr:
        attrs = {k: _plain(v) for k, v in sorted(tr.attrs.items())}
        checksums = CHECKSUMS if tr.verified else "none (written before checksums: unverified)"
        counted = tr.counted() if tr.has(Data.STAT_NUM_TOKENS) else None
        ranks = [{**layout.as_dict(), "counted": bool(counted.assignments[i]) if counted is not None else True,
                  "tokens": int(tr.num_tokens()[i]) if counted is not None else None} for i, layout in enumerate(tr.layouts)]
        served = tr.tokens_served() if counted is not None else None
    datasets = _datasets(trace)
    if as_json:
        typer.echo(json.dumps({"path": str(trace), "file_bytes": trace.stat().st_size, "checksums": checksums, "attrs": attrs, "ranks": ranks,
                               "tokens_served": served, "datasets": datasets}, indent=2))
        return
    console = stdout_console()
    console.print(f"[bold]{trace}[/bold]  {attrs.get(Attr.SCHEMA)} v{attrs.get(Attr.SCHEMA_VERSION)}  {trace.stat().st_size} bytes on disk")
    console.print(f"checksums: {checksums}; digests checked, contents are checked as read (`moetrace verify` reads them all)")
    table = Table(title="Root attributes", title_justify="left")
    table.add_column("attribute")
    table.add_column("value")
    for key, value in attrs.items():
        table.add_row(key, str(value))
    console.print(table)
    if ranks:
        layout = Table(title=f"Rank rows: {tr.layouts[0].describe()} ({tr.layouts[0].source}); tokens served {served}", title_justify="left")
        columns = ("rank", "tp_rank", "dp_rank", "ep_rank", "pp_rank", "token_group", "counted", "tokens")
        for col in columns:
            layout.add_column(col, justify="right")
        for row in ranks:
            layout.add_row(*(str(row[c]) for c in columns))
        console.print(layout)
    else:
        console.print("Rank rows: no layout recorded (a trace from before layouts): every rank row counts as its own tokens")
    ds = Table(title="Datasets", title_justify="left")
    for col in ("name", "shape", "dtype", "raw bytes", "stored bytes", "filters"):
        ds.add_column(col, justify="right" if "bytes" in col else "left")
    for row in datasets:
        ds.add_row(str(row["name"]), str(tuple(row["shape"])), str(row["dtype"]), str(row["bytes"]), str(row["stored_bytes"]), ",".join(row["filters"]) or "-")  # type: ignore[arg-type]
    console.print(ds)


@guarded
def routes(
    traces: Annotated[list[Path], typer.Argument(help="per_token traces whose rows carry their requests (per-rank files or consecutive dumps of one run).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Routes file to write (JSON, moetrace.routes.load_routes reads it).")],
    request: Annotated[str | None, typer.Option("--request", help="Only this engine request id (SGLang's meta_info['id']; vLLM's engine-core id: RequestOutput.request_id, '-' and 8 random characters).")] = None,
) -> None:
    """Write every request's routed experts from the trace alone as a routes file, keyed by the engine's request ids.

    Rows of positions no pass computed (prefix-cache hits) are all -1. Holds the rows of the
    requests written in memory (one request's with --request).
    """
    for path in traces:
        existing_file(path)
    output_path(out)
    try:
        found = trace_route_set(traces, request)
        with writing(out):
            written = save_routes(out, {rid: arr for rid, (_, arr) in found.requests.items()}, model=found.model, id_space=found.id_space,
                                  num_experts=found.num_experts, layer_ids=found.layer_ids, physical_to_logical=found.physical_to_logical,
                                  **found.meta)
    except RoutesError as exc:
        raise CommandError(str(exc)) from None
    computed = sum(int((arr >= 0).any(axis=(1, 2)).sum()) for _, arr in found.requests.values())
    typer.echo(f"wrote {written}: {counted(len(found.requests), 'request')}, {counted(computed, 'position')} computed")

"""``moetrace analyze`` over many recordings: the deployment series as tables (80 columns)."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from moetrace.analysis.deployment import DeploymentReport

__all__ = ["print_deployment"]

#: Recordings listed in the text table; ``--json`` lists them all.
RECORDINGS_SHOWN = 24


def _when(unix: float) -> str:
    return _dt.datetime.fromtimestamp(unix, tz=_dt.timezone.utc).strftime("%m-%d %H:%M")


def _opt(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _hot(cells: list[dict[str, Any]]) -> str:
    return ", ".join(f"L{c['layer']}e{c['expert']} {c['load_ratio']:.1f}x" for c in cells[:1])


def print_deployment(report: DeploymentReport, console: Console) -> None:
    """Span summary, one row per recording (the newest :data:`RECORDINGS_SHOWN`) and one per hour."""
    doc = report.to_dict()
    span, recs = doc["span"], doc["recordings"]
    model = doc["model"]
    console.print(f"[bold]{span['recordings']} recordings[/bold] of {model['model'] or 'a model'} "
                  f"({model['num_logical_experts']} experts, top-{model['top_k']}), "
                  f"{_when(span['start_unix'])} .. {_when(span['end_unix'])} UTC")
    console.print(f"passes={span['passes']} tokens={span['tokens']} assignments={span['assignments']} "
                  f"dropped_passes={span['dropped_passes']} remaps at {span['remaps'] or 'none'}")
    console.print(f"expert imbalance over the span {span['expert_imbalance']:.2f}; "
                  f"worst recording balancedness {_opt(span['balancedness_min'])}")
    console.print(f"drift between successive recordings (JS): mean {_opt(span['drift_mean'], '{:.4f}')} "
                  f"max {_opt(span['drift_max'], '{:.4f}')}")
    if span["slowest_rank_recordings"]:
        console.print("slowest rank (recordings): " + ", ".join(f"rank {r}: {n}" for r, n in span["slowest_rank_recordings"].items()))
    table = Table(title="Per recording, oldest first (imb: hottest/mean logical expert)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("#", "UTC", "run", "R", "tokens", "balance", "imb", "drift", "hottest"):
        table.add_column(col, justify="left" if col in ("UTC", "run", "hottest") else "right")
    drift = [None, *doc["drift_between_recordings"]]
    start = max(0, len(recs) - RECORDINGS_SHOWN)
    for i in range(start, len(recs)):
        r = recs[i]
        table.add_row(str(i), _when(r["created_unix"]), r["run_id"][:8], str(r["ep_size"]), str(r["tokens"]),
                      _opt(r["balancedness"]), f"{r['expert_imbalance']:.2f}", _opt(drift[i], "{:.3f}"), _hot(r["hottest"]))
    console.print(table)
    if start:
        console.print(f"({start} older recordings not shown; --json lists every one)")
    hours = Table(title="Per hour (UTC)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("hour", "recordings", "tokens", "balance", "imb", "dropped passes"):
        hours.add_column(col, justify="left" if col == "hour" else "right")
    for h in doc["hours"][-RECORDINGS_SHOWN:]:
        hours.add_row(_when(h["hour_unix"]), str(h["recordings"]), str(h["tokens"]), _opt(h["balancedness"]),
                      f"{h['expert_imbalance']:.2f}", str(h["dropped_passes"]))
    console.print(hours)

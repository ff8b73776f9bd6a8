"""The timing section of ``moetrace analyze`` and ``moetrace demo`` as an 80-column table."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from moetrace.words import counted

__all__ = ["print_timing"]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _list(values: list[Any], fmt: str) -> str:
    return " ".join("-" if v is None else format(v, fmt) for v in values)


def print_timing(timing: dict[str, Any] | None, console: Console) -> None:
    """Per rank and phase times (ms per layer-pass), then step time, stragglers and wait cost."""
    if timing is None:
        console.print("timing: not recorded (record with RecorderConfig(timing=True))")
        return
    table = Table(title=f"Phase time per layer-pass, ms ({timing['clock']}, {counted(timing['passes'], 'pass')})",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("rank", "phase", "total s", "mean", "p50", "p95", "p99"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for row in timing["phase_table"]:
        table.add_row(str(row["rank"]), row["phase"], f"{row['total_seconds']:.3f}", _ms(row["mean_seconds"]),
                      _ms(row["p50_seconds"]), _ms(row["p95_seconds"]), _ms(row["p99_seconds"]))
    console.print(table)
    step = timing.get("step_seconds")
    if not timing.get("expert_timed", True):
        console.print("no expert phase was timed (the engine brackets other phases only): stragglers are not judged")
        return
    if step is None:
        console.print("no pass was timed on every rank: no per-pass figures")
        return
    console.print(f"step (max over ranks): mean {_ms(step['mean'])} ms, p50 {_ms(step['p50'])}, "
                  f"p95 {_ms(step['p95'])}, p99 {_ms(step['p99'])}")
    shares = timing["slowest_rank_share"]
    slowest = max(range(len(shares)), key=shares.__getitem__)
    console.print(f"slowest rank (expert compute): rank {slowest} in {100 * shares[slowest]:.0f}% of passes")
    wait_share = timing["wait_share"]
    console.print(f"wait cost: {timing['wait_seconds']:.3f} s"
                  + ("" if wait_share is None else f" = {100 * wait_share:.1f}% of step time"))
    console.print(f"expert idle by rank, s: {_list(timing['expert_wait_seconds_by_rank'], '.3f')}")
    console.print(f"exchange excess by rank, s: {_list(timing['exchange_excess_seconds_by_rank'], '.3f')}")
    if "alltoall_gbps" in timing:
        console.print(f"all-to-all effective GB/s by rank: {_list(timing['alltoall_gbps'], '.3g')}")
    if "tokens_vs_expert_corr_by_rank" in timing:
        console.print(f"corr(tokens in, expert time) by rank: {_list(timing['tokens_vs_expert_corr_by_rank'], '.2f')}")
    jitter = timing["jitter_cv_by_layer"]
    console.print(f"jitter CV by layer: dispatch {_list(jitter['dispatch'], '.2f')}")
    console.print(f"                    combine  {_list(jitter['combine'], '.2f')}")

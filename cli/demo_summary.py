"""What ``moetrace demo`` prints when it is done: one screen, 80 columns.

What ran, the headline balance, the per-rank load and time with the slowest rank, one
request's routes, the placement's in-sample fit and held-out estimate, and where the files
are. Every table row is built to fit; prose is wrapped at word boundaries. The full tables
are ``moetrace analyze``'s; the figures are in ``report.html``.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from moetrace.analysis.summary import AnalysisReport
from moetrace.report.evidence import PlacementView, placement_reading
from moetrace.words import counted

__all__ = ["WIDTH", "DemoSummary", "print_summary", "say"]

#: Columns of the summary.
WIDTH = 80
#: Token positions of the example request shown.
POSITIONS = 4


@dataclasses.dataclass(frozen=True)
class DemoSummary:
    """The figures the summary prints (all computed elsewhere)."""

    served: int
    stopped: int
    interrupted: bool
    seconds: float
    report: AnalysisReport
    bytes: dict[str, float]
    placement: PlacementView | None
    example: dict[str, Any] | None  # rid, prompt_len, output_len, routes [T, L_model, k]
    out: Path  # the output directory
    files: list[str]  # file names in it, in print order
    html_bytes: int
    timeline_events: int | None


def say(console: Console, text: str, indent: int = 0) -> None:
    """Print prose wrapped at word boundaries within :data:`WIDTH` (continuation lines indented 2 more)."""
    for line in textwrap.wrap(text, width=WIDTH, initial_indent=" " * indent, subsequent_indent=" " * (indent + 2),
                              break_long_words=False, break_on_hyphens=False):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def _row(console: Console, text: str) -> None:
    console.print(text[:WIDTH], markup=False, highlight=False, soft_wrap=True)


def _ranks(console: Console, report: AnalysisReport) -> None:
    """Per EP rank: token copies, x mean, expert seconds, idle seconds, share of passes slowest."""
    timing = report.timing or {}
    load = report.rank_load.sum(axis=0)
    mean = float(load.mean()) or 1.0
    per_pass = "slowest_rank_share" in timing
    _row(console, f"  {'rank':>4} {'token copies':>13} {'x mean':>7}" + (f" {'expert s':>9} {'idle s':>7} {'slowest in':>11}" if per_pass else ""))
    for r, copies in enumerate(load):
        extra = ""
        if per_pass:
            extra = (f" {timing['expert_seconds_by_rank'][r]:>9.3f} {timing['expert_wait_seconds_by_rank'][r]:>7.3f}"
                     f" {100 * timing['slowest_rank_share'][r]:>10.0f}%")
        _row(console, f"  {r:>4} {int(copies):>13,} {copies / mean:>7.2f}{extra}")
    if per_pass:
        shares = timing["slowest_rank_share"]
        slowest = int(np.argmax(shares))
        wait = timing["wait_share"]
        say(console, f"slowest rank (expert compute): rank {timing['rank_labels'][slowest]} in {100 * shares[slowest]:.0f}% of "
                     f"{counted(timing['passes'], 'pass')}; waiting for it costs {timing['wait_seconds']:.3f} s"
                     + ("" if wait is None else f" = {100 * wait:.1f}% of step time"))


def _example(console: Console, example: dict[str, Any]) -> None:
    """The first positions of one request: its experts per MoE layer, as many layers as fit."""
    routes = example["routes"]  # [T, L_model, k]
    layers = [i for i in range(routes.shape[1]) if (routes[:, i] >= 0).any()]
    cell = max(len(",".join(str(int(e)) for e in routes[p, i])) for p in range(min(POSITIONS, routes.shape[0])) for i in layers) + 2
    fit = max(1, (WIDTH - 7) // cell)
    dense = [f"L{i}" for i in range(routes.shape[1]) if i not in layers]
    say(console, f"request {example['rid']}: {example['prompt_len']} prompt + {counted(example['output_len'], 'generated token')}; routed "
                 f"experts {list(routes.shape)} (positions x model layers x k; {', '.join(dense) or 'no layer'} dense: no experts, -1), "
                 f"first {counted(min(POSITIONS, routes.shape[0]), 'position')}"
                 + ("" if len(layers) <= fit else f", {fit} of {len(layers)} MoE layers") + ":")
    shown = layers[:fit]
    _row(console, f"  {'pos':>3}  " + "".join(f"{'L' + str(i):<{cell}}" for i in shown).rstrip())
    for p in range(min(POSITIONS, routes.shape[0])):
        _row(console, f"  {p:>3}  " + "".join(f"{','.join(str(int(e)) for e in routes[p, i]):<{cell}}" for i in shown).rstrip())


def print_summary(console: Console, s: DemoSummary) -> None:
    """The whole summary (about 30 lines)."""
    r = s.report
    console.print()
    say(console, f"ran: {counted(s.served, 'request')} ({s.stopped} stopped by the loop" + (", interrupted" if s.interrupted else "")
                 + f") in {counted(r.num_passes, 'pass')}, {counted(r.num_tokens, 'token')}, {s.seconds:.1f} s")
    say(console, "balance (every table: moetrace analyze trace.h5; every figure: report.html):")
    for line in r.headline():
        say(console, line, indent=2)
    if r.ep_size > 1:
        _ranks(console, r)
    b = s.bytes
    if b["ep_ideal"]:
        say(console, f"all-to-all: EP exact sent {b['ep_exact_sent'] / 1e6:.2f} MB = {b['ep_exact_sent'] / b['ep_ideal']:.2f}x ideal EP "
                     f"(TP all-reduce {b['tp_all_reduce'] / b['ep_ideal']:.2f}x, padded EP {b['ep_padded'] / b['ep_ideal']:.2f}x)")
    if s.example is not None:
        console.print()
        _example(console, s.example)
    if s.placement is not None:
        console.print()
        say(console, "placement: " + placement_reading(s.placement))
    console.print()
    say(console, f"files in {s.out}/:")
    notes = {
        "report.html": f"every figure, opens offline in a browser ({s.html_bytes / 1e6:.1f} MB)",
        "trace.h5": "moetrace analyze | placement | report trace.h5",
        "timeline.json": f"Chrome trace events for ui.perfetto.dev ({counted(s.timeline_events, 'event')})",
    }
    for name in s.files:
        if name in notes:
            _row(console, f"  {name:<14} {notes[name]}")
    say(console, "also: " + ", ".join(n for n in s.files if n not in notes), indent=2)

"""``moetrace placement``'s tables and lines for a reader (without ``--json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from moetrace import balance
from moetrace.placement.backtesting import BacktestResult, gap_closed
from moetrace.placement.checks import PlacementConfig
from moetrace.placement.plan import PlacementPlan
from moetrace.words import counted

from .explain import print_rebalance_value, print_selection
from .loads import Loads
from .outcome import Outcome
from .replan import print_replan

__all__ = ["print_text"]

PLANNER_ORDER = ("current", "greedy", "moetrace-fit", "moetrace-robust", "moetrace", "oracle")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _spread(values: list[float] | np.ndarray) -> str:
    a = np.asarray(values, dtype=np.float64)
    return "-" if a.size == 0 else f"{a.mean():.3f} ({a.min():.3f}-{a.max():.3f})"


def _in_sample_table(console: Console, layer_ids: list[int], figures: dict[str, np.ndarray | None], plan: PlacementPlan, config: PlacementConfig) -> None:
    c = config
    table = Table(
        title=f"In-sample balancedness per layer: planned and scored on the same passes (a fit, not a forecast)\n"
        f"{counted(c.replicas, 'slot')}, {counted(c.groups, 'expert group')}, {counted(c.nodes, 'node')}, {counted(c.gpus, 'GPU')} ({'hierarchical' if plan.hierarchical and c.groups > 1 else 'global'})",
        title_justify="left",
    )
    for col in ("layer", "current", "greedy", "moetrace", "max replicas"):
        table.add_column(col, justify="right")
    for i, layer in enumerate(layer_ids):
        table.add_row(str(layer), *(_fmt(None if figures[k] is None else float(balance.layer_balancedness(figures[k])[i])) for k in ("current", "greedy", "moetrace")), str(int(plan.logcnt[i].max())))
    table.add_row("all", *(_fmt(None if figures[k] is None else balance.balancedness(figures[k])) for k in ("current", "greedy", "moetrace")), str(plan.log2phy.shape[2]), style="bold")
    console.print(table)


def _holdout_table(console: Console, result: Any) -> None:
    table = Table(
        title=f"Hold-out: planned on the first {counted(result.plan_passes, 'pass')}, scored on the next {result.scored_passes:,}",
        title_justify="left",
    )
    for col in ("planner", "in-sample (fit)", "held-out", "gap closed", "held-out windows mean (min-max)"):
        table.add_column(col, justify="right" if col != "planner" else "left")
    closed = result.gap_closed()
    for name in PLANNER_ORDER:
        if name in result.held_out:
            table.add_row(name, _fmt(result.in_sample[name]), _fmt(result.held_out[name]), _share(closed.get(name)), _spread(result.held_out_windows[name]))
    console.print(table)
    console.print("gap closed = share of the greedy-to-oracle gap on the held-out passes (oracle = a plan fitted to them; 0% = greedy, 100% = oracle)")


def _backtest_table(console: Console, result: BacktestResult) -> None:
    summary = result.summary()
    table = Table(
        title=f"Backtest: plan on {counted(result.window, 'pass')}, deploy for the next {result.every:,}, {counted(len(result.first_pass), 'rebalance')} "
        "(realised = held-out balancedness of each deployment)",
        title_justify="left",
    )
    cols = ["planner", "realised mean", "realised min", "in-sample mean (fit)", "gap closed", "below greedy", "moved/rebalance"]
    if result.expert_bytes:
        cols.append("bytes/rebalance")
    for col in cols:
        table.add_column(col, justify="right" if col != "planner" else "left")
    for name in PLANNER_ORDER:
        if name not in summary:
            continue
        row = summary[name]
        below = row.get("below_greedy_share")
        unmoved = name in ("current", "oracle")
        cells = [name, _fmt(row["realized_mean"]), _fmt(row["realized_min"]), _fmt(row["in_sample_mean"]), _share(row.get("gap_closed")),
                 _share(below), "-" if unmoved else f"{row['moved_mean']:.1f}"]
        if result.expert_bytes:
            cells.append("-" if unmoved else f"{row['moved_bytes_mean']:,.0f}")
        table.add_row(*cells)
    console.print(table)
    if "moetrace" in result.chosen:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in summary["moetrace"]["chosen_share"].items())
        console.print(f"moetrace deployed, by validation on the past at each rebalance: {shares} of the rebalances")


def print_text(console: Console, loads: Loads, outcome: Outcome, plot: Path | None, out: Path | None) -> None:
    """The tables and lines of ``moetrace placement`` without ``--json``."""
    document, estimate = outcome.document, outcome.estimate
    if loads.defaults:
        console.print(f"defaults used: {', '.join(loads.defaults)}")
    _in_sample_table(console, loads.layer_ids, outcome.loads, outcome.plan, loads.config)
    figures = "  ".join(f"{k} {_fmt(outcome.in_sample[k])}" for k in ("current", "greedy", "moetrace"))
    console.print(f"in-sample (planned and scored on the same passes; a fit, not a forecast): {figures}")
    shares = document.get("inter_node_share")
    if shares:
        console.print("inter-node share of token copies: " + ", ".join(f"{k} {_share(v)}" for k, v in shares.items() if k != "note"))
    print_selection(console, outcome.selection, document["planner"], document.get("preferred_reason"))
    if outcome.held is not None:
        _holdout_table(console, outcome.held)
    elif outcome.replay is not None:
        _backtest_table(console, outcome.replay)
        print_rebalance_value(console, outcome.values)
        if plot is not None:
            console.print(f"wrote {plot}")
    elif estimate is not None:
        spread = "  ".join(f"{k} {_spread(estimate.realized[k])}" for k in ("current", "greedy", "moetrace", "oracle") if k in estimate.realized)
        realized = estimate.realized
        closed = gap_closed(float(realized["moetrace"].mean()), float(realized["greedy"].mean()), float(realized["oracle"].mean()))
        console.print(
            f"held-out estimate (planned on {counted(estimate.window, 'pass')}, scored on the next {estimate.every:,}; mean (min-max) over "
            f"{counted(len(estimate.first_pass), 'window')}): {spread}; moetrace closes {_share(closed)} of the greedy-to-oracle gap"
        )
    else:
        console.print("held-out estimate: n/a (needs a per_pass or per_token trace with enough passes); the figures above are a fit, not a forecast")
    if outcome.deployed is not None and document.get("replicas_moved_from_current") is not None:
        moved = document["replicas_moved_from_current"]
        extra = f" ({document['bytes_moved_from_current']:,} bytes)" if "bytes_moved_from_current" in document else ""
        console.print(f"replicas moved from --current: {moved}{extra}")
    print_replan(console, document.get("recommendation"))
    if out is not None:
        console.print(f"wrote {out}")

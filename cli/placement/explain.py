"""``moetrace placement``'s explanations: which planner was deployed and why, and what rebalancing costs against what it gains."""

from __future__ import annotations

from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from moetrace.placement.backtesting import BacktestResult
from moetrace.placement.cost import rebalance_value, recommendation
from moetrace.placement.select import BASELINE, Selection, gain_over_baseline
from moetrace.words import counted

__all__ = ["print_rebalance_value", "print_selection", "rebalance_values"]

#: Planners whose rebalances are costed: the deployed default and the EPLB baseline.
COSTED = ("moetrace", "greedy")


def print_selection(console: Console, selection: Selection, deployed: str, overruled_by: str | None = None) -> None:
    """Which planner's plan is deployed and why, in short lines: the validation's choice, and
    ``overruled_by`` (why the held-out estimate deployed ``deployed`` instead) when it did."""
    folds = len(selection.fold_ends)
    how = (f"validation on {counted(folds, 'fold')} of the trace's past (plan on {counted(selection.window * selection.passes_per_bucket, 'pass')}, "
           f"score on the next {selection.every * selection.passes_per_bucket:,})")
    if overruled_by is None:
        console.print(f"deployed: [bold]{deployed}[/bold], chosen by {how}", highlight=False)
    else:
        console.print(f"deployed: [bold]{deployed}[/bold]. {how.capitalize()} chose {selection.chosen}, but {overruled_by}", highlight=False)
    if folds < 2 or BASELINE not in selection.realized:
        console.print(f"  ({counted(folds, 'fold')}: too few to weigh the candidates against {BASELINE})", highlight=False)
        return
    baseline = np.asarray(selection.realized[BASELINE])
    rows = [(name, *gain_over_baseline(values, baseline)) for name, values in selection.realized.items() if name != BASELINE]
    table = Table(title=f"Candidates against {BASELINE} on the validation folds", title_justify="left")
    for col in ("planner", "mean gain", "± standard error", f"folds below {BASELINE}"):
        table.add_column(col, justify="left" if col == "planner" else "right")
    for name, mean, error, below in rows:
        table.add_row(name, f"{mean:+.4f}", f"{error:.4f}", f"{below:.0%}")
    console.print(table)


def rebalance_values(result: BacktestResult, expert_bytes: int | None, link_gbps: float, pass_ms: float | None) -> dict[str, Any]:
    """JSON-ready cost and benefit of :data:`COSTED` planners' rebalances, with a recommendation each."""
    out: dict[str, Any] = {"link_gbps": link_gbps, "pass_ms": pass_ms, "planners": {}}
    for name in COSTED:
        value = rebalance_value(result, name, expert_bytes, link_gbps * 1e9)
        if value is not None:
            out["planners"][name] = {**value.to_dict(), "recommendation": recommendation(value, None if pass_ms is None else pass_ms / 1e3)}
    return out


def print_rebalance_value(console: Console, values: dict[str, Any]) -> None:
    """The cost-benefit table of :func:`rebalance_values`, then one recommendation per planner."""
    planners = values["planners"]
    if not planners:
        console.print("rebalance cost/benefit: n/a (needs at least two rebalances)")
        return
    table = Table(
        title=f"Rebalance cost vs benefit (rebalances after the first; stall = the busiest GPU's bytes at {values['link_gbps']:g} GB/s)",
        title_justify="left",
    )
    for col in ("planner", "balance gained vs keeping", "MoE time saved/pass", "replicas moved", "busiest GPU receives", "bytes moved", "stall", "pays above (ms/pass)"):
        table.add_column(col, justify="right" if col != "planner" else "left")
    for name, v in planners.items():
        table.add_row(
            name, f"{v['gain']:+.4f}", f"{v['saved_share']:.1%}", f"{v['moved']:.1f}", f"{v['moved_peak']:.1f}",
            "-" if v["bytes_moved"] is None else f"{v['bytes_moved']:,.0f}",
            "-" if v["stall_s"] is None else f"{1e3 * v['stall_s']:.3g} ms",
            "never" if v["saved_share"] <= 0 else "-" if v["break_even_pass_s"] is None else f"{1e3 * v['break_even_pass_s']:.3g}",
        )
    console.print(table)
    for name, v in planners.items():
        console.print(f"{name}: {v['recommendation']}")

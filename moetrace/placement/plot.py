"""PNG of a placement backtest: realised balancedness over time, one line per planner (headless, Agg)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .backtesting import BacktestResult

__all__ = ["plot_backtest"]


def plot_backtest(result: BacktestResult, path: Path | str, title: str = "") -> Path:
    """Draw realised next-window balancedness per rebalance (top) and replicas moved (bottom) into ``path``."""
    fig = Figure(figsize=(10, 7), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    x = result.first_pass
    for name, realized in result.realized.items():
        top.plot(x, realized, marker="o", markersize=3, label=f"{name} (mean {realized.mean():.3f}, min {realized.min():.3f})")
    top.set_ylabel("realised balancedness (next window)")
    top.set_ylim(top.get_ylim()[0], 1.0)
    top.legend(loc="lower left", fontsize="small")
    c = result.config
    top.set_title(
        f"{title + ': ' if title else ''}plan on {result.window} passes, deploy for {result.every} "
        f"({c.replicas} slots, {c.groups} groups, {c.nodes} nodes, {c.gpus} GPUs)"
    )
    width = (x[1] - x[0]) / (len(result.moved) + 1) if len(x) > 1 else 1.0
    for i, (name, moved) in enumerate(result.moved.items()):
        bottom.bar(x + i * width, moved, width=width, label=name)
    bottom.set_ylabel("replicas moved")
    bottom.set_xlabel("first pass of the deployment")
    bottom.legend(loc="upper right", fontsize="small")
    fig.savefig(path, format="png", dpi=100)
    return Path(path)

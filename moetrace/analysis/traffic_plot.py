"""PNG of a run's traffic: the node x node heatmap and the nodes-per-token histogram (headless, Agg)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .traffic import Traffic

__all__ = ["plot_traffic"]


def plot_traffic(traffic: Traffic, path: Path | str, title: str = "") -> Path:
    """Draw the summed node x node copies ``[N, N]`` (left) and, for token rows, nodes per token (right) into ``path``."""
    d = traffic.to_dict()
    histogram = d["nodes_per_token"]
    fig = Figure(figsize=(11 if histogram is not None else 6, 5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if histogram is not None else 1, squeeze=False)[0]
    nodes = np.asarray(d["node_tokens"], dtype=np.float64)
    image = axes[0].imshow(nodes, cmap="viridis")
    fig.colorbar(image, ax=axes[0], label="token copies")
    axes[0].set_xlabel("destination node")
    axes[0].set_ylabel("source node")
    share = d["inter_node_share"]
    axes[0].set_title(f"{title + ': ' if title else ''}inter-node share {share:.1%}" if share is not None else "no copies")
    if histogram is not None:
        axes[1].bar(np.arange(len(histogram)), histogram)
        axes[1].set_xlabel("distinct nodes a token's top-k reaches")
        axes[1].set_ylabel("tokens x layers")
        axes[1].set_title("nodes per token")
    fig.savefig(path, format="png", dpi=100)
    return Path(path)

"""Draw the figure of docs/concepts.md from the real OLMoE counts shipped with moetrace.

Run from the repository root: ``.venv/bin/python docs/figures/make_figures.py``
(writes ``docs/figures/expert-vs-rank-balance.png``; deterministic).

Left: one real OLMoE layer's load per expert (expert balance). Right: the same load
on 8 EP ranks, contiguous placement vs moetrace's planned placement (rank balance);
an EP step waits for the hottest rank.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from moetrace import balance
from moetrace.data import olmoe_counts
from moetrace.placement.plan import plan_experts

DOMAIN, LAYER, RANKS = "github", 1, 8  # OLMoE layer 7 on GitHub text
OUT = Path(__file__).resolve().parent / "expert-vs-rank-balance.png"


def main() -> Path:
    data = olmoe_counts()
    counts = np.asarray(data["expert_counts"][DOMAIN][LAYER], dtype=np.float64)[None, :]  # [1, 64]
    num_experts = counts.shape[1]
    share = counts[0] / counts[0].mean()
    contiguous = balance.rank_load(counts, RANKS)[0]
    planned = plan_experts(counts, num_experts, 1, 1, RANKS).gpu_load[0]
    scale = counts[0].sum() / RANKS  # rank loads as a multiple of the mean rank load

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, width_ratios=[1.6, 1])
    colors = [f"C{e // (num_experts // RANKS)}" for e in range(num_experts)]
    left.bar(np.arange(num_experts), share, color=colors)
    left.axhline(1.0, color="black", linestyle="--", linewidth=1, label="mean expert = 1")
    left.set_xlabel(f"expert (colour = contiguous EP rank of {RANKS})")
    left.set_ylabel("load / mean expert load")
    left.set_title(f"Expert balance: OLMoE layer {data['layers'][LAYER]} ({DOMAIN}); "
                   f"expert imbalance {float(balance.expert_imbalance(counts)[0]):.2f}")
    left.legend(loc="upper right")

    x = np.arange(RANKS)
    width = 0.4
    right.bar(x - width / 2, contiguous / scale, width, color=[f"C{r}" for r in range(RANKS)], label="contiguous")
    right.bar(x + width / 2, planned / scale, width, color="0.6", label="planned (moetrace placement)")
    right.axhline(1.0, color="black", linestyle="--", linewidth=1, label="mean rank = ideal step")
    right.axhline(contiguous.max() / scale, color="C3", linestyle=":", linewidth=1.5, label="hottest rank = step time")
    right.set_xticks(x)
    right.set_xlabel(f"EP rank (R = {RANKS})")
    right.set_ylabel("rank load / mean rank load")
    b_contiguous = balance.balancedness(contiguous[None, :])
    b_planned = balance.balancedness(planned[None, :])
    right.set_title(f"Rank balance: contiguous {b_contiguous:.2f}, planned {b_planned:.2f}")
    right.set_ylim(0, 1.35 * contiguous.max() / scale)
    right.legend(loc="upper right", fontsize="small")
    fig.savefig(OUT, dpi=90, format="png")
    return OUT


if __name__ == "__main__":
    print(f"wrote {main()}")

"""``moetrace placement --current``: does the replan pay for its weight copies? (:func:`moetrace.placement.cost.replan_advice`)"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from rich.console import Console

from moetrace import balance
from moetrace.placement.cost import replan_advice
from moetrace.placement.plan import (
    PlacementPlan,
    log2phy_from_phy2log,
    moved_per_gpu,
    predicted_gpu_load,
    replicas_moved,
)

__all__ = ["moved_from_current", "print_replan", "weigh_replan"]


def weigh_replan(outcome: Any, loads: Any, expert_bytes: int | None, link_gbps: float, pass_ms: float | None,
                  every: int | None, replan_anyway: bool) -> PlacementPlan | None:
    """Weigh the new plan's weight copies from ``--current`` against the MoE time it saves (:func:`replan_advice`).

    The balance compared: the deployed and the new plan on the held-out
    estimate's scored windows (the new plan's figure is the estimate's realised
    next-window balancedness), else both on the whole trace (in-sample). Over
    ``--every`` passes, else the estimate's scored window, else the trace's passes.
    The figures go to ``outcome.document["recommendation"]``. Returns the
    deployed plan when the copies cost more than they save (the plan to write,
    unless ``replan_anyway``), else None.
    """
    deployed, document, gpus = outcome.deployed, outcome.document, loads.config.gpus
    if deployed is None or deployed.shape != outcome.plan.phy2log.shape:
        return None
    per_gpu = moved_per_gpu(deployed, outcome.plan.phy2log, gpus)
    estimate, series = outcome.estimate, loads.series
    if estimate is not None and series is not None:
        rows, span = np.searchsorted(series.first_pass, estimate.first_pass), estimate.every // series.bucket
        keep = [balance.balancedness(predicted_gpu_load(series.logical[r : r + span].sum(axis=0), deployed, gpus)) for r in rows]
        new, source = estimate.realized[document.get("preferred_by_estimate", "moetrace")], "held-out estimate"
        horizon = every or estimate.every
    else:
        keep, new, source = [balance.balancedness(predicted_gpu_load(loads.weight, deployed, gpus))], [outcome.in_sample["moetrace"]], "in-sample"
        horizon = every or (int(series.passes.sum()) if series is not None else document["in_sample"]["passes"])
    if not horizon:
        document["recommendation"] = {"recommended": None, "reason": "cannot weigh the copies: the trace has no pass count; give --every S, the passes the plan will serve"}
        return None
    advice = replan_advice(np.asarray(keep), np.asarray(new), horizon, int(per_gpu.sum()), int(per_gpu.max()), expert_bytes, link_gbps * 1e9,
                           None if pass_ms is None else pass_ms / 1e3, source)
    kept = advice.recommended is False and not replan_anyway
    document["recommendation"] = {**advice.to_dict(), "link_gbps": link_gbps, "expert_bytes": expert_bytes,
                                  "plan_written": "current" if kept else "new", "replan_anyway": replan_anyway}
    if not kept:
        return None
    log2phy, logcnt = log2phy_from_phy2log(deployed, loads.weight.shape[1])
    return dataclasses.replace(outcome.plan, phy2log=deployed, log2phy=log2phy, logcnt=logcnt, gpu_load=predicted_gpu_load(loads.weight, deployed, gpus))


def print_replan(console: Console, advice: dict[str, Any] | None) -> None:
    """One line: the replan recommended, not recommended (and which plan ``--out`` holds), or not weighed, with the figures."""
    if advice is None:
        return
    verdict = {True: "recommended", False: "[bold]not recommended[/bold]", None: "not weighed"}[advice["recommended"]]
    kept = "; --out holds the deployed plan (--replan-anyway writes the new one)" if advice.get("plan_written") == "current" else ""
    console.print(f"replan: {verdict}: {advice['reason']}{kept}")


def moved_from_current(document: dict[str, Any], deployed: np.ndarray | None, plan: PlacementPlan, gpus: int, expert_bytes: int | None) -> None:
    """Weight copies (and bytes) from ``--current`` to ``plan``, into ``document``."""
    if deployed is None:
        return
    document["replicas_moved_from_current"] = replicas_moved(deployed, plan.phy2log, gpus) if deployed.shape == plan.phy2log.shape else None
    if expert_bytes and document["replicas_moved_from_current"] is not None:
        document["bytes_moved_from_current"] = document["replicas_moved_from_current"] * expert_bytes

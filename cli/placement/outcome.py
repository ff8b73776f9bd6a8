"""``moetrace placement``'s plan: the validated planner's plan, greedy beside it, and the JSON document's head."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from moetrace import balance
from moetrace.placement.backtesting import baseline_plan, plan_with_selection
from moetrace.placement.eplb import greedy_rebalance
from moetrace.placement.plan import PlacementPlan, predicted_gpu_load
from moetrace.trace.schema import Attr

from .loads import Loads
from .replan import moved_from_current

__all__ = ["Outcome", "estimate_dict", "plan_run", "prefer_the_estimates_winner"]


@dataclasses.dataclass
class Outcome:
    """The plan, its in-sample loads, the document, and the evaluation that was asked for."""

    plan: PlacementPlan
    selection: Any
    loads: dict[str, np.ndarray | None]
    in_sample: dict[str, float | None]
    document: dict[str, Any]
    deployed: np.ndarray | None
    estimate: Any = None
    held: Any = None
    replay: Any = None
    values: Any = None
    written: PlacementPlan | None = None  # the deployed plan, kept when the replan does not pay


def plan_run(traces: list[Path], loads: Loads, deployed: np.ndarray | None, expert_bytes: int | None, progress: Callable[[int, int], None]) -> Outcome:
    """Plan (the validated planner), greedy beside it, the run's own placement, and the document's head."""
    config, weight, series = loads.config, loads.weight, loads.series
    gpus = config.gpus
    plan, selection = plan_with_selection(weight, series, config, deployed, progress=progress)
    greedy = greedy_rebalance(weight, config.replicas, config.groups, config.nodes, config.gpus)
    gpu_loads = {
        "current": balance.rank_load(loads.physical, gpus) if loads.physical.shape[1] % gpus == 0 else None,
        "greedy": predicted_gpu_load(weight, greedy, gpus),
        "moetrace": predicted_gpu_load(weight, plan.phy2log, gpus),
    }
    in_sample = {k: None if v is None else balance.balancedness(v) for k, v in gpu_loads.items()}
    trace = traces[0]
    document: dict[str, Any] = {
        "schema": "moetrace.placement",
        "schema_version": 3,
        "trace": str(trace) if len(traces) == 1 else [str(t) for t in traces],
        "run_id": loads.attrs.get(Attr.RUN_ID),
        "layers": loads.layer_ids,
        "num_model_layers": loads.num_model_layers,
        "num_replicas": config.replicas,
        "num_groups": config.groups,
        "num_nodes": config.nodes,
        "num_gpus": config.gpus,
        "defaults_used": loads.defaults,
        "hierarchical": plan.hierarchical,
        "planner": selection.chosen,
        "selection": selection.to_dict(),
        "in_sample": {"passes": int(series.passes.sum()) if series is not None else None, "balancedness": in_sample,
                      "layer_balancedness": {k: None if v is None else balance.layer_balancedness(v).tolist() for k, v in gpu_loads.items()}},
    }
    moved_from_current(document, deployed, plan, gpus, expert_bytes)
    return Outcome(plan, selection, gpu_loads, in_sample, document, deployed)


def prefer_the_estimates_winner(outcome: Outcome, loads: Loads, expert_bytes: int | None) -> None:
    """Deploy EPLB's plan instead when the held-out estimate on this trace has it ahead of moetrace's default.

    The validation chose on folds of the past; the estimate replays the same
    choice on the trace's later parts. When EPLB's plan realised more there on
    average, this user's data says it wins, so it is what gets deployed (and
    the document says why).
    """
    estimate = outcome.estimate
    if estimate is None:
        return
    ours, eplb = float(estimate.realized["moetrace"].mean()), float(estimate.realized["greedy"].mean())
    outcome.document["preferred_by_estimate"] = "moetrace" if ours >= eplb else "greedy"
    if ours >= eplb:
        return
    outcome.plan = baseline_plan(loads.weight, loads.config, outcome.deployed)
    outcome.loads["moetrace"] = predicted_gpu_load(loads.weight, outcome.plan.phy2log, loads.config.gpus)
    outcome.in_sample["moetrace"] = balance.balancedness(outcome.loads["moetrace"])
    document = outcome.document
    document["planner"] = "greedy"
    document["preferred_reason"] = (f"the held-out estimate on this trace has greedy (EPLB's plan) ahead: "
                                    f"{eplb:.4f} vs {ours:.4f} mean next-window balancedness")
    document["in_sample"]["balancedness"]["moetrace"] = outcome.in_sample["moetrace"]
    document["in_sample"]["layer_balancedness"]["moetrace"] = balance.layer_balancedness(outcome.loads["moetrace"]).tolist()
    moved_from_current(document, outcome.deployed, outcome.plan, loads.config.gpus, expert_bytes)


def estimate_dict(estimate: Any) -> dict[str, Any] | None:
    """The held-out estimate's JSON (``None`` without enough time-ordered passes)."""
    if estimate is None:
        return None
    return {
        "plan_passes": estimate.window, "scored_passes": estimate.every, "windows": len(estimate.first_pass),
        "realized": {k: v.tolist() for k, v in estimate.realized.items()},
        "summary": {k: {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max())} for k, v in estimate.realized.items()},
        "gap_closed": {k: v.get("gap_closed") for k, v in estimate.summary().items() if "gap_closed" in v},
    }

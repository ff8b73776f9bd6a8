"""The candidate placement planners: each turns past load into a plan for the next window.

A planner is ``planner(history [t, L, E], window, config, deployed) -> phy2log [L, N]``:
``history`` is the time-ordered load (buckets of passes, oldest first),
``window`` how many of the last buckets it plans on, ``deployed`` the
placement in service (or ``None``). Candidates (:data:`CANDIDATES`):

- ``greedy``: EPLB's replicate-then-pack on the window's total
  (:func:`~moetrace.placement.eplb.greedy_rebalance`); the baseline;
- ``moetrace-fit``: :func:`~moetrace.placement.plan.plan_experts` on
  the window's total (swap search; it fits the window's noise);
- ``moetrace-robust``: :func:`robust_rebalance`: loads shrunk toward the longer
  history, packing chosen for the mean peak over the window's sub-windows, and a
  layer keeps its deployed placement unless the new one is clearly better;
- ``moetrace-subwindows``: the same without shrinkage (it follows a switch at
  once instead of being pulled back toward the old load);
- ``moetrace-spread``: variance-aware replication: replica counts and the
  starting packing from the sub-windows' mean + 1 standard deviation, so the
  experts whose load varies most get the spare replicas.

The two hedges were kept because the validated default chose them on several
regimes and gained there (docs/analysis.md); :data:`HEDGES` keeps the one
measured and dropped (an exponentially weighted forecast).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from .checks import PlacementConfig
from .eplb import greedy_rebalance
from .plan import PlacementPlan, plan_experts

__all__ = [
    "CANDIDATES",
    "HEDGES",
    "Planner",
    "RobustSettings",
    "ewma_estimate",
    "robust_inputs",
    "robust_rebalance",
]

#: ``planner(history [t, L, E], window buckets, config, deployed phy2log or None) -> phy2log [L, N]``.
Planner = Callable[[np.ndarray, int, PlacementConfig, "np.ndarray | None"], np.ndarray]


@dataclasses.dataclass(frozen=True)
class RobustSettings:
    """Knobs of :func:`robust_rebalance`, each kept because the backtest showed it helps.

    Attributes:
        subwindows: the planning window is cut into this many consecutive
            sub-windows; the packing minimises their mean peak GPU load.
        shrink: weight of the longer history in the load estimate (0 = the
            window alone); the history is everything before the window.
        keep_tolerance: a layer keeps its deployed placement unless the new
            plan lowers the expected peak by more than this fraction.

    The packing refinement's work bound is the config's
    (:attr:`~moetrace.placement.checks.PlacementConfig.refine_work`).
    """

    subwindows: int = 10
    shrink: float = 0.25
    keep_tolerance: float = 0.02


def robust_inputs(history: np.ndarray, window: int, settings: RobustSettings) -> tuple[np.ndarray, np.ndarray]:
    """``(estimate [L, E], scenarios [S, L, E])`` from ``history [t, L, E]`` (buckets, oldest first).

    The estimate is the last ``window`` buckets' total, shrunk toward the
    per-bucket mean of all of ``history`` (scaled to the window's length).
    Scenarios are the window's ``subwindows`` consecutive parts, each scaled to
    the window's length and shrunk the same way.
    """
    recent = history[-window:]
    scale = len(recent)
    longer = history.mean(axis=0) * scale
    alpha = settings.shrink if len(history) > len(recent) else 0.0
    estimate = (1 - alpha) * recent.sum(axis=0) + alpha * longer
    parts = [p for p in np.array_split(recent, min(settings.subwindows, len(recent))) if len(p)]
    scenarios = np.stack([(1 - alpha) * p.sum(axis=0) * (scale / len(p)) + alpha * longer for p in parts])
    return estimate, scenarios


def robust_rebalance(
    history: np.ndarray, window: int, config: PlacementConfig, settings: RobustSettings = RobustSettings(), current: np.ndarray | None = None
) -> PlacementPlan:
    """The robust planner for the next window, from ``history [t, L, E]`` (its ``gpu_load`` is under the shrunk estimate)."""
    estimate, scenarios = robust_inputs(history, window, settings)
    return plan_experts(
        estimate, config.replicas, config.groups, config.nodes, config.gpus,
        scenarios=scenarios, current=current, keep_tolerance=settings.keep_tolerance, refine_work=config.refine_work,
    )


def ewma_estimate(history: np.ndarray, window: int) -> np.ndarray:
    """Exponentially weighted forecast ``[L, E]`` of the next ``window`` buckets from all of ``history [t, L, E]``.

    Bucket weights halve every ``window / 2`` buckets back from the newest; the
    weighted per-bucket mean is scaled to the window's length.
    """
    age = np.arange(len(history))[::-1]
    weight = 0.5 ** (age / max(window / 2, 1.0))
    return np.tensordot(weight / weight.sum(), history, axes=1) * min(window, len(history))


def _spread_rebalance(history: np.ndarray, window: int, config: PlacementConfig, current: np.ndarray | None) -> np.ndarray:
    """Variance-aware replication: replica counts and packing start from mean + 1 std over the sub-windows."""
    estimate, scenarios = robust_inputs(history, window, RobustSettings())
    upper = estimate + scenarios.std(axis=0)
    return plan_experts(
        upper, config.replicas, config.groups, config.nodes, config.gpus,
        scenarios=scenarios, current=current, keep_tolerance=RobustSettings().keep_tolerance, refine_work=config.refine_work,
    ).phy2log


def _fit(weight: np.ndarray, config: PlacementConfig) -> np.ndarray:
    return plan_experts(weight, config.replicas, config.groups, config.nodes, config.gpus, refine_work=config.refine_work).phy2log


CANDIDATES: dict[str, Planner] = {
    "greedy": lambda h, w, c, cur: greedy_rebalance(h[-w:].sum(axis=0), c.replicas, c.groups, c.nodes, c.gpus),
    "moetrace-fit": lambda h, w, c, cur: _fit(h[-w:].sum(axis=0), c),
    "moetrace-robust": lambda h, w, c, cur: robust_rebalance(h, w, c, RobustSettings(), cur).phy2log,
    "moetrace-subwindows": lambda h, w, c, cur: robust_rebalance(h, w, c, RobustSettings(shrink=0.0), cur).phy2log,
    "moetrace-spread": _spread_rebalance,
}

#: Hedges measured by ``benchmarks/placement_backtest.py`` and dropped (not candidates: they did not help on more than one regime).
HEDGES: dict[str, Planner] = {
    "ewma": lambda h, w, c, cur: _fit(ewma_estimate(h, w), c),
}

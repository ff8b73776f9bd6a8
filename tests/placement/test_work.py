"""The placement commands' work bound: swap evaluations, not seconds, so plans do not depend on the machine's load.

A plan's packing refinement spends at most its ``refine_work`` (each row its
share), the same plan whatever the clock says; a command's plans together
spend at most its budget. Negative controls: without the bound the same plans
spend more (the bound binds), and a wall-clock budget under a clock that jumps
(a loaded machine) cuts the search where the work bound does not.
"""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from moetrace.placement import backtesting, planners
from moetrace.placement import plan as plan_module
from moetrace.placement.backtesting import held_out_estimate, plan_with_selection
from moetrace.placement.checks import PlacementConfig, PlacementError
from moetrace.placement.plan import plan_experts
from moetrace.placement.planners import RobustSettings, robust_inputs
from moetrace.placement.series import PassSeries

LAYERS, EXPERTS = 2, 32


def drifting(buckets: int = 25, seed: int = 0) -> np.ndarray:
    """``[buckets, L, E]`` counts: a lognormal skew per layer that drifts a little every bucket (seeded)."""
    rng = np.random.default_rng(seed)
    base = rng.lognormal(0, 1.0, (LAYERS, EXPERTS))
    steps = rng.normal(0, 0.6 / np.sqrt(buckets), (buckets, LAYERS, EXPERTS)).cumsum(axis=0)
    return rng.poisson(base * np.exp(steps) * 200).astype(np.float64)


def series_of(loads: np.ndarray) -> PassSeries:
    n, layers, experts = loads.shape
    return PassSeries(1, np.ones(n, dtype=np.int64), np.arange(n), loads, loads.astype(np.int64), np.tile(np.arange(experts), (layers, 1)))


def test_a_plan_spends_at_most_its_work_whatever_the_clock(monkeypatch):
    estimate, scenarios = robust_inputs(drifting(), 10, RobustSettings())
    sizes = (40, 4, 2, 8)  # two node assignments are refined: the groups' share and both packings count
    free = plan_experts(estimate, *sizes, scenarios=scenarios)
    assert free.within_budget and free.refine_work > 0
    bound = free.refine_work // 4
    plan = plan_experts(estimate, *sizes, scenarios=scenarios, refine_work=bound)
    assert 0 < plan.refine_work <= bound and not plan.within_budget  # the bound binds (the negative control: free spent 4x)
    assert plan_experts(estimate, *sizes, scenarios=scenarios, refine_work=0).refine_work == 0
    # A clock that jumps an hour at every look (a loaded machine): the work-bound plan is the same ...
    ticks = itertools.count()
    monkeypatch.setattr(plan_module, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 3600.0))
    again = plan_experts(estimate, *sizes, scenarios=scenarios, refine_work=bound)
    np.testing.assert_array_equal(again.phy2log, plan.phy2log)
    assert again.refine_work == plan.refine_work
    # ... while a wall-clock budget under the same clock stops the search before it starts.
    timed = plan_experts(estimate, *sizes, scenarios=scenarios, budget_s=1.0)
    assert not timed.within_budget and timed.refine_work == 0
    with pytest.raises(PlacementError, match="refine_work must be"):
        plan_experts(estimate, *sizes, refine_work=-1)


def test_a_commands_plans_share_one_budget(monkeypatch):
    """plan_with_selection and the held-out estimate (what `moetrace placement` and `report` run) spend at most their work, all plans together."""
    spent: list[int] = []
    real = plan_experts

    def counted(*args, **kwargs):
        plan = real(*args, **kwargs)
        spent.append(plan.refine_work)
        return plan

    monkeypatch.setattr(planners, "plan_experts", counted)
    monkeypatch.setattr(backtesting, "plan_experts", counted)
    loads = drifting()
    series, config = series_of(loads), PlacementConfig(40, 1, 1, 8)
    plan_with_selection(loads.sum(axis=0), series, config, work=None)
    held_out_estimate(series, config, work=None)
    free, plans = sum(spent), len(spent)
    spent.clear()
    budget = free // 8
    first, _ = plan_with_selection(loads.sum(axis=0), series, config, work=budget // 2)
    held_out_estimate(series, config, work=budget - budget // 2)
    assert len(spent) == plans and 0 < sum(spent) <= budget < free  # the same plans, within the budget (unbounded they spent 8x)
    spent.clear()
    again, _ = plan_with_selection(loads.sum(axis=0), series, config, work=budget // 2)
    np.testing.assert_array_equal(again.phy2log, first.phy2log)  # counted in work: the same plan every time

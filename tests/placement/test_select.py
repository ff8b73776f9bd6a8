"""Choosing the planner by validation on the trace's own past; the oracle; rebalance cost vs benefit; the labelled regimes.

Planted loads (seeded, plain numpy) where the answer is known: one where the
hedged planner must win (load alternating between two expert sets, so the
window's total hides which set is hot next), one where greedy must win (a
permanent switch after a long stale history, which the robust planner's
shrinkage drags back). Each test fails if the selection ignored its folds.
"""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.balance import balancedness
from moetrace.placement.backtesting import (
    backtest,
    default_planners,
    gap_closed,
    oracle_plan,
    plan_with_selection,
)
from moetrace.placement.checks import PlacementConfig
from moetrace.placement.cost import rebalance_value, recommendation
from moetrace.placement.eplb import greedy_rebalance
from moetrace.placement.plan import moved_per_gpu, predicted_gpu_load
from moetrace.placement.planners import CANDIDATES
from moetrace.placement.select import (
    BASELINE,
    SelectionRule,
    ValidatedPlanner,
    select_planner,
    validation_folds,
)
from moetrace.placement.series import PassSeries
from moetrace.reference.domain_drift import DriftSpec, olmoe_domains
from moetrace.reference.regimes import REGIMES, regime_mix, regime_routes

#: The candidates that hedge against the next window's load (the sub-window scenario planners).
HEDGED = {"moetrace-robust", "moetrace-subwindows", "moetrace-spread"}


def series_of(logical: np.ndarray) -> PassSeries:
    n, layers, experts = logical.shape
    return PassSeries(1, np.ones(n, dtype=np.int64), np.arange(n), logical, logical.astype(np.int64), np.tile(np.arange(experts), (layers, 1)))


def balance(load: np.ndarray, phy2log: np.ndarray, gpus: int) -> float:
    return balancedness(predicted_gpu_load(load, phy2log, gpus))


def alternating(n: int = 60) -> np.ndarray:
    """``[n, 1, 16]``: experts {0, 2, 4, 6} hot in even buckets, {1, 3, 5, 7} in odd ones (plus seeded jitter)."""
    a, b = np.ones(16), np.ones(16)
    a[[0, 2, 4, 6]] = b[[1, 3, 5, 7]] = 10
    rng = np.random.default_rng(0)
    return np.stack([a if t % 2 == 0 else b for t in range(n)])[:, None, :] * 100 + rng.integers(0, 5, (n, 1, 16))


def stale_switch(n: int = 100, switch: int = 60) -> np.ndarray:
    """``[n, 1, 8]``: expert 7 very hot until ``switch``, then expert 0 hot for good (plus seeded jitter)."""
    before, after = np.ones(8), np.ones(8)
    before[7], after[0] = 40, 12
    rng = np.random.default_rng(0)
    return np.stack([before if t < switch else after for t in range(n)])[:, None, :] * 100 + rng.integers(0, 3, (n, 1, 8))


# ------------------------------------------------------------------------- planted regimes
def test_the_hedge_wins_where_the_window_total_hides_the_next_window():
    loads, config = alternating(61), PlacementConfig(16, 1, 1, 4)
    history, nxt = loads[:60], loads[60, 0][None]  # the next bucket: an even one
    selection = select_planner(history, 10, 1, config)
    assert selection.chosen in HEDGED and selection.margin > 0.1
    assert len(selection.fold_ends) == 8 and "held best on 8 folds" in selection.reason
    # The choice was right: on the next window the hedge beats greedy by far.
    hedge = CANDIDATES[selection.chosen](history, 10, config, None)
    greedy = greedy_rebalance(history[-10:].sum(axis=0), 16, 1, 1, 4)
    assert balance(nxt, hedge, 4) > balance(nxt, greedy, 4) + 0.1


def test_greedy_wins_where_the_hedge_is_dragged_back_by_stale_history():
    loads, config = stale_switch(), PlacementConfig(12, 1, 1, 4)
    selection = select_planner(loads[:96], 5, 2, config, {k: CANDIDATES[k] for k in (BASELINE, "moetrace-robust")})
    assert selection.chosen == BASELINE and selection.margin == 0.0
    assert select_planner(loads[:96], 5, 2, config).chosen != "moetrace-robust"  # among all candidates too
    robust = np.asarray(selection.realized["moetrace-robust"])
    assert (robust < np.asarray(selection.realized["greedy"])).all() and "moetrace-robust" in selection.reason and "(not kept)" in selection.reason
    # The choice was right: greedy also holds better on the next window.
    nxt = loads[96:].sum(axis=0)
    hedge = CANDIDATES["moetrace-robust"](loads[:96], 5, config, None)
    assert balance(nxt, greedy_rebalance(loads[91:96].sum(axis=0), 12, 1, 1, 4), 4) > balance(nxt, hedge, 4)


# ------------------------------------------------------------------------- the rule
def cheater(loads: np.ndarray, every: int, good: set[int] | None = None):
    """A planner that peeks at the window after the history: the oracle plan there (or, off ``good``, the worst contiguous one)."""

    def plan(history: np.ndarray, window: int, config: PlacementConfig, current: np.ndarray | None) -> np.ndarray:
        t = len(history)
        nxt = loads[t : t + every].sum(axis=0)
        if good is None or t in good:
            return oracle_plan(nxt, config)
        hot_first = np.argsort(-nxt, axis=1)
        return np.concatenate([hot_first, hot_first[:, : config.replicas - nxt.shape[1]]], axis=1)

    return plan


def test_the_rule_weighs_mean_gain_losses_and_fold_count():
    loads, config = alternating(60), PlacementConfig(16, 1, 1, 4)
    ends = validation_folds(60, 10, 1, 8)
    assert ends == list(range(52, 60))
    # Always right: chosen, with its margin.
    chosen = select_planner(loads, 10, 1, config, {"greedy": CANDIDATES["greedy"], "peek": cheater(loads, 1)})
    assert chosen.chosen == "peek" and chosen.margin == pytest.approx(np.mean(chosen.realized["peek"]) - np.mean(chosen.realized["greedy"]))
    # Right in 4 of 8 folds, terrible in the rest: not chosen even where its mean is not far behind.
    erratic = select_planner(loads, 10, 1, config, {"greedy": CANDIDATES["greedy"], "erratic": cheater(loads, 1, set(ends[::2]))})
    assert erratic.chosen == BASELINE and "below in 50% (not kept)" in erratic.reason
    # A loss share allowed: the same erratic planner wins only if its mean is higher too.
    lenient = SelectionRule(max_loss_share=1.0, z=0.0)
    mean_gain = np.mean(erratic.realized["erratic"]) - np.mean(erratic.realized["greedy"])
    again = select_planner(loads, 10, 1, config, {"greedy": CANDIDATES["greedy"], "erratic": cheater(loads, 1, set(ends[::2]))}, lenient)
    assert again.chosen == ("erratic" if mean_gain > 0 else BASELINE)
    # Too little history: the baseline, saying why.
    short = select_planner(loads[:12], 10, 1, config, {"greedy": CANDIDATES["greedy"], "peek": cheater(loads, 1)})
    assert short.chosen == BASELINE and "2 validation folds fit" in short.reason and "3 are needed" in short.reason
    with pytest.raises(ValueError, match="baseline"):
        select_planner(loads, 10, 1, config, {"peek": cheater(loads, 1)})
    # The validation's work budget (2 candidates x 1 layer x 16 slots = 32 cells a fold): the newest folds that fit, the reason says so.
    two = select_planner(loads, 10, 1, config, {"greedy": CANDIDATES["greedy"], "peek": cheater(loads, 1)}, SelectionRule(max_cells=64))
    assert two.fold_ends == ends[-2:] and two.chosen == BASELINE and "covers 2 of 8" in two.reason
    none = select_planner(loads, 10, 1, config, {"greedy": CANDIDATES["greedy"], "peek": cheater(loads, 1)}, SelectionRule(max_cells=31))
    assert none.fold_ends == [] and none.chosen == BASELINE and "covers 0 of 8" in none.reason


def test_the_validated_planner_in_a_backtest_is_greedy_until_validated_then_the_hedge():
    loads, config = alternating(40), PlacementConfig(16, 1, 1, 4)
    result = backtest(series_of(loads), 10, 1, config)
    chosen = result.chosen["moetrace"]
    assert chosen[:3] == [BASELINE] * 3 and set(chosen[3:]) <= HEDGED
    realized, greedy, oracle = result.realized["moetrace"], result.realized["greedy"], result.realized["oracle"]
    np.testing.assert_allclose(realized[:3], greedy[:3])  # the baseline deployed: the same balance
    assert realized[3:].mean() > greedy[3:].mean() + 0.1 and (oracle >= greedy - 1e-12).all()
    summary = result.summary()
    assert summary["moetrace"]["chosen_share"][BASELINE] == 3 / 30 and sum(summary["moetrace"]["chosen_share"].values()) == pytest.approx(1)
    closed = summary["moetrace"]["gap_closed"]
    assert closed == pytest.approx((realized.mean() - greedy.mean()) / (oracle.mean() - greedy.mean())) and 0.5 < closed <= 1.0
    assert "held best" in result.reasons["moetrace"] and set(default_planners()) == {"moetrace", "moetrace-robust", "moetrace-fit", "greedy"}


def test_plan_with_selection_explains_the_deployed_plan():
    loads, config = alternating(60), PlacementConfig(16, 1, 1, 4)
    plan, selection = plan_with_selection(loads.sum(axis=0), series_of(loads), config)
    assert selection.chosen in HEDGED and selection.window == selection.every == 12 and len(selection.fold_ends) == 4
    np.testing.assert_array_equal(plan.phy2log, CANDIDATES[selection.chosen](loads, 60, config, None))
    # No time-ordered passes: nothing to validate, the baseline is deployed.
    weight = loads.sum(axis=0)
    plan, selection = plan_with_selection(weight, None, config)
    assert selection.chosen == BASELINE and "no time-ordered passes" in selection.reason and selection.to_dict()["folds"] == 0
    np.testing.assert_array_equal(plan.phy2log, greedy_rebalance(weight, 16, 1, 1, 4))
    np.testing.assert_allclose(plan.gpu_load, predicted_gpu_load(weight, plan.phy2log, 4))


def test_gap_closed():
    assert gap_closed(0.95, 0.9, 1.0) == pytest.approx(0.5)
    assert gap_closed(0.85, 0.9, 1.0) == pytest.approx(-0.5)
    assert gap_closed(0.9, 0.9, 0.9) is None and gap_closed(None, 0.9, 1.0) is None


# ------------------------------------------------------------------------- cost vs benefit
def test_rebalance_value_from_the_definition():
    loads, config = alternating(40), PlacementConfig(16, 1, 1, 4)
    result = backtest(series_of(loads), 10, 2, config, {"greedy": CANDIDATES["greedy"], "moetrace": ValidatedPlanner(2)})
    value = rebalance_value(result, "moetrace", expert_bytes=1_000_000, link_bytes_per_s=1e9)
    kept, new = result.kept["moetrace"], result.realized["moetrace"]
    # The first rebalance replaces the trace's own placement (16 slots, one expert each); it is not counted.
    assert kept[0] == pytest.approx(balance(loads[10:12].sum(axis=0), np.arange(16)[None], 4)) and value.rebalances == len(kept) - 1
    assert value.gain == pytest.approx(np.mean(new[1:] - kept[1:]))
    assert value.saved_share == pytest.approx(np.mean(1 - kept[1:] / new[1:]))
    assert value.stall_s == pytest.approx(result.moved_peak["moetrace"][1:].mean() * 1e6 / 1e9)
    assert value.saved_share > 0
    assert value.break_even_pass_s == pytest.approx(value.stall_s / (2 * value.saved_share))
    assert "does not pay" in recommendation(value, value.break_even_pass_s / 2) and " pays at" in recommendation(value, value.break_even_pass_s * 2)
    before = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(moved_per_gpu(before, before[:, [2, 3, 0, 1, 4, 5, 7, 6]], 4), [2, 2, 0, 2])  # GPU 3 reordered: 2 copies
    with pytest.raises(ValueError, match="not in the backtest"):
        rebalance_value(result, "oracle", None, 1e9)


# ------------------------------------------------------------------------- the regimes
def test_regimes_are_what_their_labels_say():
    domains = len(olmoe_domains())
    for name in REGIMES:
        mix = regime_mix(name, 600, seed=1)
        assert mix.shape == (600, domains) and np.allclose(mix.sum(axis=1), 1) and (mix >= 0).all()
        np.testing.assert_array_equal(mix, regime_mix(name, 600, seed=1))  # seeded
    assert (regime_mix("stationary", 600) == regime_mix("stationary", 600)[0]).all()
    switches = regime_mix("switches", 600)
    assert set(np.unique(switches)) == {0.0, 1.0} and (np.abs(np.diff(switches, axis=0)).sum(axis=1) > 0).sum() >= 2
    order = regime_mix("domain-order", 600)
    np.testing.assert_array_equal(order.argmax(axis=1), np.repeat(np.arange(domains), 100))  # seed 0: the packaged order
    bursts = regime_mix("bursts", 600)
    burst_rows = ~np.isclose(bursts, bursts[0]).all(axis=1)  # the background is the first pass's mix
    assert 20 <= burst_rows.sum() <= 300 and (bursts[burst_rows].max(axis=1) >= 0.8).all()
    slow, fast = (np.abs(np.diff(regime_mix(n, 600), axis=0)).sum(axis=1).mean() for n in ("slow-drift", "drift"))
    assert slow < fast
    passes, request_domain = regime_routes("switches", DriftSpec(num_passes=8, tokens_per_pass=8, requests_per_pass=2, seed=1))
    assert len(passes) == 8 and passes[0].shape == (8, 3, 8) and request_domain.shape == (8, 2)
    assert (request_domain == request_domain[:, :1]).all()  # one domain at a time
    with pytest.raises(ValueError, match="unknown regime"):
        regime_mix("weekly", 10)

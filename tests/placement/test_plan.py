"""Placement: invariants, never worse than greedy replicate-then-pack, clear input errors."""

from __future__ import annotations

import numpy as np
import pytest

from moetrace.placement.checks import PlacementError
from moetrace.placement.eplb import greedy_rebalance
from moetrace.placement.plan import plan_experts, predicted_gpu_load

from ..analysis.helpers import olmoe


def olmoe_weight() -> np.ndarray:
    """18 real layers: 6 domains x 3 MoE layers, 64 experts."""
    return np.concatenate([np.asarray(v, dtype=np.float64) for v in olmoe()["expert_counts"].values()])


def check_plan(plan, weight, replicas, groups, nodes, gpus):
    num_layers, num_experts = weight.shape
    assert plan.phy2log.shape == (num_layers, replicas)
    assert plan.logcnt.shape == (num_layers, num_experts)
    assert (plan.logcnt >= 1).all() and (plan.logcnt.sum(axis=1) == replicas).all()
    width = plan.log2phy.shape[2]
    assert plan.log2phy.shape == (num_layers, num_experts, width) and width == plan.logcnt.max()
    for layer in range(num_layers):
        np.testing.assert_array_equal(np.bincount(plan.phy2log[layer], minlength=num_experts), plan.logcnt[layer])
        for e in range(num_experts):
            slots = plan.log2phy[layer, e]
            real = slots[slots >= 0]
            assert len(real) == plan.logcnt[layer, e] and (slots[len(real):] == -1).all()
            assert (plan.phy2log[layer, real] == e).all()
    if groups % nodes == 0:
        # Hierarchical: every replica of a group's experts sits on the group's one node.
        slots_per_node = replicas // nodes
        group_size = num_experts // groups
        for layer in range(num_layers):
            node_of_slot = np.arange(replicas) // slots_per_node
            for g in range(groups):
                members = (plan.phy2log[layer] // group_size) == g
                assert len(set(node_of_slot[members].tolist())) == 1
    # Predicted load from the definition: each expert's load split over its replicas.
    manual = np.zeros((num_layers, gpus))
    per_gpu = replicas // gpus
    for layer in range(num_layers):
        for p, e in enumerate(plan.phy2log[layer]):
            manual[layer, p // per_gpu] += weight[layer, e] / plan.logcnt[layer, e]
    np.testing.assert_allclose(plan.gpu_load, manual, rtol=1e-12)


def assert_not_behind_eplb(plan, weight: np.ndarray, eplb: np.ndarray, gpus: int) -> None:
    """Per layer, the peak is no higher than EPLB's (EPLB's plan is kept wherever the search cannot beat it)."""
    ours, theirs = plan.gpu_load.max(axis=1), predicted_gpu_load(weight, eplb, gpus).max(axis=1)
    assert (ours <= theirs).all()
    assert plan.balancedness >= weight.sum(axis=1).sum() / gpus / theirs.sum() - 1e-12


CONFIGS = [(r, 8, 2, 8) for r in (64, 72, 80, 96, 128)] + [(r, 4, 1, 8) for r in (64, 72, 80, 96, 128)] + [(72, 8, 3, 24), (96, 8, 3, 24)]


@pytest.mark.parametrize(("replicas", "groups", "nodes", "gpus"), CONFIGS)
def test_olmoe_at_least_as_good_as_greedy(replicas, groups, nodes, gpus):
    weight = olmoe_weight()
    plan = plan_experts(weight, replicas, groups, nodes, gpus)
    check_plan(plan, weight, replicas, groups, nodes, gpus)
    # Per layer (same total, so compare peaks) and overall.
    assert_not_behind_eplb(plan, weight, greedy_rebalance(weight, replicas, groups, nodes, gpus), gpus)
    assert plan.hierarchical == (groups % nodes == 0)


@pytest.mark.parametrize("seed", range(6))
def test_random_skewed_loads_never_worse_than_greedy(seed):
    rng = np.random.default_rng(seed)
    weight = np.floor(rng.lognormal(0, 1.5, size=(4, 32)) * 100)
    weight[:, rng.integers(0, 32, 3)] = 0  # some dead experts
    for replicas, groups, nodes, gpus in [(32, 4, 2, 4), (40, 4, 2, 8), (48, 8, 4, 8), (36, 3, 2, 4)]:
        if 32 % groups:
            continue
        plan = plan_experts(weight, replicas, groups, nodes, gpus)
        check_plan(plan, weight, replicas, groups, nodes, gpus)
        assert_not_behind_eplb(plan, weight, greedy_rebalance(weight, replicas, groups, nodes, gpus), gpus)


#: Inputs where moetrace's search alone ends above EPLB's peak (found over seeds 0-299: 1.30x and 1.03x before EPLB's
#: plan was kept regardless of co-located replicas): vLLM's small hierarchical size and a 64-expert one.
BEHIND_EPLB = [
    pytest.param(16, 24, 8, 4, 8, 183, id="E16-N24-G8-M4-K8"),
    pytest.param(64, 96, 8, 2, 16, 198, id="E64-N96-G8-M2-K16"),
]


@pytest.mark.parametrize(("experts", "replicas", "groups", "nodes", "gpus", "seed"), BEHIND_EPLB)
def test_eplbs_plan_is_kept_where_the_search_cannot_beat_it(experts, replicas, groups, nodes, gpus, seed):
    from moetrace.placement.plan import _best_node_assignment, _plan_limits

    rng = np.random.default_rng(seed)
    weight = rng.integers(1, 1000, (2, experts)).astype(float) if seed % 2 else rng.lognormal(0, 1.5, (2, experts))
    eplb = greedy_rebalance(weight, replicas, groups, nodes, gpus)
    plan = plan_experts(weight, replicas, groups, nodes, gpus)
    check_plan(plan, weight, replicas, groups, nodes, gpus)
    assert_not_behind_eplb(plan, weight, eplb, gpus)
    # Negative control: the search's own plan on these loads is above EPLB's peak in some layer.
    limits = _plan_limits(2, groups, nodes, replicas, None, None)
    _, search_peak = _best_node_assignment(weight, replicas, groups, nodes, gpus, None, weight[None], limits)
    assert (search_peak > predicted_gpu_load(weight, eplb, gpus).max(axis=1) * 1.01).any()


def test_more_replicas_help_and_uniform_is_perfect():
    weight = olmoe_weight()[:3]
    figures = [plan_experts(weight, n, 1, 1, 8).balancedness for n in (64, 128, 256)]
    assert figures[0] < figures[2]
    flat = plan_experts(np.full((2, 16), 10.0), 16, 4, 2, 4)
    assert flat.balancedness == pytest.approx(1.0)
    empty = plan_experts(np.zeros((1, 8)), 8, 1, 1, 2)
    assert empty.balancedness == 1.0 and (empty.logcnt == 1).all()


def test_deepseek_v3_sizes():
    rng = np.random.default_rng(0)
    weight = rng.lognormal(0, 1.0, size=(61, 256)) * 1000
    plan = plan_experts(weight, 288, 8, 4, 32)
    assert plan.phy2log.shape == (61, 288) and plan.gpu_load.shape == (61, 32)
    greedy = predicted_gpu_load(weight, greedy_rebalance(weight, 288, 8, 4, 32), 32)
    assert (plan.gpu_load.max(axis=1) <= greedy.max(axis=1) * (1 + 1e-12)).all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((np.ones((2, 8)), 6, 1, 1, 2), "smaller than the 8 experts"),
        ((np.ones((2, 8)), 10, 1, 1, 4), "not divisible by gpus=4"),
        ((np.ones((2, 8)), 8, 1, 3, 4), "gpus=4 is not divisible by nodes=3"),
        ((np.ones(8), 8, 1, 1, 4), "matrix"),
        ((-np.ones((2, 8)), 8, 1, 1, 4), "non-negative"),
        ((np.full((2, 8), np.nan), 8, 1, 1, 4), "finite"),
        ((np.ones((2, 8)), 0, 1, 1, 4), "replicas must be a positive integer"),
        ((np.ones((2, 8)), 8, 1, 1, 2.0), "gpus must be a positive integer"),
    ],
)
def test_invalid_inputs_name_the_problem(args, message):
    with pytest.raises(PlacementError, match=message):
        plan_experts(*args)


def test_groups_that_do_not_split_evenly_use_the_global_policy():
    """3 groups cannot split 8 experts (EPLB would assert), 3 groups cannot split over 2 nodes: both plan globally, as EPLB's fallback does."""
    weight = np.random.default_rng(1).lognormal(0, 1, (2, 8))
    flat = plan_experts(weight, 8, 1, 1, 4)
    for groups, nodes in ((3, 1), (3, 2)):
        plan = plan_experts(weight, 8, groups, nodes, 4)
        assert not plan.hierarchical
        np.testing.assert_array_equal(plan.phy2log, flat.phy2log)


def test_a_spent_budget_keeps_greedy_packing_and_says_so():
    weight = np.random.default_rng(2).lognormal(0, 1.5, (6, 32))
    spent = plan_experts(weight, 48, 4, 2, 8, budget_s=1e-9)
    assert not spent.within_budget
    check_plan(spent, weight, 48, 4, 2, 8)
    assert plan_experts(weight, 48, 4, 2, 8, budget_s=600.0).within_budget
    with pytest.raises(PlacementError, match="budget_s must be a positive"):
        plan_experts(weight, 48, 4, 2, 8, budget_s=0)

"""EPLB's contract, as its users rely on it, checked against the drop-in and against moetrace's planner.

The expectations are DeepSeek EPLB's published ones (its README example and the
shapes its docstring promises) and what SGLang and vLLM pass to it, written
here in our own words; the plans are checked by properties computed
independently of the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace.placement import PlacementError, plan_experts, rebalance_experts
from moetrace.placement.eplb import greedy_rebalance
from moetrace.placement.plan import log2phy_from_phy2log, predicted_gpu_load

#: DeepSeek EPLB's README example: 2 MoE layers, 12 experts in 4 groups, 16 slots on 2 nodes x 4 GPUs.
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_ARGS = (16, 4, 2, 8)
#: The phy2log the README prints for it.
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1], [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def check_contract(weight: np.ndarray, phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, num_replicas: int, num_gpus: int) -> None:
    """Shapes, dtypes and the three maps agreeing with each other, as EPLB's callers index them."""
    num_layers, num_experts = weight.shape
    p, l2p, cnt = phy2log.numpy(), log2phy.numpy(), logcnt.numpy()
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert p.shape == (num_layers, num_replicas) and cnt.shape == (num_layers, num_experts)
    assert l2p.shape == (num_layers, num_experts, cnt.max())
    assert (cnt >= 1).all() and (cnt.sum(axis=1) == num_replicas).all()
    for layer in range(num_layers):
        assert np.array_equal(np.bincount(p[layer], minlength=num_experts), cnt[layer])
        for expert in range(num_experts):
            slots = l2p[layer, expert]
            assert (slots[cnt[layer, expert]:] == -1).all()
            assert sorted(slots[: cnt[layer, expert]]) == sorted(np.flatnonzero(p[layer] == expert))
    assert num_replicas % num_gpus == 0


def test_readme_example_gives_eplbs_published_plan() -> None:
    weight = torch.tensor(README_WEIGHT)
    phy2log, log2phy, logcnt = rebalance_experts(weight, *README_ARGS)
    assert phy2log.tolist() == README_PHY2LOG
    check_contract(np.asarray(README_WEIGHT), phy2log, log2phy, logcnt, 16, 8)
    # the four copies go to the four hottest loads per replica, as the README's figure shows
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    assert np.array_equal(greedy_rebalance(np.asarray(README_WEIGHT), *README_ARGS), phy2log.numpy())


def test_readme_example_never_puts_two_replicas_of_one_expert_on_one_gpu() -> None:
    phy2log = greedy_rebalance(np.asarray(README_WEIGHT), *README_ARGS)
    per_gpu = phy2log.reshape(2, 8, 2)
    assert all(len(set(gpu.tolist())) == 2 for layer in per_gpu for gpu in layer)


def test_readme_example_through_moetraces_planner_is_valid_and_no_higher() -> None:
    weight = np.asarray(README_WEIGHT, dtype=np.float64)
    plan = plan_experts(weight, *README_ARGS)
    eplb = greedy_rebalance(weight, *README_ARGS)
    check_contract(weight, *(torch.from_numpy(a) for a in (plan.phy2log, plan.log2phy, plan.logcnt)), 16, 8)
    ours, theirs = plan.gpu_load.max(axis=1), predicted_gpu_load(weight, eplb, 8).max(axis=1)
    assert (ours <= theirs + 1e-9).all(), (ours, theirs)


def test_results_come_back_on_the_inputs_device_and_type() -> None:
    weight = torch.tensor(README_WEIGHT, dtype=torch.float16, requires_grad=False)
    out = rebalance_experts(weight, *README_ARGS)
    assert all(isinstance(t, torch.Tensor) and t.device == weight.device for t in out)
    assert out[0].tolist() == README_PHY2LOG  # half precision loads plan the same (exact integers)
    from_numpy = rebalance_experts(np.asarray(README_WEIGHT), *README_ARGS)
    assert all(torch.equal(a, b) for a, b in zip(out, from_numpy, strict=True))
    grad = torch.tensor(README_WEIGHT, dtype=torch.float32, requires_grad=True)
    assert rebalance_experts(grad, *README_ARGS)[0].tolist() == README_PHY2LOG


def test_none_groups_and_indivisible_groups_use_the_global_policy() -> None:
    weight = torch.tensor([[5.0, 1.0, 9.0, 3.0]])
    global_plan = rebalance_experts(weight, 8, 1, 1, 4)
    for groups, nodes in ((None, 1), (3, 1), (3, 2), (1, 2)):  # SGLang passes None; 3 groups cannot split 4 experts
        out = rebalance_experts(weight, 8, groups, nodes, 4)
        assert all(torch.equal(a, b) for a, b in zip(out, global_plan, strict=True)), (groups, nodes)
        check_contract(weight.numpy(), *out, 8, 4)


def test_hierarchical_keeps_each_group_inside_one_node() -> None:
    rng = np.random.default_rng(3)
    weight = rng.integers(0, 500, (4, 32))
    phy2log = rebalance_experts(torch.from_numpy(weight), 48, 8, 4, 16)[0].numpy()
    for row in phy2log:
        nodes = row.reshape(4, 12)
        for node in nodes:
            groups = set((node // 4).tolist())
            assert len(groups) == 2  # G / M = 2 whole groups per node
            assert set(node.tolist()) == {g * 4 + j for g in groups for j in range(4)}


@pytest.mark.parametrize("seed", range(6))
def test_replication_is_water_filling_and_packing_fills_every_gpu(seed: int) -> None:
    rng = np.random.default_rng(seed)
    experts, gpus = int(rng.choice([8, 16, 24])), int(rng.choice([2, 4, 8]))
    replicas = gpus * (experts // gpus + int(rng.integers(1, 4)))
    weight = rng.lognormal(0, 1.5, (3, experts)).astype(np.float32)
    phy2log, log2phy, logcnt = rebalance_experts(torch.from_numpy(weight), replicas, None, 1, gpus)
    check_contract(weight, phy2log, log2phy, logcnt, replicas, gpus)
    cnt = logcnt.numpy()
    per_replica = weight / cnt
    # no copy could move to another expert and lower the largest load per replica
    for layer in range(3):
        peak = per_replica[layer].max()
        donors = cnt[layer] > 1
        if donors.any():
            after = weight[layer][donors] / (cnt[layer][donors] - 1)
            assert after.min() >= peak * (1 - 1e-6)


def test_refusals_name_the_argument() -> None:
    with pytest.raises(PlacementError, match="`replicas` >= 12"):
        rebalance_experts(torch.tensor(README_WEIGHT), 8, 4, 2, 8)
    with pytest.raises(PlacementError, match="not divisible by gpus"):
        rebalance_experts(torch.tensor(README_WEIGHT), 18, 4, 2, 8)
    with pytest.raises(PlacementError, match="num_groups must be a positive integer or None"):
        rebalance_experts(torch.tensor(README_WEIGHT), 16, 0, 2, 8)
    with pytest.raises(PlacementError, match="real-valued"):
        rebalance_experts(torch.ones((1, 4), dtype=torch.bool), 4, 1, 1, 2)


def test_unused_slots_are_nobodys_replica() -> None:
    log2phy, logcnt = log2phy_from_phy2log(np.array([[0, 1, 2, 3, -1, -1]]), 4)
    assert logcnt.tolist() == [[1, 1, 1, 1]]
    assert log2phy.tolist() == [[[0], [1], [2], [3]]]
    log2phy, logcnt = log2phy_from_phy2log(np.array([[3, -1, 1, 3]]), 4)
    assert logcnt.tolist() == [[0, 1, 0, 2]] and log2phy[0, 3].tolist() == [0, 3] and (log2phy[0, 0] == -1).all()
    with pytest.raises(PlacementError, match="outside"):
        log2phy_from_phy2log(np.array([[0, -2]]), 2)

"""The greedy replicate-then-pack placement (the method of DeepSeek's EPLB), for comparison.

Written independently of :mod:`moetrace.analysis.placement` (plain per-layer
loops) so that tests and benchmarks compare two implementations rather than
one with itself. Steps per layer: pack expert groups onto nodes longest-first
(hierarchical when ``groups % nodes == 0``, else one node), give each node's
extra slots one by one to the expert with the highest load per replica, then
pack the replicas longest-first onto the node's GPUs, each GPU taking
``N / K``. No refinement.
"""

from __future__ import annotations

import numpy as np

from .placement import check_placement_args

__all__ = ["greedy_rebalance"]


def _longest_first(loads: list[float], num_bins: int) -> list[int]:
    """Bin of each item: heaviest first onto the lightest bin that is not full."""
    capacity = len(loads) // num_bins
    bin_load = [0.0] * num_bins
    bin_size = [0] * num_bins
    where = [0] * len(loads)
    for item in sorted(range(len(loads)), key=lambda i: -loads[i]):
        target = min((b for b in range(num_bins) if bin_size[b] < capacity), key=lambda b: bin_load[b])
        where[item] = target
        bin_load[target] += loads[item]
        bin_size[target] += 1
    return where


def greedy_rebalance(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> np.ndarray:
    """Greedy placement ``phy2log [L, N]`` for loads ``weight [L, E]`` (same arguments as ``rebalance_experts``)."""
    w = check_placement_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    num_layers, num_experts = w.shape
    if num_groups % num_nodes:
        num_groups = num_nodes = 1
    group_size = num_experts // num_groups
    slots_per_gpu = num_replicas // num_gpus
    gpus_per_node = num_gpus // num_nodes
    phy2log = np.empty((num_layers, num_replicas), dtype=np.int64)
    for layer in range(num_layers):
        row = [float(x) for x in w[layer]]
        group_load = [sum(row[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
        node_of_group = _longest_first(group_load, num_nodes)
        for node in range(num_nodes):
            experts = [g * group_size + j for g in range(num_groups) if node_of_group[g] == node for j in range(group_size)]
            count = {e: 1 for e in experts}
            for _ in range(num_replicas // num_nodes - len(experts)):
                hottest = max(experts, key=lambda e: row[e] / count[e])
                count[hottest] += 1
            replicas = [e for e in experts for _ in range(count[e])]
            gpu_of = _longest_first([row[e] / count[e] for e in replicas], gpus_per_node)
            slot = 0
            base = node * gpus_per_node * slots_per_gpu
            for gpu in range(gpus_per_node):
                for i, e in enumerate(replicas):
                    if gpu_of[i] == gpu:
                        phy2log[layer, base + slot] = e
                        slot += 1
    return phy2log

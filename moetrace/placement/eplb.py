"""DeepSeek EPLB's contract: ``rebalance_experts(weight, ...) -> (phy2log, log2phy, logcnt)``.

A drop-in for code written against DeepSeek's ``eplb.rebalance_experts`` (and
vLLM's and SGLang's copies of it): the same arguments, the same three tensors
with the same shapes, the same plan (replicate-then-pack, EPLB's tie order), on
the input's device. moetrace's own planner, which also keeps deployed slots and
refines the packing, is :func:`moetrace.placement.plan.plan_experts`; this one
exists so that swapping EPLB for moetrace changes nothing a caller relies on.

Behaviour, per MoE layer (written from EPLB's published description and
outputs, not from its code):

1. **Hierarchical** when ``num_groups`` divides into ``num_nodes`` and into the
   experts: the ``G`` groups (contiguous blocks of ``E / G`` experts) go onto
   the ``M`` nodes, heaviest group first onto the lightest node with room
   (``G / M`` per node). **Global** otherwise (one node, one group), which is
   also what ``num_groups=None`` means (SGLang passes it for models without
   expert groups). EPLB asserts when the groups divide into the nodes but not
   into the experts; the global policy is what it uses for every other
   indivisible case, so that is what happens here too.
2. Inside each node, each spare slot goes to the expert with the highest load
   per replica (the first such expert on a tie).
3. A node's replicas (originals, then copies in the order they were made) go
   onto its GPUs heaviest first, each onto the lightest GPU with room (ties:
   the lower GPU); within a GPU, slots follow that assignment order. Equal
   loads are taken in ``torch.sort``'s order, as in EPLB (:mod:`.host_sort`).

``log2phy[l, e, r]`` is the slot of replica ``r`` of expert ``e`` (replica 0 is
the original, then copies in the order they were made), ``-1`` past ``logcnt``.
Loads are compared in float32, as EPLB does.

Only :func:`rebalance_experts` (tensors in and out) imports torch, when called: EPLB's order of
equal loads is :func:`~moetrace.placement.host_sort.descending_order`, so planning from a trace
(``moetrace analyze``, ``moetrace placement``) runs on numpy alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .checks import PlacementError, check_placement_args
from .host_sort import descending_order

if TYPE_CHECKING:
    import torch

__all__ = ["eplb_policy", "greedy_rebalance", "rebalance_experts"]


def eplb_policy(num_experts: int, num_groups: int | None, num_nodes: int) -> tuple[int, int]:
    """``(groups, nodes)`` the plan uses: the given ones when hierarchical placement fits, else ``(1, 1)`` (global)."""
    if num_groups is None or num_groups % num_nodes or num_experts % num_groups:
        return 1, 1
    return num_groups, num_nodes


def _host_array(weight: Any) -> tuple[np.ndarray, torch.device]:
    """``(weight [L, E] as float32 on the host, the device results go back to)``; never reads a device tensor in place."""
    import torch

    if isinstance(weight, torch.Tensor):
        if weight.is_complex() or weight.dtype == torch.bool:
            raise PlacementError(f"weight must be a real-valued tensor of loads, got dtype {weight.dtype}")
        return weight.detach().to(device="cpu", dtype=torch.float32).numpy(), weight.device
    return np.asarray(weight).astype(np.float32), torch.device("cpu")


def _fill(weight: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Items of ``weight [n]`` into ``num_bins`` bins of ``n / bins`` each: ``(bin [n], rank in bin [n])``.

    Heaviest first onto the lightest bin with room (ties: the lower bin); with
    one item per bin, item ``i`` simply goes to bin ``i``. Equal weights are
    taken in the order of ``torch.sort(descending=True)`` on the host, the order
    EPLB's plans follow (it is not by index beyond 16 items).
    """
    capacity = len(weight) // num_bins
    if capacity == 1:
        return np.arange(len(weight)), np.zeros(len(weight), dtype=np.int64)
    load = np.zeros(num_bins, dtype=np.float32)
    size = np.zeros(num_bins, dtype=np.int64)
    where = np.empty(len(weight), dtype=np.int64)
    rank = np.empty(len(weight), dtype=np.int64)
    for item in descending_order(weight):
        room = np.flatnonzero(size < capacity)
        target = int(room[np.argmin(load[room])])
        where[item], rank[item] = target, size[target]
        load[target] += weight[item]
        size[target] += 1
    return where, rank


def _layer(row: np.ndarray, num_slots: int, groups: int, nodes: int, gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """``(phy2log [N], replica rank of each slot [N])`` for one layer's loads ``row [E]``."""
    num_experts = len(row)
    group_size = num_experts // groups
    group_load = row.reshape(groups, group_size).sum(axis=1, dtype=np.float32)
    node_of_group, group_rank = _fill(group_load, nodes)
    slots_per_node, gpus_per_node = num_slots // nodes, gpus // nodes
    slots_per_gpu = num_slots // gpus
    phy2log = np.empty(num_slots, dtype=np.int64)
    replica_rank = np.empty(num_slots, dtype=np.int64)
    for node in range(nodes):
        # the node's experts: its groups in the order they were assigned, each group's experts in order
        mine = np.flatnonzero(node_of_group == node)
        mine = mine[np.argsort(group_rank[mine], kind="stable")]
        experts = (mine[:, None] * group_size + np.arange(group_size)).ravel()
        load = row[experts]
        count = np.ones(len(experts), dtype=np.int64)
        item_expert = list(range(len(experts)))
        item_rank = [0] * len(experts)
        for _ in range(slots_per_node - len(experts)):
            hottest = int(np.argmax(load / count.astype(np.float32)))
            item_expert.append(hottest)
            item_rank.append(int(count[hottest]))
            count[hottest] += 1
        items = np.asarray(item_expert)
        item_load = (load / count.astype(np.float32))[items]
        gpu, rank = _fill(item_load, gpus_per_node)
        slot = node * slots_per_node + gpu * slots_per_gpu + rank
        phy2log[slot] = experts[items]
        replica_rank[slot] = item_rank
    return phy2log, replica_rank


def _plan(host: np.ndarray, num_replicas: int, num_groups: int | None, num_nodes: int, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """``(phy2log [L, N], replica rank of each slot [L, N])`` for float32 loads ``host [L, E]``, arguments checked."""
    if num_groups is not None and (isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups <= 0):
        raise PlacementError(f"num_groups must be a positive integer or None, got {num_groups!r}")
    check_placement_args(host, num_replicas, 1, num_nodes, num_gpus)
    num_layers, num_experts = host.shape
    groups, nodes = eplb_policy(num_experts, None if num_groups is None else int(num_groups), int(num_nodes))
    phy2log = np.empty((num_layers, int(num_replicas)), dtype=np.int64)
    replica_rank = np.empty_like(phy2log)
    for layer in range(num_layers):
        phy2log[layer], replica_rank[layer] = _layer(host[layer], int(num_replicas), groups, nodes, int(num_gpus))
    return phy2log, replica_rank


def greedy_rebalance(weight: np.ndarray, num_replicas: int, num_groups: int | None, num_nodes: int, num_gpus: int) -> np.ndarray:
    """EPLB's plan as ``phy2log [L, N]`` (a numpy array) for loads ``weight [L, E]``: the baseline every planner is judged against."""
    return _plan(np.asarray(weight).astype(np.float32), num_replicas, num_groups, num_nodes, num_gpus)[0]


def rebalance_experts(
    weight: Any, num_replicas: int, num_groups: int | None, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB's entry point: where each physical expert slot's weights live.

    Args:
        weight: ``[L, E]`` load of each logical expert per MoE layer (a tensor
            on any device, or an array).
        num_replicas: ``N`` physical slots, a multiple of ``num_gpus``, ``>= E``.
        num_groups: ``G`` expert groups, or ``None`` for a model without groups.
        num_nodes: ``M`` server nodes.
        num_gpus: ``K`` GPUs, a multiple of ``num_nodes``; GPU ``g`` owns slots ``[g N/K, (g+1) N/K)``.

    Returns:
        ``(phy2log [L, N], log2phy [L, E, X], logcnt [L, E])``, int64 tensors
        on ``weight``'s device; ``X`` is the largest replica count and
        ``log2phy`` is padded with ``-1``.

    Raises:
        PlacementError: sizes that cannot work (fewer slots than experts, GPUs
        that do not divide the slots, nodes that do not divide the GPUs, bad loads).
    """
    import torch

    host, device = _host_array(weight)
    phy2log, replica_rank = _plan(host, num_replicas, num_groups, num_nodes, num_gpus)
    num_layers, num_experts = host.shape
    logcnt = np.zeros((num_layers, num_experts), dtype=np.int64)
    np.add.at(logcnt, (np.arange(num_layers)[:, None], phy2log), 1)
    log2phy = np.full((num_layers, num_experts, int(logcnt.max())), -1, dtype=np.int64)
    layer_index = np.broadcast_to(np.arange(num_layers)[:, None], phy2log.shape)
    log2phy[layer_index, phy2log, replica_rank] = np.arange(num_replicas)
    return tuple(torch.from_numpy(a).to(device) for a in (phy2log, log2phy, logcnt))  # type: ignore[return-value]

"""Expert placement with replication: which GPU hosts which (replicated) expert.

One public entry point, :func:`plan_experts`, in the vocabulary engines
use (DeepSeek EPLB, SGLang, vLLM): ``phy2log [L, N]``, ``log2phy [L, E, X]``
padded with ``-1``, ``logcnt [L, E]``.

Algorithm (per MoE layer; every step starts from the greedy answer and only
accepts strict improvements, so the result is never worse than greedy
replicate-then-pack on the same loads):

1. *Hierarchical* when the groups split evenly over the nodes and the experts
   over the groups (EPLB's policy, :func:`~moetrace.placement.eplb.eplb_policy`): expert groups
   (contiguous blocks of ``E / G`` experts) are packed onto nodes, ``G / M``
   groups per node, so a group's traffic stays inside one node. Two node
   assignments are tried: longest-first greedy packing, and the same refined by
   pairwise swaps of groups between the heaviest node and the others. The
   remaining steps run per node. *Global* otherwise: one node holding all
   experts and GPUs.
2. Replication: each extra physical slot goes to the expert with the highest
   load per replica (``w / count``), which minimises the largest replica load.
3. Packing: replicas are placed longest-first on the lightest GPU with a free
   slot (``N / K`` slots per GPU), then refined by local search: swap a
   replica on the most loaded GPU with a lighter replica elsewhere while that
   lowers the larger of the two GPUs' loads. Each swap strictly lowers the sum
   of squared loads, so the search ends.
4. Of the candidate node assignments, each layer keeps the one with the
   smallest peak GPU load, and EPLB's own plan whenever the search cannot beat
   it: the plan's peak is never above EPLB's on the same loads.

Predicted load assumes a logical expert's tokens split evenly over its
replicas: GPU load ``= sum over its slots of w[e] / logcnt[e]``.

Over 500 lines: the hierarchical planner (groups, nodes, GPUs, replication, move-aware
keeping) is one algorithm whose steps share their arrays and argument checks.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from .. import balance
from .checks import PlacementError, check_placement_args
from .eplb import eplb_policy, greedy_rebalance

__all__ = [
    "PlacementPlan",
    "align_to",
    "check_current",
    "colocated",
    "expected_peak",
    "keep_slots",
    "log2phy_from_phy2log",
    "moved_per_gpu",
    "plan_experts",
    "predicted_gpu_load",
    "replica_load",
    "replicas_moved",
]


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """A placement of ``N`` physical expert slots over ``K`` GPUs.

    Attributes:
        phy2log: ``[L, N]`` logical expert held by physical slot ``p``; GPU
            ``g`` owns slots ``[g * N / K, (g + 1) * N / K)``.
        log2phy: ``[L, E, X]`` physical slots of each logical expert, padded
            with ``-1`` (``X`` = the largest replica count).
        logcnt: ``[L, E]`` replicas per logical expert (>= 1).
        gpu_load: ``[L, K]`` predicted tokens per GPU.
        hierarchical: whether groups were packed onto nodes first.
        within_budget: False when the planner's time budget or work bound ran
            out before every layer's packing search ended (those keep the greedy
            packing or the swaps made so far).
        refine_work: swap evaluations (one candidate swap scored under one
            scenario) the packing refinement made; at most ``plan_experts``'s
            ``refine_work`` when that is given.
    """

    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    gpu_load: np.ndarray
    hierarchical: bool
    within_budget: bool = True
    refine_work: int = 0

    @property
    def balancedness(self) -> float:
        """Predicted overall balancedness over GPUs (``balance.balancedness``)."""
        return balance.balancedness(self.gpu_load)

    @property
    def layer_balancedness(self) -> np.ndarray:
        """Predicted balancedness per layer ``[L]``."""
        return balance.layer_balancedness(self.gpu_load)

    @property
    def colocated(self) -> np.ndarray:
        """Per layer ``[L]``, replicas that share a GPU with another replica of their expert (:func:`colocated`)."""
        return colocated(self.phy2log, self.gpu_load.shape[1])


def colocated(phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """Per layer ``[L]``, replicas beyond the first of an expert on the same GPU of ``phy2log [L, N]``.

    Such a replica buys nothing (its GPU computes the expert's tokens either
    way) and costs a slot; planners place one only when an expert has more
    replicas than its node has GPUs.
    """
    num_layers, num_slots = phy2log.shape
    per_gpu = np.sort(phy2log.reshape(num_layers, num_gpus, num_slots // num_gpus), axis=2)
    return (per_gpu[:, :, 1:] == per_gpu[:, :, :-1]).sum(axis=(1, 2))


def replica_load(weight: np.ndarray, phy2log: np.ndarray) -> np.ndarray:
    """Tokens per physical slot ``[L, N]`` for loads ``weight [..., L, E]`` and a placement ``phy2log [L, N]``
    (``[..., L, N]``): each logical expert's load splits evenly over its replicas."""
    weight = np.asarray(weight, dtype=np.float64)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    num_layers, num_experts = weight.shape[-2:]
    logcnt = np.zeros((num_layers, num_experts), dtype=np.int64)
    np.add.at(logcnt, (np.arange(num_layers)[:, None], phy2log), 1)
    per_replica = np.divide(weight, logcnt, out=np.zeros_like(weight), where=logcnt > 0)
    return np.take_along_axis(per_replica, np.broadcast_to(phy2log, (*weight.shape[:-2], *phy2log.shape)), axis=-1)


def predicted_gpu_load(weight: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """Tokens per GPU ``[L, K]`` for loads ``weight [L, E]`` and a placement ``phy2log [L, N]``.

    Each logical expert's load splits evenly over its replicas (:func:`replica_load`).
    """
    slot_load = replica_load(weight, phy2log)
    return slot_load.reshape(slot_load.shape[0], num_gpus, -1).sum(axis=2)


def log2phy_from_phy2log(phy2log: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(log2phy [L, E, X] padded with -1, logcnt [L, E])`` from ``phy2log [L, N]``.

    A slot holding ``-1`` is unused (SGLang and vLLM pad with it): it is no
    expert's replica and is counted nowhere. Each expert's slots are listed in
    slot order.

    Raises:
        PlacementError: an id outside ``[-1, num_experts)``.
    """
    phy2log = np.asarray(phy2log, dtype=np.int64)
    if phy2log.size and (phy2log.min() < -1 or phy2log.max() >= num_experts):
        raise PlacementError(f"phy2log holds ids outside [0, {num_experts}) other than -1 (an unused slot)")
    num_layers = phy2log.shape[0]
    used = phy2log >= 0
    layer_of = np.broadcast_to(np.arange(num_layers)[:, None], phy2log.shape)
    logcnt = np.zeros((num_layers, num_experts), dtype=np.int64)
    np.add.at(logcnt, (layer_of[used], phy2log[used]), 1)
    log2phy = np.full((num_layers, num_experts, max(int(logcnt.max(initial=0)), 1)), -1, dtype=np.int64)
    for layer in range(num_layers):
        slots = np.flatnonzero(used[layer])
        order = slots[np.argsort(phy2log[layer, slots], kind="stable")]
        experts = phy2log[layer, order]
        starts = np.concatenate([[0], np.cumsum(logcnt[layer])[:-1]])
        log2phy[layer, experts, np.arange(len(order)) - starts[experts]] = order
    return log2phy, logcnt


# ---------------------------------------------------------------------- building blocks
def _replicate(weight: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica counts ``[X, n]`` giving ``num_slots`` slots per row to loads ``weight [X, n]``."""
    rows, n = weight.shape
    counts = np.ones((rows, n), dtype=np.int64)
    index = np.arange(rows)
    for _ in range(num_slots - n):
        counts[index, np.argmax(weight / counts, axis=1)] += 1
    return counts


def _label_cap(labels: np.ndarray, num_packs: int) -> np.ndarray:
    """Most copies of each label a pack may hold, ``[..., labels]``: ``ceil(copies / packs)`` (1 unless a label has more copies than packs)."""
    flat = labels.reshape(-1, labels.shape[-1])
    width = int(labels.max()) + 1
    copies = np.stack([np.bincount(row, minlength=width) for row in flat])
    return (-(-copies // num_packs)).reshape(*labels.shape[:-1], width)


def _greedy_pack(weight: np.ndarray, num_packs: int, labels: np.ndarray | None = None) -> np.ndarray:
    """Pack index ``[X, n]``: longest first onto the lightest pack with room (``n / packs`` each).

    With ``labels [X, n]`` (the expert each replica copies) a pack that already
    holds its share of the label (:func:`_label_cap`: one copy unless the label
    has more copies than there are packs) is skipped while another with room is
    not: two replicas of one expert share a GPU only when there is no other way.
    """
    rows, n = weight.shape
    capacity = n // num_packs
    order = np.argsort(-weight, axis=1, kind="stable")
    loads = np.zeros((rows, num_packs))
    sizes = np.zeros((rows, num_packs), dtype=np.int64)
    pack = np.empty((rows, n), dtype=np.int64)
    index = np.arange(rows)
    holds = cap = None
    if labels is not None:
        holds = np.zeros((rows, num_packs, int(labels.max()) + 1), dtype=np.int64)
        cap = _label_cap(labels, num_packs)
    for step in range(n):
        item = order[:, step]
        cost = np.where(sizes < capacity, loads, np.inf)
        if holds is not None:
            label = labels[index, item]
            full = holds[index, :, label] >= cap[index, label][:, None]
            # a pack with its share of the label ranks after every pack without (still before a full one)
            cost = np.where(full & np.isfinite(cost), cost + 1e300, cost)
        target = np.argmin(cost, axis=1)
        pack[index, item] = target
        loads[index, target] += weight[index, item]
        sizes[index, target] += 1
        if holds is not None:
            holds[index, target, labels[index, item]] += 1
    return pack


def _no_shared_label(pack: np.ndarray, labels: np.ndarray | None, num_packs: int, first: np.ndarray, second: np.ndarray,
                     cap: np.ndarray | None = None) -> np.ndarray | None:
    """Whether swapping items ``first`` and ``second`` (index arrays, broadcast together) keeps every pack within its share of each label.

    The share is :func:`_label_cap` (``cap``: already computed for these labels); ``None`` without labels.
    """
    if labels is None:
        return None
    width = int(labels.max()) + 1
    held = np.bincount(pack * width + labels, minlength=num_packs * width).reshape(num_packs, width)
    cap = _label_cap(labels, num_packs) if cap is None else cap
    a, b = labels[first], labels[second]
    same = a == b
    into_second = held[pack[second], a] - same  # copies of first's label on second's pack once second has left
    into_first = held[pack[first], b] - same
    return ((into_second < cap[a]) & (into_first < cap[b])) | same


@dataclasses.dataclass
class _Limits:
    """What the packing refinement may spend, and whether it ran out.

    Attributes:
        deadline: a ``time.perf_counter()`` value (``None``: no wall clock).
        per_slot: swap evaluations (one candidate swap scored under one
            scenario) a row of ``n`` slots may make: ``per_slot * n``
            (``None``: no bound). Counted in work, so the plan does not depend
            on the machine's speed or load.
        cut: set once either ran out before a row's search ended.
        spent: swap evaluations made so far, over all rows.
    """

    deadline: float | None = None
    per_slot: float | None = None
    cut: bool = False
    spent: int = 0

    def late(self) -> bool:
        """Whether the deadline has passed (the plan is then cut)."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.cut = True
            return True
        return False

    def row_work(self, slots: int) -> float:
        """Swap evaluations a row of ``slots`` slots may make."""
        return np.inf if self.per_slot is None else self.per_slot * slots

    def spend(self, left: float, cost: int) -> float:
        """Charge ``cost`` evaluations to a row with ``left`` to spend; returns what is left, negative (and the plan cut) when it is not enough."""
        if cost > left:
            self.cut = True
        else:
            self.spent += cost
        return left - cost


def _refine_pack(weight: np.ndarray, pack: np.ndarray, num_packs: int, labels: np.ndarray | None = None, limits: _Limits | None = None) -> np.ndarray:
    """Swap-based local search on one row: lower the heaviest pack while that helps. Returns a new ``pack [n]``.

    With ``labels [n]`` no swap puts more than its share of a label on a pack (:func:`_no_shared_label`).
    Each step scores ``slots on the heaviest pack x other slots`` swaps against ``limits``.
    """
    limits = _Limits() if limits is None else limits
    pack = pack.copy()
    loads = np.bincount(pack, weights=weight, minlength=num_packs)
    tolerance = 1e-12 * max(float(loads.max()), 1.0)
    work = limits.row_work(len(weight))
    cap = None if labels is None else _label_cap(labels, num_packs)
    for _ in range(4 * len(weight) + 16):
        if limits.late():
            break
        heavy = int(np.argmax(loads))
        inside = pack == heavy
        mine, others = np.flatnonzero(inside), np.flatnonzero(~inside)
        if len(others) == 0:
            break
        work = limits.spend(work, len(mine) * len(others))
        if work < 0:
            break
        delta = weight[mine][:, None] - weight[others][None, :]
        peak = np.maximum(loads[heavy] - delta, loads[pack[others]][None, :] + delta)
        peak[delta <= 0] = np.inf
        allowed = _no_shared_label(pack, labels, num_packs, mine[:, None], others[None, :], cap)
        if allowed is not None:
            peak[~allowed] = np.inf
        best = int(np.argmin(peak))
        i, j = divmod(best, len(others))
        if not peak[i, j] < loads[heavy] - tolerance:
            break
        a, b = mine[i], others[j]
        light = pack[b]
        pack[a], pack[b] = light, heavy
        loads[heavy] -= delta[i, j]
        loads[light] += delta[i, j]
    return pack


def _peak_without(loads: np.ndarray, hot: np.ndarray) -> np.ndarray:
    """``[S, H, K]``: per scenario, the heaviest pack other than pack ``hot[h]`` and pack ``k`` (``-inf`` when none is left).

    ``loads`` is ``[S, K]``, ``hot`` ``[H]`` pack indices; only the three heaviest packs of each scenario can be the answer.
    """
    packs = loads.shape[1]
    top = np.argsort(-loads, axis=1, kind="stable")[:, : min(3, packs)]  # [S, 3]
    value = np.take_along_axis(loads, top, axis=1)[:, None, None, :]
    slot = top[:, None, None, :]
    allowed = (slot != hot[None, :, None, None]) & (slot != np.arange(packs)[None, None, :, None])  # [S, H, K, 3]
    return np.where(allowed, value, -np.inf).max(axis=3)


def _refine_pack_scenarios(
    weight: np.ndarray, pack: np.ndarray, num_packs: int, labels: np.ndarray | None = None, limits: _Limits | None = None
) -> np.ndarray:
    """Swap search on one row minimising the *mean over scenarios* of the heaviest pack.

    ``weight [S, n]`` is each replica's load under ``S`` scenarios of the next
    window's load; ``pack [n]`` the starting packing. Each step scores every
    swap of a slot on a pack that is the heaviest in some scenario with a slot
    on another pack, under all scenarios at once (``C`` candidate swaps x ``S``
    evaluations, counted against ``limits``; the heaviest pack left by a swap
    comes from an ``[S, H, K]`` table over the ``H`` hot packs), and makes the
    best. Each accepted swap strictly lowers the objective, so the search ends.
    Returns a new ``pack [n]``.
    """
    limits = _Limits() if limits is None else limits
    pack = pack.copy()
    num_scenarios, n = weight.shape
    loads = np.stack([np.bincount(pack, weights=weight[s], minlength=num_packs) for s in range(num_scenarios)])  # [S, K]
    tolerance = 1e-9 * max(float(loads.max()), 1.0)
    work = limits.row_work(n)
    cap = None if labels is None else _label_cap(labels, num_packs)
    for _ in range(4 * n + 16):
        if limits.late():
            break
        peak = loads.max(axis=1)  # [S]
        hot = np.unique(loads.argmax(axis=1))
        mine = np.flatnonzero(np.isin(pack, hot))  # [M] slots on a hot pack; candidates: each with every slot elsewhere
        work = limits.spend(work, len(mine) * (n - n // num_packs) * num_scenarios)
        if work < 0:
            break
        first = pack[mine]
        delta = weight[:, mine, None] - weight[:, None, :]  # [S, M, n]
        rest = np.take(_peak_without(loads, hot)[:, np.searchsorted(hot, first)], pack, axis=2)  # [S, M, n]
        new_peak = np.maximum(np.maximum(loads[:, first, None] - delta, loads[:, None, pack] + delta), rest)
        gain = (peak[:, None, None] - new_peak).mean(axis=0)  # [M, n]
        gain[first[:, None] == pack[None, :]] = -np.inf  # a swap inside one pack changes nothing
        if labels is not None:
            gain[~_no_shared_label(pack, labels, num_packs, mine[:, None], np.arange(n)[None, :], cap)] = -np.inf
        best = int(np.argmax(gain))
        m, j = divmod(best, n)
        if not gain[m, j] > tolerance:
            break
        i = mine[m]
        step = delta[:, m, j]
        loads[:, pack[i]] -= step
        loads[:, pack[j]] += step
        pack[i], pack[j] = pack[j], pack[i]
    return pack


def _pack(
    weight: np.ndarray, num_packs: int, scenarios: np.ndarray | None = None, labels: np.ndarray | None = None, limits: _Limits | None = None
) -> np.ndarray:
    """Greedy packing refined by local search, for every row of ``weight [X, n]``.

    With ``scenarios [S, X, n]`` the refinement minimises the mean over scenarios
    of the heaviest pack instead of the heaviest pack under ``weight``; with
    ``labels [X, n]`` no pack gets a label twice unless it cannot be helped.
    Each row's search spends at most its share of ``limits`` (a row that runs
    out keeps the swaps made so far; past the deadline the rows not reached keep
    their greedy packing: valid, only less refined).
    """
    limits = _Limits() if limits is None else limits
    pack = _greedy_pack(weight, num_packs, labels)
    if num_packs == 1 or weight.shape[1] == num_packs:
        return pack
    for r in range(weight.shape[0]):
        if limits.late():
            break
        row_labels = None if labels is None else labels[r]
        if scenarios is not None:
            pack[r] = _refine_pack_scenarios(scenarios[:, r], pack[r], num_packs, row_labels, limits)
        else:
            pack[r] = _refine_pack(weight[r], pack[r], num_packs, row_labels, limits)
    return pack


def _place_in_nodes(
    weight: np.ndarray,
    node_of_group: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    scenarios: np.ndarray | None = None,
    limits: _Limits | None = None,
) -> np.ndarray:
    """``phy2log [L, N]`` for a given group-to-node assignment ``node_of_group [L, G]``.

    Replica counts and the initial packing follow ``weight [L, E]``; with
    ``scenarios [S, L, E]`` the packing is refined for their mean peak.
    """
    num_layers, num_experts = weight.shape
    group_size = num_experts // num_groups
    experts_per_node = num_experts // num_nodes
    slots_per_node = num_replicas // num_nodes
    gpus_per_node = num_gpus // num_nodes
    slots_per_gpu = num_replicas // num_gpus
    # Logical experts of each node, ordered by group then position: [L, M, E/M].
    group_order = np.argsort(node_of_group, axis=1, kind="stable")
    node_experts = (group_order[:, :, None] * group_size + np.arange(group_size)).reshape(num_layers, num_nodes, experts_per_node)
    node_weight = np.take_along_axis(weight, node_experts.reshape(num_layers, -1), axis=1).reshape(-1, experts_per_node)
    counts = _replicate(node_weight, slots_per_node)  # [L*M, E/M]
    replica_item = np.stack([np.repeat(np.arange(experts_per_node), c) for c in counts])  # [L*M, N/M]
    replica_weight = np.take_along_axis(node_weight / counts, replica_item, axis=1)
    replica_scenarios = None
    if scenarios is not None:
        flat_index = node_experts.reshape(num_layers, -1)
        scenario_weight = np.stack([np.take_along_axis(s, flat_index, axis=1).reshape(-1, experts_per_node) for s in scenarios])
        replica_scenarios = np.take_along_axis(scenario_weight / counts, np.broadcast_to(replica_item, scenario_weight.shape[:1] + replica_item.shape), axis=2)
    gpu = _pack(replica_weight, gpus_per_node, replica_scenarios, replica_item, limits)  # local GPU of each replica, no expert twice on one
    phy2log = np.empty((num_layers * num_nodes, slots_per_node), dtype=np.int64)
    flat_experts = node_experts.reshape(-1, experts_per_node)
    for row in range(num_layers * num_nodes):
        order = np.argsort(gpu[row], kind="stable")  # slots grouped by GPU, N/K each
        phy2log[row] = flat_experts[row, replica_item[row, order]]
    assert slots_per_gpu * gpus_per_node == slots_per_node
    return phy2log.reshape(num_layers, num_replicas)


def expected_peak(loads: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """Mean over scenarios of each layer's heaviest GPU: ``[L]`` for ``loads [S, L, E]`` and ``phy2log [L, N]``."""
    return np.mean([predicted_gpu_load(s, phy2log, num_gpus).max(axis=1) for s in loads], axis=0)


def _match(overlap: np.ndarray) -> np.ndarray:
    """Greedy maximum-overlap matching: ``partner[i]`` (a permutation) for a square ``overlap [n, n]``."""
    n = len(overlap)
    partner = np.full(n, -1, dtype=np.int64)
    free = overlap.astype(np.float64).copy()
    for _ in range(n):
        i, j = divmod(int(np.argmax(free)), n)
        partner[i] = j
        free[i, :] = -1
        free[:, j] = -1
    return partner


def align_to(current: np.ndarray, phy2log: np.ndarray, num_nodes: int, num_gpus: int) -> np.ndarray:
    """Renumber the GPUs (and nodes) of ``phy2log [L, N]`` and order each GPU's slots to keep replicas where ``current`` has them.

    Which physical GPU gets which set of replicas, and in which of its slots,
    does not change any load, so the plan's balance is untouched; only fewer
    weights are copied. Nodes are matched first (by shared replicas), then the
    GPUs inside each node; then an expert a GPU keeps stays in its slot
    (:func:`keep_slots`: in vLLM and SGLang a slot is a weight buffer).
    """
    num_layers, num_slots = phy2log.shape
    num_experts = int(max(current.max(), phy2log.max())) + 1
    per_gpu, gpus_per_node = num_slots // num_gpus, num_gpus // num_nodes
    out = np.empty_like(phy2log)

    def held(row: np.ndarray, units: int) -> np.ndarray:  # [units, E] replica counts
        unit = np.arange(num_slots) // (num_slots // units)
        counts = np.zeros((units, num_experts), dtype=np.int64)
        np.add.at(counts, (unit, row), 1)
        return counts

    for layer in range(num_layers):
        new_nodes, old_nodes = held(phy2log[layer], num_nodes), held(current[layer], num_nodes)
        node_target = _match(np.minimum(new_nodes[:, None, :], old_nodes[None, :, :]).sum(axis=2))
        new_gpus, old_gpus = held(phy2log[layer], num_gpus), held(current[layer], num_gpus)
        for node in range(num_nodes):
            target = node_target[node]
            mine = np.arange(node * gpus_per_node, (node + 1) * gpus_per_node)
            theirs = np.arange(target * gpus_per_node, (target + 1) * gpus_per_node)
            gpu_target = _match(np.minimum(new_gpus[mine][:, None, :], old_gpus[theirs][None, :, :]).sum(axis=2))
            for local, gpu in enumerate(mine):
                dest = theirs[gpu_target[local]]
                out[layer, dest * per_gpu : (dest + 1) * per_gpu] = phy2log[layer, gpu * per_gpu : (gpu + 1) * per_gpu]
    return keep_slots(current, out, num_gpus)


def keep_slots(current: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """Reorder the slots inside each GPU of ``phy2log [L, N]`` so that every expert a GPU holds in both keeps its ``current`` slot.

    Per layer and GPU, an expert held before and after keeps the slot it had
    (one slot per replica kept); the GPU's new experts fill its freed slots in
    their order in ``phy2log``. Each GPU holds the same experts as in
    ``phy2log``, so no load changes; the slots that change are exactly the
    weight copies the move needs (:func:`moved_per_gpu`), the fewest possible
    for this GPU assignment.
    """
    current = np.asarray(current, dtype=np.int64)
    out = np.asarray(phy2log, dtype=np.int64).copy()
    per_gpu = out.shape[1] // num_gpus
    for layer in range(out.shape[0]):
        for start in range(0, out.shape[1], per_gpu):
            old, new = current[layer, start : start + per_gpu], out[layer, start : start + per_gpu]
            left = list(new)
            kept = np.full(per_gpu, -1, dtype=np.int64)
            for slot, expert in enumerate(old.tolist()):
                if expert in left:
                    left.remove(expert)
                    kept[slot] = expert
            kept[kept < 0] = left
            out[layer, start : start + per_gpu] = kept
    return out


def check_current(current: np.ndarray, num_layers: int, num_experts: int, num_replicas: int) -> np.ndarray:
    """Validate a deployed placement ``phy2log [L, N]``; returns it as int64.

    Raises:
        PlacementError: wrong shape, ids outside ``[0, E)`` or an expert without a slot.
    """
    phy2log = np.asarray(current)
    if phy2log.shape != (num_layers, num_replicas):
        raise PlacementError(
            f"the current placement has shape {list(phy2log.shape)} but the plan needs [layers={num_layers}, replicas={num_replicas}]; "
            "pass the plan deployed for the same layers and `replicas`"
        )
    if not np.issubdtype(phy2log.dtype, np.integer) or (phy2log < 0).any() or (phy2log >= num_experts).any():
        raise PlacementError(f"the current placement must hold expert ids in [0, {num_experts})")
    for layer in range(num_layers):
        if len(np.unique(phy2log[layer])) != num_experts:
            raise PlacementError(f"the current placement leaves experts of layer index {layer} without a slot; every expert needs one")
    return phy2log.astype(np.int64)


def plan_experts(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    scenarios: np.ndarray | None = None,
    current: np.ndarray | None = None,
    keep_tolerance: float = 0.0,
    budget_s: float | None = None,
    refine_work: int | None = None,
) -> PlacementPlan:
    """Plan where each (replicated) expert lives so that GPU loads are balanced.

    Args:
        weight: ``[L, E]`` load of each logical expert per MoE layer (e.g. a
            trace's ``logical_count``).
        num_replicas: ``N`` physical expert slots in total, a multiple of
            ``num_gpus`` and at least ``E``.
        num_groups: ``G`` expert groups (contiguous blocks of ``E / G``
            experts); when they do not split evenly over the nodes, or
            the experts over them, the global policy is used (as EPLB does).
        num_nodes: ``M`` server nodes (fast links inside a node).
        num_gpus: ``K`` GPUs, a multiple of ``num_nodes``.
        scenarios: optional ``[S, L, E]`` loads the next window may bring
            (e.g. sub-windows of the planning window). Replica counts follow
            ``weight``; the packing then minimises the mean over scenarios of
            each layer's heaviest GPU instead of the heaviest GPU under ``weight``.
        current: optional deployed placement ``phy2log [L, N]``. The plan's
            GPUs are renumbered to keep replicas where they are (:func:`align_to`,
            no change in balance), and a layer keeps the deployed placement
            unless the new plan lowers the expected heaviest GPU by more than
            ``keep_tolerance`` (a fraction), so moves are made only when worth it.
        keep_tolerance: see ``current``; ``>= 0``.
        budget_s: seconds the packing refinement may take (``None``: no limit).
            Layers not refined in time keep the greedy packing (never worse
            than EPLB's plan, which is compared per layer in any case);
            :attr:`PlacementPlan.within_budget` says whether it ran out.
            A wall clock makes the plan depend on the machine's load;
            ``refine_work`` does not.
        refine_work: swap evaluations (one candidate swap scored under one
            scenario) the whole plan's packing refinement may make (``None``:
            no bound); each row (a layer's node) of ``n`` slots gets its share
            ``refine_work * n / (L * N)`` (``L * (G + 2N)`` when two node
            assignments are refined), so the cost is linear in the plan's
            cells. A row that runs out keeps the swaps it made;
            :attr:`PlacementPlan.within_budget` is then False and
            :attr:`PlacementPlan.refine_work` says what was spent.

    Returns:
        A :class:`PlacementPlan` with ``phy2log [L, N]``, ``log2phy [L, E, X]``
        (``-1`` padded), ``logcnt [L, E]`` and the predicted ``gpu_load [L, K]``
        (under ``weight``). Hierarchical (groups packed onto nodes) when
        ``G % M == 0``, global otherwise. EPLB's plan (:func:`greedy_rebalance`)
        replaces a layer whenever the search cannot beat it, so without
        ``scenarios`` and ``current`` no layer's heaviest GPU is heavier than
        EPLB's (with ``scenarios``: no layer's mean heaviest GPU over them).

    Raises:
        PlacementError: inconsistent sizes (see :func:`check_placement_args`),
        scenarios of another shape, or an invalid ``current``.
    """
    w = check_placement_args(weight, num_replicas, num_groups, num_nodes, num_gpus)
    scenarios = _check_plan_options(w, scenarios, keep_tolerance, budget_s, refine_work)
    judged = w[None] if scenarios is None else scenarios
    groups, nodes = eplb_policy(w.shape[1], num_groups, num_nodes)
    limits = _plan_limits(w.shape[0], groups, nodes, num_replicas, budget_s, refine_work)
    best_plan, best_peak = _best_node_assignment(w, num_replicas, groups, nodes, num_gpus, scenarios, judged, limits)
    eplb = greedy_rebalance(w, num_replicas, num_groups, num_nodes, num_gpus)
    best_plan, best_peak = _lower_peak_per_layer(best_plan, best_peak, eplb, expected_peak(judged, eplb, num_gpus), tolerance=0.0)
    if current is not None:
        deployed = check_current(current, *w.shape, num_replicas)
        best_plan = _keep_deployed(align_to(deployed, best_plan, nodes, num_gpus), best_peak, deployed, judged, num_gpus, keep_tolerance)
    log2phy, logcnt = log2phy_from_phy2log(best_plan, w.shape[1])
    return PlacementPlan(phy2log=best_plan, log2phy=log2phy, logcnt=logcnt, gpu_load=predicted_gpu_load(w, best_plan, num_gpus),
                         hierarchical=nodes == num_nodes and groups == num_groups, within_budget=not (limits.cut or limits.late()),
                         refine_work=limits.spent)


def _check_plan_options(w: np.ndarray, scenarios: np.ndarray | None, keep_tolerance: float, budget_s: float | None,
                        refine_work: int | None) -> np.ndarray | None:
    """The options of :func:`plan_experts` beside the sizes, checked; returns ``scenarios`` as float64 ``[S, L, E]``."""
    num_layers, num_experts = w.shape
    if scenarios is not None:
        scenarios = np.asarray(scenarios, dtype=np.float64)
        if scenarios.ndim != 3 or scenarios.shape[1:] != w.shape or len(scenarios) == 0:
            raise PlacementError(f"scenarios must be [S, layers, experts] = [S, {num_layers}, {num_experts}], got {list(scenarios.shape)}")
        if not np.isfinite(scenarios).all() or (scenarios < 0).any():
            raise PlacementError("scenarios must hold finite, non-negative loads")
    if not keep_tolerance >= 0:
        raise PlacementError(f"keep_tolerance must be >= 0, got {keep_tolerance!r}")
    if budget_s is not None and not budget_s > 0:
        raise PlacementError(f"budget_s must be a positive number of seconds or None, got {budget_s!r}")
    if refine_work is not None and (isinstance(refine_work, bool) or not isinstance(refine_work, (int, np.integer)) or refine_work < 0):
        raise PlacementError(f"refine_work must be a non-negative number of swap evaluations or None, got {refine_work!r}")
    return scenarios


def _plan_limits(num_layers: int, groups: int, nodes: int, num_replicas: int, budget_s: float | None, refine_work: int | None) -> _Limits:
    """The refinement's limits: the work shared per slot over what may be refined (the groups over nodes, then the
    replicas over GPUs once per node assignment)."""
    cells = num_layers * (groups + 2 * num_replicas) if 1 < nodes < groups else num_layers * num_replicas
    return _Limits(deadline=None if budget_s is None else time.perf_counter() + budget_s, per_slot=None if refine_work is None else refine_work / cells)


def _lower_peak_per_layer(plan: np.ndarray, peak: np.ndarray, other: np.ndarray, other_peak: np.ndarray,
                          tolerance: float = 1e-9) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, ``other``'s rows of ``phy2log [L, N]`` where its peak ``[L]`` is lower by more than ``tolerance`` (relative)."""
    better = other_peak < peak - tolerance * np.maximum(peak, 1.0)
    plan = plan.copy()
    plan[better] = other[better]
    return plan, np.where(better, other_peak, peak)


def _best_node_assignment(w: np.ndarray, num_replicas: int, groups: int, nodes: int, num_gpus: int, scenarios: np.ndarray | None,
                          judged: np.ndarray, limits: _Limits) -> tuple[np.ndarray, np.ndarray]:
    """``(phy2log [L, N], expected peak [L])``: per layer the better of the greedy group-to-node packing and its refinement."""
    group_weight = w.reshape(w.shape[0], groups, -1).sum(axis=2)
    greedy_nodes = _greedy_pack(group_weight, nodes)
    candidates = [greedy_nodes]
    if 1 < nodes < groups:
        refined = _pack(group_weight, nodes, limits=limits)
        if (refined != greedy_nodes).any():
            candidates.append(refined)
    best_plan = _place_in_nodes(w, candidates[0], num_replicas, groups, nodes, num_gpus, scenarios, limits)
    best_peak = expected_peak(judged, best_plan, num_gpus)
    for node_of_group in candidates[1:]:
        phy2log = _place_in_nodes(w, node_of_group, num_replicas, groups, nodes, num_gpus, scenarios, limits)
        best_plan, best_peak = _lower_peak_per_layer(best_plan, best_peak, phy2log, expected_peak(judged, phy2log, num_gpus))
    return best_plan, best_peak


def _keep_deployed(plan: np.ndarray, peak: np.ndarray, deployed: np.ndarray, judged: np.ndarray, num_gpus: int, keep_tolerance: float) -> np.ndarray:
    """Per layer, the deployed rows unless ``plan`` lowers the expected heaviest GPU by more than ``keep_tolerance``."""
    stay = expected_peak(judged, deployed, num_gpus) * (1 - keep_tolerance) <= peak + 1e-9 * np.maximum(peak, 1.0)
    plan = plan.copy()
    plan[stay] = deployed[stay]
    return plan


def moved_per_gpu(before: np.ndarray, after: np.ndarray, num_gpus: int) -> np.ndarray:
    """Weight copies each GPU receives, ``[K]`` summed over layers, to go from ``before`` to ``after`` (both ``phy2log [L, N]``).

    A slot is a weight buffer (vLLM, SGLang): every slot whose expert changes
    is one expert's weights copied into it, whether from another GPU or from
    another slot of the same GPU. :func:`align_to` keeps this to the experts a
    GPU gains.
    """
    num_layers, num_slots = after.shape
    changed = np.asarray(before) != np.asarray(after)
    return changed.reshape(num_layers, num_gpus, num_slots // num_gpus).sum(axis=(0, 2))


def replicas_moved(before: np.ndarray, after: np.ndarray, num_gpus: int) -> int:
    """Weight copies in all to go from ``before`` to ``after`` (:func:`moved_per_gpu` summed): slots whose expert changes."""
    return int(moved_per_gpu(before, after, num_gpus).sum())

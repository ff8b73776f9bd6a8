"""Balance metrics: one definition each, shared by the snapshot, analysis, exporters and docs.

Shapes: ``counts`` is ``[L, E]`` (layers x experts), ``load`` is ``[L, R]``
(layers x EP ranks). Everything is plain numpy on the host.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "HOT_EXPERTS",
    "HOT_EXPERT_DIVISOR",
    "LoadMetrics",
    "balancedness",
    "dead_experts",
    "entropy_ratio",
    "expert_cv",
    "expert_excess",
    "expert_imbalance",
    "hot_expert_count",
    "hot_expert_share",
    "js_divergence",
    "layer_balancedness",
    "layer_imbalance",
    "overall_expert_imbalance",
    "overall_hot_expert_share",
    "rank_load",
    "top_cells",
]

#: How many (layer, expert) cells a rank exports as its hottest (a fixed top-N, whatever L and E).
HOT_EXPERTS = 10
#: The "hot" experts are the hottest ``ceil(E / HOT_EXPERT_DIVISOR)`` of a layer (10%, at least one).
HOT_EXPERT_DIVISOR = 10


def rank_load(counts: np.ndarray, ep_size: int) -> np.ndarray:
    """Tokens routed to each EP rank ``[L, R]`` from per-physical-expert counts ``[L, P]``.

    Physical experts are split contiguously: rank ``r`` owns ``[r*P/R, (r+1)*P/R)``.
    """
    counts = np.asarray(counts)
    num_layers, num_physical = counts.shape
    if num_physical % ep_size:
        raise ValueError(f"{num_physical} physical experts cannot be split over ep_size={ep_size}")
    return counts.reshape(num_layers, ep_size, num_physical // ep_size).sum(axis=2)


def expert_excess(counts: np.ndarray) -> np.ndarray:
    """Copies above an even share, per layer: ``counts - counts.sum(-1) / E`` ``[..., L, E]`` (float64).

    Additive over any split of the tokens (requests, labels): the excess of the
    sum is the sum of the parts' excesses, so a part's share of a hot expert's
    excess is its contribution to the imbalance, not only to the load. Applied
    to rank loads ``[..., L, R]`` it gives each rank's excess over the mean rank.
    """
    c = np.asarray(counts, dtype=np.float64)
    return c - c.sum(axis=-1, keepdims=True) / c.shape[-1]


def layer_balancedness(load: np.ndarray) -> np.ndarray:
    """Per-layer balancedness ``mean_r T[l,r] / max_r T[l,r]`` ``[L]``; 1.0 for an empty layer."""
    load = np.asarray(load, dtype=np.float64)
    peak = load.max(axis=1)
    return np.divide(load.mean(axis=1), peak, out=np.ones_like(peak), where=peak > 0)


def balancedness(load: np.ndarray) -> float:
    """Overall balancedness ``sum_l mean_r T[l,r] / sum_l max_r T[l,r]`` (vLLM's form; 1 = perfect)."""
    load = np.asarray(load, dtype=np.float64)
    peak = float(load.max(axis=1).sum())
    return float(load.mean(axis=1).sum() / peak) if peak > 0 else 1.0


def layer_imbalance(load: np.ndarray) -> np.ndarray:
    """Per-layer imbalance ``max / mean`` ``[L]`` (1 = perfect); 1.0 for an empty layer."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean(axis=1)
    return np.divide(load.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)


def expert_imbalance(counts: np.ndarray) -> np.ndarray:
    """Per-layer expert imbalance ``max_e c[l,e] / mean_e c[l,e]`` ``[L]`` over logical experts (1 = even).

    :func:`layer_imbalance` taken over experts instead of EP ranks; 1.0 for an empty layer.
    It needs no EP: it is how much more than its share the hottest expert gets.
    """
    return layer_imbalance(counts)


def overall_expert_imbalance(counts: np.ndarray) -> float:
    """Expert imbalance over all layers ``Σ_l max_e c[l,e] / Σ_l mean_e c[l,e]`` (1 = even; 1.0 when empty).

    The reciprocal of :func:`balancedness` taken over experts: layers weigh by their load.
    """
    return 1.0 / balancedness(counts)


def expert_cv(counts: np.ndarray) -> np.ndarray:
    """Coefficient of variation of the load over logical experts ``std_e / mean_e`` ``[L]`` (0 = even).

    Population standard deviation (``ddof=0``); 0.0 for an empty layer.
    """
    counts = np.asarray(counts, dtype=np.float64)
    mean = counts.mean(axis=1)
    return np.divide(counts.std(axis=1), mean, out=np.zeros_like(mean), where=mean > 0)


def hot_expert_count(num_experts: int) -> int:
    """How many experts are "hot": the hottest 10%, ``ceil(E / HOT_EXPERT_DIVISOR)``, at least 1."""
    return max(1, -(-num_experts // HOT_EXPERT_DIVISOR))


def _hot_and_total(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    counts = np.asarray(counts, dtype=np.float64)
    hot = -np.sort(-counts, axis=1)[:, : hot_expert_count(counts.shape[1])].sum(axis=1)
    return hot, counts.sum(axis=1)


def hot_expert_share(counts: np.ndarray) -> np.ndarray:
    """Share of a layer's assignments taken by its hottest 10% of experts ``[L]`` (:func:`hot_expert_count`).

    An even load gives ``hot_expert_count(E) / E``; 0.0 for an empty layer.
    """
    hot, total = _hot_and_total(counts)
    return np.divide(hot, total, out=np.zeros_like(total), where=total > 0)


def overall_hot_expert_share(counts: np.ndarray) -> float:
    """Share of all assignments taken by each layer's hottest 10% of experts ``Σ_l hot_l / Σ_l total_l``."""
    hot, total = _hot_and_total(counts)
    return float(hot.sum() / total.sum()) if total.sum() > 0 else 0.0


def entropy_ratio(counts: np.ndarray) -> np.ndarray:
    """Routing entropy per layer normalised by ``log(E)`` ``[L]`` (1 = uniform); 0.0 for an empty layer."""
    counts = np.asarray(counts, dtype=np.float64)
    num_experts = counts.shape[1]
    totals = counts.sum(axis=1, keepdims=True)
    p = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    return h / np.log(num_experts) if num_experts > 1 else np.zeros(counts.shape[0])


def dead_experts(counts: np.ndarray) -> np.ndarray:
    """Experts that received no token, per layer ``[L]``."""
    return (np.asarray(counts) == 0).sum(axis=1)


def top_cells(counts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``n`` largest cells of ``counts [L, E]`` over all layers: ``(layer index [n'], expert [n'], count [n'])``.

    ``n' = min(n, L*E)``, largest first; ties go to the lower (layer, expert) index.
    """
    flat = np.asarray(counts).reshape(-1)
    n = min(int(n), flat.size)
    order = np.argsort(-flat, kind="stable")[:n]
    layer, expert = np.divmod(order, np.asarray(counts).shape[1])
    return layer, expert, flat[order]


def js_divergence(counts_a: np.ndarray, counts_b: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence (base 2, in ``[0, 1]``) between two count rows per layer ``[L]``.

    ``counts_a`` and ``counts_b`` are ``[L, E]``; each row is normalised to a
    distribution. A layer where either side is empty gives 0.0 (nothing to compare).
    """
    a = np.asarray(counts_a, dtype=np.float64)
    b = np.asarray(counts_b, dtype=np.float64)
    ta, tb = a.sum(axis=1, keepdims=True), b.sum(axis=1, keepdims=True)
    p = np.divide(a, ta, out=np.zeros_like(a), where=ta > 0)
    q = np.divide(b, tb, out=np.zeros_like(b), where=tb > 0)
    m = 0.5 * (p + q)

    def kl(x: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(x > 0, x * np.log2(np.where(x > 0, x, 1.0) / np.where(m > 0, m, 1.0)), 0.0).sum(axis=1)

    js = 0.5 * kl(p) + 0.5 * kl(q)
    return np.where((ta[:, 0] > 0) & (tb[:, 0] > 0), np.clip(js, 0.0, 1.0), 0.0)


class LoadMetrics:
    """Balance figures as properties of anything with counts: a mixin.

    The class using it provides ``physical_count [L, P]``, ``logical_count
    [L, E]`` and ``ep_size``; per-rank load comes from physical counts, per-expert
    figures from logical counts.
    """

    physical_count: np.ndarray
    logical_count: np.ndarray
    ep_size: int

    @property
    def rank_load(self) -> np.ndarray:
        """``T[l, r]``: token copies routed to experts of EP rank ``r`` ``[L, R]``."""
        return rank_load(self.physical_count, self.ep_size)

    @property
    def balancedness(self) -> float:
        return balancedness(self.rank_load)

    @property
    def layer_balancedness(self) -> np.ndarray:
        return layer_balancedness(self.rank_load)

    @property
    def layer_imbalance(self) -> np.ndarray:
        return layer_imbalance(self.rank_load)

    @property
    def expert_imbalance(self) -> np.ndarray:
        """Per-layer ``max_e / mean_e`` over logical experts ``[L]`` (needs no EP)."""
        return expert_imbalance(self.logical_count)

    @property
    def overall_expert_imbalance(self) -> float:
        return overall_expert_imbalance(self.logical_count)

    @property
    def expert_cv(self) -> np.ndarray:
        return expert_cv(self.logical_count)

    @property
    def hot_expert_share(self) -> np.ndarray:
        return hot_expert_share(self.logical_count)

    @property
    def overall_hot_expert_share(self) -> float:
        return overall_hot_expert_share(self.logical_count)

    @property
    def entropy_ratio(self) -> np.ndarray:
        return entropy_ratio(self.logical_count)

    @property
    def dead_experts(self) -> np.ndarray:
        return dead_experts(self.logical_count)

    @property
    def hot_experts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The :data:`HOT_EXPERTS` hottest (layer, logical expert) cells: ``top_cells(logical_count, HOT_EXPERTS)``."""
        return top_cells(self.logical_count, HOT_EXPERTS)

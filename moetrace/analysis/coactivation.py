"""Expert co-activation and cross-layer transitions from per-token routing.

- co-activation ``C[l, a, b]``: tokens that chose both logical experts ``a``
  and ``b`` (``a != b``) in layer ``l``; symmetric, zero diagonal.
- transition ``T[i, a, b]``: tokens whose ``j``-th choice was expert ``a`` in
  selected layer ``i`` and expert ``b`` in selected layer ``i + 1`` (same
  slot ``j``, as in the OLMoE routing statistics).

Counting is exact integer ``bincount`` over bounded sub-chunks, so memory is
``O(L·E²)`` for the result plus a fixed working set.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["CoactivationAccumulator", "mutual_information_bits", "top_pairs", "top_transitions"]

#: Upper bound on pair keys materialised at once (bounds the working set).
_MAX_KEYS = 1 << 22


@dataclasses.dataclass
class CoactivationAccumulator:
    """Accumulate co-activation ``[L, E, E]`` and transitions ``[L-1, E, E]``.

    Args:
        physical_to_logical: ``[L, P]`` map of the selected layers.
        layer_index: compact indices ``[L]`` of the selected layers in ``topk_ids``.
        num_experts: logical experts ``E``.
    """

    physical_to_logical: np.ndarray
    layer_index: np.ndarray
    num_experts: int

    def __post_init__(self) -> None:
        num_layers = len(self.layer_index)
        e = self.num_experts
        self.coactivation = np.zeros((num_layers, e, e), dtype=np.int64)
        self.transitions = np.zeros((max(num_layers - 1, 0), e, e), dtype=np.int64)
        self.expert_tokens = np.zeros((num_layers, e), dtype=np.int64)  # tokens choosing e (once per token)
        self.routed_tokens = np.zeros(num_layers, dtype=np.int64)  # tokens with >= 1 valid choice
        self._map = np.asarray(self.physical_to_logical, dtype=np.int64)
        self._identity = bool((self._map == np.arange(self._map.shape[1])).all())

    def _logical(self, topk_ids: np.ndarray) -> np.ndarray:
        ids = topk_ids[:, self.layer_index, :].astype(np.int64)
        if self._identity:
            return np.where(ids >= 0, ids, -1)  # -2 (invalid) reads as "none"
        layers = np.arange(ids.shape[1])[None, :, None]
        logical = self._map[layers, np.clip(ids, 0, self._map.shape[1] - 1)]
        return np.where(ids >= 0, logical, -1)

    def add(self, topk_ids: np.ndarray) -> None:
        """Count ``topk_ids [M, L_all, k]`` (physical ids; ``< 0`` = none)."""
        rows, _, top_k = topk_ids.shape
        step = max(1, _MAX_KEYS // max(1, len(self.layer_index) * top_k * max(top_k - 1, 1)))
        for start in range(0, rows, step):
            self._add(self._logical(topk_ids[start : start + step]))

    def merge(self, other: CoactivationAccumulator) -> None:
        """Add ``other``'s counts (same layers and experts): accumulators of disjoint rows add up exactly."""
        self.coactivation += other.coactivation
        self.transitions += other.transitions
        self.expert_tokens += other.expert_tokens
        self.routed_tokens += other.routed_tokens

    def _add(self, lg: np.ndarray) -> None:
        _, num_layers, top_k = lg.shape
        e = self.num_experts
        layer = np.arange(num_layers)[None, :]
        valid = lg >= 0
        self.routed_tokens += valid.any(axis=2).sum(axis=0)
        # An expert counts once per token even if two of its replicas were chosen.
        first = valid.copy()
        for i in range(1, top_k):
            first[:, :, i] &= (lg[:, :, :i] != lg[:, :, i : i + 1]).all(axis=2)
        spare = num_layers * e * e  # one extra bin collects what is not counted
        self.expert_tokens += _count(np.where(first, layer[:, :, None] * e + lg, num_layers * e), num_layers * e).reshape(num_layers, e)
        keys = []
        for i in range(top_k):
            for j in range(i + 1, top_k):
                a, b = lg[:, :, i], lg[:, :, j]
                lo, hi = np.minimum(a, b), np.maximum(a, b)
                keys.append(np.where(first[:, :, i] & first[:, :, j], (layer * e + lo) * e + hi, spare))
        if keys:
            pairs = _count(np.stack(keys), spare).reshape(num_layers, e, e)
            self.coactivation += pairs + pairs.transpose(0, 2, 1)
        if num_layers > 1:
            a, b = lg[:, :-1, :], lg[:, 1:, :]
            hop = np.arange(num_layers - 1)[None, :, None]
            hops = (num_layers - 1) * e * e
            key = np.where((a >= 0) & (b >= 0), (hop * e + a) * e + b, hops)
            self.transitions += _count(key, hops).reshape(num_layers - 1, e, e)


def _count(keys: np.ndarray, bins: int) -> np.ndarray:
    """``bincount`` of ``keys`` in ``[0, bins]``, dropping the spare bin ``bins``."""
    return np.bincount(keys.ravel(), minlength=bins + 1)[:bins]


def top_pairs(coactivation: np.ndarray, expert_tokens: np.ndarray, tokens: int, n: int) -> list[dict[str, float]]:
    """The ``n`` most frequent pairs of one layer (``coactivation [E, E]``, ``expert_tokens [E]``).

    ``lift = C[a,b] · tokens / (n_a · n_b)``: how much more often the pair occurs
    than if the two experts were chosen independently (1 = independent).
    """
    upper = np.triu(coactivation, k=1)
    flat = np.argsort(upper, axis=None, kind="stable")[::-1][:n]
    out = []
    for index in flat:
        a, b = np.unravel_index(index, upper.shape)
        count = int(upper[a, b])
        if count == 0:
            break
        expected = float(expert_tokens[a]) * float(expert_tokens[b]) / tokens if tokens else 0.0
        out.append({"a": int(a), "b": int(b), "count": count, "lift": count / expected if expected else float("nan")})
    return out


def top_transitions(transition: np.ndarray, n: int) -> list[dict[str, float]]:
    """The ``n`` most frequent ``a -> b`` transitions of one layer pair, with their share of all."""
    total = int(transition.sum())
    flat = np.argsort(transition, axis=None, kind="stable")[::-1][:n]
    out = []
    for index in flat:
        a, b = np.unravel_index(index, transition.shape)
        count = int(transition[a, b])
        if count == 0:
            break
        out.append({"a": int(a), "b": int(b), "count": count, "share": count / total})
    return out


def mutual_information_bits(transition: np.ndarray) -> float:
    """Mutual information (bits) between the expert at one layer and at the next, from counts ``[E, E]``."""
    joint = np.asarray(transition, dtype=np.float64)
    total = joint.sum()
    if total <= 0:
        return 0.0
    p = joint / total
    pa, pb = p.sum(axis=1, keepdims=True), p.sum(axis=0, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log2(p / (pa * pb)), 0.0)
    return float(terms.sum())

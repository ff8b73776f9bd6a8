"""build_dispatch_layout against a plain-Python reference, capacity semantics, no host sync."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetrace.dispatch import expert_capacity
from moetrace.dispatch_layout import build_dispatch_layout, capacity_keep_mask
from moetrace.reference import DispatchLayout
from moetrace.testing import assert_no_host_sync


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens else torch.zeros((0, top_k), dtype=torch.int64)
    return ids, torch.rand((tokens, top_k), generator=g)


def _reference_keep(ids: np.ndarray, experts: int, capacity: int) -> np.ndarray:
    keep = np.zeros(ids.shape, dtype=bool)
    used = [0] * experts
    for slot in range(ids.shape[1]):  # choice-major priority
        for token in range(ids.shape[0]):
            e = ids[token, slot]
            keep[token, slot] = used[e] < capacity
            used[e] += 1
    return keep


@pytest.mark.parametrize(("tokens", "experts", "top_k", "ranks", "factor"), [
    (13, 8, 2, 2, None), (40, 8, 2, 4, 0.5), (25, 16, 4, 4, 1.0), (7, 4, 1, 1, 0.3), (0, 8, 2, 2, None),
])
def test_layout_matches_reference(tokens, experts, top_k, ranks, factor):
    ids, weights = _routing(tokens, experts, top_k, seed=tokens)
    capacity = None if factor is None else expert_capacity(tokens, top_k, experts, factor)
    layout = build_dispatch_layout(ids, weights, experts, ranks, capacity)
    assert isinstance(layout, DispatchLayout)
    np_ids = ids.numpy()
    keep = np.ones(np_ids.shape, bool) if capacity is None else _reference_keep(np_ids, experts, capacity)
    per_rank = experts // ranks
    kept_copies = sorted((e, t) for t in range(tokens) for s, e in enumerate(np_ids[t]) if keep[t, s])
    n = len(kept_copies)
    assert layout.expert_ids[:n].tolist() == [e for e, _ in kept_copies]
    assert layout.token_indices[:n].tolist() == [t for _, t in kept_copies]
    assert layout.kept[:n].all() and not layout.kept[n:].any()
    assert layout.dest_ranks.tolist() == (layout.expert_ids // per_rank).tolist()
    assert layout.local_expert_ids.tolist() == (layout.expert_ids % per_rank).tolist()
    expected_send = np.bincount([e // per_rank for e, _ in kept_copies], minlength=ranks)
    assert layout.send_counts.tolist() == expected_send.tolist()
    assert layout.expert_counts.tolist() == np.bincount(np_ids.reshape(-1), minlength=experts).tolist()
    assert int(layout.dropped) == int((~keep).sum())
    # weights follow their copies; rank positions count 0.. within each destination
    w = weights.numpy()
    for i in range(n):
        t, e = layout.token_indices[i].item(), layout.expert_ids[i].item()
        assert layout.weights[i].item() == w[t][list(np_ids[t]).index(e)]
    starts = np.concatenate([[0], np.cumsum(expected_send)[:-1]])
    assert layout.rank_positions[:n].tolist() == [i - starts[d] for i, d in enumerate(layout.dest_ranks[:n].tolist())]


def test_capacity_priority_is_choice_major():
    ids = torch.tensor([[0, 1], [1, 0], [0, 2]])
    # capacity 1: expert 0 takes token 0 (first choice), expert 1 takes token 1 (first choice)
    assert capacity_keep_mask(ids, 3, 1).tolist() == [[True, False], [True, False], [False, True]]
    assert expert_capacity(10, 2, 8, 1.0) == 3 and expert_capacity(10, 2, 2, 4.0) == 10


def test_layout_builds_without_host_sync():
    ids, weights = _routing(32, 8, 2, seed=1)
    with assert_no_host_sync():
        build_dispatch_layout(ids, weights, 8, 4, capacity=5)


def test_layout_rejects_bad_input():
    ids, weights = _routing(4, 8, 2, seed=2)
    with pytest.raises(ValueError, match="not divisible by ep_size=3"):
        build_dispatch_layout(ids, weights, 8, 3)
    with pytest.raises(ValueError, match="must both be"):
        build_dispatch_layout(ids, weights[:, :1], 8, 2)
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(4, 2, 8, 0.0)

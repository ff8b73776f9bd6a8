"""``sglang_physical_count`` against SGLang's own replica pick, in-process (no engine).

SGLang 0.5.23 with a non-trivial ``--init-expert-location`` and no all-to-all backend
dispatches with ``ep_dispatch_algorithm="dynamic"`` and ``rank_invariant=True``
(``sglang.srt.eplb.expert_location_dispatch``). The plan's candidate lists are built by
SGLang's ``_compute_logical_to_all_physical_map`` and padded as its ``_init_raw`` does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sglang.srt.eplb.expert_location import _compute_logical_to_all_physical_map
from sglang.srt.eplb.expert_location_dispatch import (
    ExpertLocationDispatchInfo,
    topk_ids_logical_to_physical,
)

from moetrace.placement.sglang_plan import sglang_physical_count

PLAN = np.array([[3, 0, 1, 2, 0, 3, 4, 5, 6, 7, 0, 1], [7, 6, 5, 4, 3, 2, 1, 0, 7, 7, 6, 0]])  # [L=2, N=12], 8 experts


def _sglang_counts(ids: torch.Tensor, plan: np.ndarray) -> np.ndarray:
    """``[L, N]`` from SGLang's dispatch of one pass ``ids [T, k]`` (logical) in every layer."""
    mapping = torch.tensor(plan)
    candidates = _compute_logical_to_all_physical_map(mapping, num_logical_experts=8, ep_size=2, moe_ep_rank=None)
    candidates = F.pad(candidates, (0, plan.shape[1] - candidates.shape[-1]), value=-1)
    counts = []
    for layer in range(plan.shape[0]):
        info = ExpertLocationDispatchInfo(
            ep_dispatch_algorithm="dynamic", partial_logical_to_rank_dispatch_physical_map=None,
            partial_logical_to_all_physical_map=candidates[layer],
            partial_logical_to_all_physical_map_num_valid=torch.count_nonzero(candidates[layer] != -1, dim=-1),
            num_physical_experts=plan.shape[1], rank_invariant=True,
        )
        physical = topk_ids_logical_to_physical(ids, info)
        counts.append(np.bincount(physical.numpy().ravel(), minlength=plan.shape[1]))
    return np.stack(counts)


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_counts_equal_sglangs_dispatch(tokens: int) -> None:
    rng = np.random.default_rng(tokens)
    ids = np.stack([rng.choice(8, size=2, replace=False) for _ in range(tokens)])  # [T, k] one pass
    ours = sglang_physical_count(np.repeat(ids[:, None, :], 2, axis=1), np.arange(tokens), PLAN)
    np.testing.assert_array_equal(ours, _sglang_counts(torch.tensor(ids), PLAN))


def test_an_even_split_is_not_what_sglang_does() -> None:
    """Negative control: one-row passes always take an expert's first replica; splitting load evenly would be wrong."""
    ids = np.array([[0, 1]])
    theirs = sum(_sglang_counts(torch.tensor(ids), PLAN) for _ in range(4))
    assert theirs[0, 1] == 4 and theirs[0, 4] == 0 and theirs[0, 10] == 0  # expert 0's slots 1, 4, 10: all to slot 1
    ours = sglang_physical_count(np.repeat(np.repeat(ids[:, None, :], 2, axis=1), 4, axis=0), np.zeros(4, np.int64), PLAN)
    np.testing.assert_array_equal(ours, theirs)

"""The copy-level dispatch layout: which token copy goes to which EP rank and local expert.

:func:`build_dispatch_layout` turns a router's top-k choice into the layout an
expert-parallel exchange needs (which token copy goes to which rank and local
expert, with which weight), using fixed-shape device ops only, so it never
synchronises host and device. The volume formulas and :func:`~moetrace.dispatch.expert_capacity`
are :mod:`moetrace.dispatch` (no torch).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["DispatchLayout", "build_dispatch_layout", "capacity_keep_mask", "slot_in_group"]


def capacity_keep_mask(topk_ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which token copies fit their expert's capacity: ``[T, k]`` bool.

    Priority is choice-major, as in GShard/Switch: every token's first choice
    is placed before any second choice; within one choice rank, earlier tokens
    win. Copies beyond ``capacity`` for their expert are dropped. Fixed-shape
    ops only (one-hot cumulative sum), no host sync.
    """
    tokens, top_k = topk_ids.shape
    order = topk_ids.t().reshape(-1)  # [k*T], choice-major
    position = slot_in_group(order, num_experts)
    return (position < capacity).reshape(top_k, tokens).t()


def slot_in_group(ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Position of each entry of ``ids [M]`` among the earlier entries with the same id.

    Ids outside ``[0, num_groups)`` (e.g. ``-1`` padding) get ``-1``. Fixed-shape
    (one-hot by comparison, cumulative sum): no host sync, unlike ``F.one_hot``,
    which validates its input on the host.
    """
    one_hot = (ids.unsqueeze(1) == torch.arange(num_groups, device=ids.device)).long()  # [M, G]
    return (one_hot.cumsum(0) * one_hot).sum(1) - 1


@dataclasses.dataclass(frozen=True)
class DispatchLayout:
    """Copy-level layout of one MoE layer's dispatch on one rank.

    ``N = T·k`` token copies, sorted by destination expert (hence by EP rank,
    since rank ``r`` owns experts ``[r·E/R, (r+1)·E/R)``), token order within an
    expert; copies dropped over capacity come last. All tensors live on the
    router's device.

    Attributes:
        token_indices: ``[N]`` int64, source token row of each copy.
        expert_ids: ``[N]`` int64, global (physical) expert of each copy.
        local_expert_ids: ``[N]`` int64, expert index inside its owner rank.
        weights: ``[N]`` combine weight of each copy (router dtype).
        dest_ranks: ``[N]`` int64, EP rank that owns the copy's expert.
        kept: ``[N]`` bool, False for copies dropped over capacity.
        rank_positions: ``[N]`` int64, position of a kept copy among the
            copies sent to its destination rank (``0..send_counts[r]-1``).
        send_counts: ``[R]`` int64, kept copies sent to each rank.
        expert_counts: ``[E]`` int64, copies routed to each expert (kept or not):
            what a recorder counts from ``topk_ids``.
        kept_counts: ``[E]`` int64, kept copies per expert.
        dropped: ``[]`` int64, copies dropped over capacity.
        num_tokens: ``T``; ``top_k``: ``k``; ``num_experts``: ``E``; ``ep_size``: ``R``.
    """

    token_indices: torch.Tensor
    expert_ids: torch.Tensor
    local_expert_ids: torch.Tensor
    weights: torch.Tensor
    dest_ranks: torch.Tensor
    kept: torch.Tensor
    rank_positions: torch.Tensor
    send_counts: torch.Tensor
    expert_counts: torch.Tensor
    kept_counts: torch.Tensor
    dropped: torch.Tensor
    num_tokens: int
    top_k: int
    num_experts: int
    ep_size: int

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size


def build_dispatch_layout(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    ep_size: int,
    capacity: int | None = None,
) -> DispatchLayout:
    """Build the :class:`DispatchLayout` of ``topk_ids [T, k]`` for ``ep_size`` ranks.

    Args:
        topk_ids: ``[T, k]`` integer expert ids in ``[0, E)``.
        topk_weights: ``[T, k]`` combine weights.
        num_experts: ``E``; must be divisible by ``ep_size``.
        ep_size: EP ranks ``R``.
        capacity: copies each expert accepts (see :func:`~moetrace.dispatch.expert_capacity`);
            ``None`` keeps everything.
    """
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids and topk_weights must both be [T, k], got {list(topk_ids.shape)} and "
            f"{list(topk_weights.shape)}"
        )
    if ep_size <= 0 or num_experts % ep_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by ep_size={ep_size}; "
            "every EP rank must own the same number of experts"
        )
    tokens, top_k = topk_ids.shape
    device = topk_ids.device
    per_rank = num_experts // ep_size
    ids = topk_ids.long()
    flat_ids = ids.reshape(-1)
    if capacity is None:
        kept_flat = torch.ones_like(flat_ids, dtype=torch.bool)
    else:
        kept_flat = capacity_keep_mask(ids, num_experts, capacity).reshape(-1)
    # Sort key: expert id for kept copies, E for dropped ones (stable: token order within expert).
    key = torch.where(kept_flat, flat_ids, num_experts)
    _, order = torch.sort(key, stable=True)
    expert_ids = flat_ids[order]
    kept = kept_flat[order]
    dest_ranks = torch.div(expert_ids, per_rank, rounding_mode="floor")
    kept_long = kept.long()
    expert_counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    expert_counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    kept_counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    kept_counts.scatter_add_(0, expert_ids, kept_long)
    send_counts = kept_counts.view(ep_size, per_rank).sum(1)
    rank_start = send_counts.cumsum(0) - send_counts  # exclusive prefix sum [R]
    position = torch.arange(expert_ids.numel(), device=device) - rank_start[dest_ranks]
    return DispatchLayout(
        token_indices=torch.div(order, top_k, rounding_mode="floor"),
        expert_ids=expert_ids,
        local_expert_ids=expert_ids - dest_ranks * per_rank,
        weights=topk_weights.reshape(-1)[order],
        dest_ranks=dest_ranks,
        kept=kept,
        rank_positions=torch.where(kept, position, 0),
        send_counts=send_counts,
        expert_counts=expert_counts,
        kept_counts=kept_counts,
        dropped=(1 - kept_long).sum(),
        num_tokens=tokens,
        top_k=top_k,
        num_experts=num_experts,
        ep_size=ep_size,
    )

"""Expert-parallel MoE layer: experts sharded over ranks, tokens exchanged with all-to-all.

Rank ``r`` of ``R`` holds experts ``[r·E/R, (r+1)·E/R)`` only. Each rank
routes its own tokens, builds a :class:`~moetrace.dispatch_layout.DispatchLayout`,
sends every kept token copy to the rank owning its expert with
``torch.distributed.all_to_all_single``, runs its local experts on what it
received, sends the results back on the reverse all-to-all and combines them
with the router weights.

Exchange modes:

``exact``
    Split sizes are the real counts. The counts must be known on the host to
    call ``all_to_all_single``, so this mode synchronises host and device once
    per layer (``tolist()`` after a counts all-to-all). Fewest bytes moved.
``padded``
    Every rank sends ``max_tokens · k`` rows to every rank (unused rows carry
    local expert id -1) and computes each local expert on a fixed-size block
    of ``R · capacity`` rows. No host sync and static shapes, at the price of
    ``R×`` the ideal traffic (``ep_padded_bytes``). Requires ``max_tokens``.

Capacity: with ``capacity_factor`` set, each rank lets at most
``expert_capacity(T_local, k, E, factor)`` of its own copies into each
expert (GShard-style groups = ranks); the rest are dropped, counted and
reported to the recorder.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ..dispatch import expert_capacity
from ..dispatch_layout import build_dispatch_layout, slot_in_group
from ..process_recorder import get_recorder
from .experts import SwiGLUExperts
from .gate import TopKRouter
from .moe import check_input, check_parts

__all__ = ["EXCHANGE_MODES", "EPMoELayer"]

EXCHANGE_MODES = ("exact", "padded")


class EPMoELayer(torch.nn.Module):
    """One EP rank's share of an MoE layer.

    Args:
        router: the full top-k router (replicated on every rank).
        experts: this rank's shard, experts ``[ep_rank·E/R, (ep_rank+1)·E/R)``.
        ep_size: EP ranks ``R`` (must divide ``E``).
        ep_rank: this rank.
        group: the ``torch.distributed`` process group (default: the world);
            may be omitted when ``ep_size == 1`` and no group is initialised.
        mode: ``"exact"`` or ``"padded"`` (see the module docstring).
        max_tokens: largest local batch ``T`` in ``padded`` mode.
        capacity_factor: optional per-expert capacity (tokens over it are dropped).
        moe_index: compact MoE layer index given to the recorder.
        layer_id: model layer index given to a capturer.

    Phases are bracketed with ``recorder.with_phase``: ``route`` (router,
    dispatch layout, recording the choice), ``dispatch`` (count exchange,
    token all-to-all), ``expert`` (local experts) and ``combine`` (reverse
    all-to-all, weighted sum). ``expert_delay_s`` sleeps inside ``expert``
    on this rank (to inject a straggler in demos and tests).
    """

    def __init__(
        self,
        router: TopKRouter,
        experts: SwiGLUExperts,
        *,
        ep_size: int,
        ep_rank: int,
        group: Any = None,
        mode: str = "exact",
        max_tokens: int | None = None,
        capacity_factor: float | None = None,
        moe_index: int = 0,
        layer_id: int = 0,
    ) -> None:
        super().__init__()
        check_parts(router, experts, capacity_factor)
        num_experts = router.num_experts
        if ep_size <= 0 or num_experts % ep_size:
            raise ValueError(f"ep_size={ep_size} does not divide num_experts={num_experts}; choose an EP size that divides the expert count")
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank={ep_rank} is outside [0, ep_size={ep_size})")
        per_rank = num_experts // ep_size
        if experts.first != ep_rank * per_rank or experts.count != per_rank:
            raise ValueError(
                f"rank {ep_rank} of {ep_size} must hold experts [{ep_rank * per_rank}, {(ep_rank + 1) * per_rank}), "
                f"got [{experts.first}, {experts.first + experts.count})"
            )
        if mode not in EXCHANGE_MODES:
            raise ValueError(f"mode must be one of {EXCHANGE_MODES}, got {mode!r}")
        if mode == "padded" and (max_tokens is None or max_tokens <= 0):
            raise ValueError("padded mode needs max_tokens (the largest local batch) to size its static buffers")
        self._distributed = dist.is_available() and dist.is_initialized()
        if self._distributed:
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            if (size, rank) != (ep_size, ep_rank):
                raise ValueError(f"process group has size {size}, rank {rank}; the layer was given ep_size={ep_size}, ep_rank={ep_rank}")
        elif ep_size != 1:
            raise ValueError(f"ep_size={ep_size} needs an initialised torch.distributed process group (see moetrace.reference.launch)")
        self.router, self.experts, self.group = router, experts, group
        self.ep_size, self.ep_rank, self.mode = ep_size, ep_rank, mode
        self.num_experts, self.top_k, self.experts_per_rank = num_experts, router.top_k, per_rank
        self.max_tokens = max_tokens
        self.capacity_factor = capacity_factor
        self.moe_index, self.layer_id = moe_index, layer_id
        self.expert_delay_s = 0.0
        self.last_layout = None

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None = None, in_splits: list[int] | None = None) -> None:
        if self._distributed:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        else:
            out.copy_(inp)

    def _delay(self) -> None:
        """Injected straggling: sleep ``expert_delay_s`` (0 = none)."""
        if self.expert_delay_s:
            time.sleep(self.expert_delay_s)

    def _capacity(self, tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return expert_capacity(tokens, self.top_k, self.num_experts, self.capacity_factor)

    def forward(self, x: torch.Tensor, recorder: Any = None, capturer: Any = None) -> torch.Tensor:
        """``x [T, H]`` (this rank's tokens, ``T`` may be 0) -> ``[T, H]``.

        Every rank must call it the same number of times (collectives).
        """
        check_input(x, self.experts)
        if self.mode == "padded" and x.shape[0] > self.max_tokens:  # type: ignore[operator]
            raise ValueError(f"batch of {x.shape[0]} tokens exceeds max_tokens={self.max_tokens} of the padded exchange")
        recorder = get_recorder() if recorder is None else recorder
        with recorder.with_current_layer(self.moe_index):
            with recorder.with_phase("route"):
                ids, weights = self.router(x)
                layout = build_dispatch_layout(ids, weights, self.num_experts, self.ep_size, self._capacity(x.shape[0]))
                self.last_layout = layout
                recorder.on_select_experts(ids)
                if capturer is not None:
                    capturer.capture(self.layer_id, ids)
            if self.mode == "exact":
                return self._forward_exact(x, layout, recorder)
            return self._forward_padded(x, layout, recorder)

    def _forward_exact(self, x: torch.Tensor, layout: Any, recorder: Any) -> torch.Tensor:
        r, per_rank = self.ep_size, self.experts_per_rank
        with recorder.with_phase("dispatch"):
            send_matrix = layout.kept_counts.view(r, per_rank)
            recv_matrix = torch.empty_like(send_matrix)
            self._all_to_all(recv_matrix, send_matrix)  # [source rank, local expert] counts
            recorder.on_dispatch(layout.send_counts, recv_matrix.sum(1), layout.dropped)
            # The one host sync of exact mode: split sizes must be Python ints.
            send_splits = layout.send_counts.tolist()
            recv_host = recv_matrix.tolist()
            recv_splits = [sum(row) for row in recv_host]
            sent = sum(send_splits)
            token_indices = layout.token_indices[:sent]
            received = x.new_empty((sum(recv_splits), x.shape[1]))
            self._all_to_all(received, x[token_indices], recv_splits, send_splits)
        with recorder.with_phase("expert"):
            self._delay()
            # Rows from each source arrive grouped by local expert; regroup across sources.
            local_ids = torch.arange(per_rank, device=x.device).repeat(r)
            local_ids = local_ids.repeat_interleave(recv_matrix.reshape(-1), output_size=received.shape[0])
            order = torch.argsort(local_ids, stable=True)
            sizes = [sum(row[e] for row in recv_host) for e in range(per_rank)]
            results = torch.empty_like(received)
            results[order] = self.experts.grouped(received[order], sizes)
        with recorder.with_phase("combine"):
            returned = x.new_empty((sent, x.shape[1]))
            self._all_to_all(returned, results, send_splits, recv_splits)
            out = torch.zeros_like(x)
            out.index_add_(0, token_indices, returned * layout.weights[:sent, None])
        return out

    def _forward_padded(self, x: torch.Tensor, layout: Any, recorder: Any) -> torch.Tensor:
        r, per_rank = self.ep_size, self.experts_per_rank
        hidden, chunk = x.shape[1], self.max_tokens * self.top_k  # type: ignore[operator]
        capacity = self._capacity(self.max_tokens)  # type: ignore[arg-type]
        rows_per_expert = r * (self.max_tokens if capacity is None else capacity)
        with recorder.with_phase("dispatch"):
            trash = r * chunk
            slot = torch.where(layout.kept, layout.dest_ranks * chunk + layout.rank_positions, trash)
            send = x.new_zeros((trash + 1, hidden))
            send.index_copy_(0, slot, x[layout.token_indices])
            send_ids = torch.full((trash + 1,), -1, dtype=torch.int64, device=x.device)
            send_ids.index_copy_(0, slot, torch.where(layout.kept, layout.local_expert_ids, -1))
            received = x.new_empty((trash, hidden))
            received_ids = torch.empty((trash,), dtype=torch.int64, device=x.device)
            self._all_to_all(received, send[:trash])
            self._all_to_all(received_ids, send_ids[:trash])
            valid = received_ids >= 0
            recorder.on_dispatch(layout.send_counts, valid.view(r, chunk).sum(1), layout.dropped)
        with recorder.with_phase("expert"):
            self._delay()
            position = slot_in_group(received_ids, per_rank)
            expert_trash = per_rank * rows_per_expert
            expert_slot = torch.where(valid, received_ids * rows_per_expert + position, expert_trash)
            blocks = x.new_zeros((expert_trash + 1, hidden))
            blocks.index_copy_(0, expert_slot, received)
            computed = self.experts.batched(blocks[:expert_trash].view(per_rank, rows_per_expert, hidden))
            computed = torch.cat([computed.reshape(expert_trash, hidden), x.new_zeros((1, hidden))])
            results = computed[expert_slot]
        with recorder.with_phase("combine"):
            returned = x.new_empty((trash, hidden))
            self._all_to_all(returned, results)
            returned = torch.cat([returned, x.new_zeros((1, hidden))])
            out = torch.zeros_like(x)
            out.index_add_(0, layout.token_indices, returned[slot] * layout.weights[:, None])
        return out

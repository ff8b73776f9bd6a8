"""The per-layer taps the Megatron adapter installs, and the router slot they share with replay.

Three points per ``MoELayer``, none of which edits Megatron:

- the router's ``router_replay`` slot (``TopKRouter.router_replay``, passed by
  ``routing`` to ``moe_utils.topk_routing_with_score_function``): a :class:`TopKSlot`
  answers ``get_replay_topk`` by delegating to what was there before (Megatron's own
  ``RouterReplay``, another slot, or Megatron's default top-k) and hands the ids it
  returns, ``[T, k]`` in top-k order, to a callback. Instrumentation reads ids there;
  :func:`moetrace.adapters.megatron.replay` answers with replayed ids there;
- the token dispatcher: ``MoEAlltoAllTokenDispatcher.preprocess(routing_map)`` (the
  split sizes are still device tensors there, before Megatron copies them to the host)
  or ``MoEAllGatherTokenDispatcher.dispatch_preprocess``, and ``dispatch_postprocess``
  (tokens per local expert, what the experts receive);
- the layer's phase methods, for timing (wrapped in the adapter, behind its fail-safe).

A recomputed forward (activation checkpointing, ``recompute_modules=["moe"]``) runs the
router again inside ``backward()``: the taps see it (``in_backward()``) and count nothing,
so each micro-batch forward is counted once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .layers import MegatronMoELayer

__all__ = ["LayerTap", "TopKSlot", "in_backward"]


def in_backward() -> bool:
    """True while autograd runs a backward (a checkpointed forward being recomputed)."""
    return torch._C._current_graph_task_id() != -1


class TopKSlot:
    """Stands in a router's ``router_replay``: ``get_replay_topk`` delegates, then reports the ids.

    ``inner`` is the previous occupant: ``None`` (Megatron's default top-k),
    Megatron's ``RouterReplay`` (recording or replaying as its action says), or
    another slot. ``compute`` (optional) replaces the default top-k: replay's
    ``(scores, topk, num_groups, group_topk, *, default) -> (values, ids)``, where
    ``default`` is Megatron's own top-k (for rows replay leaves to the router). ``on_scores``
    (optional) sees the router's ``[T, E]`` scores first (replay checks ``T`` there). Other
    attributes are read from ``inner`` (``RouterReplay.set_target_indices`` and friends keep working).
    """

    def __init__(
        self,
        inner: Any,
        on_ids: Callable[[torch.Tensor], None] | None = None,
        compute: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
        on_scores: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.inner, self.on_ids, self.compute, self.on_scores = inner, on_ids, compute, on_scores

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values [T, k], ids [T, k])`` as Megatron's ``RouterReplay.get_replay_topk``."""
        if self.on_scores is not None:
            self.on_scores(scores)
        compute = default_compute_topk
        if self.compute is not None:
            own = self.compute

            def compute(s: torch.Tensor, k: int, num_groups: int | None = None, group_topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
                return own(s, k, num_groups, group_topk, default=default_compute_topk)

        if self.inner is None:
            assert compute is not None
            values, ids = compute(scores, topk, num_groups=num_groups, group_topk=group_topk)
        else:
            values, ids = self.inner.get_replay_topk(scores, topk, num_groups, group_topk, compute)
        if self.on_ids is not None:
            self.on_ids(ids)
        return values, ids

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class LayerTap:
    """What one MoE layer reports to the recorder, per micro-batch forward.

    Attributes:
        layer: the layer.
        expert_tokens: ``[E_local]`` int64 view: tokens each local expert received
            since ``start_record`` (Megatron's ``tokens_per_expert`` after dispatch).
    """

    def __init__(self, recorder: Any, layer: MegatronMoELayer, expert_tokens: torch.Tensor, capacity: bool) -> None:
        self.recorder, self.layer, self.expert_tokens, self.capacity = recorder, layer, expert_tokens, capacity
        self._ids: torch.Tensor | None = None
        self._send: torch.Tensor | None = None
        self._recv: torch.Tensor | None = None
        self._dropped: torch.Tensor | None = None

    def _counting(self) -> bool:
        return self.recorder.recording and not in_backward()

    def topk(self, ids: torch.Tensor) -> None:
        """The router's ``[T, k]`` ids, in top-k order (before capacity dropping)."""
        if not self._counting():
            return
        self._ids = ids
        self.recorder.on_select_experts(ids, self.layer.index)

    def dispatched(self, dispatcher: Any, routing_map: torch.Tensor) -> None:
        """After the dispatcher's preprocessing of ``routing_map [T, E]`` (bool, after dropping)."""
        if not self._counting():
            return
        layer = self.layer
        if layer.dispatcher == "alltoall" and dispatcher.input_splits is not None:
            self._send, self._recv = dispatcher.input_splits, dispatcher.output_splits
        else:  # all-gather, or all-to-all at EP=1: the copies bound for each rank's experts
            self._send = routing_map.reshape(routing_map.shape[0], layer.ep_size, -1).sum((0, 2))
            self._recv = self._send if layer.ep_size == 1 else None
        if self.capacity and self._ids is not None:
            kept = routing_map.gather(1, self._ids).sum()
            self._dropped = self._ids.numel() - kept
        else:
            self._dropped = None

    def received(self, dispatcher: Any, tokens_per_expert: torch.Tensor) -> None:
        """After ``dispatch_postprocess``: ``tokens_per_expert [E_local]`` is what the local experts get."""
        if not self._counting() or self._send is None:
            return
        recv = self._recv
        if recv is None:  # all-gather: the gathered map's rows for our experts, per source rank
            recv = dispatcher.local_map.reshape(self.layer.ep_size, -1).sum(1)
        self.recorder.on_dispatch(self._send, recv, self._dropped, layer=self.layer.index)
        self.expert_tokens.add_(tokens_per_expert.to(self.expert_tokens.device, non_blocking=True))
        self._ids = self._send = self._recv = self._dropped = None

"""The dense MoE layer: the numerical oracle every other implementation is checked against.

It holds all ``E`` experts and, for each expert, selects the tokens routed to
it, runs the FFN and adds the weighted result back with ``index_add_``. It
reads routing decisions on the host (``nonzero``), which is fine for an
oracle; :class:`~moetrace.reference.ep.EPMoELayer` in ``padded`` mode is the
implementation without host syncs.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dispatch import expert_capacity
from ..dispatch_layout import capacity_keep_mask
from ..process_recorder import get_recorder
from .experts import SwiGLUExperts
from .gate import TopKRouter

__all__ = ["MoELayer", "check_input", "check_parts"]


def check_parts(router: TopKRouter, experts: SwiGLUExperts, capacity_factor: float | None) -> None:
    """Construction-time checks shared by the dense and EP layers (clear errors)."""
    if router.weight.shape[1] != experts.hidden_size:
        raise ValueError(f"router hidden size {router.weight.shape[1]} != experts hidden size {experts.hidden_size}")
    if router.weight.dtype != experts.dtype:
        raise ValueError(f"router dtype {router.weight.dtype} != experts dtype {experts.dtype}; build both with the same dtype")
    if router.weight.device != experts.device:
        raise ValueError(f"router is on {router.weight.device} but experts are on {experts.device}; put both on one device")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor}")


def check_input(x: torch.Tensor, experts: SwiGLUExperts) -> None:
    """Forward-time metadata checks (shape, dtype, device; no values read)."""
    if x.dim() != 2 or x.shape[1] != experts.hidden_size:
        raise ValueError(f"expected hidden states [T, {experts.hidden_size}], got {list(x.shape)}")
    if x.dtype != experts.dtype or x.device != experts.device:
        raise ValueError(f"hidden states are {x.dtype} on {x.device}; the layer expects {experts.dtype} on {experts.device}")


class MoELayer(torch.nn.Module):
    """Dense (single-process) MoE layer: router + all ``E`` SwiGLU experts.

    Args:
        router: the top-k router.
        experts: all ``E`` experts (``experts.count == router.num_experts``).
        capacity_factor: drop copies over ``expert_capacity(T, k, E, factor)``
            per expert (choice-major priority); ``None`` drops nothing.
        moe_index: compact MoE layer index given to the recorder.
        layer_id: model layer index given to a capturer.
    """

    def __init__(
        self,
        router: TopKRouter,
        experts: SwiGLUExperts,
        *,
        capacity_factor: float | None = None,
        moe_index: int = 0,
        layer_id: int = 0,
    ) -> None:
        super().__init__()
        check_parts(router, experts, capacity_factor)
        if experts.first != 0 or experts.count != router.num_experts:
            raise ValueError(f"the dense layer needs all {router.num_experts} experts, got [{experts.first}, {experts.first + experts.count})")
        self.router, self.experts = router, experts
        self.capacity_factor = capacity_factor
        self.moe_index, self.layer_id = moe_index, layer_id

    def forward(self, x: torch.Tensor, recorder: Any = None, capturer: Any = None) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``; reports to ``recorder`` (default: the global one)."""
        check_input(x, self.experts)
        recorder = get_recorder() if recorder is None else recorder
        num_experts, top_k = self.router.num_experts, self.router.top_k
        with recorder.with_current_layer(self.moe_index):
            with recorder.with_phase("route"):
                ids, weights = self.router(x)
                recorder.on_select_experts(ids)
                if capturer is not None:
                    capturer.capture(self.layer_id, ids)
                if self.capacity_factor is None:
                    keep = torch.ones_like(ids, dtype=torch.bool)
                else:
                    capacity = expert_capacity(x.shape[0], top_k, num_experts, self.capacity_factor)
                    keep = capacity_keep_mask(ids, num_experts, capacity)
                kept = keep.sum().reshape(1)
                recorder.on_dispatch(kept, kept, ids.numel() - kept.reshape(()))
            out = torch.zeros_like(x)
            with recorder.with_phase("expert"):
                for e in range(num_experts):
                    token, slot = torch.nonzero((ids == e) & keep, as_tuple=True)
                    if token.numel():
                        y = self.experts.expert(e, x[token]) * weights[token, slot, None]
                        out.index_add_(0, token, y)
        return out


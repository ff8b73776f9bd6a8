"""The parallel layout of one SGLang scheduler process, as a :class:`moetrace.layout.RankLayout`.

SGLang (0.5.18+) publishes each process's parallel coordinates in
``sglang.srt.runtime_context.get_parallel()``: ``tp_size``/``tp_rank``,
``pp_size``/``pp_rank``, ``moe_ep_size``/``moe_ep_rank`` and, for DP attention
(``--enable-dp-attention``), ``attn_dp_enabled`` and ``attn_tp_size`` (ranks that run
attention, and so the router, on the same tokens); the server argument
``enable_dp_attention`` is not a field of that context. What each means for counting:

- TP attention (default): every rank of the TP group routes the same tokens;
  moetrace counts one of them (``attn_tp_size = tp_size``).
- DP attention: the TP group splits into ``dp_size`` attention groups of
  ``attn_tp_size`` ranks holding different tokens. With an all-to-all backend
  (DeepEP) each group routes its own tokens and the views add up; without one,
  SGLang gathers every group's tokens before the MoE layer, so every TP rank
  routes the whole batch (``router_tp_size = tp_size``: counted once).
- EP (``--ep-size``): ranks hold different physical expert slots; under TP
  attention (no all-to-all backend) every rank still routes every token.
- DP without DP attention: SGLang starts ``dp_size`` independent engines, each its
  own ``torch.distributed`` world and its own trace; within one, ``dp_size = 1``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from moetrace.layout import RankLayout

__all__ = ["sglang_layout"]


def _parallel() -> Any:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


def _has_all_to_all() -> bool:
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    return not get_moe_a2a_backend().is_none()


def sglang_layout(ep_size: int, ep_rank: int, parallel: Any = None, all_to_all: bool | None = None) -> RankLayout:
    """This process's layout from SGLang's parallel context (``parallel``: ``get_parallel()`` by default).

    ``ep_size``/``ep_rank`` are the expert location metadata's (what the recorder is sized by);
    ``all_to_all``: whether an MoE all-to-all backend runs (default: SGLang's ``--moe-a2a-backend``).
    """
    p = _parallel() if parallel is None else parallel
    tp_size, tp_rank = int(p.tp_size), int(p.tp_rank)
    pp_size, pp_rank = int(getattr(p, "pp_size", 1)), int(getattr(p, "pp_rank", 0))
    dp_attention = bool(getattr(p, "attn_dp_enabled", False))  # a width SGLang derives at publish: attn_dp_size > 1
    attn_tp_size = int(p.attn_tp_size) if dp_attention else tp_size
    dp_size = tp_size // attn_tp_size if dp_attention else 1
    dp_rank = tp_rank // attn_tp_size if dp_attention else 0
    if dp_attention and all_to_all is None:
        all_to_all = _has_all_to_all()
    router_tp_size = tp_size if dp_attention and not all_to_all else None
    initialised = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialised else pp_rank * tp_size + tp_rank
    world = dist.get_world_size() if initialised else tp_size * pp_size
    return RankLayout(
        rank=rank, world_size=world, tp_size=tp_size, tp_rank=tp_rank, dp_size=dp_size, dp_rank=dp_rank,
        ep_size=ep_size, ep_rank=ep_rank, pp_size=pp_size, pp_rank=pp_rank, attn_tp_size=attn_tp_size,
        router_tp_size=router_tp_size, source="sglang",
    )

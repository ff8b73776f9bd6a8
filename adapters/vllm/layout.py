"""The parallel layout of a vLLM worker, as moetrace records it (:class:`moetrace.layout.RankLayout`).

vLLM runs attention tensor-parallel: every rank of a TP group holds the whole
batch, its router computes the same top-k for the same tokens, and each rank's
recorder sees a replica of one view (counted once). With
``enable_expert_parallel`` the experts are split over the EP group, the router
output is still replicated and the experts' partial outputs are all-reduced
(no tokens are exchanged). Sequence-parallel MoE and data parallelism with the
naive dispatch gather the router logits of the whole group *before*
``select_experts``, so there too every rank routes the gathered batch.
"""

from __future__ import annotations

import logging
from typing import Any

from moetrace.layout import RankLayout

__all__ = ["vllm_rank_layout"]

log = logging.getLogger("moetrace.vllm")


def vllm_rank_layout(vllm_config: Any, ep_size: int = 1, ep_rank: int = 0) -> RankLayout:
    """This worker's layout from vLLM's process groups, with the EP coordinates the recorder counts in.

    ``vllm_config`` may be ``None`` (a model instrumented outside an engine): then the
    sizes come from the process groups alone, and a process without them is one rank.
    """
    from vllm.distributed import parallel_state

    if parallel_state._TP is None:  # no engine set up the process groups: a lone model
        return RankLayout(source="vllm")
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    pp_group = parallel_state.get_pp_group()
    pp, pp_rank = int(pp_group.world_size), int(pp_group.rank_in_group)
    parallel = getattr(vllm_config, "parallel_config", None)
    dp, dp_rank = (int(parallel.data_parallel_size), int(parallel.data_parallel_rank)) if parallel is not None else (1, 0)
    if dp > 1:
        log.warning(
            "moetrace: vLLM with data_parallel_size=%d and the naive dispatch gathers the router logits of every DP rank "
            "before the router: each rank's view then holds the whole group's tokens, and moetrace counts each DP rank's "
            "view as its own (untested here; see docs/integrations/vllm.md)", dp)
    rank = (dp_rank * pp + pp_rank) * tp + tp_rank
    return RankLayout(rank=rank, world_size=tp * pp * dp, tp_size=tp, tp_rank=tp_rank, dp_size=dp, dp_rank=dp_rank,
                      ep_size=ep_size, ep_rank=ep_rank, pp_size=pp, pp_rank=pp_rank, source="vllm")

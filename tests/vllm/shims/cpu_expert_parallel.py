"""Expert parallelism for vLLM 0.32's CPU experts, as its GPU kernels do it (a test-harness shim).

vLLM 0.32 CPU with ``enable_expert_parallel=True`` segfaults in
``csrc/cpu/cpu_fused_moe.cpp:242`` (``fused_moe_impl``), with moetrace on and
off: under EP each rank holds only its ``E / ep_size`` experts (``w13_weight``
``[E/ep, ...]``) and the router's top-k ids stay global, but
``CPUUnquantizedExperts.apply`` ignores the ``expert_map`` it is given and
hands the global ids to the kernel, which reads past the rank's weights. The
GPU kernels map ids through ``expert_map`` (global -> local, ``-1`` for experts
of other ranks) and skip the ``-1`` ones; the partial outputs are then
all-reduced over the EP group.

This shim does that mapping in front of the CPU kernel: local ids for the
rank's experts, and for the others local id 0 with routing weight 0 (they add
nothing to this rank's partial sum). It changes how the engine computes its
experts on CPU, never the router or the ids moetrace records (moetrace taps the
router's ``select_experts``, before the experts run).

It is loaded in every worker process through vLLM's own
``worker_extension_cls`` setting (``LLM(..., worker_extension_cls=EXTENSION)``):
vLLM imports the class by name in the worker, which imports this module and
patches the class there. The extension adds no methods to the worker.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

__all__ = ["EXTENSION", "CPUExpertParallel"]

EXTENSION = f"{__name__}.CPUExpertParallel"
_MARK = "__moetrace_test_cpu_ep__"


def _apply_with_expert_map(original: Any) -> Any:
    def apply(self: Any, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
              expert_map: torch.Tensor | None, *args: Any, **kwargs: Any) -> None:
        if expert_map is not None:
            local = expert_map[topk_ids.long()]  # [T, k]: the rank's own experts as local ids, -1 elsewhere
            topk_weights = torch.where(local >= 0, topk_weights, torch.zeros_like(topk_weights))
            topk_ids = local.clamp(min=0).to(topk_ids.dtype)
        return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                        expert_map, *args, **kwargs)

    setattr(apply, _MARK, True)
    return apply


if not getattr(CPUUnquantizedExperts.apply, _MARK, False):
    CPUUnquantizedExperts.apply = _apply_with_expert_map(CPUUnquantizedExperts.apply)


class CPUExpertParallel:
    """The worker extension vLLM imports in each worker (it only has to load this module)."""

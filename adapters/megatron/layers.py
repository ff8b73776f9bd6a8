"""Find the MoE layers of a Megatron-Core model, by feature detection, and refuse what is unknown.

Written against megatron-core 0.16.1 (the newest release for Python 3.11). What the
adapter needs from each ``MoELayer`` (``megatron.core.transformer.moe.moe_layer``):

- the phase methods ``route``, ``preprocess``, ``dispatch``, ``routed_experts_compute``,
  ``combine``, ``postprocess`` (the boundaries phase timing is taken on);
- a ``TopKRouter`` whose ``routing`` calls ``moe_utils.topk_routing_with_score_function``
  with a ``router_replay=`` argument: its ``router_replay`` attribute is where the top-k
  ids (in top-k order) are read and replayed (``get_replay_topk``);
- an all-to-all (``MoEAlltoAllTokenDispatcher``) or all-gather
  (``MoEAllGatherTokenDispatcher``) token dispatcher with ``dispatch_preprocess`` /
  ``dispatch_postprocess``.

Anything else (the ``flex`` DeepEP/HybridEP dispatcher, Sinkhorn routing, TE's fused
top-k) is refused with the version and the missing piece named.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..base import NoMoELayersError, UnsupportedVersionError

__all__ = [
    "DISPATCHERS",
    "PHASE_METHODS",
    "MegatronMoELayer",
    "find_moe_layers",
    "installed_version",
]

PHASE_METHODS = ("route", "preprocess", "dispatch", "routed_experts_compute", "combine", "postprocess")
"""``MoELayer`` methods the adapter wraps (phase timing) and requires."""

DISPATCHERS = {"MoEAlltoAllTokenDispatcher": "alltoall", "MoEAllGatherTokenDispatcher": "allgather"}
"""Token dispatchers whose send/receive counts the adapter reads, by class name."""


def installed_version() -> str:
    """The installed megatron-core version string."""
    from megatron.core import package_info

    return str(package_info.__version__)


@dataclass(frozen=True)
class MegatronMoELayer:
    """One MoE layer of the model.

    Attributes:
        index: compact MoE layer index (``0..L-1``), in module order.
        name: module path in the model.
        module: the ``MoELayer``.
        layer_id: Megatron's ``layer_number - 1`` (model layer index), else ``index``.
        num_experts, top_k: from the layer's ``TransformerConfig``.
        num_local_experts: experts this EP rank holds; ``local_experts`` their global ids.
        ep_size, ep_rank: the layer's expert-parallel group.
        dispatcher: ``"alltoall"`` or ``"allgather"``.
    """

    index: int
    name: str
    module: torch.nn.Module
    layer_id: int
    num_experts: int
    top_k: int
    num_local_experts: int
    local_experts: tuple[int, ...]
    ep_size: int
    ep_rank: int
    dispatcher: str

    @property
    def router(self) -> torch.nn.Module:
        return self.module.router


def _refuse(what: str) -> UnsupportedVersionError:
    return UnsupportedVersionError(
        f"megatron-core {installed_version()}: {what}. moetrace.adapters.megatron was written against "
        "megatron-core 0.16.1 (docs/integrations/megatron.md lists what is tested); file an issue with this message"
    )


def _check_routing_function() -> None:
    from megatron.core.transformer.moe import moe_utils

    fn = getattr(moe_utils, "topk_routing_with_score_function", None)
    if fn is None or "router_replay" not in inspect.signature(fn).parameters:
        raise _refuse("moe_utils.topk_routing_with_score_function(..., router_replay=) is missing, where the router's top-k ids are read")


def _describe(name: str, module: torch.nn.Module, index: int) -> MegatronMoELayer:
    missing = [m for m in PHASE_METHODS if not callable(getattr(module, m, None))]
    if missing:
        raise _refuse(f"{name} ({type(module).__name__}) has no {', '.join(missing)} method(s)")
    router = getattr(module, "router", None)
    config = getattr(module, "config", None)
    if router is None or not hasattr(router, "router_replay") or config is None:
        raise _refuse(f"{name}.router ({type(router).__name__}) has no router_replay attribute, through which the top-k ids are read")
    if getattr(router, "routing_type", None) == "sinkhorn":
        raise NoMoELayersError(
            f"{name}: Sinkhorn routing (moe_router_load_balancing_type='sinkhorn') selects experts without the "
            "router_replay hook moetrace reads; use 'aux_loss', 'seq_aux_loss', 'global_aux_loss' or 'none'"
        )
    if getattr(config, "moe_router_fusion", False):
        raise NoMoELayersError(
            f"{name}: moe_router_fusion=True routes with Transformer Engine's fused top-k, which bypasses the "
            "router_replay hook moetrace reads; turn moe_router_fusion off for an instrumented run"
        )
    dispatcher = DISPATCHERS.get(type(module.token_dispatcher).__name__)
    if dispatcher is None:
        raise NoMoELayersError(
            f"{name}: the {type(module.token_dispatcher).__name__} token dispatcher is not supported (moetrace reads the "
            f"'alltoall' and 'allgather' dispatchers: {sorted(DISPATCHERS)}); set moe_token_dispatcher_type accordingly"
        )
    from megatron.core.utils import get_pg_rank, get_pg_size

    ep_group = getattr(module, "ep_group", None)
    ep_size, ep_rank = get_pg_size(ep_group), get_pg_rank(ep_group)
    number = getattr(module, "layer_number", None)
    return MegatronMoELayer(
        index=index,
        name=name,
        module=module,
        layer_id=int(number) - 1 if isinstance(number, int) else index,
        num_experts=int(config.num_moe_experts),
        top_k=int(config.moe_router_topk),
        num_local_experts=int(module.num_local_experts),
        local_experts=tuple(int(e) for e in module.local_expert_indices),
        ep_size=int(ep_size),
        ep_rank=int(ep_rank),
        dispatcher=dispatcher,
    )


def find_moe_layers(model: torch.nn.Module) -> list[MegatronMoELayer]:
    """Every Megatron ``MoELayer`` inside ``model`` (a ``GPTModel``, a stack, or one layer), in module order.

    Raises:
        NoMoELayersError: none found, or a layer whose routing or dispatcher cannot be observed.
        UnsupportedVersionError: a Megatron whose MoE layer lacks what the adapter reads.
    """
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    _check_routing_function()
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, BaseMoELayer)]
    if not found:
        raise NoMoELayersError(
            f"{type(model).__name__} holds no megatron.core MoE layer (BaseMoELayer); build the model with an MoE "
            "spec (num_moe_experts set, e.g. get_gpt_layer_local_spec(num_experts=...)) or pass the MoE layers' parent"
        )
    layers = [_describe(name or type(module).__name__, module, i) for i, (name, module) in enumerate(found)]
    shapes = {(layer.num_experts, layer.top_k, layer.ep_size) for layer in layers}
    if len(shapes) > 1:
        raise NoMoELayersError(f"{type(model).__name__}: MoE layers differ in (experts, top_k, ep_size) {sorted(shapes)}; instrument each group separately")
    return layers

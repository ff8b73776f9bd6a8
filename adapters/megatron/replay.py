"""Replay routes into a Megatron-Core training forward (R3), with the replay audit.

::

    from moetrace.adapters import megatron as mt
    with mt.replay(model, routes) as r:       # [B, S, L, k] logical ids (or a routes file / wire payload)
        loss = loss_fn(model(input_ids))       # input_ids [B, S]; every MoE layer routes to `routes`
        loss.backward()                        # probs are the live scores at the replayed ids: the router learns
    r.audit_report().check()                   # share of rows whose experts used == requested; routers reached

Two mechanisms, chosen per model:

- **Megatron's RouterReplay** when every router has one (``moe_enable_routing_replay=True``)
  and the routes have no ``-1`` rows: each router's ``RouterReplay`` gets its layer's
  ``[T, k]`` ids (``set_target_indices``) and the ``REPLAY_FORWARD`` action; both are put
  back on exit. A recomputed forward reuses the same targets.
- **moetrace's router hook** otherwise: the router's ``router_replay`` slot answers
  ``get_replay_topk`` with the replayed ids and the scores gathered at them (as
  RouterReplay does); rows of ``-1`` keep the router's own top-k.

Token order: Megatron's MoE layers see ``[S, B]`` flattened sequence-major (token
``s * B + b``); routes are given batch-major ``[B, S, ...]``, as the other adapters take
them, and reordered here. The audit reads the ``routing_map`` each dispatcher receives
(:mod:`moetrace.replay_audit`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moetrace.replay import (
    LayerRoutes,
    ReplayError,
    ReplayHandle,
    check_not_replaying,
    prepare_routes,
)
from moetrace.replay_audit import ReplayAudit, ReplayAuditReport

from ..base import HookRegistry
from .hooks import TopKSlot
from .layers import MegatronMoELayer, find_moe_layers

__all__ = ["MegatronReplay", "replay"]


class MegatronReplay(ReplayHandle):
    """A live replay on a Megatron-Core model; ``remove()`` (or leaving the ``with`` block) undoes it.

    Attributes:
        layers: the replayed MoE layers.
        routes: ``[B, S, L, k]`` int64 logical ids.
        mechanism: ``"router_replay"`` (Megatron's) or ``"moetrace"`` (the router hook).
        audit: the :class:`~moetrace.replay_audit.ReplayAudit` of this replay.
    """

    def __init__(self, model: torch.nn.Module, layers: list[MegatronMoELayer], routes: np.ndarray, hooks: HookRegistry, mechanism: str, audit: ReplayAudit) -> None:
        super().__init__(model, routes, [_Undo(hooks)])
        self.layers, self.mechanism, self.audit = tuple(layers), mechanism, audit

    def audit_report(self) -> ReplayAuditReport:
        """The audit so far (reads device counters)."""
        return self.audit.report()


class _Undo:
    def __init__(self, hooks: HookRegistry) -> None:
        self.hooks = hooks

    def remove(self) -> None:
        self.hooks.remove_all()


def _uses_router_replay(layers: list[MegatronMoELayer], arr: np.ndarray) -> bool:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return all(isinstance(layer.router.router_replay, RouterReplay) for layer in layers) and bool((arr >= 0).all())


def replay(model: torch.nn.Module, routes: Any, *, weight_version: str | None = None, allow_other_weight_version: bool = False) -> MegatronReplay:
    """Make every MoE layer of ``model`` route to ``routes`` in its forwards, until removed.

    Args:
        model: the module whose ``forward`` is replayed (a ``GPTModel``, a stack of
            ``MoELayer`` s); it may take anything (``input_ids [B, S]``, hidden states
            ``[S, B, H]``...): each router checks the tokens it routes, ``S * B``, against
            the routes.
        routes: ``[B, S, L, k]`` or ``[S, L, k]`` logical ids, ``-1`` for rows without
            routes; ``L`` is the MoE layers or every model layer (``-1`` for dense
            ones). A numpy array, a tensor, a wire payload, or a one-request routes
            file (``moetrace-routes`` JSON, e.g. from ``moetrace routes`` or SGLang's
            ``routed_experts`` saved with :func:`moetrace.routes.save_routes`).
        weight_version: the weights being trained: routes whose provenance names another
            weight version are refused unless ``allow_other_weight_version``
            (:func:`moetrace.replay.prepare_routes`).
        allow_other_weight_version: replay routes of another weight version anyway.

    Raises:
        ReplayError: routes that do not fit (shape, top-k, ids); (in the forward) a router
            that routes another number of tokens than the routes hold.
        ReplayUnreachedError: (at the end of a forward) a targeted router was not reached.
    """
    check_not_replaying(model)
    layers = find_moe_layers(model)
    first = layers[0]
    arr = prepare_routes(
        routes, num_moe_layers=len(layers), layer_ids=[layer.layer_id for layer in layers],
        num_experts=first.num_experts, top_k=first.top_k,
        weight_version=weight_version, allow_other_weight_version=allow_other_weight_version,
    )
    batch, seq = arr.shape[:2]
    flat = np.ascontiguousarray(arr.transpose(1, 0, 2, 3)).reshape(seq * batch, len(layers), first.top_k)
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    per_layer = [LayerRoutes(flat[:, layer.index], device) for layer in layers]
    targets = [(layer.index, int((flat[:, layer.index] >= 0).all(-1).sum())) for layer in layers]
    audit = ReplayAudit([layer.name for layer in layers], device, engine="megatron")
    mechanism = "router_replay" if _uses_router_replay(layers, arr) else "moetrace"
    hooks = HookRegistry()
    try:
        for layer, routes_l in zip(layers, per_layer, strict=True):
            _attach(hooks, layer, routes_l, audit, mechanism)
        _attach_forward(hooks, model, audit, targets)
    except BaseException:
        hooks.remove_all()
        raise
    return MegatronReplay(model, layers, arr, hooks, mechanism, audit)


def _check_tokens(scores: torch.Tensor, routes: LayerRoutes, name: str) -> None:
    if scores.shape[0] != routes.ids.shape[0]:
        raise ReplayError(
            f"{name} routes {scores.shape[0]} tokens but the routes hold {routes.ids.shape[0]} (batch x seq); give routes "
            "[B, S, layers, k] for a forward of B sequences of S tokens (input_ids [B, S] or hidden states [S, B, H]; "
            "sequence parallel and context parallel splits are not replayed)"
        )


def _attach(hooks: HookRegistry, layer: MegatronMoELayer, routes: LayerRoutes, audit: ReplayAudit, mechanism: str) -> None:
    router, index, name = layer.router, layer.index, layer.name
    if mechanism == "router_replay":
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        megatron_replay = router.router_replay
        previous_action = megatron_replay.router_replay_action
        megatron_replay.set_target_indices(routes.ids)
        megatron_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

        def restore() -> None:
            megatron_replay.clear_indices()
            megatron_replay.set_router_replay_action(previous_action)

        hooks.on_remove(f"RouterReplay targets of {name}", restore)

        def reached(ids: torch.Tensor) -> None:
            audit.reached(index)

        def check(scores: torch.Tensor) -> None:  # RouterReplay would gather fewer rows without a word
            _check_tokens(scores, routes, name)

        hooks.patch(router, "router_replay", TopKSlot(router.router_replay, on_ids=reached, on_scores=check))
    else:

        def compute(scores: torch.Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None, *, default: Any) -> tuple[torch.Tensor, torch.Tensor]:
            _check_tokens(scores, routes, name)
            ids = routes.ids
            if routes.partial:
                live = default(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
                ids = torch.where(routes.valid, ids, live)
            audit.reached(index)
            return scores.gather(1, ids), ids

        hooks.patch(router, "router_replay", TopKSlot(router.router_replay, compute=compute))
    dispatcher = layer.module.token_dispatcher
    original = dispatcher.dispatch_preprocess

    def dispatch_preprocess(*args: Any, **kwargs: Any) -> Any:
        routing_map = kwargs["routing_map"] if "routing_map" in kwargs else args[1]
        audit.observe_map(index, routing_map, routes.ids, routes.valid, layer.top_k)
        return original(*args, **kwargs)

    hooks.patch(dispatcher, "dispatch_preprocess", dispatch_preprocess)


def _attach_forward(hooks: HookRegistry, model: torch.nn.Module, audit: ReplayAudit, targets: list[tuple[int, int]]) -> None:
    """Audit each forward of ``model``. Its arguments are not read: whatever it takes (input ids,
    hidden states), the token count is checked where it is exact, at each router (:func:`_check_tokens`)."""

    def begin(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        audit.begin_forward(targets)

    def end(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        audit.end_forward()

    pre = model.register_forward_pre_hook(begin)
    post = model.register_forward_hook(end)
    hooks.on_remove("replay forward hooks", lambda: (pre.remove(), post.remove(), None)[-1])

"""Routing replay on the reference runtime, dense and expert-parallel.

::

    from moetrace.reference import replay
    with replay(model, routes):              # [B, S, MoE layers, k] or [B, S, model layers, k]
        logits = model(input_ids)            # input_ids [B, S]; each router returns the replayed ids

Each MoE layer's :class:`~moetrace.reference.gate.TopKRouter` runs under
:class:`moetrace.replay.TopKReplay`: its ``torch.topk`` over the softmax
probabilities returns the replayed ids with the probabilities at them, then
the router renormalises as configured (``renormalize``). The recorder and a
capturer see the replayed ids. Under EP every rank replays the routes of its
own tokens (the router is replicated; ids are global logical ids).

The replay audit (:mod:`moetrace.replay_audit`, ``handle.audit_report()``) reads the
ids each router returns to its layer, and fails a forward that never reached a
targeted router. Covers :meth:`ReferenceMoEModel.forward` (teacher-forced); the serving
loop's ``forward_batch`` raises :class:`~moetrace.replay.ReplayError` while
a replay is installed.
"""

from __future__ import annotations

from typing import Any

import torch

from ..replay import (
    ReplayError,
    ReplayHandle,
    ReplayState,
    attach_block_replay,
    audit_forwards,
    check_not_replaying,
    prepare_routes,
)
from ..replay_audit import ReplayAudit
from .model import ReferenceMoEModel

__all__ = ["replay"]


class _ServingRefusal:
    """Shadows ``model.forward_batch`` with one that raises, until :meth:`remove`."""

    def __init__(self, model: ReferenceMoEModel) -> None:
        self.model = model

        def forward_batch(*args: Any, **kwargs: Any) -> Any:
            raise ReplayError("the serving loop's forward_batch is not replayed; remove the replay before serving")

        model.forward_batch = forward_batch  # type: ignore[method-assign]

    def remove(self) -> None:
        self.model.__dict__.pop("forward_batch", None)


def replay(model: ReferenceMoEModel, routes: Any, *, weight_version: str | None = None, allow_other_weight_version: bool = False) -> ReplayHandle:
    """Make ``model.forward`` route every MoE layer to ``routes`` until the handle is removed.

    Args:
        model: a :class:`ReferenceMoEModel` (dense or one EP rank's).
        routes: ``[B, S, L, k]`` or ``[S, L, k]`` logical ids (``L`` = MoE
            layers, or model layers with ``-1`` for dense ones), ``-1`` for
            positions without routes; array, tensor, wire payload or one-request routes file.
        weight_version, allow_other_weight_version: refuse routes of another weight version
            unless allowed (:func:`moetrace.replay.prepare_routes`).

    Raises:
        ReplayError: routes that do not fit the model.
    """
    if not isinstance(model, ReferenceMoEModel):
        raise TypeError(f"replay() takes a ReferenceMoEModel, got {type(model).__name__}; for transformers models use moetrace.adapters.hf.replay")
    check_not_replaying(model)
    config = model.config
    layer_ids = list(model.moe_layer_ids)
    arr = prepare_routes(routes, num_moe_layers=len(layer_ids), layer_ids=layer_ids, num_experts=config.num_experts, top_k=config.top_k,
                         weight_version=weight_version, allow_other_weight_version=allow_other_weight_version)
    state = ReplayState(arr, model.device_)

    def begin(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = args[0] if args else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ReplayError("replay needs input_ids [B, S] to match the routes to the forward's tokens")
        state.begin(int(ids.shape[0]), int(ids.shape[1]))

    names = [f"MoE layer {index} (model layer {layer.layer_id})" for index, layer in enumerate(model.moe_layers)]
    audit = ReplayAudit(names, model.device_, engine="reference")
    handles: list[Any] = [model.register_forward_pre_hook(begin, with_kwargs=True), _ServingRefusal(model)]
    handles += audit_forwards(model, audit, state)
    for index, (layer, name) in enumerate(zip(model.moe_layers, names, strict=True)):
        handles += attach_block_replay(
            layer.router, None, lambda index=index, name=name: state.layer(index, name), config.num_experts, config.top_k, name,
            reached=lambda index=index: audit.reached(index),
        )
        handles.append(layer.router.register_forward_hook(_observe(audit, state, index, name)))
    return ReplayHandle(model, arr, handles, audit)


def _observe(audit: ReplayAudit, state: ReplayState, index: int, name: str) -> Any:
    """Audit point: the ids the router hands its MoE layer (its output ``(ids [T, k], weights)``)."""

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        routes = state.layer(index, name)
        audit.observe_ids(index, output[0], routes.ids, routes.valid)

    return hook

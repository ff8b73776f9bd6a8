"""Replay recorded routes into a transformers model (rollout routing replay for RL training).

::

    from moetrace.adapters import hf
    with hf.replay(model, routes):           # [batch, seq, MoE layers, k] logical ids, -1 = none
        logits = model(input_ids).logits     # every MoE layer uses the given experts
        loss.backward()                      # weights came from the live router scores: the router learns

Each MoE block (the parent of the module :func:`~moetrace.adapters.hf.layers.find_moe_sites`
finds) runs its router under :class:`moetrace.replay.TopKReplay` until its
experts module is called: the router's own ``torch.topk`` over ``[T, E]``
returns the replayed ids with the scores at those ids, and the family's own
code normalises them (softmax, renormalisation, scaling). Rows of ``-1`` keep
the model's own top-k. Families whose router does not select with
``torch.topk`` are refused (:data:`~moetrace.adapters.hf.families.REPLAY_REFUSED`).

The replay audit (:mod:`moetrace.replay_audit`, ``handle.audit_report()``) reads the
``top_k_index`` each experts module is called with and fails a forward that never
reached a targeted router; the router-hooked families (Llama 4, JetMoE) are checked
for reach only (their experts take dense scores, no index to read).

Replay covers a teacher-forced forward (what RL training runs): a forward over
``[B, S]`` tokens with routes for ``[B, S]`` positions, or ``[B, S - 1]`` (a
rollout's last token has no routes; it keeps its own top-k). A forward that
continues a KV cache is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moetrace.replay import (
    ReplayError,
    ReplayHandle,
    ReplayState,
    attach_block_replay,
    audit_forwards,
    check_not_replaying,
    prepare_routes,
)
from moetrace.replay_audit import ReplayAudit

from .families import REPLAY_REFUSED
from .layers import MoESite, find_moe_sites, model_top_k
from .version import check_transformers, installed_version

__all__ = ["HFReplay", "replay"]


class HFReplay(ReplayHandle):
    """A live replay on a transformers model: ``remove()`` (or leaving the ``with`` block) takes it off.

    Attributes:
        model: the model.
        sites: its MoE sites, in compact layer order.
        routes: ``[B, S, L, k]`` int64 logical ids being replayed (``L`` = MoE layers).
    """

    def __init__(self, model: torch.nn.Module, sites: list[MoESite], routes: np.ndarray, handles: list[Any], audit: ReplayAudit) -> None:
        super().__init__(model, routes, handles, audit)
        self.sites = tuple(sites)


def _input_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    ids = args[0] if args else kwargs.get("input_ids")
    if ids is None:
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise ReplayError("replay needs input_ids or inputs_embeds to match the routes to the forward's tokens")
        return int(embeds.shape[0]), int(embeds.shape[1])
    return (1, int(ids.shape[0])) if ids.dim() == 1 else (int(ids.shape[0]), int(ids.shape[1]))


def _cache_length(kwargs: dict[str, Any]) -> int:
    cache = kwargs.get("past_key_values")
    return int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0


def _refuse_family(model: torch.nn.Module) -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None) or ""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else None
    for family in (model_type, getattr(text, "model_type", "") or ""):
        if family in REPLAY_REFUSED:
            raise ReplayError(f"{type(model).__name__}: replay is not supported for the '{family}' family: {REPLAY_REFUSED[family]}")


def replay(
    model: torch.nn.Module, routes: Any, *, top_k: int | None = None, weight_version: str | None = None,
    allow_other_weight_version: bool = False,
) -> HFReplay:
    """Make every MoE layer of ``model`` route to ``routes`` in its forward passes, until removed.

    Args:
        model: a transformers model (``*ForCausalLM`` or base model); its
            forward is the one whose calls are replayed.
        routes: ``[batch, seq, num_moe_layers, top_k]`` or ``[seq, ...]`` for
            batch 1, logical expert ids, ``-1`` for positions without routes;
            the layer axis may also be every model layer (``-1`` for dense
            ones, as a capture gives it). A numpy array, a tensor, or a wire
            payload (:func:`moetrace.wire.encode_routed_experts`).
        top_k: experts per token when the model does not say.
        weight_version: the weights being trained: routes whose provenance names another
            weight version are refused unless ``allow_other_weight_version``
            (:func:`moetrace.replay.prepare_routes`).
        allow_other_weight_version: replay routes of another weight version anyway.

    Returns:
        The live :class:`HFReplay` (also a context manager).

    Raises:
        ReplayError: a family that cannot be replayed (with the reason), or
            routes that do not fit the model (shape, top-k, physical or
            out-of-range ids, duplicate ids, rows mixing ``-1`` and ids).
        NoMoELayersError: the model has no MoE layer.
    """
    check_transformers(installed_version())
    check_not_replaying(model)
    _refuse_family(model)
    sites = find_moe_sites(model)
    k = top_k if top_k is not None else model_top_k(model, sites)
    num_experts = max(site.num_experts for site in sites)
    arr = prepare_routes(routes, num_moe_layers=len(sites), layer_ids=[s.layer_id for s in sites], num_experts=num_experts, top_k=k,
                         weight_version=weight_version, allow_other_weight_version=allow_other_weight_version)
    param = next(model.parameters(), None)
    state = ReplayState(arr, param.device if param is not None else torch.device("cpu"))
    modules = dict(model.named_modules())

    def begin(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state.begin(*_input_shape(args, kwargs), _cache_length(kwargs))

    audit = ReplayAudit([site.name for site in sites], state.device, engine="hf", observable=[not site.on_router for site in sites])
    handles = [model.register_forward_pre_hook(begin, with_kwargs=True), *audit_forwards(model, audit, state)]
    for site in sites:
        parent_name = site.name.rpartition(".")[0]
        block = modules[parent_name]
        until = None if site.on_router else site.module
        handles += attach_block_replay(
            block, until, lambda index=site.index, name=site.name: state.layer(index, name), site.num_experts, k, site.name,
            reached=lambda index=site.index: audit.reached(index),
        )
        if until is not None:
            handles.append(until.register_forward_pre_hook(_observe(audit, state, site), with_kwargs=True))
    return HFReplay(model, sites, arr, handles, audit)


def _observe(audit: ReplayAudit, state: ReplayState, site: MoESite) -> Any:
    """Audit point: the ``top_k_index`` the experts module is called with (what it computes with)."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        used = args[1] if len(args) > 1 else kwargs["top_k_index"]
        routes = state.layer(site.index, site.name)
        audit.observe_ids(site.index, used.reshape(-1, used.shape[-1]), routes.ids, routes.valid)

    return hook

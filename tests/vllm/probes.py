"""Functions that ``llm.apply_model`` runs inside vLLM's worker process, to look at the plugin there."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["expert_maps", "failsafe_state", "plugin_state", "uninstrument"]


def plugin_state(model: torch.nn.Module) -> dict[str, Any]:
    """The plugin's session in this worker, after calling ``register()`` once more (it must change nothing)."""
    from moetrace.adapters.vllm import plugin
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    session = plugin.current_session()
    plugin.register()
    load_model = BaseModelLoader.load_model
    handle = session.handle if session is not None else None
    return {
        "same_session": plugin.current_session() is session,
        "instrumented": handle is not None and handle.active and handle.target is model,
        "layer_ids": tuple(handle.layer_ids) if handle is not None else (),
        "wrapped_once": getattr(load_model, plugin._MARK, False) and not getattr(load_model.__wrapped__, plugin._MARK, False),
        "recording": handle is not None and handle.recorder.recording,
        "mode": handle.recorder.mode if handle is not None else None,
        "steps_followed": handle is not None and handle.details["batches"].attached,
    }


def uninstrument(model: torch.nn.Module) -> bool:
    """Remove the plugin's hooks from this worker's model (its recorder stays, and counts nothing more)."""
    from moetrace.adapters.vllm import plugin

    session = plugin.current_session()
    assert session is not None and session.handle is not None, "the plugin did not instrument this worker"
    session.handle.uninstrument()
    return not session.handle.active


def expert_maps(model: torch.nn.Module) -> dict[int, list[int]]:
    """Each MoE layer's ``expert_map`` in this worker (global expert -> local slot, -1: another rank's); ``{}`` without EP."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return {int(m.layer_id): m.expert_map.tolist() for m in model.modules() if isinstance(m, MoERunner) and m.expert_map is not None}


def failsafe_state(model: torch.nn.Module) -> dict[str, Any]:
    """The plugin's fail-safe in this worker: whether moetrace is on, what turned it off, whether the model is still hooked."""
    from moetrace.adapters.vllm import plugin

    session = plugin.current_session()
    assert session is not None, "the plugin did not register in this worker"
    handle = session.handle
    return {
        "on": session.failsafe.on,
        "error": session.failsafe.error,
        "hooked": handle is not None and handle.active and handle.target is model,
    }

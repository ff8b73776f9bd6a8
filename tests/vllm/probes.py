"""Functions that ``llm.apply_model`` runs inside vLLM's worker process, to look at the plugin there."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["plugin_state"]


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
    }

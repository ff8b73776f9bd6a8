"""Phase timing inside SGLang's MoE layers: route, dispatch, expert, combine.

With ``RecorderConfig(timing=True)`` (``MOETRACE_TIMING=1`` for the plugin),
:func:`watch_phases` wraps the SGLang methods that bound each phase, so that
they run inside ``recorder.with_phase(name)`` of the moetrace recorder behind
SGLang's global recorder (a :class:`~.bridge.RecorderBridge`):

=========  ==================================================================  =================================================
phase      SGLang 0.5.23 method                                                what it holds on the standard (no a2a) path
=========  ==================================================================  =================================================
route      ``layers.moe.topk.TopK.forward``                                    top-k selection, logical-to-physical map, the
                                                                               recorder hook (the router gate's linear layer
                                                                               runs before it, in the model's MoE block)
dispatch   ``layers.moe.fused_moe_triton.layer.FusedMoE._dispatch_with_pre_quant``  the dispatcher: under EP, physical ids to the
                                                                               rank's local experts (``-1`` elsewhere). No
                                                                               tokens move: TP attention gives every rank
                                                                               every token
expert     ``FusedMoE.run_moe_core``                                           the rank's expert compute
combine    ``layers.layer_boundary.stage.StageBoundary.finish`` of FFN stages   the MoE output's hand-off, which completes the
                                                                               TP/EP sum (all-reduce) or, when SGLang fuses it
                                                                               into the next layer's input, declares it
=========  ==================================================================  =================================================

A method this SGLang lacks is left alone and its phase is not timed (logged
once). Wrapping is undone by ``uninstrument()``. The wrappers only enter a
phase scope: they read no tensor value (no host-device sync).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

from ..base import HookRegistry
from .bridge import RecorderBridge

__all__ = ["PHASE_METHODS", "watch_phases"]

logger = logging.getLogger(__name__)

PHASE_METHODS: tuple[tuple[str, str, str, str], ...] = (
    ("route", "sglang.srt.layers.moe.topk", "TopK", "forward"),
    ("dispatch", "sglang.srt.layers.moe.fused_moe_triton.layer", "FusedMoE", "_dispatch_with_pre_quant"),
    ("expert", "sglang.srt.layers.moe.fused_moe_triton.layer", "FusedMoE", "run_moe_core"),
    ("combine", "sglang.srt.layers.layer_boundary.stage", "StageBoundary", "finish"),
)
"""``(phase, module, class, method)`` of each phase's bounding SGLang method."""

_UNTIMED = contextlib.nullcontext()


def _is_ffn_stage(stage: Any) -> bool:
    kind = getattr(stage, "kind", None)
    return getattr(kind, "name", None) == "FFN"


def _timed(original: Callable[..., Any], phase: str, current: Callable[[], Any], only: Callable[[Any], bool] | None) -> Callable[..., Any]:
    @functools.wraps(original)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        bridge = current()
        scope = bridge.phase(phase) if isinstance(bridge, RecorderBridge) and (only is None or only(self)) else _UNTIMED
        with scope:
            return original(self, *args, **kwargs)

    return timed


def watch_phases(hooks: HookRegistry, recorder_module: Any) -> list[str]:
    """Wrap :data:`PHASE_METHODS` (registered in ``hooks``); returns the phases timed.

    Args:
        hooks: the instrumentation's registry (undone by ``uninstrument()``).
        recorder_module: ``sglang.srt.eplb.expert_distribution`` (its
            ``get_global_expert_distribution_recorder`` finds the bridge).
    """
    timed = []
    for phase, module_name, class_name, method in PHASE_METHODS:
        try:
            owner = getattr(importlib.import_module(module_name), class_name)
            original = getattr(owner, method)
        except (ImportError, AttributeError) as exc:
            logger.warning("moetrace: SGLang has no %s.%s.%s (%s); the %r phase is not timed", module_name, class_name, method, exc, phase)
            continue
        only = _is_ffn_stage if phase == "combine" else None
        hooks.patch(owner, method, _timed(original, phase, recorder_module.get_global_expert_distribution_recorder, only))
        timed.append(phase)
    return timed

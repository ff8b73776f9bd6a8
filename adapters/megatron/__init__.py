"""Megatron-Core adapter: observe (and replay) every MoE layer of a training model.

::

    from moetrace.adapters import megatron as mt
    handle = mt.instrument(model)             # GPTModel, a MoELayer stack, or one MoELayer
    handle.recorder.start_record()
    loss = forward_step(model, batch)          # each model forward (a micro-batch) is one pass
    loss.backward()                            # backward and recomputed forwards count nothing
    handle.recorder.dump_record("step.h5")    # the same trace as every engine: analyze, plot, diff
    handle.uninstrument()

Per micro-batch forward, per MoE layer, on each EP rank:

- routed ids ``[T, k]`` in top-k order, from the router's ``router_replay`` slot
  (:class:`~moetrace.adapters.megatron.hooks.TopKSlot`), counted per expert;
- dispatch send/receive counts per EP rank (the all-to-all split sizes, or the
  all-gather routing map), and token copies dropped over ``moe_expert_capacity_factor``;
- tokens per local expert after dispatch (:meth:`MegatronInstrumentation.expert_tokens`);
- with ``RecorderConfig(timing=True)``, phases on Megatron's own boundaries:
  ``route`` (``MoELayer.route``), ``dispatch`` (``preprocess`` = permute, ``dispatch`` =
  the collective), ``expert`` (``routed_experts_compute``), ``combine`` (``combine`` +
  ``postprocess``);
- Megatron's own aux loss and z-loss per layer next to moetrace's balance metrics
  (:meth:`MegatronInstrumentation.training_report`).

A pass is one call of the instrumented model's ``forward`` (``mark_passes=True``): one
micro-batch. ``backward()`` records nothing; a forward recomputed during ``backward()``
(``recompute_granularity="selective"``, ``recompute_modules=["moe"]``, or any activation
checkpointing around the MoE layers) is seen by the taps and skipped, so it never counts
twice. Attachment is by feature detection (:mod:`~moetrace.adapters.megatron.layers`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..base import (
    HookRegistry,
    Instrumentation,
    existing_instrumentation,
    forward_pass_wrapper,
    recorder_scope,
    refuse_capturer,
    resolve_recorder,
    unwinding,
)
from ..failsafe import FailSafe
from .hooks import LayerTap, TopKSlot
from .layers import MegatronMoELayer, find_moe_layers, installed_version
from .losses import megatron_aux_losses
from .replay import MegatronReplay, replay
from .routes import RoutesRecording, record_routes

__all__ = [
    "MegatronInstrumentation",
    "MegatronMoELayer",
    "MegatronReplay",
    "RoutesRecording",
    "find_moe_layers",
    "installed_version",
    "instrument",
    "megatron_aux_losses",
    "record_routes",
    "replay",
]

_PHASES = {
    "route": "route",
    "preprocess": "dispatch",
    "dispatch": "dispatch",
    "routed_experts_compute": "expert",
    "combine": "combine",
    "postprocess": "combine",
}


class MegatronInstrumentation(Instrumentation):
    """:class:`~moetrace.adapters.base.Instrumentation` of a Megatron-Core model.

    Attributes:
        layers: the hooked MoE layers, in compact layer order.
        taps: one :class:`~moetrace.adapters.megatron.hooks.LayerTap` per layer.
    """

    layers: tuple[MegatronMoELayer, ...]
    taps: tuple[LayerTap, ...]
    _expert_tokens: torch.Tensor

    def expert_tokens(self) -> np.ndarray:
        """``[L, E_local]`` tokens each of this rank's experts received since the recorder started (host copy)."""
        return self._expert_tokens.cpu().numpy().copy()

    def reset_expert_tokens(self) -> None:
        """Zero :meth:`expert_tokens` (``recorder.reset()`` does not reach it)."""
        self._expert_tokens.zero_()

    def training_report(self) -> dict[str, np.ndarray]:
        """Per MoE layer ``[L]``: Megatron's aux losses (as its tracker holds them now) and moetrace's balance.

        Keys: every loss Megatron tracked (``load_balancing_loss``, ``z_loss``, ...,
        summed over the micro-batches since Megatron last cleared its tracker), and
        moetrace's ``balancedness`` / ``imbalance`` (mean/max and max/mean of the
        per-EP-rank load) and ``entropy`` (normalised routing entropy) over this
        rank's tokens since ``start_record``. Reads device values: call it after the step.
        """
        from moetrace import balance

        assert self.recorder is not None
        snap = self.recorder.snapshot()
        counts = np.asarray(snap.logical_count, dtype=np.float64)
        load = balance.rank_load(counts, max(1, self.layers[0].ep_size))
        report = {name: values for name, values in megatron_aux_losses([layer.module for layer in self.layers]).items()}
        report["balancedness"] = balance.layer_balancedness(load)
        report["imbalance"] = balance.layer_imbalance(load)
        report["entropy"] = balance.entropy_ratio(counts)
        return report


def _patch_dispatcher(hooks: HookRegistry, tap: LayerTap, dispatcher: Any, kind: str, failsafe: FailSafe) -> None:
    pre = "preprocess" if kind == "alltoall" else "dispatch_preprocess"
    original_pre = getattr(dispatcher, pre)
    original_post = dispatcher.dispatch_postprocess

    def dispatched(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        tap.dispatched(dispatcher, kwargs["routing_map"] if "routing_map" in kwargs else args[0 if pre == "preprocess" else 1])

    observe_pre = failsafe.guard(dispatched, f"the dispatch tap of MoE layer {tap.layer.index}")
    observe_post = failsafe.guard(lambda out: tap.received(dispatcher, out[1]), f"the receive tap of MoE layer {tap.layer.index}")

    def preprocess(*args: Any, **kwargs: Any) -> Any:
        out = original_pre(*args, **kwargs)
        observe_pre(args, kwargs)
        return out

    def dispatch_postprocess(*args: Any, **kwargs: Any) -> Any:
        out = original_post(*args, **kwargs)
        observe_post(out)
        return out

    hooks.patch(dispatcher, pre, preprocess)
    hooks.patch(dispatcher, "dispatch_postprocess", dispatch_postprocess)


def _recorder_defaults(target: torch.nn.Module, first: MegatronMoELayer) -> dict[str, Any]:
    """The recorder fields the model gives: engine, model, hidden size, EP size and rank, dtype and device."""
    config = first.module.config
    defaults: dict[str, Any] = {
        "engine": "megatron",
        "model": type(target).__name__,
        "hidden_size": int(config.hidden_size),
        "ep_size": first.ep_size,
        "ep_rank": first.ep_rank,
        "dtype_bytes": torch.finfo(config.params_dtype).bits // 8,
    }
    param = next(target.parameters(), None)
    if param is not None:
        defaults["device"] = param.device
    return defaults


def _tap_layer(hooks: HookRegistry, rec: Any, layer: MegatronMoELayer, expert_tokens: torch.Tensor, timing: bool,
               failsafe: FailSafe) -> LayerTap:
    """Hook one MoE layer: its router's top-k slot, its token dispatcher and, with ``timing``, its timed phases and
    layer scope. ``expert_tokens [local experts]``: the layer's row of the handle's per-expert token counts."""
    capacity = layer.module.config.moe_expert_capacity_factor is not None
    tap = LayerTap(rec, layer, expert_tokens, capacity)
    router = layer.router
    hooks.patch(router, "router_replay", TopKSlot(router.router_replay, on_ids=failsafe.guard(lambda ids: tap.topk(ids), f"the router tap of {layer.name}")))
    _patch_dispatcher(hooks, tap, layer.module.token_dispatcher, layer.dispatcher, failsafe)
    if timing:
        for method, phase in _PHASES.items():
            timed = failsafe.around(getattr(layer.module, method), recorder_scope(rec, phase=phase), f"the {phase} phase timing of {layer.name}")
            hooks.patch(layer.module, method, timed)
        hooks.wrap_forward(layer.module, lambda forward, index=layer.index: failsafe.around(
            forward, recorder_scope(rec, layer=index), f"the layer scope of MoE layer {index}"))
    return tap


def instrument(
    target: torch.nn.Module,
    recorder: Any = None,
    capturer: Any = None,
    *,
    mark_passes: bool = True,
    **recorder_options: Any,
) -> MegatronInstrumentation:
    """Hook every MoE layer of a Megatron-Core model ``target``.

    Args:
        target: a ``GPTModel``, any module holding ``MoELayer`` s, or one ``MoELayer``.
        recorder: the recorder to count into; ``None`` builds one from the layers
            (experts, top-k, layer numbers, EP size and rank, hidden size) and
            ``recorder_options`` and installs it globally.
        capturer: not supported by this adapter: keep a forward's routes with
            :func:`record_routes` instead.
        mark_passes: wrap ``target.forward`` in ``with_forward_pass`` (one pass per
            micro-batch); turn off when you mark passes yourself.
        **recorder_options: other :class:`~moetrace.config.RecorderConfig` fields.

    Returns:
        The live :class:`MegatronInstrumentation`; instrumenting again with the same
        (or no) recorder returns it.

    Raises:
        AdapterError: a capturer given.
        NoMoELayersError: no MoE layer, or one whose routing/dispatcher cannot be observed.
        UnsupportedVersionError: a Megatron-Core whose MoE layer lacks what is read.
        AlreadyInstrumentedError: instrumented already with another recorder.
    """
    refuse_capturer(capturer, "Megatron-Core", "keep a forward's routes with moetrace.adapters.megatron.record_routes(model)")
    live = existing_instrumentation(target, recorder, None)
    if live is not None:
        return live  # type: ignore[return-value]
    layers = find_moe_layers(target)
    first = layers[0]
    binding = resolve_recorder(recorder, len(layers), first.num_experts, first.top_k, [layer.layer_id for layer in layers],
                               adapter="megatron", defaults=_recorder_defaults(target, first), **recorder_options)
    rec = binding.recorder
    timing = bool(getattr(rec.config, "timing", False))
    expert_tokens = torch.zeros(len(layers), first.num_local_experts, dtype=torch.int64, device=rec.config.device)
    hooks = HookRegistry()
    failsafe = FailSafe("this Megatron-Core model")
    with unwinding(hooks, binding):
        taps = [_tap_layer(hooks, rec, layer, expert_tokens[layer.index], timing, failsafe) for layer in layers]
        if mark_passes:
            hooks.wrap_forward(target, forward_pass_wrapper(rec, failsafe))
        handle = MegatronInstrumentation(
            target, rec, [layer.layer_id for layer in layers], hooks, engine="megatron", failsafe=failsafe,
            details={
                "megatron_core": installed_version(),
                "dispatcher": first.dispatcher,
                "ep_size": first.ep_size,
                "layers": {layer.name: layer.layer_id for layer in layers},
            },
        )
    handle.layers = tuple(layers)
    handle.taps = tuple(taps)
    handle._expert_tokens = expert_tokens
    return handle

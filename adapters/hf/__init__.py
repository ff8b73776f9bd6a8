"""Hugging Face transformers adapter: observe every MoE layer of a model with one call.

::

    from moetrace.adapters import hf
    handle = hf.instrument(model)          # builds + installs a recorder from model.config
    handle.recorder.start_record()
    model.generate(**inputs)               # prefill and every decode step are passes
    handle.recorder.dump_record("run.h5")
    handle.uninstrument()                  # no hooks left, identical outputs

Hooks (see :mod:`moetrace.adapters.hf.families`):

- experts modules built by ``@use_experts_implementation`` (most families):
  a forward pre-hook reads ``top_k_index [T, k]``, whatever experts
  implementation (``eager``, ``grouped_mm``, ``batched_mm``, ...) runs;
- DBRX, LongCat-Flash, Step-3.7: the same pre-hook on their experts module;
- Llama 4, JetMoE: a forward hook on the router re-runs its ``topk``.

Phase timing (a recorder with ``RecorderConfig(timing=True)``): each experts
module's ``forward`` runs inside ``with_phase("expert")`` of its layer; the
router-hooked families (Llama 4, JetMoE) and the other phases are not timed.

The model's ``forward`` is wrapped so that each call is one
``recorder.with_forward_pass()``. Every hook and wrapper runs behind the
handle's :class:`~moetrace.adapters.failsafe.FailSafe`: a fault in one (a
capturer without room for the pass included) is one warning, moetrace is off
for the model from then on, and the forward returns what it would without
moetrace. With a capturer, each hook also calls
``capturer.capture(model_layer_id, topk_ids)`` and each forward ends with
``capturer.on_forward_end(out_cache_loc)``, where cache position ``t`` of
batch row ``b`` lives in KV slot ``b * capture_seq_len + t``;
:meth:`HFInstrumentation.routed_experts` reads one row back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..base import (
    AdapterError,
    HookRegistry,
    Instrumentation,
    existing_instrumentation,
    forward_pass_wrapper,
    recorder_scope,
    resolve_recorder,
    unwinding,
)
from ..failsafe import FailSafe
from .batches import RequestNames, cache_length
from .families import SiteSpec, moe_family_coverage
from .layers import MoESite, find_moe_sites, model_top_k
from .replay import HFReplay, replay
from .version import MIN_TRANSFORMERS, check_transformers, installed_version

__all__ = [
    "MIN_TRANSFORMERS",
    "HFInstrumentation",
    "HFReplay",
    "MoESite",
    "find_moe_sites",
    "installed_version",
    "instrument",
    "moe_family_coverage",
    "replay",
]

Record = Callable[[torch.Tensor], None]


class HFInstrumentation(Instrumentation):
    """:class:`~moetrace.adapters.base.Instrumentation` of a transformers model.

    Attributes:
        sites: the hooked MoE modules, in compact layer order.
        capture_seq_len: KV slots reserved per batch row for the capturer.
    """

    sites: tuple[MoESite, ...]
    capture_seq_len: int
    request_names: RequestNames

    def name_requests(self, request_ids: Sequence[object], padding: Sequence[int] | None = None) -> None:
        """Name the batch rows of the next generation (``generate`` call) as requests.

        ``per_token`` rows of that generation carry these ids (without a call:
        ``hf-<generation>-<row>``), their positions counted from each row's first token
        that the attention mask keeps. ``padding``: each row's left-pad tokens, needed
        when the mask is not a CPU tensor (reading it from the device would synchronise).
        """
        self.request_names.name(request_ids, padding)

    def request_slots(self, batch_size: int) -> torch.Tensor:
        """The ``req_to_token [batch_size, capture_seq_len]`` table of the capturer's KV slots."""
        return torch.arange(batch_size * self.capture_seq_len, dtype=torch.int64).view(batch_size, self.capture_seq_len)

    def routed_experts(self, row: int, seq_len: int, start: int = 0, batch_size: int | None = None) -> Any:
        """Routed experts ``[seq_len - start, L_model, k]`` of batch row ``row`` (numpy, ``-1`` for dense layers).

        ``seq_len`` counts cache positions that went through a forward: with
        ``generate``, prompt length + new tokens - 1 (the last sampled token is
        never fed back). With left padding, the pad positions come first.
        """
        if self.capturer is None:
            raise AdapterError("this instrumentation has no capturer; pass capturer= to instrument()")
        rows = batch_size if batch_size is not None else row + 1
        return self.capturer.get_routed_experts(self.request_slots(rows), row, seq_len, start)


def _recorder_hook(on_select: Callable[..., None], capture: Callable[..., None] | None, layer: int, model_layer: int) -> Record:
    """Count into compact MoE layer ``layer``; capture under model layer ``model_layer``."""
    if capture is None:

        def record(topk_ids: torch.Tensor) -> None:
            on_select(topk_ids, layer)

    else:

        def record(topk_ids: torch.Tensor) -> None:
            on_select(topk_ids, layer)
            capture(model_layer, topk_ids)

    return record


def _experts_pre_hook(record: Record) -> Callable[..., None]:
    """Pre-hook for ``experts(hidden_states, top_k_index, top_k_weights)``."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
        record(ids if ids.dim() == 2 else ids.reshape(-1, ids.shape[-1]))

    return hook


def _timed_experts(recorder: Any, layer: int, failsafe: FailSafe) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap an experts module's ``forward`` in ``with_current_layer(layer)`` + ``with_phase("expert")``."""

    def wrap(forward: Callable[..., Any]) -> Callable[..., Any]:
        return failsafe.around(forward, recorder_scope(recorder, layer, "expert"), f"the expert phase timing of MoE layer {layer}")

    return wrap


def _router_hook(record: Record, spec: SiteSpec, top_k: int, wanted: Callable[[], bool]) -> Callable[..., None]:
    """Forward hook on a router whose output tuple holds, at ``spec.output_index``, the logits
    ``[T, E]`` (``router-topk``: their top-k is taken again) or the selected ids ``[T, k]`` (``router-ids``)."""
    index, rerun_topk = spec.output_index, spec.kind == "router-topk"

    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if wanted():
            chosen = output[index]
            chosen = chosen.reshape(-1, chosen.shape[-1])
            record(torch.topk(chosen, top_k, dim=-1).indices if rerun_topk else chosen)

    return hook


def _capture_wrapper(
    recorder: Any, capturer: Any, seq_len: int, mark_passes: bool, names: RequestNames, failsafe: FailSafe,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Forward wrapper: one recorder pass per call (``mark_passes``), then ``capturer.on_forward_end(out_cache_loc)``.

    Token ``t`` (cache position) of batch row ``b`` lives in KV slot
    ``b * seq_len + t``; ``out_cache_loc [B * S]`` lists the pass's tokens in
    the order the MoE layers see them (batch-major), built on the host.
    """
    num_slots = int(capturer.config.num_kv_slots)

    def out_cache_loc(args: tuple[Any, ...], kwargs: dict[str, Any], start: int) -> torch.Tensor:
        ids = args[0] if args else kwargs.get("input_ids")
        shape = ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:2]
        batch, length = int(shape[0]), int(shape[1])
        if start + length > seq_len or batch * seq_len > num_slots:
            raise AdapterError(
                f"this pass needs KV slots for {batch} rows x positions up to {start + length}, but capture_seq_len="
                f"{seq_len} and the capturer has num_kv_slots={num_slots} (rows x capture_seq_len must fit); "
                "instrument with a larger capture_seq_len or build the capturer with more num_kv_slots"
            )
        rows = torch.arange(batch).unsqueeze(1) * seq_len
        return (rows + torch.arange(start, start + length).unsqueeze(0)).reshape(-1)

    @contextlib.contextmanager
    def capturing(*args: Any, **kwargs: Any) -> Iterator[None]:
        locs = out_cache_loc(args, kwargs, cache_length(kwargs))
        yield
        capturer.on_forward_end(locs)

    def wrap(forward: Callable[..., Any]) -> Callable[..., Any]:
        in_pass = forward_pass_wrapper(recorder, failsafe, batch_of=names.batch_of)(forward) if mark_passes else forward
        return failsafe.around(in_pass, capturing, "the routed-experts capture")

    return wrap


def _check_capturer(capturer: Any, layer_ids: list[int], top_k: int) -> None:
    cfg = getattr(capturer, "config", None)
    if cfg is None or not hasattr(capturer, "capture") or not hasattr(capturer, "on_forward_end"):
        raise TypeError(f"capturer must be a moetrace RoutedExpertsCapturer, got {type(capturer).__name__}")
    if cfg.num_layers <= max(layer_ids) or cfg.top_k != top_k:
        raise ValueError(
            f"the capturer (num_layers={cfg.num_layers}, top_k={cfg.top_k}) does not fit this model: it needs "
            f"num_layers > {max(layer_ids)} (model layer ids, dense layers included) and top_k={top_k}"
        )


def _text_config(target: torch.nn.Module) -> tuple[Any, dict[str, Any]]:
    """The model's text config (``None`` without a config) and the recorder defaults it gives (engine, model, hidden size)."""
    config = getattr(target, "config", None)
    text_config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    defaults: dict[str, Any] = {"engine": "hf", "model": getattr(config, "name_or_path", "") or type(target).__name__}
    if isinstance(getattr(text_config, "hidden_size", None), int):
        defaults["hidden_size"] = text_config.hidden_size
    return text_config, defaults


def _hook_site(hooks: HookRegistry, site: MoESite, rec: Any, capturer: Any, k: int, failsafe: FailSafe) -> None:
    """Install one MoE site's hook: a forward hook on a router, else a pre-hook on the experts (and their timing)."""
    capture = capturer.capture if capturer is not None else None
    record = _recorder_hook(rec.on_select_experts, capture, site.index, site.layer_id)
    if site.on_router:
        assert site.spec is not None
        wanted = (lambda: True) if capturer is not None else (lambda: rec.recording)
        hooks.forward_hook(site.module, failsafe.guard(_router_hook(record, site.spec, k, wanted), f"the router hook on {site.name}"))
        return
    hooks.forward_pre_hook(site.module, failsafe.guard(_experts_pre_hook(record), f"the experts pre-hook on {site.name}"), with_kwargs=True)
    if getattr(getattr(rec, "config", None), "timing", False):
        hooks.wrap_forward(site.module, _timed_experts(rec, site.index, failsafe))


def instrument(
    target: torch.nn.Module,
    recorder: Any = None,
    capturer: Any = None,
    *,
    top_k: int | None = None,
    mark_passes: bool = True,
    capture_seq_len: int | None = None,
    **recorder_options: Any,
) -> HFInstrumentation:
    """Hook every MoE layer of a transformers model ``target``.

    Args:
        target: a transformers model (``*ForCausalLM``, a base model, or any
            module holding MoE layers).
        recorder: the recorder to count into. ``None``: one is built from the
            model's config (MoE layers, experts, top-k, layer ids, hidden
            size) and ``recorder_options``, and installed globally. Pass
            ``moetrace.get_recorder()`` to use one configured beforehand.
        capturer: optional routed-experts capturer (``capture(layer, ids)``,
            ``on_forward_end(out_cache_loc)``).
        top_k: experts per token when the config does not say.
        mark_passes: wrap ``target.forward`` in ``with_forward_pass`` (turn off
            when you mark passes yourself).
        capture_seq_len: KV slots per batch row for the capturer (default:
            the config's ``max_position_embeddings``).
        **recorder_options: other :class:`~moetrace.config.RecorderConfig`
            fields for the recorder built here (``mode``, ``output_dir``, ...).

    Returns:
        The live :class:`HFInstrumentation`. Instrumenting an instrumented
        model with the same (or no) recorder returns the existing handle.

    Raises:
        NoMoELayersError: the model has no MoE layer moetrace can observe.
        AlreadyInstrumentedError: instrumented already with another recorder.
        UnsupportedVersionError: transformers is too old.
    """
    check_transformers(installed_version())  # installed_version looked up here: tests patch it
    live = existing_instrumentation(target, recorder, capturer)
    if live is not None:
        return live  # type: ignore[return-value]
    sites = find_moe_sites(target)
    k = top_k if top_k is not None else model_top_k(target, sites)
    num_experts = max(site.num_experts for site in sites)
    layer_ids = [site.layer_id for site in sites]
    text_config, defaults = _text_config(target)
    binding = resolve_recorder(recorder, len(sites), num_experts, k, layer_ids, adapter="hf", defaults=defaults, **recorder_options)
    rec = binding.recorder
    seq_len = 0
    if capturer is not None:
        _check_capturer(capturer, layer_ids, k)
        slots = int(capturer.config.num_kv_slots)
        seq_len = capture_seq_len or min(int(getattr(text_config, "max_position_embeddings", 0) or slots), slots)
    hooks = HookRegistry()
    names = RequestNames()
    failsafe = FailSafe("this transformers model")
    with unwinding(hooks, binding):
        for site in sites:
            _hook_site(hooks, site, rec, capturer, k, failsafe)
        if capturer is not None:
            hooks.wrap_forward(target, _capture_wrapper(rec, capturer, seq_len, mark_passes, names, failsafe))
        elif mark_passes:
            hooks.wrap_forward(target, forward_pass_wrapper(rec, failsafe, batch_of=names.batch_of))
        handle = HFInstrumentation(
            target, rec, layer_ids, hooks, engine="hf", capturer=capturer, failsafe=failsafe,
            details={"sites": {site.name: site.kind for site in sites}, "top_k": k, "num_experts": num_experts},
        )
    handle.sites = tuple(sites)
    handle.capture_seq_len = seq_len
    handle.request_names = names
    return handle

"""SGLang adapter: moetrace's recorder alongside SGLang's own expert distribution recorder.

Tested on a live SGLang 0.5.23 engine and HTTP server on CPU (``tests/sglang``,
see ``docs/integrations/sglang.md``).

How it attaches. SGLang's model runner builds its global recorder with the
static factory ``ExpertDistributionRecorder.init_new`` from
``sglang.srt.eplb.expert_distribution``: ``(expert_location_metadata, rank)``
since 0.5.19, ``(server_args, expert_location_metadata, rank)`` before.
:func:`instrument` wraps that factory (whichever signature it has: feature
detection, not a version table): the recorder SGLang asks for is still built,
so its HTTP endpoints, metrics and EPLB keep working as before, and is wrapped
in a :class:`~.bridge.RecorderBridge` that forwards every call to it *and* to
a moetrace recorder sized from the real ``ExpertLocationMetadata`` (model
layers, physical experts, ``physical_to_logical_map``, EP size) and the
model's top-k. It also wraps ``ExpertLocationMetadata.update`` so that an EPLB
rebalance re-maps moetrace's logical ids. Wrapping ``select_experts`` is not
needed (and would double count): the global recorder is the one call every
variant makes.

Loading: the ``sglang.srt.plugins`` entry point ``moetrace`` runs
:func:`plugin`, which instruments when ``MOETRACE_ENABLED=1`` (idempotent;
SGLang loads plugins in every process). Nothing moetrace does stops SGLang: a
fault in the plugin, in bridging the recorder SGLang builds or in any bridged
call inside a forward is one warning (logger ``moetrace.adapters``), moetrace is
off in that process from then on, and SGLang serves on
(:mod:`moetrace.adapters.failsafe`). Options come from ``MOETRACE_MODE``,
``MOETRACE_OUTPUT_DIR``, ``MOETRACE_WINDOW``, ``MOETRACE_TOP_K`` and
``MOETRACE_TIMING`` (phase timing inside SGLang's MoE layers, :mod:`.phases`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..base import (
    AdapterError,
    HookRegistry,
    Instrumentation,
    UnsupportedVersionError,
    existing_instrumentation,
    refuse_capturer,
    resolve_recorder,
    unwinding,
)
from ..failsafe import FailSafe
from ..settings import PluginSettings
from .bridge import RecorderBridge
from .layout import sglang_layout
from .phases import watch_phases
from .routed import answers_routes, read_routed_experts, routed_experts_payload

__all__ = [
    "LOCATION_MODULE",
    "RECORDER_MODULE",
    "RecorderBridge",
    "SGLangInstrumentation",
    "answers_routes",
    "instrument",
    "plugin",
    "read_routed_experts",
    "routed_experts_payload",
]

logger = logging.getLogger(__name__)

RECORDER_MODULE = "sglang.srt.eplb.expert_distribution"
"""Where SGLang keeps its global expert distribution recorder (0.4.8 keeps it at
``sglang.srt.managers.expert_distribution``, which this adapter does not support)."""

LOCATION_MODULE = "sglang.srt.eplb.expert_location"
"""Where SGLang keeps ``ExpertLocationMetadata`` (physical/logical expert maps)."""

_REQUIRED = ("ExpertDistributionRecorder", "get_global_expert_distribution_recorder", "set_global_expert_distribution_recorder")
_SIGNATURES = {
    ("expert_location_metadata", "rank"): False,  # 0.5.19 and later: settings come from the runtime context
    ("server_args", "expert_location_metadata", "rank"): True,  # earlier releases
}


def _sglang_version() -> str:
    try:
        import sglang
    except ImportError as exc:
        raise UnsupportedVersionError("SGLang is not installed in this environment (pip install sglang)") from exc
    return str(getattr(sglang, "__version__", "unknown"))


def _recorder_module() -> tuple[Any, bool]:
    """SGLang's recorder module, and whether its ``init_new`` takes ``server_args`` first."""
    version = _sglang_version()
    try:
        module = importlib.import_module(RECORDER_MODULE)
    except ImportError as exc:
        raise UnsupportedVersionError(
            f"SGLang {version} has no {RECORDER_MODULE} ({exc}); moetrace's SGLang adapter supports versions "
            "with the EPLB expert distribution recorder there (tested on 0.5.23)"
        ) from exc
    missing = [name for name in _REQUIRED if not hasattr(module, name)]
    factory = inspect.getattr_static(getattr(module, "ExpertDistributionRecorder", None), "init_new", None)
    if missing or not isinstance(factory, staticmethod):
        raise UnsupportedVersionError(
            f"SGLang {version}: {RECORDER_MODULE} lacks {missing or ['the static ExpertDistributionRecorder.init_new']}; "
            "this SGLang is not supported by moetrace's adapter"
        )
    params = tuple(inspect.signature(factory.__func__).parameters)
    if params not in _SIGNATURES:
        raise UnsupportedVersionError(
            f"SGLang {version}: ExpertDistributionRecorder.init_new takes {list(params)}, expected one of "
            f"{[list(p) for p in _SIGNATURES]}; this SGLang is not supported by moetrace's adapter"
        )
    return module, _SIGNATURES[params]


def _server_args(given: Any) -> Any:
    """``server_args`` passed to ``init_new`` (older SGLang), else the runtime context's (0.5.18+)."""
    if given is not None:
        return given
    try:
        from sglang.srt.runtime_context import get_server_args
    except ImportError as exc:
        raise AdapterError("SGLang passed no server_args and has no runtime_context.get_server_args") from exc
    return get_server_args()


def _model_top_k(server_args: Any) -> int:
    top_k = PluginSettings.from_env(force=True).top_k
    if top_k is not None:
        return top_k
    from transformers import AutoConfig

    from ..hf.layers import config_top_k

    config = AutoConfig.from_pretrained(server_args.model_path, trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)))
    top_k = config_top_k(config)
    if top_k is None:
        raise AdapterError(f"cannot find the experts-per-token of {server_args.model_path} in its config; set MOETRACE_TOP_K")
    return top_k


def _physical_to_logical(metadata: Any) -> Any:
    """``[L, P]`` int64 numpy map from the metadata's CPU copy (no device sync)."""
    mapping = getattr(metadata, "physical_to_logical_map_cpu", None)
    if mapping is None:
        mapping = metadata.physical_to_logical_map
    return mapping.detach().cpu().numpy().astype("int64")


def _layout(ep_size: int, ep_rank: int) -> Any:
    """This process's :func:`~.layout.sglang_layout`, or ``None`` (every rank its own tokens) when SGLang published none."""
    try:
        return sglang_layout(ep_size, ep_rank)
    except (AttributeError, RuntimeError, ValueError) as exc:
        logger.warning("moetrace: SGLang's parallel layout is not readable (%s); each rank's view is counted as its own tokens", exc)
        return None


def _rank_of(recorder: Any) -> int:
    """The EP rank a real SGLang recorder was built for (its accumulator keeps it since 0.5.19)."""
    for owner in (recorder, getattr(recorder, "_accumulator", None)):
        rank = getattr(owner, "_rank", None)
        if isinstance(rank, int):
            return rank
    return 0


def _moetrace_recorder(recorder: Any, server_args: Any, metadata: Any, rank: int, recorder_options: dict[str, Any]) -> Any:
    """The recorder SGLang's bridge counts into: ``recorder`` checked against the metadata's sizes,
    else one built from the metadata (``[L, P]`` physical-to-logical map, EP size and rank, layout),
    the plugin settings and ``recorder_options``, and installed globally."""
    num_layers, num_physical = int(metadata.num_layers), int(metadata.num_physical_experts)
    top_k = _model_top_k(server_args)
    if recorder is not None:
        return resolve_recorder(recorder, num_layers, num_physical, top_k, range(num_layers), adapter="sglang").recorder
    ep_size = int(getattr(metadata, "ep_size", 1))
    defaults = {
        "engine": "sglang",
        "model": str(getattr(server_args, "model_path", "")),
        "physical_to_logical": _physical_to_logical(metadata),
        "ep_size": ep_size,
        "ep_rank": int(rank) % ep_size,
        "layout": _layout(ep_size, int(rank) % ep_size),
        "device": torch.device(getattr(server_args, "device", None) or "cpu"),
    }
    return resolve_recorder(None, num_layers, num_physical, top_k, range(num_layers), adapter="sglang", defaults=defaults, **recorder_options).recorder


def _init_new_wrapper(original: Callable[..., Any], takes_server_args: bool, attach: Callable[[Any, Any, Any, int], Any]) -> Callable[..., Any]:
    """``ExpertDistributionRecorder.init_new`` that builds SGLang's recorder with ``original``
    and hands it to ``attach(built, server_args, metadata, rank)``, in either of SGLang's
    signatures (with ``server_args`` first, or without: older SGLang)."""
    # functools.wraps: inspect.signature (and a second instrument()) sees SGLang's own signature
    if takes_server_args:

        @functools.wraps(original)
        def init_new(server_args: Any, expert_location_metadata: Any, rank: int, *args: Any, **kwargs: Any) -> Any:
            built = original(server_args, expert_location_metadata, rank, *args, **kwargs)
            return attach(built, server_args, expert_location_metadata, rank)

        return init_new

    @functools.wraps(original)
    def init_new_without_server_args(expert_location_metadata: Any, rank: int, *args: Any, **kwargs: Any) -> Any:
        built = original(expert_location_metadata, rank, *args, **kwargs)
        return attach(built, None, expert_location_metadata, rank)

    return init_new_without_server_args


class SGLangInstrumentation(Instrumentation):
    """The live SGLang instrumentation.

    ``recorder``, ``layer_ids`` and ``bridge`` are set when SGLang builds its
    recorder (model runner start-up); before that they are ``None`` / empty.
    """

    bridge: RecorderBridge | None = None


def _refuse_target_and_capturer(target: Any, capturer: Any) -> None:
    """SGLang's adapter takes no target (it attaches to this process) and no capturer (SGLang has its own)."""
    if target is not None:
        raise AdapterError(
            f"moetrace.adapters.sglang.instrument() attaches to SGLang in this process and takes no target (got {type(target).__name__}); "
            "pass the recorder as recorder=..."
        )
    refuse_capturer(capturer, "SGLang", "SGLang captures routed experts per request itself (--enable-return-routed-experts; "
                    "read them with moetrace.adapters.sglang.read_routed_experts)")


def _bridge_maker(module: Any, handle: SGLangInstrumentation, hooks: HookRegistry, bridges: list[RecorderBridge], recorder: Any,
                  recorder_options: dict[str, Any]) -> Callable[[Any, Any, Any, int], Any]:
    """``wrap(sglang_recorder, server_args, metadata, rank)``: the :class:`RecorderBridge` that stands for the
    recorder SGLang built (SGLang's own without expert location metadata), with moetrace's recorder behind it; the
    handle learns the recorder and its layers, and uninstrumenting gives SGLang its own recorder back."""
    noop_cls = getattr(module, "_ExpertDistributionRecorderNoop", None)

    def wrap(sglang_recorder: Any, server_args: Any, metadata: Any, rank: int) -> Any:
        if metadata is None:
            logger.warning("moetrace: SGLang gave no expert location metadata (not an MoE model?); not recording")
            return sglang_recorder
        rec = _moetrace_recorder(recorder, _server_args(server_args), metadata, rank, recorder_options)
        real = noop_cls is None or not isinstance(sglang_recorder, noop_cls)
        bridge = RecorderBridge(sglang_recorder, rec, sglang_is_real=real, metadata=metadata, failsafe=handle.failsafe)
        handle.recorder, handle.layer_ids, handle.bridge = rec, tuple(range(int(metadata.num_layers))), bridge
        bridges.append(bridge)

        def restore_global() -> str | None:
            if module.get_global_expert_distribution_recorder() is bridge:
                module.set_global_expert_distribution_recorder(sglang_recorder)
            return None

        hooks.on_remove("SGLang global recorder bridge", restore_global)
        return bridge

    return wrap


def instrument(
    target: Any = None,
    recorder: Any = None,
    capturer: Any = None,
    **recorder_options: Any,
) -> SGLangInstrumentation:
    """Attach moetrace to SGLang in this process.

    Args:
        target: ``None``: the adapter attaches to SGLang in this process (its
            expert-distribution recorder is module-level; there is no model to hand over).
        recorder: a moetrace recorder to count into; ``None`` builds one from
            SGLang's expert location metadata when SGLang builds its own, and
            installs it as moetrace's global recorder.
        capturer: not supported: SGLang has its own routed-experts capturer
            (``--enable-return-routed-experts``); read its answers with
            :func:`read_routed_experts`.
        **recorder_options: other RecorderConfig fields (``mode``,
            ``output_dir``, ``window``, ...).

    Raises:
        AdapterError: a target or a capturer given.
        UnsupportedVersionError: SGLang missing or without the recorder API used here.
        AlreadyInstrumentedError: instrumented already with another recorder.
    """
    _refuse_target_and_capturer(target, capturer)
    module, takes_server_args = _recorder_module()
    live = existing_instrumentation(module, recorder)
    if live is not None:
        return live  # type: ignore[return-value]

    hooks = HookRegistry()
    handle = SGLangInstrumentation(
        module, None, (), hooks, engine="sglang", details={"init_new_takes_server_args": takes_server_args},
        failsafe=FailSafe("this SGLang engine"),
    )
    factory_cls = module.ExpertDistributionRecorder
    original_init_new = inspect.getattr_static(factory_cls, "init_new").__func__
    bridges: list[RecorderBridge] = []
    wrap = _bridge_maker(module, handle, hooks, bridges, recorder, recorder_options)
    bridged = handle.failsafe.guard(wrap, "bridging the recorder SGLang built")

    def attach(built: Any, server_args: Any, metadata: Any, rank: int) -> Any:
        if not handle.active:
            return built
        bridge = bridged(built, server_args, metadata, rank)
        return built if bridge is None else bridge

    with unwinding(hooks):
        hooks.patch(factory_cls, "init_new", staticmethod(_init_new_wrapper(original_init_new, takes_server_args, attach)))
        _watch_rebalances(hooks, bridges)
        timing = recorder.config.timing if recorder is not None else recorder_options.get("timing", PluginSettings.from_env(force=True).timing)
        if timing:
            handle.details["timed_phases"] = watch_phases(hooks, module)
        current = module.get_global_expert_distribution_recorder()
        metadata = getattr(current, "_expert_location_metadata", None)
        if metadata is not None:  # SGLang already built its recorder (plugin loaded late): bridge it now
            bridge = wrap(current, getattr(current, "_server_args", None), metadata, _rank_of(current))
            module.set_global_expert_distribution_recorder(bridge)
    return handle


def _watch_rebalances(hooks: HookRegistry, bridges: list[RecorderBridge]) -> None:
    """Wrap ``ExpertLocationMetadata.update`` (EPLB's in-place rebalance) to tell the bridges."""
    try:
        location = importlib.import_module(LOCATION_MODULE)
    except ImportError:
        logger.warning("moetrace: %s not found; logical ids will not follow EPLB rebalances", LOCATION_MODULE)
        return
    cls = location.ExpertLocationMetadata
    original = cls.update

    def update(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        for bridge in bridges:
            if bridge.metadata is self:
                bridge.on_expert_location_update()
        return result

    hooks.patch(cls, "update", update)


_PLUGIN_HANDLE: SGLangInstrumentation | None = None

_PLUGIN_FAILSAFE = FailSafe("this SGLang engine")
"""The plugin's start-up switch in this process (once it has instrumented, the handle's switch guards the hooks)."""


def plugin() -> None:
    """``sglang.srt.plugins`` entry point: instrument when ``MOETRACE_ENABLED=1``.

    Runs in every SGLang process that loads plugins; idempotent. Never raises into
    SGLang's start-up: a failure (a bad ``MOETRACE_ENABLED``, an SGLang the adapter
    does not support, ...) is one warning, and moetrace stays off in this process.
    """
    global _PLUGIN_HANDLE
    if not _PLUGIN_FAILSAFE.on or (_PLUGIN_HANDLE is not None and _PLUGIN_HANDLE.active):
        return
    with _PLUGIN_FAILSAFE.guarding("moetrace's SGLang plugin start-up"):
        if PluginSettings.from_env(adapter="sglang").enabled:  # every setting checked here, in one line if wrong
            _PLUGIN_HANDLE = instrument()

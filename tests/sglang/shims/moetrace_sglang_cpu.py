"""Make SGLang's CPU engine start in a CPU-only virtualenv (installed into .venv-sglang by the Makefile).

The Makefile copies this file into the virtualenv's site-packages and adds a
``.pth`` line that imports it, so it takes effect in every Python process of
that virtualenv, including the scheduler and detokenizer processes SGLang
spawns. It does nothing until ``sglang`` itself is imported; then, before
SGLang's own code runs, it fills three gaps of a CPU-only install:

- ``sgl_kernel`` (SGLang's CUDA kernel package, not installable without CUDA):
  an importable empty package whose every attribute (and attribute of those)
  raises if it is ever *called*, so a CPU code path that really needs a kernel fails
  loudly instead of computing garbage. SGLang imports names from it at module
  level on paths the CPU engine never calls.
- ``torchvision``: the PyPI wheel does not import against the CPU torch, and
  ``sglang.srt.multimodal.internvl_utils`` imports it unconditionally. The
  stub serves ``import torchvision...`` only; ``importlib.util.find_spec`` (how
  transformers decides whether torchvision is available) still finds nothing,
  so no library believes torchvision is usable.
- ``torch.cpu.is_current_stream_capturing`` and ``torch.cpu.empty_cache``
  (SGLang calls ``torch.get_device_module().<name>()``, which has no CPU
  implementation): no-ops, as they are on a device without graphs or caching.
- host buffers of SGLang's state capturers (``--enable-return-routed-experts``)
  on device ``"cpu"``: allocated plainly; SGLang's default allocator pins them
  with ``cudaHostRegister``, which a CPU-only torch does not have.
- expert parallelism on CPU (``ep_size > 1``): SGLang's standard dispatcher maps
  each token's physical expert ids to the rank's *local* expert index and ids of
  experts held by other ranks to ``-1`` (its GPU kernels skip them), but the CPU
  fallback ``moe_forward_native`` indexes a per-expert count with them and dies
  (``index -1 is out of bounds``); it also sizes that count by the global expert
  count while ``layer.w13_weight`` holds only the rank's experts. Under EP only,
  :func:`_local_experts_forward` computes the rank's local experts for the slots
  routed to them and leaves ``-1`` slots at zero, as the GPU kernels do; SGLang's
  all-reduce then adds the ranks' partial outputs. It runs after routing and
  after the dispatcher: the ids SGLang's recorder (and moetrace) sees are never
  touched. Without EP the original function runs unchanged.
- a test-only straggler: ``MOETRACE_TEST_EXPERT_DELAY="RANK:SECONDS"`` makes the
  expert compute of global rank ``RANK`` sleep ``SECONDS`` per MoE layer (the
  phase-timing tests use it to check that the slow rank is named). Unset: nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

_STUBBED = ("sgl_kernel", "torchvision")


class _Missing:
    """A name from a stubbed package: any attribute is another ``_Missing``; calling one raises."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> _Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._path}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self._path} is a stub in this CPU-only environment (tests/sglang/shims)")

    def __repr__(self) -> str:
        return f"<stub {self._path}>"


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package: submodules import too
        module.__getattr__ = lambda name: _Missing(f"{spec.name}.{name}")  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the stubs to import statements, and patches torch when ``sglang`` loads."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        root = fullname.partition(".")[0]
        if root in _STUBBED and _importing():
            return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)
        if fullname == "sglang":
            _patch_torch()
        patch = _AFTER_IMPORT.get(fullname)
        if patch is not None:
            return _patched_spec(fullname, path, patch)
        return None


def _patched_spec(fullname: str, path: Sequence[str] | None, patch: Callable[[types.ModuleType], None]) -> importlib.machinery.ModuleSpec | None:
    """The module's real spec, with ``patch(module)`` run right after the module executes."""
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is None or spec.loader is None:
        return spec
    loader = spec.loader
    exec_module = loader.exec_module

    def exec_then_patch(module: types.ModuleType) -> None:
        exec_module(module)
        patch(module)

    loader.exec_module = exec_then_patch  # type: ignore[method-assign]
    return spec


def _plain_host_buffers(module: types.ModuleType) -> None:
    def allocate(dims: tuple, dtype: Any, device: str, pin_memory: bool, allocator: Any, **_: Any) -> Any:
        return allocator.allocate(dims, dtype=dtype, device=device)

    module.ALLOC_MEMORY_FUNCS["cpu"] = allocate


def _local_experts_forward(layer: Any, x: Any, topk_output: Any, moe_runner_config: Any) -> Any:
    """The rank's local experts on ``x [T, H]``: ``topk_ids [T, k]`` local indices, ``-1`` = another rank's expert.

    Same arithmetic as SGLang's ``moe_forward_native`` (SwiGLU per expert, slot outputs
    ``[T, k, H]`` weighted and summed over ``k``), with ``-1`` slots left at zero.
    """
    import torch.nn.functional as F

    unsupported = [name for name, on in (
        ("apply_router_weight_on_input", moe_runner_config.apply_router_weight_on_input),
        (f"activation {moe_runner_config.activation!r}", moe_runner_config.activation != "silu"),
        ("gemm1_alpha", moe_runner_config.gemm1_alpha is not None),
        ("expert biases", getattr(layer, "w13_weight_bias", None) is not None),
    ) if on]
    if unsupported:
        raise NotImplementedError(f"the CPU EP shim (tests/sglang/shims) computes SiLU experts without biases only, not {unsupported}")
    topk_weights, topk_ids, _ = topk_output
    slots = x.new_zeros((*topk_ids.shape, x.shape[-1]))
    for expert in range(layer.w13_weight.shape[0]):
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        if len(token):
            gate, up = F.linear(x[token], layer.w13_weight[expert]).chunk(2, dim=-1)
            slots[token, slot] = F.linear(F.silu(gate) * up, layer.w2_weight[expert])
    return slots.type(topk_weights.dtype).mul_(topk_weights.unsqueeze(dim=-1)).sum(dim=1).type(x.dtype)


def _expert_delay() -> tuple[int, float] | None:
    import os

    value = os.environ.get("MOETRACE_TEST_EXPERT_DELAY")
    if not value:
        return None
    rank, _, seconds = value.partition(":")
    return int(rank), float(seconds)


def _cpu_experts(module: types.ModuleType) -> None:
    original = module.moe_forward_native
    delay = _expert_delay()

    def moe_forward_native(layer: Any, x: Any, topk_output: Any, moe_runner_config: Any) -> Any:
        if delay is not None:
            import time

            import torch.distributed as dist

            if dist.is_initialized() and dist.get_rank() == delay[0]:
                time.sleep(delay[1])
        if getattr(layer, "moe_ep_size", 1) > 1:
            return _local_experts_forward(layer, x, topk_output, moe_runner_config)
        return original(layer, x, topk_output, moe_runner_config)

    module.moe_forward_native = moe_forward_native


_AFTER_IMPORT: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.common": _plain_host_buffers,
    "sglang.srt.layers.moe.fused_moe_native": _cpu_experts,
}


def _importing() -> bool:
    """Whether the lookup comes from an import statement (not ``importlib.util.find_spec``)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "find_spec" and frame.f_globals.get("__name__") == "importlib.util":
            return False
        frame = frame.f_back
    return True


def _patch_torch() -> None:
    import torch

    if not hasattr(torch.cpu, "is_current_stream_capturing"):
        torch.cpu.is_current_stream_capturing = lambda: False  # type: ignore[attr-defined]
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None  # type: ignore[attr-defined]


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()

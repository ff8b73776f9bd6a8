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


_AFTER_IMPORT: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.common": _plain_host_buffers,
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

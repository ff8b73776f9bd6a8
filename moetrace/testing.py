"""Helpers for testing an integration against moetrace's hot-path contract.

:func:`assert_no_host_sync` runs a block of code under a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` that fails on every
operator which forces the host to wait for the device: reading a value
(``.item()``, ``bool(tensor)``), ops whose output size depends on values
(``nonzero``, ``unique``, boolean-mask indexing, ``masked_select``,
``bincount``, ``repeat_interleave`` without ``output_size``) and copies from
an accelerator to the CPU. It works on CPU tensors too, so a CPU-only test
suite catches what would stall a GPU.

:class:`CpuGraph` emulates CUDA-graph capture and replay on any device: capture
runs the block once under a dispatch mode that logs every tensor op (and then
puts back what the block wrote, since a real capture runs nothing); replay runs
exactly the logged ops again on the same buffers, with no Python hook running.
Counts that come from Python (how often a hook was called, a host integer set
in a hook) stop changing under replay, as they do on a GPU; counts kept in
device buffers by the captured ops stay right.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .graphs import emulated_capture

__all__ = ["CpuGraph", "GraphCaptureError", "HostSyncError", "assert_no_host_sync"]


class HostSyncError(AssertionError):
    """An operator that synchronises host and device ran inside a hot path."""


_ALWAYS_SYNC = {
    "aten::_local_scalar_dense": "reads a tensor value on the host (.item(), int(t), float(t), tolist())",
    "aten::is_nonzero": "branches on a tensor value (bool(t), `if t:`)",
    "aten::equal": "compares tensors into a host bool (torch.equal)",
    "aten::allclose": "compares tensors into a host bool (torch.allclose)",
    "aten::nonzero": "output size depends on values (nonzero, torch.where(cond), argwhere)",
    "aten::argwhere": "output size depends on values",
    "aten::masked_select": "output size depends on values (masked_select)",
    "aten::unique": "output size depends on values (unique)",
    "aten::_unique": "output size depends on values (unique)",
    "aten::_unique2": "output size depends on values (unique)",
    "aten::unique_dim": "output size depends on values (unique)",
    "aten::unique_consecutive": "output size depends on values (unique_consecutive)",
    "aten::bincount": "output size depends on the maximum value (bincount); use scatter_add_ into a fixed-size buffer",
    "aten::_assert_async": "asserts on a device value",
}

_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
_COPY_OPS = {"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"}


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    if len(args) < 2:
        return False
    indices = args[1]
    if not isinstance(indices, (list, tuple)):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _device_to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name == "aten::_to_copy":
        src, target = args[0], kwargs.get("device")
        return (
            isinstance(src, torch.Tensor)
            and src.device.type != "cpu"
            and target is not None
            and torch.device(target).type == "cpu"
        )
    if name in ("aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize") and len(args) >= 2:
        dst, src = (args[0], args[1]) if name == "aten::copy_" else (args[1], args[0])
        if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)):
            return False
        if not (src.device.type != "cpu" and dst.device.type == "cpu"):
            return False
        # A non_blocking copy into pinned memory is the sanctioned asynchronous path.
        non_blocking = bool(args[2]) if name == "aten::copy_" and len(args) > 2 else bool(kwargs.get("non_blocking", False))
        return not (non_blocking and dst.is_pinned())
    return False


def _sync_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    name = func._schema.name
    if name in _ALWAYS_SYNC:
        return _ALWAYS_SYNC[name]
    if name in _INDEX_OPS and _has_bool_index(args):
        return "boolean-mask indexing (t[mask]); use torch.where or masking arithmetic"
    if name == "aten::repeat_interleave" and kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None):
        return "repeat_interleave without output_size"
    if name in _COPY_OPS and _device_to_host(name, args, kwargs):
        return "blocking copy from the device to the host (.cpu(), .to('cpu'), .numpy())"
    return None


class _NoHostSyncMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            raise HostSyncError(f"host-device synchronisation in a hot path: {func._schema.name}: {reason}")
        return func(*args, **kwargs)


_HOST_READS = {
    torch.Tensor.tolist: "reads tensor values on the host (tolist)",
    torch.Tensor.numpy: "exposes tensor values to the host (numpy)",
    torch.Tensor.__array__: "exposes tensor values to the host (np.asarray(tensor), numpy functions given a tensor)",
}


class _NoHostReadMode(TorchFunctionMode):
    """Catches host reads that never reach the dispatcher on CPU tensors (tolist, numpy, np.asarray)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        reason = _HOST_READS.get(func)
        if reason is not None:
            raise HostSyncError(f"host-device synchronisation in a hot path: Tensor.{func.__name__}: {reason}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def assert_no_host_sync() -> Iterator[None]:
    """Fail with :class:`HostSyncError` if the block synchronises host and device.

    Usage::

        with moetrace.testing.assert_no_host_sync():
            recorder.on_select_experts(topk_ids)

    On a GPU, combine it with ``torch.cuda.set_sync_debug_mode("error")`` for
    the synchronisations that happen below the dispatcher.
    """
    with _NoHostReadMode(), _NoHostSyncMode():
        yield


class GraphCaptureError(RuntimeError):
    """An operation that a CUDA graph capture refuses (a host read, a value-dependent shape)."""


def _written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors an op writes (its schema's mutable and ``out=`` arguments)."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor):
                yield item


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset() == b.storage_offset()


def _copy_back(captured: Any, result: Any) -> None:
    """Put a replayed op's ``result`` into the tensors its capture returned (later ops read those)."""
    if isinstance(captured, torch.Tensor) and isinstance(result, torch.Tensor):
        if not _same_memory(captured, result):
            captured.copy_(result)
    elif isinstance(captured, (list, tuple)) and isinstance(result, (list, tuple)):
        for c, r in zip(captured, result, strict=True):
            _copy_back(c, r)


class _CaptureLog(TorchDispatchMode):
    def __init__(self, graph: CpuGraph) -> None:
        super().__init__()
        self._graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            raise GraphCaptureError(f"not permitted while a CUDA graph is captured: {func._schema.name}: {reason}")
        for tensor in _written_tensors(func, args, kwargs):
            self._graph._save(tensor)
        out = func(*args, **kwargs)
        self._graph._ops.append((func, args, kwargs, out))
        return out


class _NoHostReadInCapture(_NoHostReadMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _HOST_READS:
            raise GraphCaptureError(f"not permitted while a CUDA graph is captured: Tensor.{func.__name__}: {_HOST_READS[func]}")
        return func(*args, **(kwargs or {}))


class CpuGraph:
    """A CUDA graph emulated on CPU (or any device), for testing hooks under capture and replay.

    Usage, as with ``torch.cuda.CUDAGraph``::

        graph = CpuGraph()
        with graph.capture():          # hooks run once; moetrace sees a capture in progress
            model(static_inputs)
        for batch in batches:
            static_inputs.copy_(batch)  # the engine fills the static buffers
            with recorder.with_forward_pass():
                graph.replay()          # the logged ops only: no Python hook runs

    Capture logs every tensor op the block runs, refuses what a real capture
    refuses (:class:`GraphCaptureError`: ``.item()``, ``nonzero``, host copies
    and reads) and, as a real capture executes nothing, restores afterwards
    every tensor the block wrote that existed before it. Replay reruns the
    logged ops with the same arguments (Python scalars baked in at capture,
    tensors the same objects) and copies each result into the tensor the capture
    returned, so later ops read it as they would read a graph's private memory.
    """

    def __init__(self) -> None:
        self._ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._seen: set[int] = set()
        self._captured = False

    @property
    def num_ops(self) -> int:
        """Tensor ops the graph replays."""
        return len(self._ops)

    def _save(self, tensor: torch.Tensor) -> None:
        if id(tensor) not in self._seen:
            self._seen.add(id(tensor))
            self._saved.append((tensor, tensor.detach().clone()))

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Capture the block (once per graph)."""
        if self._captured:
            raise GraphCaptureError("this CpuGraph was already captured; make a new one")
        self._captured = True
        try:
            with emulated_capture(), _NoHostReadInCapture(), _CaptureLog(self):
                yield
        finally:
            with torch.no_grad():
                for tensor, before in reversed(self._saved):
                    tensor.copy_(before)
            self._saved, self._seen = [], set()

    def replay(self) -> None:
        """Run the captured ops again (no Python hook runs)."""
        if not self._captured:
            raise GraphCaptureError("replay() before capture(): capture the graph first")
        with torch.no_grad():
            for func, args, kwargs, out in self._ops:
                _copy_back(out, func(*args, **kwargs))

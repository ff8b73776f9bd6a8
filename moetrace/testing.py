"""Helpers for testing an integration against moetrace's hot-path contract.

:func:`assert_no_host_sync` runs a block of code under a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` that fails on every
operator which forces the host to wait for the device: reading a value
(``.item()``, ``bool(tensor)``), ops whose output size depends on values
(``nonzero``, ``unique``, boolean-mask indexing, ``masked_select``,
``bincount``, ``repeat_interleave`` without ``output_size``) and copies from
an accelerator to the CPU. It works on CPU tensors too, so a CPU-only test
suite catches what would stall a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncError", "assert_no_host_sync"]


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
}


class _NoHostReadMode(TorchFunctionMode):
    """Catches host reads that never reach the dispatcher on CPU tensors (tolist, numpy)."""

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

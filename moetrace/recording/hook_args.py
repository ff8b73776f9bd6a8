"""The recorder hooks' argument checks: metadata only (type, dtype, rank, shape, device, layer index).

They never read a tensor's values, so they cost no host-device sync; a wrong argument raises
``ValueError`` naming the value and the fix before anything is counted.
"""

from __future__ import annotations

import torch

from ..batch import PassBatch

__all__ = ["checked_batch", "checked_dispatch", "checked_ids", "checked_layer", "int_tensor"]

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def checked_layer(layer: int, num_layers: int, where: str) -> int:
    """``layer`` when it is a compact MoE layer index ``0..num_layers-1``; ``where`` names the call."""
    if not 0 <= layer < num_layers:
        raise ValueError(f"{where}: layer {layer} is outside [0, num_layers={num_layers})")
    return layer


def int_tensor(name: str, tensor: object, ndim: int, device: torch.device) -> torch.Tensor:
    """``tensor`` when it is an integer tensor of ``ndim`` dimensions on ``device``."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _INT_DTYPES:
        raise ValueError(f"{name} must be an integer tensor, got dtype {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {list(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the recorder counts on {device}; configure device={tensor.device}")
    return tensor


def checked_ids(topk_ids: object, top_k: int, device: torch.device) -> torch.Tensor:
    """``topk_ids`` when it is ``[T, top_k]`` integer ids on ``device``."""
    ids = int_tensor("topk_ids", topk_ids, 2, device)
    if ids.shape[1] != top_k:
        raise ValueError(f"topk_ids has {ids.shape[1]} columns but the recorder was configured with top_k={top_k}")
    return ids


def checked_dispatch(send_counts: object, recv_counts: object, dropped: object, ep_size: int, device: torch.device) -> None:
    """``send_counts [R]``, ``recv_counts [R]`` (optional) and ``dropped`` (``[]`` or ``[1]``, optional)
    of one layer's dispatch, ``R = ep_size``."""
    for name, tensor in (("send_counts", send_counts), ("recv_counts", recv_counts)):
        if tensor is not None and int_tensor(name, tensor, 1, device).shape[0] != ep_size:
            raise ValueError(f"{name} must have shape [ep_size={ep_size}], got {list(tensor.shape)}")  # type: ignore[attr-defined]
    if dropped is not None:
        int_tensor("dropped", dropped, dropped.dim() if isinstance(dropped, torch.Tensor) else 0, device)
        if dropped.numel() != 1:  # type: ignore[attr-defined]
            raise ValueError(f"dropped must hold one count, got shape {list(dropped.shape)}")  # type: ignore[attr-defined]


def checked_batch(batch: object) -> PassBatch | None:
    """``batch`` when it is a :class:`~moetrace.batch.PassBatch` or ``None``."""
    if batch is not None and not isinstance(batch, PassBatch):
        raise TypeError(f"batch must be a moetrace.batch.PassBatch (PassBatch.of(...)) or None, got {type(batch).__name__}")
    return batch

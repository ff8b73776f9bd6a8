"""Dispatch evidence: the communication-volume formulas and expert capacity, on plain numbers and numpy.

The copy-level layout an expert-parallel exchange needs (torch device ops) is
:mod:`moetrace.dispatch_layout`; this module loads no torch, so the offline
analysis and the snapshot's figures can use it.

Formulas: ``T`` tokens, ``H`` hidden size, ``b`` bytes per element, ``k``
top-k, ``R`` EP ranks. Each formula counts dispatch plus combine (the factor 2).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "ep_ideal_bytes",
    "ep_padded_bytes",
    "exchanged_bytes",
    "expert_capacity",
    "node_copies",
    "remote_copies",
    "tp_bytes",
]


def tp_bytes(tokens: int, hidden: int, dtype_bytes: int) -> int:
    """Tensor-parallel all-reduce volume ``2·T·H·b``."""
    return 2 * tokens * hidden * dtype_bytes


def ep_ideal_bytes(tokens: int, top_k: int, hidden: int, dtype_bytes: int) -> int:
    """Ideal EP all-to-all volume ``2·T·k·H·b`` (every token copy sent once)."""
    return 2 * tokens * top_k * hidden * dtype_bytes


def ep_padded_bytes(tokens: int, top_k: int, hidden: int, dtype_bytes: int, ranks: int) -> int:
    """Padded EP volume ``2·R·T·k·H·b`` (every rank's buffer sized for the worst case)."""
    return 2 * ranks * tokens * top_k * hidden * dtype_bytes


def exchanged_bytes(copies_sent: int, hidden: int, dtype_bytes: int) -> int:
    """Bytes actually moved for ``copies_sent`` token copies, dispatch plus combine."""
    return 2 * copies_sent * hidden * dtype_bytes


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Token copies one expert accepts from a group of ``tokens`` tokens.

    ``ceil(capacity_factor · T · k / E)``, capped at ``T`` (a token picks an
    expert at most once, so ``T`` never drops anything).
    """
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    return min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts))


def remote_copies(send_count: np.ndarray, rank: int) -> np.ndarray:
    """Token copies a rank sent to *other* ranks: ``send_count [..., R]`` -> ``[...]``.

    ``send_count[..., s]`` is what ``rank`` sent to rank ``s``; the copies it
    keeps for itself never cross the network.
    """
    send_count = np.asarray(send_count)
    return send_count.sum(axis=-1) - send_count[..., rank]


def node_copies(rank_copies: np.ndarray, gpus_per_node: int, axis: int = -1) -> np.ndarray:
    """Copies per node from copies per EP rank along ``axis``: ``[..., R, ...]`` -> ``[..., R / G, ...]``.

    Ranks ``[n·G, (n+1)·G)`` form node ``n`` (``G`` = ``gpus_per_node``, which must divide ``R``).
    """
    rank_copies = np.moveaxis(np.asarray(rank_copies), axis, -1)
    ranks = rank_copies.shape[-1]
    if gpus_per_node < 1 or ranks % gpus_per_node:
        raise ValueError(f"gpus_per_node={gpus_per_node} must divide the {ranks} EP ranks; pass the GPUs each node holds")
    nodes = rank_copies.reshape(*rank_copies.shape[:-1], ranks // gpus_per_node, gpus_per_node).sum(axis=-1)
    return np.moveaxis(nodes, -1, axis)

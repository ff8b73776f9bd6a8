"""Dispatch evidence: communication-volume formulas for MoE layers.

``T`` tokens, ``H`` hidden size, ``b`` bytes per element, ``k`` top-k, ``R``
EP ranks. Each formula counts dispatch plus combine (the factor 2).
"""

from __future__ import annotations

__all__ = ["ep_ideal_bytes", "ep_padded_bytes", "exchanged_bytes", "tp_bytes"]


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

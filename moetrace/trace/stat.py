"""``/stat`` from counter rows: the one writer of a rank's totals (dumps, segments, checkpoints).

The recorder counts into per-layer counter rows ``[L, C]`` whose columns
:class:`CounterLayout` names; every file that carries ``/stat`` (a ``stat``
dump or checkpoint, a closed segment, an empty streaming dump) writes it from
such rows with :func:`write_stat`, so the trace layer needs nothing from the
recorder but the rows themselves.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..ids import to_logical
from ..layout import RankLayout
from .schema import PADDING_IDS, PHASE_COUNTS, Data
from .writer import TraceWriter

__all__ = ["CounterLayout", "StatRows", "ring_pieces", "write_stat", "write_stat_window"]


class CounterLayout:
    """Column offsets of the ``[L, C]`` counter rows for ``P`` experts and ``R`` ranks.

    Width ``C = P + 5 + 2R``: ``0`` invalid ids below -1, ``1`` padding ids (-1),
    ``[2, P+2)`` expert counts, ``P+2`` invalid ids ``>= P``, ``[P+3, P+3+R)``
    send counts, ``[P+3+R, P+3+2R)`` receive counts, ``P+3+2R`` dropped copies,
    ``P+4+2R`` tokens (rows with at least one id that is not -1; counted on the
    device so that it stays right under CUDA-graph replay).
    """

    def __init__(self, num_physical_experts: int, ep_size: int) -> None:
        p, r = num_physical_experts, ep_size
        self.num_experts = p
        self.below = 0
        self.padding = 1
        self.experts = slice(2, p + 2)
        self.above = p + 2
        self.send = slice(p + 3, p + 3 + r)
        self.recv = slice(p + 3 + r, p + 3 + 2 * r)
        self.dropped = p + 3 + 2 * r
        self.tokens = p + 4 + 2 * r
        self.width = p + 5 + 2 * r

    def invalid(self, rows: np.ndarray) -> np.ndarray:
        """Invalid ids (below -1 or ``>= P``) of counter rows ``[..., C]`` -> ``[...]``."""
        return rows[..., self.below] + rows[..., self.above]


def write_stat(
    writer: TraceWriter,
    layout: CounterLayout,
    physical_to_logical: np.ndarray,
    rows: np.ndarray,
    num_passes: np.ndarray,
    num_tokens: np.ndarray,
    phase_rows: np.ndarray | None = None,
    phase_counts: np.ndarray | None = None,
) -> None:
    """Write ``/stat`` from counter rows ``[R, L, C]`` and the passes / tokens ``[R]`` they cover.

    Args:
        physical_to_logical: ``[L, P]`` map for ``/stat/logical_count``.
        phase_rows: ``[R, Q, L, C]`` the same counter rows split by pass phase
            (:data:`moetrace.pass_phase.PASS_PHASES`; they add up to ``rows``), or ``None``.
        phase_counts: ``[R, 3, Q]`` passes, tokens and requests of each pass phase (:data:`PHASE_COUNTS`).
    """
    physical = rows[:, :, layout.experts]
    writer.write(Data.STAT_PHYSICAL_COUNT, physical, compress=True)
    writer.write(Data.STAT_LOGICAL_COUNT, to_logical(physical, physical_to_logical), compress=True)
    writer.write(Data.STAT_INVALID_IDS, layout.invalid(rows))
    writer.write(PADDING_IDS, rows[:, :, layout.padding])
    writer.write(Data.STAT_SEND_COUNT, rows[:, :, layout.send])
    writer.write(Data.STAT_RECV_COUNT, rows[:, :, layout.recv])
    writer.write(Data.STAT_DROPPED, rows[:, :, layout.dropped])
    writer.write(Data.STAT_NUM_PASSES, np.asarray(num_passes, dtype=np.int64))
    writer.write(Data.STAT_NUM_TOKENS, np.asarray(num_tokens, dtype=np.int64))
    if phase_rows is not None and phase_counts is not None:
        writer.write(Data.STAT_PASS_PHASE_PHYSICAL_COUNT, np.ascontiguousarray(phase_rows[..., layout.experts]), compress=True)
        for i, name in enumerate(PHASE_COUNTS):
            writer.write(name, np.asarray(phase_counts[:, i], dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class StatRows:
    """The host arrays of a ``stat`` dump or checkpoint (:func:`write_stat_window`) of ``R`` rank rows.

    Attributes:
        rows: counter rows ``[R, L, C]``.
        passes: ``(passes, tokens) [R, 2]``.
        meta: the window ``(pass_id, timestamp, tokens, pass phase, requests) [R, W, 5]`` (pass id -1: an empty slot).
        counts: the window's counts as consecutive pieces ``[R, w_i, L, P]`` along the window axis,
            oldest first (their lengths add up to at least the filled slots).
        layouts: every rank row's layout (the header's; ``()`` where the header has its own).
        phase_rows: the totals split by pass phase ``[R, Q, L, C]``, or ``None``.
        phase_counts: their passes, tokens and requests ``[R, 3, Q]``, or ``None``.
    """

    rows: np.ndarray
    passes: np.ndarray
    meta: np.ndarray
    counts: list[np.ndarray]
    layouts: tuple[RankLayout, ...] = ()
    phase_rows: np.ndarray | None = None
    phase_counts: np.ndarray | None = None


def ring_pieces(ring: np.ndarray, order: np.ndarray) -> list[np.ndarray]:
    """The live slots of a window ring ``[W, ...]``, oldest first, as at most two views ``[1, n, ...]``
    (no copy: what :func:`write_stat_window` takes as ``StatRows.counts``).

    ``order``: the live slots oldest first, consecutive slots from ``order[0]`` wrapping to 0.
    """
    ring = ring[None]
    if not len(order):
        return [ring[:, :0]]
    first = int(order[0])
    wrap = min(len(order), ring.shape[1] - first)
    return [ring[:, first : first + wrap], ring[:, : len(order) - wrap]]


def write_stat_window(writer: TraceWriter, layout: CounterLayout, physical_to_logical: np.ndarray, stat: StatRows) -> None:
    """Write ``/stat`` and ``/window`` of a ``stat`` dump or checkpoint from ``stat``'s host arrays
    (the window cut to its filled slots)."""
    meta = stat.meta
    filled = int((meta[:, :, 0] >= 0).sum(axis=1).max()) if meta.size else 0
    write_stat(writer, layout, physical_to_logical, stat.rows, stat.passes[:, 0], stat.passes[:, 1], stat.phase_rows, stat.phase_counts)
    writer.write(Data.WINDOW_PASS_ID, meta[:, :filled, 0].astype(np.int64))
    writer.write(Data.WINDOW_TIMESTAMP, meta[:, :filled, 1])
    writer.write(Data.WINDOW_NUM_TOKENS, meta[:, :filled, 2].astype(np.int64))
    writer.write(Data.WINDOW_PASS_PHASE, np.maximum(meta[:, :filled, 3], 0).astype(np.int8))
    writer.write(Data.WINDOW_NUM_REQUESTS, meta[:, :filled, 4].astype(np.int32))
    writer.write_pieces(Data.WINDOW_PHYSICAL_COUNT, stat.counts, axis=1, length=filled, compress=True)

"""Crash-safe streaming: a recording as a sequence of complete segment files.

Streaming modes never keep more than one *open* file. Rows go into the open
segment (a :class:`~moetrace.trace.writer.TraceWriter` temporary); once the
recording's pass count reaches a multiple of its period
(``RecorderConfig.rotation_passes``, the same pass on every rank, see
:mod:`moetrace.recording.session`) or the segment holds ``segment_bytes`` of raw
rows, the writer closes it: it writes the segment's own ``/stat`` (the totals
of exactly the passes in it), marks it complete, ``fsync``s and renames it to::

    .moetrace-<run_id>-rank<r>-seg<index:06d>.h5

These writers run in the recording's writer process
(:mod:`moetrace.trace.writer_process`), never in the engine's interpreter.

Every closed segment is a valid trace on its own. A SIGKILL therefore loses at
most the open segment plus the rows still staged in memory. ``stat`` mode
writes a checkpoint instead, ``.moetrace-<run_id>-rank<r>-checkpoint.h5``,
replaced atomically on the same schedule.

Next to them the run's journal (:mod:`moetrace.trace.journal`) notes what each
segment holds. File names and writer liveness are :mod:`moetrace.trace.files`;
joining segments into one trace is :mod:`moetrace.trace.join`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..pass_phase import PASS_PHASES
from .files import segment_path
from .journal import Journal
from .schema import PHASE_COUNTS, STRING_DTYPE, Attr, Data, TraceHeader
from .stat import CounterLayout, StatRows, write_stat, write_stat_window
from .writer import TraceWriter

__all__ = ["CheckpointWriter", "SegmentInfo", "SegmentWriter", "StreamRows"]


@dataclasses.dataclass
class StreamRows:
    """One hand-off of streamed rows and the counter totals of exactly those passes.

    Attributes:
        rows: ``{dataset: [n, ...] rows}`` to append (e.g. ``"tokens/topk_ids"``).
        totals: ``[L, C]`` int64 counter rows of these passes (see ``CounterLayout``);
            ``None`` when there are no passes.
        passes: passes in ``rows``.
        tokens: tokens in those passes.
        first_pass: pass id of the first pass (``-1`` when ``passes == 0``).
        last_pass: pass id of the last pass.
        dropped_passes: passes dropped (``on_overflow="drop"``) since the previous hand-off.
        phase_totals: ``[Q, L, C]`` the same totals split by pass phase (they add up to ``totals``).
        phase_counts: ``[3, Q]`` passes, tokens and requests of each pass phase
            (:data:`~moetrace.trace.stat.PHASE_COUNTS`).
        request_ids: ``per_token``: the request ids that ``rows["tokens/request"]`` indexes
            (this hand-off's own table); the segment writer re-indexes them into the
            segment's ``/request_table``. ``None``: no request column.
    """

    rows: dict[str, np.ndarray]
    totals: np.ndarray | None
    passes: int
    tokens: int
    first_pass: int
    last_pass: int
    dropped_passes: int = 0
    phase_totals: np.ndarray | None = None
    phase_counts: np.ndarray | None = None
    request_ids: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    """A closed segment: its file and the passes it holds."""

    path: Path
    index: int
    first_pass: int
    last_pass: int
    passes: int
    tokens: int
    closed_unix: float


class SegmentWriter:
    """Writes one rank's streamed rows into rotating segment files (writer thread only).

    Args:
        directory: where segments go (the recorder's ``output_dir``).
        header: the trace header of every segment (run id, rank, shapes).
        streamed: ``{dataset: (row shape, dtype)}`` of the streamed group, so an
            empty segment or dump still has every dataset.
        layout: the columns of the counter rows (a segment's ``/stat`` is written from its totals).
        physical_to_logical: ``[L, P]`` map for ``/stat/logical_count``.
        segment_bytes: close the segment once its raw rows reach this size.
        journal: the run's journal.
        compression: keyword arguments for ``TraceWriter.append`` datasets.
    """

    def __init__(
        self,
        directory: Path,
        header: TraceHeader,
        streamed: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        layout: CounterLayout,
        physical_to_logical: np.ndarray,
        segment_bytes: int,
        journal: Journal,
        compression: Mapping[str, object] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.header = header
        self.streamed = dict(streamed)
        self.layout = layout
        self.physical_to_logical = physical_to_logical
        self.segment_bytes = segment_bytes
        self.journal = journal
        self.compression = compression
        self._index = 0
        self._writer: TraceWriter | None = None
        self._reset_open()
        self._completed: list[SegmentInfo] = []
        self._lock = threading.Lock()

    def _reset_open(self) -> None:
        self._requests: dict[str, int] = {}  # the open segment's /request_table: id -> index
        self._totals: np.ndarray | None = None
        self._phase_totals = np.zeros((len(PASS_PHASES), self.header.num_layers, self.layout.width), np.int64)
        self._phase_counts = np.zeros((len(PHASE_COUNTS), len(PASS_PHASES)), np.int64)
        self._passes = self._tokens = self._bytes = self._dropped = 0
        self._first = self._last = -1

    @property
    def next_index(self) -> int:
        """The index the next segment will get: every segment closed so far has a smaller one."""
        return self._index

    @property
    def open_passes(self) -> int:
        """Passes written into the open (not yet closed) segment."""
        return self._passes

    def write(self, part: StreamRows | dict[str, np.ndarray] | None) -> None:
        """Append one hand-off to the open segment, closing it when it reached ``segment_bytes``.

        A plain ``{dataset: rows}`` dict (rows that belong to no pass count,
        e.g. ``/timing``) is appended as it is.
        """
        if part is None or (isinstance(part, dict) and not part):
            return
        rows = part if isinstance(part, dict) else part.rows
        if self._writer is None:
            target = segment_path(self.directory, self.header.run_id, self.header.rank, self._index)
            self._writer = TraceWriter(target, self.header, compression=self.compression)
        if not isinstance(part, dict) and part.request_ids is not None:
            rows = self._segment_requests(rows, part.request_ids)
        for name, array in rows.items():
            self._writer.append(name, array)
            self._bytes += array.nbytes
        if isinstance(part, dict):
            return
        self._dropped += part.dropped_passes
        if part.passes == 0:
            return
        assert part.totals is not None
        self._totals = part.totals.astype(np.int64) if self._totals is None else self._totals + part.totals
        if part.phase_totals is not None and part.phase_counts is not None:
            self._phase_totals += part.phase_totals
            self._phase_counts += part.phase_counts
        if self._passes == 0:
            self._first = part.first_pass
        self._passes += part.passes
        self._tokens += part.tokens
        self._last = part.last_pass
        self.journal.note("rows", segment=self._index, first_pass=self._first, last_pass=self._last, passes=self._passes, tokens=self._tokens, dropped_passes=self._dropped)
        if self._bytes >= self.segment_bytes:
            self.rotate()

    def _segment_requests(self, rows: dict[str, np.ndarray], request_ids: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Re-index a hand-off's ``/tokens/request`` column (into ``request_ids``) into the open
        segment's table, appending the ids it has not seen to ``/request_table/id``."""
        table = self._requests
        known = len(table)
        index = np.fromiter((table.setdefault(r, len(table)) for r in request_ids), dtype=np.int32, count=len(request_ids))
        local = rows[Data.TOKENS_REQUEST]
        rows = dict(rows)
        rows[Data.TOKENS_REQUEST] = np.where(local >= 0, index[np.maximum(local, 0)] if len(index) else -1, -1).astype(np.int32)
        new = list(table)[known:]
        if new:
            rows[Data.REQUEST_TABLE_ID] = np.array(new, dtype=STRING_DTYPE)
        return rows

    def rotate(self) -> None:
        """Close the open segment (``/stat``, complete, fsync, rename); no-op when it holds nothing."""
        writer = self._writer
        if writer is None:
            return
        self._writer = None  # closed below, whether it commits or fails
        with writer:
            for name, (row_shape, dtype) in self.streamed.items():
                writer.ensure_empty(name, row_shape, np.dtype(dtype))
            totals = self._totals if self._totals is not None else np.zeros((self.header.num_layers, self.layout.width), np.int64)
            write_stat(writer, self.layout, self.physical_to_logical, totals[None], np.array([self._passes]), np.array([self._tokens]),
                       self._phase_totals[None], self._phase_counts[None])
            writer.write(Data.STAT_DROPPED_PASSES, np.array([self._dropped], dtype=np.int64))
            closed = time.time()
            for key, value in ((Attr.SEGMENT_INDEX, self._index), (Attr.FIRST_PASS, self._first), (Attr.LAST_PASS, self._last), (Attr.SEGMENT_UNIX, closed)):
                writer.set_attr(key, value)
            path = writer.commit()
        info = SegmentInfo(path, self._index, self._first, self._last, self._passes, self._tokens, closed)
        with self._lock:
            self._completed.append(info)
        self.journal.note("segment", segment=self._index, path=path.name, first_pass=self._first, last_pass=self._last, passes=self._passes, tokens=self._tokens, dropped_passes=self._dropped)
        self._index += 1
        self._reset_open()

    def take_completed(self, before: int | None = None) -> list[SegmentInfo]:
        """Closed segments not taken yet (oldest first), only those with an index below ``before``
        when given; the caller owns their files."""
        with self._lock:
            done = [info for info in self._completed if before is None or info.index < before]
            self._completed = self._completed[len(done):]
        return done

    def abort(self) -> None:
        """Delete the open segment's temporary (its rows are discarded)."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        self._reset_open()


class CheckpointWriter:
    """``stat`` mode's sink: each job writes a complete checkpoint trace, replacing the previous one atomically.

    A job builds ``(stat, last_pass, passes)``: ``stat`` (:class:`~moetrace.trace.stat.StatRows`, one
    rank row) gives ``/stat`` and ``/window`` (:func:`~moetrace.trace.stat.write_stat_window`); the
    checkpoint gets root attributes ``checkpoint_unix`` and ``last_pass``.
    """

    def __init__(self, path: Path, header: TraceHeader, journal: Journal, layout: CounterLayout,
                 compression: Mapping[str, object] | None = None) -> None:
        self.path = Path(path)
        self.header = header
        self.journal = journal
        self.layout = layout
        self.compression = compression

    def write(self, part: tuple[StatRows, int, int] | None) -> None:
        if part is None:
            return
        stat, last_pass, passes = part
        with TraceWriter(self.path, self.header, compression=self.compression) as writer:
            write_stat_window(writer, self.layout, self.header.physical_to_logical, stat)
            now = time.time()
            writer.set_attr(Attr.CHECKPOINT_UNIX, now)
            writer.set_attr(Attr.LAST_PASS, last_pass)
            writer.commit()
        self.journal.note("checkpoint", path=self.path.name, last_pass=last_pass, passes=passes)

    def rotate(self) -> None:
        return None

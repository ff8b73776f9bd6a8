"""The recording session: one recording's files while it runs, for crash safety.

From ``start_record`` to the dump that ends it, a streaming recording writes
rotating segment files and a ``stat`` recording writes checkpoints, both
through one background writer thread, and notes each step in the run's
journal (:mod:`moetrace.trace.segments`, :mod:`moetrace.trace.journal`).
:class:`RecordingSession` owns that thread, the journal, the rotation
schedule, the checkpoint host buffers and the closed segments a dump took but
has not consumed yet. The recorder's state machine opens one at
``start_record`` and closes it at ``reset`` or after the last dump; at
interpreter exit the sessions still open are closed (:func:`close_at_exit`),
keeping passes never dumped on disk for ``moetrace recover``.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..config import RecorderConfig
from ..trace.files import journal_path, sweep_dead_temporaries
from ..trace.journal import Journal
from ..trace.schema import TraceHeader, TraceWriteError
from ..trace.segments import CheckpointWriter, SegmentInfo, SegmentWriter
from ..trace.stat import StatRows
from ..trace.stream import BackgroundTraceWriter, HostBufferPool, StreamJob
from ..trace.writer import TraceWriter, check_writable_dir
from .pass_counter import PassCounter
from .sink import ModeSink
from .window import StatWindow

__all__ = ["Cut", "OpenFiles", "RecordingSession", "SessionSlot", "Staged", "close_at_exit"]

#: ``fill(writer, stat)``: a checkpoint's ``/stat`` and ``/window`` from its host arrays (one rank row).
FillStat = Callable[[TraceWriter, StatRows], None]


#: ``open_files(directory, header, journal)``: the writer of a recording's files, the mode's
#: (:meth:`moetrace.recording.modes.RecordingMode.session_files`): checkpoints or segments.
OpenFiles = Callable[[Path, TraceHeader, Journal], "CheckpointWriter | SegmentWriter"]


@dataclasses.dataclass(frozen=True)
class Staged:
    """The recorder's device-side parts whose staged rows a rotation hands to the writer thread.

    Attributes:
        counter: the pass counter; its ``totals [L, C]`` go into each checkpoint.
        sink: the mode's sink: ``stat`` mode's window of the last passes (a checkpoint copies it),
            a streaming mode's row stream (a rotation flushes it).
        flush_timing: submits the staged ``/timing`` rows (streaming modes).
    """

    counter: PassCounter
    sink: ModeSink
    flush_timing: Callable[[], None]


class RecordingSession:
    """The writer thread, journal and rotation schedule of one recording (see the module docstring).

    Args:
        config: the recorder's configuration (``output_dir``, ``segment_seconds``, ``segment_bytes``).
        header: the header of every segment / checkpoint (carries run id and rank).
        open_files: opens the writer of the recording's files (the mode's checkpoints or segments).
        staged: the parts a rotation flushes.
        fill_stat: writes a checkpoint's ``/stat`` and ``/window`` from host arrays.
    """

    def __init__(
        self,
        config: RecorderConfig,
        header: TraceHeader,
        open_files: OpenFiles,
        staged: Staged,
        fill_stat: FillStat,
    ) -> None:
        self.config = config
        self._staged = staged
        self._fill_stat = fill_stat
        self._cuda = torch.device(config.device).type == "cuda"  # type: ignore[arg-type]
        directory = check_writable_dir(Path(config.output_dir))
        sweep_dead_temporaries(directory)
        rank = header.rank
        self.journal = Journal(journal_path(directory, header.run_id, rank))
        self.journal.note("start", pid=os.getpid(), host=socket.gethostname(), run_id=header.run_id, rank=rank, world_size=header.world_size, mode=config.mode, segment_seconds=config.segment_seconds, segment_bytes=config.segment_bytes)
        self.writer = BackgroundTraceWriter(open_files(directory, header, self.journal))
        self._rotate_at = time.monotonic() + (config.segment_seconds or float("inf"))
        self._checkpoint_buffers: tuple[HostBufferPool, HostBufferPool, HostBufferPool, HostBufferPool] | None = None
        self._undumped: list[SegmentInfo] = []  # closed segments taken by a dump that failed

    @property
    def error(self) -> BaseException | None:
        """The writer thread's first error, if any."""
        return self.writer.error

    def submit(self, job: StreamJob) -> None:
        self.writer.submit(job)

    def poll(self) -> None:
        """Pass end (forward thread): hand the writer the copies that have finished (never blocks)."""
        self.writer.poll()

    def settle(self) -> None:
        """Wait for every copy in flight and hand it to the writer (a lifecycle call, or before blocking)."""
        self.writer.settle()

    def due(self) -> bool:
        """Whether ``segment_seconds`` have passed since the last rotation and every stream's staged
        rows end on a chunk boundary (so that segments join by copying chunks; a few passes later)."""
        return time.monotonic() >= self._rotate_at and self._staged.sink.at_boundary()

    def rotate(self, pass_id: int, passes: int, wait: bool = False) -> None:
        """Hand what is staged to the writer thread, which closes the segment (streaming) or writes a
        checkpoint (``stat``: totals of ``passes`` passes up to ``pass_id``; tokens from the device).
        Only enqueues (``wait``: block for a free checkpoint buffer instead of skipping)."""
        self._rotate_at = time.monotonic() + (self.config.segment_seconds or float("inf"))  # 0: no time bound
        if not self._staged.sink.streamed:
            self._checkpoint(pass_id, passes, wait)
            return
        self._staged.flush_timing()
        self._staged.sink.flush(rotate=True, wait=wait)

    def _checkpoint(self, pass_id: int, passes: int, wait: bool) -> None:
        """Stat mode: copy totals and window to host buffers (asynchronously) and let the
        writer thread write the checkpoint; skipped when the previous one is still being
        written, unless ``wait``."""
        counter, w = self._staged.counter, self._staged.sink
        assert isinstance(w, StatWindow)
        slots = len(w.pass_id)
        if self._checkpoint_buffers is None:
            with torch.inference_mode(False):  # normal tensors, even when the first checkpoint runs under it
                self._checkpoint_buffers = (
                    HostBufferPool(tuple(counter.totals.shape), torch.int64, 1, self._cuda),
                    HostBufferPool(tuple(w.counts.shape), torch.int32, 1, self._cuda),
                    HostBufferPool((slots + 1 + len(counter.pass_phase_tokens),), torch.int64, 1, self._cuda),
                    HostBufferPool(tuple(counter.pass_phase_totals.shape), torch.int64, 1, self._cuda),
                )
        totals_pool, window_pool, tokens_pool, phase_pool = self._checkpoint_buffers
        if wait:
            self.settle()  # the previous checkpoint's copy, so that its buffers come back
        totals = totals_pool.acquire(block=wait)
        if totals is None:
            return
        window, tokens, phase_totals = window_pool.acquire(), tokens_pool.acquire(), phase_pool.acquire()
        assert window is not None and tokens is not None and phase_totals is not None
        totals.copy_(counter.totals, non_blocking=True)
        window.copy_(w.counts, non_blocking=True)
        phase_totals.copy_(counter.pass_phase_totals, non_blocking=True)
        tokens[:slots].copy_(w.tokens, non_blocking=True)  # each window slot's tokens, the token total, each pass phase's
        tokens[slots : slots + 1].copy_(counter.token_total, non_blocking=True)
        tokens[slots + 1 :].copy_(counter.pass_phase_tokens, non_blocking=True)
        event = torch.cuda.Event() if self._cuda else None
        if event is not None:
            event.record()
        order = w.order()
        meta = np.stack([w.pass_id, w.timestamp], axis=1)[order]
        window_phase = np.stack([w.pass_phase, w.requests], axis=1)[order].astype(np.float64)
        phase_host = counter.pass_phase_host.copy()
        fill = self._fill_stat

        def build() -> tuple[object, int, int]:
            rows, counts = totals.numpy()[None].copy(), [window.numpy()[order][None]]
            host_tokens = tokens.numpy()
            full = np.concatenate([meta, host_tokens[order][:, None].astype(np.float64), window_phase], axis=1)
            phase_rows = phase_totals.numpy()[None].copy()
            phase_counts = np.stack([phase_host[0], host_tokens[slots + 1 :], phase_host[1]])[None]
            stat = StatRows(rows, np.array([[passes, int(host_tokens[slots])]]), full[None], counts, phase_rows=phase_rows, phase_counts=phase_counts)
            return (lambda writer: fill(writer, stat)), pass_id, passes

        def done() -> None:
            phase_pool.release(phase_totals)
            tokens_pool.release(tokens)
            window_pool.release(window)
            totals_pool.release(totals)

        self.writer.submit(StreamJob(event=event, build=build, done=done))

    def cut(self, pass_id: int, passes: int) -> Cut:
        """A dump's cut (recorder lock held, between two pass ends): hand what is staged to the
        writer thread, which closes the open segment, and mark the place in its queue. O(1) on
        this thread: it only enqueues (it waits only when the writer is already behind, as the
        next pass end would)."""
        self.rotate(pass_id, passes)
        cut = Cut()
        sink = self.writer.sink
        assert isinstance(sink, SegmentWriter)
        self.writer.submit(StreamJob(event=None, done=lambda: cut.reached(sink.next_index)))
        return cut

    def take_segments(self, cut: Cut) -> list[SegmentInfo]:
        """The closed segments up to ``cut`` not consumed yet (oldest first), with those of a dump
        that failed. Waits until the writer thread has closed them (call :meth:`settle` first)."""
        cut.wait()
        if self.writer.error is not None:
            raise TraceWriteError(f"the background trace writer failed earlier ({self.writer.error}); the passes since then are lost, call reset() or start_record()") from self.writer.error
        sink = self.writer.sink
        assert isinstance(sink, SegmentWriter)
        self._undumped = self._undumped + sink.take_completed(before=cut.index)
        return list(self._undumped)

    def consumed(self, taken: Sequence[SegmentInfo], written: Path) -> None:
        """``taken``'s rows are now in the complete trace ``written``: note it and delete the segments."""
        self.journal.note("dumped", segments=[info.index for info in taken], path=str(written))
        for info in taken:
            info.path.unlink(missing_ok=True)
        self._undumped = [info for info in self._undumped if info not in taken]

    def close(self, keep: bool, undumped_passes: int) -> None:
        """Stop the writer thread. ``keep``: the caller rotated last (every pass is in a closed segment
        or checkpoint) and the files stay for ``moetrace recover``; else every file of the run not dumped
        yet is deleted."""
        self.writer.close()
        sink = self.writer.sink
        if isinstance(sink, SegmentWriter):
            if not keep:
                sink.abort()
                for info in [*self._undumped, *sink.take_completed()]:
                    info.path.unlink(missing_ok=True)
                self._undumped = []
        elif not keep:
            sink.path.unlink(missing_ok=True)
        if keep:
            self.journal.note("closed", undumped_passes=undumped_passes)
            self.journal.close()
        else:
            self.journal.close()
            self.journal.path.unlink(missing_ok=True)


class Cut:
    """Where a dump's cut sits in the writer thread's queue: set once every job handed over
    before it is written; ``index``: segments below it hold the cut's passes."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.index = -1

    def reached(self, index: int) -> None:
        self.index = index
        self._done.set()

    def wait(self) -> None:
        self._done.wait()


class _Owner(Protocol):
    def _close_at_exit(self) -> None: ...


_OPEN: weakref.WeakSet[_Owner] = weakref.WeakSet()


class SessionSlot:
    """A recorder's open :class:`RecordingSession`, if any, and what the recorder asks of it; each
    call is a no-op while none is open (a ``stat`` recording without checkpoints never opens one).
    While one is open, the owner's ``_close_at_exit`` runs at interpreter exit (:func:`close_at_exit`)."""

    def __init__(self, owner: _Owner) -> None:
        self._owner = owner
        self.session: RecordingSession | None = None

    def open(self, session: RecordingSession) -> None:
        self.session = session
        _OPEN.add(self._owner)

    def take(self) -> RecordingSession | None:
        """The open session, which the slot no longer holds (the caller closes it)."""
        session, self.session = self.session, None
        _OPEN.discard(self._owner)
        return session

    @property
    def error(self) -> str | None:
        """The open session's writer failure, if any."""
        return self.session.error if self.session is not None else None

    def submit(self, job: StreamJob) -> None:
        """Hand ``job`` to the writer thread (with none open: the job's staging is released at once)."""
        if self.session is None:
            job.done()
        else:
            self.session.submit(job)

    def settle(self) -> None:
        """Hand the writer thread every copy still in flight (waits for their events on this thread)."""
        if self.session is not None:
            self.session.settle()

    def after_pass(self, pass_id: int, passes: int) -> None:
        """A pass ended (lock held): note what the writer finished; rotate when a segment is due
        (``segment_seconds``). Only enqueues: never waits."""
        if self.session is not None:
            self.session.poll()
            if self.session.due():
                self.session.rotate(pass_id, passes, False)

    def rotate(self, pass_id: int, passes: int) -> None:
        """Everything recorded up to ``pass_id`` into closed segments or a checkpoint (waits for a
        free checkpoint buffer)."""
        if self.session is not None:
            self.session.rotate(pass_id, passes, True)

    def close(self, keep: bool, pass_id: int, passes: int, undumped_passes: int) -> None:
        """Stop the writer thread. ``keep``: rotate up to ``pass_id`` first and leave the files for
        ``moetrace recover``; else delete every file of the run not dumped yet."""
        if keep:
            self.rotate(pass_id, passes)
        session = self.take()
        if session is not None:
            session.close(keep, undumped_passes)


@atexit.register
def close_at_exit() -> None:
    """Stop writer threads before the interpreter tears HDF5 down (a daemon thread
    frozen inside h5py would deadlock the exit). Passes never dumped stay on disk as
    closed segments (or a checkpoint) for ``moetrace recover``."""
    for owner in list(_OPEN):
        owner._close_at_exit()

"""The recording session: one recording's files while it runs, for crash safety.

From ``start_record`` to the dump that ends it, a streaming recording writes
rotating segment files and a ``stat`` recording writes checkpoints, and notes
each step in the run's journal (:mod:`moetrace.trace.segments`,
:mod:`moetrace.trace.journal`). Those files are written by the recording's
writer process (:mod:`moetrace.trace.writer_process`), never in the engine's
interpreter; a background thread here waits for each hand-off's device copy
and sends its host arrays there. :class:`RecordingSession` owns that thread,
the writer process, the rotation schedule, the checkpoint host buffers and the
closed segments a dump took but has not consumed yet.

The schedule is a pass count agreed at ``start_record``
(``RecorderConfig.rotation_passes``, rank 0's under a process group): a
segment closes, or a checkpoint is written, at the first pass end on a chunk
boundary once the recording's pass count reaches a multiple of the period, so
every rank of a fleet in lockstep does it at the same pass. A ``stat`` checkpoint copies its window
a part at each pass end (:data:`CHECKPOINT_COPY_BYTES`), never all at one. The recorder's state machine opens one at
``start_record`` and closes it at ``reset`` or after the last dump; at
interpreter exit the sessions still open are closed (:func:`close_at_exit`),
keeping passes never dumped on disk for ``moetrace recover``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..config import RecorderConfig
from ..trace.files import sweep_dead_temporaries
from ..trace.journal import Journal
from ..trace.offload import run_job
from ..trace.schema import TraceHeader, TraceWriteError
from ..trace.segments import CheckpointWriter, SegmentInfo, SegmentWriter
from ..trace.stat import StatRows, ring_pieces
from ..trace.stream import BackgroundTraceWriter, HostBufferPool, StreamJob
from ..trace.writer import check_writable_dir
from ..trace.writer_process import RemoteJournal, RemoteSink, WriterProcess, WriterSpec
from .pass_counter import PassCounter
from .sink import ModeSink
from .window import StatWindow, WindowCut

__all__ = ["Cut", "RecordingSession", "SessionSlot", "Staged", "WriterSpecFor", "close_at_exit"]

_log = logging.getLogger("moetrace")

#: At most this many bytes of a checkpoint's window are copied at one pass end (4 MiB: 64 of
#: DeepSeek-V3's 67 KB slots, so its 67 MB window takes 16 pass ends; a small window, at once).
CHECKPOINT_COPY_BYTES = 4 << 20


#: ``spec_for(directory, header)``: what the recording's writer process builds, the mode's
#: (:meth:`moetrace.recording.modes.RecordingMode.session_files`): checkpoints or segments.
WriterSpecFor = Callable[[Path, TraceHeader], WriterSpec]


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
    """The writer thread and process, journal and rotation schedule of one recording (see the module docstring).

    Args:
        config: the recorder's configuration (``output_dir``, ``segment_bytes``).
        header: the header of every segment / checkpoint (carries run id and rank).
        spec_for: what the writer process opens for the recording's files (the mode's checkpoints or segments).
        staged: the parts a rotation flushes.
        period: passes between rotations / checkpoints, agreed by the ranks (``0``: none).
    """

    def __init__(
        self,
        config: RecorderConfig,
        header: TraceHeader,
        spec_for: WriterSpecFor,
        staged: Staged,
        period: int,
    ) -> None:
        self.config = config
        self._staged = staged
        self._cuda = torch.device(config.device).type == "cuda"  # type: ignore[arg-type]
        self._checkpoint_buffers = None if staged.sink.streamed else self._checkpoint_pools()  # before any file or process: a failed allocation leaves none behind
        directory = check_writable_dir(Path(config.output_dir))
        sweep_dead_temporaries(directory)
        rank = header.rank
        spec = spec_for(directory, header)
        self._checkpoint_path = spec.checkpoint
        self._process, self.journal, sink = _open_files(spec)
        self.journal.note("start", pid=os.getpid(), writer_pid=self._process.pid if self._process is not None else None, host=socket.gethostname(),
                          run_id=header.run_id, rank=rank, world_size=header.world_size, mode=config.mode, segment_passes=period,
                          segment_bytes=config.segment_bytes)
        self.writer = BackgroundTraceWriter(sink)  # type: ignore[arg-type]
        self._period = period
        self._warned = False
        self._rotate_at = period or None  # the pass count of the next rotation
        self._window_copy: _WindowCopy | None = None  # a checkpoint whose window is being copied
        self._undumped: list[SegmentInfo] = []  # closed segments taken by a dump that failed

    @property
    def error(self) -> BaseException | None:
        """The writer's first error, if any."""
        return self.writer.error

    def failed_once(self) -> bool:
        """``True`` (with one warning) the first time it is asked after the writer failed."""
        if self._warned:
            return False
        self._warned = True
        _log.warning("moetrace: the recording's writer failed (%s); recording stopped, the engine goes on; the closed segments or "
                     "checkpoint in %s stay for `moetrace recover`", self.writer.error, self.config.output_dir)
        return True

    def submit(self, job: StreamJob) -> None:
        self.writer.submit(job)

    def poll(self) -> None:
        """Pass end (forward thread): copy the next part of a checkpoint's window (:meth:`advance`) and
        hand the writer the copies that have finished (never blocks)."""
        self.advance()
        self.writer.poll()

    def settle(self) -> None:
        """Wait for every copy in flight and hand it to the writer (a lifecycle call, or before blocking)."""
        self.writer.settle()

    def due(self, passes: int) -> bool:
        """Whether the recording's pass count ``passes`` reached the next multiple of the period and every
        stream's staged rows end on a chunk boundary (so that segments join by copying chunks; a few
        passes later, the same ones on every rank)."""
        return self._rotate_at is not None and passes >= self._rotate_at and self._staged.sink.at_boundary()

    def rotate(self, pass_id: int, passes: int, wait: bool = False) -> None:
        """Hand what is staged to the writer thread, which closes the segment (streaming) or writes a
        checkpoint (``stat``: totals of ``passes`` passes up to ``pass_id``; tokens from the device).
        Only enqueues (``wait``: block for a free checkpoint buffer instead of skipping)."""
        if self._period:  # the next multiple of the period: a dump's cut in between leaves the schedule where it was
            self._rotate_at = (passes // self._period + 1) * self._period
        if not self._staged.sink.streamed:
            self._checkpoint(pass_id, passes, wait)
            return
        self._staged.flush_timing()
        self._staged.sink.flush(rotate=True, wait=wait)

    def _checkpoint(self, pass_id: int, passes: int, wait: bool) -> None:
        """Stat mode: copy totals and window to host buffers (asynchronously) and let the
        writer thread write the checkpoint; skipped when the previous one is still being
        copied or written, unless ``wait``.

        The window ``[W, L, P]`` (67 MB at DeepSeek-V3 size) is copied as a
        :class:`~moetrace.recording.window.WindowCut`: at most :data:`CHECKPOINT_COPY_BYTES` of
        it at this pass end and at each of the next ones (:meth:`advance`), a slot about to be
        overwritten first, so the checkpoint holds the window as it was at ``pass_id`` and no
        pass end carries one large copy (on a GPU, a burst the engine's own copies would queue
        behind; on a CPU, a copy the forward thread makes). ``wait`` copies it all now."""
        counter, w = self._staged.counter, self._window()
        slots = len(w.pass_id)
        if wait:  # the previous checkpoint's copy finished and handed over, so that its buffers come back once written
            self._finish_window_copy()
            self.settle()
        assert self._checkpoint_buffers is not None  # made for stat mode, the only one that checkpoints
        totals_pool, window_pool, tokens_pool, phase_pool = self._checkpoint_buffers
        totals = totals_pool.acquire(block=wait)
        if totals is None:
            return
        window, tokens, phase_totals = window_pool.acquire(), tokens_pool.acquire(), phase_pool.acquire()
        assert window is not None and tokens is not None and phase_totals is not None
        totals.copy_(counter.totals(), non_blocking=True)
        phase_totals.copy_(counter.pass_phase_totals, non_blocking=True)
        tokens[:slots].copy_(w.tokens, non_blocking=True)  # each window slot's tokens, the token total, each pass phase's
        tokens[slots : slots + 1].copy_(counter.token_total(), non_blocking=True)
        tokens[slots + 1 :].copy_(counter.pass_phase_tokens, non_blocking=True)
        cut = w.cut(window)
        order = cut.order
        meta = np.stack([w.pass_id, w.timestamp], axis=1)[order]
        window_phase = np.stack([w.pass_phase, w.requests], axis=1)[order].astype(np.float64)
        phase_host = counter.pass_phase_host.copy()

        def build() -> tuple[StatRows, int, int]:
            # The window goes to the writer process as the ring's views (no reordered copy here).
            rows, counts = totals.numpy()[None].copy(), ring_pieces(window.numpy(), order)
            host_tokens = tokens.numpy()
            full = np.concatenate([meta, host_tokens[order][:, None].astype(np.float64), window_phase], axis=1)
            phase_rows = phase_totals.numpy()[None].copy()
            phase_counts = np.stack([phase_host[0], host_tokens[slots + 1 :], phase_host[1]])[None]
            stat = StatRows(rows, np.array([[passes, int(host_tokens[slots])]]), full[None], counts, phase_rows=phase_rows, phase_counts=phase_counts)
            return stat, pass_id, passes

        def done() -> None:
            phase_pool.release(phase_totals)
            tokens_pool.release(tokens)
            window_pool.release(window)
            totals_pool.release(totals)

        slot_bytes = max(1, w.counts[0].numel() * w.counts.element_size())
        self._window_copy = _WindowCopy(cut, max(1, CHECKPOINT_COPY_BYTES // slot_bytes), StreamJob(event=None, build=build, done=done))
        if wait:
            self._finish_window_copy()
        else:
            self.advance()

    def _checkpoint_pools(self) -> tuple[HostBufferPool, HostBufferPool, HostBufferPool, HostBufferPool]:
        """``stat`` mode's checkpoint host buffers, one each, made when the recording starts (not at its
        first checkpoint, on the forward thread): totals ``[L, C]``, window ``[W, L, P]``, tokens
        ``[W + 1 + Q]`` (each slot's, the total, each pass phase's), phase totals ``[Q, L, C]``."""
        counter, w = self._staged.counter, self._window()
        with torch.inference_mode(False):  # normal tensors, even when the recording starts under it
            return (
                HostBufferPool(tuple(counter.current.shape), torch.int64, 1, self._cuda),
                HostBufferPool(tuple(w.counts.shape), torch.int32, 1, self._cuda),
                HostBufferPool((len(w.pass_id) + 1 + len(counter.pass_phase_tokens),), torch.int64, 1, self._cuda),
                HostBufferPool(tuple(counter.pass_phase_totals.shape), torch.int64, 1, self._cuda),
            )

    def advance(self) -> None:
        """Pass end (lock held): copy the next slots of a checkpoint's window; once all are
        copied, hand the checkpoint to the writer thread."""
        copy = self._window_copy
        if copy is None:
            return
        w = self._window()
        w.copy_cut(copy.cut, copy.cut.order[copy.at : copy.at + copy.step])
        copy.at += copy.step
        if copy.at >= len(copy.cut.order):
            self._window_copy = None
            copy.job.event = w.end_cut(copy.cut)
            self.writer.submit(copy.job)

    def _finish_window_copy(self) -> None:
        """Copy what is left of a checkpoint's window now and hand the checkpoint over."""
        copy = self._window_copy
        if copy is not None:
            copy.step = len(copy.cut.order)
            self.advance()

    def _drop_window_copy(self) -> None:
        """Closing without keeping files: a checkpoint still being copied is not written."""
        copy, self._window_copy = self._window_copy, None
        if copy is not None:
            self._window().end_cut(copy.cut)
            copy.job.done()

    def _window(self) -> StatWindow:
        """``stat`` mode's sink, the window a checkpoint copies."""
        w = self._staged.sink
        assert isinstance(w, StatWindow)
        return w

    def cut(self, pass_id: int, passes: int) -> Cut:
        """A dump's cut (recorder lock held, between two pass ends): hand what is staged to the
        writer thread, which closes the open segment, and mark the place in its queue. O(1) on
        this thread: it only enqueues (it waits only when the writer is already behind, as the
        next pass end would)."""
        self.rotate(pass_id, passes)
        cut = Cut()
        sink = self.writer.sink

        def reached() -> None:  # on the writer thread, once every job before it is written
            try:
                cut.reached(sink.next_index)  # type: ignore[union-attr]
            except TraceWriteError as exc:  # the writer process died
                cut.failed(exc)

        self.writer.submit(StreamJob(event=None, done=reached))
        return cut

    def take_segments(self, cut: Cut) -> list[SegmentInfo]:
        """The closed segments up to ``cut`` not consumed yet (oldest first), with those of a dump
        that failed. Waits until the writer thread has closed them (call :meth:`settle` first)."""
        cut.wait()
        error = self.writer.error or cut.error
        if error is not None:
            raise TraceWriteError(f"the background trace writer failed earlier ({error}); the passes since then are lost, call reset() or start_record()") from error
        sink = self.writer.sink
        self._undumped = self._undumped + sink.take_completed(before=cut.index)  # type: ignore[union-attr]
        return list(self._undumped)

    def run_small_job(self, job: Mapping[str, object]) -> Path:
        """A small dump's file job (:data:`moetrace.trace.offload.SmallJobs`): in the recording's writer
        process while it runs, so this interpreter writes no dump either; on this thread once it is
        gone (closed, died, or never started)."""
        process = self._process
        if process is not None and process.alive:
            try:
                return process.run_job(job)
            except TraceWriteError:
                if process.alive:
                    raise  # the job's own failure
        return run_job(job)

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
        if keep:
            self._finish_window_copy()
        else:
            self._drop_window_copy()
        self.writer.close()
        try:
            self._close_files(keep, undumped_passes)
        except TraceWriteError as exc:  # the writer process died: its closed files stay for `moetrace recover`
            _log.warning("moetrace: closing the recording's files failed: %s", exc)
        finally:
            if self._process is not None:
                self._process.close()

    def _close_files(self, keep: bool, undumped_passes: int) -> None:
        sink = self.writer.sink
        if self._checkpoint_path is None:
            if not keep:
                sink.abort()  # type: ignore[union-attr]
                for info in [*self._undumped, *sink.take_completed()]:  # type: ignore[union-attr]
                    info.path.unlink(missing_ok=True)
                self._undumped = []
        elif not keep:
            self._checkpoint_path.unlink(missing_ok=True)
        if keep:
            self.journal.note("closed", undumped_passes=undumped_passes)
            self.journal.close()
        else:
            self.journal.close()
            self.journal.path.unlink(missing_ok=True)


def _open_files(spec: WriterSpec) -> tuple[WriterProcess | None, Journal | RemoteJournal, SegmentWriter | CheckpointWriter | RemoteSink]:
    """The recording's writer process and its journal and sink there; in this process (as before the
    writer process) only when no Python can be started (an embedded interpreter)."""
    try:
        process = WriterProcess(spec)
    except OSError as exc:
        _log.warning("moetrace: no writer process could be started (%s); the recording's files are written in this process", exc)
        journal, sink = spec.build()
        return None, journal, sink
    return process, RemoteJournal(process, spec.journal), RemoteSink(process, spec.checkpoint)


@dataclasses.dataclass
class _WindowCopy:
    """A checkpoint whose window is being copied: ``step`` slots of ``cut.order`` a pass end from
    ``at`` on, then ``job`` (its event set then) goes to the writer thread."""

    cut: WindowCut
    step: int
    job: StreamJob
    at: int = 0


class Cut:
    """Where a dump's cut sits in the writer thread's queue: set once every job handed over
    before it is written; ``index``: segments below it hold the cut's passes."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.index = -1
        self.error: BaseException | None = None

    def reached(self, index: int) -> None:
        self.index = index
        self._done.set()

    def failed(self, error: BaseException) -> None:
        """The writer could not say where the cut is (its process died)."""
        self.error = error
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

    def after_pass(self, pass_id: int, passes: int) -> bool:
        """A pass ended (lock held): note what the writer finished; rotate when the agreed pass count
        is reached. Only enqueues: never waits. ``True`` once, with one warning, when the recording's
        writer failed (its process died, the disk is full): the caller stops recording."""
        session = self.session
        if session is None:
            return False
        session.poll()
        if session.error is not None:
            return session.failed_once()
        if session.due(passes):
            session.rotate(pass_id, passes, False)
        return False

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

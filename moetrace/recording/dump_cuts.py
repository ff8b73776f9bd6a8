"""A recorder's dump cuts: each mode's cut under the recorder's lock, and the ledger of what the dumps did.

``dump_record()`` takes its recorder's lock, reads where the recording stands (a :class:`CutPoint`)
and hands it to its mode's dumper, built once by the mode (:meth:`~moetrace.recording.modes.RecordingMode.dumper`):

* :class:`StatDumper` (``stat``): collective and cumulative. Under the lock it copies the totals on
  the device and begins a copy on write of the window ring; outside it, the ring comes to the host
  :data:`WINDOW_BATCH_BYTES` per lock hold (a pass end waits for one batch at most), then the
  gathers to rank 0, which writes one file with a rank axis.
* :class:`StreamDumper` (``per_pass``, ``per_token``): per rank, the passes since the previous cut.
  Under the lock the open segment is handed to the writer thread and the place marked; outside it,
  the copies in flight are settled, then the dump thread joins the closed segments.

Either way the file itself is written on the background dump thread (:class:`~moetrace.recording.dump_files.DumpQueue`),
and :class:`DumpLedger` keeps the bookkeeping: the passes dumped, the last file, the failures, and
retention after each dump. Writing the files is :mod:`moetrace.recording.dump_files`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..config import RecorderConfig, rank_identity
from ..trace.retention import Retention
from .dump_files import (
    DumpQueue,
    PendingDump,
    TraceDump,
    gather_objects,
    stat_gathers,
)
from .pass_counter import PassCounter
from .session import RecordingSession
from .timing_state import NoTiming
from .window import StatWindow, WindowCut

__all__ = ["WINDOW_BATCH_BYTES", "CutPoint", "DumpLedger", "ModeDumper", "StatDumper", "StreamDumper"]

#: What a ``stat`` dump copies of the window per recorder lock hold (the most a pass end waits for it).
WINDOW_BATCH_BYTES = 4 << 20
#: The pause after each batch, outside the lock. Python's locks are not fair: without it the dump
#: thread takes the lock back before a waiting pass end wakes, and at DeepSeek-V3 size the first
#: pass after a cut waited 50-70 ms for the whole 67 MB window (``docs/benchmarks.md``). About
#: 17 ms per dump at that size.
WINDOW_BATCH_PAUSE_S = 1e-3

#: What a cut leaves for the caller's thread, outside the lock; it returns the file write for the dump thread.
Outside = Callable[[], Callable[[], Path]]
#: ``hand_session(session, run_id) -> taken``: a streaming dump after ``stop_record`` takes the recorder's
#: open session (``None``: it closes after that dump); a failed one gives it back, which the recorder
#: refuses (``False``) when ``run_id`` has ended.
HandSession = Callable[[RecordingSession | None, str], bool]


@dataclasses.dataclass(frozen=True)
class CutPoint:
    """Where the recording stands at a cut (read under the recorder's lock).

    Attributes:
        num_passes: passes recorded since ``start_record``.
        last_pass_id: the id of the last pass that ended.
        recording: whether hooks still count.
        run_id: the recording's run id.
        session: its open session (segments or checkpoints), if any.
    """

    num_passes: int
    last_pass_id: int
    recording: bool
    run_id: str
    session: RecordingSession | None


class DumpLedger:
    """What one recorder's dumps did, and the thread that writes their files.

    Fields change under the recorder's ``lock``.

    Attributes:
        dumped_passes: passes in dumps so far (cumulative ``stat`` dumps hold every pass).
        last_path: the last file a dump put in place.
        errors: one line per failed dump.
        retention: the bounded output directory (``RecorderConfig.retention``), applied after each dump.
        queue: the background dump thread.
    """

    def __init__(self, config: RecorderConfig, lock: threading.RLock) -> None:
        self._lock = lock
        self.dumped_passes = 0
        self.last_path: Path | None = None
        self.errors: list[str] = []
        self.retention = Retention(config.retention, config.output_dir) if config.retention is not None else None
        self.queue = DumpQueue()

    @property
    def pending(self) -> list[PendingDump]:
        """Dumps whose file is still being written."""
        return self.queue.pending

    def clear(self) -> None:
        """A fresh recording (lock held): nothing dumped, no failures."""
        self.dumped_passes = 0
        self.errors = []

    def retention_stats(self) -> dict[str, int] | None:
        return self.retention.stats.to_dict() if self.retention is not None else None

    def finished(self, target: Path, write: Callable[[], Path], undo: Callable[[], None] | None) -> Callable[[], Path]:
        """``write`` for the dump thread, then the bookkeeping: the last path and retention, or the
        error (and ``undo``, lock held)."""

        def run() -> Path:
            try:
                written = write()
            except BaseException as exc:
                with self._lock:
                    self.errors.append(f"dump to {target} failed: {exc}")
                    if undo is not None:
                        undo()
                raise
            with self._lock:
                self.last_path = written
            if self.retention is not None:  # bounded disk: after the dump, file I/O only
                self.retention.apply()
            return written

        return run


class ModeDumper(Protocol):
    """A mode's dump: a cut under the recorder's lock, the rest outside it."""

    #: Whether a cut needs the recording's open session (its segments).
    needs_session: bool

    def prepare(self) -> object:
        """Before the lock: what the cut needs allocated (``stat``: the host ring)."""

    def cut(self, path: Path, at: CutPoint, prepared: object) -> tuple[Path, Outside]:
        """The cut (lock held) of a dump asked for at ``path``: the file it writes, and what runs
        next on the caller's thread."""


def _per_rank(target: Path, rank: int, world: int) -> Path:
    return target.with_name(f"{target.stem}-rank{rank}{target.suffix}") if world > 1 else target


class StatDumper:
    """``stat`` dumps: cumulative, one file with a rank axis when gathered (collective)."""

    needs_session = False

    def __init__(self, config: RecorderConfig, dump: TraceDump, counter: PassCounter, window: StatWindow,
                 timing: NoTiming, ledger: DumpLedger, lock: threading.RLock) -> None:
        self._config, self._dump, self._counter, self._window = config, dump, counter, window
        self._timing, self._ledger, self._lock = timing, ledger, lock

    def prepare(self) -> torch.Tensor:
        return self._window.host_buffer()

    def cut(self, path: Path, at: CutPoint, prepared: object) -> tuple[Path, Outside]:
        """Device copies of the totals, the window's copy on write into ``prepared`` begun. What runs
        next copies the window a batch per lock hold, then gathers to rank 0 (collective)."""
        identity = rank_identity(self._config)
        rank, world = identity.rank, identity.world_size
        gathered = stat_gathers(self._config)
        if gathered:
            rank = rank_identity().rank  # the collective's rank 0 writes the file
        target = path if gathered else _per_rank(path, rank, world)
        peers = world if gathered else 1
        cut = self._dump.stat_cut(self._counter, self._window, at.num_passes, prepared)  # type: ignore[arg-type]
        timing = self._timing.part(rows=True, resolve=not at.recording)
        self._ledger.dumped_passes = at.num_passes  # every pass is in this one

        def gather() -> Callable[[], Path]:
            rows = self._dump.stat_gather(cut, self._copy_window(cut.ring), rank, world, peers)
            parts = gather_objects(timing, peers) if timing is not None else None
            if peers > 1 and rank != 0:
                return lambda: target  # rank 0 writes the file
            return self._ledger.finished(target, lambda: self._dump.stat(target, at.run_id, rank, world, peers, rows, parts, at.session), undo=None)  # type: ignore[arg-type]

        return target, gather

    def _copy_window(self, cut: WindowCut) -> np.ndarray:
        """The cut's window ring ``[W, L, P]`` on the host: copied :data:`WINDOW_BATCH_BYTES` at a
        time, each batch under the lock a pass end takes, then a pause that lets a waiting pass end
        take it (so a pass end waits for about one batch, never the whole window), oldest slots first
        (those the next passes overwrite; a pass end copies a slot itself when it gets there first)."""
        slot_bytes = max(1, cut.host[0].numel() * cut.host.element_size())
        step = max(1, WINDOW_BATCH_BYTES // slot_bytes)
        try:
            for at in range(0, len(cut.order), step):
                with self._lock:
                    self._window.copy_cut(cut, cut.order[at : at + step])
                time.sleep(WINDOW_BATCH_PAUSE_S)
        finally:
            with self._lock:
                event = self._window.end_cut(cut)
        if event is not None:
            event.synchronize()  # the caller's thread (a dump), not a pass end
        return cut.host.numpy()


class StreamDumper:
    """``per_pass`` and ``per_token`` dumps: per rank, the passes since the previous cut."""

    needs_session = True

    def __init__(self, config: RecorderConfig, dump: TraceDump, timing: NoTiming, ledger: DumpLedger, hand_session: HandSession) -> None:
        self._config, self._dump, self._timing, self._ledger, self._hand_session = config, dump, timing, ledger, hand_session

    def prepare(self) -> None:
        return None

    def cut(self, path: Path, at: CutPoint, prepared: object) -> tuple[Path, Outside]:
        """Hand the staged rows over and mark the cut. What runs next waits for the copies just
        handed over, then the dump thread joins the segments."""
        session = at.session
        assert session is not None, "the recorder checks needs_session"
        identity = rank_identity(self._config)
        rank, world = identity.rank, identity.world_size
        target = _per_rank(path, rank, world)
        timing = self._timing.part(rows=False, resolve=not at.recording)
        cut = session.cut(at.last_pass_id, at.num_passes)
        passes = at.num_passes - self._ledger.dumped_passes
        self._ledger.dumped_passes = at.num_passes
        undo_timing = self._timing.cut()
        detach = not at.recording  # the last dump after stop_record: the session closes after it
        if detach:
            self._hand_session(None, at.run_id)
        parts = [timing] if timing is not None else None

        def undo() -> None:  # lock held: the dump failed, its passes count as not dumped again
            self._ledger.dumped_passes -= passes
            undo_timing()
            # given back, a dump again retries; refused (a new recording began), its files stay for `moetrace recover`
            if detach and not self._hand_session(session, at.run_id):
                session.close(keep=True, undumped_passes=passes)

        def join() -> Path:
            written = self._dump.stream(target, at.run_id, rank, world, session, cut, parts)  # type: ignore[arg-type]
            if detach:
                session.close(keep=False, undumped_passes=0)
            return written

        def settle() -> Callable[[], Path]:
            session.settle()  # the writer thread waits for these copies; no CUDA call on other threads
            return self._ledger.finished(target, join, undo)

        return target, settle

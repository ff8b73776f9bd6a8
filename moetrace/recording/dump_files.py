"""Writing a recorder's dump files: the gathers over ranks, the background dump thread and the files.

Each mode's cut under the recorder's lock is :mod:`moetrace.recording.dump_cuts`; this module
writes what a cut leaves.

A dump is a *cut* at a pass boundary and nothing more on the forward thread:
under the recorder's lock (which a pass end also takes) a streaming mode hands
its staged rows to the segment writer thread, which closes the open segment,
and marks the place in that thread's queue (:meth:`RecordingSession.cut`);
``stat`` mode copies its totals on the device and begins a copy on write of
its window ring (:meth:`TraceDump.stat_cut`). Everything slow happens
afterwards, off the lock: the window ring's copy to the host a batch per lock
hold and the gathers over ranks on the caller's thread (collective), then on the
background :class:`DumpQueue` thread the joining of the closed segments up to
the cut into one per-rank trace by copying their chunks (:meth:`TraceDump.stream`),
or the ``stat`` file with a rank axis written by rank 0 (:meth:`TraceDump.stat`),
checksums, fsync and rename. Both files are written in a child process once they are
large (:mod:`moetrace.trace.offload`), so that work never holds this interpreter's
GIL: the dump thread waits for it and renames the file into place. Every file is written through
:class:`~moetrace.trace.writer.TraceWriter` (atomic: a failure leaves nothing
under the target name, and the segments stay for a retry or ``moetrace recover``:
the journal notes them consumed only once the dump is renamed into place).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..config import RecorderConfig, rank_identity
from ..layout import RankLayout
from ..pass_phase import PASS_PHASES
from ..timing import HISTOGRAM_EDGES, PHASES
from ..trace.offload import join_segments, write_stat_trace
from ..trace.schema import PHASE_COUNTS, Attr, Data, TraceHeader, dataset
from ..trace.stat import CounterLayout, StatRows, ring_pieces, write_stat
from ..trace.writer import TraceWriter
from .pass_counter import PassCounter
from .session import Cut, RecordingSession
from .timing_state import TimingPart
from .window import StatWindow, WindowCut

__all__ = ["DumpQueue", "PendingDump", "StatCut", "TimingParts", "TraceDump", "gather", "gather_objects", "shared_start", "stat_gathers"]

#: Per rank, in rank order: timing aggregates ``{field: array}`` and (``stat`` dumps) the window's ``/timing`` rows.
TimingParts = list[TimingPart]


def shared_start(config: RecorderConfig) -> tuple[str, int]:
    """A new recording's run id and the period of its periodic work in passes (``config.rotation_passes``):
    ``config.run_id`` and this rank's period when a run id is given (a launcher gives every rank the same
    configuration), else rank 0's of both (collective under a process group)."""
    if config.run_id is not None:
        return config.run_id, config.rotation_passes
    agreed: list[object] = [uuid.uuid4().hex, config.rotation_passes]
    if rank_identity().world_size > 1:
        dist.broadcast_object_list(agreed, src=0)
    return str(agreed[0]), int(agreed[1])  # type: ignore[call-overload]


def stat_gathers(config: RecorderConfig) -> bool:
    """Whether a ``stat`` dump gathers every rank's rows over the default process group (a collective
    that rank 0 writes): only with ``config.gather_stat`` and while a group of this recorder's world
    size (> 1) is initialised. Otherwise each rank writes its own file (``moetrace merge`` / ``analyze``
    join them)."""
    world = rank_identity(config).world_size
    return config.gather_stat and world > 1 and rank_identity().world_size == world


def gather(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order: ``[...]`` -> ``[world, ...]`` (collective)."""
    if world == 1:
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts)


def gather_objects(obj: object, world: int) -> list[object]:
    """Every rank's picklable ``obj`` in rank order (collective)."""
    if world == 1:
        return [obj]
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, obj)
    return gathered


@dataclasses.dataclass(frozen=True)
class StatCut:
    """A ``stat`` dump's cut: device copies (``totals [L, C]``, ``token_total [1]`` and the window's
    ``tokens [W]``), the window ring ``[W, L, P]`` being copied on write to the host
    (:class:`~moetrace.recording.window.WindowCut`) and host copies of the window's metadata."""

    totals: torch.Tensor
    token_total: torch.Tensor
    ring: WindowCut
    tokens: torch.Tensor
    order: np.ndarray
    pass_id: np.ndarray
    timestamp: np.ndarray
    num_passes: int
    pass_phase_totals: torch.Tensor  # [Q, L, C]
    pass_phase_tokens: torch.Tensor  # [Q]
    pass_phase_host: np.ndarray  # [2, Q] passes, requests of each pass phase
    window_pass_phase: np.ndarray  # [W] pass phase of each window slot
    window_requests: np.ndarray  # [W]


class PendingDump:
    """One dump whose file is written on the background dump thread.

    Attributes:
        target: the file it writes (it appears, complete, when the dump ends).
    """

    def __init__(self, target: Path, work: Callable[[], Path]) -> None:
        self.target = target
        self._work = work
        self._done = threading.Event()
        self._path: Path | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._path = self._work()
        except BaseException as exc:  # handed to whoever waits for the result
            self._error = exc
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Path:
        """The written path once the dump ended (raises its error; ``TimeoutError`` after ``timeout`` s)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the dump to {self.target} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return self._path


class DumpQueue:
    """Runs dumps in order on one background thread, off the forward thread.

    The thread starts with the first dump and ends when no dump is left; it is not a
    daemon, so the interpreter's exit waits for a dump in progress before the atexit
    handlers close the recording (:func:`moetrace.recording.session.close_at_exit`).
    """

    def __init__(self, name: str = "moetrace-dump") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._queue: deque[PendingDump] = deque()
        self._thread: threading.Thread | None = None

    def submit(self, target: Path, work: Callable[[], Path]) -> PendingDump:
        pending = PendingDump(target, work)
        with self._lock:
            self._queue.append(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=False)
                self._thread.start()
        return pending

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                pending = self._queue[0]
            pending.run()
            with self._lock:
                self._queue.popleft()

    @property
    def pending(self) -> list[PendingDump]:
        """Dumps not finished yet, oldest first."""
        with self._lock:
            return [p for p in self._queue if not p.done]

    def wait(self) -> None:
        """Wait until every dump submitted so far has ended (whatever its outcome)."""
        for pending in self.pending:
            pending._done.wait()


def _rename(source: Path, target: Path) -> bool:
    """Atomically move ``source`` to ``target``; False when that needs a copy (another file system)."""
    try:
        os.replace(source, target)
    except OSError:
        return False
    return True


class TraceDump:
    """How one recorder's traces are written.

    Args:
        config: the recorder's configuration.
        layout: the counter rows' columns.
        streamed: ``{dataset: (row shape, dtype)}`` of the streamed group (empty in ``stat`` mode).
        clock_kind: the phase clock (``"cuda_event"`` / ``"perf_counter"``), ``None`` without timing.
        compression: h5py filter keywords.
    """

    def __init__(
        self,
        config: RecorderConfig,
        layout: CounterLayout,
        streamed: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        clock_kind: str | None,
        compression: Mapping[str, object],
    ) -> None:
        self.config = config
        self.layout = layout
        self.streamed = dict(streamed)
        self.clock_kind = clock_kind
        self.compression = dict(compression)

    def header(self, run_id: str, rank: int, world_size: int, layouts: tuple[RankLayout, ...] | None = None) -> TraceHeader:
        """The trace header; ``layouts``: each rank row's layout (default: this rank's alone)."""
        own = (rank_identity(self.config),) if layouts is None else layouts
        return TraceHeader.of_config(self.config, run_id, rank, world_size, own)

    # ------------------------------------------------------------------ pieces
    def write_totals(self, writer: TraceWriter, rows: np.ndarray, num_passes: np.ndarray, num_tokens: np.ndarray,
                     phase_rows: np.ndarray | None = None, phase_counts: np.ndarray | None = None) -> None:
        """Write ``/stat`` from counter rows ``[R, L, C]`` (and, split by pass phase, ``[R, Q, L, C]`` with ``[R, 3, Q]`` counts)."""
        write_stat(writer, self.layout, self.config.physical_to_logical, rows, num_passes, num_tokens, phase_rows, phase_counts)  # type: ignore[arg-type]

    def write_timing(self, writer: TraceWriter, parts: TimingParts | None) -> None:
        """Root ``timing_*`` attributes, ``/stat`` timing aggregates ``[R, ...]`` and (gathered window) ``/timing`` rows."""
        attrs, datasets = self.timing_contents(parts)
        for key, value in attrs.items():
            writer.set_attr(key, value)
        for name, array in datasets.items():
            writer.write(name, array)

    def timing_contents(self, parts: TimingParts | None) -> tuple[dict[str, object], dict[str, np.ndarray]]:
        """What :meth:`write_timing` writes, as ``(root attributes, {dataset: array})`` (empty without timing)."""
        if parts is None:
            return {}, {}
        attrs = {Attr.TIMING_PHASES: json.dumps(list(PHASES)), Attr.TIMING_CLOCK: self.clock_kind, Attr.TIMING_HISTOGRAM_EDGES: HISTOGRAM_EDGES}
        datasets = {dataset(Data.STAT, name): np.stack([np.asarray(stats[name]) for stats, _ in parts]) for name in parts[0][0]}
        if parts[0][1] is not None:
            rows = {name: np.concatenate([r[name] for _, r in parts]) for name in parts[0][1]}  # type: ignore[index]
            rows["rank"] = np.concatenate([np.full(len(r["pass_id"]), i, dtype=np.int32) for i, (_, r) in enumerate(parts)])  # type: ignore[index]
            order = np.lexsort((rows["rank"], rows["pass_id"]))
            datasets.update({dataset(Data.TIMING, name): array[order] for name, array in rows.items()})
        return attrs, datasets

    # ------------------------------------------------------------------ dumps
    def stat_cut(self, counter: PassCounter, window: StatWindow, num_passes: int, ring: torch.Tensor) -> StatCut:
        """``stat`` mode's cut (recorder lock held): device copies of the totals, the window ring's
        copy on write into the host buffer ``ring [W, L, P]`` begun (nothing copied yet: the
        caller takes it a batch at a time, :meth:`StatWindow.copy_cut`), host copies of the
        window's metadata and of the passes and requests of each pass phase. Nothing is read
        back to the host here."""
        return StatCut(
            totals=counter.totals(), token_total=counter.token_total(), ring=window.cut(ring),
            tokens=window.tokens.clone(), order=window.order(), pass_id=window.pass_id.copy(), timestamp=window.timestamp.copy(),
            num_passes=num_passes, pass_phase_totals=counter.pass_phase_totals.clone(), pass_phase_tokens=counter.pass_phase_tokens.clone(),
            pass_phase_host=counter.pass_phase_host.copy(), window_pass_phase=window.pass_phase.copy(), window_requests=window.requests.copy(),
        )

    def stat_gather(self, cut: StatCut, ring: np.ndarray, rank: int, world: int, peers: int) -> StatRows:
        """The ``peers`` ranks' cuts on rank 0 as host arrays (collective when ``peers > 1``; the
        caller's thread, outside the recorder lock); ``ring [W, L, P]``: the cut's window ring,
        copied to the host (slot-indexed)."""
        device = cut.totals.device
        layouts = tuple(gather_objects(rank_identity(self.config), peers))  # every rank row's layout
        rows = gather(cut.totals, peers).cpu().numpy()
        phase_rows = gather(cut.pass_phase_totals, peers).cpu().numpy()
        host = torch.as_tensor(cut.pass_phase_host, dtype=torch.int64, device=device)
        phase_counts = gather(torch.stack([host[0], cut.pass_phase_tokens, host[1]]), peers).cpu().numpy()
        order, slots = cut.order, len(cut.pass_id)
        meta = np.full((slots, 5), -1.0)
        meta[: len(order)] = np.stack([cut.pass_id, cut.timestamp, cut.tokens.cpu().numpy(), cut.window_pass_phase, cut.window_requests], axis=1)[order]
        passes = torch.cat([torch.tensor([cut.num_passes], dtype=torch.int64, device=device), cut.token_total])
        if peers == 1:
            # The ring as it is (no reordered copy): the oldest slots first, then the wrapped ones.
            return StatRows(rows, passes.cpu().numpy()[None], meta[None], ring_pieces(ring, order), layouts, phase_rows, phase_counts)  # type: ignore[arg-type]
        ordered = torch.zeros(ring.shape, dtype=torch.int32, device=device)
        ordered[: len(order)] = torch.as_tensor(ring[order], device=device)
        return StatRows(rows, gather(passes, peers).cpu().numpy(), gather(torch.as_tensor(meta, dtype=torch.float64, device=device), peers).cpu().numpy(),
                        [gather(ordered, peers).cpu().numpy()], layouts, phase_rows, phase_counts)  # type: ignore[arg-type]

    def stat(self, target: Path, run_id: str, rank: int, world: int, peers: int, rows: StatRows, timing: TimingParts | None,
             session: RecordingSession | None) -> Path:
        """Write a ``stat`` dump of ``rows`` (``peers`` ranks' rows: one file with a rank axis when > 1,
        written by rank 0) to ``target`` (any thread); ``session``: the recording's open one, whose
        writer process writes a small dump."""
        header = self.header(run_id, rank=-1 if peers > 1 else rank, world_size=world, layouts=rows.layouts)
        attrs, datasets = self.timing_contents(timing)  # written in a child process: this process's GIL stays with the forward thread
        return write_stat_trace(target, header, self.layout, rows, attrs=attrs, datasets=datasets, compression=self.compression,
                                small_jobs=session.run_small_job if session is not None else None)

    def stream(self, target: Path, run_id: str, rank: int, world: int, session: RecordingSession, cut: Cut, timing: TimingParts | None) -> Path:
        """Join the closed segments up to ``cut`` (and those of an earlier dump that failed) into
        ``target`` (any thread; waits for the writer thread to reach the cut); one segment without
        timing is renamed, no segment gives an empty trace."""
        taken = session.take_segments(cut)
        if len(taken) == 1 and self.clock_kind is None and _rename(taken[0].path, target):
            written = target  # one closed segment is already a complete trace of these passes
        elif taken:  # joined in a child process: this process's GIL stays with the forward thread
            attrs, datasets = self.timing_contents(timing)
            written = join_segments([info.path for info in taken], target, attrs=attrs, datasets=datasets, compression=self.compression,
                                    small_jobs=session.run_small_job)
        else:
            written = self._empty_stream(target, run_id, rank, world, timing)
        session.consumed(taken, written)  # the segments' rows are now in a complete trace
        return written

    def _empty_stream(self, target: Path, run_id: str, rank: int, world: int, timing: TimingParts | None) -> Path:
        """A streaming dump with no passes since the previous one."""
        with TraceWriter(target, self.header(run_id, rank, world), compression=self.compression) as writer:
            zeros = np.zeros((1, self.config.num_layers, self.layout.width), dtype=np.int64)
            phases = len(PASS_PHASES)
            self.write_totals(writer, zeros, np.array([0]), np.array([0]), np.zeros((1, phases, *zeros.shape[1:]), np.int64),
                              np.zeros((1, len(PHASE_COUNTS), phases), np.int64))
            writer.write(Data.STAT_DROPPED_PASSES, np.zeros(1, dtype=np.int64))
            for name, (row_shape, dtype) in self.streamed.items():
                writer.ensure_empty(name, row_shape, dtype)
            self.write_timing(writer, timing)
            return writer.commit()

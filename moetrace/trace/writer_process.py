"""A recording's writer process: its segment files (or checkpoints) and its journal, outside the engine.

Every file a recording writes while it runs (segment appends and rotations, ``stat`` checkpoints,
the journal's notes and compactions, and the small dumps: :meth:`WriterProcess.run_job`) is written
by one long-lived child process per recording, started with ``sys.executable``
(:func:`~moetrace.trace.child.start_child`: never a fork, the engine may hold CUDA). The engine's
interpreter keeps no file open and holds its GIL for none of that work: its writer thread (:class:`~moetrace.trace.stream.BackgroundTraceWriter`) builds each
hand-off's host arrays and sends them down a pipe (:func:`~moetrace.trace.child.send`: the arrays'
memory as it is, the GIL released while the write blocks), then waits for the child's answer.
Arrays in the recording's shared host buffers (:mod:`moetrace.trace.shared_memory`: a stream's
rows, a checkpoint's window, on a CPU device) cross as references, nothing copied, once a probe at
start showed that the child can map this process's buffers; a call is synchronous, so the child is
done with them before the engine reuses their memory.

Bounded: one call is in flight at a time (a lock), so what the child holds is one hand-off, and
the pipe's back-pressure reaches the writer thread's bounded queue, where the drop policy
(``on_overflow``) applies as before.

The engine's side holds :class:`RemoteJournal` and :class:`RemoteSink`, which forward each call to
the child's real :class:`~moetrace.trace.journal.Journal` and sink
(:class:`~moetrace.trace.segments.SegmentWriter` or :class:`~moetrace.trace.segments.CheckpointWriter`).

Lifetimes:

* the child dies with its parent: it watches its stdin (EOF when the parent is gone) and its parent
  pid (a forked grandchild may hold the pipe open); it then closes its open segment, so the rows it
  received survive as a complete segment for ``moetrace recover``, and exits;
* the parent survives the child's death: every call then raises :class:`~moetrace.trace.schema.TraceWriteError`
  naming the process and its exit status; the recording stops with one warning (the recorder), the
  closed segments and the journal stay for ``moetrace recover``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import select
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from . import offload
from .child import lower_priority, receive, send, start_child
from .journal import Journal
from .schema import TraceError, TraceHeader, TraceWriteError
from .segments import CheckpointWriter, SegmentInfo, SegmentWriter
from .shared_memory import SharedBuffer, SharedMaps, sharing_available
from .stat import CounterLayout

__all__ = ["RemoteJournal", "RemoteSink", "WriterProcess", "WriterSpec"]

#: How often (seconds) an idle child checks that its parent still runs.
PARENT_CHECK_S = 1.0


@dataclasses.dataclass(frozen=True)
class WriterSpec:
    """What the writer process builds: the run's journal and its sink.

    Attributes:
        journal: the journal's path.
        checkpoint: ``stat`` mode: the checkpoint's path (then ``streamed`` is ignored); ``None``: segments.
        directory: where segments go.
        header: every file's trace header.
        streamed: ``{dataset: (row shape, dtype)}`` of the streamed group (segments).
        layout: the counter rows' columns.
        segment_bytes: close a segment once its raw rows reach this size.
        compression: h5py filter keywords.
    """

    journal: Path
    checkpoint: Path | None
    directory: Path
    header: TraceHeader
    streamed: Mapping[str, tuple[tuple[int, ...], np.dtype]]
    layout: CounterLayout
    segment_bytes: int
    compression: Mapping[str, object]

    def build(self) -> tuple[Journal, SegmentWriter | CheckpointWriter]:
        """The journal and the sink (in the process that writes the files)."""
        if isinstance(self.compression.get("compression"), int):  # a plugin filter (zstd, blosc2): registered by importing hdf5plugin
            import hdf5plugin  # noqa: F401
        journal = Journal(self.journal)
        if self.checkpoint is not None:
            return journal, CheckpointWriter(self.checkpoint, self.header, journal, self.layout, self.compression)
        return journal, SegmentWriter(self.directory, self.header, self.streamed, self.layout, self.header.physical_to_logical,
                                      self.segment_bytes, journal, self.compression)


class WriterProcess:
    """The child that writes one recording's files (see the module docstring).

    Raises:
        OSError: no Python could be started (an embedded interpreter): the caller writes in-process.
        TraceWriteError: the child could not build the journal or the sink.
    """

    def __init__(self, spec: WriterSpec) -> None:
        self._child = start_child(__name__, capture_stderr=False)
        self._lock = threading.Lock()
        self._dead: str | None = None
        self.pid = self._child.pid
        self._share = False
        self._exchange(("spec", spec, os.getpid()))
        self._share = self._child_maps_shared_buffers()

    def _child_maps_shared_buffers(self) -> bool:
        """Whether the child reads this process's shared buffers: a probe buffer's bytes, read
        back there (no shared memory here, or ``/proc/<pid>/fd`` closed to the child: arrays go as bytes)."""
        if not sharing_available():
            return False
        marker = os.urandom(16)
        try:
            probe = SharedBuffer(len(marker))
        except OSError:
            return False
        probe.map[:] = marker
        try:
            return bool(self.call("shared", "probe", probe.key, len(marker)) == marker)
        except OSError:
            return False

    @property
    def alive(self) -> bool:
        """Whether the child still answers (it neither died nor failed a pipe)."""
        return self._dead is None and self._child.poll() is None

    def call(self, target: str, name: str, *args: object, **kwargs: object) -> Any:
        """``target.name(*args, **kwargs)`` in the child (``target``: ``"journal"``, ``"sink"`` or ``"offload"``); its result or its exception."""
        return self._exchange((target, name, args, kwargs))

    def run_job(self, job: Mapping[str, object]) -> Path:
        """A small dump's job (:func:`moetrace.trace.offload.run_job`) in the child, between two calls
        of the writer thread (milliseconds: jobs over ``CHILD_MIN_BYTES`` get a child of their own)."""
        return Path(self.call("offload", "run_job", job))

    def attribute(self, target: str, name: str) -> Any:
        """``target.name`` in the child."""
        return self._exchange((target, name, None, None))

    def _exchange(self, message: object) -> Any:
        with self._lock:
            if self._dead is not None:
                raise TraceWriteError(self._dead)
            assert self._child.stdin is not None and self._child.stdout is not None
            try:
                send(self._child.stdin, message, share=self._share)
                reply: dict[str, Any] = receive(self._child.stdout)  # type: ignore[assignment]
            except (OSError, EOFError, pickle.UnpicklingError) as exc:
                status = self._child.wait()
                self._dead = (f"the recording's writer process (pid {self.pid}) died (exit status {status}: {exc}); the passes since its last "
                              "closed segment or checkpoint are lost, the closed ones stay: run `moetrace recover` on the output directory")
                raise TraceWriteError(self._dead) from exc
        if "error" in reply:
            raise reply["error"]
        return reply.get("ok")

    def close(self) -> None:
        """Let the child finish (stdin closed: it closes its open segment, if any) and wait for it."""
        with self._lock:
            if self._child.stdin is not None and not self._child.stdin.closed:
                try:
                    self._child.stdin.close()
                except OSError:
                    pass  # a dead child's pipe
            self._child.wait()
            self._dead = self._dead or f"the recording's writer process (pid {self.pid}) was closed"


class RemoteJournal:
    """The engine's side of the child's journal: :meth:`note` and :meth:`close` run there."""

    def __init__(self, process: WriterProcess, path: Path) -> None:
        self._process = process
        self.path = Path(path)

    def note(self, event: str, **fields: object) -> None:
        self._process.call("journal", "note", event, **fields)

    def close(self) -> None:
        self._process.call("journal", "close")


class RemoteSink:
    """The engine's side of the child's sink (segments or a checkpoint): each call runs there.

    ``path``: the checkpoint's path (``stat`` mode), ``None`` for segments.
    """

    def __init__(self, process: WriterProcess, path: Path | None) -> None:
        self._process = process
        self.path = path

    def write(self, part: object) -> None:
        self._process.call("sink", "write", part)

    def rotate(self) -> None:
        self._process.call("sink", "rotate")

    @property
    def next_index(self) -> int:
        return int(self._process.attribute("sink", "next_index"))

    def take_completed(self, before: int | None = None) -> list[SegmentInfo]:
        return list(self._process.call("sink", "take_completed", before))

    def abort(self) -> None:
        self._process.call("sink", "abort")


def _next_message(stream: Any, parent: int, maps: SharedMaps) -> object | None:
    """The parent's next message (arrays in its shared buffers mapped through ``maps``); ``None``
    once the pipe ends or the parent is gone."""
    while True:
        ready, _, _ = select.select([stream], [], [], PARENT_CHECK_S)
        if ready:
            try:
                return receive(stream, maps)
            except EOFError:
                return None
        if os.getppid() != parent:
            return None


def _answer(objects: Mapping[str, object], message: tuple[str, str, tuple[object, ...] | None, dict[str, object] | None]) -> dict[str, object]:
    target, name, args, kwargs = message
    try:
        member = getattr(objects[target], name)
        return {"ok": member if args is None else member(*args, **(kwargs or {}))}
    except BaseException as exc:  # handed to the parent, which raises it
        try:
            pickle.loads(pickle.dumps(exc))  # the parent must be able to rebuild it
            return {"error": exc}
        except Exception:
            return {"error": TraceError(f"{type(exc).__name__}: {exc}")}


def main() -> None:
    """The child: build the journal and sink, answer calls until the parent ends, close the open segment."""
    stdin, stdout = sys.stdin.buffer.raw, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into an answer
    lower_priority()
    _, spec, parent = receive(stdin)  # type: ignore[misc]
    try:
        journal, sink = spec.build()
    except BaseException as exc:
        send(stdout, {"error": TraceWriteError(f"the recording's writer process could not open its files: {exc}")})
        return
    send(stdout, {"ok": None})
    maps = SharedMaps()
    objects = {"journal": journal, "sink": sink, "offload": offload, "shared": maps}
    while (message := _next_message(stdin, parent, maps)) is not None:
        send(stdout, _answer(objects, message))  # type: ignore[arg-type]
    if isinstance(sink, SegmentWriter):
        sink.rotate()  # the parent is gone (or done): what it handed over becomes a complete segment
    journal.close()

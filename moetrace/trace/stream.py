"""Background writer that streams staged rows into a sink (segments, checkpoints).

The forward thread hands over host buffers filled by an asynchronous
device-to-host copy together with the CUDA event that marks the copy's end;
the writer thread waits on that event, builds the rows, gives them to its sink
(a :class:`~moetrace.trace.segments.SegmentWriter` or a checkpoint writer),
then gives the buffer back to its :class:`HostBufferPool`. Memory is bounded
by the pool: when the writer falls behind, :meth:`HostBufferPool.acquire`
blocks the forward thread (``on_overflow="block"``) or reports that no buffer
is free (``"drop"``) rather than growing.

Everything slow (HDF5 appends, compression, closing, fsync and renaming a
segment) happens on the writer thread; the forward thread only enqueues.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["BackgroundTraceWriter", "HostBufferPool", "StreamJob", "StreamSink"]


class HostBufferPool:
    """A fixed set of (pinned, when on CUDA) host buffers of one shape and dtype."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, count: int, pin: bool) -> None:
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(count):
            self._free.put(torch.empty(shape, dtype=dtype, pin_memory=pin))

    def acquire(self, block: bool = True) -> torch.Tensor | None:
        """A free buffer; blocks while all are in flight (or returns ``None`` with ``block=False``)."""
        try:
            return self._free.get(block=block)
        except queue.Empty:
            return None

    def release(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)


class StreamSink(Protocol):
    """Where the writer thread puts what jobs build."""

    def write(self, part: Any) -> None: ...

    def rotate(self) -> None: ...


@dataclass
class StreamJob:
    """Work for the writer thread.

    ``build()`` runs once ``event`` completed and returns what the sink's
    ``write`` takes (or ``None``); ``done()`` runs afterwards in every case
    (it releases the host buffer). With ``rotate`` the sink closes its open
    segment after the write.
    """

    event: torch.cuda.Event | None
    build: Callable[[], Any]
    done: Callable[[], None]
    rotate: bool = False


def _nothing() -> None:
    return None


class BackgroundTraceWriter:
    """Runs jobs in submission order on one daemon thread, feeding ``sink``."""

    def __init__(self, sink: StreamSink, max_pending: int = 4, name: str = "moetrace-trace-writer") -> None:
        self.sink = sink
        self._jobs: queue.Queue[StreamJob | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """The first write error, if any (later jobs are skipped, their buffers released)."""
        return self._error

    def submit(self, job: StreamJob) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if self._error is None:
                    if job.event is not None:
                        job.event.synchronize()
                    self.sink.write(job.build())
                    if job.rotate:
                        self.sink.rotate()
            except BaseException as exc:
                self._error = exc
            finally:
                job.done()

    def rotate(self) -> None:
        """Ask the sink to close its open segment after the jobs already submitted."""
        self._jobs.put(StreamJob(event=None, build=_nothing, done=_nothing, rotate=True))

    def drain(self) -> None:
        """Wait until every submitted job is written (the thread keeps running)."""
        barrier = threading.Event()
        self._jobs.put(StreamJob(event=None, build=_nothing, done=barrier.set))
        barrier.wait()

    def close(self) -> None:
        """Drain and stop the thread; the sink stays as it is."""
        self._jobs.put(None)
        self._thread.join()

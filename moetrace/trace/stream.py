"""Background writer that streams staged rows into a :class:`TraceWriter`.

The forward thread hands over host buffers filled by an asynchronous
device-to-host copy together with the CUDA event that marks the copy's end;
the writer thread waits on that event, appends the rows, then gives the buffer
back to its :class:`HostBufferPool`. Memory is bounded by the pool: when the
writer falls behind, :meth:`HostBufferPool.acquire` blocks the forward thread
(back-pressure) rather than dropping data or growing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .writer import TraceWriter

__all__ = ["BackgroundTraceWriter", "HostBufferPool", "StreamJob"]


class HostBufferPool:
    """A fixed set of (pinned, when on CUDA) host buffers of one shape and dtype."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, count: int, pin: bool) -> None:
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(count):
            self._free.put(torch.empty(shape, dtype=dtype, pin_memory=pin))

    def acquire(self) -> torch.Tensor:
        """A free buffer; blocks while all are in flight."""
        return self._free.get()

    def release(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)


@dataclass
class StreamJob:
    """Rows to append: ``arrays(host)`` builds ``{dataset: rows}`` once ``event`` completed."""

    event: torch.cuda.Event | None
    build: Callable[[], dict[str, np.ndarray]]
    done: Callable[[], None]


class BackgroundTraceWriter:
    """Owns a :class:`TraceWriter` and appends jobs in submission order on a thread."""

    def __init__(self, writer: TraceWriter, max_pending: int = 4) -> None:
        self.writer = writer
        self._jobs: queue.Queue[StreamJob | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self.rows_written: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="moetrace-trace-writer", daemon=True)
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
                    for name, rows in job.build().items():
                        self.writer.append(name, rows)
                        self.rows_written[name] = self.rows_written.get(name, 0) + len(rows)
            except BaseException as exc:
                self._error = exc
            finally:
                job.done()

    def drain(self) -> None:
        """Wait until every submitted job is written (the thread keeps running)."""
        barrier = threading.Event()
        self._jobs.put(StreamJob(event=None, build=dict, done=barrier.set))
        barrier.wait()

    def close(self) -> None:
        """Drain and stop the thread; the :class:`TraceWriter` stays open."""
        self._jobs.put(None)
        self._thread.join()

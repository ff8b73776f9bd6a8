"""Background writer that streams staged rows into a sink (segments, checkpoints).

The forward thread hands over host buffers filled by an asynchronous
device-to-host copy together with the CUDA event that marks the copy's end;
the writer thread waits until that copy is known to be done, builds the rows,
gives them to its sink
(a :class:`~moetrace.trace.segments.SegmentWriter` or a checkpoint writer),
then gives the buffer back to its :class:`HostBufferPool`. Memory is bounded
by the pool: when the writer falls behind, :meth:`HostBufferPool.acquire`
blocks the forward thread (``on_overflow="block"``) or reports that no buffer
is free (``"drop"``) rather than growing.

Everything slow (HDF5 appends, compression, closing, fsync and renaming a
segment) happens behind the writer thread, in a recording's writer process
(:mod:`moetrace.trace.writer_process`: the sink the thread feeds is that
process's proxy); the forward thread only enqueues.

The writer thread makes no CUDA call. Under the default (global) capture mode
a CUDA event query or synchronize from any thread while another captures a
graph invalidates that capture, and engines capture their graphs at start-up,
often with a recording or an exporter already running. So the thread that
owns the events decides when a copy is done: :meth:`BackgroundTraceWriter.poll`
(the forward thread, at pass end, with ``event.query()``, which never blocks)
or :meth:`BackgroundTraceWriter.settle` (a lifecycle call, a dump, or a forward
thread about to wait for a buffer anyway, with ``event.synchronize()``).

Only :class:`HostBufferPool` allocates tensors; it imports torch when a recording builds one,
so a routing recorder or a tool that streams host rows loads no torch.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .shared_memory import SharedBuffer

if TYPE_CHECKING:
    import torch

__all__ = ["BackgroundTraceWriter", "HostBufferPool", "StreamJob", "StreamSink"]


class HostBufferPool:
    """A fixed set of host buffers of one shape and dtype: pinned (``pin``, for CUDA copies), or
    else in shared memory (:class:`~moetrace.trace.shared_memory.SharedBuffer`, where there is
    some), so that the writer process maps them and a hand-off copies no rows into its pipe.

    The buffers are zeroed when made, so that every page is in memory from then on (a recording's
    start) rather than faulted in by the first pass that fills or copies into it: at DeepSeek-V3
    size a checkpoint's window is 16,000 pages, and faulting them in held that pass end up to 20 ms
    on a CPU device (``benchmarks/pass_breakdown.py``).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, count: int, pin: bool) -> None:
        import torch  # only a recording allocates buffers: the writer thread and its jobs need no torch

        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._shared: list[SharedBuffer] = []  # kept while the pool lives: the writer process maps them by key
        for _ in range(count):
            self._free.put(torch.zeros(shape, dtype=dtype, pin_memory=True) if pin else self._shared_zeros(shape, dtype))

    def _shared_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed buffer in a new shared buffer; in private memory where none can be made."""
        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        try:
            shared = SharedBuffer(nbytes)
        except OSError:  # no memfd on this platform, or none left
            return torch.zeros(shape, dtype=dtype)
        self._shared.append(shared)
        return torch.frombuffer(shared.map, dtype=dtype).view(shape).zero_()

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


def _nothing() -> None:
    return None


@dataclass
class StreamJob:
    """Work for the writer thread.

    ``build()`` runs once ``event`` completed (``ready`` set) and returns what
    the sink's ``write`` takes (or ``None``; default: nothing to write, a
    rotation or a barrier); ``done()`` runs afterwards in every case (it
    releases the host buffer; default: none to release). With ``rotate`` the
    sink closes its open segment after the write.
    """

    event: torch.cuda.Event | None
    build: Callable[[], Any] = _nothing
    done: Callable[[], None] = _nothing
    rotate: bool = False
    ready: threading.Event = field(default_factory=threading.Event)


class BackgroundTraceWriter:
    """Runs jobs in submission order on one daemon thread, feeding ``sink``."""

    def __init__(self, sink: StreamSink, max_pending: int = 4, name: str = "moetrace-trace-writer") -> None:
        self.sink = sink
        self._jobs: queue.Queue[StreamJob | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._in_flight: deque[StreamJob] = deque()  # jobs whose copy is not known done, oldest first
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """The first write error, if any (later jobs are skipped, their buffers released)."""
        return self._error

    def submit(self, job: StreamJob) -> None:
        """Queue ``job`` (jobs are written in this order). If the queue is full, settle the copies
        in flight first (the writer thread waits for them), then wait for room."""
        if job.event is None:
            job.ready.set()
        else:
            with self._lock:
                self._in_flight.append(job)
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self.settle()
            self._jobs.put(job)

    def poll(self) -> None:
        """Mark done, oldest first, the jobs whose copy has finished (``event.query()``, never blocks).

        Call it from the thread that submits (the forward thread, at pass end).
        """
        with self._lock:
            while self._in_flight and self._in_flight[0].event.query():  # type: ignore[union-attr]
                self._in_flight.popleft().ready.set()

    def settle(self) -> None:
        """Wait (``event.synchronize()``, on the calling thread) for every copy in flight and mark it done.

        Each wait happens outside the lock that :meth:`poll` takes, so a dump settling its
        copies on another thread never holds up the forward thread's pass end.
        """
        while True:
            with self._lock:
                if not self._in_flight:
                    return
                job = self._in_flight.popleft()
            job.event.synchronize()  # type: ignore[union-attr]
            job.ready.set()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job.ready.wait()
                if self._error is None:
                    self.sink.write(job.build())
                    if job.rotate:
                        self.sink.rotate()
            except BaseException as exc:
                self._error = exc
            finally:
                job.done()

    def rotate(self) -> None:
        """Ask the sink to close its open segment after the jobs already submitted."""
        self.submit(StreamJob(event=None, rotate=True))

    def drain(self) -> None:
        """Wait until every submitted job is written (the thread keeps running)."""
        barrier = threading.Event()
        self.settle()
        self.submit(StreamJob(event=None, done=barrier.set))
        barrier.wait()

    def close(self) -> None:
        """Drain and stop the thread; the sink stays as it is."""
        self.settle()
        self._jobs.put(None)
        self._thread.join()

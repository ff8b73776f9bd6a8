"""The streaming modes' sinks: ``per_pass``'s :class:`PassStream` and ``per_token``'s :class:`TokenStream`.

Both stage rows and hand them to the segment writer through their shared base
(:class:`RowStream`): a host buffer of a fixed pool and a
:class:`~moetrace.trace.stream.StreamJob`, with the chunk's totals by pass phase and the
``on_overflow`` policy. On CUDA the rows are staged on the device and the hand-off is an
asynchronous copy into a free pinned buffer and a CUDA event. On a CPU device the staging buffer
is a pool buffer itself: the hand-off gives it to the writer and stages on in a free one (no copy
on the forward thread, which a 17-61 MB staging buffer at DeepSeek-V3 size made 10-45 ms on this CPU),
and the pool's buffers are shared memory that the writer process maps (no copy into its pipe either:
:mod:`moetrace.trace.shared_memory`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..batch import PassBatch
from ..config import RecorderConfig
from ..pass_phase import PASS_PHASES, phase_counts
from ..trace.schema import Data
from ..trace.segments import StreamRows
from ..trace.stat import CounterLayout
from ..trace.stream import HostBufferPool, StreamJob
from ..trace.writer import chunk_rows, token_id_dtype
from .pass_counter import PassCounter
from .sink import ModeSink, Submit, copy_event

__all__ = ["PassStream", "RowStream", "TokenStream"]


def _submit_empty(submit: Submit, overflow: _Overflow | None, rotate: bool) -> None:
    """Nothing staged: still pass on a rotation request and the passes dropped since the last hand-off."""
    dropped = overflow.take_pending() if overflow is not None else 0
    if not (rotate or dropped):
        return
    part = StreamRows(rows={}, totals=None, passes=0, tokens=0, first_pass=-1, last_pass=-1, dropped_passes=dropped) if dropped else None
    submit(StreamJob(event=None, build=lambda: part, rotate=rotate))


def _no_copies() -> None:
    """A hand-off that copied nothing besides its rows has nothing more to give back."""


class _ChunkTotals:
    """Counter rows ``[Q, L, C]`` (int64) of the passes staged since the last hand-off, by pass phase.

    Each hand-off carries them so that a segment's ``/stat`` covers exactly the
    passes whose rows it holds (their sum over ``Q``, and each phase's);
    ``take`` copies them asynchronously into one of two host buffers and zeroes
    the device copy.
    """

    def __init__(self, config: RecorderConfig, layout: CounterLayout) -> None:
        shape = (len(PASS_PHASES), config.num_layers, layout.width)
        self.acc = torch.zeros(shape, dtype=torch.int64, device=config.device)
        self.pool = HostBufferPool(shape, torch.int64, count=2, pin=config.device.type == "cuda")

    def add(self, current: torch.Tensor, phase: int) -> None:
        self.acc[phase].add_(current)

    def take(self) -> tuple[torch.Tensor, Callable[[], None]]:
        """``(host buffer, release)``; record the copy's event after calling this."""
        host = self.pool.acquire(block=False)  # never waits: released before its rows buffer
        assert host is not None
        host.copy_(self.acc, non_blocking=True)
        self.acc.zero_()
        return host, lambda: self.pool.release(host)

    def reset(self) -> None:
        self.acc.zero_()


class _Overflow:
    """``on_overflow`` bookkeeping shared by the streams: whole hand-offs dropped when the writer is behind.

    ``settle`` hands the writer every copy still in flight (it waits for their
    events, on the calling thread); it runs before blocking for a buffer, since
    the writer thread never waits on CUDA events itself.
    """

    def __init__(self, config: RecorderConfig, settle: Callable[[], None]) -> None:
        self.settle = settle
        self.drop = config.on_overflow == "drop"
        self.dropped_passes = 0  # since start_record
        self.pending = 0  # dropped since the last hand-off: written with the next one
        self.dropped_ranges: list[tuple[int, int]] = []  # (first, last) pass ids of every drop

    def acquire(self, pool: HostBufferPool, wait: bool) -> torch.Tensor | None:
        """A free host buffer: waits for one (``block``, or ``wait``) or returns ``None`` at once (``drop``)."""
        host = pool.acquire(block=False)
        if host is None and (wait or not self.drop):
            self.settle()
            host = pool.acquire(block=True)
        return host

    def dropped(self, passes: int, first: int, last: int) -> None:
        self.dropped_passes += passes
        self.pending += passes
        self.dropped_ranges.append((first, last))

    def take_pending(self) -> int:
        pending, self.pending = self.pending, 0
        return pending

    def reset(self) -> None:
        self.dropped_passes = self.pending = 0
        self.dropped_ranges = []


def stages_in_host_buffers(device: torch.device) -> bool:
    """Whether a stream on ``device`` stages its rows in a host buffer of its pool and hands that
    buffer itself to the writer (a CPU device, whose memory is host memory) rather than staging
    on the device and copying into a free host buffer (CUDA)."""
    return device.type == "cpu"


class RowStream(ModeSink):
    """The hand-off the streaming sinks share: their staged rows (``staging``, the first
    ``filled`` rows of a ``shape`` buffer) go to the segment writer in a host buffer of a fixed
    pool, with the chunk's totals by pass phase and the passes dropped since the last hand-off;
    ``on_overflow="drop"`` drops the whole hand-off when the writer is behind. Subclasses say what
    is staged.

    Two buffers can be with the writer at once. On CUDA ``staging`` lives on the device and a
    hand-off copies it asynchronously into a free host buffer (a CUDA event says when it is
    there). Where :func:`stages_in_host_buffers`, ``staging`` is one of three pool buffers and a
    hand-off swaps it for a free one: the same memory, and no copy on the forward thread."""

    streamed = True

    def __init__(self, config: RecorderConfig, layout: CounterLayout, submit: Submit, settle: Callable[[], None], shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.device = config.device
        self.swaps = stages_in_host_buffers(config.device)
        self.pool = HostBufferPool(shape, dtype, count=3 if self.swaps else 2, pin=config.device.type == "cuda")
        staging = self.pool.acquire(block=False) if self.swaps else torch.empty(shape, dtype=dtype, device=config.device)
        assert staging is not None  # a new pool has every buffer free
        self.staging = staging
        self.filled = 0  # rows staged since the last hand-off
        self.totals = _ChunkTotals(config, layout)
        self.overflow = _Overflow(config, settle)
        self.submit = submit

    @property
    def dropped_passes(self) -> int:
        return self.overflow.dropped_passes

    def flush(self, rotate: bool = False, wait: bool = False) -> None:
        """Hand the staged passes to the writer; ``rotate`` closes the segment after them; ``wait``
        waits for a free buffer even with ``on_overflow="drop"``."""
        passes = self._staged_passes()
        if passes == 0:
            _submit_empty(self.submit, self.overflow, rotate)
            return
        free = self.overflow.acquire(self.pool, wait)
        if free is None:  # on_overflow="drop": the writer is behind, these whole passes are dropped
            self.overflow.dropped(passes, *self._pass_span())
            self.totals.reset()
            self._forget()
            _submit_empty(self.submit, None, rotate)
            return
        dropped = self.overflow.take_pending()
        host = self._rows_into(free)
        rows_of, release_copies = self._copy_out(host)
        totals, release_totals = self.totals.take()
        event = copy_event(self.device)
        self._forget()

        def done() -> None:
            release_totals()
            release_copies()
            self.pool.release(host)

        self.submit(StreamJob(event=event, build=lambda: rows_of(totals.numpy(), dropped), done=done, rotate=rotate))

    def reset(self) -> None:
        self._forget()
        self.totals.reset()
        self.overflow.reset()

    def _rows_into(self, free: torch.Tensor) -> torch.Tensor:
        """The host buffer that holds the staged rows for the writer, given a ``free`` one: the
        staging buffer itself, ``free`` becoming the next (:func:`stages_in_host_buffers`), or
        ``free`` with an asynchronous copy of the rows begun (record the copy's event after it)."""
        if self.swaps:
            rows, self.staging = self.staging, free
            return rows
        free[: self.filled].copy_(self.staging[: self.filled], non_blocking=True)
        return free

    def _staged_passes(self) -> int:
        """Passes staged since the last hand-off."""
        raise NotImplementedError

    def _pass_span(self) -> tuple[int, int]:
        """The first and last staged pass ids."""
        raise NotImplementedError

    def _copy_out(self, host: torch.Tensor) -> tuple[Callable[[np.ndarray, int], StreamRows], Callable[[], None]]:
        """Take copies of the staged rows' metadata, the rows being in (or on their way to)
        ``host``; returns what builds the hand-off's rows on the writer thread from the chunk's
        totals by pass phase ``[Q, L, C]`` and the passes dropped before it, and what gives back
        the host buffers it copied into besides ``host`` (called before ``host`` is released)."""
        raise NotImplementedError

    def _forget(self) -> None:
        """Start the next hand-off empty."""
        raise NotImplementedError


class PassStream(RowStream):
    """``per_pass`` mode: stage ``S`` passes' rows, then hand them to the writer."""

    def __init__(self, config: RecorderConfig, layout: CounterLayout, submit: Submit, settle: Callable[[], None]) -> None:
        s = config.stream_chunk_passes
        shape = (s, config.num_layers, layout.width)
        super().__init__(config, layout, submit, settle, shape, torch.int32)
        self.layout = layout
        self.meta = np.zeros((s, 4), dtype=np.float64)  # pass_id, timestamp, pass phase, requests (tokens are in the rows)
        # Hand-offs of a multiple of the counts' chunk rows keep segments on the chunk grid, so a dump
        # joins them by copying chunks (when the full hand-off is such a multiple itself).
        align = chunk_rows((config.num_layers, config.num_physical_experts), np.int32)
        self.align = align if s % align == 0 else 1

    def at_boundary(self) -> bool:
        return self.filled % self.align == 0

    def end_pass(self, counter: PassCounter, pass_id: int, timestamp: float, phase: int, requests: int, batch: PassBatch | None) -> None:
        """Stage the pass's counter rows and metadata; a full staging buffer is handed over."""
        current = counter.current
        self.staging[self.filled].copy_(current)
        self.totals.add(current, phase)
        self.meta[self.filled] = (pass_id, timestamp, phase, requests)
        self.filled += 1
        if self.filled == len(self.meta):
            self.flush()

    def _staged_passes(self) -> int:
        return self.filled

    def _pass_span(self) -> tuple[int, int]:
        return int(self.meta[0, 0]), int(self.meta[self.filled - 1, 0])

    def _copy_out(self, host: torch.Tensor) -> tuple[Callable[[np.ndarray, int], StreamRows], Callable[[], None]]:
        n = self.filled
        meta = self.meta[:n].copy()
        layout = self.layout

        def build(by_phase: np.ndarray, dropped: int) -> StreamRows:
            rows = host[:n].numpy()
            tokens = rows[:, :, layout.tokens].max(axis=1).astype(np.int64)
            phase, requests = meta[:, 2].astype(np.int8), meta[:, 3].astype(np.int64)
            return StreamRows(
                rows={
                    Data.PASSES_PASS_ID: meta[:, 0].astype(np.int64),
                    Data.PASSES_TIMESTAMP: meta[:, 1],
                    Data.PASSES_NUM_TOKENS: tokens,
                    Data.PASSES_PHYSICAL_COUNT: rows[:, :, layout.experts].copy(),
                    Data.PASSES_INVALID_IDS: layout.invalid(rows),
                    Data.PASSES_SEND_COUNT: rows[:, :, layout.send].copy(),
                    Data.PASSES_RECV_COUNT: rows[:, :, layout.recv].copy(),
                    Data.PASSES_PASS_PHASE: phase,
                    Data.PASSES_NUM_REQUESTS: requests.astype(np.int32),
                },
                totals=by_phase.sum(axis=0),
                phase_totals=by_phase.copy(),
                phase_counts=phase_counts(phase, tokens, requests),
                passes=n,
                tokens=int(tokens.sum()),
                first_pass=int(meta[0, 0]),
                last_pass=int(meta[n - 1, 0]),
                dropped_passes=dropped,
            )

        return build, _no_copies

    def _forget(self) -> None:
        self.filled = 0


class _TokenColumns:
    """Each staged token's ``/tokens`` columns besides its ids, ``[chunk]`` each, by dataset name:
    its pass id (int64), position in its pass, request index and position in that request (int32),
    pass phase (int8).

    They are numpy views (:attr:`staged`) of one byte buffer of a pool of three, in shared memory
    where there is some (:class:`~moetrace.trace.stream.HostBufferPool`): one being staged into,
    up to two with the writer. A hand-off gives the staged set to the writer as it is and stages
    on in a free one, so it copies nothing and touches no fresh memory on the forward thread (its
    copies of them were 1.3 MB and up to 320 page faults in a hand-off pass at DeepSeek-V3 size,
    ``benchmarks/pass_breakdown.py``), and the writer process maps them rather than reading their
    bytes down its pipe.
    """

    LAYOUT = ((Data.TOKENS_PASS_ID, np.int64), (Data.TOKENS_POSITION, np.int32), (Data.TOKENS_REQUEST, np.int32),
              (Data.TOKENS_REQUEST_POSITION, np.int32), (Data.TOKENS_PASS_PHASE, np.int8))  # widest first: every view aligned

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        width = sum(np.dtype(dtype).itemsize for _, dtype in self.LAYOUT)
        # Three: a set is released before its rows buffer, and a hand-off holds a free rows buffer,
        # so at most one other set is with the writer then (as the token rows' pool of two).
        self.pool = HostBufferPool((chunk * width,), torch.uint8, count=3, pin=False)
        buffers = [self.pool.acquire(block=False) for _ in range(3)]
        self._views = {id(buffer): self._carve(buffer) for buffer in buffers}  # made once: no tensor call at a hand-off
        self.buffer = buffers.pop()
        for buffer in buffers:
            self.pool.release(buffer)
        self.staged = self._views[id(self.buffer)]

    def _carve(self, buffer: torch.Tensor | None) -> dict[str, np.ndarray]:
        """``buffer``'s columns, views of its bytes in :attr:`LAYOUT`'s order."""
        assert buffer is not None  # a new pool has every buffer free
        raw, views, offset = buffer.numpy(), {}, 0
        for name, dtype in self.LAYOUT:
            size = self.chunk * np.dtype(dtype).itemsize
            views[name] = raw[offset : offset + size].view(dtype)
            offset += size
        return views

    def hand_off(self) -> tuple[dict[str, np.ndarray], Callable[[], None]]:
        """The staged columns, for the writer, and what gives them back to the pool once it is done
        with them; staging goes on in a free set."""
        buffer, columns = self.buffer, self.staged
        free = self.pool.acquire(block=False)  # never waits: see __init__
        assert free is not None
        self.buffer, self.staged = free, self._views[id(free)]
        return columns, lambda: self.pool.release(buffer)


class TokenStream(RowStream):
    """``per_token`` mode: every token's ``[L, k]`` ids, staged per pass then per chunk.

    At pass end the first ``counter.pass_rows`` rows of each layer of the pass counter's stage
    (:class:`~moetrace.recording.pass_counter.PassCounter`: every id the hooks gave, as its counter
    column, layer by layer in call order, so a token's position in the pass is its row) move
    into ``staging [chunk_tokens, L, k]`` in one ``gather`` through ``lut`` (counter column ->
    stored id: the expert id, -1 for padding, -2 for an invalid id), which also turns
    ``[L, T, k]`` into ``[T, L, k]``. A layer (or a replayed CUDA graph) that wrote fewer rows
    reads -1 there. The writer keeps only the rows that are not all -1 (padding rows of a
    static batch), with their position in the pass. Which rows those are is staged beside them,
    ``token_rows [chunk_tokens]`` (bool), at pass end from the pass counter's token count
    (:meth:`~moetrace.recording.pass_counter.PassCounter.rows_with_ids`: one kernel over
    ``[L, rows]``), and copied into a host buffer of its own at the hand-off; the writer thread
    reads it rather than scanning the chunk's ids (58 MiB at DeepSeek-V3 size, 12-22 ms of numpy
    on this CPU, on a thread of the engine's process). Ids are stored in the smallest signed
    dtype for ``P`` (:func:`~moetrace.trace.writer.token_id_dtype`).

    Requests: with the engine's :class:`~moetrace.batch.PassBatch` of the pass,
    each row also gets its request (an index into the hand-off's request table,
    ``request_ids``: the ids of this hand-off in first-seen order, so bounded by
    the chunk) and its position in that request; ``-1`` without a batch and for
    rows no request owns. The segment writer turns hand-off indices into the
    segment's own table (:class:`~moetrace.trace.segments.SegmentWriter`). Cost per
    pass: one dict lookup per request and a few ``[rows]`` numpy operations.
    """

    def __init__(self, config: RecorderConfig, layout: CounterLayout, submit: Submit, settle: Callable[[], None]) -> None:
        self.token_dtype = token_id_dtype(config.num_physical_experts)
        dtype = {np.int8: torch.int8, np.int16: torch.int16}.get(self.token_dtype.type, torch.int32)
        row = (config.num_layers, config.top_k)
        super().__init__(config, layout, submit, settle, (config.stream_chunk_tokens, *row), dtype)
        p = config.num_physical_experts
        # Stored id of counter column c (id c - 2, clamped at both ends): c - 2, except both invalid columns -> -2.
        self.lut = torch.arange(-2, p + 1, dtype=dtype, device=config.device)
        self.lut[0] = self.lut[p + 2] = -2
        chunk = config.stream_chunk_tokens
        self.token_rows = torch.zeros(chunk, dtype=torch.bool, device=config.device)
        # Two: released before their rows buffer, so one is free whenever a rows buffer is (as _ChunkTotals').
        self.token_rows_pool = HostBufferPool((chunk,), torch.bool, count=2, pin=config.device.type == "cuda")
        self.columns = _TokenColumns(chunk)
        self.positions = np.arange(chunk, dtype=np.int32)  # a pass's row positions, sliced: no array made per pass
        self.phase_passes = np.zeros(len(PASS_PHASES), dtype=np.int64)  # since the last hand-off
        self.phase_requests = np.zeros(len(PASS_PHASES), dtype=np.int64)
        self.request_table: dict[str, int] = {}  # request id -> index, this hand-off's requests
        self.passes = 0  # passes (with or without tokens) since the last hand-off
        self.first_pass = self.last_pass = -1

    def end_pass(self, counter: PassCounter, pass_id: int, timestamp: float, phase: int, requests: int, batch: PassBatch | None) -> None:
        """Move the pass's rows of the counter's stage into ``staging`` (each row's request from
        ``batch``; ``None``: rows of no known request)."""
        rows = counter.pass_rows
        if self.filled + rows > self.columns.chunk:
            self.flush()
        self.totals.add(counter.current, phase)
        if self.passes == 0:
            self.first_pass = pass_id
        self.passes += 1
        self.last_pass = pass_id
        self.phase_passes[phase] += 1
        self.phase_requests[phase] += max(requests, 0)
        if rows == 0:
            return
        columns = counter.stage[:, :rows].transpose(0, 1)  # [rows, L, k]
        torch.gather(self.lut.expand(*columns.shape[:2], -1), 2, columns, out=self.staging[self.filled : self.filled + rows])
        counter.rows_with_ids(self.token_rows[self.filled : self.filled + rows])
        span, staged = slice(self.filled, self.filled + rows), self.columns.staged
        staged[Data.TOKENS_PASS_ID][span] = pass_id
        staged[Data.TOKENS_POSITION][span] = self.positions[:rows]
        staged[Data.TOKENS_PASS_PHASE][span] = phase
        if batch is None:
            staged[Data.TOKENS_REQUEST][span] = -1
            staged[Data.TOKENS_REQUEST_POSITION][span] = -1
        else:
            table = self.request_table
            index = np.fromiter((table.setdefault(r, len(table)) for r in batch.request_ids), dtype=np.int64, count=len(batch.request_ids))
            staged[Data.TOKENS_REQUEST][span], staged[Data.TOKENS_REQUEST_POSITION][span] = batch.row_requests(index, rows)
        self.filled += rows

    def _staged_passes(self) -> int:
        return self.passes

    def _pass_span(self) -> tuple[int, int]:
        return self.first_pass, self.last_pass

    def _copy_out(self, host: torch.Tensor) -> tuple[Callable[[np.ndarray, int], StreamRows], Callable[[], None]]:
        n, passes = self.filled, self.passes
        token_rows = self.token_rows_pool.acquire(block=False)  # never waits: see __init__
        assert token_rows is not None
        token_rows[:n].copy_(self.token_rows[:n], non_blocking=True)
        columns, release_columns = self.columns.hand_off()
        phase_passes, phase_requests = self.phase_passes.copy(), self.phase_requests.copy()
        request_ids = tuple(self.request_table)
        first, last = self.first_pass, self.last_pass

        def build(by_phase: np.ndarray, dropped: int) -> StreamRows:
            ids, real = host[:n].numpy(), token_rows[:n].numpy()
            # Views of the host buffers when every row is a token: the writer is done with them before ``done`` releases them.
            rows = {Data.TOKENS_TOPK_IDS: ids, **{name: column[:n] for name, column in columns.items()}}
            if not real.all():
                rows = {name: array[real] for name, array in rows.items()}
            counts = np.stack([phase_passes, np.bincount(rows[Data.TOKENS_PASS_PHASE], minlength=len(PASS_PHASES)), phase_requests])
            return StreamRows(
                rows=rows,
                totals=by_phase.sum(axis=0),
                phase_totals=by_phase.copy(),
                phase_counts=counts.astype(np.int64),
                passes=passes,
                tokens=int(real.sum()),
                first_pass=first,
                last_pass=last,
                dropped_passes=dropped,
                request_ids=request_ids,
            )

        def release() -> None:
            release_columns()
            self.token_rows_pool.release(token_rows)

        return build, release

    def _forget(self) -> None:
        self.filled = self.passes = 0
        self.phase_passes[:] = self.phase_requests[:] = 0
        self.request_table = {}
